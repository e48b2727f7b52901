"""Runs recorded, replayed and driven: the record format, recording, replay, traces, the trace
runner, the engine loop (an engine in its own thread, publishing snapshots), traffic, the load
generator and attach."""
