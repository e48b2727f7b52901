"""The engine's statistics: per-request metrics (TTFT, ITL, TPOT, E2E, goodput against an
SLO) and the running figures the engine keeps after every step and finished request, which
replay rebuilds from the trace. The engine core imports these; they import nothing but
the core's request and config."""
