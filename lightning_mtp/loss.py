"""Per-depth MTP targets, masks and the weighted loss, all depths through one chunked cross-entropy.

Depth k at position i predicts t(i+k+1) (depth 0 is the next-token head). With T tokens, depth k has T-k-1 scored
positions; positions whose target falls past the end are never computed, and targets equal to ``ignore_index``
(padding) are masked. Each depth's mean is over its own valid count, clamped to ≥ 1, so a depth with no valid target
contributes 0, never NaN (Megatron-LM #1532 and #2417 came from getting this normalisation wrong).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_mtp.kernels import linear_cross_entropy


@dataclass
class DepthRows:
    """The scored rows of one depth: normalised hidden states and their targets."""

    depth: int
    hidden: Tensor  # (B, L, H) after the depth's output norm
    targets: Tensor  # (B, L)
    weight: float  # coefficient of this depth's mean loss in the total


@dataclass
class DepthLosses:
    """Result of :func:`weighted_depth_loss`."""

    loss: Tensor
    """Differentiable Σ_k weight_k · mean CE of depth k."""
    per_depth: Tensor
    """(n_depths,) detached mean CE of each depth (0 where nothing is valid)."""
    valid_counts: Tensor
    """(n_depths,) scored tokens of each depth."""
    predictions: list[Tensor] = field(default_factory=list)
    """Per depth (B*L,) argmax predictions, for accuracies."""
    targets: list[Tensor] = field(default_factory=list)
    """Per depth (B*L,) targets, ``ignore_index`` where masked."""


def depth_targets(labels: Tensor, depth: int, length: int) -> Tensor:
    """Targets of depth k for its first ``length`` positions: labels shifted left by k+1. (B, T) -> (B, length)."""
    return labels[:, depth + 1 : depth + 1 + length]


def weighted_depth_loss(
    rows: Sequence[DepthRows],
    head_weight: Tensor | Sequence[Tensor],
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
) -> DepthLosses:
    """Σ_k weight_k · mean_k(CE) with each mean over its own valid count.

    ``head_weight`` is the shared (V, H) output weight, or one weight per entry of ``rows`` when heads are not
    shared. A shared head sends every depth through one chunked cross-entropy call: one weight-gradient buffer, and
    at most one chunk of logits alive at a time.
    """
    flat_hidden, flat_targets, flat_weights, sizes = [], [], [], []
    counts = []
    for entry in rows:
        hidden = entry.hidden.reshape(-1, entry.hidden.shape[-1])  # (B*L, H)
        targets = entry.targets.reshape(-1)  # (B*L,)
        count = (targets != ignore_index).sum()
        counts.append(count)
        # Row weight = depth weight / the depth's own valid count: the weighted sum is then Σ_k w_k · mean_k.
        scale = torch.as_tensor(entry.weight, dtype=torch.float32, device=hidden.device) / count.clamp(min=1)
        flat_hidden.append(hidden)
        flat_targets.append(targets)
        flat_weights.append(scale.expand(targets.shape[0]))
        sizes.append(targets.shape[0])
    counts_t = torch.stack(counts)
    if isinstance(head_weight, Tensor):
        out = linear_cross_entropy(
            torch.cat(flat_hidden), head_weight, torch.cat(flat_targets), torch.cat(flat_weights), ignore_index,
            chunk_size,
        )
        loss, row_loss, row_argmax = out.loss, out.row_loss.split(sizes), out.row_argmax.split(sizes)
    else:
        outs = [
            linear_cross_entropy(h, w, t, rw, ignore_index, chunk_size)
            for h, w, t, rw in zip(flat_hidden, head_weight, flat_targets, flat_weights)
        ]
        loss = torch.stack([o.loss for o in outs]).sum()
        row_loss, row_argmax = [o.row_loss for o in outs], [o.row_argmax for o in outs]
    per_depth = torch.stack([r.sum() for r in row_loss]) / counts_t.clamp(min=1)
    return DepthLosses(loss, per_depth.detach(), counts_t, list(row_argmax), flat_targets)
