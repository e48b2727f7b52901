"""Model files: GGUF parsing, model facts, the registry, and (later) architectures."""
