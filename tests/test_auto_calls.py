"""``speculative="auto"`` across a call and across calls, on simulated machines (``test_auto_policy``'s): the guard's
holds, the calls retired to the plain loop after calls whose drafting measured slower or that ended plain by rating,
and what later calls start from."""

from __future__ import annotations

from test_auto_policy import Machine, decode_batch, policy_for, run

from lightning_mtp.decoding.auto import HOLD_STEPS, RECHECK_EVERY, AutoMemory, AutoPolicy
from lightning_mtp.decoding.tree import TreeShape


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



# ------------------------------------------------------------------------------------- calls retired to the plain loop
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


# ----------------------------------------------------------------------------------------------- later calls
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
