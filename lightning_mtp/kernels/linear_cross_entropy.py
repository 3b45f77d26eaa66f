"""Fused linear + cross-entropy: cuBLAS matmul per row chunk, one Triton kernel for softmax/loss/argmax/d(logits).

Same signature and outputs as :func:`~lightning_mtp.kernels.linear_cross_entropy_torch.linear_cross_entropy_torch`
(the twin, which is the CPU path and the reference). Per chunk of ``c`` rows:

1. ``logits[:c] = h @ W.T`` into one reusable scratch buffer of ``chunk_size × V`` in the input dtype (so no more
   than one chunk of logits ever exists);
2. :func:`_lce_row_kernel`, one program per row, streams the row in ``BLOCK_V`` tiles: online logsumexp, the target
   logit and the first argmax in a first pass, then (when gradients are needed) overwrites the logits IN PLACE with
   ``d loss / d logits = (softmax - onehot) * row_weight``; loads are cast to fp32, so bf16 works. The host's logit
   transform (``logit_scale`` s, ``softcap`` cap) is applied to each loaded tile, y = cap · tanh(s · z / cap), and
   the gradient gets the chain-rule factor dy/dz = s · (1 - tanh²) (the twin's module docstring has the math);
3. ``grad_hidden[chunk] = dlogits @ W`` and ``grad_weight += dlogits.T @ h`` into ONE fp32 buffer for all rows (all
   depths sharing the head go through one call).

Backward only scales the stored gradients by the incoming gradient (in place; the autograd Function and the
handling of a list of parts are the twin's). Ignored rows have weight 0: loss 0, no gradient.
Only the gradients backward will ask for are computed (the twin's ``grads_wanted``): under ``no_grad`` or
``inference_mode`` the kernel runs without its second pass and no gradient buffer is allocated.
Targets must be in ``[0, V)`` or equal ``ignore_index`` (not checked, to avoid a device sync).

Example (CUDA tensors; CPU tensors work under ``TRITON_INTERPRET=1``, slowly)::

    hidden = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 32000, (4096,), device="cuda")
    out = linear_cross_entropy_triton(hidden, weight, targets)  # loss: mean CE over valid rows
    out.loss.backward()  # weight.grad from one fp32 accumulator, cast to bf16
"""

import functools
from types import SimpleNamespace
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_mtp.kernels.dispatch import LazyKernel, check_triton_usable
from lightning_mtp.kernels.linear_cross_entropy_torch import (
    LinearCrossEntropyOutput,
    as_parts,
    check_logit_transform,
    resolve_row_weights,
    score_parts,
)

try:  # kernels are plain functions built lazily (see LazyKernel); without triton only the annotations need `tl`
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    tl = SimpleNamespace(constexpr=None)


def _lce_row_kernel(
    logits_ptr,  # (c, V) logits of the chunk, overwritten with d(loss)/d(logits) when COMPUTE_GRAD
    stride_row,  # elements between rows of logits
    targets_ptr,  # (c,) int64
    row_weights_ptr,  # (c,) fp32, 0 on ignored rows
    row_loss_ptr,  # (c,) fp32 out
    row_argmax_ptr,  # (c,) int64 out
    V,  # vocabulary size
    ignore_index,
    logit_scale,  # fp32: multiplies the raw logits (1.0 = none)
    softcap,  # fp32: cap of the tanh soft-capping when SOFTCAP
    SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # tanh(u) is written out as sign(u) · (1 - e^(-2|u|)) / (1 + e^(-2|u|)): libdevice's tanh has no interpreter
    # counterpart, and a @triton.jit helper would be compiled at import (see LazyKernel).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)

    # pass 1: running max m, running Σ exp(x - m), target logit, first argmax
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    target_logit = tl.full([], 0.0, tl.float32)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols  # (BLOCK_V,)
        in_vocab = offs < V
        x = tl.load(row_ptr + offs, mask=in_vocab, other=0.0).to(tl.float32) * logit_scale
        if SOFTCAP:
            u = x / softcap
            e = tl.exp(-2.0 * tl.abs(u))
            x = softcap * tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        x = tl.where(in_vocab, x, float("-inf"))  # (BLOCK_V,) transformed logits y, -inf past the vocabulary
        tile_max = tl.max(x, axis=0)
        # first index attaining the tile max; masked lanes are excluded so no id ≥ V can come out
        tile_arg = tl.min(tl.where(in_vocab & (x == tile_max), offs, V), axis=0).to(tl.int64)
        best_idx = tl.where(tile_max > best_val, tile_arg, best_idx)  # strict: earlier tiles win ties
        best_val = tl.maximum(best_val, tile_max)
        new_m = tl.maximum(m, tile_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.where(in_vocab, tl.exp(x - new_m), 0.0), axis=0)
        m = new_m
        target_logit += tl.sum(tl.where(offs == target, x, 0.0), axis=0)
    lse = m + tl.log(s)
    tl.store(row_loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    tl.store(row_argmax_ptr + row, tl.minimum(best_idx, V - 1))

    if COMPUTE_GRAD:
        # pass 2: dlogits = (softmax(y) - onehot) * dy/dz * w, written over the logits; w == 0 on ignored rows
        w = tl.load(row_weights_ptr + row) * logit_scale  # the constant factor s of dy/dz folded in
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            in_vocab = offs < V
            x = tl.load(row_ptr + offs, mask=in_vocab, other=0.0).to(tl.float32) * logit_scale
            if SOFTCAP:
                u = x / softcap
                e = tl.exp(-2.0 * tl.abs(u))
                tanh = tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
                grad = (tl.exp(softcap * tanh - lse) - tl.where(offs == target, 1.0, 0.0)) * (1.0 - tanh * tanh)
            else:
                grad = tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)
            tl.store(row_ptr + offs, (grad * w).to(logits_ptr.dtype.element_ty), mask=in_vocab)


def _row_kernel_configs(interpret: bool):
    import triton

    if interpret:  # one small tile so that several vocab tiles (and a partial last one) are exercised
        return [triton.Config({"BLOCK_V": 64}, num_warps=1)]
    return [
        triton.Config({"BLOCK_V": 2048}, num_warps=4),
        triton.Config({"BLOCK_V": 4096}, num_warps=8),
        triton.Config({"BLOCK_V": 8192}, num_warps=16),
    ]


# The kernel overwrites the logits in place, so autotuning must restore them between trial runs.
lce_row_kernel = LazyKernel(_lce_row_kernel, configs=_row_kernel_configs, key=["V"], restore_value=["logits_ptr"])


@functools.cache
def _fp32_out_addmm_works(device: str) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=fp32, out=acc)`` accumulates bf16 products in place correctly."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(8, 16, device=device, generator=gen).bfloat16()
        b = torch.randn(16, 8, device=device, generator=gen).bfloat16()
        acc = torch.randn(8, 8, device=device, generator=gen)
        expected = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, expected, atol=1e-3, rtol=1e-3))
    except Exception:
        return False


def _accumulate_fp32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` in the input dtype, without an fp32 copy of ``a``."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b.float())
    elif a.is_cuda and _fp32_out_addmm_works(str(a.device)):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # fp32 accumulation and output from cuBLAS
    else:  # one (V, H) temporary in the input dtype; the running sum stays fp32
        acc.add_(torch.mm(a, b))


def fused_chunked_pass(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    row_weights: Tensor,
    ignore_index: int,
    chunk_size: int,
    grad_hidden_wanted: bool,
    grad_weight_wanted: bool,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    overwrite_hidden: bool = False,
    grad_weight: Optional[Tensor] = None,
):
    """One chunked sweep: ``(row_loss (N,) fp32, row_argmax (N,) int64, grad_hidden | None, grad_weight fp32 | None)``.

    Without either gradient wanted it is the forward alone (``COMPUTE_GRAD=False``: no d(logits), no gradient buffer).
    ``row_weights`` (N,) fp32 scales each row's gradient (zero on ignored rows). Inputs must be contiguous. The loss,
    argmax and gradients are those of the logits scaled by ``logit_scale`` and capped by ``softcap``.
    ``overwrite_hidden`` and ``grad_weight`` (an fp32 buffer to accumulate into) as in the twin's ``chunked_pass``.
    """
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    compute_grad = grad_hidden_wanted or grad_weight_wanted
    row_loss = torch.zeros(num_rows, device=hidden.device, dtype=torch.float32)
    row_argmax = torch.zeros(num_rows, device=hidden.device, dtype=torch.long)
    grad_hidden = (hidden if overwrite_hidden else torch.empty_like(hidden)) if grad_hidden_wanted else None
    if grad_weight_wanted and grad_weight is None:
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    elif not grad_weight_wanted:
        grad_weight = None
    chunk_rows = max(1, min(chunk_size, num_rows))
    logits_buffer = torch.empty((chunk_rows, vocab), device=hidden.device, dtype=hidden.dtype)  # (chunk, V)
    for start in range(0, num_rows, chunk_rows):
        end = min(start + chunk_rows, num_rows)
        h = hidden[start:end]  # (c, H)
        logits = logits_buffer[: end - start]  # (c, V), contiguous
        torch.mm(h, weight.t(), out=logits)
        lce_row_kernel[(end - start,)](
            logits,
            logits.stride(0),
            targets[start:end],
            row_weights[start:end],
            row_loss[start:end],
            row_argmax[start:end],
            vocab,
            ignore_index,
            float(logit_scale),
            1.0 if softcap is None else float(softcap),
            SOFTCAP=softcap is not None,
            COMPUTE_GRAD=compute_grad,
        )
        # logits now holds d(loss)/d(logits) when compute_grad
        if grad_weight_wanted:  # before the hidden rows may be overwritten by their gradient
            _accumulate_fp32(grad_weight, logits.t(), h)  # (V, H)
        if grad_hidden_wanted:
            torch.mm(logits, weight, out=grad_hidden[start:end])  # (c, H)
    return row_loss, row_argmax, grad_hidden, grad_weight


def linear_cross_entropy_triton(
    hidden: Union[Tensor, Sequence[Tensor]],
    weight: Tensor,
    targets: Tensor,
    row_weights: Optional[Tensor] = None,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    overwrite_hidden: Union[bool, Sequence[bool]] = False,
) -> LinearCrossEntropyOutput:
    """Triton twin of :func:`linear_cross_entropy_torch`: same arguments (documented there), same outputs.

    The kernel takes ``hidden`` (or each part) in fp32, bf16 or fp16 with ``weight`` of the same dtype, and
    ``targets`` in ``[0, V)`` or ``ignore_index``. Needs CUDA tensors, or ``TRITON_INTERPRET=1`` for CPU tensors
    (tests). The autograd Function is the twin's (:class:`ChunkedLinearCrossEntropy`), running this file's sweep.
    """
    parts = as_parts(hidden, weight, targets)
    if any(part.dtype != weight.dtype for part in parts):
        raise ValueError(f"hidden ({parts[0].dtype}) and weight ({weight.dtype}) must have the same dtype")
    check_logit_transform(logit_scale, softcap)
    check_triton_usable(*parts, weight, targets, row_weights)
    weights = resolve_row_weights(targets, row_weights, ignore_index).contiguous()
    # A part that is not contiguous is copied: the copy, not the caller's tensor, then receives the gradient.
    parts = [part.contiguous() for part in parts]
    return score_parts(parts, weight.contiguous(), weights, targets.long().contiguous(), fused_chunked_pass,
                       ignore_index, chunk_size, overwrite_hidden, logit_scale, softcap)
