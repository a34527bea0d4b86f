"""miles.actors"""
