"""The engine core: the engine and its loop, the scheduler, the data of one step, requests,
configuration, clocks, the step budget and the finish-time forecast."""
