"""stofc.frontend"""
