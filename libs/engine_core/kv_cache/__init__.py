"""The paged KV cache: block keys, the block pool, per-request block ownership, cache events."""
