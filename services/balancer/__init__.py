"""The balancer: picks the (prefill, decode) pair for each request from pools built out of NATS heartbeats.

`router.Router` is the pure picking logic; `kv_index.KVIndex` follows every prefill worker's KV events so the
prefill pick can credit cached prefixes; `server.py` wires both to the WorkerRegistry, NATS and gRPC.
"""
