"""The prefill role: computes prompts (reusing cached prefixes from its device cache and the KV store), samples
the first token, and pushes the KV to the decode worker the balancer chose.

    kvmesh serve prefill           (KVMESH_* settings: services.prefill.config.PrefillSettings)
"""
