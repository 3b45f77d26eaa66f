"""DeepSpeed ZeRO-3 helpers: chunked cross-entropy through the head *module* when its weight is partitioned.

Under ZeRO-3 a parameter outside a gathered context is an empty partition (its real shape is in ``ds_shape``), so
the fused :func:`lightning_mtp.kernels.linear_cross_entropy`, which takes the head's weight tensor, cannot be used
(Liger-Kernel #767 hit the same). :func:`head_cross_entropy` computes the same weighted, chunked cross-entropy by
calling the head module on each row chunk, inside activation checkpointing: the module's hooks gather its weight in
forward and again when backward recomputes the chunk, and no chunk's logits are kept for backward. The host's logit
transform (``logit_scale``, ``softcap``) is applied to each chunk's head output, as the fused kernel does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mtp.kernels.linear_cross_entropy_torch import (
    LinearCrossEntropyOutput,
    check_logit_transform,
    default_chunk_size,
    resolve_row_weights,
    row_cross_entropy,
    scale_and_cap,
)
from lightning_mtp.sharded import is_zero3_partition


def is_partitioned(param: Tensor) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 parameter (an empty partition outside a gathered context)."""
    return is_zero3_partition(param)


def full_shape(param: Tensor) -> torch.Size:
    """The parameter's real shape, partitioned or not."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def _chunk_cross_entropy(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    row_weights: Tensor,
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk: weighted CE sum, per-row CE (c,) (0 where ignored) and argmax (c,)."""
    logits = scale_and_cap(head(hidden).float(), logit_scale, softcap)  # (c, V)
    row_loss, _, _ = row_cross_entropy(logits, targets, ignore_index)  # (c,), differentiable
    return (row_loss * row_weights).sum(), row_loss.detach(), logits.argmax(dim=-1)


def head_cross_entropy(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    row_weights: Optional[Tensor] = None,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> LinearCrossEntropyOutput:
    """``linear_cross_entropy(hidden, head.weight, ...)`` computed by calling ``head``, for partitioned weights.

    Args:
        hidden: (N, H) rows to score.
        head: the output projection module (``nn.Linear``-like: (c, H) -> (c, V)).
        targets: (N,) target ids, ``ignore_index`` where masked.
        row_weights: (N,) weight of each row in the loss; ``None`` is the mean over valid rows.
        chunk_size: rows of logits materialised at once (default as the fused kernel's).
        logit_scale, softcap: the host's logit transform, as in the fused kernel (1 and ``None``: none).

    Returns:
        The fused kernel's :class:`LinearCrossEntropyOutput`: the weighted loss (differentiable w.r.t. ``hidden`` and
        the head's parameters), per-row CE and argmax (detached).
    """
    check_logit_transform(logit_scale, softcap)
    num_rows = hidden.shape[0]
    weight = getattr(head, "weight", None)
    vocab = full_shape(weight)[0] if weight is not None else head.out_features
    chunk_size = chunk_size or default_chunk_size(num_rows, hidden.shape[1], vocab)
    weights = resolve_row_weights(targets, row_weights, ignore_index)  # (N,)
    # Checkpoint only when backward will run: under no_grad/inference_mode (validation), or with a frozen trunk and
    # head, each chunk is a plain forward and its logits are freed at once.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    losses, row_losses, row_argmax = [], [], []
    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        args = (head, hidden[start:end], targets[start:end], weights[start:end], ignore_index, logit_scale, softcap)
        if recompute:
            loss, row_loss, argmax = checkpoint(_chunk_cross_entropy, *args, use_reentrant=False)
        else:
            loss, row_loss, argmax = _chunk_cross_entropy(*args)
        losses.append(loss)
        row_losses.append(row_loss)
        row_argmax.append(argmax)
    if not losses:  # no rows
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return LinearCrossEntropyOutput(hidden.sum() * 0.0, empty, targets.new_zeros((0,)))
    return LinearCrossEntropyOutput(torch.stack(losses).sum(), torch.cat(row_losses), torch.cat(row_argmax))
