"""stofc.kernels"""
