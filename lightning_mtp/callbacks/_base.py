"""What every MTP callback shares: the ``MTPMixin`` check in ``setup``, argument checks that quote the bad value,
and the module-call path from hidden states to a depth's logits (safe under DeepSpeed ZeRO-3)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_mtp.mixin import MTPMixin


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


def depth_head(pl_module: MTPMixin, depth: int) -> nn.Module:
    """The output head module of ``depth`` (0 = the trunk's own head); see ``MTPMixin.mtp_depth_head``."""
    return pl_module.mtp_depth_head(depth)


def row_chunks(num_rows: int, chunk_size: int) -> Iterator[slice]:
    for start in range(0, num_rows, chunk_size):
        yield slice(start, min(start + chunk_size, num_rows))


def chunk_rows(pl_module: MTPMixin, num_rows: int, override: Optional[int] = None) -> int:
    """Rows of [rows × vocab] logits alive at once: ``override``, else the MTP loss's own chunk size."""
    if override is not None:
        return override
    from lightning_mtp.kernels.linear_cross_entropy_torch import default_chunk_size

    configured = pl_module.mtp_config.loss_chunk_size
    if configured is not None:
        return configured
    return default_chunk_size(num_rows, pl_module.mtp_token_embedding().embedding_dim, pl_module.mtp_vocab_size())


def batch_input_ids(batch: Any) -> Tensor:
    from lightning_mtp.mixin import unpack_batch

    return unpack_batch(batch)[0]
