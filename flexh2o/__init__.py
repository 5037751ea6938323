"""flexh2o: high-throughput offloading inference (FlexGen) with H2O heavy-hitter KV-cache eviction."""
