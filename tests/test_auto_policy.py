"""``speculative="auto"``: the policy (margins, retirement, evidence, acceptance learning) and its calibration (each
option timed against the plain step before it, on the call's own prompts, at the call's context). Decoding with
``auto`` is lossless like every other option: ``test_tree_decoding`` checks that."""

from __future__ import annotations

import pytest
import torch
from test_decoding import alone, draftable_model, ragged_prompts, rows_of
from test_tree_decoding import MixedSteps

from lightning_mtp.decoding import GenerationConfig
from lightning_mtp.decoding.auto import (
    CLOSE_PROBE_EVERY,
    DRAFT_MARGIN,
    AutoMemory,
    AutoPolicy,
    StepCosts,
    candidate_options,
)
from lightning_mtp.decoding.tree import TreeShape


@pytest.fixture(scope="module")
def models():
    return {"cascaded": draftable_model("cascaded")}


def measured_policy() -> AutoPolicy:
    """A policy whose step times are given: a step costs 1 + 0.25 per depth + 0.02 per node (plain: 1)."""
    options = candidate_options(3, 3, True, True)
    seconds = {"plain": 1.0}
    for option in options[1:]:
        seconds[option.describe()] = 1.0 + 0.25 * option.depth + 0.02 * option.num_nodes
    return AutoPolicy(AutoMemory(StepCosts(seconds)), options)


def test_auto_policy_prefers_plain_when_drafts_are_never_accepted():
    policy = measured_policy()
    option = policy.next()
    assert option is not None  # the prior expects acceptance: it drafts
    for _ in range(40):  # every draft rejected
        ranks = [[1] + [0] * 8 for _ in range(option.depth)] if option is not None else None
        policy.update(option, 1.0, ranks)
        option = policy.next()
    choices = [policy.next() for _ in range(48)]
    assert choices.count(None) >= 45  # plain, but for the periodic probe of the runner-up


def test_auto_policy_needs_a_margin_over_plain_and_retires_after_plain_choices():
    from lightning_mtp.decoding.auto import RETIRE_AFTER

    options = [None, TreeShape.chain(1)]
    expected_chain = 1 + 0.6  # the prior acceptance of depth 1, rank 0
    evidence = {(1, 0): (0.6 * 40, 40.0)}  # this call's drafts: tried often enough, accepted at the prior's rate
    barely = AutoPolicy(AutoMemory(StepCosts({"plain": 1.0, "chain1": expected_chain / (DRAFT_MARGIN - 0.01)})),
                        options)
    barely.memory.acceptance = dict(evidence)
    assert barely.next() is None  # faster than plain by less than the margin: plain
    clearly = AutoPolicy(AutoMemory(StepCosts({"plain": 1.0, "chain1": expected_chain / (DRAFT_MARGIN + 0.05)})),
                         options)
    clearly.memory.acceptance = dict(evidence)
    assert clearly.next() == TreeShape.chain(1)
    choices = [barely.next() for _ in range(RETIRE_AFTER - 1)]
    probes = RETIRE_AFTER // CLOSE_PROBE_EVERY + 1  # a close call is probed now and then (and the runner-up)
    assert choices.count(None) >= RETIRE_AFTER - 1 - probes and barely.retired
    assert not clearly.retired


def test_a_close_call_is_probed_and_its_evidence_can_turn_the_choice():
    """Plain wins by a little: every CLOSE_PROBE_EVERY-th plain choice drafts once; when those drafts are accepted
    the estimate rises and drafting resumes. A hopeless option is not probed that way."""
    options = [None, TreeShape.chain(1)]
    policy = AutoPolicy(AutoMemory(StepCosts({"plain": 1.0, "chain1": 1.6 / (DRAFT_MARGIN - 0.02)})), options)
    policy.memory.acceptance = {(1, 0): (0.6 * 20, 20.0)}
    choices = []
    for _ in range(8 * CLOSE_PROBE_EVERY):
        option = policy.next()
        choices.append(option)
        if option is not None:
            policy.update(option, 2.0, [[1, 1]])  # the probe's draft is accepted
        if len(choices) > CLOSE_PROBE_EVERY and all(c is not None for c in choices[-2:]):
            break
    assert choices[: CLOSE_PROBE_EVERY - 1] == [None] * (CLOSE_PROBE_EVERY - 1)
    assert choices[CLOSE_PROBE_EVERY - 1] == TreeShape.chain(1)  # the probe
    assert choices[-2:] == [TreeShape.chain(1)] * 2  # accepted probes turned it: it drafts again
    hopeless = AutoPolicy(AutoMemory(StepCosts({"plain": 1.0, "chain1": 3.0})), options)
    hopeless.memory.acceptance = {(1, 0): (0.6 * 40, 40.0)}
    assert [hopeless.next() for _ in range(2 * CLOSE_PROBE_EVERY)] == [None] * (2 * CLOSE_PROBE_EVERY)


def test_a_batch_counts_the_tokens_its_slowest_row_gains():
    """A batch steps until its slowest row is done: a draft 10% better per row pays at batch 1; at batch 8 the spread
    between rows eats the gain over 32 new tokens per row, not over 4096 (slowest_row.batch_efficiency)."""
    from lightning_mtp.decoding.slowest_row import batch_efficiency

    options = [None, TreeShape.chain(1)]
    for batch, new_tokens, drafts in ((1, 32, True), (8, 32, False), (8, 4096, True)):
        policy = AutoPolicy(AutoMemory(StepCosts({"plain": 1.0, "chain1": 1.6 / 1.1})), options, batch, new_tokens)
        policy.memory.acceptance = {(1, 0): (0.6 * 400, 400.0)}
        assert (policy.next() is not None) == drafts, (batch, new_tokens)
        tokens = policy.expected_tokens(TreeShape.chain(1))
        assert tokens == pytest.approx(1.6, abs=0.01)
        variance = (tokens - 1) * (2 - tokens)  # one draft accepted with probability tokens - 1
        assert policy.batch_tokens(TreeShape.chain(1)) == pytest.approx(
            tokens * batch_efficiency(tokens, variance, batch, new_tokens))
        assert policy.batch_tokens(None) == 1.0


def _retiring_call(memory: AutoMemory, hits_per_try: float, policy: AutoPolicy | None = None) -> AutoPolicy:
    """A call (a new one, or ``policy``'s) whose drafts accepted ``hits_per_try`` (40 tries: evidence enough), stepped
    until it retires."""
    from lightning_mtp.decoding.auto import RETIRE_AFTER

    policy = policy or AutoPolicy(memory, [None, TreeShape.chain(1)])
    memory.acceptance = {(1, 0): (hits_per_try * 40, 40.0)}
    for _ in range(RETIRE_AFTER):
        policy.next()
    assert policy.retired
    return policy


def test_calls_after_a_hopeless_retirement_decode_plainly_and_recheck_ever_more_rarely():
    """One hopeless retirement: the next RECHECK_EVERY - 1 calls decode plainly from their first step, the one after
    decides afresh; a recheck that retires again doubles the interval (up to MAX_RECHECK_EVERY); a recheck that
    finds drafting pays drafts, and the call after it decides afresh with the interval back at RECHECK_EVERY."""
    from lightning_mtp.decoding.auto import MAX_RECHECK_EVERY, PROBE_EVERY, RECHECK_EVERY, START_PLAIN_STREAK

    memory = AutoMemory(StepCosts({"plain": 1.0, "chain1": 10.0}))  # never pays: a hopeless retirement
    _retiring_call(memory, 0.5)
    assert memory.retired_calls == START_PLAIN_STREAK

    def next_recheck() -> tuple[int, AutoPolicy]:
        for count in range(1, 10 * MAX_RECHECK_EVERY):
            policy = AutoPolicy(memory, [None, TreeShape.chain(1)])
            if not policy.retired:
                return count, policy
        raise AssertionError("no recheck")

    count, recheck = next_recheck()
    assert count == RECHECK_EVERY and recheck.recheck  # the RECHECK_EVERY-th call after the retirement decides
    intervals = []
    for _ in range(5):  # every recheck retires again
        _retiring_call(memory, 0.5, recheck)
        count, recheck = next_recheck()
        intervals.append(count)
    assert intervals == [min(RECHECK_EVERY * 2 ** (i + 1), MAX_RECHECK_EVERY) for i in range(5)]
    memory.step_seconds["chain1"] = 0.1  # now drafting pays: the recheck call drafts to its end
    memory.acceptance = {(1, 0): (20.0, 40.0)}
    assert all(recheck.next() == TreeShape.chain(1) for _ in range(PROBE_EVERY - 1)) and not recheck.retired
    after = AutoPolicy(memory, [None, TreeShape.chain(1)])
    assert not after.retired and memory.retired_calls == 0 and memory.recheck_every == RECHECK_EVERY


def test_one_close_retirement_leaves_the_next_call_to_decide_but_two_in_a_row_start_calls_plainly():
    """A call that retires while drafting was close to paying (within RETIRE_HOPELESS of plain) does not make the next
    call start plainly: that call drafts a few steps to learn its own prompts' acceptance (earlier counts weigh
    CALL_START_EVIDENCE tries). A second close retirement in a row does: a host where drafting only breaks even must
    not explore every call (measured on the transformers host of hf_compare: 0.87-0.91x of plain)."""
    from lightning_mtp.decoding.auto import CALL_START_EVIDENCE, DRAFT_MARGIN, MIN_EVIDENCE, START_PLAIN_STREAK

    expected_chain = 1 + 0.5
    memory = AutoMemory(StepCosts({"plain": 1.0, "chain1": expected_chain / (DRAFT_MARGIN - 0.02)}))
    _retiring_call(memory, 0.5)  # just below the margin: plain, then retired
    assert memory.retired_calls == 1 < START_PLAIN_STREAK  # close: half a streak
    second = AutoPolicy(memory, [None, TreeShape.chain(1)])
    hits, tried = memory.acceptance[(1, 0)]
    assert tried == pytest.approx(CALL_START_EVIDENCE) and hits / tried == pytest.approx(0.5)
    assert not second.retired and second.next() == TreeShape.chain(1)  # evidence < MIN_EVIDENCE: it drafts
    assert CALL_START_EVIDENCE < MIN_EVIDENCE
    _retiring_call(memory, 0.5, second)  # the second call retires too
    assert memory.retired_calls == START_PLAIN_STREAK
    assert AutoPolicy(memory, [None, TreeShape.chain(1)]).retired  # the third starts plainly


def test_a_call_that_drafts_to_its_end_breaks_the_streak():
    """A close retirement followed by a call that drafts to its end (it never retires): the call after that decides
    afresh even if one more close retirement follows."""
    from lightning_mtp.decoding.auto import DRAFT_MARGIN, PROBE_EVERY

    memory = AutoMemory(StepCosts({"plain": 1.0, "chain1": 1.5 / (DRAFT_MARGIN - 0.02)}))
    _retiring_call(memory, 0.5)
    drafting = AutoPolicy(memory, [None, TreeShape.chain(1)])
    memory.acceptance = {(1, 0): (0.9 * 40, 40.0)}  # this call's prompts accept: it drafts throughout
    assert all(drafting.next() == TreeShape.chain(1) for _ in range(PROBE_EVERY - 1))
    _retiring_call(memory, 0.5)
    assert memory.retired_calls == 1 and not AutoPolicy(memory, [None, TreeShape.chain(1)]).retired


def test_each_acceptance_estimate_keeps_its_own_evidence_at_a_calls_start():
    """At a call's start every (depth, rank) count is capped at CALL_START_EVIDENCE tries on its own, its rate kept:
    a rarely tried second-ranked sibling that was never accepted stays near zero instead of falling back to its prior
    (scaled by depth 1's factor, its 20 tries became 2.4 and the estimate rose from 0.02 to 0.1)."""
    from lightning_mtp.decoding.auto import CALL_START_EVIDENCE

    memory = AutoMemory(StepCosts({"plain": 1.0}))
    memory.acceptance = {(1, 0): (45.0, 50.0), (1, 1): (0.0, 20.0), (2, 0): (3.0, 4.0)}
    policy = AutoPolicy(memory, [None, TreeShape.chain(2), TreeShape(branching=(2, 1))])
    assert memory.acceptance[(1, 0)] == pytest.approx((0.9 * CALL_START_EVIDENCE, CALL_START_EVIDENCE))
    assert memory.acceptance[(1, 1)] == pytest.approx((0.0, CALL_START_EVIDENCE))
    assert memory.acceptance[(2, 0)] == (3.0, 4.0)  # fewer tries than the cap: kept as it is
    assert policy._acceptance(1, 1) < 0.05


def test_a_call_retired_from_its_start_never_touches_the_drafter(models):
    """After a call retired drafting, the next calls (but every RECHECK_EVERY-th) decode plainly from the first step:
    the drafter's caches are not even allocated, and the output still equals plain decoding."""
    from lightning_mtp.decoding.auto import START_PLAIN_STREAK
    from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter

    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts(seed=3)
    expected = [alone(model, p, 24) for p in prompts]
    model.generate(input_ids, 24, attention_mask=mask, speculative="auto")  # calibrates, sets up the memory
    batch_memories = [m for key, m in model.__dict__["_mtp_auto_memory"].items() if key[1] == input_ids.shape[0]]
    for memory in batch_memories:
        # as if a call had just retired hopelessly (the next call is not a recheck)
        memory.retired_calls, memory.last_call_retired, memory.plain_calls = START_PLAIN_STREAK, True, 0
    allocations = []
    allocate = MTPTreeDrafter.allocate
    MTPTreeDrafter.allocate = lambda self, *a: allocations.append(1) or allocate(self, *a)
    try:
        out = model.generate(input_ids, 24, attention_mask=mask, speculative="auto")
    finally:
        MTPTreeDrafter.allocate = allocate
    assert rows_of(out) == expected and allocations == [] and out.stats.main_forwards >= 24


def test_auto_policy_drafts_until_it_has_evidence_of_the_acceptance():
    from lightning_mtp.decoding.auto import MIN_EVIDENCE

    policy = AutoPolicy(AutoMemory(StepCosts({"plain": 1.0, "chain1": 3.0})), [None, TreeShape.chain(1)])
    choices = []
    for _ in range(int(MIN_EVIDENCE) + 8):
        option = policy.next()
        choices.append(option)
        if option is not None:  # every draft accepted, but a draft step costs 3 plain steps: plain is better
            policy.update(option, 2.0, [[1, 1] + [0] * 7])
    assert choices[: int(MIN_EVIDENCE)] == [TreeShape.chain(1)] * int(MIN_EVIDENCE)  # the prior alone says plain
    assert choices[-4:] == [None] * 4


class RetiringSteps(MixedSteps):
    """Mixed steps, then retired (the decoding loop must finish plainly on the same caches)."""

    def __init__(self, retire_after: int) -> None:
        super().__init__()
        self.retire_after = retire_after

    @property
    def retired(self) -> bool:
        return self.steps >= self.retire_after


def test_a_retired_policy_finishes_with_plain_steps(models):
    from lightning_mtp.decoding.host import decoding_host
    from lightning_mtp.decoding.speculative import decode, prepare_prompts
    from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter

    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts(seed=8)
    expected = [alone(model, p, 40) for p in prompts]
    host = decoding_host(model)
    drafter = MTPTreeDrafter(model, 5)
    prompts_, lengths = prepare_prompts(input_ids, mask, host.vocab_size, torch.device("cpu"))
    calls = []
    draft = drafter.draft
    drafter.draft = lambda *args, **kwargs: calls.append(1) or draft(*args, **kwargs)
    out = decode(host, drafter, prompts_, lengths, GenerationConfig(max_new_tokens=40, speculative=True),
                 policy=RetiringSteps(retire_after=6))
    assert rows_of(out) == expected
    assert len(calls) <= 6 and out.stats.main_forwards > 10  # drafting stopped; plain steps finished the call


def test_auto_policy_drafts_deep_when_drafts_are_accepted():
    policy = measured_policy()
    for _ in range(40):  # the best candidate always accepted: a deep draft pays
        option = policy.next()
        ranks = None if option is None else [[1, 1] + [0] * 7 for _ in range(option.depth)]
        policy.update(option, 1.0 + (option.depth if option else 0), ranks)
    best = policy.next()
    assert best is not None and best.depth == 3 and best.is_chain  # a wider tree adds nodes nobody accepts


def test_plain_steps_are_priced_at_the_plain_loop_step_time():
    """The calibration times the plain decoding loop (decode N+1 tokens minus decode 1: prefill cancels), and plain
    steps taken inside the drafting loop do not move that price."""
    from types import SimpleNamespace

    from lightning_mtp.decoding.calibration import plain_loop_samples

    calls = []

    def run(prompts, lengths, new_tokens, plain=False):
        calls.append((new_tokens, plain))
        return SimpleNamespace(stats=SimpleNamespace(elapsed_s=0.5 + 0.01 * new_tokens))  # prefill 0.5 s

    assert plain_loop_samples(run, None, None, 24, repeats=2) == pytest.approx([0.01, 0.01])
    assert all(plain for _, plain in calls)


def test_calibration_decodes_the_calls_own_prompts_and_again_far_from_their_context():
    """The calibration decodes the call's own prompts for the call's number of new tokens (at least
    CALIBRATION_MIN_SEGMENT), so its steps run at the call's context and acceptance; the plain loop is timed on them
    too, and a call whose context is more than twice as long calibrates again."""
    from lightning_mtp import MTPConfig
    from lightning_mtp.decoding import speculative
    from lightning_mtp.decoding.auto import RECALIBRATE_CONTEXT
    from lightning_mtp.decoding.calibration import CALIBRATION_MIN_SEGMENT
    from lightning_mtp.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, max_seq_len=512),
                     MTPConfig(depth=2)).eval()
    model.configure_model()
    seen = []
    original = speculative.calibrate_steps

    def spy(steps, run, prompts, lengths, new_tokens, context):
        def recording_run(calibration_prompts, rows, tokens, plain=False):
            seen.append((calibration_prompts.clone(), rows.tolist(), tokens, plain))
            return run(calibration_prompts, rows, tokens, plain=plain)
        return original(steps, recording_run, prompts, lengths, new_tokens, context)

    speculative.calibrate_steps = spy
    try:
        prompt = torch.arange(40).remainder(30).unsqueeze(0) + 1
        model.generate(prompt, 100, speculative="auto")
        (costs,) = [m.costs for m in model.__dict__["_mtp_auto_memory"].values()]
        assert costs.calibrated_context == 40 + 100 // 2
        drafting = [(p, rows, n) for p, rows, n, plain in seen if not plain]
        assert drafting and all(torch.equal(p, prompt) and rows == [40] and n == 100 for p, rows, n in drafting)
        assert any(plain and n == 101 and torch.equal(p, prompt) for p, _, n, plain in seen)  # the plain loop
        assert costs.plain_in_loop_s is not None and costs.plain_in_loop_s > 0
        seen.clear()
        model.generate(prompt, 120, speculative="auto")  # centre 100: close enough, no calibration
        assert seen == []
        far = int(90 * RECALIBRATE_CONTEXT) + 100
        model.generate(torch.arange(far).remainder(30).unsqueeze(0) + 1, 16, speculative="auto")
        assert seen and all(n == CALIBRATION_MIN_SEGMENT for _, _, n, plain in seen if not plain)
        assert costs.calibrated_context == far + CALIBRATION_MIN_SEGMENT // 2
    finally:
        speculative.calibrate_steps = original


def test_calibration_times_each_option_against_a_steady_plain_step():
    """RoundRobin: after a warm-up taking every option once (untimed), per drafting option X three plain steps then X
    twice; X's second step is timed as a ratio to the third plain step (drift cancels; the first steps of a kind also
    pay for the switch: the MTP modules catch up, the plain steps after a draft run colder), a new decode starts at a
    pattern's first step, and a refinement adds rounds over the contenders to the same samples."""
    from lightning_mtp.decoding.calibration import RoundRobin

    options = [None, TreeShape.chain(1), TreeShape.chain(2)]
    cost = {None: 1.0, TreeShape.chain(1): 2.0, TreeShape.chain(2): 3.0}
    robin = RoundRobin(options, rounds=3)
    taken = []

    def run_rounds(first_steps=1.0):
        previous = None
        while not robin.done:
            option = robin.next()
            taken.append(option)
            drift = 1.0 + 0.03 * len(taken)  # the machine slows down step by step (1.5x over the run)
            switch = 1.5 if option != previous else 1.0  # the first step after another kind costs more, and
            second_plain = option is None and len(taken) % 5 == (2 + len(robin.warmup)) % 5
            switch *= 1.2 if second_plain else 1.0  # the second plain step still a little
            robin.record(option, drift * switch * cost[option] * first_steps)
            previous = option
            first_steps = 1.0

    c1, c2 = TreeShape.chain(1), TreeShape.chain(2)
    run_rounds(first_steps=10.0)  # the very first step is slow (warm-up): it must not count
    assert taken == [None, c1, c2] + [None, None, None, c1, c1, None, None, None, c2, c2] * 3
    assert len(robin.plain) == 6 and len(robin.ratios["chain1"]) == 3, robin.ratios  # the warm-up left out
    medians = robin.medians()
    assert medians["chain1"] == pytest.approx(2.0, rel=0.1)  # ratios to the steady plain step, despite the drift
    assert medians["chain2"] == pytest.approx(3.0, rel=0.1)  # and the switches
    taken.clear()
    robin.refine([None, c2], rounds=2)
    run_rounds()
    assert taken == [None, None, None, c2, c2] * 2  # no warm-up: both rounds timed
    assert len(robin.ratios["chain2"]) == 5 and len(robin.ratios["chain1"]) == 3
    robin = RoundRobin(options, rounds=3)
    robin.next()
    robin.start_segment()  # a new prompt during the warm-up: it goes on where it was
    assert robin.steps == 1 and robin.next() == c1
    robin.next(), robin.next(), robin.next()  # the warm-up's last step, then the first pattern's first step
    robin.start_segment()  # a new prompt: the interrupted pattern is abandoned, the next one starts with plain
    assert robin.steps == 3 + 5 and robin.next() is None


def test_decoding_keeps_the_calibrated_prices_and_the_plain_price(models):
    """Decoding does not move the calibrated step prices nor the plain price the policy weighs drafts against (a
    running average of step times drifts with the machine while the plain price does not): the acceptance estimates
    learn, and paired steps of two drafting options only correct those options' prices among themselves
    (test_paired_prices)."""
    model = models["cascaded"]
    model.__dict__.pop("_mtp_auto_memory", None)
    input_ids, mask, _ = ragged_prompts(seed=5)
    model.generate(input_ids, 8, attention_mask=mask, speculative="auto")
    (memory,) = [m for key, m in model.__dict__["_mtp_auto_memory"].items() if key[1] == input_ids.shape[0]]
    prices, acceptance = dict(memory.step_seconds), dict(memory.acceptance)
    model.generate(input_ids, 32, attention_mask=mask, speculative="auto")
    assert memory.step_seconds == prices and memory.acceptance != acceptance
    assert memory.prices()["plain"] == prices["plain"] and memory.prices().keys() == prices.keys()


def test_sampling_calls_start_from_the_calibration_and_a_seed_reproduces_them(models):
    """Every sampling call, the calibrating one included, starts from the acceptance the calibration's steps saw
    (StepCosts.acceptance), so the same seed gives the same samples in the first call and the next."""
    model = models["cascaded"]
    model.__dict__.pop("_mtp_auto_memory", None)
    prompt = torch.tensor([[5, 2, 9, 11, 3, 7, 1, 4]])
    first = model.generate(prompt, 24, speculative="auto", temperature=1.0, seed=11)
    (costs,) = {id(m.costs): m.costs for m in model.__dict__["_mtp_auto_memory"].values()}.values()
    assert costs.acceptance and costs.acceptance[(1, 0)][1] > 0  # the calibration's steps were counted
    second = model.generate(prompt, 24, speculative="auto", temperature=1.0, seed=11)
    assert torch.equal(first.sequences, second.sequences)
    from lightning_mtp.decoding.host import decoding_host
    from lightning_mtp.decoding.tree_policy import draft_plan

    for temperature in (1.0, 0.0):  # a sampling call never learns from timings; a greedy one does
        config = GenerationConfig(max_new_tokens=24, speculative="auto", temperature=temperature)
        _, steps = draft_plan(model, decoding_host(model), config, 1, torch.device("cpu"), False)
        assert steps.policy.learn_prices is (temperature == 0.0)
    assert not torch.equal(first.sequences, model.generate(prompt, 24, speculative="auto", temperature=1.0,
                                                            seed=12).sequences)


def test_a_sampling_call_starts_plainly_when_the_calibration_found_drafting_hopeless():
    from lightning_mtp.decoding.tree_policy import AutoSteps

    options = [None, TreeShape.chain(1), TreeShape.chain(2)]
    seen = {(1, 0): (2.0, 40.0), (2, 0): (1.0, 2.0)}  # 5% of depth-1 drafts accepted
    costs = StepCosts({"plain": 1.0, "chain1": 1.3, "chain2": 1.6}, acceptance=seen)
    steps = AutoSteps(AutoPolicy(AutoMemory(costs=costs), options, 8), 2, tree_mode=True)
    steps.sampling = True
    steps.start_sampling_call()
    assert steps.retired
    good = StepCosts({"plain": 1.0, "chain1": 1.3, "chain2": 1.6}, acceptance={(1, 0): (36.0, 40.0)})
    steps = AutoSteps(AutoPolicy(AutoMemory(costs=good), options, 1), 2, tree_mode=True)
    steps.sampling = True
    steps.start_sampling_call()
    assert not steps.retired and steps.next() is not None
