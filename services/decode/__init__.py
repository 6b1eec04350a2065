"""The decode role: takes requests whose KV prefill pushed into its continuous batch and streams their tokens.

kvmesh serve decode            (KVMESH_* settings: services.decode.config.DecodeSettings)
"""
