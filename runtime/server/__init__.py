"""The OpenAI-compatible HTTP API and Prometheus metrics over an engine."""
