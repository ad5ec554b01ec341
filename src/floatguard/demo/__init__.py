"""A tiny GPT and a synthetic task, for the demo and the benchmarks (no downloads)."""

from floatguard.demo.model import GPT, GPTConfig, synthetic_batch
from floatguard.demo.train import TINY, train_tiny

__all__ = ["GPT", "TINY", "GPTConfig", "synthetic_batch", "train_tiny"]
