"""miles.algorithms"""
