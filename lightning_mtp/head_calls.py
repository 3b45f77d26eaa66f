"""Calling the output heads the way the loss terms and monitors need: chunk by chunk, through the head *modules*
(safe under DeepSpeed ZeRO-3), with the host's logit transform, and without gradient into a shared head under
``MTPConfig.detach_trunk`` (:func:`loss_head`).

Below the mixin: self-distillation (a loss term the mixin registers) and the callbacks both use these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional

from torch import Tensor, nn
from torch.func import functional_call

from lightning_mtp.kernels.linear_cross_entropy_torch import default_chunk_size
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

    Raises:
        ValueError: for a shared head under ``detach_trunk`` whose weight is a DeepSpeed ZeRO-3 partition, which
            cannot be read outside the module call (``zero_settings.validate_mtp_under_zero`` refuses the setting at
            setup; this is the same refusal where that check did not run).
    """
    head = depth_head(pl_module, depth)
    shared = head is depth_head(pl_module, 0)
    if not (pl_module.mtp_config.detach_trunk and shared and any(p.requires_grad for p in head.parameters())):
        return head  # nothing to keep out (a frozen head, e.g. HFCausalLM(freeze_trunk=True), is called as is)
    if any(is_partitioned(p) for p in head.parameters()):
        raise ValueError(
            "MTPConfig.detach_trunk=True (--model.mtp.detach_trunk) with a shared output head "
            "(MTPConfig.share_output_head=True, --model.mtp.share_output_head) cannot be used with DeepSpeed ZeRO "
            "stage 3: keeping the MTP loss terms out of the shared head needs its weight, which is partitioned; use "
            "detach_trunk=False, share_output_head=False, or ZeRO stage 1/2"
        )
    frozen = {name: param.detach() for name, param in head.named_parameters()}

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
