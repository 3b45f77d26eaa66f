"""Analytic FLOPs of one training step of the bundled ``CausalLM`` with MTP: the denominator of the time target.

The count is written from the architecture's matrix products, in the spirit of nanoGPT's 6N + 12·L·H·T
(``estimate_mfu`` in https://github.com/karpathy/nanoGPT/blob/master/model.py), never measured on the step that
runs: work an implementation wastes (a nested recompute, say) then shows up as step time above what this predicts,
instead of landing in the denominator as it does for a FLOP counter.

Rules (B batch rows, T tokens, H hidden, V vocabulary, ``hd`` head size, ``nh``/``nkv`` query/key-value heads, ``F``
the SwiGLU width):

- A product (m × k) @ (k × n) costs 2·m·n·k. A linear layer on N tokens costs 2·N·in·out forward and twice that
  backward (input and weight gradients; every input needs its gradient, down to the embedding output).
- A block on N = B·L tokens: qkv 2·N·H·(nh + 2·nkv)·hd (GQA shrinks k/v), out-projection 2·N·nh·hd·H, gate/up
  2·N·H·2F, down 2·N·F·H. Attention: per query head, scores Q·Kᵀ and the weighted sum P·V, 2·P(L)·hd each, where
  P(L) is the number of (query, key) pairs the kernel computes (:class:`AttentionCost`): forward 2 products,
  backward 5 for a flash kernel (scores recomputed, dV, dP, dQ, dK).
- The fused linear + cross-entropy over the shared head on N scored rows: 3 products of 2·N·H·V (the logits, and
  the gradients dlogits @ W and dlogitsᵀ @ h, all computed in forward; backward only scales them). The main head
  scores B·(T-1) rows, depth k scores B·(T-k-1).
- Depth k runs its module on L = T-k-1 positions: for ``"cascaded"`` eh_proj (2H → H) then a block, for
  ``"parallel"`` a block; forward and backward like the trunk's.
- ``MTPConfig.recompute`` adds exactly one forward of each active depth's module (eh_proj and block): the target of
  activation recomputation, whatever the implementation does.
- Ignored: embedding lookups (gathers, 0), norms, RoPE, SiLU, softmax and other elementwise work (a few FLOPs per
  activation against hundreds per token for the products), AdamW (a few per parameter).

Example::

    >>> from lightning_mtp import MTPConfig
    >>> from lightning_mtp.models import ModelConfig
    >>> flops = training_step_flops(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4),
    ...                             MTPConfig(depth=2, recompute=True), batch=2, seq_len=16, active_depth=2)
    >>> flops["total"] == flops["trunk"] + flops["main_head"] + sum(flops["depth_block"] + flops["depth_head"]
    ...                                                               + flops["recompute"])
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mtp.config import MTPConfig
from lightning_mtp.layers import mlp_hidden_size

if TYPE_CHECKING:
    from lightning_mtp.models import ModelConfig


@dataclass(frozen=True)
class AttentionCost:
    """Which attention products a kernel computes under a causal mask, and how many it runs in backward."""

    key_block: Optional[int]
    """Keys are computed in blocks of this many, from the first up to the block that holds the query's own position
    (so a query at position i costs min(⌈(i+1)/key_block⌉·key_block, L) keys). ``None``: all L keys (the full
    L × L, as explicit matmuls with a mask compute it); 1: exactly the causal triangle L(L+1)/2."""
    backward_products: int
    """Products of the scores' size in backward: 5 for a flash kernel (Q·Kᵀ recomputed, dV, dP, dQ, dK), 4 for
    autograd through explicit matmuls (dQ, dK, dP, dV)."""

    def pairs(self, length: int) -> int:
        """(query, key) pairs computed by one head over ``length`` tokens."""
        if self.key_block is None or self.key_block >= length:
            return length * length
        block = self.key_block
        return sum(min(block, length - start) * min(start + block, length) for start in range(0, length, block))


CPU_FLASH = AttentionCost(key_block=512, backward_products=5)
"""ATen's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, what ``F.scaled_dot_product_attention``
runs on CPU in fp32): keys in blocks of 512 (``kv_split_size``; the query blocks of 32/64/256 divide it), so with
T ≤ 512 it computes the full T × T and masks it (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``)."""

EXPLICIT_MATMULS = AttentionCost(key_block=None, backward_products=4)
"""softmax(mask(Q·Kᵀ))·V written as matmuls: the full L × L forward, autograd's four products backward."""


def linear_flops(tokens: int, in_features: int, out_features: int) -> int:
    """Forward FLOPs of a bias-free linear layer on ``tokens`` rows."""
    return 2 * tokens * in_features * out_features


def block_forward_flops(
    batch: int, length: int, dim: int, n_heads: int, n_kv_heads: Optional[int], mlp_hidden: int,
    attention: AttentionCost = CPU_FLASH,
) -> dict:
    """Forward FLOPs of one :class:`~lightning_mtp.layers.Block` on ``batch`` sequences of ``length`` tokens:
    ``{"linear": ..., "attention": ...}`` (attention: Q·Kᵀ and P·V)."""
    tokens, head_dim, n_kv_heads = batch * length, dim // n_heads, n_kv_heads or n_heads
    linear = (linear_flops(tokens, dim, (n_heads + 2 * n_kv_heads) * head_dim)  # qkv
              + linear_flops(tokens, n_heads * head_dim, dim)  # proj
              + linear_flops(tokens, dim, 2 * mlp_hidden)  # gate_up
              + linear_flops(tokens, mlp_hidden, dim))  # down
    return {"linear": linear, "attention": 2 * 2 * batch * n_heads * attention.pairs(length) * head_dim}


def _forward_backward(forward: dict, attention: AttentionCost) -> dict:
    """Forward plus backward of a piece given its forward ``{"linear", "attention"}``: linear layers 3× forward,
    attention 2 + ``backward_products`` products where forward has 2."""
    return {"linear": 3 * forward["linear"],
            "attention": forward["attention"] // 2 * (2 + attention.backward_products)}


def head_flops(rows: int, dim: int, vocab_size: int) -> int:
    """The fused linear + cross-entropy on ``rows`` scored rows, forward and backward: logits, dlogits @ W and
    dlogitsᵀ @ h, each 2·rows·H·V."""
    return 3 * linear_flops(rows, dim, vocab_size)


def training_step_flops(
    model_config: ModelConfig, mtp_config: MTPConfig, batch: int, seq_len: int, active_depth: int,
    attention: AttentionCost = CPU_FLASH,
) -> dict:
    """Analytic FLOPs of one forward + backward of ``CausalLM.compute_lm_loss`` (the optimizer step is negligible).

    Args:
        model_config: the trunk's :class:`~lightning_mtp.models.ModelConfig`.
        mtp_config: the MTP modules and loss; ``recompute`` adds one forward of each active depth's module.
        batch: B sequences of ``seq_len`` tokens each.
        active_depth: depths 1..active_depth run and are scored (0: next-token training alone).
        attention: what the attention kernel computes (:data:`CPU_FLASH` by default).

    Returns:
        ``trunk`` (the n_layers blocks), ``main_head``, per depth k = 1..active_depth the lists ``depth_block``
        (its module, forward and backward), ``depth_head`` and ``recompute`` (one forward of its module, 0 without
        recompute), ``attention`` (the part of all these spent in Q·Kᵀ and P·V) and ``total``.
    """
    if not 0 <= active_depth <= mtp_config.depth:
        raise ValueError(f"active_depth must lie in [0, MTPConfig.depth={mtp_config.depth}], got {active_depth}")
    if seq_len < active_depth + 2:
        raise ValueError(f"seq_len {seq_len} leaves depth {active_depth} no target (needs ≥ active_depth + 2)")
    if mtp_config.detach_trunk or mtp_config.distill_weight > 0:
        raise ValueError("training_step_flops models MTPConfig.detach_trunk=False and distill_weight=0 only")
    H, V = model_config.dim, model_config.vocab_size
    trunk = block_forward_flops(batch, seq_len, H, model_config.n_heads, model_config.n_kv_heads,
                                mlp_hidden_size(H, model_config.mlp_ratio), attention)
    # The MTP blocks' shape, as CausalLM.mtp_block_spec gives it.
    depth_heads = mtp_config.num_heads or model_config.n_heads
    depth_kv_heads = None if mtp_config.num_heads else model_config.n_kv_heads
    depth_mlp = mlp_hidden_size(H, mtp_config.mlp_ratio or model_config.mlp_ratio)
    trunk_step = _forward_backward(trunk, attention)
    flops = {
        "trunk": model_config.n_layers * sum(trunk_step.values()),
        "main_head": head_flops(batch * (seq_len - 1), H, V),
        "depth_block": [], "depth_head": [], "recompute": [],
        "attention": model_config.n_layers * trunk_step["attention"],
    }
    for k in range(1, active_depth + 1):
        length = seq_len - k - 1  # positions with a target t(i+k+1)
        module = block_forward_flops(batch, length, H, depth_heads, depth_kv_heads, depth_mlp, attention)
        if mtp_config.architecture == "cascaded":
            module["linear"] += linear_flops(batch * length, 2 * H, H)  # eh_proj
        module_step = _forward_backward(module, attention)
        recompute = module if mtp_config.recompute else {"linear": 0, "attention": 0}
        flops["depth_block"].append(sum(module_step.values()))
        flops["depth_head"].append(head_flops(batch * length, H, V))
        flops["recompute"].append(sum(recompute.values()))
        flops["attention"] += module_step["attention"] + recompute["attention"]
    flops["total"] = (flops["trunk"] + flops["main_head"] + sum(flops["depth_block"]) + sum(flops["depth_head"])
                      + sum(flops["recompute"]))
    return flops


class CountedFlops(TorchDispatchMode):
    """The cross-check: FLOPs of the work that actually runs, op by op, with ``torch.utils.flop_counter``'s formulas.

    Two ops that ``FlopCounterMode`` does not register are counted too: ATen's CPU flash attention (with torch's
    own attention formulas: the full L × L; backward recomputed scores, dV, dP, dQ, dK) and the in-place ``addmm_``
    of the fused cross-entropy's weight gradient. Unlike ``FlopCounterMode`` it tracks no modules: that tracker's
    hooks fail ("Expected gradient function to be set") on modules called inside a custom
    ``autograd.Function``'s forward. It counts repeated work, so it checks this model and is never the time
    target's denominator.

    Example::

        >>> with CountedFlops() as counted:
        ...     _ = torch.ones(4, 8) @ torch.ones(8, 2)
        >>> counted.total
        128
    """

    def __init__(self) -> None:
        super().__init__()
        aten = torch.ops.aten
        self.formulas = {**flop_counter.flop_registry, **{op: flop_counter.shape_wrapper(formula) for op, formula in {
            aten._scaled_dot_product_flash_attention_for_cpu:  # (query, key, value, dropout_p, is_causal)
                lambda q, k, v, *_, out_shape=None, **__: flop_counter.sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:  # (grad_out, query, key, value, out, ...)
                lambda grad_out, q, k, v, *_, out_shape=None, **__: flop_counter.sdpa_backward_flop_count(
                    grad_out, q, k, v),
            aten.addmm_: lambda _self, a, b, *_, out_shape=None, **__: flop_counter.mm_flop(a, b),
        }.items()}}
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out
