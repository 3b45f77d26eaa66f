"""Verification of drafted tokens (speculative decoding) in plain torch: the CPU path and the reference of the kernel.

A row drafted ``k`` tokens ``x_0..x_{k-1}``; the target model scored the ``k + 1`` positions that follow the prefix.

* ``mode="greedy"``: ``target`` holds logits or probabilities ``(B, k+1, V)``. A draft is accepted while it equals the
  target argmax (first index on ties); the token after the accepted prefix is the target argmax there (the *bonus*
  token when all ``k`` drafts are accepted).
* ``mode="sampling"``: ``target`` holds the target probabilities ``p (B, k+1, V)`` and ``draft_probs`` the draft
  probabilities ``q (B, k, V)`` the drafts were sampled from (both already temperature/top-k/top-p processed and
  normalised). Draft ``x_j`` is accepted when ``u_j · q_j(x_j) < p_j(x_j)`` (i.e. with probability
  ``min(1, p/q)``; ``q_j(x_j) = 0`` rejects) for a float64 uniform ``u_j``. At the first rejection ``j`` a token is
  drawn from ``max(0, p_j - q_j)`` by an exponential race, ``argmax_v r_v / E_v`` with ``E_v ~ Exp(1)`` (no
  normalisation needed); if that residual is all zero, from ``p_j`` the same way. If all ``k`` are accepted, the bonus
  token is drawn from ``p_k`` by the same race. The emitted tokens are then distributed exactly as the target model.

Randomness: :func:`sampling_randomness` draws ``uniforms (B, k)`` float64 then ``exponentials (B, V)`` float32 (one race
per row is ever needed) with torch on the input device; callers may pass either. The Triton kernel consumes the same
tensors, so both backends give identical tokens for the same generator state.

Draft ids outside ``[0, V)`` (e.g. padding ``-1``) are never accepted.

Example::

    >>> import torch
    >>> logits = torch.zeros(1, 3, 5)
    >>> logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 1.0  # target argmax: 2, 4, 1
    >>> out = verify_drafts_torch(torch.tensor([[2, 3]]), logits, mode="greedy")
    >>> out.num_accepted.tolist(), out.output_tokens.tolist()
    ([1], [[2, 4, -1]])
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

MODES = ("greedy", "sampling")


class VerifyOutput(NamedTuple):
    num_accepted: Tensor
    """(B,) int64 in ``[0, k]``: length of the accepted draft prefix."""
    output_tokens: Tensor
    """(B, k+1) int64: ``output_tokens[b, :num_accepted[b] + 1]`` are the accepted drafts then one corrected/bonus
    token; the rest is ``-1``."""


def check_verify_inputs(
    draft_tokens: Tensor, target: Tensor, draft_probs: Optional[Tensor], mode: str
) -> Tuple[int, int, int]:
    """Validate shapes; returns ``(B, k, V)``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be (B, k), got {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[0] != batch or target.shape[1] != k + 1:
        raise ValueError(f"target must be (B, k+1, V) = ({batch}, {k + 1}, V), got {tuple(target.shape)}")
    vocab = target.shape[2]
    if vocab < 1:
        raise ValueError("empty vocabulary")
    if mode == "sampling":
        if draft_probs is None:
            raise ValueError("mode='sampling' needs draft_probs (B, k, V)")
        if tuple(draft_probs.shape) != (batch, k, vocab):
            raise ValueError(f"draft_probs must be ({batch}, {k}, {vocab}), got {tuple(draft_probs.shape)}")
    return batch, k, vocab


def sampling_randomness(
    batch: int,
    k: int,
    vocab: int,
    device: torch.device,
    uniforms: Optional[Tensor] = None,
    exponentials: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> Tuple[Tensor, Tensor]:
    """``uniforms (B, k)`` float64 in [0, 1) and ``exponentials (B, V)`` float32 ~ Exp(1), drawn in that order.

    Given tensors are checked and cast; missing ones are drawn with ``generator`` on ``device``.
    """
    if uniforms is None:
        uniforms = torch.rand((batch, k), dtype=torch.float64, device=device, generator=generator)
    elif tuple(uniforms.shape) != (batch, k):
        raise ValueError(f"uniforms must be ({batch}, {k}), got {tuple(uniforms.shape)}")
    if exponentials is None:
        exponentials = torch.empty((batch, vocab), dtype=torch.float32, device=device)
        exponentials.exponential_(generator=generator)
    elif tuple(exponentials.shape) != (batch, vocab):
        raise ValueError(f"exponentials must be ({batch}, {vocab}), got {tuple(exponentials.shape)}")
    return uniforms.to(device, torch.float64).contiguous(), exponentials.to(device, torch.float32).contiguous()


def assemble_output(draft_tokens: Tensor, num_accepted: Tensor, next_token: Tensor) -> VerifyOutput:
    """(B, k+1) tokens: accepted drafts, then ``next_token``, then -1."""
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device).unsqueeze(0)  # (1, k+1)
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_full((batch, 1), -1, dtype=torch.long)], dim=1)
    n = num_accepted.unsqueeze(1)
    filler = torch.where(positions == n, next_token.unsqueeze(1), torch.full_like(padded, -1))
    return VerifyOutput(num_accepted, torch.where(positions < n, padded, filler))


def verify_drafts_torch(
    draft_tokens: Tensor,
    target: Tensor,
    draft_probs: Optional[Tensor] = None,
    *,
    mode: str = "greedy",
    uniforms: Optional[Tensor] = None,
    exponentials: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> VerifyOutput:
    """Accept the longest valid prefix of each row's drafts and append one corrected (or bonus) token.

    Args:
        draft_tokens: (B, k) int drafted ids.
        target: (B, k+1, V) target logits or probabilities (greedy) / probabilities ``p`` (sampling).
        draft_probs: (B, k, V) draft probabilities ``q`` (sampling only).
        mode: ``"greedy"`` or ``"sampling"``.
        uniforms: (B, k) float64 acceptance uniforms (sampling); drawn from ``generator`` when ``None``.
        exponentials: (B, V) float32 Exp(1) race variables (sampling); drawn from ``generator`` when ``None``.
        generator: torch generator on the input device for the draws.
    """
    batch, k, vocab = check_verify_inputs(draft_tokens, target, draft_probs, mode)
    draft_tokens = draft_tokens.long()
    rows = torch.arange(batch, device=target.device)
    if mode == "greedy":
        target_ids = target.argmax(dim=-1)  # (B, k+1)
        num_accepted = (draft_tokens == target_ids[:, :k]).long().cumprod(dim=1).sum(dim=1)  # (B,)
        next_token = target_ids[rows, num_accepted]  # (B,)
        return assemble_output(draft_tokens, num_accepted, next_token)

    uniforms, exponentials = sampling_randomness(batch, k, vocab, target.device, uniforms, exponentials, generator)
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)
    safe = draft_tokens.clamp(0, vocab - 1).unsqueeze(-1)  # (B, k, 1)
    p_x = target[:, :k].gather(2, safe).squeeze(-1).float().double()  # (B, k)
    q_x = draft_probs.gather(2, safe).squeeze(-1).float().double()
    accepted = in_vocab & (q_x > 0) & (uniforms * q_x < p_x)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (B,)

    p_n = target[rows, num_accepted].float()  # (B, V) target probs where the race happens
    if k > 0:
        q_n = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()
        q_n = torch.where((num_accepted < k).unsqueeze(1), q_n, torch.zeros_like(q_n))  # no q at the bonus position
    else:
        q_n = torch.zeros_like(p_n)
    residual = (p_n - q_n).clamp_min(0.0)
    key_residual = torch.where(residual > 0, residual / exponentials, torch.full_like(residual, -1.0))
    key_target = torch.where(p_n > 0, p_n / exponentials, torch.full_like(p_n, -1.0))
    has_residual = key_residual.max(dim=1).values >= 0
    next_token = torch.where(has_residual, key_residual.argmax(dim=1), key_target.argmax(dim=1))
    return assemble_output(draft_tokens, num_accepted, next_token)
