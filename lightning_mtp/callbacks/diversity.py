"""``MTPDiversityRegularizer``: a penalty on adjacent MTP depths that collapse onto the same prediction."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning as L
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_mtp.callbacks._base import MTPCallback, check_int, require_mtp_module
from lightning_mtp.callbacks.schedules import ScalarSchedule, as_schedule
from lightning_mtp.head_calls import chunk_rows, head_logits, loss_head, row_chunks
from lightning_mtp.mixin import MTPForward, MTPMixin


class MTPDiversityRegularizer(MTPCallback):
    r"""Penalises the collision probability of adjacent depths at the same position.

    When depth k and depth k+1 put their mass on the same token at position i, the drafts repeat themselves
    ("the the the"). With p_k(·|i) = softmax(head_k(h_k(i))), the term added to the training loss is

    .. math::

        R = w(t) \cdot \frac{1}{|P|} \sum_{k \in P} \frac{1}{|M_k|} \sum_{i \in M_k} \sum_v p_k(v|i)\, p_{k+1}(v|i)

    where P holds the pairs (k, k+1) of active depths and M_k the positions whose two targets t(i+k+1) and t(i+k+2)
    are both scored and differ (with ``only_differing_targets=False``: all scored positions). Σ_v p_k p_{k+1} is the
    probability that independent draws from the two heads collide; it is 1 for two identical one-hot predictions and
    1/V for two uniform ones. Gradients reach both depths' modules and heads, except a head shared with the trunk under
    ``MTPConfig.detach_trunk``, which (like the trunk and the embedding) gets none: see
    :func:`~lightning_mtp.callbacks._base.loss_head`. Probabilities are computed ``chunk_size`` rows at a time with
    activation recomputation, through the head modules (never their weights, so it works under DeepSpeed ZeRO-3; with
    ``detach_trunk`` only separate heads, ``share_output_head=False``, can be used there).

    The term is registered in ``setup`` as an MTP loss term named ``name`` and is logged as ``train/mtp/<name>``
    (weighted, default ``train/mtp/diversity``); the unweighted collision of each pair as
    ``train/mtp/<name>_collision_depth{k}``, and w(t) as ``train/mtp/<name>_weight``.

    Args:
        weight: w(t) ≥ 0: a number, a ``{step: weight}`` step schedule, or a :class:`ScalarSchedule` over optimizer
            steps.
        only_differing_targets: score only positions whose two targets differ (where agreeing is wrong).
        chunk_size: rows of [rows × vocab] probabilities alive at once (default: the MTP loss's chunk size).
        name: name of the loss term (several instances need different names).

    Example::

        from lightning_mtp.callbacks import MTPDiversityRegularizer, ScalarSchedule

        MTPDiversityRegularizer(weight=0.05)
        MTPDiversityRegularizer(weight=ScalarSchedule("linear", start=0.0, end=0.05, until=2000))
    """

    def __init__(
        self,
        weight: Union[float, dict[int, float], ScalarSchedule] = 0.05,
        only_differing_targets: bool = True,
        chunk_size: Optional[int] = None,
        name: str = "diversity",
    ) -> None:
        self.weight = as_schedule("MTPDiversityRegularizer.weight", weight)
        self.only_differing_targets = bool(only_differing_targets)
        self.chunk_size = None if chunk_size is None else check_int("MTPDiversityRegularizer.chunk_size", chunk_size, 1)
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"MTPDiversityRegularizer.name must be an identifier such as 'diversity', got {name!r}")
        self.name = name
        self.current_weight = self.weight(0)
        self.last_step = -1

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mtp_module(pl_module, "MTPDiversityRegularizer")
        if module.mtp_config.depth < 2:
            raise ValueError(
                "MTPDiversityRegularizer penalises adjacent MTP depths and needs MTPConfig.depth >= 2 "
                f"(--model.mtp.depth), got {module.mtp_config.depth}"
            )
        module.register_mtp_loss_term(self.name, self.loss_term)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(pl_module, MTPMixin):
            pl_module.unregister_mtp_loss_term(self.name)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.last_step = trainer.global_step
        self.current_weight = self.weight(trainer.global_step)
        pl_module.log(f"train/mtp/{self.name}_weight", self.current_weight, on_step=True, on_epoch=False,
                      batch_size=1)

    def loss_term(self, module: MTPMixin, fwd: MTPForward) -> Tensor:
        """R above, for the depths of ``fwd`` (the active ones)."""
        if self.current_weight == 0 or len(fwd.depth_hidden) < 2:
            return fwd.trunk_hidden.new_zeros((), dtype=torch.float32)
        collisions = []
        for depth in range(1, len(fwd.depth_hidden)):
            total, count = collision_sum(module, fwd, depth, self.only_differing_targets, self.chunk_size)
            collisions.append(total / count.clamp(min=1))
        if getattr(module, "_trainer", None) is not None:
            values = {f"train/mtp/{self.name}_collision_depth{k}": c.detach() for k, c in enumerate(collisions, 1)}
            module.log_dict(values, on_step=True, on_epoch=False, batch_size=fwd.input_ids.shape[0])
        return self.current_weight * torch.stack(collisions).mean()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "current_weight": self.current_weight}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = state_dict.get("last_step", -1)
        self.current_weight = state_dict.get("current_weight", self.weight(max(self.last_step, 0)))


def collision_sum(
    module: MTPMixin, fwd: MTPForward, depth: int, only_differing_targets: bool = True, chunk_size: Optional[int] = None
) -> tuple[Tensor, Tensor]:
    """(Σ_i Σ_v p_depth(v|i) · p_depth+1(v|i) over the scored positions i, their count); a packed batch's positions
    whose targets lie in another document are not scored (``MTPForward.targets``)."""
    ignore = module.mtp_config.ignore_index
    near, far = fwd.depth_hidden[depth - 1], fwd.depth_hidden[depth]  # (B, T-k-1, H), (B, T-k-2, H)
    length = far.shape[1]
    near_targets = fwd.targets(depth, length, ignore)  # t(i+k+1), (B, L)
    far_targets = fwd.targets(depth + 1, length, ignore)  # t(i+k+2), (B, L)
    mask = (near_targets != ignore) & (far_targets != ignore)
    if only_differing_targets:
        mask &= near_targets != far_targets
    # Every row goes through the heads, masked ones weighted 0: the number of head calls then depends on the batch
    # shape only, which DeepSpeed ZeRO-3 needs (each call gathers the head's weight on every rank).
    hidden = near.shape[-1]
    near_rows = near[:, :length].reshape(-1, hidden)  # (B*L, H)
    far_rows = far.reshape(-1, hidden)  # (B*L, H)
    weights = mask.reshape(-1).float()  # (B*L,)
    heads = (head_logits(module, loss_head(module, depth)), head_logits(module, loss_head(module, depth + 1)))
    total = near_rows.new_zeros((), dtype=torch.float32)
    for part in row_chunks(near_rows.shape[0], chunk_rows(module, near_rows.shape[0], chunk_size)):
        args = (*heads, near_rows[part], far_rows[part], weights[part])
        if torch.is_grad_enabled():
            # Recompute the chunk's probabilities in backward: only one chunk of [rows × vocab] is ever alive.
            total = total + checkpoint(_chunk_collision, *args, use_reentrant=False)
        else:
            total = total + _chunk_collision(*args)
    return total, mask.sum()


def _chunk_collision(
    near_head: Callable[[Tensor], Tensor], far_head: Callable[[Tensor], Tensor], near: Tensor, far: Tensor,
    weights: Tensor,
) -> Tensor:
    p_near = torch.softmax(near_head(near).float(), dim=-1)  # (c, V)
    p_far = torch.softmax(far_head(far).float(), dim=-1)  # (c, V)
    return ((p_near * p_far).sum(-1) * weights).sum()
