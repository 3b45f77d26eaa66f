"""DeepSpeed on CPU for development and CI, and the checks that reject MTP settings a ZeRO stage cannot run.

Lightning's ``DeepSpeedStrategy`` refuses anything but CUDA; DeepSpeed itself runs ZeRO-1/2/3 on CPU with gloo
(its CPU accelerator). :class:`CPUDeepSpeedStrategy` lifts Lightning's CUDA-only checks and nothing else, so the same
ZeRO code paths (partitioned parameters, gathered forwards, sharded checkpoints) are exercised without a GPU. It is
slow and meant for tests and debugging; on GPUs use the stock ``deepspeed_stage_2`` / ``deepspeed_stage_3``.

Example::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=3))
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler
from lightning.pytorch.strategies import DeepSpeedStrategy
from typing_extensions import override


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` on CPU processes with the gloo backend (development and CI only).

    Accepts every ``DeepSpeedStrategy`` argument (``stage``, ``offload_optimizer``, ``config``, ...). Runs with
    ``Trainer(accelerator="cpu", devices=N)``; DeepSpeed picks its CPU accelerator by itself when no GPU is visible
    (or set ``DS_ACCELERATOR=cpu``). At setup it calls :func:`validate_mtp_under_zero`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(*args, **kwargs)

    @property
    @override
    def root_device(self) -> torch.device:
        # DeepSpeed's initialize reads ``root_device.index`` (its device_rank): give the CPU device an index.
        return torch.device("cpu", 0)

    @override
    def setup_environment(self) -> None:
        # Skip DeepSpeedStrategy's "CUDA only" check; keep the rest of the environment setup.
        super(DeepSpeedStrategy, self).setup_environment()

    @override
    def setup_distributed(self) -> None:
        # DeepSpeedStrategy validates CUDA device indices here; CPU processes have none.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def setup(self, trainer: Any) -> None:
        validate_mtp_under_zero(trainer, zero_stage(self))
        super().setup(trainer)


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
    - ZeRO-3 with ``MTPConfig.detach_trunk`` and a shared output head: the MTP loss then reads the head's weight
      (``.detach()``) outside the module call, and under ZeRO-3 that weight is an empty partition;
    - ZeRO-3 with ``generation.draft_confidence_threshold`` on several processes: draft lengths then depend on each
      rank's data, so ranks would run different numbers of MTP forwards (each one all-gathers) and deadlock.

    A second optimizer is rejected by Lightning itself ("only one optimizer is supported with DeepSpeed").
    - ZeRO-3 with ``MTPConfig.recompute``: the sublayer-wise recomputation slices the attention's ``qkv``/``proj``
      weights per key/value head group (``layers.Attention.head_group``) instead of calling those modules, and under
      ZeRO-3 they are empty partitions there (``size mismatch ... vec (0)``).

    ZeRO-1/2 keep whole parameters on every rank, so none of the MTP settings above is restricted there.
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
        if config.detach_trunk and config.share_output_head:
            raise ValueError(
                f"MTPConfig.detach_trunk=True (--model.mtp.detach_trunk) with a shared output head cannot be used with "
                f"{name}: the MTP loss would read the partitioned head weight directly; use detach_trunk=False, "
                "share_output_head=False, or ZeRO stage 1/2"
            )
        if config.recompute:
            raise ValueError(
                f"MTPConfig.recompute=True (--model.mtp.recompute) cannot be used with {name}: the MTP blocks' "
                "sublayer-wise recomputation reads the attention weights directly, which ZeRO-3 partitions; use "
                "recompute=False (ZeRO-3 already shards the memory) or ZeRO stage 1/2"
            )
        if getattr(module, "mtp_generate_kwargs", {}).get("draft_confidence_threshold") is not None and (
            trainer.world_size > 1
        ):
            raise ValueError(
                f"generation.draft_confidence_threshold (--model.generation.draft_confidence_threshold) cannot be used "
                f"with {name} on {trainer.world_size} processes: draft lengths would differ per rank and the ranks' "
                "parameter all-gathers would deadlock; leave it unset"
            )
