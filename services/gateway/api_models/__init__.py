"""The gateway's request models: one pydantic model per request type, the single definition from which each
body is parsed and checked (errors naming the client's field), the sampling fields are mapped to the wire, and
/openapi.json is generated."""
