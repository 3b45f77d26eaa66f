"""Chunked linear + cross-entropy in plain torch: the CPU path and the reference of the Triton kernel.

The [tokens × vocab] logits never exist for more than ``chunk_size`` rows at a time. Gradients of the hidden states
and of the output weight are computed chunk by chunk in the forward pass (as Liger-Kernel does), so backward only
scales them by the incoming gradient: no logits are kept for backward and no forward is recomputed. All depths that
share one head go through one call, so a single fp32 weight-gradient buffer serves them all. Only the gradients that
backward will ask for are computed (:func:`grads_wanted`): under ``no_grad``/``inference_mode`` (validation) the call
is the forward alone, with no weight-gradient buffer and no d(logits).

Hosts whose forward transforms the head's output (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, Gemma-2's
``final_logit_softcapping``) are scored on the transformed logits y = cap · tanh(s · z / cap) (y = s · z without a
cap) of the raw head outputs z, in the model's order of operations (:func:`scale_and_cap`). The chain rule then
multiplies d(CE)/dy = softmax(y) - onehot by dy/dz = s · (1 - tanh²(s · z / cap)) = s · (1 - (y / cap)²).

Example::

    >>> import torch
    >>> hidden, weight = torch.randn(10, 8, requires_grad=True), torch.randn(32, 8, requires_grad=True)
    >>> targets = torch.tensor([1, 2, 3, -100, 5, 6, 7, 8, 9, 10])
    >>> out = linear_cross_entropy_torch(hidden, weight, targets)
    >>> reference = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
    >>> bool(torch.allclose(out.loss, reference))
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor


class LinearCrossEntropyOutput(NamedTuple):
    loss: Tensor
    """Scalar: Σ_i row_weights[i] · CE_i over rows whose target is not ignored (differentiable)."""
    row_loss: Tensor
    """(N,) fp32 per-row cross-entropy, 0 where the target is ignored (detached)."""
    row_argmax: Tensor
    """(N,) argmax of each row's logits (detached), for accuracies."""


def default_chunk_size(num_rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk so that one chunk of logits is about as large as the hidden states (Liger's rule)."""
    rows = max(1, (num_rows * hidden_size) // max(vocab_size, 1))
    return int(min(4096, max(64, 1 << (rows - 1).bit_length())))


def resolve_row_weights(targets: Tensor, row_weights: Optional[Tensor], ignore_index: int) -> Tensor:
    """(N,) fp32 weights, zero on ignored rows; ``None`` means the mean over valid rows."""
    valid = targets != ignore_index
    if row_weights is None:
        return valid.float() / valid.sum().clamp(min=1)
    return row_weights.float() * valid


def check_logit_transform(
    logit_scale: float, softcap: Optional[float], names: tuple[str, str] = ("logit_scale", "softcap")
) -> None:
    """Raise a ``ValueError`` naming the argument (``names``): the scale must be finite, the cap ``None`` or > 0."""
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not math.isfinite(logit_scale):
        raise ValueError(f"{names[0]} must be a finite number, got {logit_scale!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"{names[1]} must be None or a finite number > 0, got {softcap!r}")


def scale_and_cap(logits: Tensor, logit_scale: float = 1.0, softcap: Optional[float] = None) -> Tensor:
    """``softcap · tanh(logit_scale · logits / softcap)`` (``logit_scale · logits`` without a cap), out of place.

    The reference of what the kernels do to the raw head outputs, with ``transformers``' order of operations
    (``CohereForCausalLM``: ``logits * logit_scale``; ``Gemma2ForCausalLM``: ``tanh(logits / cap) * cap``).
    """
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _scale_and_cap_(logits: Tensor, logit_scale: float, softcap: Optional[float], with_slope: bool) -> Optional[Tensor]:
    """:func:`scale_and_cap` in place on fp32 ``logits`` (c, V). Returns the slope dy/dz = s · (1 - tanh²) (c, V)
    when ``with_slope`` and a cap makes it vary per logit; ``None`` otherwise (the slope is the constant s)."""
    if logit_scale != 1.0:
        logits.mul_(logit_scale)
    if softcap is None:
        return None
    tanh = logits.div_(softcap).tanh_()
    slope = tanh.square().neg_().add_(1.0).mul_(logit_scale) if with_slope else None
    tanh.mul_(softcap)
    return slope


def row_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy of each row of fp32 ``logits`` (c, V) (already scaled and capped) against ``targets`` (c,).

    Returns the per-row loss (c,), 0 where the target is ``ignore_index``; the row logsumexp (c,); and the targets
    with ignored rows pointed at id 0 (c, 1), for gathers. Differentiable: the ZeRO-3 head path backpropagates through
    it, the fused twin reuses ``logsumexp`` and the targets for its closed-form gradient. The one place the chunked
    cross-entropy math is written.
    """
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)  # (c, 1)
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    row_loss = (lse - logits.gather(1, safe_targets).squeeze(1)) * valid  # (c,)
    return row_loss, lse, safe_targets


def _score_chunk(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    row_weights: Tensor,
    ignore_index: int,
    logit_scale: float,
    softcap: Optional[float],
    with_grad: bool,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One row chunk: CE per row (c,) (0 where ignored), argmax (c,), and when ``with_grad`` the fp32 gradient of
    Σ_i row_weights[i] · CE_i w.r.t. the raw head outputs h @ W.T (c, V)."""
    logits = (h @ weight.t()).float()  # (c, V) raw head outputs z
    slope = _scale_and_cap_(logits, logit_scale, softcap, with_grad)  # logits now hold y
    row_loss, lse, safe_target = row_cross_entropy(logits, target, ignore_index)
    row_argmax = logits.argmax(dim=-1)
    if not with_grad:
        return row_loss, row_argmax, None
    # d(CE)/dy = softmax - onehot, scaled by each row's weight; reuse the logits buffer.
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, safe_target, -torch.ones_like(safe_target, dtype=grad.dtype))
    if slope is None:  # constant dy/dz = s: fold it into the row weights
        grad.mul_((row_weights * logit_scale).unsqueeze(1))
    else:
        grad.mul_(row_weights.unsqueeze(1)).mul_(slope)
    return row_loss, row_argmax, grad


def grads_wanted(hidden: Tensor, weight: Tensor) -> tuple[bool, bool]:
    """Whether backward will want the gradient of ``hidden`` and of ``weight``: grad mode is on and the tensor
    requires grad (Liger-Kernel keys on the input's ``requires_grad`` the same way).

    Decided before ``Function.apply``: inside ``forward`` grad mode is always off, and ``ctx.needs_input_grad`` stays
    True for Parameters under ``no_grad``/``inference_mode``, which made validation compute the head's weight gradient.
    """
    if not torch.is_grad_enabled():
        return False, False
    return hidden.requires_grad, weight.requires_grad


def chunked_pass(
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
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """One chunked sweep: ``(row_loss (N,) fp32, row_argmax (N,) int64, grad_hidden | None, grad_weight fp32 | None)``.

    Without either gradient wanted it is the forward alone: one chunk of logits at a time, no gradient buffer and
    no d(logits). ``row_weights`` (N,) fp32 scales each row's gradient (zero on ignored rows).
    """
    num_rows = hidden.shape[0]
    row_loss = torch.zeros(num_rows, device=hidden.device, dtype=torch.float32)
    row_argmax = torch.zeros(num_rows, device=hidden.device, dtype=torch.long)
    if grad_hidden_wanted:
        # A scratch copy of the hidden states (a concatenation of depths) receives its own gradient, row chunk
        # by row chunk once the chunk has been used: one (N, H) buffer instead of two.
        grad_hidden = hidden if overwrite_hidden else torch.empty_like(hidden)
    else:
        grad_hidden = None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grad_weight_wanted else None
    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        h = hidden[start:end]  # (c, H)
        row_loss[start:end], row_argmax[start:end], grad_logits = _score_chunk(
            h, weight, targets[start:end], row_weights[start:end], ignore_index, logit_scale, softcap,
            grad_hidden_wanted or grad_weight_wanted,
        )
        if grad_weight_wanted:  # before the hidden rows may be overwritten by their gradient
            grad_weight.addmm_(grad_logits.t(), h.float())
        if grad_hidden_wanted:
            grad_hidden[start:end] = grad_logits.to(weight.dtype) @ weight
    return row_loss, row_argmax, grad_hidden, grad_weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights, ignore_index, chunk_size, overwrite_hidden, logit_scale,
                softcap, grad_hidden_wanted, grad_weight_wanted):
        # hidden (N, H), weight (V, H), targets (N,), row_weights (N,) fp32, already zero on ignored rows. The two
        # flags come from grads_wanted(): ctx.needs_input_grad cannot tell whether backward will run.
        row_loss, row_argmax, grad_hidden, grad_weight = chunked_pass(
            hidden, weight, targets, row_weights, ignore_index, chunk_size, grad_hidden_wanted, grad_weight_wanted,
            logit_scale, softcap, overwrite_hidden,
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype, ctx.consumed = weight.dtype, False
        ctx.mark_non_differentiable(row_loss, row_argmax)
        return (row_loss * row_weights).sum(), row_loss, row_argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_loss, _grad_argmax):
        if ctx.consumed:
            raise RuntimeError("linear_cross_entropy scales its precomputed gradients in place: backward runs once")
        ctx.consumed = True
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: a second full-size weight gradient here would raise the step's peak memory by V × H.
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def linear_cross_entropy_torch(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    row_weights: Optional[Tensor] = None,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    overwrite_hidden: bool = False,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> LinearCrossEntropyOutput:
    """Weighted cross-entropy of ``scale_and_cap(hidden @ weight.T)`` against ``targets`` without materialising all
    logits.

    Args:
        hidden: (N, H) final hidden states (after the final norm) of every scored row, any depth.
        weight: (V, H) output projection.
        targets: (N,) token ids; ``ignore_index`` rows score 0 and get no gradient.
        row_weights: (N,) weight of each row's loss. ``None`` gives the mean over valid rows.
        chunk_size: rows of logits materialised at once; default from :func:`default_chunk_size`.
        overwrite_hidden: ``hidden`` is a private scratch copy (e.g. a concatenation) that nobody reads afterwards;
            its rows are overwritten by their gradients to save one (N, H) buffer.
        logit_scale: multiplies the head's outputs (Cohere's ``logit_scale``; 1 = none).
        softcap: then ``softcap · tanh(logits / softcap)`` (Gemma-2's ``final_logit_softcapping``; ``None`` = none).

    ``row_loss`` and ``row_argmax`` are those of the scaled and capped logits.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden rows {hidden.shape[0]}")
    check_logit_transform(logit_scale, softcap)
    chunk_size = chunk_size or default_chunk_size(hidden.shape[0], hidden.shape[1], weight.shape[0])
    weights = resolve_row_weights(targets, row_weights, ignore_index)
    logit_scale, softcap = float(logit_scale), (None if softcap is None else float(softcap))
    grad_hidden_wanted, grad_weight_wanted = grads_wanted(hidden, weight)
    if not (grad_hidden_wanted or grad_weight_wanted):  # validation, inference, a frozen head and trunk
        with torch.no_grad():  # not differentiable w.r.t. row_weights on either path
            row_loss, row_argmax, _, _ = chunked_pass(
                hidden, weight, targets, weights, ignore_index, chunk_size, False, False, logit_scale, softcap
            )
            return LinearCrossEntropyOutput((row_loss * weights).sum(), row_loss, row_argmax)
    loss, row_loss, row_argmax = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, targets, weights, ignore_index, chunk_size, overwrite_hidden, logit_scale, softcap,
        grad_hidden_wanted, grad_weight_wanted,
    )
    return LinearCrossEntropyOutput(loss, row_loss, row_argmax)
