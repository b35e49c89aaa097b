"""The benchmarks, `python -m jaxcb.bench NAME` (one module each in commands/), and their
building blocks: models, workloads, peer systems, clients, reports, plots.

Nothing in the engine imports this package; these modules may import torch and transformers.
"""
