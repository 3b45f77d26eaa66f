"""What every MTP callback shares: the ``MTPMixin`` check in ``setup`` and argument checks that quote the bad value.
The head calls (chunked, ZeRO-3 safe, ``detach_trunk``-aware) are in :mod:`lightning_mtp.head_calls`."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_mtp.mixin import MTPMixin, unpack_batch


class MTPCallback(Callback):
    """Base of the ``lightning_mtp.callbacks``: ``setup`` refuses modules without :class:`~lightning_mtp.MTPMixin`."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        require_mtp_module(pl_module, type(self).__name__)


def require_mtp_module(pl_module: Any, callback: str) -> MTPMixin:
    if not isinstance(pl_module, MTPMixin):
        raise TypeError(
            f"{callback} needs a LightningModule that uses MTPMixin (class M(MTPMixin, L.LightningModule)), "
            f"got {type(pl_module).__name__}"
        )
    return pl_module


def check_non_negative(name: str, value: Any) -> float:
    """A finite number ≥ 0, else ``ValueError`` naming the argument and quoting the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_depth_in_config(pl_module: MTPMixin, callback: str, name: str, depth: int) -> None:
    """Depths above ``MTPConfig.depth`` exist only once the module is known, so this runs in ``setup``."""
    if depth > pl_module.mtp_config.depth:
        raise ValueError(
            f"{callback}: {name} asks for depth {depth}, beyond the module's MTPConfig.depth = "
            f"{pl_module.mtp_config.depth} (--model.mtp.depth)"
        )


def batch_input_ids(batch: Any) -> Tensor:
    return unpack_batch(batch)[0]
