"""The engine core: the engine, the scheduler, the data of one step, requests,
configuration, clocks, the step budget and the finish-time forecast; the step record,
checkpoint and inbox messages; the scheduler's policies (`policies/`)."""
