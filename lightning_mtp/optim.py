"""The bundled hosts' optimizer: AdamW with decoupled weight decay on matrices, linear warmup, then cosine decay.

Example::

    >>> import torch
    >>> module = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    >>> config = adamw_warmup_cosine(module, learning_rate=1e-3, weight_decay=0.1, warmup_steps=10, total_steps=100)
    >>> [len(group["params"]) for group in config["optimizer"].param_groups]
    [1, 2]
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lightning_mtp.finite import is_finite_number

NO_DECAY_NAMES = ("embed", ".wte.", ".wpe.")
"""Parameter-name parts of embeddings, which get no weight decay (with norms and biases: every tensor below 2-D)."""


def check_optimizer_args(learning_rate: float, weight_decay: float, warmup_steps: int) -> None:
    """Raise ``ValueError`` naming the ``--model.init_args.*`` flag of a bad value."""
    if not (is_finite_number(learning_rate) and learning_rate > 0):
        raise ValueError(f"--model.init_args.learning_rate must be a finite number > 0, got {learning_rate!r}")
    if not (is_finite_number(weight_decay) and weight_decay >= 0):
        raise ValueError(f"--model.init_args.weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if warmup_steps < 0:
        raise ValueError(f"--model.init_args.warmup_steps must be >= 0, got {warmup_steps!r}")


def warmup_cosine(warmup_steps: int, total_steps: Optional[int]):
    """Learning-rate factor: linear warmup, then cosine to 10% at ``total_steps`` (constant when that is unknown)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None:  # a time budget (max_time): no known end
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def adamw_warmup_cosine(
    module: nn.Module, learning_rate: float, weight_decay: float, warmup_steps: int, total_steps: Optional[int]
) -> dict:
    """Lightning ``configure_optimizers`` result for ``module``'s trainable parameters, stepped per optimizer step."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        ndim = len(getattr(param, "ds_shape", param.shape))  # ZeRO-3 partitions are flat: use the real shape
        embedding = any(part in name for part in NO_DECAY_NAMES)
        (decay if ndim >= 2 and not embedding else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError(f"{type(module).__name__} has no trainable parameter (frozen trunk and no MTP modules?)")
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=learning_rate, betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup_steps, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def estimated_total_steps(module) -> Optional[int]:
    """The fit's optimizer steps when Lightning knows them (``None`` under a time budget or outside a fit)."""
    if getattr(module, "_trainer", None) is None:
        return None
    estimate = float(module.trainer.estimated_stepping_batches)
    return max(1, int(estimate)) if math.isfinite(estimate) else None
