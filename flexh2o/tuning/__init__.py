"""Tuning tools that need the engine: hardware profiles, the profiler, the cost model, the policy search."""
