"""Evaluations run through the engine: perplexity (perplexity.py)."""
