"""``ScalarSchedule``: a number as a function of a training counter (optimizer steps, or tokens).

Kinds, with ``t`` the counter:

- ``"constant"``: ``value``;
- ``"step"``: the value of the last milestone ≤ t, e.g. DeepSeek-V3's λ ``{0: 0.3, 10_000_000_000_000: 0.1}``
  (keys strictly increasing, the first one 0);
- ``"linear"``: ``start`` until ``begin``, a straight line to ``end`` at ``until``, then ``end``;
- ``"cosine"``: as ``"linear"`` but along half a cosine: end + (start - end) · (1 + cos(π · p)) / 2.

Example::

    >>> deepseek = ScalarSchedule("step", milestones={0: 0.3, 1000: 0.1})
    >>> deepseek(999), deepseek(1000)
    (0.3, 0.1)
    >>> ScalarSchedule("linear", start=0.0, end=1.0, until=10)(5)
    0.5
    >>> ScalarSchedule("step", milestones={0: 1.0, 20: 0.5, 10: 0.2})
    Traceback (most recent call last):
    ...
    ValueError: milestones steps must be strictly increasing from 0, got [0, 20, 10] (from {0: 1.0, 20: 0.5, 10: 0.2})
"""

from __future__ import annotations

import math
from typing import Optional, Union

from lightning_mtp.callbacks._base import check_int, check_non_negative

KINDS = ("constant", "step", "linear", "cosine")
_ARGUMENTS = {
    "constant": ("value",),
    "step": ("milestones",),
    "linear": ("start", "end", "begin", "until"),
    "cosine": ("start", "end", "begin", "until"),
}


class ScalarSchedule:
    """A non-negative number over a counter; see the module docstring for the kinds.

    Args:
        kind: ``"constant"``, ``"step"``, ``"linear"`` or ``"cosine"``.
        value: the constant (``"constant"``).
        milestones: ``{counter: value}`` (``"step"``).
        start: value up to ``begin`` (``"linear"``/``"cosine"``).
        end: value from ``until`` on (``"linear"``/``"cosine"``).
        begin: counter where the ramp starts.
        until: counter where the ramp ends (> ``begin``).
        name: the argument's name in error messages.
    """

    def __init__(
        self,
        kind: str = "constant",
        value: Optional[float] = None,
        milestones: Optional[dict[int, float]] = None,
        start: Optional[float] = None,
        end: Optional[float] = None,
        begin: int = 0,
        until: Optional[int] = None,
        name: str = "",
    ) -> None:
        prefix = f"{name}." if name else ""
        if kind not in KINDS:
            raise ValueError(f"{prefix}kind must be one of {KINDS}, got {kind!r}")
        given = {"value": value, "milestones": milestones, "start": start, "end": end, "until": until,
                 "begin": begin or None}
        stray = sorted(k for k, v in given.items() if v is not None and k not in _ARGUMENTS[kind])
        if stray:
            raise ValueError(f"{prefix}{', '.join(stray)} do(es) not apply to kind {kind!r} (it takes "
                             f"{', '.join(_ARGUMENTS[kind])}), got {', '.join(f'{k}={given[k]!r}' for k in stray)}")
        self.kind = kind
        self.value = self.start = self.end = None
        self.milestones: dict[int, float] = {}
        self.begin, self.until = begin, until
        if kind == "constant":
            self.value = check_non_negative(f"{prefix}value", value)
        elif kind == "step":
            self.milestones = check_milestones(f"{prefix}milestones", milestones, check_non_negative)
        else:
            self.start = check_non_negative(f"{prefix}start", start)
            self.end = check_non_negative(f"{prefix}end", end)
            check_int(f"{prefix}begin", begin, 0)
            if isinstance(until, bool) or not isinstance(until, int) or until <= begin:
                raise ValueError(f"{prefix}until must be an integer > begin = {begin}, got {until!r}")

    def __call__(self, counter: int) -> float:
        if self.kind == "constant":
            return self.value
        if self.kind == "step":
            return step_value(self.milestones, counter)
        progress = min(1.0, max(0.0, (counter - self.begin) / (self.until - self.begin)))
        if self.kind == "linear":
            return self.start + (self.end - self.start) * progress
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __repr__(self) -> str:
        if self.kind == "constant":
            return f"ScalarSchedule('constant', value={self.value})"
        if self.kind == "step":
            return f"ScalarSchedule('step', milestones={self.milestones})"
        return (f"ScalarSchedule({self.kind!r}, start={self.start}, end={self.end}, begin={self.begin}, "
                f"until={self.until})")


def check_milestones(name: str, milestones: Optional[dict], check_value) -> dict:
    """``{counter: value}`` with counters strictly increasing from 0 (in the order given) and valid values."""
    if not isinstance(milestones, dict) or not milestones:
        raise ValueError(f"{name} must be a non-empty mapping {{step: value}}, got {milestones!r}")
    steps = list(milestones)
    if (
        any(isinstance(s, bool) or not isinstance(s, int) for s in steps)
        or steps[0] != 0
        or any(b <= a for a, b in zip(steps, steps[1:]))
    ):
        raise ValueError(f"{name} steps must be strictly increasing from 0, got {steps} (from {milestones!r})")
    return {step: check_value(f"{name}[{step}]", value) for step, value in milestones.items()}


def step_value(milestones: dict, counter: int):
    """Value of the last milestone at or before ``counter`` (milestones sorted, first at 0)."""
    current = None
    for step, value in milestones.items():
        if step > counter:
            break
        current = value
    return current


def as_schedule(name: str, spec: Union[float, dict, ScalarSchedule]) -> ScalarSchedule:
    """A number (constant), a ``{step: value}`` mapping (step schedule) or a :class:`ScalarSchedule`."""
    if isinstance(spec, ScalarSchedule):
        return spec
    if isinstance(spec, dict):
        return ScalarSchedule("step", milestones=spec, name=name)
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise ValueError(f"{name} must be a number, a {{step: value}} mapping or a ScalarSchedule, got {spec!r}")
    return ScalarSchedule("constant", value=spec, name=name)
