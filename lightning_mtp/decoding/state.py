"""What a decoding call keeps per row, and the tensor-only bookkeeping of a step (no host syncs).

:class:`DecodeState` holds the token buffer and each row's position, counters and "done" flag; :func:`emit` appends
each row's accepted tokens (its own count: ragged), stops rows at EOS or their budget and moves each row's newest
position (the rollback of the positional caches); :func:`record_acceptance` adds a step's per-depth counts. Both are
plain tensor code, so a compiled step (``lightning_mtp.decoding.compiled``) can include them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor


@dataclass
class DecodeState:
    """Per-call buffers; every tensor is (B, ...) and stays allocated for the whole call."""

    tokens: Tensor
    """(B, L) prompt, emitted tokens, then scratch (drafts)."""
    newest: Tensor
    """(B,) position of each row's newest token (emitted, not yet run through the trunk)."""
    prompt_lengths: Tensor
    emitted: Tensor
    """(B,) tokens emitted so far."""
    done: Tensor
    """(B,) rows that hit EOS or their budget."""
    row_forwards: Tensor
    steps: Tensor
    """(D+1,) arange: offsets of the verify window and the emitted tokens."""
    drafted: Tensor
    accepted: Tensor
    histogram: Tensor
    last_accepted: Tensor
    """(B,) drafts each row accepted in its last drafting step (``auto`` rates the rows that remain)."""
    main_forwards: int = 0
    stop_ids: Optional[Tensor] = None
    """(S,) the stop ids of a list ``eos_token_id``, made once per call (:func:`emit`)."""
    cache_len: int = 0
    """Slots of the decoding caches (the tree attention masks span them)."""


def new_state(prompts: Tensor, lengths: Tensor, max_new_tokens: int, max_drafts: int) -> DecodeState:
    batch, width = prompts.shape
    device = prompts.device
    tokens = torch.zeros(batch, width + max_new_tokens + max_drafts + 2, dtype=torch.long, device=device)
    tokens[:, :width] = prompts
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    return DecodeState(
        tokens=tokens, newest=lengths - 1, prompt_lengths=lengths.clone(), emitted=zeros.clone(),
        done=torch.zeros(batch, dtype=torch.bool, device=device), row_forwards=zeros.clone(),
        steps=torch.arange(max_drafts + 1, device=device),
        drafted=torch.zeros(max(1, max_drafts), dtype=torch.long, device=device),
        accepted=torch.zeros(max(1, max_drafts), dtype=torch.long, device=device),
        histogram=torch.zeros(max_drafts + 1, dtype=torch.long, device=device),
        last_accepted=zeros.clone(),
    )


def emit(state: DecodeState, out_tokens: Tensor, count: Tensor, max_new_tokens: int,
         eos: Union[int, list[int], None]) -> Tensor:
    """Append ``out_tokens[:, :count]`` (B, k+1) to every unfinished row, cut at EOS (any of a list) and the budget.

    Returns the tokens each row actually advanced by (B,) (0 for finished rows).
    """
    active = ~state.done
    count = torch.minimum(count, max_new_tokens - state.emitted) * active  # (B,)
    width = out_tokens.shape[1]
    steps = state.steps[:width]
    if eos is not None:
        if not isinstance(eos, int) and state.stop_ids is None:
            state.stop_ids = out_tokens.new_tensor(eos)
        stop = out_tokens == eos if isinstance(eos, int) else torch.isin(out_tokens, state.stop_ids)
        is_eos = stop & (steps < count.unsqueeze(1))  # (B, k+1)
        hit = is_eos.any(dim=1)
        count = torch.where(hit, is_eos.long().argmax(dim=1) + 1, count)
    positions = state.newest.unsqueeze(1) + 1 + steps  # (B, k+1)
    keep = steps < count.unsqueeze(1)
    state.tokens.scatter_(1, positions, torch.where(keep, out_tokens, state.tokens.gather(1, positions)))
    state.row_forwards += active
    state.emitted += count
    state.newest += count
    finished = state.emitted >= max_new_tokens
    if eos is not None:
        finished |= hit
    state.done |= finished
    return count


def record_acceptance(state: DecodeState, drafts: Tensor, num_accepted: Tensor, active: Tensor) -> Tensor:
    """Add this step's drafted/accepted counts per depth and the accepted-length histogram; returns the accepted
    count per depth (k,) of this step."""
    k = drafts.shape[1]
    depth = state.steps[1 : k + 1]  # (k,) depths 1..k
    reached = (num_accepted.unsqueeze(1) >= depth) & active.unsqueeze(1)  # (B, k)
    accepted = reached.sum(dim=0)
    state.accepted[:k] += accepted
    state.drafted[:k] += ((drafts >= 0) & active.unsqueeze(1)).sum(dim=0)
    state.histogram.index_add_(0, num_accepted, active.long())
    state.last_accepted.copy_(num_accepted)
    return accepted
