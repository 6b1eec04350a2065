"""The KV cache store: full KV blocks by key in host memory, shared by every prefill worker.

`store.HostBlockStore` owns the blocks (LRU within a byte capacity); `server.py` serves the KVCache contract,
publishes the store's changes as KV events on NATS and exports its metrics.
"""
