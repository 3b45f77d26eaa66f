"""``speculative="auto"``: each step drafts what pays on this machine and model, or nothing.

A step that drafts a tree of N nodes and depth d costs one trunk forward over N+1 tokens per row plus d drafting
calls, and returns 1 + (expected accepted drafts) tokens per row. Plain decoding costs one forward of 1 token and
returns 1. :class:`AutoPolicy` picks, before each step, the option with the most expected tokens per second:

* **costs** are measured: at the first call for a model / batch size / device / mode, a short calibration decodes
  the call's own prompts for its number of new tokens, taking every option in turn for several rounds
  (``calibration.RoundRobin``), so steps are timed at the call's context and with its acceptance (step costs grow with
  both: attention reads every cached position, and accepted drafts make the MTP modules recompute more); a call
  whose context is far from the calibrated one calibrates again. Each drafting option is timed against a steady
  plain step three steps before it, so drift on a shared machine cancels, and every comparison rests on such paired
  ratios (the plain decoding loop, timed too, is only their unit); the best few options are timed again, and each
  option's price is pooled with a cost model fitted through all of them (:mod:`~lightning_mtp.decoding.step_prices`:
  an option's own few ratios are noisy, and the policy would take whichever came out cheapest). Greedy decoding
  then corrects the drafting options' prices among themselves from paired steps (the runners-up are probed in turn,
  each twice in a row, its second step timed against the best option's steps just before, and the best's after it:
  :mod:`~lightning_mtp.decoding.paired_prices`); the plain price stays the calibration's (a running average of step
  times drifts with the machine while the plain price it is weighed against does not);
* **acceptance** is a running estimate per (depth, sibling rank) of the probability that the candidate of that rank
  is accepted given its parent was; a static tree's expected accepted length is the sum over its nodes of the
  product of those estimates along the node's path (dynamic trees use their own measured average). The prior fades
  with the tries, and a deeper depth's prior is the estimate of the depth above.

Until ``MIN_EVIDENCE`` drafts have been tried the policy drafts rather than step plainly, so that it learns the
acceptance; while drafting is a close call it is probed every ``CLOSE_PROBE_EVERY`` plain choices. A drafting
option must beat a plain step by ``DRAFT_MARGIN``; in a batch, its expected tokens count only as far as the slowest row
gains them (:mod:`~lightning_mtp.decoding.slowest_row`: rows accept different numbers of drafts and the batch steps
until the last one is done, so the spread of a step's tokens costs the more, the more rows and the fewer tokens per
row a call has). After ``RETIRE_AFTER`` plain
choices in a row the call drops the drafter and finishes with the plain decoding loop. After a call where drafting
was clearly unprofitable (``RETIRE_HOPELESS``), or two calls in a row that retired while it was close, the next calls
decode plainly from their first step, the drafter never set up; one call in ``RECHECK_EVERY`` decides afresh, and
each recheck that retires again doubles that interval (up to ``MAX_RECHECK_EVERY``). So where drafting does not pay,
or only breaks even, ``auto`` costs (almost) nothing: exploring a call's prompts, the plain steps inside the drafting
loop and the drafter's set-up over the prompt are each worth little but together cost a call that retires 10-15%
(measured on the ``transformers`` host of ``benchmarks/hf_compare.py``, where the best chain gives 0.86-0.90x).
Both estimates are kept per model, batch size and device, so later greedy calls start from what earlier calls learned.
Every option is lossless, so the policy only changes speed: greedy output stays identical to plain decoding and sampling
keeps the model's distribution. With sampling, which draft a step makes decides which random numbers it consumes, so
there the policy decides from the (cached) calibration and the call's own acceptance only: the same seed gives the same
samples within a process (across processes the calibration is re-measured; ``speculative=True`` or ``False`` make
samples reproducible everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_mtp.decoding.paired_prices import PairedPrices, StepPairs
from lightning_mtp.decoding.slowest_row import batch_efficiency, chain_moments, equal_acceptance_moments
from lightning_mtp.decoding.tree import TreeShape
from lightning_mtp.layers import ATTENTION_WIDTH_STEP

PRIOR_ACCEPTANCE = 0.6
"""Prior probability that the best candidate of depth 1 is accepted (rank r: prior / (r + 1)^2); a deeper depth's prior
is the estimate of the depth above."""
PRIOR_WEIGHT = 4.0
"""How many observations the prior acceptance is worth."""
FORGET = 0.98
"""Each step multiplies the acceptance counts by this (older steps count less; about the last 50 matter)."""
PROBE_EVERY = 24
"""Every this many steps the runner-up option is taken once (greedy: the runners-up in turn, ``PROBED_RUNNERS``, and
twice when it drafts and so does the best, the second step paired with the best's for the prices), so its estimates
stay current."""
PROBED_RUNNERS = 2
"""Greedy calls probe the best this many options after the chosen one in turn (the runner-up, then the third), each
twice in a row, for the paired prices (:mod:`~lightning_mtp.decoding.paired_prices`): measured on the benchmark model,
the calibration priced the chain of 3 at 1.43 plain steps where steps inside decoding cost 1.11 times the chain of 2's
(priced 1.09), so the chain of 3 was never the runner-up, never paired, and ``auto`` took the chains of 2 and 4 at
1.53x where the chain of 3 gave 2.21x."""
MIN_EVIDENCE = 12.0
"""Until the depth-1 candidates have been tried this many times (the forgotten counts), the policy drafts (its best
drafting option) rather than step plainly: from the prior alone it cannot tell that drafting does not pay."""
DRAFT_MARGIN = 1.05
"""A drafting option is taken only when its expected tokens per second beat a plain step's by this factor (at batch
1): the estimates are noisy, so a marginal gain is not worth it."""
DEFAULT_NEW_TOKENS = 128
"""New tokens per row assumed when the policy is not told the call's (the batch discount of
:func:`~lightning_mtp.decoding.slowest_row.batch_efficiency` depends on it)."""
RETIRE_AFTER = PROBE_EVERY
"""After this many consecutive plain choices (a probe of the runner-up among them) the call stops drafting: the rest
of it runs the plain decoding loop, without the drafter's bookkeeping. (Twice as many cost sampling at batch 8, where
no draft pays, 3-7% against plain: each plain step inside the drafting loop is 2-5% dearer than the plain loop's.)"""
CLOSE_PROBE_EVERY = 4
"""While plain steps win but the best drafting option's expected rate is within ``RETIRE_HOPELESS`` of what it must
reach, every this many plain choices that option is taken once: near break-even a probe costs about nothing, and at
batch 1 the estimate after a few steps of a new prompt is noisy (measured on the ``transformers`` host: calls
switched to plain after 8 steps where drafting paid 7-10%, and only the probe every ``PROBE_EVERY`` steps could
bring them back)."""
RECHECK_EVERY = 8
"""Once calls retire (``START_PLAIN_STREAK``), the following ones decode plainly from the start, but every this many
calls one decides afresh (the prompts, and so the acceptance, may have changed)."""
MAX_RECHECK_EVERY = 64
"""Each recheck call that retires again doubles the interval between rechecks, up to this many calls (a recheck of a
host where drafting does not pay costs a call about 10-15%: at one call in 8 that alone is 1-2% of plain's speed)."""
START_PLAIN_STREAK = 2
"""Calls start plainly once the retiring calls in a row weigh this much: a hopeless retirement weighs
``START_PLAIN_STREAK`` (one suffices), a close one 1 (two in a row: one harder prompt must not stop drafting for the
next calls, measured where a chain of 2 gave 1.29x; but a host where drafting only breaks even must not explore every
call, measured on the ``transformers`` host: ``auto`` 0.87-0.91x of plain while every close retirement let the next
call draft again)."""
RETIRE_HOPELESS = 0.9
"""A retiring call makes the next calls start plainly on its own only if its best drafting option's expected rate was
below this fraction of what it had to reach (a plain step's times the margin): clearly unprofitable; a closer call
leaves the next one to decide afresh, and two in a row start calls plainly (``START_PLAIN_STREAK``)."""
CALL_START_EVIDENCE = MIN_EVIDENCE / 2
"""At a call's start each acceptance count of earlier calls is scaled down to at most this many tries: prompts
differ, and with fewer than ``MIN_EVIDENCE`` tries the call drafts a few steps to learn its own acceptance."""
RECALIBRATE_CONTEXT = 2.0
"""A call whose context is more than this many times the calibrated one (or less than its inverse) calibrates again."""


@dataclass
class StepCosts:
    """What ``auto`` measured of step times for one model / batch size / device / mode (kept across calls, shared by
    greedy learning and by sampling calls, which only read it)."""

    step_seconds: dict[str, float] = field(default_factory=dict)
    """option -> measured seconds of a decoding step with it (the calibration's); ``"plain"``: a step of the plain
    decoding loop."""
    plain_in_loop_s: Optional[float] = None
    """Seconds of a steady plain step taken inside the drafting loop, which also feeds the drafter (calibration;
    reported: drafting options are priced by their ratio to it, times the plain loop's ``step_seconds["plain"]``)."""
    calibrated_context: Optional[int] = None
    """The context length (tokens) the calibration decoded at."""
    acceptance: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    """The acceptance counts the calibration's own steps gave (``AutoMemory.acceptance``'s form): where sampling calls
    start, all from the same counts, so that a seed reproduces the samples whichever call calibrated."""

    def needs_calibration(self, context: int) -> bool:
        """Whether a call decoding around ``context`` tokens must calibrate: never calibrated, or calibrated at a
        context more than ``RECALIBRATE_CONTEXT`` times shorter or longer (and at least ``ATTENTION_WIDTH_STEP``
        tokens apart). Step costs grow with the context, so prices from far away would mislead the choice."""
        if not self.step_seconds:
            return True
        if self.calibrated_context is None:
            return False
        low, high = sorted((max(context, 1), max(self.calibrated_context, 1)))
        return high > RECALIBRATE_CONTEXT * low and high - low >= ATTENTION_WIDTH_STEP


@dataclass
class AutoMemory:
    """What ``auto`` learned for one model / batch size / device / mode (kept across calls)."""

    costs: StepCosts = field(default_factory=StepCosts)
    """Measured step times."""
    acceptance: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    """(depth, rank) -> (accepted, tried) counts of the candidate of that rank given its parent was accepted, slowly
    forgotten (see :meth:`AutoPolicy.update`)."""
    measured_tau: dict[str, float] = field(default_factory=dict)
    """option -> measured tokens per row-step (dynamic trees)."""
    paired: PairedPrices = field(default_factory=PairedPrices)
    """Corrections of the drafting options' prices among themselves from paired steps of greedy decoding
    (:mod:`~lightning_mtp.decoding.paired_prices`); cleared by a new calibration."""
    retired_calls: int = 0
    """Weight of the consecutive calls that stopped drafting (``RETIRE_AFTER``): a hopeless retirement
    ``START_PLAIN_STREAK``, a close one 1. From ``START_PLAIN_STREAK`` on a call decodes plainly from its first step,
    but one call in ``recheck_every`` decides afresh."""
    recheck_every: int = RECHECK_EVERY
    """Calls between rechecks while calls start plainly: doubled by each recheck that retires again (up to
    ``MAX_RECHECK_EVERY``), back to ``RECHECK_EVERY`` when a call drafts to its end."""
    plain_calls: int = 0
    """Calls started plainly since the last call that decided for itself."""
    last_call_retired: bool = False
    """Whether the last call stopped drafting (or never started); a call that drafted to its end breaks the streak."""

    @property
    def step_seconds(self) -> dict[str, float]:
        """``costs.step_seconds``: the calibration's prices."""
        return self.costs.step_seconds

    def prices(self) -> dict[str, float]:
        """The prices the policy decides by: the calibration's, with the paired corrections of greedy decoding
        (none for sampling calls, whose memory starts empty and never learns timings)."""
        return self.paired.apply(self.costs.step_seconds)


def candidate_options(max_depth: int, mtp_depth: int, cascaded: bool, trees: bool) -> list[Optional[TreeShape]]:
    """Plain, chains 1..max_depth, and (with tree support) static trees widening the first depths."""
    options: list[Optional[TreeShape]] = [None]
    for length in range(1, max_depth + 1):
        options.append(TreeShape.chain(length))
        if trees:
            for head in ((2,), (3,), (4,), (2, 2), (4, 2), (8,)):
                if len(head) <= length:
                    options.append(TreeShape(branching=head + (1,) * (length - len(head))))
    if not cascaded:
        options = [o for o in options if o is None or o.depth <= mtp_depth]
    return options


class AutoPolicy:
    """Chooses each step's draft option (see the module docstring)."""

    def __init__(self, memory: AutoMemory, options: list[Optional[TreeShape]], batch_size: int = 1,
                 new_tokens: int = DEFAULT_NEW_TOKENS, learn_prices: bool = True) -> None:
        self.memory, self.options = memory, options
        self.learn_prices = learn_prices
        """Greedy calls: the runners-up are probed in turn (``PROBED_RUNNERS``), each twice in a row, and paired steps
        of two drafting options correct their prices (:meth:`observe_seconds`); sampling calls may not depend on
        timings."""
        self._pairs = StepPairs()
        self._repeat: Optional[int] = None  # the probe to take again at the next step
        self.margin = DRAFT_MARGIN
        """How much a drafting option's expected rate must beat a plain step's."""
        self.batch_size, self.new_tokens = batch_size, new_tokens
        """Rows and new tokens per row of the call: a drafting option's rate counts the tokens its slowest row gains
        (:func:`~lightning_mtp.decoding.slowest_row.batch_efficiency`)."""
        self.steps = 0
        self.plain_run = 0
        """Consecutive steps the policy chose a plain step (probes aside)."""
        self.last_tried: dict[str, int] = {}
        self.keys = ["plain" if o is None else o.describe() for o in options]
        self._index = {option: i for i, option in enumerate(options)}
        self._rates: Optional[list[float]] = None  # cached until the next update
        self.begin_call()

    def begin_call(self) -> None:
        """A call's start: plain from the first step when earlier calls retired (``START_PLAIN_STREAK``; but one call
        in ``recheck_every`` decides afresh), else each acceptance count known so far is kept at the weight of at
        most ``CALL_START_EVIDENCE`` tries."""
        memory = self.memory
        self._rates = None
        if not memory.last_call_retired:  # the last call drafted to its end: the streak is broken
            memory.retired_calls, memory.recheck_every = 0, RECHECK_EVERY
        memory.last_call_retired = False
        self.recheck = False
        """This call decides afresh after calls that started plainly: if it retires too, rechecks get rarer."""
        if memory.retired_calls >= START_PLAIN_STREAK and self.options[0] is None:
            if memory.plain_calls + 1 < memory.recheck_every:
                memory.plain_calls += 1
                memory.last_call_retired = True
                self.plain_run = RETIRE_AFTER  # earlier calls found that drafting does not pay: plain from the start
                return
            memory.plain_calls, self.recheck = 0, True
        # A new call, probably new prompts: each of earlier calls' acceptance counts is kept at the weight of at
        # most CALL_START_EVIDENCE tries (its rate unchanged), so this call's own drafts soon outweigh them. Each on
        # its own: scaled all by depth 1's factor, a rarely tried key (a second-ranked sibling, tried by the few tree
        # steps) fell to a fraction of a try and its prior returned (measured on the transformers host: at every
        # call's start the tree [4, 2] looked 18% better than the chain of 2 again, and was taken in 18% of steps).
        memory.acceptance = {key: _at_most(hits, count, CALL_START_EVIDENCE)
                             for key, (hits, count) in memory.acceptance.items()}

    def hopeless(self) -> bool:
        """Whether, at the acceptance known now, every drafting option's expected rate is below ``RETIRE_HOPELESS``
        of what it must reach (a plain step's rate times the margin)."""
        if self.options[0] is None and len(self.options) == 1:
            return True
        if self.options[0] is not None:
            return False
        rates = self._all_rates()
        return self._hopeless(rates, max(range(1, len(rates)), key=rates.__getitem__), 0)

    def _hopeless(self, rates: list[float], drafting: Optional[int], plain: int) -> bool:
        """Whether the best drafting option (index ``drafting``) is below ``RETIRE_HOPELESS`` of what it must reach,
        the plain step's rate times the margin (no drafting option: hopeless)."""
        return drafting is None or rates[drafting] < RETIRE_HOPELESS * self.margin * rates[plain]

    def start_plain(self) -> None:
        """Decode this call plainly from its first step (the decoding loop drops the drafter)."""
        self.plain_run = RETIRE_AFTER

    def evidence(self) -> float:
        """How often (forgotten counts) a depth-1 best candidate has been tried: the evidence behind the estimates."""
        return self.memory.acceptance.get((1, 0), (0.0, 0.0))[1]

    def _acceptance(self, depth: int, rank: int, memo: Optional[dict] = None) -> float:
        """P(rank-``rank`` candidate at ``depth`` accepted | parent accepted): the counts with a prior worth
        ``PRIOR_WEIGHT`` observations at first, so that a few rejections at batch 1 cannot lock the policy into plain
        steps, fading as tries accumulate (``PRIOR_WEIGHT² / (PRIOR_WEIGHT + tried)``): once earlier calls have
        measured the acceptance, a fixed prior would only pull it towards 0.6 (measured on the ``transformers`` host,
        where depth 1 accepts 88%: at each call's start the estimate was 0.77, below what a draft needed). The
        prior of a depth below the first is the estimate of the depth above (its best candidate's): a depth rarely
        drafted is expected to accept like its parent (measured on that host: 0.74 and 0.93 at depths 2 and 3 given
        the depth above, where a flat 0.6 kept the chain of 3, 1.10x, from ever being chosen)."""
        if memo is not None and (depth, rank) in memo:
            return memo[(depth, rank)]
        base = PRIOR_ACCEPTANCE if depth <= 1 else self._acceptance(depth - 1, 0, memo)
        prior = base / (rank + 1) ** 2
        hits, tried = self.memory.acceptance.get((depth, rank), (0.0, 0.0))
        weight = PRIOR_WEIGHT * PRIOR_WEIGHT / (PRIOR_WEIGHT + tried)
        estimate = (hits + prior * weight) / (tried + weight)
        if memo is not None:
            memo[(depth, rank)] = estimate
        return estimate

    def expected_tokens(self, option: Optional[TreeShape]) -> float:
        """1 + expected accepted drafts per row. A static tree's nodes at depth d are every combination of ranks,
        so the sum over them of the products along their paths is the product over depths of the sums over ranks."""
        return self._moments(option, {}, {})[0]

    def batch_tokens(self, option: Optional[TreeShape]) -> float:
        """:meth:`expected_tokens` as the call's batch gains them: discounted by the spread between its rows
        (:func:`~lightning_mtp.decoding.slowest_row.batch_efficiency`; 1 at batch 1)."""
        return self._discounted(*self._moments(option, {}, {}))

    def _discounted(self, mean: float, variance: float) -> float:
        """Tokens per row a step of ``mean`` ± √``variance`` gains the call's batch (its slowest row's)."""
        return mean * batch_efficiency(mean, variance, self.batch_size, self.new_tokens)

    def _moments(self, option: Optional[TreeShape], reach_sums: dict[tuple[int, int], float],
                 estimates: dict) -> tuple[float, float]:
        """(mean, variance) of a step's tokens per row with ``option``; ``reach_sums`` caches min(1, sum of the first
        b ranks' acceptance) per (depth, b), and ``estimates`` each (depth, rank)'s acceptance, across the options of
        one rate pass. Dynamic trees have only their measured mean: their spread is that of a chain of their depth
        with one acceptance for all depths."""
        if option is None:
            return 1.0, 0.0
        if option.dynamic:
            tau = self.memory.measured_tau.get(option.describe(), 1.0 + option.depth * PRIOR_ACCEPTANCE)
            return equal_acceptance_moments(tau, option.depth)
        reach, path = [], 1.0
        for depth, branch in enumerate(option.branching, start=1):
            reached = reach_sums.get((depth, branch))
            if reached is None:
                reached = reach_sums[(depth, branch)] = min(
                    1.0, sum(self._acceptance(depth, rank, estimates) for rank in range(branch)))
            path *= reached
            reach.append(path)  # P(the accepted path reaches this depth)
        return chain_moments(reach)

    def _all_rates(self, step_seconds: Optional[dict[str, float]] = None) -> list[float]:
        """Every option's expected tokens per second per row of the batch (:meth:`batch_tokens` over its price; an
        unpriced option: 0), at the measured prices or at ``step_seconds``, in one pass (the per-depth acceptance sums
        are shared between options)."""
        reach_sums: dict[tuple[int, int], float] = {}
        estimates: dict[tuple[int, int], float] = {}
        seconds = self.memory.prices() if step_seconds is None else step_seconds
        rates = []
        for option, key in zip(self.options, self.keys):
            tokens = self._discounted(*self._moments(option, reach_sums, estimates))
            rates.append(tokens / seconds.get(key, float("inf")))
        return rates

    def contenders(self, step_seconds: dict[str, float], count: int) -> list[TreeShape]:
        """The ``count`` drafting options with the best expected rate at prices ``step_seconds`` (best first)."""
        rates = self._all_rates(step_seconds)
        ranked = sorted((i for i, o in enumerate(self.options) if o is not None), key=lambda i: -rates[i])
        return [self.options[i] for i in ranked[:count]]

    @property
    def retired(self) -> bool:
        """Whether drafting has stopped paying for long enough that the call should decode plainly from now on."""
        return self.plain_run >= RETIRE_AFTER and self.options[0] is None

    def next(self) -> Optional[TreeShape]:
        self.steps += 1
        if self._repeat is not None:  # a probe's second step: the steady one, paired with the best's before it
            best, self._repeat = self._repeat, None
            self.last_tried[self.keys[best]] = self.steps
            return self.options[best]
        if self._rates is None:
            self._rates = self._all_rates()
        rates = self._rates
        best = max(range(len(self.options)), key=rates.__getitem__)
        plain = 0 if self.options[0] is None else None
        if plain is not None and best != plain and rates[best] < self.margin * rates[plain]:
            best = plain
        drafting = max(range(1, len(self.options)), key=rates.__getitem__) if len(self.options) > 1 else None
        if best == plain and drafting is not None and self.evidence() < MIN_EVIDENCE:
            best = drafting  # explore: learn the acceptance first
        self.plain_run = self.plain_run + 1 if best == plain else 0
        if (best == plain and drafting is not None and self.plain_run % CLOSE_PROBE_EVERY == 0
                and not self._hopeless(rates, drafting, plain)):
            best = drafting  # a close call: the probe costs about nothing and its evidence may turn the choice
        if self.plain_run == RETIRE_AFTER:
            # This call retires. The next ones start plainly when drafting looked clearly unprofitable; where it was
            # close (its rate within RETIRE_HOPELESS of plain's), another prompt may well pay, so the next call
            # decides afresh (measured: one harder prompt retired auto for the next six, where a chain of 2 gave
            # 1.29x), and only a second close retirement in a row makes the calls after it start plainly.
            memory = self.memory
            memory.retired_calls += START_PLAIN_STREAK if self._hopeless(rates, drafting, plain) else 1
            memory.last_call_retired = True
            if self.recheck:  # it retires again: check less often
                memory.recheck_every = min(2 * memory.recheck_every, MAX_RECHECK_EVERY)
        if self.steps % PROBE_EVERY == 0:
            # keep the runner-up's estimates current (a slow measurement must not lock an option out); greedy calls
            # take the runners-up in turn (ranks 2 .. PROBED_RUNNERS + 1), so that an option the calibration priced
            # too high is paired too
            others = sorted((i for i in range(len(self.options)) if i != best), key=lambda i: -rates[i])
            turn = (self.steps // PROBE_EVERY) % PROBED_RUNNERS if self.learn_prices else 0
            runner = others[min(turn, len(others) - 1)] if others else best
            if self.learn_prices and self.options[runner] is not None and self.options[best] is not None:
                self._repeat = runner  # twice: its second step prices it against the best's steps before
            best = runner
        self.last_tried[self.keys[best]] = self.steps
        return self.options[best]

    def observe_seconds(self, option: Optional[TreeShape], seconds: float) -> None:
        """A greedy step with ``option`` took ``seconds``: where the last four steps paired two drafting options
        (``X X Y Y``), their ratio corrects the options' relative prices
        (:class:`~lightning_mtp.decoding.paired_prices.PairedPrices`; plain steps are never paired)."""
        if not self.learn_prices:
            return
        index = self._index.get(option)
        key = self.keys[index] if index is not None else ("plain" if option is None else option.describe())
        pair = self._pairs.observe(key, seconds)
        if pair is not None and self.memory.paired.add(*pair):
            self._rates = None

    def update(self, option: Optional[TreeShape], tokens_per_row: float,
               accepted_ranks: Optional[list[list[int]]] = None, decay: float = 0.8) -> None:
        """Fold in one step's acceptance: tokens per active row, and (static trees) per depth the counts of [rows whose
        parent was reached, accepted rank-0 children, rank-1 children, ...]. Step times are not averaged here: they
        come from the calibration, corrected only by paired steps (:meth:`observe_seconds`; a running average of
        times taken during decoding drifts with the machine while the plain price it is weighed against does not;
        measured, that made ``auto`` retire where chains paid)."""
        if option is None:
            return
        memory = self.memory
        index = self._index.get(option)
        key = self.keys[index] if index is not None else option.describe()
        self._rates = None
        if option.dynamic:
            memory.measured_tau[key] = decay * memory.measured_tau.get(key, tokens_per_row) + (
                1 - decay) * tokens_per_row
            return
        for depth, counts in enumerate(accepted_ranks or [], start=1):
            reached, per_rank = counts[0], counts[1 : 1 + option.branching[depth - 1]]  # the ranks drafted
            if reached == 0:
                continue
            for rank, hits in enumerate(per_rank):
                old_hits, old_tried = memory.acceptance.get((depth, rank), (0.0, 0.0))
                memory.acceptance[(depth, rank)] = (FORGET * old_hits + hits, FORGET * old_tried + reached)


def _at_most(hits: float, tried: float, evidence: float) -> tuple[float, float]:
    """(hits, tried) scaled down to ``evidence`` tries when there are more (the rate kept)."""
    if tried <= evidence:
        return hits, tried
    return hits * evidence / tried, evidence


def memory_for(module: Any, key: tuple, build: Callable[[], AutoMemory]) -> AutoMemory:
    """The module's :class:`AutoMemory` for ``key`` (model-specific, so it lives on the module)."""
    store = module.__dict__.setdefault("_mtp_auto_memory", {})
    if key not in store:
        store[key] = build()
    return store[key]
