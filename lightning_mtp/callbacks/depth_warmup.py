"""``MTPDepthWarmup``: start with few active MTP depths and add the distant ones on a schedule."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_mtp.callbacks._base import MTPCallback, check_depth_in_config, check_int, require_mtp_module
from lightning_mtp.callbacks.schedules import check_milestones, step_value


class MTPDepthWarmup(MTPCallback):
    """Progressive depth: train depth 1 first and switch deeper depths on once training is stable.

    Sets ``pl_module.mtp_active_depth`` at the start of every training batch from ``trainer.global_step``, so all
    micro-batches of one optimizer step (gradient accumulation) see the same depth. A depth above the active one runs
    no forward and gives no loss; the MTP mean divides by the active count. Every module exists from the start and
    the optimizer's parameter groups are never touched, so the callback is safe under DeepSpeed (which allows one
    optimizer and no parameter-group changes). An inactive depth gets no gradient (``grad is None``), and PyTorch's
    optimizers skip such parameters entirely, weight decay included, so inactive heads are not decayed toward zero.

    Give either ``schedule`` (a step schedule) or ``until`` (a linear ramp).

    Args:
        schedule: ``{step: active depth}``, steps strictly increasing from 0, depths non-decreasing and ≥ 1,
            e.g. ``{0: 1, 1000: 2, 3000: 3}``.
        start_depth: linear ramp: active depth before ``begin``.
        end_depth: linear ramp: active depth from ``until`` on (default: ``MTPConfig.depth``).
        begin: linear ramp: first optimizer step of the ramp.
        until: linear ramp: optimizer step where ``end_depth`` is reached; the depths in between are spread evenly.

    Logs ``train/mtp/active_depth``.

    Raises:
        ValueError: in ``__init__`` for a bad schedule (quoting it); in ``setup`` for a depth beyond
            ``MTPConfig.depth``.
        TypeError: in ``setup`` when the module does not use ``MTPMixin``.

    Example::

        from lightning_mtp.callbacks import MTPDepthWarmup

        trainer = L.Trainer(callbacks=[MTPDepthWarmup(schedule={0: 1, 1000: 2, 3000: 3})])
        # or a linear ramp from depth 1 to MTPConfig.depth over the first 2000 steps:
        trainer = L.Trainer(callbacks=[MTPDepthWarmup(start_depth=1, until=2000)])
    """

    sets_active_depth = True
    """The module's active depth is this callback's (a fit resumed without one trains every depth)."""

    def __init__(
        self,
        schedule: Optional[dict[int, int]] = None,
        start_depth: int = 1,
        end_depth: Optional[int] = None,
        begin: int = 0,
        until: Optional[int] = None,
    ) -> None:
        if (schedule is None) == (until is None):
            raise ValueError(
                "MTPDepthWarmup needs exactly one of schedule={step: depth} (a step schedule) or until=STEP "
                f"(a linear ramp), got schedule={schedule!r}, until={until!r}"
            )
        self.schedule: Optional[dict[int, int]] = None
        if schedule is not None:
            self.schedule = check_milestones("MTPDepthWarmup.schedule", schedule, _check_depth)
            depths = list(self.schedule.values())
            if any(b < a for a, b in zip(depths, depths[1:])):
                raise ValueError(f"MTPDepthWarmup.schedule depths must not decrease, got {schedule!r}")
        else:
            check_int("MTPDepthWarmup.start_depth", start_depth, 1)
            if end_depth is not None and (check_int("MTPDepthWarmup.end_depth", end_depth, 1) < start_depth):
                raise ValueError(f"MTPDepthWarmup.end_depth must be >= start_depth = {start_depth}, got {end_depth!r}")
            check_int("MTPDepthWarmup.begin", begin, 0)
            if isinstance(until, bool) or not isinstance(until, int) or until <= begin:
                raise ValueError(f"MTPDepthWarmup.until must be an integer > begin = {begin}, got {until!r}")
        self.start_depth, self.end_depth, self.begin, self.until = start_depth, end_depth, begin, until
        self._full_depth: Optional[int] = None
        self.active_depth: Optional[int] = None
        self.last_step: int = -1

    @property
    @override
    def state_key(self) -> str:
        if self.schedule is not None:
            return self._generate_state_key(schedule=self.schedule)
        return self._generate_state_key(start_depth=self.start_depth, end_depth=self.end_depth, begin=self.begin,
                                        until=self.until)

    def depth_at(self, step: int) -> int:
        """Active depth at optimizer step ``step``."""
        if self.schedule is not None:
            return step_value(self.schedule, step)
        end = self.end_depth if self.end_depth is not None else self._full_depth
        if end is None:
            raise RuntimeError("MTPDepthWarmup.depth_at needs end_depth, or setup() to have read MTPConfig.depth")
        if step <= self.begin:
            return self.start_depth
        if step >= self.until:
            return end
        # integer arithmetic: the depth rises by one at evenly spaced steps and reaches `end` exactly at `until`
        return self.start_depth + (end - self.start_depth) * (step - self.begin) // (self.until - self.begin)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mtp_module(pl_module, "MTPDepthWarmup")
        self._full_depth = module.mtp_config.depth
        if self.schedule is not None:
            for step, depth in self.schedule.items():
                check_depth_in_config(module, "MTPDepthWarmup", f"schedule[{step}]", depth)
        else:
            check_depth_in_config(module, "MTPDepthWarmup", "start_depth", self.start_depth)
            if self.end_depth is not None:
                check_depth_in_config(module, "MTPDepthWarmup", "end_depth", self.end_depth)
        if stage == "fit" and self.depth_at(0) < self._full_depth:
            _warn_about_strategy(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After a resume is restored: a fit resumed past the warmup trains every depth, which plain DDP takes.
        if self.depth_at(trainer.global_step) < self._full_depth:
            _refuse_ddp_without_unused_parameters(trainer)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self.active_depth = self.depth_at(step)
        self.last_step = step
        pl_module.mtp_active_depth = self.active_depth
        pl_module.log("train/mtp/active_depth", float(self.active_depth), on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "active_depth": self.active_depth}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = state_dict.get("last_step", -1)
        self.active_depth = state_dict.get("active_depth")


def _check_depth(name: str, depth: Any) -> int:
    return check_int(name, depth, 1)


def _warn_about_strategy(trainer: L.Trainer) -> None:
    strategy = type(trainer.strategy).__name__
    if "DeepSpeed" in strategy:
        rank_zero_warn(
            "MTPDepthWarmup under DeepSpeed: ZeRO's optimizer may step parameters whose gradient is zero rather "
            "than absent, which applies weight decay to the inactive depths. Exclude the MTP modules from weight "
            "decay, or start with all depths, if that matters."
        )


def _refuse_ddp_without_unused_parameters(trainer: L.Trainer) -> None:
    """DDP fails at the first backward (a long traceback per rank) on the inactive depths' unused parameters."""
    strategy = type(trainer.strategy).__name__
    if "DDP" in strategy and not getattr(trainer.strategy, "_ddp_kwargs", {}).get("find_unused_parameters"):
        raise ValueError(
            "MTPDepthWarmup leaves the inactive depths without gradients, which DDP refuses at the first backward: "
            "use --trainer.strategy ddp_find_unused_parameters_true (DDPStrategy(find_unused_parameters=True)), or "
            "start with every depth"
        )
