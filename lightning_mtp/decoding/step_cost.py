"""What a decoding step costs: a plain step; a drafting step adds a fixed overhead, a cost per draft depth and a cost
per extra tree node.

A step verifies ``n`` tokens for each of ``B`` rows in one trunk forward (``n = 1`` for a plain step, ``1 + nodes``
when it drafts) after ``m`` drafting calls (one MTP module and the output head each; ``m`` is the draft's depth)::

    seconds = plain                                                     (m = 0)
    seconds = plain + overhead + per_depth · m + per_node · B · (n - 1 - m)   (m >= 1)

* ``plain``: a plain step (a trunk forward over one token per row);
* ``overhead``: what any drafting step adds whatever its depth (verifying drafts, accepting, rolling back);
* ``per_depth``: what one more depth of a chain adds (a drafting call and one more verified token per row);
* ``per_node``: what each tree node beyond the chain adds (a verified token-row), trees only.

**The machine's speed drifts**: a step takes ``speed · cost``, ``speed`` the median over the last :data:`SPEED_WINDOW`
steps of measured over own kind's median seconds; steps are learned as ``seconds / speed`` (ratios decide).

All are medians of the steps the decode runs (a step's time on a busy machine has outliers a mean would follow):
``plain`` over the last :data:`WINDOW` plain steps; each draft depth ``m`` with :data:`MIN_SAMPLES` steps gives a point,
the median of ``seconds - plain - per_node · extra node-rows``, which prices that depth (costs need not be linear in
the depth: a matrix product of 3 rows can take longer than one of 4); a line through the points gives ``overhead``
(at 0) and ``per_depth`` (its slope) for depths not measured; through the origin where one depth is. **Prior**,
until timed, in plain steps: a drafting call costs the bytes of an MTP module and the output head over those of the
trunk and the head (:func:`draft_cost_share`), a verified token-row :data:`TOKEN_SHARE` (``per_node`` always). Only
ratios matter, so the prior needs no timing (and decides alone where timings must not: seeded sampling).

Example::

    >>> cost = StepCost(draft_share=0.25)
    >>> round(cost.seconds(rows=1, tokens=1, drafts=0), 3), round(cost.seconds(rows=1, tokens=3, drafts=2), 3)
    (1.0, 1.6)
    >>> for _ in range(20):
    ...     cost.observe(rows=1, tokens=1, drafts=0, seconds=0.010)
    ...     cost.observe(rows=1, tokens=2, drafts=1, seconds=0.015)
    ...     cost.observe(rows=1, tokens=4, drafts=3, seconds=0.021)
    >>> plain, overhead, per_depth, per_node = cost.parameters()
    >>> round(plain, 4), round(overhead, 4), round(per_depth, 4)
    (0.01, 0.002, 0.003)
    >>> round(cost.seconds(rows=1, tokens=3, drafts=2), 4)
    0.018
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Any, Optional

import torch
from torch import nn

TOKEN_SHARE = 0.05
"""A verified token-row's cost in plain steps, in the prior (small: a decoding step of a few tokens is memory-bound)."""
WINDOW = 32
"""Timed steps of each kind (plain, each draft depth) whose median the costs are."""
SPEED_WINDOW = 8
"""Steps whose median ratio of measured to predicted seconds is the machine's current speed."""
MIN_SAMPLES = 3
"""Timed steps a kind needs before its median counts (a median of 3 ignores one outlier: the first steps of a shape
in a process measure their matrix products, :mod:`lightning_mtp.small_matmul`)."""


def parameter_bytes(module: Optional[nn.Module]) -> int:
    """Bytes of ``module``'s parameters (each shared tensor once); 0 for ``None``."""
    if module is None:
        return 0
    seen, total = set(), 0
    for parameter in module.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            shape = getattr(parameter, "ds_shape", parameter.shape)  # DeepSpeed ZeRO-3 keeps the real shape there
            total += int(torch.Size(shape).numel()) * parameter.element_size()
    return total


def draft_cost_share(module: Any) -> float:
    """One drafting call's cost over a plain step's, memory-bound: (an MTP module + the output head) / (the trunk +
    the head), from the parameters' bytes (the MTP modules are part of ``module`` and left out of the trunk)."""
    modules = module.require_mtp_modules()
    head = parameter_bytes(module.mtp_output_head())
    total = parameter_bytes(module)
    mtp = parameter_bytes(modules) + parameter_bytes(getattr(module, "mtp_output_heads", None))
    per_module = mtp / max(len(modules), 1)
    trunk = max(total - mtp, 1)
    return min(1.0, (per_module + head) / trunk)


class StepCost:
    """The step-cost model of one decoding host, batch size and mode: :meth:`seconds` predicts, :meth:`observe`
    learns (see the module docstring). Plain Python floats: it runs at every decoding step."""

    def __init__(self, draft_share: float, learn: bool = True) -> None:
        self.draft_share, self.learn = draft_share, learn
        self.plain_steps: deque = deque(maxlen=WINDOW)  # seconds
        self.drafting_steps: dict[int, deque] = {}  # depth -> (seconds, extra node-rows) of its last steps
        self.timed = 0
        self.ratios: deque = deque(maxlen=SPEED_WINDOW)  # measured over predicted seconds of the last steps
        self.speed = 1.0  # the machine's speed: median of ratios (1 until kinds are measured)
        self._medians: Optional[tuple[float, dict[int, float]]] = None  # _learned() until the next step
        self._points: dict[int, float] = {}  # depth -> its cost (_point), until its steps or the plain median change
        self._fitted: Optional[tuple[float, float, float, float]] = None  # parameters() until the next step

    def observe(self, rows: int, tokens: int, drafts: int, seconds: float, track_speed: bool = True) -> None:
        """A timed step: ``rows`` rows verified ``tokens`` tokens each after ``drafts`` drafting calls
        (``track_speed=False``: learned as measured, the machine's drift ignored)."""
        if not self.learn or rows <= 0 or not seconds > 0:
            return
        plain, points = self._learned()  # the speed now: the last steps of any kinds, each over its own kind's median
        if track_speed and self.plain_timed and (drafts == 0 or drafts in points):
            extra = TOKEN_SHARE * plain * rows * (tokens - 1 - drafts)
            self.ratios.append(seconds / (plain + points.get(drafts, 0.0) + extra))
            self.speed = median(self.ratios)
        seconds /= self.speed
        if drafts == 0:
            self.plain_steps.append(seconds)
            self._points.clear()
        else:
            steps = self.drafting_steps.setdefault(drafts, deque(maxlen=WINDOW))
            steps.append((seconds, rows * (tokens - 1 - drafts)))
            self._points.pop(drafts, None)
        self.timed += 1
        self._medians = self._fitted = None

    def measured(self, drafts: int) -> bool:
        """Whether steps of ``drafts`` drafting calls are timed often enough for their median to count."""
        return len(self.drafting_steps.get(drafts, ())) >= MIN_SAMPLES

    @property
    def plain_timed(self) -> bool:
        """Whether enough plain steps are timed for the costs to be in seconds."""
        return len(self.plain_steps) >= MIN_SAMPLES

    def parameters(self) -> tuple[float, float, float, float]:
        """(plain, overhead, per_depth, per_node): in seconds at the machine's speed now once :data:`MIN_SAMPLES`
        plain steps are timed, else in plain steps (the prior)."""
        if self._fitted is None:
            plain, points = self._learned()
            per_node = TOKEN_SHARE * plain
            overhead, per_depth = _line(sorted(points.items())) if points else (
                0.0, (self.draft_share + TOKEN_SHARE) * plain)
            speed = self.speed  # at the speed now
            self._fitted = speed * plain, speed * overhead, speed * per_depth, speed * per_node
        return self._fitted

    def _learned(self) -> tuple[float, dict[int, float]]:
        """(a plain step, each timed depth's cost over it), in plain steps until plain steps are timed (memoised)."""
        if self._medians is None:
            timed = self.plain_timed
            plain = median(self.plain_steps) if timed else 1.0
            self._medians = plain, {depth: self._point(depth, plain) for depth, steps in self.drafting_steps.items()
                                    if timed and len(steps) >= MIN_SAMPLES}
        return self._medians

    def _point(self, depth: int, plain: float) -> float:
        """Depth ``depth``'s point (above), recomputed only when its steps or the plain median changed."""
        if depth not in self._points:
            per_node = TOKEN_SHARE * plain
            self._points[depth] = median(s - plain - per_node * extra for s, extra in self.drafting_steps[depth])
        return self._points[depth]

    def seconds(self, rows: int, tokens: int, drafts: int) -> float:
        """A step's predicted cost: a depth timed :data:`MIN_SAMPLES` times at its own median, others on the line;
        never below a tenth of a plain step, so noise cannot price a step at nothing."""
        plain, points = self._learned()
        speed = self.speed
        drafting = 0.0
        if drafts:
            own = points.get(drafts)
            if own is not None:
                drafting = speed * own
            else:  # a depth not timed: on the line
                _, overhead, per_depth, _ = self.parameters()
                drafting = overhead + per_depth * drafts
            drafting += speed * (TOKEN_SHARE * plain) * rows * (tokens - 1 - drafts)  # per_node · extra node-rows
        return max(speed * plain + drafting, 0.1 * (speed * plain))


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``(depth, extra seconds)`` points, both at least 0;
    through the origin where there is one depth, or where the free line would cross below it."""
    through_origin = sum(d * y for d, y in points) / sum(d * d for d, _ in points)
    if len(points) < 2:
        return 0.0, max(through_origin, 0.0)
    mean_d = sum(d for d, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((d - mean_d) * (y - mean_y) for d, y in points) / sum((d - mean_d) ** 2 for d, _ in points)
    intercept = mean_y - slope * mean_d
    if intercept < 0:
        return 0.0, max(through_origin, 0.0)
    if slope < 0:
        return max(mean_y, 0.0), 0.0
    return intercept, slope
