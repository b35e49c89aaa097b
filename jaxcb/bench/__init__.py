"""Benchmark building blocks shared by scripts/bench_*.py: models, workloads, peer systems.

Nothing here is imported by the engine; these modules may import torch and transformers.
"""
