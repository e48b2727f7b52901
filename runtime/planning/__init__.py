"""Planning: the planner, hardware/model/workload profiles, the step-time model, the sweep,
calibration, the live plan and power."""
