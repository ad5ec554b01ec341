"""A tiny GPT and a synthetic task, for the demo and the benchmarks (no downloads)."""

from floatguard.demo.model import GPT, GPTConfig, synthetic_batch

__all__ = ["GPT", "GPTConfig", "synthetic_batch"]
