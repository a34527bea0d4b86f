"""miles.engines"""
