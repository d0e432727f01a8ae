"""stofc.runtime"""
