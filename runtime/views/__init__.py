"""What a running engine shows: the snapshot the console draws (built from an engine by
`snapshot_of`, never by the engine itself) and the prefix tree's summary."""
