"""Keeping ranks in lockstep while decoding under DeepSpeed ZeRO-3 or FSDP2 (every forward all-gathers parameters)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mtp.sharded import holds_sharded_parameters


def needs_rank_sync(module: torch.nn.Module) -> bool:
    """Whether decoding must keep the ranks in lockstep: several processes, and DeepSpeed ZeRO-3 parameters or FSDP2
    units (``fully_shard``), whose every forward all-gathers."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return holds_sharded_parameters(module)


def all_ranks(summary: Tensor) -> Tensor:
    """``[all done, moved, active rows, accepted per depth...]`` (int64) combined over ranks: all done only when
    every rank is (MIN), moved kept local, counts summed (SUM), so every rank takes the same next step."""
    done = summary[:1].clone()
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    counts = summary[2:].clone()
    if counts.numel():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return torch.cat([done, summary[1:2], counts])


def gathered_output_head(module: torch.nn.Module):
    """A context in which the (ZeRO-3) output head weight is whole: the drafter reads its shape and dtype. (Under
    FSDP2 the head belongs to the root's group, whole inside ``generate``: nothing to do.)"""
    head = getattr(module, "mtp_output_head", None)
    weight = getattr(head(), "weight", None) if callable(head) else None
    if weight is None or not hasattr(weight, "ds_id") or weight.numel() > 0:  # not partitioned, or already whole
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight])
