"""Training losses as means over the scored tokens of a whole optimizer step, not of each batch.

A step's gradient is accumulated over ``accumulate_grad_batches`` batches on each of the ``world_size`` processes;
Lightning divides each batch's loss by the first, and the processes average their gradients. With each batch's loss
the mean over its own scored tokens, a token of a batch that scores 6 tokens weighs as much as 100 tokens of one that
scores 600 (padded chat rows with short and long answers), and the result depends on how the records fall into
batches. Here each depth's summed cross-entropy is divided by the tokens that depth scores in the whole step instead
(every batch of the window, every process), times ``accumulate · world_size`` to undo the averaging: the step's
gradient is that of one batch holding all of them, as ``transformers`` does with ``num_items_in_batch``.

The window's batches come from the training loader (:meth:`~lightning_mtp.data.loading.ResumableDataLoader.
accumulation_window`: ``TextDataModule`` reads each window ahead); the counts are summed over the processes with
one all-reduce per window. A loader of one's own that does not hold its windows keeps per-batch means when
accumulating (warned once); without accumulation only the processes' counts are needed. One process without
accumulation changes nothing (each batch is its own step).

Example::

    >>> import torch
    >>> scored_counts({"input_ids": torch.zeros(1, 6, dtype=torch.long),
    ...                "labels": torch.tensor([[-100, -100, 3, 4, 5, 6]])}, depth=2).tolist()
    [4.0, 4.0, 3.0]
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mtp.loss import depth_targets
from lightning_mtp.mixin.batches import batch_position_ids, unpack_batch


def scored_counts(batch: Any, depth: int, ignore_index: int = -100) -> Tensor:
    """(depth + 1,) float64: the tokens the main head (0) and depths 1..``depth`` score in ``batch``, as
    :meth:`~lightning_mtp.mixin.objective.MTPObjective.compute_lm_loss` scores them (labels shifted by k + 1, ignored
    labels and padding not counted, no target across a packed document)."""
    input_ids, labels = unpack_batch(batch, ignore_index)
    return label_counts(input_ids if labels is None else labels, batch_position_ids(batch), depth, ignore_index)


def label_counts(labels: Tensor, position_ids: Optional[Tensor], depth: int, ignore_index: int) -> Tensor:
    """:func:`scored_counts` of (B, T) ``labels`` (``ignore_index`` where not trained) and packed ``position_ids``."""
    T = labels.shape[1]
    counts = [(depth_targets(labels, k, max(T - k - 1, 0), position_ids, ignore_index) != ignore_index).sum()
              for k in range(depth + 1)]
    return torch.stack(counts).to(torch.float64)


class StepTokens:
    """The per-depth normalizers of the optimizer step a training batch belongs to (see the module docstring)."""

    def __init__(self) -> None:
        self._window: Optional[tuple[int, int]] = None  # (epoch, window) the counts are of
        self._totals: Optional[Tensor] = None
        self.warned = False

    def normalizers(self, module: Any, labels: Optional[Tensor], input_ids: Tensor, position_ids: Optional[Tensor],
                    batch_idx: int) -> Optional[Tensor]:
        """(D + 1,) what each part's summed cross-entropy is divided by (the step's scored tokens over
        ``accumulate · world_size``), or ``None`` for this batch's own counts."""
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return None
        accumulate, world = int(trainer.accumulate_grad_batches), int(trainer.world_size)
        if accumulate == 1 and world == 1:
            return None
        depth, ignore = module.mtp_config.depth, module.mtp_config.ignore_index
        if accumulate == 1:
            local = label_counts(input_ids if labels is None else labels, position_ids, depth, ignore)
        else:
            key = (int(trainer.current_epoch), batch_idx // accumulate)
            if key == self._window and self._totals is not None:
                return self._totals
            window = getattr(trainer.train_dataloader, "accumulation_window", None)
            limit = trainer.num_training_batches  # a pass that limit_train_batches ends early: its last window too
            limit = int(limit) if math.isfinite(limit) else None
            batches = window(batch_idx, limit) if window is not None else None
            if batches is None:
                if not self.warned:
                    self.warned = True
                    from lightning.pytorch.utilities import rank_zero_warn

                    rank_zero_warn("accumulate_grad_batches > 1 with a training loader that does not hold its "
                                   "accumulation windows (TextDataModule's does): each batch's loss stays the mean "
                                   "over its own scored tokens, so a batch of few scored tokens weighs as much as a "
                                   "full one")
                return None
            local = sum(scored_counts(b, depth, ignore) for b in batches).to(input_ids.device)
            self._window = key
        totals = trainer.strategy.reduce(local, reduce_op="sum") if world > 1 else local
        totals = totals.to(torch.float32) / (accumulate * world)
        if accumulate > 1:
            self._totals = totals
        return totals
