"""One step of speculative decoding: draft, verify in one trunk forward, accept, emit.

:func:`speculative_step` is plain tensor code apart from what the drafter and the acceptance rule do on the host
(dynamic draft length, the sampling generator), so ``GenerationConfig.compile`` compiles this very function into one
graph for greedy decoding with a fixed draft length (:mod:`lightning_mtp.decoding.compiled`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.drafting import Drafter, Drafts
from lightning_mtp.decoding.host import DecodingHost
from lightning_mtp.decoding.sampling import SamplingParams, choose_tokens, logits_to_probs, sample
from lightning_mtp.decoding.state import DecodeState, emit, record_acceptance
from lightning_mtp.kernels import VerifyOutput, verify_drafts
from lightning_mtp.kernels.speculative_verify_torch import assemble_output


def verify_forward(host: DecodingHost, cache: Any, state: DecodeState, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Trunk over ``[newest token, k drafts]`` of every row; returns hidden (B, k+1, H), positions, logits."""
    positions = state.newest.unsqueeze(1) + state.steps[: k + 1]  # (B, k+1)
    hidden = host.forward(state.tokens.gather(1, positions), positions, cache)  # (B, k+1, H)
    state.main_forwards += 1
    return hidden, positions, host.main_logits(hidden)


def plain_step(host: DecodingHost, cache: Any, state: DecodeState, params: SamplingParams, config: GenerationConfig,
               generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """The trunk over each row's newest token, the next token chosen from p and emitted; returns the hidden states
    (B, 1, H) and positions (B, 1) (for a drafter). The caller rolls the cache back."""
    hidden, positions, logits = verify_forward(host, cache, state, 0)
    token = choose_tokens(logits[:, 0], params, generator)  # (B,)
    emit(state, token.unsqueeze(1), torch.ones_like(token), config.max_new_tokens, config.eos_token_id)
    return hidden, positions


def accept_typical(
    draft_tokens: Tensor, probs: Tensor, epsilon: float, delta: float, generator: Optional[torch.Generator] = None
) -> VerifyOutput:
    """Medusa's typical acceptance (arXiv 2401.10774, sec. 2.3.1) -- LOSSY, opt-in only.

    Draft x_j is accepted while p_j(x_j) > min(epsilon, delta · exp(-H(p_j))); the token after the accepted prefix is
    sampled from p there. ``probs`` (B, k+1, V) are the processed target probabilities.
    """
    k = draft_tokens.shape[1]
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)  # (B, k+1)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)  # (B, k+1)
    p_draft = probs[:, :k].gather(2, draft_tokens.clamp_min(0).unsqueeze(2)).squeeze(2)  # (B, k)
    ok = (draft_tokens >= 0) & (p_draft > threshold[:, :k])
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (B,)
    rows = torch.arange(probs.shape[0], device=probs.device)
    next_token = sample(probs[rows, num_accepted], generator)  # (B,)
    return assemble_output(draft_tokens, num_accepted, next_token)


def accept(
    drafts: Drafts, logits: Tensor, config: GenerationConfig, generator: Optional[torch.Generator]
) -> VerifyOutput:
    """Which drafts each row keeps, plus its next token (see the module docstring)."""
    if not config.sampling:
        return verify_drafts(drafts.tokens, logits, mode="greedy")
    probs = logits_to_probs(logits, config.temperature, config.top_k, config.top_p)  # (B, k+1, V) = p
    if config.acceptance == "typical":
        return accept_typical(drafts.tokens, probs, config.typical_epsilon, config.typical_delta, generator)
    return verify_drafts(drafts.tokens, probs, drafts.probs, mode="sampling", generator=generator)


def speculative_step(
    host: DecodingHost,
    drafter: Drafter,
    draft_state: Any,
    cache: Any,
    state: DecodeState,
    num_drafts: int,
    draft_params: SamplingParams,
    config: GenerationConfig,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Draft up to ``num_drafts`` tokens per row, verify them, accept, emit and roll the caches back.

    Returns the step's summary, read by the host in one sync: [all rows done, most tokens a row advanced (drafter
    windows), active rows, accepted drafts per depth (adaptive draft length)].
    """
    active = ~state.done
    drafts = drafter.draft(draft_state, state.tokens, state.newest, num_drafts, draft_params, generator,
                           config.draft_confidence_threshold)
    hidden, positions, logits = verify_forward(host, cache, state, drafts.tokens.shape[1])
    drafter.observe(draft_state, hidden, positions)
    verdict = accept(drafts, logits, config, generator)
    accepted = record_acceptance(state, drafts.tokens, verdict.num_accepted, active)
    advanced = emit(state, verdict.output_tokens, verdict.num_accepted + 1, config.max_new_tokens, config.eos_token_id)
    host.rollback(cache, state.newest)
    return torch.cat([state.done.all().view(1), advanced.max().view(1), active.sum().view(1), accepted])
