"""The default :class:`~lightning_mtp.decoding.DecodingHost` of any ``MTPMixin`` module: its trunk, without a KV cache.

It is built only on what the mixin already asks of its host (``mtp_trunk_hidden_states``, ``mtp_final_norm``,
``mtp_output_head``, ``mtp_logit_transform``), so every MTP module can ``generate()``, plainly or speculatively,
greedy or sampling, and losslessly. The price: every forward re-runs the trunk over each row's whole sequence.

The "cache" is the token buffer itself, indexed by position like the bundled static KV cache. A forward writes its
tokens at their positions and runs the trunk once over the buffer up to the furthest position asked for. Each row's
tokens start at position 0 (the decoder packs prompts to the front), and the decoder only writes a row from its current
length on, so a query at position p finds that row's committed tokens at 0..p. Whatever lies past p (the right padding
of shorter rows, rejected drafts) sits *after* the query, where a causal trunk does not look: it needs no attention
mask, and the hidden state at p is what the trunk's own forward over the row alone gives. Rollback is therefore a
length change with nothing to do, as for the static caches.

Cost: a forward over a batch whose furthest position is W costs one trunk call over (B, W) tokens instead of (B, T).
Plain decoding of N tokens after P prompt tokens therefore runs the trunk over about N·(P + N/2) positions per row;
speculative decoding divides the number of forwards by τ (tokens per forward), and its verify's extra positions are
almost free here, so it gains more over plain decoding than with a cache. A host with a cache (see
``mtp_decoding_host()`` and the README's "Add MTP to your own module") avoids the re-runs altogether.
"""

from __future__ import annotations

import weakref

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

_WARNED: weakref.WeakSet[type] = weakref.WeakSet()
"""Module classes already told that they decode without a cache (the warning is shown once per class)."""


def decoding_context(module: nn.Module) -> int:
    """Longest prompt + generation the module can decode: verification looks D positions past it, which the trunk
    (``mtp_max_sequence_length()``, when known) and the MTP blocks' RoPE table (``mtp_block_spec()["max_positions"]``)
    must both still hold."""
    depth = module.mtp_config.depth
    limits = [int(module.mtp_block_spec()["max_positions"]) - depth - 1]
    trunk = module.mtp_max_sequence_length()
    if trunk is not None:
        limits.append(int(trunk) - depth)
    return min(limits)


class UncachedHost:
    """:class:`~lightning_mtp.decoding.DecodingHost` of an ``MTPMixin`` module with no KV cache of its own.

    Args:
        module: the module; its ``mtp_trunk_hidden_states(input_ids)`` must be causal (position i reads tokens 0..i
            only), as training already requires.

    The decoding state is a (B, L) buffer of token ids by position; see the module docstring for why the trunk's
    output at every real position is exact without an attention mask.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.vocab_size = int(module.mtp_vocab_size())
        self.max_context = decoding_context(module)

    def allocate(self, batch_size: int, max_len: int) -> Tensor:
        device = self.module.mtp_output_head().weight.device
        return torch.zeros(batch_size, max_len, dtype=torch.long, device=device)  # (B, L) token ids by position

    def forward(self, input_ids: Tensor, positions: Tensor, tokens: Tensor) -> Tensor:
        tokens.scatter_(1, positions, input_ids)
        width = int(positions.max()) + 1
        hidden = self.module.mtp_trunk_hidden_states(tokens[:, :width])  # (B, W, H)
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (tokens.shape[0], width):
            raise ValueError(
                f"{type(self.module).__name__}.mtp_trunk_hidden_states(input_ids) must return (batch, tokens, hidden) "
                f"= ({tokens.shape[0]}, {width}, H) for input_ids of shape {(tokens.shape[0], width)}, got "
                f"{tuple(hidden.shape)}"
            )
        return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, T, H)

    def main_logits(self, hidden: Tensor) -> Tensor:
        module = self.module
        return module.mtp_logit_transform()(module.mtp_output_head()(module.mtp_final_norm()(hidden)))  # (B, T, V)

    def rollback(self, tokens: Tensor, lengths: Tensor) -> None:
        """Nothing to do: a row's stale tokens lie past every query that could read them, and are overwritten."""


def warn_uncached(module: nn.Module) -> None:
    """Say once per module class that it decodes without a cache, and how to decode faster."""
    cls = type(module)
    if cls in _WARNED:
        return
    _WARNED.add(cls)
    rank_zero_warn(
        f"{cls.__name__} decodes without a KV cache: every decoding step re-runs mtp_trunk_hidden_states() over each "
        "row's whole sequence (correct, but slower as sequences grow). To decode faster, define "
        f"{cls.__name__}.mtp_decoding_host() returning a lightning_mtp.decoding.DecodingHost whose forward keeps a "
        "cache (README: 'Add MTP to your own module')."
    )
