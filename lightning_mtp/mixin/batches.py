"""A training batch in ``transformers``' conventions, read: token ids, labels, positions of packed documents and the
padding mask (the formats are listed in :mod:`lightning_mtp.mixin.steps`)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor


def unpack_batch(batch: Any, ignore_index: int = -100) -> tuple[Tensor, Optional[Tensor]]:
    """Token ids and labels from a (B, T) tensor, a (ids, labels) tuple, or a dict with ``input_ids`` and optional
    ``labels`` / ``attention_mask`` (0 turns the label into ``ignore_index``). A packed dict's ``position_ids`` come
    from :func:`batch_position_ids`."""
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (list, tuple)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    input_ids = batch["input_ids"]
    labels = batch.get("labels")
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = (input_ids if labels is None else labels).masked_fill(mask == 0, ignore_index)
    return input_ids, labels


def batch_position_ids(batch: Any) -> Optional[Tensor]:
    """(B, T) ``position_ids`` of a packed dict batch (positions restarting at 0 at each document), else ``None``."""
    return batch.get("position_ids") if isinstance(batch, dict) else None


def batch_mask(batch: Any) -> Optional[Tensor]:
    """(B, T) ``attention_mask`` of a dict batch (1 on tokens, 0 on right padding), else ``None``."""
    return batch.get("attention_mask") if isinstance(batch, dict) else None
