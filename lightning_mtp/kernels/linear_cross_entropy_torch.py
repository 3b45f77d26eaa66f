"""Chunked linear + cross-entropy in plain torch: the CPU path and the reference of the Triton kernel.

The [tokens × vocab] logits never exist for more than ``chunk_size`` rows at a time. Gradients of the hidden states
and of the output weight are computed chunk by chunk in the forward pass (as Liger-Kernel does), so backward only
scales them by the incoming gradient: no logits are kept for backward and no forward is recomputed. All depths that
share one head go through one call, so a single fp32 weight-gradient buffer serves them all. Only the gradients that
backward will ask for are computed (:func:`grads_wanted`): under ``no_grad``/``inference_mode`` (validation) the call
is the forward alone, with no weight-gradient buffer and no d(logits).

Several row sets scored with one head (the main head's and every MTP depth's rows) can be given as a list of parts
instead of one (N, H) tensor: one call, one fp32 weight-gradient buffer for all of them, no concatenated copy, each
part chunked by its own row count, and each part's gradient its own tensor, so that backward frees each one as soon
as its depth has used it (one concatenated buffer would stay alive until the last depth's backward).

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
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

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
    grad_weight: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """One chunked sweep: ``(row_loss (N,) fp32, row_argmax (N,) int64, grad_hidden | None, grad_weight fp32 | None)``.

    Without either gradient wanted it is the forward alone: one chunk of logits at a time, no gradient buffer and
    no d(logits). ``row_weights`` (N,) fp32 scales each row's gradient (zero on ignored rows). ``grad_weight``: an fp32
    (V, H) buffer to accumulate the weight gradient into (several parts, one buffer); ``None`` allocates one.
    """
    num_rows = hidden.shape[0]
    row_loss = torch.zeros(num_rows, device=hidden.device, dtype=torch.float32)
    row_argmax = torch.zeros(num_rows, device=hidden.device, dtype=torch.long)
    if grad_hidden_wanted:
        # Private hidden states (a depth's normed rows that nothing else reads) receive their own gradient, row
        # chunk by row chunk once the chunk has been used: one (N, H) buffer instead of two.
        grad_hidden = hidden if overwrite_hidden else torch.empty_like(hidden)
    else:
        grad_hidden = None
    if grad_weight_wanted and grad_weight is None:
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
    elif not grad_weight_wanted:
        grad_weight = None
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
        del grad_logits  # before the next chunk's logits exist: one chunk of (c, V) alive at a time, not two
    return row_loss, row_argmax, grad_hidden, grad_weight


PassFn = Callable[..., tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]]
"""A chunked sweep with :func:`chunked_pass`'s signature: this twin's, or the Triton kernel's launcher."""


@dataclass(frozen=True)
class PassSettings:
    """What every part of one call shares: the sweep to run and its arguments besides the tensors."""

    pass_fn: PassFn
    ignore_index: int
    chunk_size: Optional[int]  # rows per chunk; None: each part's own default_chunk_size
    logit_scale: float
    softcap: Optional[float]
    overwrite_hidden: tuple[bool, ...]  # per part: private scratch that receives its own gradient in place
    grad_hidden_wanted: tuple[bool, ...]  # per part, from grads_wanted()
    grad_weight_wanted: bool

    def chunk_rows(self, part: Tensor, weight: Tensor) -> int:
        return self.chunk_size or default_chunk_size(part.shape[0], part.shape[1], weight.shape[0])


def sweep_parts(
    settings: PassSettings, weight: Tensor, targets: Tensor, row_weights: Tensor, parts: Sequence[Tensor]
) -> tuple[Tensor, Tensor, list[Optional[Tensor]], Optional[Tensor]]:
    """Every part's chunked sweep, one after the other, into one fp32 weight-gradient buffer.

    Returns row_loss (N,) and row_argmax (N,) over all parts' rows in order, each part's gradient (or ``None``) and
    the weight gradient (or ``None``).
    """
    sizes = [part.shape[0] for part in parts]
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if settings.grad_weight_wanted else None
    row_losses, row_argmaxes, grad_parts = [], [], []
    for part, part_targets, part_weights, grad_wanted, overwrite in zip(
        parts, targets.split(sizes), row_weights.split(sizes), settings.grad_hidden_wanted, settings.overwrite_hidden
    ):
        row_loss, row_argmax, grad_part, _ = settings.pass_fn(
            part, weight, part_targets, part_weights, settings.ignore_index, settings.chunk_rows(part, weight),
            grad_wanted, settings.grad_weight_wanted, settings.logit_scale, settings.softcap, overwrite, grad_weight,
        )
        row_losses.append(row_loss)
        row_argmaxes.append(row_argmax)
        grad_parts.append(grad_part)
    if len(parts) == 1:
        return row_losses[0], row_argmaxes[0], grad_parts, grad_weight
    return torch.cat(row_losses), torch.cat(row_argmaxes), grad_parts, grad_weight


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Gradients computed in forward (no logits kept); backward scales them in place by the incoming gradient.

    Shared by both backends (``settings.pass_fn``). Each part (N_i, H) is an input of its own and gets its own
    gradient, so autograd frees each as soon as its consumer (a depth's backward) has run.
    """

    @staticmethod
    def forward(ctx, settings: PassSettings, weight, targets, row_weights, *parts):
        # weight (V, H), targets (N,), row_weights (N,) fp32 already zero on ignored rows, parts (N_i, H) with
        # Σ N_i = N. The gradient flags come from grads_wanted(): ctx.needs_input_grad cannot tell whether backward
        # will run.
        row_loss, row_argmax, grad_parts, grad_weight = sweep_parts(settings, weight, targets, row_weights, parts)
        ctx.save_for_backward(grad_weight, *grad_parts)
        ctx.weight_dtype, ctx.consumed = weight.dtype, False
        ctx.mark_non_differentiable(row_loss, row_argmax)
        return (row_loss * row_weights).sum(), row_loss, row_argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_loss, _grad_argmax):
        if ctx.consumed:
            raise RuntimeError("linear_cross_entropy scales its precomputed gradients in place: backward runs once")
        ctx.consumed = True
        grad_weight, *grad_parts = ctx.saved_tensors
        # In place: a second full-size weight gradient here would raise the step's peak memory by V × H.
        grad_parts = [None if grad is None else grad.mul_(grad_loss.to(grad.dtype)) for grad in grad_parts]
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return None, grad_weight, None, None, *grad_parts


def as_parts(hidden: Union[Tensor, Sequence[Tensor]], weight: Tensor, targets: Tensor) -> list[Tensor]:
    """``hidden`` as a list of (N_i, H) parts, checked against ``weight`` (V, H) and ``targets`` (Σ N_i,)."""
    parts = [hidden] if isinstance(hidden, Tensor) else list(hidden)
    if not parts or weight.dim() != 2 or any(p.dim() != 2 or p.shape[1] != weight.shape[1] for p in parts):
        shapes = [tuple(p.shape) for p in parts]
        raise ValueError(
            f"expected hidden (N, H) or a non-empty list of (N_i, H) parts and weight (V, H), got "
            f"{shapes[0] if isinstance(hidden, Tensor) else shapes} and {tuple(weight.shape)}"
        )
    num_rows = sum(p.shape[0] for p in parts)
    if targets.shape != (num_rows,):
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden rows {num_rows}")
    return parts


def score_parts(
    parts: list[Tensor],
    weight: Tensor,
    weights: Tensor,
    targets: Tensor,
    pass_fn: PassFn,
    ignore_index: int,
    chunk_size: Optional[int],
    overwrite_hidden: Union[bool, Sequence[bool]],
    logit_scale: float,
    softcap: Optional[float],
) -> LinearCrossEntropyOutput:
    """Both backends' common tail: the forward alone when no gradient is wanted, else the autograd Function."""
    logit_scale, softcap = float(logit_scale), (None if softcap is None else float(softcap))
    overwrite = (overwrite_hidden,) * len(parts) if isinstance(overwrite_hidden, bool) else tuple(overwrite_hidden)
    if len(overwrite) != len(parts):
        raise ValueError(f"overwrite_hidden has {len(overwrite)} flags for {len(parts)} parts")
    wanted = [grads_wanted(part, weight) for part in parts]
    grad_weight_wanted = any(w for _, w in wanted)
    settings = PassSettings(pass_fn, int(ignore_index), chunk_size, logit_scale, softcap, overwrite,
                            tuple(h for h, _ in wanted), grad_weight_wanted)
    if not (grad_weight_wanted or any(settings.grad_hidden_wanted)):  # validation, inference, a frozen head and trunk
        with torch.no_grad():  # not differentiable w.r.t. row_weights on either path
            row_loss, row_argmax, _, _ = sweep_parts(settings, weight, targets, weights, parts)
            return LinearCrossEntropyOutput((row_loss * weights).sum(), row_loss, row_argmax)
    loss, row_loss, row_argmax = ChunkedLinearCrossEntropy.apply(settings, weight, targets, weights, *parts)
    return LinearCrossEntropyOutput(loss, row_loss, row_argmax)


def linear_cross_entropy_torch(
    hidden: Union[Tensor, Sequence[Tensor]],
    weight: Tensor,
    targets: Tensor,
    row_weights: Optional[Tensor] = None,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    overwrite_hidden: Union[bool, Sequence[bool]] = False,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
) -> LinearCrossEntropyOutput:
    """Weighted cross-entropy of ``scale_and_cap(hidden @ weight.T)`` against ``targets`` without materialising all
    logits.

    Args:
        hidden: (N, H) final hidden states (after the final norm) of every scored row, or a list of (N_i, H) parts
            (e.g. one per depth) scored as if concatenated, each receiving its own gradient.
        weight: (V, H) output projection.
        targets: (N,) token ids; ``ignore_index`` rows score 0 and get no gradient.
        row_weights: (N,) weight of each row's loss. ``None`` gives the mean over valid rows.
        chunk_size: rows of logits materialised at once; default from :func:`default_chunk_size`, per part.
        overwrite_hidden: ``hidden`` is private scratch that nobody reads afterwards: its rows are overwritten by
            their gradients to save an (N, H) buffer. One flag, or one per part. Must not be set for tensors saved
            for backward elsewhere (autograd would then report the in-place change).
        logit_scale: multiplies the head's outputs (Cohere's ``logit_scale``; 1 = none).
        softcap: then ``softcap · tanh(logits / softcap)`` (Gemma-2's ``final_logit_softcapping``; ``None`` = none).

    ``row_loss`` and ``row_argmax`` are those of the scaled and capped logits, over all parts' rows in order.
    """
    parts = as_parts(hidden, weight, targets)
    check_logit_transform(logit_scale, softcap)
    weights = resolve_row_weights(targets, row_weights, ignore_index)
    return score_parts(parts, weight, weights, targets, chunked_pass, ignore_index, chunk_size, overwrite_hidden,
                       logit_scale, softcap)
