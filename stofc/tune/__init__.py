"""stofc.tune"""
