"""Paired step prices of ``speculative="auto"`` (greedy): which steps pair, what the fit of their ratios gives against
a direct reference, and that a policy misled by its calibration finds the cheaper option from decoding's own steps."""

from __future__ import annotations

import doctest
import itertools
import math
import statistics

import pytest
import torch

from lightning_mtp.decoding.auto import PROBE_EVERY, AutoMemory, AutoPolicy, StepCosts
from lightning_mtp.decoding.paired_prices import MAX_PAIRS, PRIOR_PAIRS, PairedPrices, StepPairs
from lightning_mtp.decoding.tree import TreeShape


def test_only_two_steady_steps_of_two_drafting_options_pair():
    pairs = StepPairs()
    steps = [("chain1", 1.0), ("chain1", 1.2), ("chain3", 9.0), ("chain3", 1.8)]
    assert [pairs.observe(*step) for step in steps] == [None, None, None, ("chain1", "chain3", 1.5)]
    assert pairs.observe("chain1", 5.0) is None  # the first step after a switch is not steady
    assert pairs.observe("chain1", 1.2) == ("chain3", "chain1", 1.2 / 1.8)
    for sequence in (["plain", "plain", "chain1", "chain1"], ["chain1", "chain1", "plain", "plain"],
                     ["chain1", "chain2", "chain2", "chain2"], ["chain1", "chain1", "chain2", "chain1"]):
        fresh = StepPairs()
        assert [fresh.observe(key, 1.0) for key in sequence][-1] is None, sequence


def reference_corrections(pairs: dict, calibrated: dict) -> dict:
    """The same objective minimised by gradient descent on the log corrections (an independent solver)."""
    keys = sorted({k for pair in pairs for k in pair})
    x = torch.zeros(len(keys), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([x], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14)

    def objective():
        optimizer.zero_grad()
        loss = PRIOR_PAIRS * (x ** 2).sum()
        for (a, b), values in pairs.items():
            median = statistics.median(values)
            i, j = keys.index(a), keys.index(b)
            gap = math.log(calibrated[b]) - math.log(calibrated[a])
            loss = loss + len(values) * (x[j] - x[i] + gap - median) ** 2
        loss.backward()
        return loss

    optimizer.step(objective)
    return {key: math.exp(float(v)) for key, v in zip(keys, x.detach())}


def test_the_fit_matches_a_direct_minimisation_and_leaves_plain_and_unpaired_options_alone():
    calibrated = {"plain": 0.01, "chain1": 0.013, "chain2": 0.016, "chain3": 0.018, "tree[2,1]": 0.02}
    prices = PairedPrices()
    generator = torch.Generator().manual_seed(0)
    truth = {"chain1": 0.0127, "chain2": 0.0144, "chain3": 0.0163}
    for a, b in itertools.permutations(truth, 2):
        for _ in range(int(torch.randint(1, 9, (1,), generator=generator))):
            noise = 1.0 + 0.05 * float(torch.randn(1, generator=generator))
            assert prices.add(a, b, truth[b] / truth[a] * noise)
    corrected = prices.apply(calibrated)
    assert corrected["plain"] == calibrated["plain"] and corrected["tree[2,1]"] == calibrated["tree[2,1]"]
    reference = reference_corrections(prices.pairs, calibrated)
    for key, factor in reference.items():
        assert corrected[key] / calibrated[key] == pytest.approx(factor, rel=1e-6)


def test_many_pairs_bring_the_relative_prices_to_the_measured_ones_and_bursts_are_not_kept():
    calibrated = {"plain": 1.0, "chain1": 1.29, "chain2": 1.57, "chain3": 1.78}
    truth = {"chain1": 1.27, "chain2": 1.44, "chain3": 1.63}  # measured inside decoding (the module docstring)
    prices = PairedPrices()
    for _ in range(MAX_PAIRS):
        for a, b in (("chain1", "chain2"), ("chain2", "chain3"), ("chain3", "chain1")):
            prices.add(a, b, truth[b] / truth[a])
    assert not prices.add("chain1", "chain3", 3.0) and not prices.add("chain1", "chain1", 1.0)
    prices.add("chain1", "chain3", 1.9)  # a burst within the bounds: the median ignores it
    corrected = prices.apply(calibrated)
    for a, b in itertools.combinations(truth, 2):
        assert corrected[b] / corrected[a] == pytest.approx(truth[b] / truth[a], rel=0.03)
    assert corrected["chain3"] / corrected["chain1"] < 0.97 * calibrated["chain3"] / calibrated["chain1"]
    assert len(prices.pairs[("chain1", "chain3")]) == MAX_PAIRS


def misled_policy(learn_prices: bool) -> AutoPolicy:
    """Calibrated so that the chain of 1 looks best (chains of 2 / 3 priced 1.75 / 2.1 plain steps), where steps
    inside decoding cost 1.2 / 1.4 / 1.6: with acceptance 0.8 per depth the chain of 3 is the fastest."""
    options = [None, TreeShape.chain(1), TreeShape.chain(2), TreeShape.chain(3)]
    costs = StepCosts({"plain": 1.0, "chain1": 1.2, "chain2": 1.75, "chain3": 2.1})
    memory = AutoMemory(costs=costs)
    memory.acceptance = {(d, 0): (80.0, 100.0) for d in (1, 2, 3)}
    return AutoPolicy(memory, options, learn_prices=learn_prices)


def decode_steps(policy: AutoPolicy, true_seconds: dict[str, float], steps: int) -> list[str]:
    """``steps`` choices of ``policy``, each step taking its option's ``true_seconds`` (acceptance held fixed)."""
    choices = []
    for _ in range(steps):
        option = policy.next()
        key = "plain" if option is None else option.describe()
        policy.observe_seconds(option, true_seconds[key])
        choices.append(key)
    return choices


@pytest.mark.parametrize("learn_prices", [True, False])
def test_a_policy_misled_by_its_calibration_finds_the_faster_chain_from_paired_steps(learn_prices):
    true_seconds = {"plain": 1.0, "chain1": 1.2, "chain2": 1.4, "chain3": 1.6}
    policy = misled_policy(learn_prices)
    choices = decode_steps(policy, true_seconds, 8 * PROBE_EVERY)
    late = choices[-4 * PROBE_EVERY:]
    if learn_prices:
        assert late.count("chain3") > 0.85 * len(late), late
        assert policy.memory.step_seconds["chain3"] == 2.1  # the calibration's prices are kept as measured
        assert policy.memory.prices()["plain"] == 1.0
    else:  # sampling calls: prices never move, the probe is taken once
        assert late.count("chain1") > 0.85 * len(late) and not policy.memory.paired.pairs


def test_the_module_example_holds():
    from lightning_mtp.decoding import paired_prices

    assert doctest.testmod(paired_prices).failed == 0


@pytest.mark.parametrize("runners", [2, 1])
def test_the_runners_up_are_probed_in_turn_so_a_third_option_priced_too_high_is_found(runners, monkeypatch):
    """Calibrated: chain of 2 best, chain of 1 the runner-up, chain of 3 third (priced 2.0 plain steps where it costs
    1.5); only probing the runners-up in turn pairs the chain of 3 (with one runner it is never tried)."""
    from lightning_mtp.decoding import auto

    monkeypatch.setattr(auto, "PROBED_RUNNERS", runners)
    options = [None, TreeShape.chain(1), TreeShape.chain(2), TreeShape.chain(3)]
    memory = AutoMemory(costs=StepCosts({"plain": 1.0, "chain1": 1.2, "chain2": 1.4, "chain3": 2.0}))
    memory.acceptance = {(d, 0): (80.0, 100.0) for d in (1, 2, 3)}
    policy = AutoPolicy(memory, options)
    true_seconds = {"plain": 1.0, "chain1": 1.2, "chain2": 1.4, "chain3": 1.5}
    choices = decode_steps(policy, true_seconds, 12 * PROBE_EVERY)
    late = choices[-4 * PROBE_EVERY:]
    if runners == 2:
        assert late.count("chain3") > 0.85 * len(late), late
    else:
        assert "chain3" not in choices and late.count("chain2") > 0.85 * len(late)
