"""stofc.package"""
