"""Pipeline plans: stage partition of a captured step, schedules, runtime and cost."""
