"""Corrections of ``speculative="auto"``'s step prices from paired steps taken during greedy decoding.

The calibration prices each drafting option by its ratio to a steady plain step, from a few seconds of round robin;
those prices carry noise, enough to prefer the chain of 1 where the chain of 3 gains 15% more (measured on the
quickstart checkpoint: the calibration priced the chains of 1 / 2 / 3 at 1.29 / 1.57 / 1.78 plain steps, the fixed
chains measured 1.27 / 1.44 / 1.63 inside decoding; on the benchmark model it priced the chain of 3 at 1.43 where
it cost 1.33). During decoding the policy takes its best option most of the time and, every ``PROBE_EVERY`` steps,
one of the runners-up (the second- and third-best in turn) twice, so the decode itself holds pairs of near, steady
steps of two drafting options: ``X X Y Y`` gives the ratio of the second ``Y`` to the second ``X``, two steps apart
(drift on a shared machine cancels, as in the calibration; the first step after a switch catches the MTP modules up
and is not used). :class:`PairedPrices` keeps those log ratios and fits one multiplicative correction per option: a
least-squares fit of the pairs' medians, each option's correction held towards 1 by a prior worth ``PRIOR_PAIRS``
pairs. Only drafting options are paired, never a plain
step, so the corrections reshape the drafting options' prices among themselves while the plain price stays the
calibration's (a running average of step times would drift with the machine against it). Sampling calls never use
them: which draft a sampling step makes decides which random numbers it consumes, so it may not depend on timings.

Example::

    >>> prices = PairedPrices()
    >>> calibrated = {"plain": 1.0, "chain1": 1.30, "chain3": 1.80}
    >>> for _ in range(12):  # inside decoding the chain of 3 costs 1.30 times the chain of 1, not 1.38
    ...     kept = prices.add("chain1", "chain3", 1.30)
    >>> corrected = prices.apply(calibrated)  # 12 pairs against the prior's 4 per option
    >>> corrected["plain"], round(corrected["chain3"] / corrected["chain1"], 3)
    (1.0, 1.312)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

PRIOR_PAIRS = 4.0
"""Each option's correction is held towards 1 (the calibration's price) with the weight of this many pairs."""
MAX_PAIRS = 32
"""Per pair of options, only the most recent this many ratios are kept."""
RATIO_BOUNDS = (0.5, 2.0)
"""Ratios outside these bounds are not kept: a burst on a shared machine, not the options' costs (the options' own
prices are rarely more than 1.6 times apart where two of them are both near the best)."""


@dataclass
class PairedPrices:
    """Log ratios of paired steady steps of two drafting options, and the per-option price corrections they give."""

    pairs: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    """(a, b), a < b -> recent samples of log(seconds of b's step / seconds of a's)."""
    factors: dict[str, float] = field(default_factory=dict)
    """option -> multiplicative correction of its calibrated price (absent: 1); refitted after each new pair."""

    def clear(self) -> None:
        """Forget every pair and correction (after a new calibration)."""
        self.pairs.clear()
        self.factors.clear()

    def add(self, earlier: str, later: str, ratio: float) -> bool:
        """Keep one paired ratio (seconds of ``later``'s step / seconds of ``earlier``'s); ``False`` (not kept) for
        a ratio outside ``RATIO_BOUNDS`` or a pair of one option with itself."""
        if earlier == later or not RATIO_BOUNDS[0] <= ratio <= RATIO_BOUNDS[1]:
            return False
        sample = math.log(ratio)
        key = (earlier, later) if earlier < later else (later, earlier)
        values = self.pairs.setdefault(key, [])
        values.append(sample if key[0] == earlier else -sample)
        del values[:-MAX_PAIRS]
        self.factors.clear()  # refitted on the next apply
        return True

    def apply(self, calibrated: dict[str, float]) -> dict[str, float]:
        """``calibrated`` prices (option -> seconds) with the corrections applied (options never paired and
        ``"plain"`` unchanged; without pairs, ``calibrated`` itself)."""
        if not self.pairs:
            return calibrated
        if not self.factors:
            self.factors = self._fit(calibrated)
        return {key: price * self.factors.get(key, 1.0) for key, price in calibrated.items()}

    def _fit(self, calibrated: dict[str, float]) -> dict[str, float]:
        """argmin over log corrections x of PRIOR_PAIRS · Σ x_i² + Σ_pairs n_ab · (log p_b + x_b - log p_a - x_a -
        m_ab)², m_ab the median of the pair's log ratios and n_ab their count; p the calibrated prices."""
        pairs = {key: values for key, values in self.pairs.items()
                 if values and key[0] in calibrated and key[1] in calibrated}
        keys = sorted({option for pair in pairs for option in pair})
        if not keys:
            return {}
        index = {key: i for i, key in enumerate(keys)}
        normal = torch.eye(len(keys), dtype=torch.float64) * PRIOR_PAIRS  # (K, K)
        target = torch.zeros(len(keys), dtype=torch.float64)  # (K,)
        for (a, b), values in pairs.items():
            count = float(len(values))
            residual = statistics.median(values) - (math.log(calibrated[b]) - math.log(calibrated[a]))
            i, j = index[a], index[b]
            normal[i, i] += count
            normal[j, j] += count
            normal[i, j] -= count
            normal[j, i] -= count
            target[j] += count * residual
            target[i] -= count * residual
        corrections = torch.linalg.solve(normal, target)
        return {key: math.exp(float(x)) for key, x in zip(keys, corrections)}


class StepPairs:
    """The last steps of one greedy decoding call, and the paired ratio each ``X X Y Y`` sequence gives (drafting
    options X ≠ Y; see the module docstring)."""

    def __init__(self) -> None:
        self.recent: list[tuple[str, float]] = []  # (option, seconds), the last 4 steps

    def observe(self, key: str, seconds: float) -> tuple[str, str, float] | None:
        """Record a step of option ``key`` (``"plain"`` for a plain step) that took ``seconds``; returns
        ``(X, Y, seconds of Y's second step / seconds of X's second)`` when the last four steps were ``X X Y Y``
        of two drafting options."""
        self.recent.append((key, seconds))
        del self.recent[:-4]
        if len(self.recent) < 4:
            return None
        (x1, _), (x2, x_seconds), (y1, _), (y2, y_seconds) = self.recent
        if x1 == x2 != y1 == y2 and "plain" not in (x1, y1) and x_seconds > 0:
            return x1, y1, y_seconds / x_seconds
        return None
