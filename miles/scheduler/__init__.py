"""miles.scheduler"""
