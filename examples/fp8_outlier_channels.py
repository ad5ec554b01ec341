"""FP8 lesson, question 1: why DeepSeek-V3 scales FP8 activations per 1x128 tile.

0.1% of the channels carry values far larger than the rest (the outlier channels of
large language models). One scale for the whole tensor must fit the outliers under
e4m3's max (448), which pushes small ordinary values below e4m3's smallest subnormal
(2**-9): they flush to zero. A scale per 1x128 tile confines each outlier to its
own tile.

What the numbers show (and what the lesson glosses over): floating-point error is
relative, so while the ordinary values stay in e4m3's normal range their SQNR does
not move; the damage at ~100x is the *underflow* of the small ordinary values. The
SQNR collapses once the outliers are ~1e5x the ordinary values and the ordinary
values sink into subnormals as a whole.
"""

import torch

from floatguard.emulation import Block, Tensorwise, quant_metrics

TOKENS, CHANNELS = 512, 1024
RECIPES = [("tensorwise", Tensorwise("e4m3fn")), ("1x128 blocks", Block("e4m3fn", (1, 128)))]


def activations(
    ratio: float, spread_decades: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordinary values with magnitudes log-uniform over ``spread_decades`` decades (0: Gaussian),
    and 0.1% outlier channels ``ratio`` times larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, CHANNELS, generator=g)
    if spread_decades:
        x = x.sign() * 10 ** (
            torch.rand(TOKENS, CHANNELS, generator=g) * spread_decades - spread_decades
        )
    outliers = torch.randperm(CHANNELS, generator=g)[: max(1, CHANNELS // 1000)]
    x[:, outliers] *= ratio
    ordinary = torch.ones(CHANNELS, dtype=torch.bool)
    ordinary[outliers] = False
    return x, ordinary


for label, ratio, spread in [("100x, ordinary spread over 5 decades", 100.0, 5.0),
                             ("100x, Gaussian ordinary", 100.0, 0.0),
                             ("1e5x, Gaussian ordinary", 1e5, 0.0)]:  # fmt: skip
    x, ordinary = activations(ratio, spread)
    for name, recipe in RECIPES:
        q = recipe(x).values
        m = quant_metrics(x[:, ordinary], q[:, ordinary])
        print(f"{label} | {name} underflow %: {m['underflow_pct']:.2f}")
        print(f"{label} | {name} SQNR dB: {m['sqnr_db']:.1f}")
