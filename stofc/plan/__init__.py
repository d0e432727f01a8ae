"""stofc.plan"""
