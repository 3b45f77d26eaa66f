"""The MTP modules: cascaded (DeepSeek-V3) and parallel (Meta 2024) depth modules.

Each module maps hidden states to the pre-norm hidden state of its depth; its own output norm and the (usually
shared) output head turn that into logits. Checkpoint keys follow DeepSeek-V3's MTP layer: ``enorm``, ``hnorm``,
``eh_proj`` and ``block``/``norm`` (their ``shared_head.norm``).

With ``MTPConfig.recompute`` a depth runs through :func:`recomputed_depth`: no autograd graph in forward, and one
rerun of every piece in backward.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_mtp.layers import Block, KVCache, Linear, RMSNorm, linear_backward


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
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        # hidden: h_(k-1) at positions i (B, T, H); token_embedding: Emb(t(i+k)) (B, T, H)
        # positions: the cache slots written (decoding); mask: (B, 1, T, S) slots each query sees (tree drafting)
        return self.block(self.block_input(hidden, token_embedding), cos, sin, positions, cache, mask)

    def block_input(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:
        """eh_proj([enorm(Emb); hnorm(h)]): (B, T, H) twice -> (B, T, H)."""
        return self.eh_proj(self.features(hidden, token_embedding))

    def features(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:
        """[enorm(Emb); hnorm(h)]: (B, T, H) twice -> (B, T, 2H), the input of ``eh_proj``."""
        return torch.cat([self.enorm(token_embedding), self.hnorm(hidden)], dim=-1)


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
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        # hidden: the trunk's h_0 at positions i (B, T, H); the token embedding is unused (same call signature)
        return self.block(hidden, cos, sin, positions, cache, mask)

    def block_input(self, hidden: Tensor, token_embedding: Optional[Tensor]) -> Tensor:
        """The block reads the trunk's hidden state as it is."""
        return hidden


def build_mtp_modules(
    architecture: str, depth: int, dim: int, n_heads: int, n_kv_heads: Optional[int], mlp_hidden: int, eps: float
) -> nn.ModuleList:
    """D modules of the given architecture, index k-1 holding depth k."""
    module_class = CascadedMTPModule if architecture == "cascaded" else ParallelMTPHead
    return nn.ModuleList(module_class(dim, n_heads, n_kv_heads, mlp_hidden, eps) for _ in range(depth))


class _RecomputedDepth(torch.autograd.Function):
    """One depth (MTP module and output norm) run without autograd and recomputed once in backward, piece by piece.

    Forward keeps the depth's inputs (h_(k-1) or h_0, and Emb: views of tensors that the next depth or the trunk keep
    anyway, except Emb) and one tensor of its own, the block's residual between its two sublayers,
    x = m + attn(attn_norm(m)) (B, L, H), m being the block's input. x is the price of running the attention once:
    the MLP's backward, which needs all of x, must come before the attention's.

    Backward, given d/dh_k and d/dnorm(h_k):

    1. MLP sublayer and output norm, by token chunks (they are position-wise): rerun a chunk with autograd and
       backpropagate it at once; d/dx overwrites x in place.
    2. m (by token chunks) and attn_norm(m) without autograd, then the attention one key/value head group at a time,
       each group rerun and backpropagated at once (:meth:`~lightning_mtp.layers.Attention.backward_by_group`).
    3. attn_norm and the block input by token chunks. Their norms are elementwise and are evaluated again here
       rather than kept; the cascaded module's ``eh_proj`` is differentiated by hand, so it is not rerun.

    Every matrix product of the depth's forward thus runs once more (the attention's output projection not at all:
    its output is x's summand, never needed again), and at most one chunk or head group of activations is alive at a
    time besides m, attn_norm(m) and its gradient. Parameters are inputs of the function and their gradients are
    returned, so ``torch.autograd.grad`` works; backward runs once (x is consumed).
    """

    @staticmethod
    def forward(ctx, module, cos, sin, chunks, hidden, embedding, *params):
        block = module.block
        x = block.attention_residual(_block_input(module, *_detached(hidden, embedding), chunks), cos, sin)  # (B, L, H)
        out = normed = None
        for start, x_part in _token_chunks(x, chunks):
            out_part = block.mlp_residual(x_part)
            normed_part = module.norm(out_part)
            if out is None:
                out, normed = out_part.new_empty(x.shape), normed_part.new_empty(x.shape)
            out[:, start : start + x_part.shape[1]] = out_part
            normed[:, start : start + x_part.shape[1]] = normed_part
        ctx.module, ctx.chunks, ctx.consumed = module, chunks, False
        device = x.device.type  # backward reruns the pieces under the forward's autocast, as checkpointing does
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        ctx.save_for_backward(hidden, embedding, x, cos, sin)
        ctx.set_materialize_grads(False)
        return out, normed

    @staticmethod
    def backward(ctx, grad_out, grad_normed):
        if ctx.consumed:
            raise RuntimeError("a recomputed MTP depth overwrites its saved activations with gradients: its backward "
                               "runs once")
        ctx.consumed = True
        module, chunks = ctx.module, ctx.chunks
        hidden, embedding, x, cos, sin = ctx.saved_tensors
        hidden, embedding = _detached(hidden, embedding)  # module inputs without autograd history (module hooks)
        params = list(module.parameters())
        need = {id(p): needed for p, needed in zip(params, ctx.needs_input_grad[6:])}
        need_inputs = ctx.needs_input_grad[4:6]
        grads: dict[int, Tensor] = {}
        mlp_params = [p for m in (module.block.mlp_norm, module.block.mlp, module.norm) for p in m.parameters()]
        mlp_ids = {id(p) for p in mlp_params}
        # Anything before the MLP to differentiate? Then d/dx is needed.
        upstream = any(need_inputs) or any(need[id(p)] for p in params if id(p) not in mlp_ids)
        with torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext():
            _mlp_backward(module, x, grad_out, grad_normed, chunks, upstream,
                          [p for p in mlp_params if need[id(p)]], grads)
            input_grads = _input_backward(module, hidden, embedding, x, cos, sin, chunks, need, need_inputs, grads) \
                if upstream else (None, None)
        return (None, None, None, None, *input_grads,
                *(grads.get(id(p)) if need[id(p)] else None for p in params))


def _detached(*tensors: Optional[Tensor]) -> list[Optional[Tensor]]:
    return [t.detach() if t is not None else None for t in tensors]


def _token_chunks(tensor: Tensor, chunks: int):
    """(start, view) of ``tensor`` (B, L, ...) cut into ``chunks`` slices along the tokens (views, never copies)."""
    start = 0
    for part in tensor.chunk(chunks, dim=1):
        yield start, part
        start += part.shape[1]


def _block_input(module: nn.Module, hidden: Tensor, embedding: Optional[Tensor], chunks: int) -> Tensor:
    """``module.block_input`` without autograd, by token chunks (it is position-wise): (B, L, H)."""
    if embedding is None:
        return module.block_input(hidden, None)
    out = None
    for start, hidden_part in _token_chunks(hidden, chunks):
        part = module.block_input(hidden_part, embedding[:, start : start + hidden_part.shape[1]])
        out = part.new_empty(hidden.shape) if out is None else out
        out[:, start : start + part.shape[1]] = part
    return out


def _mlp_backward(module, x: Tensor, grad_out, grad_normed, chunks: int, upstream: bool, params: list, grads: dict):
    """Step 1: the MLP sublayer and the output norm by token chunks, each rerun and backpropagated at once. With
    ``upstream``, d/dx replaces x chunk by chunk."""
    given = [(i, g) for i, g in enumerate((grad_out, grad_normed)) if g is not None]
    for start, x_part in _token_chunks(x, chunks):
        window = slice(start, start + x_part.shape[1])
        leaf = x_part.detach().requires_grad_(upstream)
        with torch.enable_grad():
            out_part = module.block.mlp_residual(_non_leaf(leaf))
            results = (out_part, module.norm(out_part))
        found = _grad([results[i] for i, _ in given], [g[:, window] for _, g in given], [leaf] * upstream + params)
        if upstream:
            x_part.copy_(found.pop(0))
        _accumulate(grads, params, found)


def _input_backward(module, hidden, embedding, grad_x, cos, sin, chunks, need, need_inputs, grads):
    """Steps 2 and 3: the attention by head groups, then attn_norm and the block input by token chunks, from d/dx
    (``grad_x``, in x's storage). Returns d/dhidden and d/dembedding (``None`` where not needed)."""
    block = module.block
    projection = getattr(module, "eh_proj", None)  # the cascaded module's mix; the parallel block reads h_0 as is
    block_input = _block_input(module, hidden, embedding, chunks)  # (B, L, H)
    attention = (block.attn.qkv.weight, block.attn.proj.weight)
    grad_normed_input, *attention_grads = block.attn.backward_by_group(
        block.attn_norm(block_input), cos, sin, grad_x, any(need[id(p)] for p in attention))
    _accumulate(grads, list(attention), attention_grads)  # the caller returns only the needed ones
    norm_params = [p for p in block.attn_norm.parameters() if need[id(p)]]
    feature_params = [p for name, m in module.named_children() if name in ("enorm", "hnorm")
                      for p in m.parameters() if need[id(p)]]
    projection_grad = None
    if projection is not None and need[id(projection.weight)]:
        projection_grad = grads.setdefault(id(projection.weight), torch.zeros_like(projection.weight))
    grad_embedding = torch.empty_like(embedding) if embedding is not None and need_inputs[1] else None
    for start, input_part in _token_chunks(block_input, chunks):
        window = slice(start, start + input_part.shape[1])
        leaf = input_part.detach().requires_grad_()
        with torch.enable_grad():
            normed_part = block.attn_norm(_non_leaf(leaf))
        found = _grad([normed_part], [grad_normed_input[:, window]], [leaf] + norm_params)
        grad_input = found.pop(0).add_(grad_x[:, window])  # attn_norm's branch and the residual's
        _accumulate(grads, norm_params, found)
        if projection is None:  # the block input is the hidden state itself
            grad_x[:, window] = grad_input
            continue
        leaves = [t[:, window].detach().requires_grad_(needed) for t, needed in zip((hidden, embedding), need_inputs)]
        with torch.enable_grad():
            features = module.features(*map(_non_leaf, leaves))  # (B, l, 2H)
        grad_features = linear_backward(features.detach(), projection.weight, grad_input, projection_grad)
        found = _grad([features], [grad_features.to(features.dtype)], [t for t in leaves if t.requires_grad]
                      + feature_params)
        for t, grad in zip(leaves, (grad_x, grad_embedding)):
            if t.requires_grad:
                grad[:, window] = found.pop(0)
        _accumulate(grads, feature_params, found)
    return (grad_x if need_inputs[0] else None), grad_embedding


def _non_leaf(tensor: Optional[Tensor]) -> Optional[Tensor]:
    """A view of a leaf that requires grad, for use as a module's input: module trackers (``FlopCounterMode``'s) hook
    module inputs, and ``torch.autograd.grad`` cannot run such a hook on a leaf."""
    return tensor.view_as(tensor) if tensor is not None and tensor.requires_grad else tensor


def _grad(outputs: list[Tensor], grad_outputs: list[Tensor], inputs: list[Tensor]) -> list[Optional[Tensor]]:
    """``torch.autograd.grad`` over the outputs that require grad; ``None`` for inputs they do not reach."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not inputs or not pairs:
        return [None] * len(inputs)
    return list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))


def _accumulate(grads: dict, params: list, found: list) -> None:
    for param, grad in zip(params, found):
        if grad is not None:
            grads[id(param)] = grad if id(param) not in grads else grads[id(param)].add_(grad)


def recomputed_depth(
    module: nn.Module, hidden: Tensor, embedding: Optional[Tensor], cos: Tensor, sin: Tensor, chunks: int
) -> tuple[Tensor, Tensor]:
    """(h_k, norm(h_k)) of one depth, each (B, L, H), its activations recomputed in backward
    (:class:`_RecomputedDepth`); its position-wise pieces run in ``chunks`` token chunks."""
    return _RecomputedDepth.apply(module, cos, sin, chunks, hidden, embedding, *module.parameters())
