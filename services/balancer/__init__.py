"""The balancer: picks the (prefill, decode) pair for each request from pools built out of NATS heartbeats.

The policies live in `mesh.routing` (shared with the simulator `kvmesh bench route`); `server.py` feeds them the
pools (WorkerRegistry), the global KV index (KVEventFollower over the KVMESH_KV stream) and peer replicas'
decisions, and publishes recommended pool sizes. docs/balancer.md has the design.
"""
