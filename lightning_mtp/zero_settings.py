"""The MTP settings a DeepSpeed ZeRO stage cannot run, refused at setup naming the setting and the stage.

``MTPMixin.setup`` calls :func:`validate_mtp_under_zero` under every DeepSpeed strategy (the stock
``deepspeed_stage_3`` on GPUs as well as ``CPUDeepSpeedStrategy``), before any step runs.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler
from lightning.pytorch.strategies import DeepSpeedStrategy


def zero_stage(strategy: Any) -> Optional[int]:
    """The ZeRO stage of a Lightning DeepSpeed strategy, ``None`` for any other strategy."""
    if not isinstance(strategy, DeepSpeedStrategy):
        return None
    if strategy.config is None:
        strategy._init_config_if_needed()
    return int((strategy.config or {}).get("zero_optimization", {}).get("stage", 0))


def validate_mtp_under_zero(trainer: Any, stage: Optional[int] = None) -> None:
    """Raise at setup for settings that cannot work under DeepSpeed ZeRO ``stage``, naming the setting and the stage.

    Checked (``stage`` defaults to the trainer's strategy; nothing is checked without DeepSpeed):

    - ``GradientAccumulationScheduler`` and ``BaseFinetuning`` callbacks (DeepSpeed owns gradient accumulation and the
      optimizer's parameter groups; Lightning rejects both too, later and less clearly);
    - ZeRO-3 with ``generation.draft_confidence_threshold`` on several processes: draft lengths then depend on each
      rank's data, so ranks would run different numbers of MTP forwards (each one all-gathers) and deadlock.

    A second optimizer is rejected by Lightning itself ("only one optimizer is supported with DeepSpeed").
    ``MTPConfig.recompute`` and ``detach_trunk`` work at every stage: under ZeRO-3 each MTP module is a leaf module
    whose call gathers all its weights, recomputation included, and a detached shared head is gathered for the fused
    cross-entropy (:func:`lightning_mtp.loss.score_jointly`).
    """
    if stage is None:
        stage = zero_stage(trainer.strategy)
    if stage is None:
        return
    name = f"DeepSpeed ZeRO stage {stage}"
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, GradientAccumulationScheduler):
            raise ValueError(
                f"{type(callback).__name__} cannot be used with {name}: DeepSpeed fixes gradient accumulation at "
                "setup (use --trainer.accumulate_grad_batches instead)"
            )
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"{type(callback).__name__} (a BaseFinetuning callback) cannot be used with {name}: DeepSpeed owns "
                "the optimizer's parameter groups, so layers cannot be unfrozen into it during training"
            )
    module = getattr(trainer, "lightning_module", None)
    if module is None:
        return
    config = getattr(module, "mtp_config", None)
    if stage == 3 and config is not None:
        if getattr(module, "mtp_generate_kwargs", {}).get("draft_confidence_threshold") is not None and (
            trainer.world_size > 1
        ):
            raise ValueError(
                f"generation.draft_confidence_threshold (--model.generation.draft_confidence_threshold) cannot be used "
                f"with {name} on {trainer.world_size} processes: draft lengths would differ per rank and the ranks' "
                "parameter all-gathers would deadlock; leave it unset"
            )
