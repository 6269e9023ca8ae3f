"""KV beyond one engine: a connector that loads full KV blocks from outside the pool (by block hash) instead of
recomputing them, and saves the pool's blocks there. Stores: an LRU tier in host memory, Redis, a directory.

Pure Python (no torch): the scheduler decides which blocks, the model runner moves the tensors.
"""
