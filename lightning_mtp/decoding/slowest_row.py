"""A batch decodes until its slowest row is done: what a drafting option's tokens per step are worth to a batch.

With drafts, each row of a batch advances by its own number of tokens per step (1 + its accepted drafts), so rows
reach their budget at different steps and the batch steps until the last one does; a plain step advances every row
by exactly 1. A row needing ``N`` new tokens at a mean ``μ`` tokens per step (standard deviation ``σ``) takes about
``N / μ`` steps, with variance ``N σ² / μ³`` (renewal theory), and the batch takes the largest of ``B`` such counts:
about ``N / μ + c_B σ √N / μ^1.5``, where ``c_B`` is the expected maximum of ``B`` standard normals. Per step the batch
so gains ``μ`` tokens per row times

    efficiency = 1 / (1 + c_B σ / √(N μ))

(1 at batch 1 or without spread). Measured on the quickstart checkpoint at batch 8 with 96 new tokens per row, the
steps a per-row τ predicts were 0.84-0.97 of those the batch ran, with chains and trees of 1-2 drafts
(``benchmarks/results/quickstart_model``); this model gives 0.92-0.95 there. Rows whose prompts accept differently
(the model assumes one acceptance for all) add to the spread; ``auto.DRAFT_MARGIN`` covers what is left.

Example:
    >>> round(expected_maximum(8), 2)
    1.43
    >>> batch_efficiency(mean=2.0, variance=0.5, rows=1, new_tokens=96)
    1.0
    >>> round(batch_efficiency(mean=2.0, variance=0.5, rows=8, new_tokens=96), 3)
    0.932
"""

from __future__ import annotations

import math
from statistics import NormalDist

BLOM_ALPHA = 0.375
"""Blom's plotting position: E[max of B standard normals] ≈ Φ⁻¹((B - α) / (B - 2α + 1)), within 2% for
4 ≤ B ≤ 64 (4.5% high at B = 2)."""


def expected_maximum(rows: int) -> float:
    """The expected largest of ``rows`` independent standard normal draws (0 for one row)."""
    if rows <= 1:
        return 0.0
    return NormalDist().inv_cdf((rows - BLOM_ALPHA) / (rows - 2 * BLOM_ALPHA + 1))


def batch_efficiency(mean: float, variance: float, rows: int, new_tokens: int) -> float:
    """The fraction of its per-row tokens per step (``mean``, with ``variance`` between a step's rows) that a batch
    of ``rows`` rows, each decoding ``new_tokens`` tokens, gains per step until its slowest row is done."""
    if rows <= 1 or variance <= 0 or mean <= 0 or new_tokens <= 0:
        return 1.0
    return 1.0 / (1.0 + expected_maximum(rows) * math.sqrt(variance) / math.sqrt(new_tokens * mean))


def chain_moments(reach: list[float]) -> tuple[float, float]:
    """(mean, variance) of a step's tokens per row, 1 + L, where ``reach[d - 1]`` = P(L ≥ d) is the probability that
    the accepted path reaches depth d (so E[L] = Σ reach, E[L²] = Σ (2d - 1) reach).

    Example:
        >>> chain_moments([0.5])  # one draft, accepted half the time: 1 or 2 tokens
        (1.5, 0.25)
    """
    first = sum(reach)
    second = sum((2 * depth - 1) * p for depth, p in enumerate(reach, start=1))
    return 1.0 + first, max(0.0, second - first * first)


def equal_acceptance_moments(mean_tokens: float, depth: int) -> tuple[float, float]:
    """(mean, variance) of tokens per row for a draft of ``depth`` depths measured only by its mean (a dynamic tree):
    the moments of a chain whose depths all accept with the one probability p that gives that mean."""
    target = min(max(mean_tokens - 1.0, 0.0), float(depth))
    low, high = 0.0, 1.0
    for _ in range(40):  # Σ p^d grows with p: bisection
        p = (low + high) / 2
        if sum(p ** d for d in range(1, depth + 1)) < target:
            low = p
        else:
            high = p
    p = (low + high) / 2
    return 1.0 + target, chain_moments([p ** d for d in range(1, depth + 1)])[1]
