"""miles.trainers"""
