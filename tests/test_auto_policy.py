"""``speculative="auto"``: the step-cost model, the acceptance estimates, the choice, the guard and the memory across
calls, on simulated machines whose step costs and acceptance are known; and on a real model, that a
call starting plainly never touches the drafter and a seed reproduces sampled output. (Lossless decoding with
``auto``, where drafts are accepted, is checked in ``test_tree_decoding``.)"""

from __future__ import annotations

import random
from collections import Counter
from typing import Optional

import pytest
import torch
from test_decoding import alone, draftable_model, ragged_prompts, rows_of
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mtp.decoding import GenerationConfig
from lightning_mtp.decoding.auto import (
    HOLD_STEPS,
    RECHECK_EVERY,
    SWITCHES,
    AutoMemory,
    AutoPolicy,
    candidate_options,
    measured_rate,
)
from lightning_mtp.decoding.step_cost import TOKEN_SHARE, StepCost
from lightning_mtp.decoding.tree import TreeShape


@pytest.fixture(scope="module")
def models():
    return {"cascaded": draftable_model("cascaded")}


class Machine:
    """A simulated decoding host: a step costs ``fixed + per_token · rows · tokens + per_draft · drafts`` seconds
    (plus ``overhead`` when it drafts), and each depth of a chain is accepted with probability ``accept`` given the
    depth above was (a static tree's depth of ``b`` candidates: ``1 - (1 - accept)^b``)."""

    def __init__(self, fixed=1.0, per_token=0.01, per_draft=0.2, accept=0.8, rows=1, seed=0, overhead=0.0):
        self.fixed, self.per_token, self.per_draft, self.accept, self.rows = fixed, per_token, per_draft, accept, rows
        self.overhead, self.slow = overhead, 1.0  # slow: every step takes this many times longer
        self.rng = random.Random(seed)

    def seconds(self, option: Optional[TreeShape]) -> float:
        tokens = 1 if option is None else option.num_nodes + 1
        drafting = 0.0 if option is None else self.overhead + self.per_draft * option.depth
        return self.slow * (self.fixed + self.per_token * self.rows * tokens + drafting)

    def step(self, policy: AutoPolicy, option: Optional[TreeShape]) -> float:
        """Run one step of ``option`` and report it to ``policy``; returns the tokens per row it gained."""
        seconds = self.seconds(option)
        reached, rows = [], self.rows
        for branch in () if option is None else option.branching:
            chance = 1 - (1 - self.accept) ** branch
            rows = sum(self.rng.random() < chance for _ in range(rows))
            reached.append(rows)
        policy.observe(option, self.rows, reached, seconds)
        return 1.0 + sum(reached) / self.rows


def run(policy: AutoPolicy, machine: Machine, steps: int) -> tuple[Counter, float]:
    """(choices by name, measured tokens per second) of ``steps`` steps."""
    choices, tokens, seconds = Counter(), 0.0, 0.0
    for _ in range(steps):
        option = policy.next()
        choices[option.describe() if option else "plain"] += 1
        tokens += machine.rows * machine.step(policy, option)
        seconds += machine.seconds(option)
    return choices, tokens / seconds


def policy_for(share: float = 0.2, depth: int = 3, rows: int = 1, memory: Optional[AutoMemory] = None,
               options: Optional[list] = None) -> AutoPolicy:
    return AutoPolicy(memory or AutoMemory.fresh(share), options or candidate_options(depth), rows)


@pytest.fixture
def switches():
    """The mechanisms' switches, restored after the test."""
    saved = dict(vars(SWITCHES))
    yield SWITCHES
    vars(SWITCHES).update(saved)


# ----------------------------------------------------------------------------------------------- the cost model
def test_the_cost_model_learns_the_machines_step_costs():
    cost = StepCost(draft_share=0.05)  # the prior: drafting is cheap
    machine = Machine(fixed=0.010, per_token=0.0005, per_draft=0.006)
    shapes = [(1, 1, 0), (1, 2, 1), (1, 4, 3), (1, 3, 2), (1, 1, 0), (1, 3, 1)]
    for i in range(10):
        for rows, tokens, drafts in shapes:
            seconds = machine.fixed + machine.per_token * rows * tokens + machine.per_draft * drafts
            cost.observe(rows, tokens, drafts, seconds * (5.0 if i == 0 else 1.0))  # the first round: outliers
    plain, overhead, per_depth, per_node = cost.parameters()
    # medians: the outliers are ignored; a chain's depth costs a drafting call and a verified token; no overhead
    assert plain == pytest.approx(0.0105) and per_depth == pytest.approx(0.0065, rel=0.02)
    assert overhead == pytest.approx(0.0, abs=2e-4)
    assert cost.seconds(1, 4, 3) == pytest.approx(machine.fixed + machine.per_token * 4 + machine.per_draft * 3,
                                                  rel=0.02)


def test_drafts_measured_while_the_machine_was_slow_are_not_priced_dear_after(switches):
    """Another process slows the machine by half for 40 steps while ``auto`` drafts; then it recovers. Its plain rate
    was measured before, and plain steps, taken rarely while drafting pays, stay that fast: learned as measured, the
    drafts are priced half as dear again as they are and the call steps plainly for most of the 300 steps after (a
    draft is measured once in 32 of them). Learned over the machine's speed at the time, it goes on drafting."""
    def after_a_slow_spell() -> tuple[Counter, float]:
        machine, policy = Machine(per_draft=0.3, accept=0.6, seed=3), policy_for()
        run(policy, machine, 300)
        machine.slow = 1.5
        run(policy, machine, 40)
        machine.slow = 1.0
        return run(policy, machine, 300)

    choices, rate = after_a_slow_spell()
    steady = run(policy_for(), Machine(per_draft=0.3, accept=0.6, seed=3), 640)[1]
    switches.speed = False
    unaware_choices, unaware = after_a_slow_spell()
    assert choices["plain"] <= 15 and rate > 0.97 * steady, (choices, rate, steady)
    assert unaware_choices["plain"] > 150 and unaware < 0.9 * rate, (unaware_choices, unaware)


def test_one_slow_step_does_not_decide():
    """A step that measured new matrix-product shapes (or lost its thread) takes many times its cost: a median of
    fewer than three steps would be that step, so a kind's median counts from three steps on, rates are mean tokens
    over the median time, and a step reported without a time of its own (nan) is not learned from."""
    cost = StepCost(draft_share=0.2)
    for _ in range(5):
        cost.observe(1, 1, 0, 0.010)
    cost.observe(1, 3, 2, 0.500)
    assert cost.parameters()[2] == pytest.approx((0.2 + TOKEN_SHARE) * 0.010)  # the prior, in seconds
    cost.observe(1, 3, 2, 0.016)
    cost.observe(1, 3, 2, 0.016)
    assert cost.parameters()[1:3] == pytest.approx((0.0, 0.003))  # median 0.016: 0.006 over two depths
    assert measured_rate([(1.0, 0.010)] * 15 + [(1.0, 1.0)]) == pytest.approx(100.0)
    policy, chain = policy_for(), TreeShape.chain(2)
    for option in (None, chain):  # the call's first step and the first draft after it are never timed
        policy.next()
        policy.observe(option, 1, [] if option is None else [1, 0], 0.010)
    timed, tried = policy.memory.cost.timed, policy.memory.acceptance[(1, "chain")][1]
    policy.next()
    policy.observe(chain, 1, [1, 0], float("nan"))
    assert policy.memory.cost.timed == timed  # not timed, but its acceptance counts
    assert policy.memory.acceptance[(1, "chain")][1] > tried
    policy.next()
    policy.observe(chain, 1, [1, 0], 0.020)
    assert policy.memory.cost.timed == timed + 1


def test_the_prior_prices_a_drafting_call_by_the_weights_bytes(models):
    from lightning_mtp.decoding.step_cost import draft_cost_share, parameter_bytes

    model = models["cascaded"]
    share = draft_cost_share(model)
    module = parameter_bytes(model.mtp_modules) / len(model.mtp_modules)
    head, total = parameter_bytes(model.mtp_output_head()), parameter_bytes(model)
    assert share == pytest.approx(min(1.0, (module + head) / (total - parameter_bytes(model.mtp_modules))))
    assert 0 < share <= 1


# ----------------------------------------------------------------------------------------------- choosing
def test_plain_steps_win_when_drafts_are_never_accepted():
    choices, _ = run(policy_for(), Machine(accept=0.0), 200)
    assert choices["plain"] > 0.85 * 200, choices  # drafting only until the acceptance estimates learn


def test_deep_chains_when_drafts_are_accepted_and_cheap():
    choices, rate = run(policy_for(share=0.2), Machine(per_draft=0.1, accept=0.95), 200)
    assert choices.most_common(1)[0][0] == "chain3", choices
    assert rate > 2.0  # about 3.8 tokens per 1.3-second step against a plain step's 1 per second


def test_the_choice_follows_the_machines_costs_not_the_prior():
    """The prior believes drafting is cheap; the machine's drafting calls cost 1.5 plain steps each: the fit learns it
    and the policy steps plainly (a chain of 1 would give 1.8 tokens for 2.5 seconds)."""
    choices, rate = run(policy_for(share=0.05), Machine(per_draft=1.5, accept=0.8), 300)
    assert choices["plain"] > 0.8 * 300, choices
    # plain: 0.99; what it pays for is finding out: the first drafts, and measuring each chain in turn every
    # MEASURE_EVERY plain steps (here a chain of 3 costs 5.5 plain steps)
    assert rate > 0.85


def test_a_deep_chain_is_found_where_drafting_has_a_fixed_overhead():
    """Any drafting step costs a fixed overhead of one plain step, each depth only 0.1 more: a chain of 1 loses to
    plain (1.9 tokens for 2.1 seconds) while a chain of 3 wins (3.4 tokens for 2.3 seconds). Measuring only the
    chain it rates best, and pricing every depth alike, the policy would never try the deep chain; it measures the
    chains in turn and fits the overhead."""
    choices, rate = run(policy_for(share=0.05), Machine(per_draft=0.1, overhead=1.0, accept=0.9), 400)
    assert choices.most_common(1)[0][0] == "chain3", choices
    assert rate > 1.3  # the chain of 3: 1.50 tokens per second; plain 0.99


def test_a_named_tree_is_drafted_only_where_its_verify_cost_pays():
    """A call naming a tree decides between plain steps and that tree. Cheap verify token-rows: the tree (its
    depth of two candidates is accepted 84% of the time); dear ones (a compute-bound step): plain."""
    tree = TreeShape(branching=(2, 1))
    cheap, _ = run(policy_for(options=[None, tree]), Machine(per_token=0.01, per_draft=0.1, accept=0.6), 300)
    dear, _ = run(policy_for(options=[None, tree]), Machine(per_token=0.6, per_draft=0.1, accept=0.6), 300)
    assert cheap.most_common(1)[0][0] == tree.describe(), cheap
    assert dear.most_common(1)[0][0] == "plain", dear


# ----------------------------------------------------------------------------------------------- a batch's rows
class FixedChain:
    def __init__(self, depth: int) -> None:
        self.chain = TreeShape.chain(depth)

    def next(self) -> TreeShape:
        return self.chain

    def observe(self, *args, **kwargs) -> None:
        """Nothing to learn."""


def decode_batch(policy: Optional[AutoPolicy], machine: Machine, accept: list[float], budget: int) -> float:
    """Seconds until every row of a simulated batch has emitted ``budget`` tokens, row ``r`` accepting each depth with
    probability ``accept[r]``; ``policy=None``: plain steps."""
    remaining, total = {r: budget - 1 for r in range(len(accept))}, 0.0  # the prefill emitted one token per row
    while remaining:
        option = None if policy is None else policy.next()
        machine.rows = len(remaining)
        total += machine.seconds(option)
        accepted, reached = [-1] * len(accept), [0] * (0 if option is None else option.depth)
        for row in list(remaining):
            count = 0
            while option is not None and count < option.depth and machine.rng.random() < accept[row]:
                count += 1
            for depth in range(count):
                reached[depth] += 1
            remaining[row] -= count + 1
            if remaining[row] <= 0:
                del remaining[row]
            else:
                accepted[row] = count
        if policy is not None:
            left = [remaining.get(r, 0) for r in range(len(accept))]
            policy.observe(option, machine.rows, reached, machine.seconds(option), rows=accepted, remaining=left)
    return total


def test_a_batch_is_rated_by_the_row_that_ends_last(switches):
    """Seven rows whose drafts are accepted and one whose drafts never are: the call ends when that row has emitted
    its budget one token per step, whatever the others do, so drafting only makes its steps dearer. Rated by each
    row's own acceptance and the row with the most steps left, ``auto`` steps plainly; rated by the pooled acceptance
    (87%: 7 of 8 rows) it kept drafting."""
    accept, budget = [0.95] * 7 + [0.0], 96
    machine = Machine(per_draft=0.3, seed=1)
    plain = decode_batch(None, machine, accept, budget)
    chain = decode_batch(FixedChain(3), machine, accept, budget)
    rated_by_rows = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    switches.rows = False  # rated by the acceptance pooled over the rows
    pooled = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    assert chain > 1.5 * plain  # a fixed chain of 3: 95 steps of 1.9 seconds against 95 of 1 (and a token-row each)
    assert rated_by_rows < 1.15 * plain < pooled, (rated_by_rows, plain, pooled)


def test_a_rows_counts_fade_while_it_steps_plainly():
    """A row whose drafts were rejected is rated below the shared estimate; while the batch steps plainly it gathers
    no evidence, so its counts fade with every step and its rating returns towards the shared one (a measurement
    then finds out whether it still rejects)."""
    policy, chain = policy_for(rows=2), TreeShape.chain(1)
    for _ in range(20):  # row 0 accepts, row 1 rejects
        policy.observe(chain, 2, [1], 0.01, rows=[1, 0], remaining=[50, 50])
    shared = policy.acceptance(1)
    low = policy.expected_tokens(chain, 1) - 1
    for _ in range(64):
        policy.observe(None, 2, [], 0.01, rows=[0, 0], remaining=[50, 50])
    faded = policy.expected_tokens(chain, 1) - 1
    assert low < 0.15 and shared > 0.45  # 20 rejections against the pooled half
    assert faded - low > 0.3 * (shared - low)  # 64 plain steps keep 0.98^64 = 27% of the row's counts


def test_the_guard_measures_a_batch_by_the_progress_of_its_last_row(switches):
    """Rated by the pooled acceptance, a batch whose one row never accepts drafts keeps drafting, and the tokens the
    other rows' drafts emit (3.4 per row and step, pooled) make drafting measure faster than plain. The call ends
    when that row has emitted its budget one token per step, so the guard measures a step by how far it brought the
    row with the most tokens left: drafting measures slower, and it holds the call plain."""
    accept, budget = [0.95] * 7 + [0.0], 192
    switches.rows = False  # rated by the acceptance pooled over the rows
    machine = Machine(per_draft=0.3, seed=4)
    plain = decode_batch(None, machine, accept, budget)
    policy = policy_for(share=0.3, rows=8)
    guarded = decode_batch(policy, machine, accept, budget)
    switches.guard = False
    unguarded = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    assert unguarded > 1.5 * plain  # drafting all along: 191 steps of 2.2 seconds against 1.1
    # (the pooled measure held too, twice, but drafted 1.42 times as long as plain)
    assert policy.holds >= 1 and guarded < 1.3 * plain, (policy.holds, guarded, plain)


def test_a_batch_of_rows_that_accept_drafts_draws_deep_chains():
    accept, budget = [0.95] * 8, 96
    machine = Machine(per_draft=0.3, seed=2)
    plain = decode_batch(None, machine, accept, budget)
    auto = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    assert auto < plain / 1.5, (auto, plain)  # a chain of 3 emits ~3.8 tokens per 1.9-second step


# ----------------------------------------------------------------------------------------------- the guard
def test_the_guard_holds_plain_when_drafting_measures_slower(switches):
    """Without the fit (the prior alone says drafting pays), the measured rates decide: drafting is three plain steps
    dear, and the guard holds the call plain for HOLD_STEPS, then twice as long."""
    switches.fit = False
    machine = Machine(per_draft=3.0, accept=0.8)
    policy = policy_for(share=0.05)
    choices, rate = run(policy, machine, 200)
    assert choices["plain"] > 0.6 * 200 and policy.holds >= 2, choices
    switches.guard = False
    unguarded_choices, unguarded = run(policy_for(share=0.05), machine, 200)
    assert rate > 1.3 * unguarded and unguarded_choices["plain"] < 0.2 * 200


def test_calls_whose_drafting_measured_slower_retire_the_next_ones_twice_as_many_each_time(switches):
    """Drafting is three plain steps dear and the prior says it pays: the guard held the call plain, and the call went
    on to end drafting. Its drafting steps measured slower than its plain ones over the call, so the next call starts
    plainly all the same, whatever the rating says, and decodes plainly to its end. Each further call that decides
    afresh and measures the same retires twice as many, at most RECHECK_EVERY - 1: one wrong verdict (a hard prompt)
    costs one call."""
    switches.fit = False
    memory = AutoMemory.fresh(0.05)
    machine = Machine(per_draft=3.0, accept=0.8)
    policy = policy_for(share=0.05, memory=memory)
    while policy.holds == 0:  # until the guard holds the call plain
        machine.step(policy, policy.next())
    while policy.hold > 0 or policy.check is not None or memory.last_plain:  # then until it drafts again
        machine.step(policy, policy.next())
    policy.end_call()
    retired = []
    while len(retired) < 24:
        later = policy_for(memory=memory)
        assert later._best()[0] > later._rate(None)  # the rating alone would draft
        retired.append(later.retired)
        if not later.retired:  # it decides afresh, and its drafting measures slower again
            run(later, machine, 200)
        later.end_call()  # a call that started plainly ran no step of the policy
    expected = [True, False, True, True, False] + [True] * 4 + [False] + ([True] * (RECHECK_EVERY - 1) + [False]) * 2
    assert retired == expected[:24]


def test_a_call_whose_drafting_measured_slower_only_for_a_spell_retires_nothing():
    """A spell in which each drafting call costs twenty times as much makes the guard hold the call plain; over the
    whole call drafting still measured faster than its plain steps, so the next call decides afresh (retiring on any
    hold, one noisy window of a batch's slowest row would retire calls where drafting pays)."""
    memory = AutoMemory.fresh(0.2)
    machine, policy = Machine(per_draft=0.1, accept=0.9), policy_for(memory=memory)
    run(policy, machine, 100)
    machine.per_draft = 2.0
    while policy.holds == 0:
        machine.step(policy, policy.next())
    machine.per_draft = 0.1
    run(policy, machine, 300)
    policy.end_call()
    assert memory.ended_plain is None and not policy_for(memory=memory).retired


def test_a_call_whose_drafting_measured_slower_with_its_catching_up_retires_the_next():
    """Each return to drafting after plain steps catches the MTP modules up on the tokens they missed, in a step the
    cost model and the guard do not time (it is not the draft's own cost): each timed draft measured twice as fast as
    a plain step and the guard never held, yet over the call, drafting in short stretches emitted 0.92 tokens a second
    against plain's 1. The call's sums count every step, so the next call starts plainly."""
    memory = AutoMemory.fresh(0.2)
    policy, chain, left = policy_for(memory=memory), TreeShape.chain(2), 1000
    for _ in range(12):
        for option, seconds in [(None, 1.0)] * 5 + [(chain, 5.0), (chain, 1.5)]:  # every draft accepted
            policy.next()
            accepted = 0 if option is None else 2
            left -= 1 + accepted
            policy.observe(option, 1, [1] * accepted, seconds, rows=[accepted], remaining=[left])
    policy.end_call()
    assert policy.holds == 0 and memory.ended_plain == "slower" and policy_for(memory=memory).retired


def test_a_call_whose_drafts_were_rejected_after_calls_whose_drafts_were_accepted_retires_nothing():
    """A prompt whose drafts are rejected makes its call's drafting measure slower than its plain steps, but the next
    call's prompt is another. A call's drafting is judged at the depth-1 acceptance of recent calls (its progress
    scaled by their median over its own), so after calls whose drafts were accepted the next call decides afresh
    (retiring it, a batch-1 row lost 40% on the easy prompt after a hard one); once hard calls are the typical ones,
    calls start plainly."""
    memory = AutoMemory.fresh(0.2)
    for _ in range(3):
        policy = policy_for(memory=memory)
        run(policy, Machine(per_draft=0.2, accept=0.8), 200)
        policy.end_call()
    assert memory.ended_plain is None
    hard, retired = Machine(per_draft=0.2, accept=0.05, seed=1), []
    for _ in range(6):
        policy = policy_for(memory=memory)
        retired.append(policy.retired)
        if not policy.retired:
            run(policy, hard, 400)
            (drafted, drafting, drafts, *_), (stepped, plain, *_) = policy.totals
            assert drafts >= 16 and drafted / drafting < stepped / plain  # its drafting measured slower
            if len(retired) == 1:
                assert memory.ended_plain is None  # judged at the easy calls' acceptance
        policy.end_call()
    assert retired[:2] == [False, False] and any(retired)  # later, the hard calls' is the typical acceptance


def test_a_call_with_too_few_drafts_to_judge_keeps_the_count_of_verdicts():
    """A call whose drafting measured slower retires one call, the next such verdict in a row two. A call between them
    that drafted too few steps to judge (fewer than GUARD_WINDOW) is no evidence that drafting paid: the next verdict
    still retires two calls."""
    memory, chain = AutoMemory.fresh(0.2), TreeShape.chain(2)

    def call(steps: list) -> AutoPolicy:
        policy, left = policy_for(memory=memory), 1000
        for option, seconds in steps:
            policy.next()
            accepted = 0 if option is None else 2
            left -= 1 + accepted
            policy.observe(option, 1, [1] * accepted, seconds, rows=[accepted], remaining=[left])
        policy.end_call()
        return policy

    slower = [(chain, 5.0)] * 20 + [(None, 1.0)] * 20  # 3 tokens in 5 s against 1 in 1 s
    call(slower)
    assert memory.ended_plain == "slower" and memory.retire_left == 1
    assert call([]).retired
    call([(chain, 5.0)] * 5 + [(None, 1.0)] * 20 + [(chain, 5.0)])  # 6 drafts, ending on one: no verdict
    assert memory.ended_plain is None and memory.verdicts == 1
    call(slower)
    assert memory.verdicts == 2 and memory.retire_left == 2


def test_a_call_ending_plainly_by_rating_retires_the_next_only_once_every_draft_is_timed(switches):
    """Drafting does not pay (each depth costs a plain step, drafts are accepted half the time), yet the guard never
    holds: the rating alone keeps the call plain. The next call starts plainly only when every chain's cost was
    measured by then (an unmeasured one may be priced dear: it could pay after all)."""
    switches.guard = True
    machine = Machine(per_draft=1.0, accept=0.5)
    memory = AutoMemory.fresh(1.0)
    policy = policy_for(share=1.0, memory=memory)
    run(policy, machine, 40)
    policy.end_call()
    unmeasured = [o.depth for o in policy.options[1:] if not memory.cost.measured(o.depth)]
    assert memory.last_plain and unmeasured  # plain by rating, some chain never timed yet
    assert policy.hold == 0 and not policy_for(memory=memory).retired

    while not all(memory.cost.measured(o.depth) for o in policy.options[1:]):  # later calls time each chain in turn
        policy = policy_for(memory=memory)
        run(policy, machine, 40)
    policy = policy_for(memory=memory)
    while True:  # until a plain step chosen by rating (not a one-off measurement)
        option = policy.next()
        machine.step(policy, option)
        if option is None and memory.streak >= 2:
            break
    assert policy.hold == 0
    policy.end_call()
    assert policy_for(memory=memory).retired


def test_later_calls_start_from_what_earlier_ones_learned():
    memory = AutoMemory.fresh(0.05)
    machine = Machine(per_draft=1.5, accept=0.8)
    run(policy_for(memory=memory), machine, 200)
    later, chosen = policy_for(memory=memory), []
    assert max(counts[1] for counts in memory.acceptance.values()) <= 8.0  # prompts differ: counts scaled down
    for _ in range(6):
        chosen.append(later.next())
        machine.step(later, chosen[-1])
    assert chosen[:2] == [TreeShape.chain(3)] * 2  # a call's prompts are new: two steps of the deepest chain see them
    assert chosen[2:] == [None] * 4  # then plain steps: the costs are known


def test_a_call_after_a_prompt_whose_drafts_were_rejected_measures_its_own(switches):
    """Calls start from the acceptance earlier calls measured; a prompt whose drafts were all rejected leaves it low.
    The next call's first two steps draft the deepest chain on its own prompt, which accepts: it drafts from then on.
    Measuring only after MEASURE_EVERY plain steps, it takes 24% longer."""
    def easy_call_after_a_hard_one() -> float:
        memory, machine = AutoMemory.fresh(0.3), Machine(per_draft=0.3, seed=3)
        decode_batch(policy_for(share=0.3, memory=memory), machine, [0.0], 96)
        memory.streak = 0  # the hard call's last step measured drafting (it does so every MEASURE_EVERY steps)
        return decode_batch(policy_for(share=0.3, memory=memory), machine, [0.95], 96)

    plain = decode_batch(None, Machine(), [0.95], 96)
    measured_at_the_start = easy_call_after_a_hard_one()
    switches.explore = False
    assert measured_at_the_start < 0.6 * plain  # chains of 3 emitting ~3.8 tokens per 1.9-second step
    assert easy_call_after_a_hard_one() > 1.15 * measured_at_the_start


# ----------------------------------------------------------------------------------------------- a real model
def test_a_call_starting_plainly_never_touches_the_drafter(models, monkeypatch):
    from lightning_mtp.decoding.drafting import MTPDrafter
    from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter

    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts(seed=3)
    expected = [alone(model, p, 24) for p in prompts]
    allocations = []
    for drafter in (MTPDrafter, MTPTreeDrafter):
        monkeypatch.setattr(drafter, "allocate", lambda self, *a, _allocate=drafter.allocate:
                            allocations.append(type(self).__name__) or _allocate(self, *a))
    model.generate(input_ids, 24, attention_mask=mask, speculative="auto")  # sets up the memory
    assert allocations  # the call drafted: the counting reaches the drafter auto uses
    for memory in model.__dict__["_mtp_auto_memory"].values():  # as if the last call ended plainly, and drafting
        memory.ended_plain, memory.retire_left, memory.cost = "rated", 1, StepCost(draft_share=5.0)  # does not pay
    allocations.clear()
    out = model.generate(input_ids, 24, attention_mask=mask, speculative="auto")
    assert rows_of(out) == expected and allocations == [] and out.stats.main_forwards >= 24
    model.__dict__.pop("_mtp_auto_memory", None)


def test_a_seed_reproduces_sampled_output_and_seeded_calls_use_no_timings(models):
    from lightning_mtp.decoding.host import decoding_host
    from lightning_mtp.decoding.tree_policy import draft_plan

    model = models["cascaded"]
    prompt = torch.tensor([[5, 2, 9, 11, 3, 7, 1, 4]])
    first = model.generate(prompt, 24, temperature=1.0, seed=11)
    model.generate(prompt, 24)  # a greedy call in between learns costs and acceptance
    assert torch.equal(first.sequences, model.generate(prompt, 24, temperature=1.0, seed=11).sequences)
    for temperature, seeded, timed in ((1.0, True, False), (1.0, False, True), (0.0, False, True)):
        config = GenerationConfig(max_new_tokens=24, temperature=temperature)
        _, steps = draft_plan(model, decoding_host(model), config, 1, torch.device("cpu"), False, seeded)
        assert steps.policy.timings is timed and steps.policy.memory.cost.learn is timed


def test_the_guard_holds_only_if_plain_steps_measured_then_confirm():
    """The plain rate the guard compares with was measured earlier. When the machine slows down (another process
    takes it), drafting measures slower than that though it still pays; the guard then takes MIN_SAMPLES plain steps
    and holds only if they are faster than drafting was. Here they are four times slower too: drafting goes on."""
    machine, policy = Machine(per_draft=0.1, accept=0.9), policy_for(share=0.2)
    run(policy, machine, 100)
    machine.slow = 4.0
    choices, _ = run(policy, machine, 100)
    assert policy.holds == 0 and choices["plain"] <= 12, choices  # the checks, and a measurement every 32 steps


def test_hold_steps_is_what_the_guard_waits(switches):
    """The guard's first hold lasts HOLD_STEPS plain steps."""
    switches.fit = False
    policy = policy_for(share=0.05)
    machine = Machine(per_draft=3.0, accept=0.8)
    while policy.holds == 0:
        machine.step(policy, policy.next())
    held = 0
    while policy.next() is None and held < 10 * HOLD_STEPS:
        held += 1
    assert held == HOLD_STEPS



def test_the_options_are_chains_up_to_d_plus_1_by_the_chain_drafter(models):
    """Cascaded modules: chains of 1..D+1 by the chain drafter (D + 1: the last module re-applied); parallel heads:
    chains of 1..D. ``draft_tokens`` caps the chains, and a chain longer than that makes auto choose between plain
    steps and that chain (the tree drafter beyond D + 1)."""
    from lightning_mtp.decoding.drafting import MTPDrafter
    from lightning_mtp.decoding.host import decoding_host
    from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter
    from lightning_mtp.decoding.tree_policy import draft_plan

    def plan(model, **settings):
        config = GenerationConfig(max_new_tokens=8, **settings)
        drafter, steps = draft_plan(model, decoding_host(model), config, 1, torch.device("cpu"), False)
        return type(drafter), drafter.max_drafts, [o and o.describe() for o in steps.policy.options]

    cascaded, parallel = models["cascaded"], draftable_model("parallel")
    depth = cascaded.mtp_config.depth
    chains = [None] + [f"chain{k}" for k in range(1, depth + 2)]
    assert plan(cascaded) == (MTPDrafter, depth + 1, chains)
    assert plan(cascaded, draft_tokens=2) == (MTPDrafter, 2, chains[:3])
    assert plan(cascaded, draft_tokens=depth + 2) == (MTPTreeDrafter, depth + 2, [None, f"chain{depth + 2}"])
    assert plan(parallel) == (MTPDrafter, depth, chains[:-1])


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("draft", [{}, {"draft_tree": [2, 1, 1]}], ids=["chains", "named-tree"])
def test_autos_plain_steps_dispatch_what_the_plain_loops_do_and_the_drafters_feed(draft, monkeypatch):
    """A plain step inside an ``auto`` call runs the plain loop's operations, feeds the drafter the trunk's hidden
    state (its one write) and counts the step, and reads the rows back in one sync: no step summary built of
    tensors (which cost 16 operations a step more than the plain loop's)."""
    model = draftable_model("cascaded").eval()
    prompts = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    choose = AutoPolicy.next
    monkeypatch.setattr(AutoPolicy, "next", lambda self: choose(self) and None)  # decided, then stepped plainly

    def per_step(speculative) -> float:
        model.generate(prompts, 5, speculative=speculative, **draft)  # memos (weights checked, memory) filled
        counts = []
        for new_tokens in (9, 17):
            with OpCounter() as counter:
                out = model.generate(prompts, new_tokens, speculative=speculative, **draft)
            counts.append((counter.ops, out.stats.main_forwards))
        (short, short_steps), (long, long_steps) = counts
        return (long - short) / (long_steps - short_steps)

    plain, auto = per_step(False), per_step("auto")
    assert plain > 20  # the trunk's forward and the token's emission
    assert auto - plain <= 6, f"an auto plain step dispatched {auto - plain:.1f} operations more than a plain one"
