"""What the compute roles (prefill, decode) share: their settings, one engine per served model, the
conversions between protobuf and the engine's types, and the mapping of their errors to status codes."""
