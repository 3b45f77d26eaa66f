"""``MTPWeightSchedule``: the MTP loss weight λ over time, and per-depth weights that decay with distance."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_mtp.callbacks._base import (
    MTPCallback,
    batch_input_ids,
    check_int,
    check_non_negative,
    require_mtp_module,
)
from lightning_mtp.callbacks.schedules import KINDS, ScalarSchedule
from lightning_mtp.mixin.batches import batch_mask

UNITS = ("steps", "tokens")


class MTPWeightSchedule(MTPCallback):
    """Schedules λ (``pl_module.mtp_loss_weight``) and the per-depth weights w_k (``pl_module.mtp_depth_weights``).

    The training loss is main + λ · mean_k(w_k · L_k) over the active depths. The callback sets both at the start of
    every training batch from the optimizer step (or from the tokens of all finished optimizer steps, with
    ``unit="tokens"``), so every micro-batch of one optimizer step sees one value.

    λ schedules (``schedule``):

    - ``"constant"``: ``loss_weight`` (default: ``MTPConfig.loss_weight``);
    - ``"step"``: ``milestones={counter: λ}``; DeepSeek-V3 used 0.3 for the first 10T tokens and 0.1 after:
      ``schedule="step", unit="tokens", milestones={0: 0.3, 10_000_000_000_000: 0.1}``;
    - ``"linear"`` / ``"cosine"``: from ``start`` at ``begin`` to ``end`` at ``until``.

    Per-depth weights: ``depth_decay=γ`` gives w_k = γ^(k-1) (Medusa used γ = 0.8), or ``depth_weights`` lists them;
    default ``MTPConfig.depth_weights`` (all 1). ``distant_ramp=N`` ramps every w_k with k ≥ 2 linearly from 0 to its
    target over the first N steps (or tokens): "progressive loss weights" (depth 1 keeps its weight throughout).

    Args:
        schedule: ``"constant"``, ``"step"``, ``"linear"`` or ``"cosine"``.
        loss_weight: λ of ``"constant"``.
        milestones: ``{counter: λ}`` of ``"step"``; counters strictly increasing from 0.
        start: λ at ``begin`` (``"linear"``/``"cosine"``).
        end: λ at ``until`` (``"linear"``/``"cosine"``).
        begin: counter where the ramp starts.
        until: counter where the ramp ends.
        unit: ``"steps"`` (optimizer steps) or ``"tokens"`` (input tokens of finished optimizer steps, all ranks).
        depth_decay: γ ≥ 0: w_k = γ^(k-1).
        depth_weights: explicit w_1..w_D (≥ 0, one per ``MTPConfig.depth``).
        distant_ramp: ramp length (in ``unit``) of the weights of depths ≥ 2.

    Logs ``train/mtp/lambda`` and ``train/mtp/weight_depth{k}`` for k = 1..D.

    Example::

        from lightning_mtp.callbacks import MTPWeightSchedule

        # DeepSeek-V3: λ = 0.3, then 0.1 after 10T tokens; Medusa's distance decay 0.8^(k-1)
        MTPWeightSchedule(schedule="step", unit="tokens", milestones={0: 0.3, 10_000_000_000_000: 0.1},
                          depth_decay=0.8)
        # cosine from 0.3 to 0.1 over 5000 steps, distant depths ramped in over the first 1000
        MTPWeightSchedule(schedule="cosine", start=0.3, end=0.1, until=5000, distant_ramp=1000)
    """

    def __init__(
        self,
        schedule: str = "constant",
        loss_weight: Optional[float] = None,
        milestones: Optional[dict[int, float]] = None,
        start: Optional[float] = None,
        end: Optional[float] = None,
        begin: int = 0,
        until: Optional[int] = None,
        unit: str = "steps",
        depth_decay: Optional[float] = None,
        depth_weights: Optional[list[float]] = None,
        distant_ramp: Optional[int] = None,
    ) -> None:
        if schedule not in KINDS:
            raise ValueError(f"MTPWeightSchedule.schedule must be one of {KINDS}, got {schedule!r}")
        if unit not in UNITS:
            raise ValueError(f"MTPWeightSchedule.unit must be one of {UNITS}, got {unit!r}")
        self.schedule_kind = schedule
        # A constant without a value takes MTPConfig.loss_weight in setup; everything else is checked here.
        self.loss_weight: Optional[ScalarSchedule] = None
        if not (schedule == "constant" and loss_weight is None):
            self.loss_weight = ScalarSchedule(
                schedule, value=loss_weight, milestones=milestones, start=start, end=end, begin=begin, until=until,
                name="MTPWeightSchedule",
            )
        self.unit = unit
        # fixed at construction: setup() may fill in the config's λ, and the key must not change with it
        self._lambda_key = repr(self.loss_weight) if self.loss_weight is not None else "MTPConfig.loss_weight"
        if depth_decay is not None and depth_weights is not None:
            raise ValueError(
                f"MTPWeightSchedule takes depth_decay or depth_weights, not both: got depth_decay={depth_decay!r}, "
                f"depth_weights={depth_weights!r}"
            )
        self.depth_decay = None if depth_decay is None else check_non_negative("MTPWeightSchedule.depth_decay",
                                                                              depth_decay)
        if depth_weights is not None:
            if not isinstance(depth_weights, (list, tuple)) or not depth_weights:
                raise ValueError(f"MTPWeightSchedule.depth_weights must be a non-empty list, got {depth_weights!r}")
            depth_weights = [check_non_negative(f"MTPWeightSchedule.depth_weights[{i}]", w)
                             for i, w in enumerate(depth_weights)]
        self.depth_weights = depth_weights
        self.distant_ramp = None if distant_ramp is None else check_int("MTPWeightSchedule.distant_ramp",
                                                                        distant_ramp, 1)
        self._targets: list[float] = []
        # Schedule position: tokens of every micro-batch started, and of the finished optimizer steps.
        self.tokens_seen = 0
        self.tokens_at_step = 0
        self.last_step = -1
        self.current_loss_weight: Optional[float] = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(loss_weight=self._lambda_key, unit=self.unit,
                                        depth_decay=self.depth_decay, depth_weights=self.depth_weights,
                                        distant_ramp=self.distant_ramp)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mtp_module(pl_module, "MTPWeightSchedule")
        depth = module.mtp_config.depth
        if self.loss_weight is None:
            self.loss_weight = ScalarSchedule("constant", value=module.mtp_config.loss_weight)
        if self.depth_weights is not None:
            if len(self.depth_weights) != depth:
                raise ValueError(
                    f"MTPWeightSchedule.depth_weights has {len(self.depth_weights)} entries {self.depth_weights}, "
                    f"but MTPConfig.depth = {depth} (--model.mtp.depth)"
                )
            self._targets = list(self.depth_weights)
        elif self.depth_decay is not None:
            self._targets = [self.depth_decay ** (k - 1) for k in range(1, depth + 1)]
        else:
            # The config, never the runtime attribute: a resumed module may hold mid-ramp values.
            self._targets = list(module.mtp_config.depth_weights or [1.0] * depth)

    def counter(self) -> int:
        """The schedule's position: optimizer steps, or tokens of the finished optimizer steps."""
        return self.last_step if self.unit == "steps" else self.tokens_at_step

    def weights_at(self, counter: int) -> tuple[float, list[float]]:
        """(λ, [w_1..w_D]) at ``counter``."""
        ramp = 1.0 if self.distant_ramp is None else min(1.0, counter / self.distant_ramp)
        return self.loss_weight(counter), [self._targets[0]] + [w * ramp for w in self._targets[1:]]

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.last_step:  # first micro-batch of an optimizer step
            self.last_step = trainer.global_step
            self.tokens_at_step = self.tokens_seen
        if self.unit == "tokens":  # (a count summed over the processes: a collective, only where it is read)
            self.tokens_seen += batch_tokens(trainer, batch)
        loss_weight, depth_weights = self.weights_at(self.counter())
        self.current_loss_weight = loss_weight
        pl_module.mtp_loss_weight = loss_weight
        pl_module.mtp_depth_weights = depth_weights
        values = {"train/mtp/lambda": loss_weight}
        values.update({f"train/mtp/weight_depth{k}": w for k, w in enumerate(depth_weights, start=1)})
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen, "tokens_at_step": self.tokens_at_step, "last_step": self.last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens_seen = state_dict.get("tokens_seen", 0)
        self.tokens_at_step = state_dict.get("tokens_at_step", 0)
        self.last_step = state_dict.get("last_step", -1)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A fit resumed with other arguments (a milestone moved): Lightning restores a callback's state only under
        the same arguments (``state_key``), and the tokens the fit has seen would restart at 0, though they count the
        fit, not the schedule. Take them from the checkpoint's own ``MTPWeightSchedule``."""
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return  # Lightning loads it
        saved = [key for key in states if key.startswith(f"{type(self).__qualname__}{{")]
        if len(saved) == 1:
            self.load_state_dict(states[saved[0]])
            rank_zero_warn(f"MTPWeightSchedule: resumed with other arguments than the checkpoint's fit ({saved[0]}); "
                           f"its position ({self.tokens_seen} tokens, step {self.last_step}) continues, and λ and the "
                           "per-depth weights follow the new arguments from there")


def batch_tokens(trainer: L.Trainer, batch: Any) -> int:
    """The tokens of this micro-batch on every process: its ``attention_mask``'s ones (right padding is not a token
    trained on), or all its ids; summed over the processes (their batches may be padded to other widths)."""
    mask = batch_mask(batch)
    tokens = mask.sum() if mask is not None else torch.tensor(batch_input_ids(batch).numel())
    if trainer.world_size > 1:
        tokens = trainer.strategy.reduce(tokens.to(trainer.strategy.root_device, torch.long), reduce_op="sum")
    return int(tokens)
