"""``speculative="auto"``: the step-cost model, the acceptance estimates, the choice and a batch's rows, on simulated
machines whose step costs and acceptance are known (:class:`Machine`; the memory across calls on them is
in ``test_auto_calls``); and on a real model, that a call starting plainly never touches the drafter, a seed
reproduces sampled output, and the options and plain steps are what they should be. (Lossless decoding with
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
    AutoMemory,
    AutoPolicy,
    candidate_options,
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


def test_a_step_is_priced_as_the_medians_of_all_its_steps_say():
    """The cost model recomputes a depth's median only when its own steps or the plain median changed: after every
    observation of a random mix of plain steps, chains and trees (rows finishing, outliers), each step's price equals
    one computed from scratch from the windows it learned (an independent, naive twin of ``StepCost.seconds``)."""
    from statistics import median

    from lightning_mtp.decoding.step_cost import MIN_SAMPLES, TOKEN_SHARE
    from lightning_mtp.decoding.step_cost import _line as line

    def naive(cost: StepCost, rows: int, tokens: int, drafts: int) -> float:
        if len(cost.plain_steps) < MIN_SAMPLES:
            return cost.seconds(rows, tokens, drafts)  # the prior (no medians yet)
        plain = median(cost.plain_steps)
        per_node = TOKEN_SHARE * plain
        points = {d: median(s - plain - per_node * extra for s, extra in steps)
                  for d, steps in sorted(cost.drafting_steps.items()) if len(steps) >= MIN_SAMPLES}
        own = points.get(drafts)
        overhead, per_depth = line(list(points.items())) if points else (0.0, (cost.draft_share + TOKEN_SHARE) * plain)
        drafting = 0.0 if not drafts else (own if own is not None else overhead + per_depth * drafts) + (
            per_node * rows * (tokens - 1 - drafts))
        return cost.speed * max(plain + drafting, 0.1 * plain)

    rng = random.Random(5)
    cost = StepCost(draft_share=0.2)
    shapes = [(1, 0), (2, 1), (3, 2), (4, 3), (7, 2)]  # (tokens, drafts): plain, chains of 1..3, a tree of depth 2
    for _ in range(300):
        tokens, drafts = rng.choice(shapes)
        rows = rng.randint(1, 8)
        seconds = (0.01 + 0.004 * drafts + 0.0005 * rows * tokens) * (4.0 if rng.random() < 0.05 else 1.0)
        cost.observe(rows, tokens, drafts, seconds * rng.uniform(0.9, 1.1))
        for tokens, drafts in shapes + [(5, 4)]:  # (5, 4): a depth never timed, on the line
            assert cost.seconds(3, tokens, drafts) == pytest.approx(naive(cost, 3, tokens, drafts), rel=1e-9)


def test_drafts_measured_while_the_machine_was_slow_are_not_priced_dear_after(switches):
    """Another process slows the machine by half for 40 steps while ``auto`` drafts; then it recovers. Learned
    as measured, the chain's window fills with slow steps while the few plain steps measured before stay fast: the
    drafts are priced half as dear again as they are and the call steps plainly for most of the 300 steps after (294:
    0.99 tokens/s). Learned over the machine's speed at the time, it goes on drafting (1.24 tokens/s, as
    fast as a call without the spell)."""

    def after_a_slow_spell() -> tuple[Counter, float]:
        machine, policy = Machine(per_draft=0.3, accept=0.6, seed=5), policy_for()
        run(policy, machine, 300)
        machine.slow = 1.5
        run(policy, machine, 40)
        machine.slow = 1.0
        return run(policy, machine, 300)

    choices, rate = after_a_slow_spell()
    steady = run(policy_for(), Machine(per_draft=0.3, accept=0.6, seed=5), 640)[1]
    switches.speed = False
    unaware_choices, unaware = after_a_slow_spell()
    assert choices["plain"] <= 15 and rate > 0.97 * steady, (choices, rate, steady)
    assert unaware_choices["plain"] > 150 and unaware < 0.9 * rate, (unaware_choices, unaware)


def chain_steps_catching_up(policy: AutoPolicy, machine: Machine, behind: list[int], per_position: float,
                            accept: float, steps: int) -> tuple[Counter, float]:
    """(choices, tokens per second) of ``steps`` steps of one row, each depth accepted with probability ``accept``
    given the depth above was, where a step also recomputes, for each module it runs, the positions that module
    skipped since it last ran (``behind[k]``, by depth; ``per_position`` seconds each), as the chain drafter does."""
    choices, tokens, seconds = Counter(), 0.0, 0.0
    for _ in range(steps):
        option = policy.next()
        depth = 0 if option is None else option.depth
        cost = machine.seconds(option) + per_position * sum(behind[1 : depth + 1])
        reached, row = [], 1
        for _ in range(depth):
            row = int(row and machine.rng.random() < accept)
            reached.append(row)
        gained = 1 + sum(reached)
        behind[:] = [0 if k <= depth else skipped + gained for k, skipped in enumerate(behind)]
        policy.observe(option, 1, reached, cost)
        choices[option.describe() if option else "plain"] += 1
        tokens, seconds = tokens + gained, seconds + cost
    return choices, tokens / seconds


@pytest.mark.parametrize("seed, per_position", [(1, 0.03), (3, 0.03), (1, 0.1), (3, 0.1)])
def test_a_deeper_chain_is_not_priced_at_its_catching_up(seed, per_position):
    """A deeper chain's first step after shallower ones first recomputes the positions its deeper module skipped:
    after 33 steps of a chain of 1 (the measuring share's pace), 50 positions or so, 1.5 to 5 plain steps on this
    machine. That step is not the chain's cost, so it is not learned as one: measuring a deeper chain takes a
    catching-up step, then the timed one. 400 steps accept 45% of drafts (a chain of 1 pays), then 600 steps accept
    90% (a chain of 2 pays: 1.6 tokens/s against 1.4): the measured chain of 2 is found and drafted (the catching up
    learned as its cost, it measured dearer at each turn and the chain of 1 kept every step: 1.38-1.43 tokens/s)."""
    machine, policy, behind = Machine(per_draft=0.3, seed=seed), policy_for(depth=2), [0, 0, 0]
    chain_steps_catching_up(policy, machine, behind, per_position, 0.45, 400)
    choices, rate = chain_steps_catching_up(policy, machine, behind, per_position, 0.9, 600)
    assert choices["chain2"] > 450 and rate > 1.5, (choices, rate)


def test_one_slow_step_does_not_decide():
    """A step that measured new matrix-product shapes (or lost its thread) takes many times its cost: a median of
    fewer than three steps would be that step, so a kind's median counts from three steps on, and a step reported
    without a time of its own (nan) is not learned from."""
    cost = StepCost(draft_share=0.2)
    for _ in range(5):
        cost.observe(1, 1, 0, 0.010)
    cost.observe(1, 3, 2, 0.500)
    assert cost.parameters()[2] == pytest.approx((0.2 + TOKEN_SHARE) * 0.010)  # the prior, in seconds
    cost.observe(1, 3, 2, 0.016)
    cost.observe(1, 3, 2, 0.016)
    assert cost.parameters()[1:3] == pytest.approx((0.0, 0.003))  # median 0.016: 0.006 over two depths
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
    # plain: 0.99; what it pays for is finding out: the first drafts, and measuring each chain in turn within
    # EXPLORE_SHARE of the time decoded (here a chain of 3 costs 5.5 plain steps)
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
    row's own acceptance and the row with the most steps left, ``auto`` steps mostly plainly (1.14x plain's time: the
    first steps, before the row's rejections outweigh the shared estimate, and the measuring); rated by the pooled
    acceptance (87%: 7 of 8 rows) it keeps drafting (1.34x). The last-row correction, which would help both, is off."""
    switches.last_row = False
    accept, budget = [0.95] * 7 + [0.0], 192
    machine = Machine(per_draft=0.3, seed=1)
    plain = decode_batch(None, machine, accept, budget)
    chain = decode_batch(FixedChain(3), machine, accept, budget)
    rated_by_rows = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    switches.rows = False  # rated by the acceptance pooled over the rows
    pooled = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    assert chain > 1.5 * plain  # a fixed chain of 3: 191 steps of 1.9 seconds against 191 of 1 (and a token-row each)
    assert rated_by_rows < 1.2 * plain and 1.3 * plain < pooled, (rated_by_rows, plain, pooled)


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
    # 20 rejections (16.6 tries once faded) against the pooled half worth ROW_TRIES = 12: 0.21
    assert low < 0.5 * shared and shared > 0.45
    assert faded - low > 0.3 * (shared - low)  # 64 plain steps keep 0.98^64 = 27% of the row's counts


def test_a_batch_of_rows_that_accept_drafts_draws_deep_chains():
    accept, budget = [0.95] * 8, 96
    machine = Machine(per_draft=0.3, seed=2)
    plain = decode_batch(None, machine, accept, budget)
    auto = decode_batch(policy_for(share=0.3, rows=8), machine, accept, budget)
    assert auto < plain / 1.5, (auto, plain)  # a chain of 3 emits ~3.8 tokens per 1.9-second step


# ----------------------------------------------------------------------------------------------- a real model
def test_a_call_starting_plainly_never_touches_the_drafter(models, monkeypatch):
    """A call rated plain at its start with nothing to measure (every option timed, the measuring share spent) is
    retired: it decodes what plain decoding does, at least one trunk forward per token, and never allocates a
    drafter (the call before it, with nothing measured, drafted)."""
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
    for key, memory in model.__dict__["_mtp_auto_memory"].items():  # as if every option were measured, drafting did
        memory.cost, depths = StepCost(draft_share=5.0), [int(o[5:]) for o in key[-1] if o]  # not pay, and the
        for _ in range(3):  # share of measuring were spent: the call is rated plain with nothing to measure
            memory.cost.observe(key[1], 1, 0, 0.01)
            for depth in depths:
                memory.cost.observe(key[1], depth + 1, depth, 0.05 * depth)
        memory.measuring = memory.decoded
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


def test_one_row_needs_no_per_row_summary(models):
    """Alone, a row's acceptance is the shared estimate and its budget ends the call: the decoding loop reads each
    row's accepted drafts and budget only in a batch of several rows (one step's host sync stays small), and a
    one-row policy told them chooses exactly as one not told; the step prices it memoises are never stale."""
    from lightning_mtp.decoding.host import decoding_host
    from lightning_mtp.decoding.tree_policy import draft_plan

    model = models["cascaded"]
    for batch, per_row in ((1, False), (2, True)):
        _, steps = draft_plan(model, decoding_host(model), GenerationConfig(max_new_tokens=8), batch,
                              torch.device("cpu"), False)
        assert steps.per_row is per_row
    machine = Machine(per_draft=0.3, accept=0.7, seed=3)
    told, untold = policy_for(), policy_for()
    left, choices = 2000, Counter()  # tokens the row may still emit (400 steps emit at most 1600)
    for _ in range(400):
        option = told.next()
        assert untold.next() == option
        choices[option and option.describe()] += 1
        seconds = machine.seconds(option) * machine.rng.uniform(0.9, 1.1)  # (noise: every step moves the costs)
        accepted = 0
        while option is not None and accepted < option.depth and machine.rng.random() < 0.7:
            accepted += 1
        left -= accepted + 1
        reached = [1] * accepted + [0] * ((option.depth if option else 0) - accepted)
        told.observe(option, 1, reached, seconds, rows=[accepted], remaining=[left])
        untold.observe(option, 1, reached, seconds)
        for shape in told.options:  # its memoised step prices are the cost model's after every observation
            tokens, drafts = (1, 0) if shape is None else (shape.num_nodes + 1, shape.depth)
            assert told.seconds(shape) == told.memory.cost.seconds(1, tokens, drafts)
    assert len(choices) >= 3, choices  # measured options and the chosen ones
