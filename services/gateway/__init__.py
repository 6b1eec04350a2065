"""The gateway: speaks OpenAI's Chat Completions, Completions and Responses, Anthropic's Messages (aiohttp)
and kvmesh's Gateway gRPC API, and drives each request through the mesh: route (balancer) -> prefill ->
decode stream, detokenizing as tokens arrive.

    config.py            GatewaySettings (KVMESH_*)
    auth.py              API keys, held as SHA-256 digests
    errors.py            GatewayError and the one mapping to HTTP statuses, OpenAI/Anthropic bodies, gRPC codes
    catalog.py           the models whose tokenizers the gateway holds: chat templates, context lengths
    api_models/          one pydantic model per request type: parsing, errors naming the field, the sampling
                         fields and their mapping to the wire (sampling.py), /openapi.json (document.py)
    schema_support.py    which JSON Schemas the grammar enforces (a 400 naming any other feature)
    tool_calls.py        tool-call formats (DeepSeek's tokens, Hermes): prompt, grammar, streaming parser
    chat.py              one chat turn for every API: prompt, grammar, n generations -> events
    detokenizer.py       incremental detokenization and stop strings
    mesh_view.py         what the heartbeats say: live balancers, served models, readiness
    mesh_workers.py      GET /v1/mesh/workers: pools, worker loads and recommended sizes from a balancer
    pipeline.py          one generation's life: route, prefill (with retries), decode stream
    telemetry.py         metrics and the one log line per finished request
    rest.py              what every REST API shares: API key, request ids, JSON body, error bodies, admission, SSE
    openai_shapes.py     OpenAI's shapes several APIs share: messages, stop, tool_choice, usage, SSE
    chat_completions.py  /v1/chat/completions: body -> ChatRequest, completions and chunks -> JSON
    completions.py       /v1/completions (legacy): prompt -> ChatTurn, text_completion objects
    responses_api.py     /v1/responses (+ response_store.py: stored responses in NATS JetStream KV)
    messages_api.py      /v1/messages: Anthropic's Messages API
    plain_routes.py      /v1/models, /openapi.json, /healthz, /readyz, /metrics
    http_app.py          builds the REST app: the route table
    listener.py          serves it, bounded: connections in all and per client, the first head's time
    grpc_api.py          the Gateway servicer; server.py wires them up
    rollout_api.py       /admin/v1/rollouts: canary rollouts (the golden prompts rendered here)
    quality_probe.py     each running rollout's quality probe: golden prompts, greedy, canary against stable
"""
