"""The KV cache store: KV blocks (or erasure-coded fragments of blocks) by key, in host memory and on SSD.

`store.BlockStore` owns the tiers (`tiers.py`: host memory, one file per block on SSD), eviction by policy
(`mesh.eviction`: lru, s3fifo, lfuda, chain; `reuse.py`: reuse and admit, with `sketch.py`'s frequency sketch),
TTLs by traffic class and pins; `blocks.py` holds the values and events (the layout and checksum are the block
format every role shares: mesh.kv_blocks), `codec.py` the protobuf conversions. `server.py` serves the KVCache
contract, publishes every change on JetStream and runs the TTL sweep; `repair.py` rebuilds lost fragments on live
nodes from the global KV index, most valuable first.
"""
