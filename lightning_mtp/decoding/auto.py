"""``speculative="auto"``: each step takes the draft with the most expected tokens per second, or none.

Before each step :class:`AutoPolicy` rates every option (a plain step and chains of 1..D, or D + 1; or a plain step
and a named tree or longer chain) by expected tokens over predicted seconds
(:class:`~lightning_mtp.decoding.step_cost.StepCost`) and takes the best. Tokens come from each row's acceptance
counts in the call over a shared running estimate of P(depth d accepted | depth d-1 was); a batch is rated by the row
with the most steps left (a call ends when its last row does). What is not chosen is still measured
(:data:`MEASURE_EVERY`), and each call starts, and drafting resumes, with two steps of the deepest draft. **The
guard** steps plainly for :data:`HOLD_STEPS` (doubling) when the last :data:`GUARD_WINDOW` drafting steps measured
slower than plain steps, then and before (a step is worth how far it brought the row with the most tokens left).
**Memory**: costs, acceptance and the plain rate are kept per module, host, batch size, device and mode; a call after
one whose drafting measured slower than its plain steps (at recent calls' acceptance), or that ended stepping plainly,
starts so (``retired``). A call with a seed (or generator) decides without timings, so a seed gives the same samples
anywhere. Every option is lossless. Design, constants and measurements: docs/decoding.md.

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

from lightning_mtp.decoding.step_cost import MIN_SAMPLES, StepCost
from lightning_mtp.decoding.tree import TreeShape

PRIOR_ACCEPTANCE = 0.6
"""Prior probability that depth 1 is accepted."""
PRIOR_TRIES = 4.0
"""How many tries the prior acceptance is worth."""
FORGET = 0.98
"""Each step that tries a depth multiplies its counts by this first (about its last 50 tries count)."""
CALL_START_TRIES = 8.0
"""At a call's start each acceptance count of earlier calls is scaled down to at most this many tries."""
MEASURE_EVERY = 32
"""After this many steps of one kind (plain or drafting) in a row one of the other is taken: both stay measured."""
GUARD_WINDOW = 16
"""Drafting steps whose measured tokens per second the guard compares with that of as many plain steps."""
HOLD_STEPS = 32
"""Plain steps the guard takes when drafting measured slower than plain (doubled at each further hold of a call)."""
RECHECK_EVERY = 8
"""Calls that start plainly (see :attr:`AutoPolicy.retired`) decide afresh once in this many at most: the first call
that ends plain retires one call, each further one in a row twice as many."""


def candidate_options(max_drafts: int) -> list[Optional[TreeShape]]:
    """Plain (``None``) and chains of 1..``max_drafts`` drafts."""
    return [None, *(TreeShape.chain(k) for k in range(1, max_drafts + 1))]


@dataclass
class AutoMemory:
    """What ``auto`` learned for one module / host / batch size / device / mode, kept across calls."""

    cost: StepCost
    acceptance: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # (depth, kind) -> [accepted, tried]
    # (chains share a kind; a named tree has its own: its depths accept more often than a chain's)
    ended_plain: Optional[str] = None  # how the last call ended: "slower" or "rated" (AutoPolicy.end_call), or None
    verdicts: int = 0  # calls in a row that ended plain (their drafting slower, or plain by rating)
    retire_left: int = 0  # calls still to start plainly (AutoPolicy.retired; RECHECK_EVERY)
    firsts: list[float] = field(default_factory=list)  # depth-1 acceptance of the last calls' drafting (RECHECK_EVERY)
    plain_steps: list[tuple[float, float]] = field(default_factory=list)  # (tokens, seconds): the guard's plain rate
    streak: int = 0  # steps of the same kind (plain or drafting) in a row, across calls (MEASURE_EVERY)
    last_plain: bool = False  # whether the last step was plain
    measured: int = 0  # drafting measurements taken while plain steps were chosen (the drafts in turn)

    @classmethod
    def fresh(cls, draft_share: float, learn_costs: bool = True) -> AutoMemory:
        return cls(StepCost(draft_share, learn=learn_costs))


@dataclass
class Switches:
    """Which mechanisms run (all by default; ``benchmarks/decode_ablation.py`` turns each off in turn)."""

    fit: bool = True  # step costs fitted to the timed steps (off: the prior from the weights' bytes)
    speed: bool = True  # steps learned over the machine's speed at the time (off: as measured; see .step_cost)
    guard: bool = True
    memory: bool = True
    explore: bool = True  # each chain measured in turn, the deepest when drafting resumes (off: the best-rated)
    rows: bool = True  # a batch rated by its rows' own acceptance and its last row (off: the pooled acceptance)

SWITCHES = Switches()  # the mechanisms every new policy uses (the ablation benchmark changes these fields)


def _kind(option: TreeShape) -> str:  # a key of AutoMemory.acceptance
    return "chain" if option.is_chain else option.describe()


class AutoPolicy:
    """Chooses each step's draft (``None``: a plain step); :meth:`observe` learns from the step that ran."""

    def __init__(self, memory: AutoMemory, options: list[Optional[TreeShape]], batch_size: int = 1,
                 timings: bool = True) -> None:
        self.memory, self.options, self.batch_size, self.timings = memory, options, batch_size, timings
        self.switches = SWITCHES
        self._estimates: dict[tuple[int, str], float] = {}
        self._tokens: dict[tuple[Optional[int], str], list[float]] = {}
        self.deepest = max(o.depth for o in options if o is not None)
        self.steps = 0
        self.hold = 0  # plain steps the guard still holds
        self.window: list[tuple[float, float]] = []  # (tokens, seconds) of the last drafting steps
        self.check: Optional[tuple[float, list]] = None  # (drafting rate, plain steps since) while the guard checks
        self.holds = 0  # times the guard held this call plain (each hold twice as long as the one before)
        # (progress, seconds, steps, depth-1 hits, row-steps) of the call's drafting, and plain, steps
        self.totals = ([0.0, 0.0, 0, 0.0, 0], [0.0, 0.0, 0, 0.0, 0])
        self.after_plain = True  # the last step was plain (or the prefill): the next draft catches up first
        self.probe = 0  # drafting steps still to take to measure drafting (the first one only catches up)
        self.probing: Optional[TreeShape] = None  # the draft they take
        self.rows: dict[int, dict[int, list[float]]] = {r: {} for r in range(batch_size)}  # row -> depth -> counts
        self.remaining: dict[int, int] = {}  # row -> tokens it may still emit (once the decoding loop reports them)
        self._begin_call()

    def _begin_call(self) -> None:
        memory = self.memory
        if not self.switches.memory:
            memory.acceptance.clear()
        for counts in memory.acceptance.values():  # earlier calls' prompts differ: their counts weigh less
            scale = min(1.0, CALL_START_TRIES / max(counts[1], 1e-12))
            counts[0], counts[1] = counts[0] * scale, counts[1] * scale
        ended_plain = memory.ended_plain if self.switches.guard and self.timings else None
        plain = ended_plain == "slower" or (ended_plain == "rated" and self._best()[0] <= self._rate(None))
        self.retired = plain and memory.retire_left > 0
        memory.retire_left -= self.retired

    # ----------------------------------------------------------------- estimates
    def acceptance(self, depth: int, kind: str = "chain") -> float:
        """P(``depth`` of a ``kind`` draft is accepted | the depth above was): counts over a prior (memoised until
        the next observation)."""
        key = (depth, kind)
        value = self._estimates.get(key)
        if value is None:
            prior = PRIOR_ACCEPTANCE if depth == 1 else self.acceptance(depth - 1, kind)
            hits, tried = self.memory.acceptance.get(key, (0.0, 0.0))
            value = self._estimates[key] = (hits + PRIOR_TRIES * prior) / (tried + PRIOR_TRIES)
        return value

    def expected_tokens(self, option: Optional[TreeShape], row: Optional[int] = None) -> float:
        """Expected tokens a step emits for ``row`` (bonus token counted): the row's counts in this call over the
        shared estimate (:meth:`acceptance`) as a prior worth :data:`PRIOR_TRIES` tries (``None``: the shared one)."""
        depth, key = (0, (row, "chain")) if option is None else (option.depth, (row, _kind(option)))
        tokens = self._tokens.get(key)  # after 0..deepest depths, memoised until the next observation
        if tokens is None:
            tokens, reach, counts = [1.0], 1.0, self.rows.get(row, {})
            for level in range(1, self.deepest + 1):
                hits, tried = counts.get(level, (0.0, 0.0))
                reach *= (hits + PRIOR_TRIES * self.acceptance(level, key[1])) / (tried + PRIOR_TRIES)
                tokens.append(tokens[-1] + reach)
            self._tokens[key] = tokens
        return tokens[depth]

    def _rate(self, option: Optional[TreeShape]) -> float:
        """Expected tokens per second of a step of ``option``. Once the rows' budgets are known, a call's tokens over
        the time until its last row ends: the row with the most steps left, remaining / expected tokens, decides."""
        tokens, drafts = (1, 0) if option is None else (option.num_nodes + 1, option.depth)
        seconds = self.memory.cost.seconds(max(len(self.rows), 1), tokens, drafts)
        expected = {row: self.expected_tokens(option, row) for row in self.rows}
        if not self.remaining or not self.switches.rows:
            return (sum(expected.values()) if expected else 1.0) / seconds
        steps_left = max(self.remaining[row] / expected[row] for row in self.remaining)
        return sum(self.remaining.values()) / (steps_left * seconds)

    def _best(self) -> tuple[float, TreeShape]:  # the drafting option of the highest rate, and its rate
        return max(((self._rate(o), o) for o in self.options[1:]), key=lambda pair: pair[0])  # [0] is None: plain

    # ----------------------------------------------------------------- choosing
    def next(self) -> Optional[TreeShape]:
        """The next step's draft (``None``: a plain step)."""
        self.steps += 1
        if self.hold > 0 or self.check is not None:
            self.hold = max(self.hold - 1, 0)
            return None
        memory = self.memory
        if self.probe > 0:
            self.probe, choice = self.probe - 1, self.probing
        else:
            rate, best = self._best()
            choice = best if rate > self._rate(None) else None
            if self.timings and memory.streak >= MEASURE_EVERY and (choice is None) == memory.last_plain:
                # a measured step of the other kind: a plain step, or two steps of each draft in turn (the first
                # after plain steps catches the modules up and is not timed)
                if choice is None:
                    drafts = self.options[1:] if self.switches.explore else [best]
                    self.probing, memory.measured = drafts[memory.measured % len(drafts)], memory.measured + 1
                    choice, self.probe = self.probing, 1
                else:
                    choice = None
            elif self.switches.guard and self.timings and choice is not None and len(memory.plain_steps) < MIN_SAMPLES:
                choice = None  # the guard's first plain measurements
            elif self.switches.explore and self.timings and self.after_plain and (choice or self.steps == 1):
                # drafting resumes, and a call starts (its prompts are new), with two steps of the deepest draft: the
                # first catches the modules up, the second measures its cost and every depth's acceptance
                self.probing = self.options[-1]
                choice, self.probe = self.probing, 1
        memory.streak = memory.streak + 1 if (choice is None) == memory.last_plain else 1
        memory.last_plain = choice is None
        return choice

    # ----------------------------------------------------------------- learning
    def observe(self, option: Optional[TreeShape], active_rows: int, reached: list[float], seconds: float,
                rows: Optional[list[int]] = None, remaining: Optional[list[int]] = None) -> None:
        """The step that ran: its draft, the rows that took part, the rows whose accepted path reached each depth of
        the draft (``reached[d-1]``), how long it took; each row's accepted drafts (-1: the row has finished;
        ``None``: every row took part and none has finished) and the tokens each may still emit."""
        if active_rows <= 0:
            return
        self._estimates, self._tokens = {}, {}
        tried = active_rows
        for depth, hits in enumerate(reached, start=1):  # only what is tried is forgotten: an option left alone
            _count(self.memory.acceptance.setdefault((depth, _kind(option)), [0.0, 0.0]), hits, tried)  # keeps its
            tried = hits  # evidence
        longest = max(self.remaining.values(), default=None)  # the most tokens a row had left (once reported)
        for row, accepted in enumerate(rows or []):
            if accepted < 0:
                self.rows.pop(row, None)
                self.remaining.pop(row, None)
                continue
            self.remaining[row] = remaining[row]  # >= 1: the row has not finished
            if self.switches.rows:  # a row's counts fade at every step: left plain, it returns to the prior
                tried = min(accepted + 1, len(reached))  # the depths the row tried (none in a plain step)
                for depth in range(1, max(tried, len(self.rows[row])) + 1):
                    _count(self.rows[row].setdefault(depth, [0.0, 0.0]), float(tried >= depth <= accepted),
                           float(tried >= depth))
        # the guard's worth of a step: a call ends when its last row does, so how far it brought the row with the most
        # tokens left (for every row; until the loop reports the rows' budgets, the tokens the rows emitted)
        progress = active_rows + sum(reached) if longest is None or rows is None else (
            active_rows * (longest - max(self.remaining.values(), default=0)))
        catching_up, self.after_plain = option is not None and self.after_plain, option is None
        if seconds > 0:  # the call's sums, drafting and plain (end_call)
            totals = self.totals[option is None]
            for i, value in enumerate((progress, seconds, 1, reached[0] if reached else 0, active_rows)):
                totals[i] += value
        if not self.timings or self.steps == 1 or catching_up or not seconds > 0:
            # untimed: a seeded call, its first step, a draft after plain steps (it catches the modules up), a nan time
            return
        if self.switches.fit:
            tokens = 1 if option is None else option.num_nodes + 1
            self.memory.cost.observe(active_rows, tokens, 0 if option is None else option.depth, seconds,
                                    track_speed=self.switches.speed)
        if option is None:
            self.memory.plain_steps = (self.memory.plain_steps + [(progress, seconds)])[-GUARD_WINDOW:]
            if self.check is not None:  # the guard holds only if plain steps measured now confirm it
                self.check[1].append((progress, seconds))
                if len(self.check[1]) == MIN_SAMPLES:
                    if measured_rate(self.check[1]) > self.check[0]:  # each hold twice as long as the last
                        self.hold, self.holds = HOLD_STEPS * 2 ** self.holds, self.holds + 1
                    self.check = None
            return
        self.window = (self.window + [(progress, seconds)])[-GUARD_WINDOW:]
        plain = measured_rate(self.memory.plain_steps) if len(self.memory.plain_steps) >= MIN_SAMPLES else None
        if self.switches.guard and plain is not None and len(self.window) == GUARD_WINDOW:
            if measured_rate(self.window) < plain:  # slower than plain was: plain steps now decide (a machine drifts)
                self.check, self.window = (measured_rate(self.window), []), []

    def end_call(self) -> None:
        """The call is over: the next starts plainly if its drafting steps (at least :data:`GUARD_WINDOW`, catching up
        and measuring included) measured slower than its plain steps, progress over seconds summed over the call and
        scaled to the median depth-1 acceptance of the last judged calls; or if it ended plain by rating with every
        draft timed (a call that started plainly changes nothing; one with fewer drafts keeps the count of verdicts)."""
        if self.retired:
            return
        (drafted, drafting, drafts, hits, row_steps), (stepped, plain, *_) = self.totals
        memory = self.memory
        judged = drafts >= GUARD_WINDOW and plain > 0
        if judged:  # at the depth-1 acceptance of recent calls: a prompt whose drafts were rejected says little of the
            # next call's (the call's drafting progress scaled by their median over its own)
            memory.firsts = (memory.firsts + [hits / row_steps])[-RECHECK_EVERY:]
            drafted *= median(memory.firsts) / max(hits / row_steps, 1e-9)
        slower = judged and drafted / drafting < stepped / plain
        measured = all(self.memory.cost.measured(option.depth) for option in self.options[1:])
        memory.ended_plain = "slower" if slower else "rated" if memory.last_plain and measured else None
        if memory.ended_plain or judged:  # each verdict in a row retires twice as many calls; too few drafts: no change
            memory.verdicts = memory.verdicts + 1 if memory.ended_plain else 0
        memory.retire_left = min(2 ** (memory.verdicts - 1), RECHECK_EVERY - 1) if memory.ended_plain else 0


def _count(counts: list[float], hits: float, tried: float) -> None:
    """Forget a little of ``counts`` ([accepted, tried]) and add a try."""
    counts[0], counts[1] = FORGET * counts[0] + hits, FORGET * counts[1] + tried


def measured_rate(steps: list[tuple[float, float]]) -> float:
    """Tokens per second of timed ``(tokens, seconds)`` steps: mean tokens over the median step time, so that one slow
    step (a first matrix-product shape being measured, a preempted thread) does not decide."""
    return sum(t for t, _ in steps) / len(steps) / max(median(s for _, s in steps), 1e-12)


def memory_for(module: Any, key: tuple, build: Callable[[], AutoMemory]) -> AutoMemory:
    """The module's :class:`AutoMemory` for ``key`` (built on first use; it lives on the module)."""
    store = module.__dict__.setdefault("_mtp_auto_memory", {})
    if key not in store:
        store[key] = build()
    return store[key]
