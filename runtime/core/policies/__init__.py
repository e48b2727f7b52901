"""The scheduler's policies, one file each: the queue order, preemption, admission (what can
never fit, deadline forecasts), the adaptive draft length and how prompts share a step's
budget. `core/scheduler.py` plans and applies iterations with them."""
