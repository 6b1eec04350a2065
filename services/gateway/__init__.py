"""The gateway: speaks OpenAI's Chat Completions (aiohttp) and kvmesh's Gateway gRPC API, and drives each
request through the mesh: route (balancer) -> prefill -> decode stream, detokenizing as tokens arrive.

    config.py       GatewaySettings (KVMESH_*)
    auth.py         API keys, held as SHA-256 digests
    errors.py       GatewayError and the one mapping to HTTP statuses, OpenAI error bodies and gRPC codes
    catalog.py      the models whose tokenizers the gateway holds: chat templates, context lengths
    sampling.py     request fields -> the wire's SamplingParams, validated by the engine's rules
    openai_api.py   Chat Completions bodies -> ChatRequest; completions, chunks and errors -> JSON
    detokenizer.py  incremental detokenization and stop strings
    mesh_view.py    what the heartbeats say: live balancers, served models, readiness
    pipeline.py     one request's life: route, prefill (with retries), decode stream
    telemetry.py    metrics and the one log line per finished request
    http_app.py     the REST app; grpc_api.py the Gateway servicer; server.py wires them up
"""
