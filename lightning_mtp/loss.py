"""Per-depth MTP targets, masks and the weighted loss, computed with chunked cross-entropy.

Depth k at position i predicts t(i+k+1) (depth 0 is the next-token head). With T tokens, depth k has T-k-1 scored
positions; positions whose target falls past the end are never computed, and targets equal to ``ignore_index``
(padding, prompts) are masked. In a packed batch (``position_ids``, several documents per row) a target in another
document than its position is masked too (:func:`depth_targets`). Each depth's mean is over its own valid count,
clamped to ≥ 1, so a depth with no valid target contributes 0, never NaN (Megatron-LM #1532 and #2417 came from
getting this normalisation wrong).

All depths that share a head are scored by one chunked cross-entropy call with per-row weights w_k / n_k: one fp32
weight-gradient buffer serves every depth, and no logits are kept for backward. Each depth's rows are a part of
their own in that call (chunked by their own count, with their own gradient tensor), not a concatenated copy.
With ``MTPConfig.recompute`` each depth keeps only its inputs and its block's mid residual, and its backward reruns
it once, piece by piece (:func:`run_depth`).
Under DeepSpeed ZeRO-3 (a partitioned head weight) the same loss goes through the head module instead
(:func:`lightning_mtp.zero.head_cross_entropy`); a detached head (``MTPConfig.detach_trunk``) is gathered and scored by
the fused kernel, which keeps no reference to it. Under FSDP2 the head belongs to the root's group, whole wherever
the mixin scores (``MTPMixin.mtp_whole_root``), so the fused kernel reads it as on one process.

Hosts that scale or soft-cap their head's outputs (Cohere, Granite, Gemma-2, ...) describe that with a
:class:`LogitTransform` (``MTPMixin.mtp_logit_transform``); every depth's logits get it, in the loss and in decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_mtp.kernels import linear_cross_entropy_torch, linear_cross_entropy_triton, resolve_backend
from lightning_mtp.kernels.linear_cross_entropy_torch import check_logit_transform, scale_and_cap
from lightning_mtp.layers import document_ids
from lightning_mtp.sharded import gathered_weights, is_dtensor
from lightning_mtp.zero import head_cross_entropy, is_partitioned


@dataclass(frozen=True)
class LogitTransform:
    """What a host does to its head's outputs z before softmax: y = softcap · tanh(scale · z / softcap), or
    y = scale · z without a cap. The default is the identity.

    Example::

        >>> import torch
        >>> LogitTransform(scale=0.5, softcap=1.0)(torch.tensor([0.0, 100.0]))
        tensor([0., 1.])
    """

    scale: float = 1.0
    """Multiplier of the head's outputs (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``)."""
    softcap: Optional[float] = None
    """Cap of the tanh soft-capping after the scale (Gemma-2's ``final_logit_softcapping``); ``None``: no cap."""

    def __post_init__(self) -> None:
        check_logit_transform(self.scale, self.softcap, names=("LogitTransform.scale", "LogitTransform.softcap"))

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        """The transformed logits (same shape; out of place, in the dtype of ``logits``)."""
        return logits if self.is_identity else scale_and_cap(logits, self.scale, self.softcap)


def depth_targets(
    labels: Tensor, depth: int, length: int, position_ids: Optional[Tensor] = None, ignore_index: int = -100
) -> Tensor:
    """Targets of depth k for its first ``length`` positions: labels shifted left by k+1. (B, T) -> (B, length).

    With ``position_ids`` (B, T) of packed documents, the target of position i is ``ignore_index`` unless t(i+k+1)
    lies in i's document (:func:`same_document`): no depth learns to predict across a document boundary.
    """
    targets = labels[:, depth + 1 : depth + 1 + length]  # (B, length)
    if position_ids is None:
        return targets
    return targets.masked_fill(~same_document(position_ids, depth, length), ignore_index)


def same_document(position_ids: Tensor, depth: int, length: int) -> Tensor:
    """(B, length) bool: token i + depth + 1 lies in token i's document, for i < ``length``; for position ids that
    restart at 0 at each document, ``position_ids[i + depth + 1] == position_ids[i] + depth + 1``. Documents are
    contiguous, so every token between the two is in that document too."""
    documents = document_ids(position_ids)  # (B, T)
    return documents[:, :length] == documents[:, depth + 1 : depth + 1 + length]


@dataclass
class DepthLossPart:
    """One depth's scored rows: its share of the differentiable loss and detached per-row results."""

    loss: Tensor  # scalar, weight · mean CE (differentiable)
    row_loss: Tensor  # (N,) detached CE per row, 0 where ignored
    row_argmax: Tensor  # (N,) detached predictions
    targets: Tensor  # (N,)
    count: Tensor  # scalar, valid rows
    weight: float  # the depth's coefficient in the total


@dataclass
class DepthLossSpec:
    """How one depth is scored: its head, targets (B, L), weight in the total and chunking."""

    head_weight: Tensor  # (V, H)
    targets: Tensor  # (B, L)
    weight: float
    ignore_index: int = -100
    chunk_size: Optional[int] = None
    head: Optional[nn.Module] = None  # the module owning head_weight; called instead when it is ZeRO-3-partitioned
    detach_head: bool = False  # score with the head weight detached: no gradient into it (MTPConfig.detach_trunk)
    normalizer: Optional[Tensor] = None  # scalar: what the summed CE is divided by (None: this batch's n_valid)

    def row_weights(self, device) -> tuple[Tensor, Tensor, Tensor]:
        """Flat targets (N,), per-row weights weight / normalizer (N,) and n_valid; the normalizer is n_valid unless
        given (the tokens of a whole optimizer step, :mod:`lightning_mtp.mixin.step_tokens`)."""
        targets = self.targets.reshape(-1)
        count = (targets != self.ignore_index).sum()
        normalizer = count.clamp(min=1) if self.normalizer is None else self.normalizer.to(device).clamp(min=1e-12)
        scale = torch.as_tensor(self.weight, dtype=torch.float32, device=device) / normalizer
        return targets, scale.expand(targets.shape[0]), count


def score_jointly(
    specs: Sequence[DepthLossSpec],
    normed: list[Tensor],
    transform: Optional[LogitTransform] = None,
    private: bool = False,
) -> list[DepthLossPart]:
    """Score several depths with one chunked cross-entropy call per distinct head weight.

    ``normed`` holds each depth's (B, L, H) normed hidden states; the list is consumed (emptied), so that the call
    holds the only references the caller gave up. Each depth's rows go in as a part of their own (no concatenated
    copy), chunked by their own row count, and get a gradient of their own, which autograd frees once that depth's
    backward has run. ``private``: nothing else reads these states afterwards, so each receives its gradient in
    place (no (N, H) gradient buffer). ``transform`` is the host's logit transform (default: none).
    """
    transform = transform or LogitTransform()
    scaling = dict(logit_scale=transform.scale, softcap=transform.softcap)
    parts: list[Optional[DepthLossPart]] = [None] * len(specs)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault((id(spec.head_weight), spec.detach_head), []).append(i)
    overwritable = [private and _overwritable(h) for h in normed]
    rows = [h.reshape(-1, h.shape[-1]) for h in normed]  # (B*L, H) each
    normed.clear()
    for members in groups.values():
        sizes = [rows[i].shape[0] for i in members]
        hidden = [rows[i] for i in members]
        for i in members:
            rows[i] = None  # the call's list is the only reference now
        flat = [specs[i].row_weights(hidden[0].device) for i in members]
        first = specs[members[0]]
        targets, row_weights = torch.cat([f[0] for f in flat]), torch.cat([f[1] for f in flat])
        if is_dtensor(first.head_weight):
            raise RuntimeError(
                "the output head's weight is an FSDP2 shard here: score through compute_lm_loss / compute_mtp_loss, "
                "which make the root's parameters whole first (MTPMixin.mtp_whole_root)"
            )
        if is_partitioned(first.head_weight) and first.detach_head:
            # ZeRO-3 with a detached head (MTPConfig.detach_trunk): the fused kernel on the gathered weight, detached;
            # it keeps no reference to the weight for backward, so the gathered copy may go at once.
            with gathered_weights([first.head_weight]):
                out = linear_cross_entropy_torch(hidden, first.head_weight.detach(), targets, row_weights,
                                                 first.ignore_index, first.chunk_size,
                                                 overwrite_hidden=[overwritable[i] for i in members], **scaling)
        elif is_partitioned(first.head_weight):
            # DeepSpeed ZeRO-3: the weight is an empty partition here; the module call gathers it.
            if first.head is None:
                raise ValueError("DepthLossSpec.head is required when head_weight is a DeepSpeed ZeRO-3 partition")
            joined = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
            hidden.clear()
            out = head_cross_entropy(joined, first.head, targets, row_weights, first.ignore_index, first.chunk_size,
                                     **scaling)
            del joined
        else:
            weight = first.head_weight.detach() if first.detach_head else first.head_weight
            backend = resolve_backend("auto", *hidden, weight, targets)
            cross_entropy = linear_cross_entropy_triton if backend == "triton" else linear_cross_entropy_torch
            out = cross_entropy(hidden, weight, targets, row_weights, first.ignore_index,
                                first.chunk_size, overwrite_hidden=[overwritable[i] for i in members], **scaling)
        del hidden
        # The joint loss is attributed to the group's first member; the others carry zero (the sum is what counts).
        losses = [out.loss] + [out.loss.new_zeros(())] * (len(members) - 1)
        for i, loss, row_loss, row_argmax, (targets, _, count) in zip(
            members, losses, out.row_loss.split(sizes), out.row_argmax.split(sizes), flat
        ):
            parts[i] = DepthLossPart(loss, row_loss, row_argmax, targets, count, specs[i].weight)
    return parts


def _overwritable(states: Tensor) -> bool:
    """Whether private states may receive their gradient in place: they own their storage (not a view: an identity
    final norm hands back a slice of the trunk's state) and the op that made them did not save them for its backward
    (e.g. ``tanh``; autograd would then refuse the changed tensor)."""
    if states._is_view():
        return False
    producer = states.grad_fn
    saved = [getattr(producer, name, None) for name in dir(producer) if name.startswith("_saved_")] if producer else []
    return not any(isinstance(t, Tensor) and t.data_ptr() == states.data_ptr() for t in saved)


@dataclass
class DepthLosses:
    """All scored depths together."""

    loss: Tensor
    """Differentiable Σ_k weight_k · mean CE of depth k."""
    per_depth: Tensor
    """(n_depths,) detached mean CE of each depth (0 where nothing is valid)."""
    valid_counts: Tensor
    """(n_depths,) scored tokens of each depth."""
    predictions: list[Tensor] = field(default_factory=list)
    """Per depth (N,) argmax predictions, for accuracies."""
    targets: list[Tensor] = field(default_factory=list)
    """Per depth (N,) targets, ``ignore_index`` where masked."""
    weights: list[float] = field(default_factory=list)
    """Per depth its coefficient in ``loss`` (``weight_k``)."""


def combine_parts(parts: Sequence[DepthLossPart]) -> DepthLosses:
    counts = torch.stack([p.count for p in parts])
    per_depth = torch.stack([p.row_loss.sum() for p in parts]) / counts.clamp(min=1)
    loss = parts[0].loss
    for part in parts[1:]:
        loss = loss + part.loss
    return DepthLosses(loss, per_depth.detach(), counts, [p.row_argmax for p in parts], [p.targets for p in parts],
                       [p.weight for p in parts])


MLP_RECOMPUTE_CHUNKS = 8
"""Token chunks in which a recomputed depth reruns its position-wise pieces (the MLP, whose SwiGLU activations are
the block's largest, the norms and the cascaded mix); the per-row pieces of its attention half take this many chunks
per batch (``MLP_RECOMPUTE_CHUNKS // B`` per row). A chunk's working set sits on top of every trunk activation: with
the SwiGLU gate differentiated in place (``heads._swiglu_backward``) an MLP chunk holds about 3.5 MiB at the
``benchmarks/train_overhead.py`` shape, below the attention half's per-row set. More chunks save little more and cost
time: 16 chunks measured 0.2 s dearer per step there (smaller products, more calls)."""


def run_depth(
    module: nn.Module, cos: Tensor, sin: Tensor, recompute: bool, hidden: Tensor, embedding: Optional[Tensor],
    positions: Optional[Tensor] = None, mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """One depth: h_k = module(h_(k-1) or h_0, Emb) and its output norm. Returns (h_k (B, L, H), norm(h_k)).

    Packed documents: ``positions`` (B, L) are the tokens' positions within their documents (the native modules
    apply their own RoPE from them; the lightning modules get theirs in ``cos``/``sin``), ``mask`` (B, 1, L, L) the
    block-diagonal causal attention mask (:func:`~lightning_mtp.layers.document_mask`). ``None``: one sequence per
    row, causal. With ``recompute`` the depth keeps no activations but its residual between attention and MLP; its
    backward reruns it once, piece by piece (:func:`~lightning_mtp.heads.recomputed_depth`, run inside the module's
    call).
    """
    if recompute:
        if getattr(module, "_z3_leaf", False) and not any(t is not None and t.requires_grad
                                                          for t in (hidden, embedding)):
            # A ZeRO-3 leaf module reduces its gradients in a full backward hook, which fires once its inputs'
            # gradients exist, or, when no input needs one (detach_trunk at depth 1), before its backward has run.
            hidden = hidden.detach().requires_grad_()
        return module(hidden, embedding, cos, sin, mask=mask, recompute=MLP_RECOMPUTE_CHUNKS)
    # One call for h_k and norm(h_k): the output norm's weight is used inside the module's call, where sharded
    # parameters (FSDP2 units, ZeRO-3 leaf modules) are whole.
    return module(hidden, embedding, cos, sin, positions, None, mask, normed=True)
