"""``speculative="auto"`` across a call and across calls, on simulated machines (``test_auto_policy``'s): calls retired
to the plain loop, the share of time spent measuring options not chosen, what later calls start from, and a batch's
drafts rated at what its last row realized in earlier calls."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import pytest
from test_auto_policy import FixedChain, Machine, decode_batch, policy_for, run

from lightning_mtp.decoding.auto import (
    CALL_START_TRIES,
    EXPLORE_SHARE,
    NOTHING,
    AutoMemory,
    AutoPolicy,
    candidate_options,
)
from lightning_mtp.decoding.tree import TreeShape


def call_policy(memory: AutoMemory, rows: int = 1, max_new_tokens: int = 100, depth: int = 3) -> AutoPolicy:
    """A call's policy as the decoding loop makes it (its budget known: it may be retired)."""
    return AutoPolicy(memory, candidate_options(depth), rows, max_new_tokens=max_new_tokens)


# ------------------------------------------------------------------------------------- calls retired to the plain loop
def test_a_call_rated_plain_with_nothing_to_measure_is_retired():
    """Each drafting call costs 1.5 plain steps: a fixed chain of 1 emits 0.67 tokens/s against plain's 0.99. A first
    call measures every option and steps plainly after; the next call is rated plain at its start, every option is
    timed and the measuring share is spent: it is retired (the loop decodes plainly without the drafter), and its
    budget counts as decoded time."""
    memory, machine = AutoMemory.fresh(0.05), Machine(per_draft=1.5, accept=0.8)
    first = call_policy(memory)
    choices, _ = run(first, machine, 99)
    assert not first.retired and choices["plain"] > 0.85 * 99, choices
    probe = policy_for(memory=memory)  # no budget: never retired (to_measure takes a turn when it answers one)
    assert probe.best() is None and probe.to_measure(None) is NOTHING
    decoded = memory.decoded
    later = call_policy(memory)
    assert later.retired and memory.decoded == decoded + 99
    assert run(FixedChain(1), Machine(per_draft=1.5, accept=0.8), 100)[1] < 0.7 / machine.seconds(None)


def test_a_call_with_an_unmeasured_option_measures_it_before_it_retires():
    """The same machine, but the earlier call had chains of 1..2 only: a call that may draft a chain of 3 is rated
    plain (the chains it measured do not pay) yet that chain was never timed, and unmeasured it might pay. It is not
    retired: it drafts the chain of 3 four times (a catching-up step, then MIN_SAMPLES timed ones), then steps
    plainly; the call after it is retired."""
    memory, machine = AutoMemory.fresh(0.05), Machine(per_draft=1.5, accept=0.8)
    run(call_policy(memory, depth=2), machine, 99)
    policy = call_policy(memory, depth=3)
    assert policy.best() is None and not policy.retired
    steps = []
    for _ in range(12):
        option = policy.next()
        steps.append((option and option.describe(), policy.measuring))
        machine.step(policy, option)
    assert steps[:4] == [("chain3", True)] * 4, steps
    assert steps[-5:] == [(None, False)] * 5, steps  # plain by rating (one more chain measured in turn before)
    run(policy, machine, 99 - 12)
    assert call_policy(memory, depth=3).retired


# ----------------------------------------------------------------------------------------------- measuring
def measure_calls(machine: Machine, calls: int = 30, explore: bool = True) -> tuple[float, Counter, str]:
    """(share of the simulated time spent measuring options not chosen once every option was measured, those
    measurements by option, each call as C (decoded) or R (retired)) over ``calls`` calls of 100 tokens."""
    memory, total, measured, again, log = AutoMemory.fresh(0.05), 0.0, 0.0, Counter(), ""
    for _ in range(calls):
        policy = call_policy(memory)
        log += "R" if policy.retired else "C"
        if policy.retired:
            total += 99 * machine.seconds(None)
            continue
        for _ in range(99):
            timed = memory.cost.plain_timed and all(memory.cost.measured(d) for d in (1, 2, 3))
            option = policy.next()
            total += machine.seconds(option)
            if policy.measuring and timed:
                measured += machine.seconds(option)
                again[option.describe() if option else "plain"] += 1
            machine.step(policy, option)
    return measured / total, again, log


def test_measuring_options_not_chosen_stays_within_the_explore_share(switches):
    """30 calls of 100 tokens, once each option is measured: where drafting does not pay (a drafting call costs 1.5
    plain steps), calls are retired (17 of 30) and re-measuring the three chains, 6 to 8 times each, takes 2.8% of
    the time; where a chain of 3 pays, plain and the two shorter chains are re-measured 35 times each in 3.0% of the
    time. Both within EXPLORE_SHARE; without exploring, nothing is re-measured and every later call is retired."""
    for machine, options in ((Machine(per_draft=1.5, accept=0.8), ("chain1", "chain2", "chain3")),
                             (Machine(per_draft=0.1, accept=0.9), ("plain", "chain1", "chain2"))):
        share, again, log = measure_calls(machine)
        assert 0.5 * EXPLORE_SHARE < share <= EXPLORE_SHARE, (share, again)
        assert all(again[o] >= 5 for o in options), again  # every option not chosen is re-measured, in turn
    switches.explore = False
    share, again, log = measure_calls(Machine(per_draft=1.5, accept=0.8))
    assert share == 0 and not again and log == "C" + "R" * 29, (share, again, log)


# ----------------------------------------------------------------------------------------------- later calls
def test_later_calls_start_from_what_earlier_ones_learned():
    """After a call of 200 steps on a machine whose drafts are accepted 95% of the time and cheap, the next call
    starts from the costs and acceptance it learned (each acceptance at the call's own over all its steps, worth
    CALL_START_TRIES tries: a prompt differs from the last; depth 1 rated 0.85 against the prior's 0.6): it drafts a
    chain of 3 from its first steps, and its first 30 steps emit 2.7 tokens/s against a fresh call's 2.3 (which
    measures every option first)."""
    memory = AutoMemory.fresh(0.3)
    run(policy_for(share=0.3, memory=memory), Machine(per_draft=0.1, accept=0.95), 200)
    learned = {key: hits / tried for key, (hits, tried) in memory.this_call.items()}
    later = policy_for(share=0.3, memory=memory)
    for key, (hits, tried) in memory.acceptance.items():
        assert tried == pytest.approx(CALL_START_TRIES) and hits / tried == pytest.approx(learned[key])
    assert later.acceptance(1) > 0.8
    choices, rate = run(later, Machine(per_draft=0.1, accept=0.95, seed=5), 30)
    fresh_choices, fresh = run(policy_for(share=0.3), Machine(per_draft=0.1, accept=0.95, seed=5), 30)
    assert choices["chain3"] >= 28 and rate > 1.1 * fresh, (choices, rate, fresh_choices, fresh)


def test_a_call_after_one_whose_drafts_were_rejected_starts_from_the_typical_acceptance():
    """Calls start from the median of the last RECENT_CALLS calls' own acceptance, not from the last call's: after
    three calls whose drafts are accepted 90% of the time and one whose drafts are all rejected (a prompt the MTP
    modules do not know), on a machine where a drafting call costs half a plain step, the next call starts at
    depth-1 acceptance 0.77 and drafts chains of 2 and 3 from its first steps: 1.28 tokens/s over its first 30
    steps. Started from the last call's counts (0.46), it steps plainly all 30 steps (0.99 tokens/s)."""
    def after_a_hard_call(typical: bool) -> tuple[float, float]:
        memory = AutoMemory.fresh(0.5)
        for accept in (0.9, 0.9, 0.9, 0.0):
            run(policy_for(share=0.5, memory=memory), Machine(per_draft=0.5, accept=accept, seed=2), 120)
        if not typical:
            memory.recent, memory.this_call = {}, {}  # no earlier call remembered: the hard call's counts decide
        later = policy_for(share=0.5, memory=memory)
        return later.acceptance(1), run(later, Machine(per_draft=0.5, accept=0.9, seed=3), 30)[1]

    (start, rate), (hard_start, hard_rate) = after_a_hard_call(True), after_a_hard_call(False)
    assert start > 0.7 and hard_start < 0.5, (start, hard_start)
    assert rate > 1.2 * hard_rate, (rate, hard_rate)


# ----------------------------------------------------------------------------------------------- a batch's last row
def batch_calls(accept: list[float], calls: int = 6, budget: int = 96) -> tuple[list[float], list[int], AutoMemory]:
    """(simulated seconds of each call, chosen drafting steps of each, the memory) of ``calls`` calls of a batch whose
    row ``r`` accepts each depth with probability ``accept[r]``, on one memory (drafting calls cost 0.3 plain steps)."""
    memory, machine, times, drafted = AutoMemory.fresh(0.3), Machine(per_draft=0.3, seed=1), [], []
    for _ in range(calls):
        policy = call_policy(memory, rows=len(accept), max_new_tokens=budget)
        chosen = [0]
        if not policy.retired:
            choose = policy.next

            def counting(choose=choose, policy=policy, chosen=chosen) -> Optional[TreeShape]:
                option = choose()
                chosen[0] += option is not None and not policy.measuring
                return option

            policy.next = counting
        times.append(decode_batch(None if policy.retired else policy, machine, accept, budget))
        drafted.append(chosen[0])
    return times, drafted, memory


def test_a_batch_paced_by_a_row_that_rejects_drafts_decodes_plainly_after_a_call(switches):
    """Seven rows accept drafts 95% of the time, one never: the call ends when that row has emitted its 96 tokens one
    per step, so drafting only makes its steps dearer (plain: 102.6 s a call; a fixed chain of 3: 191.7 s). The first
    call starts rated on the shared estimate (no row's counts yet); its last row realizes 0.65 of the progress its
    first chosen drafts were rated at, and from then on drafts are rated by that share: the first call takes 1.07x
    plain's time (2 chosen drafting steps), the 5 later ones decode plainly from their start (one chosen drafting
    step in all; within 3.2% of plain, measuring included; every other one retired): 6 calls take 1.02x plain's time.
    Rated as the rows' counts say (``last_row`` off), every call drafts again at its start and then one step in 3 or
    4 as the row's counts fade (31 to 40 chosen drafting steps a call): 1.19x to 1.22x plain's time each."""
    accept = [0.95] * 7 + [0.0]
    plain = decode_batch(None, Machine(per_draft=0.3, seed=1), accept, 96)
    assert decode_batch(FixedChain(3), Machine(per_draft=0.3, seed=1), accept, 96) > 1.5 * plain
    times, drafted, memory = batch_calls(accept)
    realized, rated = memory.last_row
    assert (realized + 4) / (rated + 4) < 0.75, memory.last_row
    assert all(t < 1.04 * plain for t in times[1:]) and sum(drafted[1:]) <= 2, (times, drafted)
    switches.last_row = False
    unaware_times, unaware_drafted, _ = batch_calls(accept)
    assert all(t > 1.15 * plain for t in unaware_times) and min(unaware_drafted[1:]) > 10, unaware_times
    assert sum(times) < 0.9 * sum(unaware_times), (sum(times), sum(unaware_times), 6 * plain)


def test_a_batch_of_alike_rows_keeps_drafting(switches):
    """Eight rows that all accept drafts 95% of the time: the last row realizes what its drafts were rated at (the
    share is 0.96 after 6 calls), so the batch keeps drafting chains of 3: every call takes 0.60 to 0.62 of plain's
    time (a fixed chain of 3: 0.60), as with the last-row correction off (the same calls)."""
    accept = [0.95] * 8
    plain = decode_batch(None, Machine(per_draft=0.3, seed=1), accept, 96)
    chain = decode_batch(FixedChain(3), Machine(per_draft=0.3, seed=1), accept, 96)
    times, drafted, memory = batch_calls(accept)
    realized, rated = memory.last_row
    assert (realized + 4) / (rated + 4) > 0.9 and rated > 100, memory.last_row
    assert chain < 0.62 * plain and all(t < 0.65 * plain for t in times), (chain, plain, times)
    switches.last_row = False
    assert sum(times) < 1.02 * sum(batch_calls(accept)[0])


def test_a_single_rows_rating_ignores_the_last_row_share(switches):
    """At batch size 1 the row is the batch: its own acceptance is what the rating uses, so the last-row share is 1
    and nothing is accumulated: a memory whose last row realized a tenth of its rating changes no rate at batch 1
    (at batch 2 it divides the drafts' rates by about 7), and calls decode the same with the switch on or off."""
    memory = AutoMemory.fresh(0.3)
    memory.last_row = [10.0, 100.0]
    single, pair = policy_for(share=0.3, memory=memory), policy_for(share=0.3, rows=2, memory=memory)
    on = [single.rate(o) for o in single.options]
    assert pair.rate(TreeShape.chain(2)) < 0.2 * policy_for(share=0.3, rows=2).rate(TreeShape.chain(2))
    switches.last_row = False
    assert [single.rate(o) for o in single.options] == on

    def calls() -> tuple[list[float], list[float]]:
        memory, machine = AutoMemory.fresh(0.3), Machine(per_draft=0.3, seed=1)
        times = []
        for accept in (0.0, 0.95, 0.0, 0.95):
            policy = call_policy(memory, max_new_tokens=96)
            times.append(decode_batch(None if policy.retired else policy, machine, [accept], 96))
        return times, memory.last_row

    off, off_memory = calls()
    switches.last_row = True
    assert calls() == (off, off_memory) and off_memory == [0.0, 0.0]
