"""stofc.masks"""
