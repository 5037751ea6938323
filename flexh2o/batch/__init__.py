"""Batch jobs over requests: stopping rules, per-row sampling, results streamed to a JSONL file, resume."""
