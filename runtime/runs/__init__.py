"""Runs recorded, replayed and driven: the record format, recording, replay, traces, the trace
runner, traffic, the load generator and attach."""
