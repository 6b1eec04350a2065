"""Eviction policies: which block a cache gives up when it needs room (`policies.make_policy`). Shared by the KV
store's tiers (services.kvcache) and the workers' device prefix caches (engine_core.kv_cache), so pure Python
with no dependency beyond the standard library (a store node needs no torch, the engine no service)."""
