"""KVIndex: which block hashes each prefill worker holds, followed from its KV event batches.

The balancer uses the mesh's shared global index (`mesh.kv_index.GlobalKVIndex`, which also knows tiers and
erasure-coded fragments for the KV store nodes); this name stays for the balancer's own code. Written only by the
balancer's KV-event subscription (`apply_*`, `check_seq`) and its registry's leave callback (`drop`); the Router
only reads it. The index may lag a worker's cache by a batch or miss one (a seq gap): that costs at most a cache
miss, never a failed request.
"""

from __future__ import annotations

from mesh.kv_index import GlobalKVIndex as KVIndex

__all__ = ["KVIndex"]
