"""Before a run: the memory plan, hardware profiles, the cost model and the policy search."""
