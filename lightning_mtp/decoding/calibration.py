"""``speculative="auto"``'s calibration: every option timed on this machine and model, against a steady plain step.

:class:`RoundRobin` is the schedule of one calibration (per drafting option X: three plain steps, then X twice; X's
second step timed against the third plain step), and :func:`calibrate_steps` runs it on the call's own prompts, refines
the contenders' prices and stores them (pooled with a cost model, :mod:`~lightning_mtp.decoding.step_prices`) in the
policy's memory, in units of the plain decoding loop's step (:func:`plain_loop_samples`).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor

from lightning_mtp.decoding.step_prices import pooled_ratios
from lightning_mtp.decoding.tree import TreeShape

if TYPE_CHECKING:
    from lightning_mtp.decoding.tree_policy import AutoSteps

CALIBRATION_ROWS = 32
"""Calibration decodes at most this many rows (a larger batch is timed at this size)."""
CALIBRATION_SAMPLES = 48
"""Calibration times at least this many steps in all (and every option at least ``MIN_CALIBRATION_ROUNDS`` times)."""
MIN_CALIBRATION_ROUNDS = 2
REFINE_OPTIONS = 3
"""After the rounds over every option, calibration times the best this many (by expected rate) again, ..."""
REFINE_ROUNDS = 8
"""... for this many more rounds: their prices decide, and a median of 4 paired ratios was measured up to 10% off
(on the transformers host, where the best chain pays 5-8%, that flipped ``auto`` between 0.94x and 1.05x)."""
CALIBRATION_MIN_SEGMENT = 64
"""Calibration decodes run at least this many tokens (a call of few new tokens still gives several rounds)."""
MAX_CALIBRATION_SEGMENTS = 16
"""At most this many calibration decodes (a short context holds few steps per decode)."""


class RoundRobin:
    """Calibration policy: for every drafting option X in turn, three plain steps then X twice, each round; X's second
    step is timed against the third plain step, three steps before it.

    The ratio of two near steps cancels what drifts on a shared machine (measured here: the same step costs up to 15%
    more or less from one tenth of a second to the next), which timing the options one after another does not. Only
    steady steps are timed: a plain step soon after drafting steps runs colder (on the 12-layer benchmark model the
    first plain step after a chain of 2 measured 5% dearer than steady plain steps, the second 4.5%, the third 1-3%;
    on the ``transformers`` host the first 17%), and the first X after plain steps also catches the MTP modules up on
    the positions they skipped, which steady decoding with X does not. A warm-up takes every option once, untimed.
    ``medians()`` gives each option's median ratio; the timed plain steps' median is reported.
    """

    PATTERN = 5
    """Steps per option and round: plain, plain, plain, X, X."""

    def __init__(self, options: list[Optional[TreeShape]], rounds: int = 3) -> None:
        self.options, self.rounds = options, rounds
        self._set_sequence(options)
        self.warmup = [None] + self.drafting
        """Untimed steps first: each option once (the first call of a shape measures its products' path, fills
        allocator caches)."""
        self.plain: list[float] = []
        self.ratios: dict[str, list[float]] = {}
        self.steps = 0
        self._last_plain: Optional[float] = None

    def _set_sequence(self, options: list[Optional[TreeShape]]) -> None:
        self.drafting = [o for o in options if o is not None]
        self.sequence = [step for o in self.drafting for step in (None, None, None, o, o)] or [None] * self.PATTERN

    def refine(self, options: list[Optional[TreeShape]], rounds: int) -> None:
        """Go on for ``rounds`` more rounds over ``options`` only (the contenders), adding to the same samples (no
        warm-up: the machine and model are warm)."""
        self._set_sequence(options)
        self.rounds, self.steps, self.warmup, self._last_plain = rounds, 0, [], None

    def next(self) -> Optional[TreeShape]:
        if self.steps < len(self.warmup):
            option = self.warmup[self.steps]
        else:
            option = self.sequence[(self.steps - len(self.warmup)) % len(self.sequence)]
        self.steps += 1
        return option

    def record(self, option: Optional[TreeShape], seconds: float) -> None:
        step = self.steps - 1 - len(self.warmup)  # the step just taken, counted from the end of the warm-up
        if step < 0:
            self._last_plain = None
            return
        place = step % self.PATTERN
        if option is None:
            self._last_plain = seconds if place == 2 else None  # the third plain step: steady
            if place == 2:
                self.plain.append(seconds)
        elif place == 4 and self._last_plain:  # the second X, against the third plain step
            self.ratios.setdefault(option.describe(), []).append(seconds / self._last_plain)

    def start_segment(self) -> None:
        """A new calibration decode starts (prefill): begin at the next pattern's first step (the warm-up goes on
        where it was)."""
        done = self.steps - len(self.warmup)
        if done > 0:
            self.steps = len(self.warmup) + -(-done // self.PATTERN) * self.PATTERN
        self._last_plain = None

    @property
    def done(self) -> bool:
        return self.steps >= len(self.warmup) + self.rounds * len(self.sequence)

    def medians(self) -> dict[str, float]:
        """Per drafting option its median ratio to the steady plain step; ``"plain"``: the steady plain steps' median
        seconds (inside the drafting loop)."""
        if not self.plain:
            return {}
        out = {"plain": statistics.median(self.plain)}
        out.update({key: statistics.median(values) for key, values in self.ratios.items()})
        return out

    def prices(self) -> dict[str, float]:
        """:meth:`medians`, with each drafting option's ratio pooled with a cost model fitted across all options
        (:func:`~lightning_mtp.decoding.step_prices.pooled_ratios`: an option's own few ratios are noisy)."""
        if not self.plain:
            return {}
        shapes = {option.describe(): option for option in self.options if option is not None}
        return {"plain": statistics.median(self.plain), **pooled_ratios(self.ratios, shapes)}


def calibrate_steps(steps: AutoSteps, run: Callable[..., Any], prompts: Tensor, lengths: Tensor, new_tokens: int,
                    context: int) -> None:
    """Time every option on this machine and model, decoding the call's own prompts (its first
    ``CALIBRATION_ROWS`` rows) as the call will: for every drafting option X in turn, three plain steps then X twice,
    X's second step timed against the third plain step (:class:`RoundRobin`: near steps,
    so drift on a shared machine cancels, and steady steps of both kinds, no catch-up after another option); a warm-up
    (each option once), then enough rounds for ``CALIBRATION_SAMPLES`` timed steps, at least
    ``MIN_CALIBRATION_ROUNDS``. The decodes ("segments") run ``new_tokens`` tokens (at least
    ``CALIBRATION_MIN_SEGMENT``) from the prompts, again and again until the rounds are done, so the steps are timed
    at the call's context and with its acceptance: a step that accepts more drafts also recomputes more positions in
    the MTP modules (on random tokens, which draft nothing acceptable, a chain of 3 measured 8% cheaper and a chain
    of 2 12% dearer than in decoding). Then the ``REFINE_OPTIONS`` drafting options with the best expected rate (at
    these prices; greedy calls count the calibration's accepted drafts) get ``REFINE_ROUNDS`` more rounds, since
    their prices are the ones that decide. The plain decoding loop is timed on the same prompts, before and after.

    ``run(prompts, lengths, max_new_tokens, plain=False)`` decodes with ``steps`` as the policy (the call's greedy or
    sampling settings, its own generator), or with ``plain=True`` in the plain decoding loop, whose step time becomes
    the plain option's and the unit of the drafting options' ratios (:func:`plain_loop_samples`); the steady plain
    steps the round robin took inside the drafting loop give ``plain_in_loop_s`` (reported beside it).
    """
    options = steps.policy.options
    rounds = max(MIN_CALIBRATION_ROUNDS, -(-CALIBRATION_SAMPLES // len(options)))  # after a warm-up (each option once)
    rows = min(prompts.shape[0], CALIBRATION_ROWS)
    prompts, lengths = prompts[:rows], lengths[:rows]
    longest = int(lengths.max())
    segment = max(1, min(max(new_tokens, CALIBRATION_MIN_SEGMENT), context - longest))
    calibration = RoundRobin(options, rounds)
    loop_samples: list[float] = []  # the plain decoding loop, timed before and after the round robin (drift)
    if None in options:
        loop_samples += plain_loop_samples(run, prompts, lengths, segment)
    steps.calibration = calibration
    try:
        _run_segments(calibration, run, prompts, lengths, segment)
        if len(calibration.drafting) > REFINE_OPTIONS:
            # the contenders' prices decide: time them again (their estimate, with what calibration saw accepted)
            calibration.refine([None] + steps.policy.contenders(calibration.prices(), REFINE_OPTIONS), REFINE_ROUNDS)
            _run_segments(calibration, run, prompts, lengths, segment)
        measured = calibration.prices()
    finally:
        steps.calibration = None
    costs = steps.policy.memory.costs
    if not measured:
        return
    unit = measured["plain"]
    if loop_samples:
        loop_samples += plain_loop_samples(run, prompts, lengths, segment)
        costs.plain_in_loop_s = measured["plain"]
        # Prices in plain-loop seconds: each option's paired ratio to the steady in-loop plain step, taking that step
        # as the plain loop's (measured 0.96-1.05 of it; DRAFT_MARGIN covers the difference). So every comparison the
        # policy makes rests on ratios of near steps only: the plain loop is timed seconds apart from the round robin
        # on a machine that drifts, and scaling by their unpaired ratio moved prices by 10-20% from run to run.
        unit = statistics.median(loop_samples)
    costs.step_seconds.update({key: (unit if key == "plain" else ratio * unit) for key, ratio in measured.items()})
    steps.policy.memory.paired.clear()  # corrections of the earlier prices, at another context
    costs.calibrated_context = longest + segment // 2
    costs.acceptance = dict(steps.policy.memory.acceptance)
    if steps.sampling:
        steps.start_sampling_call()  # the calibrating call starts where later ones will


def _run_segments(calibration: RoundRobin, run: Callable[..., Any], prompts: Tensor, lengths: Tensor,
                  segment: int) -> None:
    """Decode calibration segments until the round robin is done (at most ``MAX_CALIBRATION_SEGMENTS``)."""
    for _ in range(MAX_CALIBRATION_SEGMENTS):
        calibration.start_segment()
        run(prompts, lengths, segment)
        if calibration.done:
            break


def plain_loop_samples(run: Callable[..., Any], prompts: Tensor, lengths: Tensor, steps: int,
                       repeats: int = 1) -> list[float]:
    """Seconds per step of the plain decoding loop on ``prompts``, ``repeats`` samples: the cost ``auto`` weighs drafts
    against, since where drafting does not pay it retires to that loop (a plain step inside the drafting loop also
    feeds the drafter and can cost more). Each sample is the difference between decoding ``steps + 1`` tokens and 1
    token (prefill and set-up cancel)."""
    if steps < 1:
        return [float(run(prompts, lengths, 1, plain=True).stats.elapsed_s)]
    samples = []
    for _ in range(repeats):
        short = run(prompts, lengths, 1, plain=True).stats.elapsed_s
        long = run(prompts, lengths, steps + 1, plain=True).stats.elapsed_s
        samples.append(max(long - short, 1e-9) / steps)
    return samples
