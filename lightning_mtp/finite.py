"""Non-finite numbers never pass silently: a diverging fit stops, and non-finite weights are neither saved nor decoded.

A NaN or infinite loss, or gradient, is the end of a fit: every later step would write NaN into the weights. The
mixin checks both at each optimizer step (:class:`~lightning_mtp.mixin.divergence.MTPDivergenceGuard`) and stops the
fit with :class:`TrainingDiverged` before the step is taken, so the weights stay as they were and the last checkpoint
written before it is kept. Checkpoints with non-finite weights are refused when saved, and ``generate`` refuses
weights that are not finite.

Example::

    >>> import torch
    >>> nonfinite_tensors({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])})
    ['b']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn


class TrainingDiverged(RuntimeError):
    """A fit stopped at a non-finite loss or gradient; the message says at which step, the losses and what to try."""


def is_finite_number(value: Any) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def nonfinite_tensors(named: Mapping[str, Any]) -> list[str]:
    """Names of the floating-point tensors of ``named`` holding a NaN or an infinity (other entries are skipped)."""
    return [name for name, value in named.items()
            if isinstance(value, Tensor) and value.is_floating_point() and value.numel()
            and not bool(torch.isfinite(value).all())]


def describe_names(names: list[str], limit: int = 3) -> str:
    """``a, b, c and 4 more``."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_finite_state_dict(state_dict: Mapping[str, Any], what: str) -> None:
    """Raise ``ValueError`` when ``state_dict`` holds a non-finite tensor; ``what`` names the thing refused."""
    bad = nonfinite_tensors(state_dict)
    if bad:
        raise ValueError(
            f"{what}: the weights hold NaN or infinite values ({describe_names(bad)}): they come from a fit that "
            "diverged. Use a checkpoint written before the divergence and train again with a lower learning rate"
        )


def _weights_version(module: nn.Module) -> tuple:
    """Changes whenever a parameter or buffer is replaced or modified in place."""
    return tuple((id(t), t._version) for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterable[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def check_finite_weights(module: nn.Module, action: str = "generate") -> None:
    """Refuse to ``action`` with non-finite parameters or buffers (``ValueError`` naming up to three of them).

    The answer is kept per module until a weight changes, so a decode loop calling ``generate`` pays once.
    """
    version = _weights_version(module)
    if getattr(module, "_mtp_finite_weights_version", None) == version:
        return
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    bad = nonfinite_tensors(named)
    if bad:
        raise ValueError(
            f"{action}: {type(module).__name__}'s weights hold NaN or infinite values ({describe_names(bad)}), so "
            "its output would be garbage. They come from a fit that diverged: load a checkpoint written before the "
            "divergence"
        )
    module._mtp_finite_weights_version = version


def divergence_message(step: int, losses: Mapping[str, Optional[float]], gradient_norm: Optional[float],
                       advice: str) -> str:
    """What :class:`TrainingDiverged` says: where, the losses (``{"loss": .., "main": .., "depth 1": ..}``), the
    gradient norm when it was measured, and ``advice``."""
    shown = ", ".join(f"{name} {value:.4g}" for name, value in losses.items() if value is not None)
    norm = f"; gradient norm {gradient_norm:.4g}" if gradient_norm is not None else ""
    return f"training diverged at global step {step}: {shown}{norm}. {advice}"
