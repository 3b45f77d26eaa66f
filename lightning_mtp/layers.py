"""Llama-style transformer parts shared by the bundled trunk and the MTP modules.

RMSNorm, rotary position embeddings, grouped-query attention with an optional static KV cache, SwiGLU MLP and a
pre-norm ``Block``. The KV cache is indexed by position (gpt-fast style): every row of a batch writes its new keys at
its own positions, and a query at position p sees cache slots 0..p only, so rolling back rejected drafts is a length
change, never a copy.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mtp.small_matmul import THIN_ROWS, thin_linear, thin_path_pays  # noqa: F401 (THIN_ROWS re-exported)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op (decoding is op-bound)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint keys) with the faster of two ways to compute decoding-sized
    products on CPU.

    A decoding step multiplies a few rows (one token per row, or the k+1 tokens of a verify) by every weight; MKL
    computes ``x @ W.T`` and ``(W @ x.T).T`` with different kernels, and which is faster depends on the machine
    (:mod:`lightning_mtp.small_matmul` measures it once per shape and row count). Results equal ``F.linear`` up to
    float summation order; more than ``THIN_ROWS`` rows (training), other devices and dtypes use ``F.linear``.
    """

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (0 < rows <= THIN_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32
                and thin_path_pays(self.in_features, self.out_features, rows)):
            return thin_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def rope_cache(max_positions: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos/sin tables of rotary embeddings (Su et al. 2021), each (max_positions, head_dim // 2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, T, nh, hd) by per-position angles; ``cos``/``sin`` are (B or 1, T, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, nh, hd/2) each, "rotate half" layout
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, T, 1, hd/2)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)


class KVCache:
    """Static key/value cache of one attention layer, indexed by position.

    ``k`` and ``v`` are (B, max_len, n_kv_heads, head_dim). Nothing here tracks lengths: the caller passes the
    positions it writes, and the causal mask hides every slot beyond a query's own position, so stale entries of
    rejected drafts are never read and are overwritten by the next accepted tokens.
    """

    def __init__(self, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int, *, device, dtype) -> None:
        shape = (batch_size, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def write(self, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k/v (B, T, n_kv, hd) at ``positions`` (B, T); return the whole cache (B, max_len, n_kv, hd).

        No host sync: the caller's mask (:func:`visible_slots`) hides the slots beyond each query's position.
        """
        batch, slots = self.k.shape[:2]
        rows = torch.arange(batch, device=k.device).unsqueeze(1) * slots  # (B, 1)
        index = (rows + positions).flatten()  # (B*T,) rows of the flattened cache
        self.k.view(batch * slots, *self.k.shape[2:]).index_copy_(0, index, k.flatten(0, 1).to(self.k.dtype))
        self.v.view(batch * slots, *self.v.shape[2:]).index_copy_(0, index, v.flatten(0, 1).to(self.v.dtype))
        return self.k, self.v


def document_ids(position_ids: Tensor) -> Tensor:
    """(B, T) -> (B, T) long: the number of each token's document within its row, from packed ``position_ids``.

    A document starts wherever a position does not follow the previous one by exactly 1 (a restart at 0, as
    ``transformers.DataCollatorWithFlattening`` writes them): the rule ``transformers``' ``masking_utils`` uses to
    find packed sequences, so the MTP depths, the bundled trunk and a ``transformers`` trunk separate the same
    documents. For ids that restart at 0, tokens i < j share a document iff ``position_ids[j] == position_ids[i] +
    j - i``.
    """
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)  # (B, T)
    return (position_ids != previous + 1).long().cumsum(dim=1)


def document_mask(position_ids: Tensor) -> Tensor:
    """(B, T) -> (B, 1, T, T) bool attention mask of packed documents: query i sees key j iff j <= i and both lie in
    the same document (:func:`document_ids`), block-diagonal causal attention. Its top-left (L, L) corner is the
    mask of the first L tokens, which is what the MTP depths (positions 0..T-k-2) read."""
    documents = document_ids(position_ids)  # (B, T)
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril_()  # (T, T)
    return (documents.unsqueeze(2) == documents.unsqueeze(1)).logical_and_(causal).unsqueeze(1)


def visible_slots(positions: Tensor, max_len: int) -> Tensor:
    """(B, 1, T, max_len) bool attention mask of cached decoding: the query at position p sees cache slots 0..p.

    Computed once per forward and shared by every layer (all layers' caches have the same length).
    """
    slots = torch.arange(max_len, device=positions.device)
    return slots.view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)


ATTENTION_WIDTH_STEP = 32
"""Cached attention reads the cache up to the last slot in use, rounded up to a multiple of this."""


def attention_width(last_slot: Tensor, max_len: int) -> int:
    """How many leading cache slots a cached forward attends over: every slot up to ``last_slot`` (the highest slot
    a query sees, any shape), rounded up to a multiple of ``ATTENTION_WIDTH_STEP``; the whole cache under
    ``torch.compile`` (one shape per graph). Attention over a decoding cache costs in proportion to its length, and
    the slots beyond the last one in use are masked anyway: reading only the used part changes no result."""
    if torch.compiler.is_compiling():
        return max_len
    step = ATTENTION_WIDTH_STEP
    return min(max_len, (int(last_slot.max()) // step + 1) * step)


def unit_stride(x: Tensor) -> Tensor:
    """``x`` with a unit stride along its last dimension (copied only when it has another).

    :class:`Linear`'s thin path returns a transposed view, and elementwise ops keep that layout, so the queries of a
    2-16 token forward reach attention with their head dimension strided by T. ATen's CPU flash attention needs unit
    stride there and otherwise falls back to the math path (bmm, softmax, masking as separate ops): measured on the
    benchmark model (12 x 256, batch 1, 2 threads), a verify forward of 4 tokens took 5.8 ms instead of 4.9 ms, of 16
    tokens 6.6 instead of 5.7, while a 1-token step (4.9 ms) was unaffected.
    """
    return x if x.stride(-1) == 1 else x.contiguous()


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if dim % n_heads:
            raise ValueError(f"hidden size {dim} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.qkv = Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.proj = Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        """With a ``cache``: ``mask`` is :func:`visible_slots` of ``positions`` (computed here when not given) over the
        first W cache slots (W = :func:`attention_width`; the attention reads only those). Without one (training):
        causal attention over the T tokens, or the (B, 1, T, T) bool ``mask`` when given (packed documents,
        :func:`document_mask`); ``positions`` are then unused (RoPE comes in ``cos``/``sin``)."""
        B, T, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv(x).split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk = apply_rope(qk.reshape(B, T, nh + nkv, hd), cos, sin)  # (B, T, nh + nkv, hd): one rotation for both
        q, k = qk.split([nh, nkv], dim=2)  # (B, T, nh, hd), (B, T, nkv, hd)
        v = v.reshape(B, T, nkv, hd)
        q = unit_stride(q)
        gqa = self.n_kv_heads != self.n_heads
        if cache is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), unit_stride(k).transpose(1, 2), unit_stride(v).transpose(1, 2), attn_mask=mask,
                is_causal=mask is None, enable_gqa=gqa,
            )  # (B, nh, T, hd)
        else:
            k_all, v_all = cache.write(positions, k, v)  # (B, S, nkv, hd)
            if mask is None:
                mask = visible_slots(positions, attention_width(positions, cache.max_len))  # (B, 1, T, W)
            width = mask.shape[-1]  # the mask covers the slots in use: attend over those only
            k_all, v_all = k_all[:, :width], v_all[:, :width]  # (B, W, nkv, hd)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=mask, enable_gqa=gqa
            )
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))

    def head_group(self, group: int) -> tuple[slice, slice, slice]:
        """Rows of ``qkv.weight`` projecting key/value head ``group``: its query heads, its key and its value. The
        query rows also index the columns of ``proj.weight`` that read the group's heads."""
        per_group, hd = self.n_heads // self.n_kv_heads, self.head_dim
        k_start = (self.n_heads + group) * hd
        v_start = (self.n_heads + self.n_kv_heads + group) * hd
        return (slice(group * per_group * hd, (group + 1) * per_group * hd), slice(k_start, k_start + hd),
                slice(v_start, v_start + hd))

    def _group_qkv(self, x: Tensor, cos: Tensor, sin: Tensor, group: int) -> Tensor:
        """Queries, key and value of key/value head ``group`` (B, T, g + 2, hd), queries and key rotated."""
        B, T, _ = x.shape
        per_group = self.n_heads // self.n_kv_heads
        weight = torch.cat([self.qkv.weight[rows] for rows in self.head_group(group)])  # ((g + 2) * hd, dim)
        qkv = F.linear(x, weight).view(B, T, per_group + 2, self.head_dim)
        qkv[:, :, : per_group + 1] = apply_rope(qkv[:, :, : per_group + 1], cos, sin)
        return qkv

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Attention of one group: q (B, T, g, hd), k and v (B, T, 1, hd) -> (B, T, g * hd); causal, or the (B, 1,
        T, T) bool ``mask`` when given (packed documents)."""
        B, T, per_group, hd = q.shape
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            enable_gqa=per_group > 1,
        )  # (B, g, T, hd)
        return out.transpose(1, 2).reshape(B, T, per_group * hd)

    def add_by_group(self, out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``out += attention(x)`` (both (B, T, dim), no cache, no autograd graph), one key/value head group at a
        time: heads are independent and the output projection is linear, so the groups' projected outputs sum to
        :meth:`forward`'s (up to summation order) while one group's activations are alive at a time. ``mask``: as
        :meth:`forward`'s without a cache."""
        flat = out.view(-1, out.shape[-1])  # (B*T, dim)
        per_group = self.n_heads // self.n_kv_heads
        for group in range(self.n_kv_heads):
            heads = self._attend(*self._group_qkv(x, cos, sin, group).split([per_group, 1, 1], dim=2), mask)
            _addmm_(flat, heads.reshape(flat.shape[0], -1), self.proj.weight[:, self.head_group(group)[0]].t())
        return out

    def backward_by_group(
        self, x: Tensor, cos: Tensor, sin: Tensor, grad_out: Tensor, weight_grads: bool,
        accumulate_into: Optional[tuple[Tensor, Tensor]] = None, mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """Recompute the attention of ``x`` (B, T, dim) one key/value head group at a time and backpropagate
        ``grad_out`` (B, T, dim) through each group straight away: one group's activations are alive at a time.

        Returns d/dx (B, T, dim) and, with ``weight_grads``, the gradients of ``qkv.weight`` and ``proj.weight``:
        added into ``accumulate_into`` (their two buffers) when given, so that calls on slices of a batch (one row at
        a time) sum into one gradient. Only the attention itself goes through autograd; the projections and RoPE (a
        rotation: its backward rotates back) are differentiated by hand, so that d/dx and the weight gradients
        accumulate in place. The output projection is not rerun: its result is not needed, only its input (the
        group's heads). ``mask``: the (B, 1, T, T) bool mask of packed documents (``None``: causal).
        """
        x, grad_out = x.detach(), grad_out.detach()
        flat_x = x.reshape(-1, x.shape[-1])  # (B*T, dim)
        grad_x = torch.zeros_like(flat_x)
        grad_qkv = grad_proj = None
        if weight_grads:
            grad_qkv, grad_proj = accumulate_into or (torch.zeros_like(self.qkv.weight),
                                                      torch.zeros_like(self.proj.weight))
        per_group = self.n_heads // self.n_kv_heads
        for group in range(self.n_kv_heads):
            rows = self.head_group(group)  # of qkv.weight: queries, key, value
            q, k, v = (t.detach().requires_grad_() for t in
                       self._group_qkv(x, cos, sin, group).split([per_group, 1, 1], dim=2))
            with torch.enable_grad():
                heads = self._attend(q, k, v, mask)  # (B, T, g * hd)
            grad_heads = linear_backward(heads.detach(), self.proj.weight[:, rows[0]], grad_out,
                                         None if grad_proj is None else grad_proj[:, rows[0]])
            grads = torch.autograd.grad(heads, (q, k, v), grad_heads.to(heads.dtype))
            del heads, grad_heads, q, k, v
            for part_rows, grad, rotated in zip(rows, grads, (True, True, False)):
                if rotated:
                    grad = apply_rope(grad, cos, -sin)  # (B, T, g or 1, hd)
                grad = grad.reshape(flat_x.shape[0], -1)  # (B*T, g * hd or hd)
                weight = self.qkv.weight.detach()[part_rows]  # (g * hd or hd, dim)
                _addmm_(grad_x, grad, weight)
                if grad_qkv is not None:
                    _addmm_(grad_qkv[part_rows], grad.t(), flat_x.to(grad.dtype))
            del grads, grad
        return grad_x.view_as(x), grad_qkv, grad_proj


def rms_norm_backward(
    norm: RMSNorm, x: Tensor, grad: Tensor, input_grad: bool = True, weight_grad: Optional[Tensor] = None
) -> Optional[Tensor]:
    """The backward of ``norm(x)`` by hand, for :meth:`RMSNorm.forward`'s fp32 path (fp32 ``x``, weight and
    ``grad``, no autocast: see :func:`rms_norm_backward_applies`): d/dx (..., H) from ``grad`` (..., H) when
    ``input_grad``, and d/dweight added in place into ``weight_grad`` (H,) when given.

    With y = x · r · w and r = (mean(x²) + eps)^(-1/2) per row: d/dx = r · (g·w − x̂ · mean(g·w · x̂)) with
    x̂ = x · r, and d/dw = Σ_rows g · x̂. At most three (..., H) temporaries are alive at a time; autograd through
    ``F.rms_norm`` (a decomposition on CPU) keeps five and runs more ops.

    Example::

        >>> import torch
        >>> norm, x, g = RMSNorm(8), torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
        >>> expected, = torch.autograd.grad(norm(x), x, g)
        >>> torch.allclose(rms_norm_backward(norm, x.detach(), g), expected, atol=1e-6)
        True
    """
    x, grad = x.detach(), grad.detach()
    weight = norm.weight.detach()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(norm.eps))  # (..., 1)
    x_hat = x * rstd  # (..., H)
    if weight_grad is not None:
        weight_grad.add_((grad * x_hat).reshape(-1, x.shape[-1]).sum(0))
    if not input_grad:
        return None
    grad_normed = grad * weight  # (..., H)
    dot = torch.linalg.vecdot(grad_normed, x_hat).unsqueeze(-1).div_(x.shape[-1])  # (..., 1) mean(g·w · x̂)
    return grad_normed.sub_(x_hat.mul_(dot)).mul_(rstd)


def rms_norm_backward_applies(norm: nn.Module, x: Tensor) -> bool:
    """Whether :func:`rms_norm_backward` computes ``norm``'s backward at ``x``: an :class:`RMSNorm` on its fp32 path
    (fp32 input and weight, autocast off); anything else goes through autograd."""
    return (isinstance(norm, RMSNorm) and x.dtype == torch.float32 and norm.weight.dtype == torch.float32
            and not torch.is_autocast_enabled(x.device.type))


def linear_backward(x: Tensor, weight: Tensor, grad: Tensor, weight_grad: Optional[Tensor] = None) -> Tensor:
    """The backward of ``F.linear(x, weight)`` (no bias) by hand: d/dx (..., in) from ``grad`` (..., out), and
    d/dweight added in place into ``weight_grad`` (out, in) when given. Under autocast the products run in its dtype,
    as autograd's would."""
    x, grad = x.detach(), grad.detach()
    flat_x, flat_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])  # (N, in), (N, out)
    if weight_grad is not None:
        _addmm_(weight_grad, flat_grad.t(), flat_x.to(flat_grad.dtype))
    return (flat_grad @ weight.detach().to(flat_grad.dtype)).view(*grad.shape[:-1], weight.shape[1])


def _addmm_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out += a @ b`` in place; through a temporary product when autocast or the dtypes call for a cast. Written as
    ``addmm(..., out=out)``, which ``torch.utils.flop_counter`` counts (it does not count ``addmm_``)."""
    if a.dtype == b.dtype == out.dtype and not torch.is_autocast_enabled(out.device.type):
        return torch.addmm(out, a, b, out=out)
    return out.add_(a @ b)


class SwiGLU(nn.Module):
    """Gated MLP of Llama: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = Linear(dim, 2 * hidden, bias=False)
        self.down = Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def mlp_hidden_size(dim: int, ratio: float, multiple_of: int = 32) -> int:
    """SwiGLU width: ``ratio · dim`` rounded up to a multiple (8/3 keeps parameters equal to a 4× GELU MLP)."""
    return multiple_of * math.ceil(ratio * dim / multiple_of)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int], mlp_hidden: int, eps: float = 1e-6):
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = Attention(dim, n_heads, n_kv_heads)
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, mlp_hidden)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        positions: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        """``mask``: the cached-decoding attention mask (:func:`visible_slots`), shared by the layers of a forward, or
        without a cache the (B, 1, T, T) mask of packed documents (:func:`document_mask`; ``None``: causal)."""
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, cache, mask)
        return self.mlp_residual(x)

    def attention_residual(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """The first half of :meth:`forward` without autograd, one key/value head group at a time: x + attn(norm(x))
        (B, T, H); ``mask`` as :meth:`forward`'s without a cache."""
        return self.attn.add_by_group(x.clone(), self.attn_norm(x), cos, sin, mask)

    def mlp_residual(self, x: Tensor) -> Tensor:
        """The second half of :meth:`forward`: x + mlp(norm(x)), position-wise, so it can run on any rows of x."""
        return x + self.mlp(self.mlp_norm(x))


class RotaryTable(nn.Module):
    """Holds the cos/sin tables and looks them up for training (contiguous) or cached decoding (per-row)."""

    def __init__(self, max_positions: int, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        cos, sin = rope_cache(max_positions, head_dim, base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, length: int, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """(1, T, hd/2) tables for positions 0..T-1, or (B, T, hd/2) for explicit ``positions`` (B, T)."""
        if positions is None:
            if length > self.cos.shape[0]:
                raise ValueError(f"sequence of {length} tokens exceeds the model's context of {self.cos.shape[0]}")
            return self.cos[:length].unsqueeze(0), self.sin[:length].unsqueeze(0)
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} exceeds the model's context of {self.cos.shape[0]}")
        return self.cos[positions], self.sin[positions]
