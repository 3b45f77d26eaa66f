"""What the decoder needs from the model that verifies: a trunk forward over a positional state, and its logits.

:class:`DecodingHost` is the whole contract; its state is usually a KV cache. The decoder addresses the state by
position: a forward writes the keys of ``input_ids`` at ``positions`` (per row, so batches may be ragged) and a query
at position p may only see slots 0..p. Every row starts at position 0 (prefill runs positions 0..P-1 of all rows, the
shorter prompts right-padded), and each later forward writes a row's positions contiguously from its current length
on. Rejected drafts are therefore never read again and are overwritten by the next accepted tokens, and
:meth:`DecodingHost.rollback` is only told the new per-row lengths (a no-op for a static positional cache; a host
with a growing cache, e.g. Hugging Face's ``DynamicCache``, crops it there).

:func:`decoding_host` picks the host of a module: ``module.mtp_decoding_host()`` when it returns one, else the
adapter of the bundled :class:`~lightning_mtp.models.CausalLM` (any module with ``allocate_kv_caches``, ``logits``
and ``max_context``), else :class:`~lightning_mtp.decoding.uncached_host.UncachedHost`, which any ``MTPMixin`` module
gets from the mixin's own methods: correct but without a cache (a one-time warning says how to go faster).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.uncached_host import UncachedHost, warn_uncached


@runtime_checkable
class DecodingHost(Protocol):
    """The main model as the decoder sees it."""

    vocab_size: int
    """Valid token ids are ``[0, vocab_size)``."""
    max_context: int
    """Longest sequence (prompt + generated tokens) the model supports. Verification looks up to D positions past
    it (drafts beyond the budget, never emitted), so positions up to ``max_context + D`` must be addressable."""

    def allocate(self, batch_size: int, max_len: int) -> Any:
        """Fresh decoding state (KV caches) for ``batch_size`` rows of up to ``max_len`` positions."""

    def forward(self, input_ids: Tensor, positions: Tensor, state: Any) -> Tensor:
        """Trunk over ``input_ids`` (B, T) at ``positions`` (B, T) using and filling ``state``.

        Returns the last hidden state (B, T, H) before the final norm (what the MTP modules read).
        """

    def main_logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits (B, T, V) from :meth:`forward`'s hidden states."""

    def rollback(self, state: Any, lengths: Tensor) -> None:
        """Each row now holds ``lengths`` (B,) valid positions; later positions may be dropped."""


@runtime_checkable
class TreeHost(DecodingHost, Protocol):
    """A host that can also verify draft *trees* (``GenerationConfig.draft_tree``, drafts beyond D, ``auto``)."""

    def forward_tree(self, input_ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, state: Any) -> Tensor:
        """Like :meth:`DecodingHost.forward`, but token i has rotary position ``positions[:, i]``, is written at
        cache slot ``slots[:, i]`` and sees exactly the slots where ``mask`` (B, 1, T, S) is True."""

    def keep_path(self, state: Any, sources: Tensor, targets: Tensor) -> None:
        """Move the cache entries at slots ``sources`` (B, A) to slots ``targets`` (B, A) (the accepted path to
        its positions); gathers before it writes."""


def supports_trees(host: Any) -> bool:
    return callable(getattr(host, "forward_tree", None)) and callable(getattr(host, "keep_path", None))


class CausalLMHost:
    """:class:`DecodingHost` of the bundled :class:`~lightning_mtp.models.CausalLM` (static positional KV caches)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.vocab_size = int(model.mtp_vocab_size())
        self.max_context = int(model.max_context)

    def allocate(self, batch_size: int, max_len: int) -> list:
        return self.model.allocate_kv_caches(batch_size, max_len)

    def forward(self, input_ids: Tensor, positions: Tensor, state: list) -> Tensor:
        return self.model(input_ids, positions, state)

    def main_logits(self, hidden: Tensor) -> Tensor:
        return self.model.logits(hidden)

    def rollback(self, state: list, lengths: Tensor) -> None:
        """Nothing to do: stale slots are masked by position and overwritten later."""

    def forward_tree(self, input_ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, state: list) -> Tensor:
        """Trunk over tree nodes (B, T): rotary ``positions``, cache ``slots`` and the ``mask`` (B, 1, T, S) of the
        slots each node sees (:class:`TreeHost`)."""
        return self.model(input_ids, positions, state, slots=slots, mask=mask)

    def keep_path(self, state: list, sources: Tensor, targets: Tensor) -> None:
        """Copy every layer's cached keys/values from slots ``sources`` (B, A) to ``targets`` (B, A)."""
        rows = torch.arange(sources.shape[0], device=sources.device).unsqueeze(1)
        for cache in state:
            cache.k[rows, targets] = cache.k[rows, sources]
            cache.v[rows, targets] = cache.v[rows, sources]


def decoding_host(module: nn.Module) -> DecodingHost:
    """The :class:`DecodingHost` of ``module``: its ``mtp_decoding_host()``, the CausalLM adapter, or the uncached
    host of an ``MTPMixin`` module (see the module docstring)."""
    custom = getattr(module, "mtp_decoding_host", None)
    if callable(custom):
        host = custom()
        if host is not None:
            return host
    if all(hasattr(module, name) for name in ("allocate_kv_caches", "logits", "max_context")):
        return CausalLMHost(module)
    if callable(getattr(module, "mtp_trunk_hidden_states", None)):
        warn_uncached(module)
        return UncachedHost(module)
    raise TypeError(
        f"{type(module).__name__} cannot decode: it is not an MTPMixin module (no mtp_trunk_hidden_states); define "
        "mtp_decoding_host() returning a lightning_mtp.decoding.DecodingHost (allocate, forward, main_logits, "
        "rollback, vocab_size, max_context)"
    )


def module_device_dtype(module: nn.Module) -> tuple[torch.device, Optional[torch.dtype]]:
    """Device and floating dtype of the module's first parameter (CPU / None without parameters)."""
    for param in module.parameters():
        return param.device, param.dtype
    return torch.device("cpu"), None
