"""The batch discount of ``auto`` (lightning_mtp.decoding.slowest_row) against a simulation of rows that accept drafts
independently, each stepping until the batch's slowest row has its budget."""

import doctest
import random

import pytest

from lightning_mtp.decoding import slowest_row
from lightning_mtp.decoding.slowest_row import (
    batch_efficiency,
    chain_moments,
    equal_acceptance_moments,
    expected_maximum,
)


def simulated_efficiency(acceptance: list[float], rows: int, new_tokens: int, trials: int, seed: int) -> float:
    """(per-row steps a mean τ predicts) / (mean steps until the slowest of ``rows`` rows has ``new_tokens``), rows
    accepting depth d with probability ``acceptance[d - 1]`` given depth d - 1 was accepted."""
    rng = random.Random(seed)
    reach, path = [], 1.0
    for p in acceptance:
        path *= p
        reach.append(path)
    mean = 1 + sum(reach)
    total = 0
    for _ in range(trials):
        slowest = 0
        for _ in range(rows):
            tokens = steps = 0
            while tokens < new_tokens:
                accepted = 0
                for p in acceptance:
                    if rng.random() >= p:
                        break
                    accepted += 1
                tokens += 1 + accepted
                steps += 1
            slowest = max(slowest, steps)
        total += slowest
    return (new_tokens / mean) / (total / trials)


@pytest.mark.parametrize("acceptance,rows,new_tokens", [
    ([0.73], 8, 96),
    ([0.7, 0.7], 8, 96),
    ([0.7, 0.7], 32, 96),
    ([0.8, 0.75, 0.75], 8, 512),
    ([0.5], 4, 32),
])
def test_the_batch_discount_matches_a_simulated_batch(acceptance, rows, new_tokens):
    reach, path = [], 1.0
    for p in acceptance:
        path *= p
        reach.append(path)
    mean, variance = chain_moments(reach)
    model = batch_efficiency(mean, variance, rows, new_tokens)
    simulated = simulated_efficiency(acceptance, rows, new_tokens, trials=600, seed=rows + new_tokens)
    assert model < 1.0
    assert model == pytest.approx(simulated, abs=0.025), (model, simulated)


def test_moments_and_limits():
    mean, variance = chain_moments([0.8, 0.4])  # L = 0, 1, 2 with probabilities 0.2, 0.4, 0.4
    assert mean == pytest.approx(1 + 0.4 + 0.8)
    assert variance == pytest.approx(0.4 * 1 + 0.4 * 4 - 1.2 ** 2)
    assert batch_efficiency(2.0, 1.0, rows=1, new_tokens=64) == 1.0
    assert batch_efficiency(1.0, 0.0, rows=64, new_tokens=64) == 1.0  # plain steps: every row advances by 1
    assert batch_efficiency(2.0, 1.0, 8, 64) < batch_efficiency(2.0, 1.0, 8, 1024) < 1.0  # more tokens: less spread
    assert batch_efficiency(2.0, 1.0, 32, 64) < batch_efficiency(2.0, 1.0, 8, 64)
    assert expected_maximum(2) == pytest.approx(1 / 3.141592653589793 ** 0.5, rel=0.05)  # 1/√π (Blom: 4.5% high)
    assert expected_maximum(1) == 0.0
    mean, variance = equal_acceptance_moments(1 + 0.6 + 0.36, depth=2)  # a chain accepting 0.6 at each depth
    assert mean == pytest.approx(1.96)
    assert variance == pytest.approx(chain_moments([0.6, 0.36])[1], rel=1e-6)


def test_docstring_examples():
    assert doctest.testmod(slowest_row).failed == 0
