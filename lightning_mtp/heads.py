"""The MTP modules: cascaded (DeepSeek-V3) and parallel (Meta 2024) depth modules.

Each module maps hidden states to the pre-norm hidden state of its depth; its own output norm and the (usually
shared) output head turn that into logits. Checkpoint keys follow DeepSeek-V3's MTP layer: ``enorm``, ``hnorm``,
``eh_proj`` and ``block``/``norm`` (their ``shared_head.norm``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mtp.layers import Block, KVCache, Linear, RMSNorm


class CascadedMTPModule(nn.Module):
    """Depth k of DeepSeek-V3's MTP: h_k = Block(eh_proj([enorm(Emb(t(i+k))); hnorm(h_(k-1))])).

    The embedding comes first in the concatenation, as in the public implementations (Megatron-LM
    ``multi_token_prediction.py``, vLLM ``deepseek_mtp.py``), so converted checkpoints line up.

    Example::

        >>> import torch
        >>> from lightning_mtp.layers import RotaryTable
        >>> module = CascadedMTPModule(dim=32, n_heads=4, n_kv_heads=None, mlp_hidden=64)
        >>> cos, sin = RotaryTable(16, 8)(5)
        >>> module(torch.randn(2, 5, 32), torch.randn(2, 5, 32), cos, sin).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int], mlp_hidden: int, eps: float = 1e-6):
        super().__init__()
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.eh_proj = Linear(2 * dim, dim, bias=False)
        self.block = Block(dim, n_heads, n_kv_heads, mlp_hidden, eps)
        self.norm = RMSNorm(dim, eps)

    def forward(
        self,
        hidden: Tensor,
        token_embedding: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        recompute_chunks: int = 0,
    ) -> Tensor:
        # hidden: h_(k-1) at positions i (B, T, H); token_embedding: Emb(t(i+k)) (B, T, H)
        if recompute_chunks and torch.is_grad_enabled():
            mixed = checkpoint(self.mix, token_embedding, hidden, use_reentrant=False)
        else:
            mixed = self.mix(token_embedding, hidden)
        return self.block(mixed, cos, sin, positions, cache, recompute_chunks)

    def mix(self, token_embedding: Tensor, hidden: Tensor) -> Tensor:
        """eh_proj([enorm(Emb); hnorm(h)]): (B, T, H) twice -> (B, T, H)."""
        return self.eh_proj(torch.cat([self.enorm(token_embedding), self.hnorm(hidden)], dim=-1))


class ParallelMTPHead(nn.Module):
    """Depth k of Meta's multi-token prediction: one transformer block on the trunk's last hidden state.

    Example::

        >>> import torch
        >>> from lightning_mtp.layers import RotaryTable
        >>> head = ParallelMTPHead(dim=32, n_heads=4, n_kv_heads=None, mlp_hidden=64)
        >>> cos, sin = RotaryTable(16, 8)(5)
        >>> head(torch.randn(2, 5, 32), None, cos, sin).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int], mlp_hidden: int, eps: float = 1e-6):
        super().__init__()
        self.block = Block(dim, n_heads, n_kv_heads, mlp_hidden, eps)
        self.norm = RMSNorm(dim, eps)

    def forward(
        self,
        hidden: Tensor,
        token_embedding: Optional[Tensor],
        cos: Tensor,
        sin: Tensor,
        positions: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        recompute_chunks: int = 0,
    ) -> Tensor:
        # hidden: the trunk's h_0 at positions i (B, T, H); the token embedding is unused (same call signature)
        return self.block(hidden, cos, sin, positions, cache, recompute_chunks)


def build_mtp_modules(
    architecture: str, depth: int, dim: int, n_heads: int, n_kv_heads: Optional[int], mlp_hidden: int, eps: float
) -> nn.ModuleList:
    """D modules of the given architecture, index k-1 holding depth k."""
    module_class = CascadedMTPModule if architecture == "cascaded" else ParallelMTPHead
    return nn.ModuleList(module_class(dim, n_heads, n_kv_heads, mlp_hidden, eps) for _ in range(depth))
