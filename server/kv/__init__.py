"""Paged KV bookkeeping shared by the target (engine) and the drafters (speculators): block allocation
with prefix caching (block_manager.py, no torch) and the cache tensors' layout and size (kv_cache.py)."""
