"""Scale-out in the simulator: many sim engines on one virtual clock behind a router
(`replicas.py`), disaggregated prefill and decode (`handoff.py`), what a router sees
(`view.py`), the routers themselves (`routers/`) and the fleet's report (`report.py`)."""
