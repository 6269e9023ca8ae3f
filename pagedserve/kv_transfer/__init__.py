"""KV beyond one engine: a connector that loads full KV blocks from outside the pool (by block hash) instead of
recomputing them, and saves the pool's blocks there. Stores: an LRU tier in host memory, Redis, a directory.

The scheduler decides which blocks; block_io.py (the only module here that uses torch) moves them in and out of
the cache tensors.
"""
