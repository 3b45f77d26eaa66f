"""``speculative="auto"``'s step prices: the cost model fitted across the calibrated options and pooled with each
option's own ratios (``lightning_mtp.decoding.step_prices``), against the known costs the samples were drawn from."""

from __future__ import annotations

import random
import statistics

import pytest

from lightning_mtp.decoding.auto import candidate_options
from lightning_mtp.decoding.calibration import RoundRobin
from lightning_mtp.decoding.step_prices import (
    MIN_POOLED_OPTIONS,
    POOL_WEIGHT,
    fit_step_costs,
    pooled_ratios,
    step_features,
)
from lightning_mtp.decoding.tree import TreeShape


def true_ratio(shape: TreeShape) -> float:
    """A step's cost in plain steps: verify tokens, module calls, their tree tokens and the tree path's overhead."""
    features = step_features(shape)
    return 1.0 + 0.15 + 0.04 * features[1] + 0.45 * features[2] + 0.01 * features[3] + 0.3 * features[4]


def noisy_samples(shapes: list[TreeShape], per_option: int, seed: int, spread: float = 0.25) -> dict:
    """Ratios with the machine's noise: mostly within ±spread/2, and now and then a burst (3x the spread)."""
    rng = random.Random(seed)
    samples = {}
    for shape in shapes:
        values = []
        for _ in range(per_option):
            noise = rng.uniform(-spread / 2, spread / 2)
            if rng.random() < 0.1:
                noise = rng.choice((-1, 1)) * 1.5 * spread
            values.append(true_ratio(shape) * (1 + noise))
        samples[shape.describe()] = values
    return samples


def test_step_features_count_verify_tokens_module_calls_their_tree_tokens_and_the_tree_path():
    assert step_features(TreeShape.chain(3)) == [1.0, 3.0, 3.0, 3.0, 0.0]  # depth 2 runs 1 node, depth 3 runs 2
    assert step_features(TreeShape(branching=(4, 2))) == [1.0, 12.0, 2.0, 4.0, 1.0]
    assert step_features(TreeShape(branching=(2, 2, 1))) == [1.0, 10.0, 3.0, 2.0 + 6.0, 1.0]
    dynamic = TreeShape(nodes=16, top_k=4, max_depth=3)
    assert step_features(dynamic) == [1.0, 16.0, 3.0, 4.0 + 8.0, 1.0]


def test_pooled_prices_are_closer_to_the_true_costs_than_each_options_own_median():
    """Two ratios per option, as the calibration's first rounds give, over 20 seeds: pooled prices err about half as
    much as the own medians on average (3.6% against 6.8% here) and a third less on the chains (4.4% against 6.6%:
    the tree term leaves the chains' intercept to the chains alone), and the chains' worst error is smaller. (A median
    regression still follows an extreme option, the widest tree, when its own samples are off.)"""
    shapes = [o for o in candidate_options(4, 3, True, True) if o is not None]
    keyed = {s.describe(): s for s in shapes}
    own_errors, pooled_errors, own_chains, pooled_chains = [], [], [], []
    for seed in range(20):
        samples = noisy_samples(shapes, 2, seed)
        prices = pooled_ratios(samples, keyed)
        for key, values in samples.items():
            truth = true_ratio(keyed[key])
            own, pooled = abs(statistics.median(values) / truth - 1), abs(prices[key] / truth - 1)
            own_errors.append(own)
            pooled_errors.append(pooled)
            if keyed[key].is_chain:
                own_chains.append(own)
                pooled_chains.append(pooled)
    assert statistics.mean(pooled_errors) < 0.6 * statistics.mean(own_errors)
    assert statistics.median(pooled_errors) < 0.05
    assert max(pooled_chains) < 0.75 * max(own_chains)
    assert statistics.mean(pooled_chains) < 0.75 * statistics.mean(own_chains)


def test_an_option_measured_often_keeps_its_own_price_and_a_lucky_one_is_pulled_to_the_fit():
    """Partial pooling: the fit counts as POOL_WEIGHT samples. An option whose many samples say it costs 20% more
    than the model predicts keeps most of that (the model is only linear); an option with two lucky samples 30%
    below is priced mostly by the fit."""
    shapes = [o for o in candidate_options(3, 3, True, True) if o is not None]
    keyed = {s.describe(): s for s in shapes}
    samples = {s.describe(): [true_ratio(s) * f for f in (0.98, 1.0, 1.02)] for s in shapes}
    chain2, chain3 = TreeShape.chain(2), TreeShape.chain(3)
    samples["chain3"] = [true_ratio(chain3) * 1.2] * 10
    samples["chain2"] = [true_ratio(chain2) * 0.7] * 2
    prices = pooled_ratios(samples, keyed)
    fitted3 = true_ratio(chain3)  # the median regression ignores the two deviating options
    assert prices["chain3"] == pytest.approx((10 * 1.2 * fitted3 + POOL_WEIGHT * fitted3) / (10 + POOL_WEIGHT),
                                             rel=0.02)
    assert prices["chain2"] == pytest.approx((2 * 0.7 + POOL_WEIGHT) / (2 + POOL_WEIGHT) * true_ratio(chain2),
                                             rel=0.02)
    for key in ("chain1", "tree[4, 2]", "tree[2, 1, 1]"):
        assert prices[key] == pytest.approx(true_ratio(keyed[key]), rel=0.02)


def test_too_few_options_keep_their_own_medians_and_chains_alone_can_be_fitted():
    chains = [TreeShape.chain(k) for k in range(1, MIN_POOLED_OPTIONS)]
    samples = noisy_samples(chains, 3, seed=1)
    keyed = {s.describe(): s for s in chains}
    assert fit_step_costs(samples, keyed) is None
    assert pooled_ratios(samples, keyed) == {key: statistics.median(v) for key, v in samples.items()}
    chains.append(TreeShape.chain(MIN_POOLED_OPTIONS))  # now enough; the terms are collinear for chains
    keyed = {s.describe(): s for s in chains}
    exact = {s.describe(): [true_ratio(s)] * 3 for s in chains}
    prices = pooled_ratios(exact, keyed)
    assert all(prices[k] == pytest.approx(true_ratio(keyed[k]), rel=1e-6) for k in prices)


def test_round_robin_prices_pool_its_ratios():
    """The calibration's prices (RoundRobin.prices, which auto stores) are the pooled ratios; the plain entry stays
    the steady plain steps' median seconds."""
    options = candidate_options(3, 3, True, True)
    robin = RoundRobin(options, rounds=2)
    robin.plain = [0.010, 0.011, 0.012]
    shapes = [o for o in options if o is not None]
    robin.ratios = noisy_samples(shapes, 2, seed=3)
    prices = robin.prices()
    assert prices["plain"] == pytest.approx(0.011)
    expected = pooled_ratios(robin.ratios, {s.describe(): s for s in shapes})
    assert {k: v for k, v in prices.items() if k != "plain"} == expected
    assert prices != robin.medians()
