"""What every kvmesh service shares: config, logging, metrics, the NATS bus, gRPC helpers, discovery,
graceful shutdown, and the generated protobuf code (`mesh.pb`)."""
