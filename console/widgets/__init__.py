"""Console panels, one per file; each renders only from an `EngineSnapshot`."""
