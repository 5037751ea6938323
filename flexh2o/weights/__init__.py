"""Weights: dummy initialisation, the converted on-disk checkpoint format, and conversion from HF/GGUF."""
