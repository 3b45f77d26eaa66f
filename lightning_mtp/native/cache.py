"""A positional KV cache that ``transformers`` attention layers can write into, for drafting with native blocks.

``transformers`` attention modules call ``cache.update(first, second, layer_idx, kwargs=...)`` with this forward's
keys and values (B, heads, T, d) -- or, for DeepSeek-V3's multi-head latent attention, the compressed latents -- and
attend over what it returns. :class:`PositionalLayerCache` writes them at the *positions* of the forward's tokens
(set by :meth:`PositionalLayerCache.step` before the block runs) and returns the whole buffer; the additive mask that
:meth:`~PositionalLayerCache.step` returns hides every slot after each query's own position. So, as with the
lightning layout's ``KVCache``, rollback is free: stale entries past a row's position are masked, and overwritten when
the drafter recomputes its window (:mod:`lightning_mtp.decoding.drafting`).

Example::

    >>> import torch
    >>> cache = PositionalLayerCache(batch_size=1, max_len=4)
    >>> mask = cache.step(torch.tensor([[0, 1]]), torch.float32)
    >>> keys, values = cache.update(torch.ones(1, 2, 2, 8), torch.ones(1, 2, 2, 8), 0)
    >>> keys.shape, mask.shape
    (torch.Size([1, 2, 4, 8]), torch.Size([1, 1, 2, 4]))
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mtp.native.module import additive


class PositionalLayerCache:
    """One native MTP block's keys and values by position: (B, heads, L, d) buffers, allocated at the first write
    (their head count and widths are the attention's: keys and values may differ, as in multi-head latent attention)."""

    def __init__(self, batch_size: int, max_len: int) -> None:
        self.batch_size, self.max_len = batch_size, max_len
        self.buffers: Optional[list[Tensor]] = None
        self.positions: Optional[Tensor] = None  # (B, T) slots of the current forward
        self.rows: Optional[Tensor] = None  # (B, 1)

    def step(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """Record the slots (B, T) the next ``update`` writes; return the additive (B, 1, T, L) mask (query at
        position j sees slots <= j)."""
        self.positions = positions
        if self.rows is None:
            self.rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)  # (B, 1)
        slots = torch.arange(self.max_len, device=positions.device)  # (L,)
        visible = slots.view(1, 1, -1) <= positions.unsqueeze(2)  # (B, T, L)
        return additive(visible.unsqueeze(1), dtype)

    def update(self, first: Tensor, second: Tensor, layer_idx: int = 0, kwargs: Any = None, **_: Any):
        """Write (B, h, T, d) keys/latents and values at the recorded slots; return the full (B, h, L, d) buffers."""
        if self.positions is None:
            raise RuntimeError("PositionalLayerCache.update before step(): the slots to write are unknown")
        if self.buffers is None:
            self.buffers = [t.new_zeros(self.batch_size, t.shape[1], self.max_len, t.shape[3]) for t in (first, second)]
        for buffer, new in zip(self.buffers, (first, second)):
            buffer[self.rows, :, self.positions] = new.transpose(1, 2).to(buffer.dtype)  # (B, T, h, d) at (B, T)
        return self.buffers[0], self.buffers[1]

    # What transformers' layers may ask of a cache besides update (sliding windows, lengths): a full-attention view.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.max_len

    @property
    def is_compileable(self) -> bool:
        return False
