"""What an MTP forward and its loss return: :class:`MTPForward` (handed to loss terms) and :class:`MTPLossOutput`.

Plain containers below the mixin, so that loss terms (self-distillation, the callbacks' penalties) can read them
without importing the mixin.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import Tensor

from lightning_mtp.loss import DepthLosses, depth_targets

LossTerm = Callable[[Any, "MTPForward"], Tensor]
"""``term(module, forward) -> scalar`` added to the training loss (``MTPMixin.register_mtp_loss_term``)."""


@dataclass
class MTPForward:
    """What one MTP forward produced; handed to registered loss terms (callbacks)."""

    input_ids: Tensor  # (B, T)
    labels: Tensor  # (B, T), ignore_index on padding
    trunk_hidden: Tensor  # (B, T, H) h_0, before the final norm
    depth_hidden: list[Tensor]  # per active depth k: (B, T-k-1, H) after the depth's output norm
    main_hidden: Optional[Tensor] = None  # (B, T-1, H) final-normed trunk states, when the main loss is computed
    argmax: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    """Depth k (0: the main head) -> (B, T-k-1) argmax of every position's logits, where a loss pass computed it
    (the validation loss keeps its fused cross-entropy's; the teacher-forced callbacks read and complete it)."""
    position_ids: Optional[Tensor] = None
    """(B, T) positions of a packed batch, restarting at 0 at each document (``None``: one sequence per row). A
    target in another document than its position is never scored: read targets through :meth:`targets`."""

    def targets(self, depth: int, length: int, ignore_index: int = -100) -> Tensor:
        """(B, length) targets of depth k (0: the main head) at positions 0..length-1: t(i+k+1)'s label, and
        ``ignore_index`` where that label is or where t(i+k+1) lies in another document
        (:func:`~lightning_mtp.loss.depth_targets`)."""
        return depth_targets(self.labels, depth, length, self.position_ids, ignore_index)


@dataclass
class MTPLossOutput:
    """Result of :meth:`MTPMixin.compute_mtp_loss` and :meth:`MTPMixin.compute_lm_loss`."""

    loss: Tensor
    """Differentiable total: λ · mean_k(w_k · L_k) [+ main loss when computed] + registered terms."""
    mtp_loss: Tensor
    """Detached λ · mean_k(w_k · L_k)."""
    depth_losses: Tensor
    """(D,) detached mean loss of each depth; 0 for inactive depths."""
    main_loss: Optional[Tensor] = None
    extra_terms: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    forward: Optional[MTPForward] = None
    losses: Optional[DepthLosses] = None  # raw per-row predictions/targets, entry 0 = main when computed
