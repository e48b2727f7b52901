"""The scheduler's policies, one file each: the queue order, preemption, admission (what can
never fit, deadline forecasts) and the adaptive draft length. `core/scheduler.py` plans and
applies iterations with them."""
