"""flexh2o: high-throughput offloading inference (FlexGen) with H2O heavy-hitter KV-cache eviction."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    """`from flexh2o import LLM, SamplingParams` (flexh2o/api.py), imported on first use."""
    if name in __all__:
        from flexh2o import api
        return getattr(api, name)
    raise AttributeError(f"module 'flexh2o' has no attribute {name!r}")
