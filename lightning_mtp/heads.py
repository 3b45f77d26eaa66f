"""The MTP modules: cascaded (DeepSeek-V3) and parallel (Meta 2024) depth modules.

Each module maps hidden states to the pre-norm hidden state of its depth; its own output norm and the (usually
shared) output head turn that into logits. Checkpoint keys follow DeepSeek-V3's MTP layer: ``enorm``, ``hnorm``,
``eh_proj`` and ``block``/``norm`` (their ``shared_head.norm``).

With ``MTPConfig.recompute`` a depth runs through :func:`recomputed_depth`: no autograd graph in forward, and one
rerun of every piece in backward.

The training loop calls a module once per depth and gets both h_k and norm(h_k) from that call
(``module(..., normed=True)``, or ``recompute=chunks``): every weight of a depth is then used inside its module's
call, which is where sharding engines make them whole (FSDP2 unshards a ``fully_shard`` unit around its forward,
DeepSpeed ZeRO-3 gathers a leaf module's parameters around it).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_mtp.layers import (
    Block,
    KVCache,
    Linear,
    RMSNorm,
    linear_backward,
    rms_norm_backward,
    rms_norm_backward_applies,
)


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
        normed: bool = False,
        recompute: Optional[int] = None,
    ) -> Union[Tensor, tuple[Tensor, Tensor]]:
        """h_k (B, T, H); with ``normed`` the pair (h_k, norm(h_k)); with ``recompute`` (token chunks) that pair from
        :func:`recomputed_depth` (training only: no cache, no ``positions``).

        hidden: h_(k-1) at positions i (B, T, H); token_embedding: Emb(t(i+k)) (B, T, H); positions: the cache slots
        written (decoding); mask: (B, 1, T, S) slots each query sees (tree drafting, packed documents)."""
        if recompute is not None:
            return recomputed_depth(self, hidden, token_embedding, cos, sin, recompute, mask)
        out = self.block(self.block_input(hidden, token_embedding), cos, sin, positions, cache, mask)
        return (out, self.norm(out)) if normed else out

    def block_input(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:
        """eh_proj([enorm(Emb); hnorm(h)]): (B, T, H) twice -> (B, T, H)."""
        return self.eh_proj(self.features(hidden, token_embedding))

    def features(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:
        """[enorm(Emb); hnorm(h)]: (B, T, H) twice -> (B, T, 2H), the input of ``eh_proj``."""
        return torch.cat(self.feature_parts(hidden, token_embedding), dim=-1)

    def feature_parts(self, hidden: Tensor, token_embedding: Tensor) -> tuple[Tensor, Tensor]:
        """(enorm(Emb), hnorm(h)), (B, T, H) each, in the order of ``eh_proj``'s input columns."""
        return self.enorm(token_embedding), self.hnorm(hidden)


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
        normed: bool = False,
        recompute: Optional[int] = None,
    ) -> Union[Tensor, tuple[Tensor, Tensor]]:
        """As :meth:`CascadedMTPModule.forward`; ``hidden`` is the trunk's h_0 at positions i (B, T, H) and the token
        embedding is unused (same call signature)."""
        if recompute is not None:
            return recomputed_depth(self, hidden, None, cos, sin, recompute, mask)
        out = self.block(hidden, cos, sin, positions, cache, mask)
        return (out, self.norm(out)) if normed else out

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
    anyway; Emb is the trunk's own lookup where the mixin could catch it, ``TrunkEmbeddings``) and one tensor of its
    own, the block's residual between its two sublayers,
    x = m + attn(attn_norm(m)) (B, L, H), m being the block's input. x is the price of running the attention once:
    the MLP's backward, which needs all of x, must come before the attention's.

    Backward, given d/dh_k and d/dnorm(h_k):

    1. MLP sublayer and output norm, by token chunks (they are position-wise): rerun a chunk and backpropagate it at
       once, the two products by hand into one weight-gradient buffer each; d/dx overwrites x in place.
    2. One batch row at a time: the row's m and attn_norm(m) without autograd, then its attention one key/value head
       group at a time, each group rerun and backpropagated at once
       (:meth:`~lightning_mtp.layers.Attention.backward_by_group`).
    3. In the same row, attn_norm and the block input by token chunks. Their norms are elementwise and are evaluated
       again here rather than kept; the cascaded module's ``eh_proj`` is differentiated by hand, so it is not rerun.
       d/dEmb goes into the storage of d/dnorm(h_k), consumed in step 1, when that storage is provably this depth's
       own (:func:`_spent_buffer`).

    Every matrix product of the depth's forward thus runs once more (the attention's output projection not at all:
    its output is x's summand, never needed again), and at most one chunk, or one row's m, attn_norm(m), its gradient
    and one head group, is alive at a time: this working set sits on top of every trunk activation (the trunk's
    backward waits for all depths), so it is what recompute's peak memory is made of. Parameters are inputs of the
    function and their gradients are returned, so ``torch.autograd.grad`` works; backward runs once (x is consumed).
    With packed documents the attention mask (B, 1, L, L) and per-token RoPE tables are kept with the inputs, and the
    rerun attends exactly as the forward did.
    """

    @staticmethod
    def forward(ctx, module, cos, sin, mask, chunks, hidden, embedding, *params):
        block = module.block
        x = block.attention_residual(_block_input(module, *_detached(hidden, embedding), chunks), cos, sin,
                                     mask)  # (B, L, H)
        out = normed = None
        for start, x_part in _token_chunks(x, chunks):
            out_part = block.mlp_residual(x_part)
            normed_part = module.norm(out_part)
            if out is None:
                out, normed = out_part.new_empty(x.shape), normed_part.new_empty(x.shape)
            out[:, start : start + x_part.shape[1]] = out_part
            normed[:, start : start + x_part.shape[1]] = normed_part
        ctx.module, ctx.chunks, ctx.consumed = module, chunks, False
        ctx.normed_storage = StorageWeakRef(normed.untyped_storage())  # see _spent_buffer
        device = x.device.type  # backward reruns the pieces under the forward's autocast, as checkpointing does
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        ctx.save_for_backward(hidden, embedding, x, cos, sin, mask)
        ctx.set_materialize_grads(False)
        return out, normed

    @staticmethod
    def backward(ctx, grad_out, grad_normed):
        if ctx.consumed:
            raise RuntimeError("a recomputed MTP depth overwrites its saved activations with gradients: its backward "
                               "runs once")
        ctx.consumed = True
        module, chunks = ctx.module, ctx.chunks
        hidden, embedding, x, cos, sin, mask = ctx.saved_tensors
        hidden, embedding = _detached(hidden, embedding)  # module inputs without autograd history (module hooks)
        params = list(module.parameters())
        need = {id(p): needed for p, needed in zip(params, ctx.needs_input_grad[7:])}
        need_inputs = ctx.needs_input_grad[5:7]
        grads: dict[int, Tensor] = {}
        mlp_params = [p for m in (module.block.mlp_norm, module.block.mlp, module.norm) for p in m.parameters()]
        mlp_ids = {id(p) for p in mlp_params}
        # Anything before the MLP to differentiate? Then d/dx is needed.
        upstream = any(need_inputs) or any(need[id(p)] for p in params if id(p) not in mlp_ids)
        with torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext():
            _mlp_backward(module, x, grad_out, grad_normed, chunks, upstream,
                          [p for p in mlp_params if need[id(p)]], grads)
            spent = _spent_buffer(grad_normed, ctx.normed_storage, embedding)
            input_grads = _input_backward(module, hidden, embedding, x, cos, sin, chunks, need, need_inputs, grads,
                                          spent, mask) if upstream else (None, None)
        return (None, None, None, None, None, *input_grads,
                *(grads.get(id(p)) if need[id(p)] else None for p in params))


def _spent_buffer(grad_normed: Optional[Tensor], normed_storage: StorageWeakRef,
                  embedding: Optional[Tensor]) -> Optional[Tensor]:
    """``grad_normed`` as a buffer for d/dEmb, when it is provably nobody else's after the MLP step: it lies in the
    storage of this depth's own ``normed`` output, where the loss wrote it because nothing else reads those states
    (``score_jointly(private=True)``). The MLP step consumes it; reusing it saves one B·L·H buffer next to every
    trunk activation. ``None`` otherwise (another gradient tensor may be shared: autograd gives no such promise)."""
    if grad_normed is None or embedding is None or normed_storage.expired():
        return None
    if (grad_normed.untyped_storage()._cdata != normed_storage.cdata or grad_normed.shape != embedding.shape
            or grad_normed.dtype != embedding.dtype or not grad_normed.is_contiguous()):
        return None
    return grad_normed


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
    """Step 1: the MLP sublayer and the output norm by token chunks, each rerun and backpropagated at once
    (:func:`_mlp_chunk_backward`). With ``upstream``, d/dx replaces x chunk by chunk."""
    block, wanted = module.block, {id(p) for p in params}
    weight_grads = [grads.setdefault(id(w), torch.zeros_like(w)) if id(w) in wanted else None
                    for w in (block.mlp.gate_up.weight, block.mlp.down.weight)]
    for start, x_part in _token_chunks(x, chunks):
        window = slice(start, start + x_part.shape[1])
        _mlp_chunk_backward(module, x_part, *(None if g is None else g[:, window] for g in (grad_out, grad_normed)),
                            upstream, weight_grads, wanted, grads)


def _mlp_chunk_backward(module, x_part: Tensor, grad_out, grad_normed, upstream: bool, weight_grads: list,
                        wanted: set, grads: dict) -> None:
    """One token chunk of step 1; its activations die with the call, before the next chunk's exist.

    Nothing goes through autograd: the norms by :func:`_norm_backward`, the SwiGLU gate by :func:`_swiglu_backward`,
    the two products by :func:`~lightning_mtp.layers.linear_backward`, their weight gradients added in place into
    ``weight_grads`` (one buffer each; autograd would return a fresh weight gradient per chunk, alive next to the
    running sum)."""
    block = module.block
    mlp = block.mlp
    with torch.no_grad():
        normed_input = block.mlp_norm(x_part)  # (B, l, H)
        gate_up = mlp.gate_up(normed_input)  # (B, l, 2 · hidden), as in forward
        gate, up = gate_up.chunk(2, dim=-1)
        activation = F.silu(gate) * up  # (B, l, hidden)
    grad_mlp = grad_out  # d/d(out), out = x + mlp(x): the residual's (the next depth's) and the output norm's
    if grad_normed is not None:
        with torch.no_grad():
            out = x_part + mlp.down(activation)  # (B, l, H)
        grad_norm = _norm_backward(module.norm, out, grad_normed, True, wanted, grads)
        del out
        grad_mlp = grad_norm if grad_mlp is None else grad_norm.add_(grad_mlp)
    grad_activation = linear_backward(activation, mlp.down.weight, grad_mlp, weight_grads[1])  # (B, l, hidden)
    del activation, gate, up
    grad_gate_up = _swiglu_backward(gate_up, grad_activation.to(gate_up.dtype))
    del grad_activation
    grad_normed_input = linear_backward(normed_input, mlp.gate_up.weight, grad_gate_up, weight_grads[0])
    del grad_gate_up, gate_up, normed_input
    grad_x = _norm_backward(block.mlp_norm, x_part, grad_normed_input.to(x_part.dtype), upstream, wanted, grads)
    if upstream:
        x_part.copy_(grad_x.add_(grad_mlp))  # the MLP branch's and the residual's


def _norm_backward(norm: nn.Module, x: Tensor, grad: Tensor, input_grad: bool, wanted: set,
                   grads: dict) -> Optional[Tensor]:
    """d/dx of ``norm(x)`` from ``grad`` when ``input_grad``; the gradients of its parameters in ``wanted`` (ids)
    are added into ``grads``. By hand on :class:`~lightning_mtp.layers.RMSNorm`'s fp32 path
    (:func:`~lightning_mtp.layers.rms_norm_backward`: fewer temporaries and ops), through autograd otherwise
    (bf16, autocast)."""
    params = [p for p in norm.parameters() if id(p) in wanted]
    if not input_grad and not params:
        return None
    if rms_norm_backward_applies(norm, x) and grad.dtype == torch.float32:
        weight_grad = grads.setdefault(id(norm.weight), torch.zeros_like(norm.weight)) if params else None
        return rms_norm_backward(norm, x, grad, input_grad, weight_grad)
    leaf = x.detach().requires_grad_(input_grad)
    with torch.enable_grad():
        normed = norm(_non_leaf(leaf))
    found = _grad([normed], [grad.to(normed.dtype)], [leaf] * input_grad + params)
    grad_x = found.pop(0) if input_grad else None
    _accumulate(grads, params, found)
    return grad_x


def _swiglu_backward(gate_up: Tensor, grad: Tensor) -> Tensor:
    """d/d(gate_up) of silu(gate) · up, written over ``gate_up`` (B, l, 2 · hidden), which it consumes; ``grad`` (B, l,
    hidden) is overwritten too. Autograd would keep silu's output and allocate four more (B, l, hidden) tensors and a
    (B, l, 2 · hidden) concatenation; this allocates one: σ(gate).

    d/dgate = grad · up · σ(gate) · (1 + gate · (1 − σ(gate))) (torch's silu backward), d/dup = grad · silu(gate).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad.mul_(sig)  # grad · σ
    slope = sig.neg_().add_(1).mul_(gate).add_(1).mul_(up).mul_(grad)  # grad · σ · up · (1 + gate · (1 − σ))
    torch.mul(grad, gate, out=up)  # d/dup = grad · σ · gate, into up's half
    gate.copy_(slope)
    return gate_up


def _input_backward(module, hidden, embedding, grad_x, cos, sin, chunks, need, need_inputs, grads, spent=None,
                    mask=None):
    """Steps 2 and 3 from d/dx (``grad_x``, in x's storage), one batch row at a time (:func:`_row_input_backward`).
    d/dhidden is written over ``grad_x`` row by row (a row's d/dx is consumed before its d/dhidden exists),
    d/dembedding into ``spent`` when given (a consumed gradient, :func:`_spent_buffer`). ``mask``: the (B, 1, L, L)
    attention mask of packed documents (``None``: causal). Returns d/dhidden and d/dembedding (``None`` where not
    needed)."""
    block = module.block
    projection = getattr(module, "eh_proj", None)  # the cascaded module's mix; the parallel block reads h_0 as is
    attention = (block.attn.qkv.weight, block.attn.proj.weight)
    weight_grads = {"attention": None, "projection": None}  # one buffer per weight, every row's gradient added
    if any(need[id(p)] for p in attention):
        weight_grads["attention"] = tuple(grads.setdefault(id(p), torch.zeros_like(p)) for p in attention)
    if projection is not None and need[id(projection.weight)]:
        weight_grads["projection"] = grads.setdefault(id(projection.weight), torch.zeros_like(projection.weight))
    wanted = {key for key, needed in need.items() if needed}
    grad_embedding = None
    if embedding is not None and need_inputs[1]:
        grad_embedding = spent if spent is not None else torch.empty_like(embedding)
    batch = hidden.shape[0]
    row_chunks = max(1, chunks // batch)  # token chunks of one row: the whole batch's chunk size
    for row in range(batch):
        rows = slice(row, row + 1)
        _row_input_backward(
            module, (hidden[rows], None if embedding is None else embedding[rows]),
            (grad_x[rows], None if grad_embedding is None else grad_embedding[rows]),
            *(t[rows] if t.shape[0] > 1 else t for t in (cos, sin)), row_chunks, need_inputs, weight_grads,
            wanted, grads, None if mask is None else mask[rows])
    return (grad_x if need_inputs[0] else None), grad_embedding


def _row_input_backward(module, inputs: tuple, input_grads: tuple, cos: Tensor, sin: Tensor, chunks: int,
                        need_inputs, weight_grads: dict, wanted: set, grads: dict,
                        mask: Optional[Tensor] = None) -> None:
    """Steps 2 and 3 for one batch row: its block input m and attn_norm(m) without autograd, its attention by head
    groups, then attn_norm and the block input by token chunks. A row's m, attn_norm(m) and d/dattn_norm(m) are the
    step's working set (3 · L·H, a B-th of the batch's), alive next to every trunk activation; they die with the
    call. ``inputs``: the row's (hidden, embedding), (1, L, H) each; ``input_grads``: the row's d/dx (read, then
    overwritten with d/dhidden) and its d/dembedding buffer; ``mask``: the row's (1, 1, L, L) attention mask of
    packed documents (``None``: causal)."""
    block = module.block
    projection = getattr(module, "eh_proj", None)
    grad_x, grad_embedding = input_grads
    block_input = _block_input(module, *inputs, chunks)  # (1, L, H)
    attention_grads = weight_grads["attention"]
    grad_normed_input, _, _ = block.attn.backward_by_group(
        block.attn_norm(block_input), cos, sin, grad_x, attention_grads is not None, attention_grads, mask)
    for start, input_part in _token_chunks(block_input, chunks):
        window = slice(start, start + input_part.shape[1])
        grad_input = _norm_backward(block.attn_norm, input_part, grad_normed_input[:, window], True, wanted, grads)
        grad_input.add_(grad_x[:, window])  # attn_norm's branch and the residual's
        if projection is None:  # the block input is the hidden state itself
            grad_x[:, window] = grad_input
            continue
        parts_in = [t[:, window] for t in inputs]  # h_(k-1), Emb: (1, l, H) each
        with torch.no_grad():
            parts = module.feature_parts(*parts_in)  # enorm(Emb), hnorm(h), in eh_proj's column order
        # eh_proj's backward by column halves: no (1, l, 2H) concatenation or gradient of one
        projection_grad = weight_grads["projection"]
        for part, cols, norm, x_in, needed, grad in zip(
                parts, _column_halves(projection.weight.shape[1]), (module.enorm, module.hnorm), parts_in[::-1],
                need_inputs[::-1], (grad_embedding, grad_x)):
            grad_part = linear_backward(part, projection.weight[:, cols], grad_input,
                                        None if projection_grad is None else projection_grad[:, cols])
            found = _norm_backward(norm, x_in, grad_part.to(part.dtype), needed, wanted, grads)
            if needed:
                grad[:, window] = found


def _column_halves(width: int) -> tuple[slice, slice]:
    return slice(0, width // 2), slice(width // 2, width)


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
    module: nn.Module, hidden: Tensor, embedding: Optional[Tensor], cos: Tensor, sin: Tensor, chunks: int,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(h_k, norm(h_k)) of one depth, each (B, L, H), its activations recomputed in backward
    (:class:`_RecomputedDepth`); its position-wise pieces run in ``chunks`` token chunks. ``cos``/``sin`` (1 or B,
    L, hd/2) are the tokens' RoPE tables; ``mask`` (B, 1, L, L) bool keeps packed documents apart in attention
    (``None``: causal), in forward and in the rerun.

    The rerun reads the module's weights directly (slices of ``qkv``/``proj`` per head group), so it runs inside the
    module's call (``module(..., recompute=chunks)``): an FSDP2 unit is unsharded there and unsharded again for its
    backward (FSDP's pre-backward hook on the outputs), a DeepSpeed ZeRO-3 leaf module gathered likewise."""
    return _RecomputedDepth.apply(module, cos, sin, mask, chunks, hidden, embedding, *module.parameters())
