"""``speculative="auto"``: each step takes the draft with the most expected tokens per second, or none.

Before each step :class:`AutoPolicy` rates every option (a plain step and chains of 1..D, or D + 1; or a plain step
and a named tree or longer chain) by expected tokens over predicted seconds and takes the best:

* **seconds**: :class:`~lightning_mtp.decoding.step_cost.StepCost`, fitted to the steps the decode runs;
* **tokens**: a running estimate of P(depth d accepted | depth d-1 was), kept across calls (a call starts from the
  median of recent calls'); in a batch each row's own counts in the call weigh against it, the batch is rated by the
  row with the most steps left (a call ends when its last row does), and its drafts by what that row realized over
  what it was rated at in earlier drafting steps (:meth:`AutoPolicy.last_row_share`).

**Measuring.** An option is taken in place of the best until it has
:data:`~lightning_mtp.decoding.step_cost.MIN_SAMPLES` timed steps; then the options not chosen are measured in turn
while that time stays within :data:`EXPLORE_SHARE` of the time decoded. (No guard compares measured drafting with
plain rates: the rating already does.) **Memory** is kept per module, host, batch size, device and mode. A call rated
plain at its start with nothing to measure is **retired** (:attr:`AutoPolicy.retired`): the loop runs its plain
loop, without the drafter. A call with a seed (or generator) decides without timings (the prior cost model and the
call's acceptance), so a seed gives the same samples anywhere. Every option is lossless. See docs/decoding.md.

Example::

    >>> memory = AutoMemory.fresh(draft_share=0.2)  # a drafting call priced at a fifth of a plain step
    >>> policy = AutoPolicy(memory, candidate_options(3), batch_size=1, timings=False)
    >>> policy.next().describe()  # the prior alone: 0.6 acceptance at depth 1
    'chain2'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Optional

from lightning_mtp.decoding.step_cost import StepCost
from lightning_mtp.decoding.tree import TreeShape

PRIOR_ACCEPTANCE = 0.6
"""Prior probability that depth 1 is accepted."""
PRIOR_TRIES = 4.0
"""How many tries the prior acceptance is worth."""
FORGET = 0.98
"""Each step that tries a depth multiplies its counts by this first (about its last 50 tries count)."""
CALL_START_TRIES = 8.0
"""At a call's start each acceptance is worth at most this many tries (its prompts are new)."""
RECENT_CALLS = 8
"""Calls whose median acceptance a new call starts from."""
ROW_TRIES = 12.0
"""How many tries the shared estimate is worth against a row's own counts (batches of several rows)."""
EXPLORE_SHARE = 0.03
"""The most of the decoded time that measuring options not chosen may take, once each option is measured."""


def candidate_options(max_drafts: int) -> list[Optional[TreeShape]]:
    """Plain (``None``) and chains of 1..``max_drafts`` drafts."""
    return [None, *(TreeShape.chain(k) for k in range(1, max_drafts + 1))]


@dataclass
class AutoMemory:
    """What ``auto`` learned for one module / host / batch size / device / mode, kept across calls."""

    cost: StepCost
    acceptance: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # (depth, kind) -> [accepted, tried]
    decoded: float = 0.0  # plain steps' worth (predicted) of every step taken: EXPLORE_SHARE
    measuring: float = 0.0  # ... of the steps taken to measure an option not chosen, once each was measured
    turn: int = 0  # the option to measure next, in turn
    this_call: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # the call's counts, unforgotten
    recent: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # the last calls' own acceptance
    last_row: list[float] = field(default_factory=lambda: [0.0, 0.0])  # a batch's last row: [realized, rated]

    def start_call(self) -> None:
        """A call's prompts are new: each acceptance starts at the median of the last :data:`RECENT_CALLS` calls' own
        (one prompt whose drafts were rejected says little about the next), worth :data:`CALL_START_TRIES` tries."""
        for key, (hits, tried) in self.this_call.items():
            if tried > 0:
                self.recent.setdefault(key, []).append(hits / tried)
                del self.recent[key][:-RECENT_CALLS]
        self.this_call = {}
        for key, counts in self.acceptance.items():
            typical = median(self.recent[key]) if self.recent.get(key) else counts[0] / max(counts[1], 1e-12)
            tries = min(counts[1], CALL_START_TRIES)
            counts[0], counts[1] = typical * tries, tries

    @classmethod
    def fresh(cls, draft_share: float, learn_costs: bool = True) -> AutoMemory:
        return cls(StepCost(draft_share, learn=learn_costs))


@dataclass
class Switches:
    """Which mechanisms run (all by default; ``benchmarks/decode_ablation.py`` turns each off in turn)."""

    fit: bool = True  # step costs fitted to the timed steps (off: the prior from the weights' bytes)
    speed: bool = True  # steps learned over the machine's speed at the time (off: as measured; see .step_cost)
    memory: bool = True  # what earlier calls learned (off: each call starts afresh)
    explore: bool = True  # options not chosen measured in turn within EXPLORE_SHARE (off: only until measured)
    rows: bool = True  # a batch rated by its rows' own acceptance and its last row (off: the pooled acceptance)
    last_row: bool = True  # a batch's drafts rated at what its last row realized in earlier calls (off: as rated)

SWITCHES = Switches()  # the mechanisms every new policy uses (the ablation benchmark changes these fields)

NOTHING = object()
""":meth:`AutoPolicy.to_measure`'s answer when no option is to be measured (``None`` is a plain step)."""


def _depth_kind(option: Optional[TreeShape]) -> tuple[int, str]:
    """(depth, kind) of ``option``; kinds key AutoMemory.acceptance: "chain", or a named tree's own (its depths accept
    more often than a chain's)."""
    return (0, "chain") if option is None else (option.depth, "chain" if option.is_chain else option.describe())


class AutoPolicy:
    """Chooses each step's draft (``None``: a plain step); :meth:`observe` learns from the step that ran."""

    def __init__(self, memory: AutoMemory, options: list[Optional[TreeShape]], batch_size: int = 1,
                 timings: bool = True, max_new_tokens: Optional[int] = None) -> None:
        self.memory, self.options, self.batch_size, self.timings = memory, options, batch_size, timings
        self.switches = SWITCHES
        # until the next observation: acceptance by (depth, kind), tokens by (row, kind), seconds, steps left by kind
        self._estimates, self._tokens, self._seconds, self._steps = {}, {}, {}, {}
        self.deepest = max(o.depth for o in options if o is not None)
        self.steps = 0
        self.last_depth = 0  # the last step's draft depth (0: plain, or the prefill); a deeper draft catches up first
        self.measure: list[Optional[TreeShape]] = []  # the steps still to take to measure an option
        self.measuring = self.charged = False  # the step being taken measures an option (charged: not chosen)
        self.rated = 0.0  # the progress of the row with the most tokens left that the chosen draft was rated at
        self.rows: dict[int, dict[int, list[float]]] = {r: {} for r in range(batch_size)}  # row -> depth -> counts
        self.remaining: dict[int, int] = {}  # row -> tokens it may still emit (once the decoding loop reports them)
        if not self.switches.memory:
            memory.acceptance.clear()
        memory.start_call()
        # A call rated plain with nothing to measure is retired: the loop steps plainly without the drafter (neither
        # allocated nor fed) and asks nothing; its ``max_new_tokens - 1`` plain steps count as decoded.
        self.retired = False
        if timings and max_new_tokens and self.best() is None:
            option = self.to_measure(None)
            if option is NOTHING:
                self.retired, memory.decoded = True, memory.decoded + max_new_tokens - 1
            else:
                self.measure = [option] * (1 + (option is not None))

    # ----------------------------------------------------------------- estimates
    def acceptance(self, depth: int, kind: str = "chain") -> float:
        """P(``depth`` of a ``kind`` draft is accepted | the depth above was): counts over a prior (memoised)."""
        key = (depth, kind)
        value = self._estimates.get(key)
        if value is None:
            prior = PRIOR_ACCEPTANCE if depth == 1 else self.acceptance(depth - 1, kind)
            hits, tried = self.memory.acceptance.get(key, (0.0, 0.0))
            value = self._estimates[key] = (hits + PRIOR_TRIES * prior) / (tried + PRIOR_TRIES)
        return value

    def expected_tokens(self, option: Optional[TreeShape], row: Optional[int] = None) -> float:
        """Expected tokens a step emits for ``row`` (bonus token counted): in a batch, the row's counts in this call
        over the shared estimate (:meth:`acceptance`) worth :data:`ROW_TRIES` tries; alone, the shared estimate
        (it is the row's)."""
        depth, kind = _depth_kind(option)
        return self._row_tokens(row, kind)[depth]

    def _row_tokens(self, row: Optional[int], kind: str) -> list[float]:
        """``row``'s expected tokens after 0..deepest depths of a ``kind`` draft (memoised: every option reads it)."""
        tokens = self._tokens.get((row, kind))
        if tokens is None:
            tokens, reach = [1.0], 1.0
            counts = self.rows.get(row, {}) if self.batch_size > 1 else {}
            for level in range(1, self.deepest + 1):
                hits, tried = counts.get(level, (0.0, 0.0))
                reach *= (hits + ROW_TRIES * self.acceptance(level, kind)) / (tried + ROW_TRIES)
                tokens.append(tokens[-1] + reach)
            self._tokens[(row, kind)] = tokens
        return tokens

    def seconds(self, option: Optional[TreeShape]) -> float:
        """Predicted seconds of a step of ``option`` (in plain steps until plain steps are timed; memoised)."""
        value = self._seconds.get(option)
        if value is None:
            tokens, drafts = (1, 0) if option is None else (option.num_nodes + 1, option.depth)
            value = self._seconds[option] = self.memory.cost.seconds(max(len(self.rows), 1), tokens, drafts)
        return value

    def rate(self, option: Optional[TreeShape]) -> float:
        """Expected tokens per second of a step of ``option``. Once the rows' budgets are known, a call's tokens over
        the time until its last row ends: the row with the most steps left, remaining / expected tokens, decides."""
        share = self.last_row_share(option) if self.batch_size > 1 else 1.0
        if not self.remaining or not self.switches.rows:
            depth, kind = _depth_kind(option)
            tokens = sum(self._row_tokens(row, kind)[depth] for row in self.rows) if self.rows else 1.0
            return tokens * share / self.seconds(option)
        return sum(self.remaining.values()) * share / (self.steps_left(option) * self.seconds(option))

    def steps_left(self, option: Optional[TreeShape]) -> float:
        """Steps of ``option`` until the call ends: the most, over the rows whose budgets are known, of a row's
        remaining tokens over its expected tokens per step."""
        depth, kind = _depth_kind(option)
        steps = self._steps.get(kind)  # by depth (memoised until the next observation)
        if steps is None:
            rows = [(left, self._row_tokens(row, kind)) for row, left in self.remaining.items()]
            steps = self._steps[kind] = [max(left / tokens[level] for left, tokens in rows)
                                         for level in range(self.deepest + 1)]
        return steps[depth]

    def last_row_share(self, option: Optional[TreeShape]) -> float:
        """Realized over rated progress of a batch's last row in earlier drafting steps (1 for plain steps)."""
        realized, rated = self.memory.last_row
        return 1.0 if option is None or not self.switches.last_row else (realized + PRIOR_TRIES) / (rated + PRIOR_TRIES)

    def rated_progress(self, option: Optional[TreeShape]) -> float:
        """The tokens a step of ``option`` is rated to bring the row with the most tokens left."""
        return max(self.remaining.values()) / self.steps_left(option) if self.remaining else 0.0

    def best(self) -> Optional[TreeShape]:
        """The option of the highest :meth:`rate` (``None``: a plain step)."""
        return max(self.options, key=self.rate)

    # ----------------------------------------------------------------- choosing
    def next(self) -> Optional[TreeShape]:
        """The next step's draft (``None``: a plain step)."""
        self.steps += 1
        if not self.measure:
            choice = self.best()
            option = self.to_measure(choice) if self.timings else NOTHING
            if option is NOTHING:
                return self._took(choice, measuring=False)
            # a draft deeper than the last step's catches up the modules that did not run first (untimed): two steps
            self.measure = [option] * (1 + self.catches_up(option))
        return self._took(self.measure.pop(0), measuring=True)

    def to_measure(self, choice: Optional[TreeShape]) -> Any:
        """The option to measure instead of ``choice`` (:data:`NOTHING`: none): one not yet timed
        :data:`~lightning_mtp.decoding.step_cost.MIN_SAMPLES` times, else the next in turn if measuring it keeps the
        time measured within :data:`EXPLORE_SHARE` of the time decoded."""
        memory, others = self.memory, [o for o in self.options if o is not choice]
        unmeasured = [o for o in others if self.switches.fit and not (
            memory.cost.plain_timed if o is None else memory.cost.measured(o.depth))]  # (fit off: the prior prices)
        self.charged = not unmeasured  # the first measurements are not charged to EXPLORE_SHARE
        if unmeasured:
            return unmeasured[0]
        if not self.switches.explore or not others:
            return NOTHING
        option = others[memory.turn % len(others)]
        steps = 1 + self.catches_up(option)
        if memory.measuring + steps * self.seconds(option) / self.seconds(None) > EXPLORE_SHARE * memory.decoded:
            return NOTHING
        memory.turn += 1  # (what measuring costs is charged as the steps are timed, catching up included)
        return option

    def catches_up(self, option: Optional[TreeShape]) -> bool:
        """Whether ``option`` is deeper than the last step: it first recomputes what its deeper modules skipped."""
        return option is not None and option.depth > self.last_depth

    def _took(self, option: Optional[TreeShape], measuring: bool) -> Optional[TreeShape]:
        self.measuring = measuring
        rated = self.batch_size > 1 and option is not None and not measuring
        self.rated = self.rated_progress(option) if rated else 0.0
        self.memory.decoded += self.seconds(option) / self.seconds(None)
        return option

    # ----------------------------------------------------------------- learning
    def observe(self, option: Optional[TreeShape], active_rows: int, reached: list[float], seconds: float,
                rows: Optional[list[int]] = None, remaining: Optional[list[int]] = None) -> None:
        """The step that ran: its draft, the rows that took part, the rows whose accepted path reached each depth of
        the draft (``reached[d-1]``), how long it took; each row's accepted drafts (-1: the row has finished;
        ``None``: every row took part and none has finished) and the tokens each may still emit."""
        if active_rows <= 0:
            return
        self._estimates, self._tokens, self._steps, self._seconds = {}, {}, {}, {}
        tried, kind = active_rows, _depth_kind(option)[1]
        for depth, hits in enumerate(reached, start=1):  # only what is tried is forgotten: an option left alone
            _count(self.memory.acceptance.setdefault((depth, kind), [0.0, 0.0]), hits, tried)  # keeps its evidence
            call = self.memory.this_call.setdefault((depth, kind), [0.0, 0.0])
            call[0], call[1], tried = call[0] + hits, call[1] + tried, hits
        longest = max(self.remaining.values(), default=None)  # the most tokens a row had left (once reported)
        for row, accepted in enumerate(rows or []):
            if accepted < 0:
                self.rows.pop(row, None)
                self.remaining.pop(row, None)
                continue
            self.remaining[row] = remaining[row]  # >= 1: the row has not finished
            if self.switches.rows:  # a row's counts fade at every step: left plain, it returns to the shared estimate
                tried = min(accepted + 1, len(reached))  # the depths the row tried (none in a plain step)
                for depth in range(1, max(tried, len(self.rows[row])) + 1):
                    _count(self.rows[row].setdefault(depth, [0.0, 0.0]), float(tried >= depth <= accepted),
                           float(tried >= depth))
        if self.rated > 0 and longest is not None and rows is not None:  # the last row's realized over rated progress
            _count(self.memory.last_row, longest - max(self.remaining.values(), default=0), self.rated)
        self.rated = 0.0
        catching_up, self.last_depth = self.catches_up(option), _depth_kind(option)[0]
        if self.measuring and self.charged:  # in plain steps: as timed (the catching-up step too), else as predicted
            timed = self.memory.cost.plain_timed and seconds > 0
            self.memory.measuring += (seconds if timed else self.seconds(option)) / self.seconds(None)
        if not self.timings or self.steps <= 1 or catching_up or not seconds > 0:
            # untimed: a seeded call, its first step, a draft deeper than the last (it catches modules up), a nan time
            return
        if self.switches.fit:
            tokens = 1 if option is None else option.num_nodes + 1
            self.memory.cost.observe(active_rows, tokens, 0 if option is None else option.depth, seconds,
                                     track_speed=self.switches.speed)
            self._seconds = {}


def _count(counts: list[float], hits: float, tried: float) -> None:
    """Forget a little of ``counts`` ([accepted, tried]) and add a try."""
    counts[0], counts[1] = FORGET * counts[0] + hits, FORGET * counts[1] + tried


def memory_for(module: Any, key: tuple, build: Callable[[], AutoMemory]) -> AutoMemory:
    """The module's :class:`AutoMemory` for ``key`` (built on first use; it lives on the module)."""
    store = module.__dict__.setdefault("_mtp_auto_memory", {})
    if key not in store:
        store[key] = build()
    return store[key]
