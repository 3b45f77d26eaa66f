"""DeepSpeed on CPU for development and CI (the checks that reject MTP settings a ZeRO stage cannot run live in
:mod:`lightning_mtp.zero_settings`; the mixin runs them at setup under every DeepSpeed strategy).

Lightning's ``DeepSpeedStrategy`` refuses anything but CUDA; DeepSpeed itself runs ZeRO-1/2/3 on CPU with gloo
(its CPU accelerator). :class:`CPUDeepSpeedStrategy` lifts Lightning's CUDA-only checks and nothing else, so the same
ZeRO code paths (partitioned parameters, gathered forwards, sharded checkpoints) are exercised without a GPU. It is
slow and meant for tests and debugging; on GPUs use the stock ``deepspeed_stage_2`` / ``deepspeed_stage_3``.

Example::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=3))
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from typing_extensions import override

from lightning_mtp.zero_settings import validate_mtp_under_zero, zero_stage

__all__ = ["CPUDeepSpeedStrategy", "validate_mtp_under_zero", "zero_stage"]


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` on CPU processes with the gloo backend (development and CI only).

    Accepts every ``DeepSpeedStrategy`` argument (``stage``, ``offload_optimizer``, ``config``, ...). Runs with
    ``Trainer(accelerator="cpu", devices=N)``; DeepSpeed picks its CPU accelerator by itself when no GPU is visible
    (or set ``DS_ACCELERATOR=cpu``). The MTP settings a ZeRO stage cannot run are refused by the mixin's ``setup``
    (:func:`~lightning_mtp.zero_settings.validate_mtp_under_zero`), under this strategy and the stock ones alike.
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

