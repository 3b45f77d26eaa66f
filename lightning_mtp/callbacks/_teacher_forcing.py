"""Teacher-forced evaluation of every MTP depth, shared by the coupling monitor and the draft calibration.

Depth k at position i drafts t(i+k+1); the main model verifies it with its own prediction at position i+k. Both are
computed on the real tokens (teacher forcing), under ``no_grad``, for every configured depth (inference drafts with
all of them, whatever the active depth of training is).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_mtp.head_calls import chunk_rows, depth_head, head_logits, row_chunks
from lightning_mtp.mixin import MTPForward, MTPMixin, unpack_batch


def teacher_forced_forward(module: MTPMixin, input_ids: Tensor, labels: Optional[Tensor] = None) -> MTPForward:
    """Every configured depth's hidden states, and ``main_hidden``, under ``no_grad``."""
    with torch.no_grad():
        active = module.mtp_active_depth
        module.mtp_active_depth = module.mtp_config.depth
        try:
            hidden = module.mtp_trunk_hidden_states(input_ids)  # (B, T, H)
            fwd = module.mtp_forward(hidden, input_ids, labels)
        finally:
            module.mtp_active_depth = active
        fwd.main_hidden = module.mtp_final_norm()(hidden[:, :-1])  # (B, T-1, H)
    return fwd


def batch_forward(module: MTPMixin, batch: Any) -> MTPForward:
    input_ids, labels = unpack_batch(batch, module.mtp_config.ignore_index)
    return teacher_forced_forward(module, input_ids, labels)


def sequence_logits(
    module: MTPMixin, fwd: MTPForward, chunk_size: Optional[int] = None
) -> Iterator[tuple[slice, Tensor, list[Tensor]]]:
    """Per chunk of sequences: (the sequences, main logits (b, T-1, V), [depth k logits (b, T-k-1, V)]), fp32.

    Whole sequences go together so that depth k at i meets the main model at i+k; about ``chunk_size`` rows of
    logits per depth are alive at once (at least one sequence).
    """
    batch, length = fwd.input_ids.shape
    rows = chunk_rows(module, batch * length, chunk_size)
    heads = [head_logits(module, depth_head(module, k)) for k in range(len(fwd.depth_hidden) + 1)]
    with torch.no_grad():
        for part in row_chunks(batch, max(1, rows // length)):
            main = heads[0](fwd.main_hidden[part])  # (b, T-1, V)
            depths = [heads[k](h[part]) for k, h in enumerate(fwd.depth_hidden, start=1)]  # (b, T-k-1, V) each
            yield part, main, depths


def scored_positions(labels: Tensor, depth: int, length: int, ignore_index: int) -> Tensor:
    """(B, length) bool: the tokens t(i+1)..t(i+depth+1) drafted or verified at position i are all scored."""
    scored = labels[:, 1:] != ignore_index  # (B, T-1): target of main position j is t(j+1)
    valid = scored[:, :length].clone()
    for offset in range(1, depth + 1):
        valid &= scored[:, offset : offset + length]
    return valid
