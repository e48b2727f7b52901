"""Model files: GGUF parsing, model facts, the registry, architectures, the decoder,
weight formats and offload."""
