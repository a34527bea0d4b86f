"""miles.models"""
