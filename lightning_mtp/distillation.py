"""Acceptance-aware training: self-distillation of each MTP depth toward the main model's own prediction.

A draft from depth k at position i is accepted when it matches what the main model predicts at position i+k, not
when it matches the data. The term

    distill = β · mean_k [ (1/|M_k|) Σ_{i ∈ M_k} KL( stop-grad(p_main(·|i+k)) ‖ p_k(·|i) ) ]

(β = ``module.mtp_distill_weight``, k over the active depths, M_k the positions whose target t(i+k+1) is scored: its
label is not ``ignore_index`` and, in a packed batch, it lies in i's document, so the teacher at i+k does too)
pulls depth k toward the main model's distribution (Medusa-2 trains its heads with self-distillation too). The
teacher runs under ``no_grad``: neither the trunk nor the head learns from it. Under ``MTPConfig.detach_trunk`` the
student side does not move a head shared with the trunk either (:func:`~lightning_mtp.callbacks._base.loss_head`).
Rows are processed in chunks with activation recomputation, so at most one chunk of [rows × vocab] logits is alive
at a time, and logits come from calling the head modules (DeepSpeed ZeRO-3 gathers their weights in the call).

It is registered as the MTP loss term ``"distill"`` (logged as ``train/mtp/distill``) by ``MTPMixin`` when
``MTPConfig.distill_weight > 0`` (``--model.mtp.distill_weight``).

Example::

    >>> import torch
    >>> from lightning_mtp import MTPConfig
    >>> from lightning_mtp.models import CausalLM, ModelConfig
    >>> config = MTPConfig(depth=2, distill_weight=0.5)
    >>> model = CausalLM(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4), config)
    >>> model.configure_model()
    >>> out = model.compute_lm_loss(torch.randint(0, 64, (2, 16)))
    >>> sorted(out.extra_terms)
    ['distill']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_mtp.head_calls import chunk_rows, depth_head, head_logits, loss_head, row_chunks
from lightning_mtp.outputs import MTPForward

if TYPE_CHECKING:
    from lightning_mtp.mixin import MTPMixin


def self_distillation_term(module: MTPMixin, fwd: MTPForward) -> Tensor:
    """β · mean over active depths of the masked mean KL(stop-grad(main at i+k) ‖ depth k at i)."""
    weight = float(module.mtp_distill_weight)
    if weight == 0 or not fwd.depth_hidden:
        return fwd.trunk_hidden.new_zeros((), dtype=torch.float32)
    per_depth = [kl / count.clamp(min=1) for kl, count in (depth_kl_sum(module, fwd, k)
                                                           for k in range(1, len(fwd.depth_hidden) + 1))]
    return weight * torch.stack(per_depth).mean()


def main_hidden(module: MTPMixin, fwd: MTPForward) -> Tensor:
    """(B, T-1, H) final-normed trunk states; position j predicts t(j+1)."""
    if fwd.main_hidden is not None:
        return fwd.main_hidden
    return module.mtp_final_norm()(fwd.trunk_hidden[:, :-1])


def depth_kl_sum(
    module: MTPMixin, fwd: MTPForward, depth: int, chunk_size: Optional[int] = None
) -> tuple[Tensor, Tensor]:
    """(Σ_i KL(stop-grad(p_main(·|i+depth)) ‖ p_depth(·|i)) over the scored positions i, their count)."""
    student = fwd.depth_hidden[depth - 1]  # (B, L, H), L = T-k-1
    length = student.shape[1]
    with torch.no_grad():
        teacher = main_hidden(module, fwd)[:, depth : depth + length]  # main at i+k, (B, L, H)
    ignore = module.mtp_config.ignore_index
    mask = fwd.targets(depth, length, ignore) != ignore  # (B, L): t(i+k+1) scored, in i's document
    # Every row goes through the heads, masked ones weighted 0: the number of head calls depends on the batch shape
    # only, as DeepSpeed ZeRO-3 needs (each call gathers the head's weight on every rank).
    hidden = student.shape[-1]
    student_rows, teacher_rows = student.reshape(-1, hidden), teacher.reshape(-1, hidden)  # (B*L, H)
    weights = mask.reshape(-1).float()  # (B*L,)
    # The teacher runs under no_grad; both read logits as the host forms them (scaling, soft-capping).
    teacher_head = head_logits(module, depth_head(module, 0))
    student_head = head_logits(module, loss_head(module, depth))
    total = student_rows.new_zeros((), dtype=torch.float32)
    for part in row_chunks(student_rows.shape[0], chunk_rows(module, student_rows.shape[0], chunk_size)):
        args = (teacher_head, student_head, teacher_rows[part], student_rows[part], weights[part])
        if torch.is_grad_enabled():
            # Recompute in backward: keeps only the inputs, never a chunk's [rows × vocab] logits.
            total = total + checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            total = total + _chunk_kl(*args)
    return total, mask.sum()


def _chunk_kl(
    teacher_head: Callable, student_head: Callable, teacher: Tensor, student: Tensor, weights: Tensor
) -> Tensor:
    with torch.no_grad():
        teacher_logp = torch.log_softmax(teacher_head(teacher).float(), dim=-1)  # (c, V), stop-grad
    student_logp = torch.log_softmax(student_head(student).float(), dim=-1)  # (c, V)
    # KL(p ‖ q) = Σ_v p (log p - log q), per row
    return ((teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1) * weights).sum()
