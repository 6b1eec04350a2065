"""The vision encoder: images in, embeddings in the language model's hidden size out, cached by content hash.

`encoder.ImageEncoder` is the core (a vision transformer per model that takes images, an LRU cache of embeddings
bounded by bytes); `server.py` wires it to gRPC (Encoder.Encode), heartbeats and metrics.
"""
