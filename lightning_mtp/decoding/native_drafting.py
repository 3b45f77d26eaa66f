"""Chain drafting with native MTP layers (``MTPConfig.layout="native"``, :mod:`lightning_mtp.native`).

The indexing, windows and rollback are :class:`~lightning_mtp.decoding.drafting.MTPDrafter`'s: module k recomputes a
window of positions j ending at ``n - 1`` from h_(k-1)(j) and Emb(t(j+k)), and drafts t(n+k) from position n - 1.
Two things differ for native blocks, and both live in the module and its cache rather than here:

* the block is the trunk's own ``transformers`` decoder layer, which writes its keys and values (or MLA latents)
  through the cache ``update`` protocol: each module gets a :class:`~lightning_mtp.native.PositionalLayerCache`,
  positional like our ``KVCache`` (stale entries past a row's position are masked, then overwritten);
* the chain carries post-normed states (the module's output is ``post_norm``'d, its ``norm`` the identity), and RoPE
  runs at the consumed token's position j + k.

So the drafts are what ``transformers``' ``MtpModel`` drafts in ``generate(use_mtp=True)``: the argmax of the
teacher-forced chain over the accepted tokens followed by the drafts.

Example::

    drafter = chain_drafter(module)     # NativeMTPDrafter for native layouts, MTPDrafter otherwise
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_mtp.decoding.drafting import MTPDrafter, MTPDraftState
from lightning_mtp.native.cache import PositionalLayerCache


class NativeMTPDrafter(MTPDrafter):
    """:class:`MTPDrafter` over native MTP modules: the same draft loop, with caches that ``transformers`` decoder
    layers can write into."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        if not self.cascaded:
            raise ValueError("native MTP layers are cascaded; parallel heads cannot use the native drafter")

    def allocate(self, batch_size: int, max_len: int) -> MTPDraftState:
        weight = self.module.mtp_output_head().weight
        device, dtype = weight.device, weight.dtype
        caches = [PositionalLayerCache(batch_size, max_len) for _ in self.modules]
        # h_0 .. h_(D-1) by position (the deepest module's output is never read); post-normed for k >= 1
        hidden = torch.zeros(self.max_drafts, batch_size, max_len, weight.shape[1], device=device, dtype=dtype)
        rows = torch.arange(batch_size, device=device).unsqueeze(1)  # (B, 1)
        return MTPDraftState(caches, hidden, [0] * self.max_drafts, rows)


def chain_drafter(module: nn.Module, max_depth: Optional[int] = None) -> MTPDrafter:
    """The chain drafter of ``module``'s MTP layout: :class:`NativeMTPDrafter` for ``layout="native"`` (depths up to
    D), else the lightning layout's :class:`MTPDrafter` (up to ``max_depth``)."""
    if getattr(module.mtp_config, "layout", None) == "native":
        return NativeMTPDrafter(module)
    return MTPDrafter(module, max_depth)
