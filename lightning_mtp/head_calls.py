"""Calling the output heads the way the loss terms and monitors need: chunk by chunk, through the head *modules*
(safe under DeepSpeed ZeRO-3 and FSDP2), with the host's logit transform, and without gradient into a shared head
under ``MTPConfig.detach_trunk`` (:func:`loss_head`).

Below the mixin: self-distillation (a loss term the mixin registers) and the callbacks both use these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from lightning_mtp.kernels.linear_cross_entropy_torch import default_chunk_size
from lightning_mtp.sharded import gathered_weights
from lightning_mtp.zero import is_partitioned

if TYPE_CHECKING:
    from lightning_mtp.mixin import MTPMixin


def depth_head(pl_module: MTPMixin, depth: int) -> nn.Module:
    """The output head module of ``depth`` (0 = the trunk's own head); see ``MTPMixin.mtp_depth_head``."""
    return pl_module.mtp_depth_head(depth)


def loss_head(pl_module: MTPMixin, depth: int) -> Callable[[Tensor], Tensor]:
    """What an MTP training loss term calls for the logits of ``depth`` (0 = the trunk's own head).

    The depth's head module, except under ``MTPConfig.detach_trunk`` when that head is the trunk's (depth 0, or any
    depth with ``share_output_head``): the MTP side must then train the MTP modules only, never the trunk's head nor
    the embedding tied to it (as ``MTPMixin._run_depths`` detaches the head weight of the MTP loss). That head is then
    run by its own ``forward`` on detached parameters, so gradients still reach the hidden states fed to it. Separate
    per-depth heads (``share_output_head=False``) and frozen heads are returned as modules.

    Under DeepSpeed ZeRO-3 that head's weight is a partition outside its call: it is gathered once here and the
    terms score a detached copy of it (V·H more memory while the terms' graph lives). Under FSDP2 the head belongs to
    the root's group, whole inside the mixin's loss (``MTPMixin.mtp_whole_root``).
    """
    head = depth_head(pl_module, depth)
    shared = head is depth_head(pl_module, 0)
    if not (pl_module.mtp_config.detach_trunk and shared and any(p.requires_grad for p in head.parameters())):
        return head  # nothing to keep out (a frozen head, e.g. HFCausalLM(freeze_trunk=True), is called as is)
    params = dict(head.named_parameters())
    if any(is_partitioned(p) for p in params.values()):
        # ZeRO-3: a copy of the gathered weight (its storage goes with the context), applied as the nn.Linear the
        # head is (the mixin's contract): calling the module would run DeepSpeed's hooks on tensors it does not own.
        with gathered_weights(list(params.values())):
            weight = params["weight"].detach().clone()
            bias = params["bias"].detach().clone() if "bias" in params else None
        return lambda hidden: F.linear(hidden, weight, bias)  # (..., H) -> (..., V), no gradient into the head
    frozen = {name: param.detach() for name, param in params.items()}

    def frozen_head(hidden: Tensor) -> Tensor:
        return functional_call(head, frozen, (hidden,))  # (..., H) -> (..., V), no gradient into the head

    return frozen_head


def head_logits(pl_module: MTPMixin, head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``head`` followed by the host's logit transform (``MTPMixin.mtp_logit_transform``: Cohere's scaling, Gemma-2's
    soft-capping), in fp32: logits exactly as the host's loss and decoding form them."""
    transform = pl_module.mtp_logit_transform()
    if transform.is_identity:
        return lambda hidden: head(hidden).float()
    return lambda hidden: transform(head(hidden).float())


def row_chunks(num_rows: int, chunk_size: int) -> Iterator[slice]:
    for start in range(0, num_rows, chunk_size):
        yield slice(start, min(start + chunk_size, num_rows))


def chunk_rows(pl_module: MTPMixin, num_rows: int, override: Optional[int] = None) -> int:
    """Rows of [rows × vocab] logits alive at once: ``override``, else the MTP loss's own chunk size."""
    if override is not None:
        return override
    configured = pl_module.mtp_config.loss_chunk_size
    if configured is not None:
        return configured
    return default_chunk_size(num_rows, pl_module.mtp_token_embedding().embedding_dim, pl_module.mtp_vocab_size())
