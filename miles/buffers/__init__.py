"""miles.buffers"""
