"""Parameters split across ranks: DeepSpeed ZeRO-3 partitions and FSDP2 shards (``DTensor``).

Both engines make a parameter whole only around a call of the module that owns it (ZeRO-3: every submodule, or a
leaf module with all its children; FSDP2: a ``fully_shard`` unit and everything below it). Code that reads a weight
outside such a call sees an empty partition (ZeRO-3) or a local shard (FSDP2). This module tells them apart
(:func:`is_sharded`, :func:`holds_sharded_parameters`), calls a small submodule with whole weights outside its
unit's call (:func:`call_whole`, used for the MTP modules' output norms when drafting), and reads and writes whole
weights of ZeRO-3 partitions (:func:`state_shapes`, :func:`load_state_dict_whole`), for loading checkpoints into them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call


def is_dtensor(param: Any) -> bool:
    """Whether ``param`` is a ``DTensor`` (an FSDP2 shard outside its unit's forward)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return False
    return isinstance(param, DTensor)


def is_zero3_partition(param: Any) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 parameter (an empty partition outside a gathered context)."""
    return hasattr(param, "ds_id")


def is_sharded(param: Any) -> bool:
    """Whether ``param`` is split across ranks by DeepSpeed ZeRO-3 or FSDP2."""
    return is_zero3_partition(param) or is_dtensor(param)


def is_fsdp2_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or to one of its submodules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def holds_sharded_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds ZeRO-3 parameters or FSDP2 units: every forward then gathers weights across ranks,
    so ranks that decode must run the same number of forwards (:mod:`lightning_mtp.decoding.lockstep`)."""
    return is_fsdp2_module(module) or any(is_zero3_partition(p) for p in module.parameters())


def call_whole(module: nn.Module, *args: Any) -> Any:
    """``module(*args)`` with whole weights, for a small submodule of a sharded unit called outside that unit's
    forward (an MTP module's output norm when drafting). A collective when they are sharded: every rank calls it.

    ZeRO-3 partitions are gathered (``deepspeed.zero.GatheredParameters``) for the call; FSDP2 shards are gathered
    with ``DTensor.full_tensor()`` and the call runs on those copies, which carry no gradient to the shards, so it is
    refused where autograd would need one (train such weights through the unit's own call).
    """
    params = dict(module.named_parameters())
    if any(is_dtensor(p) for p in params.values()):
        if torch.is_grad_enabled() and any(p.requires_grad for p in params.values()):
            raise RuntimeError(
                f"{type(module).__name__} holds FSDP2 shards outside its unit's forward; its whole weights can be read "
                "here for inference only (under torch.no_grad). Train it through the unit's own call"
            )
        whole = {name: p.full_tensor() if is_dtensor(p) else p for name, p in params.items()}
        return functional_call(module, whole, args)
    partitioned = [p for p in params.values() if is_zero3_partition(p) and p.numel() == 0]
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned):
            return module(*args)
    return module(*args)


def gathered_weights(params: list[Tensor]):
    """A context in which the ZeRO-3 partitions among ``params`` are whole (nothing to do for other tensors)."""
    partitioned = [p for p in params if is_zero3_partition(p) and p.numel() == 0]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


def state_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The real shape of every entry of ``module.state_dict()``: a ZeRO-3 partition's ``ds_shape``, not the empty
    placeholder's ``(0,)``."""
    shapes = {key: tuple(value.shape) for key, value in module.state_dict().items()}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in shapes and is_zero3_partition(param):
            shapes[name] = tuple(param.ds_shape)
    return shapes


def load_state_dict_whole(module: nn.Module, state_dict: Mapping[str, Tensor],
                          strict: bool = True) -> tuple[list[str], list[str]]:
    """``module.load_state_dict(state_dict, strict)`` that also loads into DeepSpeed ZeRO-3 partitions; returns
    ``(missing_keys, unexpected_keys)``.

    Under ZeRO-3 each submodule's own parameters are gathered (``GatheredParameters(..., modifier_rank=0)``), loaded,
    and partitioned again from rank 0's copy, one module at a time, as Lightning's ``load_full_weights`` path does; a
    collective: every rank calls it with the same keys. An empty tensor standing for one of the module's own
    partitioned weights (``module.state_dict()`` under ZeRO-3, copied into a checkpoint to fill keys it leaves out) is
    a placeholder: that weight keeps its value and is not reported missing.

    Raises:
        RuntimeError: a weight of another shape, or, with ``strict``, missing or unexpected keys (as ``torch``).
    """
    if not any(is_zero3_partition(p) for p in module.parameters()):
        result = module.load_state_dict(state_dict, strict=strict)
        return list(result.missing_keys), list(result.unexpected_keys)
    import deepspeed

    params = dict(module.named_parameters(remove_duplicate=False))
    placeholders = {key for key, value in state_dict.items() if key in params and is_zero3_partition(params[key])
                    and value.numel() == 0 and math.prod(params[key].ds_shape) > 0}
    state = {key: value for key, value in state_dict.items() if key not in placeholders}
    metadata = getattr(state_dict, "_metadata", None)
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []

    def load(child: nn.Module, prefix: str) -> None:
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        with deepspeed.zero.GatheredParameters(list(child.parameters(recurse=False)), modifier_rank=0):
            child._load_from_state_dict(state, prefix, local_metadata, True, missing, unexpected, errors)
        for name, grandchild in child._modules.items():
            if grandchild is not None:
                load(grandchild, f"{prefix}{name}.")

    load(module, "")
    missing = [key for key in missing if key not in placeholders]
    if strict and (missing or unexpected):
        errors[:0] = [f"Missing key(s) in state_dict: {missing}. Unexpected key(s) in state_dict: {unexpected}."]
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors))
    return missing, unexpected
