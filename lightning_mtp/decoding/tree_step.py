"""One step of tree speculative decoding: draft a tree, verify every node in one trunk forward, keep the accepted path.

The trunk scores ``[newest token, N draft nodes]`` of every row with a tree attention mask (node i at rotary position
``newest + depth(i)``, written at cache slot ``newest + i``, seeing the committed prefix and its ancestors). After
acceptance (:func:`~lightning_mtp.kernels.verify_tree`) the accepted path's keys and values are moved to their real
positions (``TreeHost.keep_path``), the trunk's hidden states along the path go to the drafter, and the accepted tokens
are emitted as in chain decoding. (``auto``'s plain steps run in the decoding loop: ``step.plain_step``.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.drafting import Drafts
from lightning_mtp.decoding.host import TreeHost
from lightning_mtp.decoding.sampling import SamplingParams, logits_to_probs
from lightning_mtp.decoding.state import DecodeState, emit, record_acceptance
from lightning_mtp.decoding.step import accept
from lightning_mtp.decoding.tree import DraftTree, TreeShape, ancestors, tree_attention_mask
from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter, TreeDraftState
from lightning_mtp.kernels import verify_tree
from lightning_mtp.kernels.tree_verify_torch import TreeVerifyOutput
from lightning_mtp.layers import attention_width


def verify_tree_forward(host: TreeHost, cache: Any, state: DecodeState, tree: DraftTree, depth: int) -> Tensor:
    """Trunk over every row's tree (B, N+1); returns its hidden states (B, N+1, H)."""
    newest = state.newest
    size = tree.tokens.shape[1]
    positions = newest.unsqueeze(1) + tree.depths  # (B, T)
    slots = newest.unsqueeze(1) + torch.arange(size, device=newest.device)  # (B, T)
    anc = tree.anc.expand(newest.shape[0], size, size) if tree.anc is not None else ancestors(tree.parents, depth)
    width = attention_width(newest + (size - 1), state.cache_len)  # the slots in use, the tree's included
    mask = tree_attention_mask(newest - 1, newest, anc, width)  # (B, 1, T, W)
    hidden = host.forward_tree(tree.tokens.clamp_min(0), positions, slots, mask, cache)
    state.main_forwards += 1
    return hidden


def accept_tree(tree: DraftTree, logits: Tensor, config: GenerationConfig, depth: int,
                generator: Optional[torch.Generator]) -> TreeVerifyOutput:
    """Greedy: the longest path of target argmaxes; sampling: recursive rejection sampling (exact)."""
    if not config.sampling:
        return verify_tree(tree.tokens, tree.parents, tree.depths, logits, mode="greedy", max_depth=depth,
                           anc=tree.anc)
    probs = logits_to_probs(logits, config.temperature, config.top_k, config.top_p)  # (B, T, V) = p
    return verify_tree(tree.tokens, tree.parents, tree.depths, probs, tree.probs, mode="sampling", max_depth=depth,
                       generator=generator, anc=tree.anc)


def accept_chain(chain: DraftTree, logits: Tensor, config: GenerationConfig,
                 generator: Optional[torch.Generator]) -> TreeVerifyOutput:
    """A chain's verdict by ordinary speculative decoding (greedy: the longest prefix equal to the argmaxes;
    sampling: speculative rejection sampling), as a tree verdict whose path is the accepted prefix."""
    drafts = chain.tokens[:, 1:]  # (B, k)
    draft_probs = chain.probs[:, :-1] if chain.probs is not None else None  # q of each draft: its parent's
    verdict = accept(Drafts(drafts, draft_probs), logits, config, generator)
    path = torch.arange(drafts.shape[1] + 1, device=logits.device).expand(logits.shape[0], -1)
    path = torch.minimum(path, verdict.num_accepted.unsqueeze(1))  # past the accepted prefix: its last node
    return TreeVerifyOutput(verdict.num_accepted, path, verdict.output_tokens)


def tree_step(
    host: TreeHost,
    drafter: MTPTreeDrafter,
    draft_state: TreeDraftState,
    cache: Any,
    state: DecodeState,
    option: TreeShape,
    draft_params: SamplingParams,
    config: GenerationConfig,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Draft a tree of shape ``option``, verify, accept, emit, move the caches.

    Returns the step's summary (one host sync): [all rows done, most tokens a row advanced, active rows, accepted
    drafts per depth (``drafter.max_drafts`` entries)].
    """
    active = ~state.done
    newest = state.newest.clone()
    rows = torch.arange(newest.shape[0], device=newest.device).unsqueeze(1)
    depth = option.depth
    tree = drafter.draft(draft_state, state.tokens, newest, option, draft_params, generator)
    steps = torch.arange(depth + 1, device=newest.device)
    if option.is_chain:  # a chain is causal: the ordinary verify forward, its accepted prefix already in place
        hidden = host.forward(tree.tokens.clamp_min(0), newest.unsqueeze(1) + steps, cache)  # (B, k+1, H)
        state.main_forwards += 1
        verdict = accept_chain(tree, host.main_logits(hidden), config, generator)
    else:
        hidden = verify_tree_forward(host, cache, state, tree, depth)  # (B, T, H)
        verdict = accept_tree(tree, host.main_logits(hidden), config, depth, generator)
        host.keep_path(cache, newest.unsqueeze(1) + verdict.path, newest.unsqueeze(1) + steps)
    drafter.observe(draft_state, hidden[rows, verdict.path], newest.unsqueeze(1) + steps)
    drafted = torch.zeros(newest.shape[0], depth, dtype=torch.long, device=newest.device)
    accepted = record_acceptance(state, drafted, verdict.num_accepted, active)
    accepted = torch.cat([accepted, accepted.new_zeros(drafter.max_drafts - depth)])
    advanced = emit(state, verdict.output_tokens, verdict.num_accepted + 1, config.max_new_tokens, config.eos_token_id)
    host.rollback(cache, state.newest)
    return torch.cat([state.done.all().view(1), advanced.max().view(1), active.sum().view(1), accepted])

