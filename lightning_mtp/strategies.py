"""Strategies for sharded MTP training: FSDP2 over every process (:class:`FSDP2Strategy`), and DeepSpeed on CPU for
development and CI (:class:`CPUDeepSpeedStrategy`).

:class:`FSDP2Strategy` is Lightning's ``ModelParallelStrategy`` set up as plain fully sharded data parallelism:
every process in one data-parallel dimension, one consolidated checkpoint file by default, the module sharded with
``MTPMixin.mtp_fully_shard`` unless its ``configure_model`` did so, and optional FSDP2 mixed precision (bf16
parameters with fp32 reductions). It runs on GPUs (nccl) and on CPU processes (gloo) alike.

Lightning's ``DeepSpeedStrategy`` refuses anything but CUDA; DeepSpeed itself runs ZeRO-1/2/3 on CPU with gloo
(its CPU accelerator). :class:`CPUDeepSpeedStrategy` lifts Lightning's CUDA-only checks and nothing else, so the same
ZeRO code paths (partitioned parameters, gathered forwards, sharded checkpoints) are exercised without a GPU. It is
slow and meant for tests and debugging; on GPUs use the stock ``deepspeed_stage_2`` / ``deepspeed_stage_3``. The
MTP settings a ZeRO stage cannot run live in :mod:`lightning_mtp.zero_settings`; the mixin checks them at setup.

Example::

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy())
    trainer = L.Trainer(accelerator="gpu", devices=8, strategy=FSDP2Strategy(param_dtype="bfloat16"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=3))
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from typing_extensions import override

from lightning_mtp.fsdp import mixed_precision
from lightning_mtp.sharded import is_fsdp2_module, load_state_dict_whole
from lightning_mtp.zero_settings import validate_mtp_under_zero, zero_stage

__all__ = ["CPUDeepSpeedStrategy", "FSDP2Strategy", "validate_mtp_under_zero", "zero_stage"]


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallelism (FSDP2) over every process, for :class:`~lightning_mtp.MTPMixin` modules.

    Args:
        data_parallel_size: processes in the data-parallel dimension; ``"auto"``: all of them (nodes × devices).
            Tensor parallelism is not used (``tensor_parallel_size`` is 1).
        save_distributed_checkpoint: ``False`` (default): one consolidated checkpoint file, gathered on rank 0, that
            every entry point reads (``predict``, ``init_from``, ``export``, resuming); ``True``: a folder of shards
            (``torch.distributed.checkpoint``), which only this strategy reads back.
        param_dtype, reduce_dtype: FSDP2 mixed precision (``MixedPrecisionPolicy``): the dtype of the gathered
            parameters that forward and backward compute with, and of the gradient reduce-scatter, e.g.
            ``param_dtype="bfloat16", reduce_dtype="float32"``; the sharded parameters and the optimizer stay in the
            dtype they were built in (fp32 with ``--trainer.precision 32-true``). ``None``: the parameters' dtype.
        reshard_after_forward: free the gathered weights of the trunk's blocks and the MTP modules after their
            forward (gathered again for backward); ``False`` keeps them until backward (more memory, fewer
            all-gathers). The root's group (embedding, head) is kept from forward to backward either way.
        cpu_offload: keep the shards and their optimizer state in CPU memory (``CPUOffloadPolicy``).
        process_group_backend: default nccl on GPUs, gloo on CPU.
    """

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = False,
        param_dtype: Optional[str] = None,
        reduce_dtype: Optional[str] = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._mtp_mixed_precision = mixed_precision(param_dtype, reduce_dtype)  # validates the names now
        self._mtp_reshard_after_forward = reshard_after_forward
        self._mtp_cpu_offload = cpu_offload

    @property
    def mtp_fsdp_settings(self) -> dict:
        """What ``MTPMixin.mtp_fully_shard`` applies under this strategy (``fully_shard``'s keyword arguments)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return dict(mp_policy=self._mtp_mixed_precision, reshard_after_forward=self._mtp_reshard_after_forward,
                    offload_policy=CPUOffloadPolicy() if self._mtp_cpu_offload else OffloadPolicy())

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's load, which writes the weights into the shards strictly before any module hook runs; a
        checkpoint that leaves out weights on purpose (``HFCausalLM``'s frozen trunk: ``mtp_keys_not_saved``) is
        loaded without those keys, and refused if any other weight is missing."""
        module = self.lightning_module
        absent = getattr(module, "mtp_keys_not_saved", None)
        path = Path(str(checkpoint_path))
        if not path.is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)  # (read once, mapped)
        if module.trainer.state.fn == "fit":
            refuse_unstepped_parameters(checkpoint, path)
        if absent is None or not module.strict_loading:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        allowed = absent(checkpoint)
        if not allowed:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        missing = {name for name, _ in module.named_parameters()} - set(checkpoint.get("state_dict", {})) - allowed
        if missing:
            raise ValueError(f"--ckpt_path {str(path)!r} lacks weights of the model: {sorted(missing)[:4]}")
        module.strict_loading = False  # the keys left out come from elsewhere (the pretrained folder)
        try:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        finally:
            module.strict_loading = True

    @override
    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if not is_fsdp2_module(module):
            if not callable(getattr(module, "mtp_fully_shard", None)):
                raise TypeError(f"FSDP2Strategy shards MTPMixin modules; {type(module).__name__} is none: apply "
                                "fully_shard in its configure_model and use Lightning's ModelParallelStrategy")
            module.mtp_fully_shard()
        super().setup(trainer)


def refuse_unstepped_parameters(checkpoint: dict, path: Path) -> None:
    """Refuse to resume under FSDP2 a checkpoint whose optimizer state FSDP2 cannot take: one saved without FSDP2
    (DDP's or one process's state did not map onto the shards: "The size of tensor a (48) must match the size of
    tensor b (96)"), or one that holds no state for some of its parameters (never stepped: depths ``MTPDepthWarmup``
    had not activated yet; torch's sharded optimizer load requires every one, and a load that skips them was
    measured not to resume exactly; DDP resumes such a checkpoint exactly)."""
    if (checkpoint.get("mtp") or {}).get("fsdp2") is False and checkpoint.get("optimizer_states"):
        raise ValueError(
            f"--ckpt_path {str(path)!r} was saved without FSDP2 (DDP or one process), and its optimizer state does "
            "not map onto FSDP2's shards: resume it with the strategy it was saved with (--trainer.strategy), or "
            "start a new fit from its weights (--model.init_args.init_from)")
    for optimizer in checkpoint.get("optimizer_states") or []:
        listed = [index for group in optimizer.get("param_groups") or [] for index in group.get("params", [])]
        unstepped = len(set(listed) - set(optimizer.get("state") or {}))
        if unstepped:
            raise ValueError(
                f"--ckpt_path {str(path)!r}: its optimizer has no state yet for {unstepped} parameters (never "
                "stepped: MTP depths a warmup had not activated yet), which FSDP2 cannot resume. Resume this "
                "checkpoint with --trainer.strategy ddp_find_unused_parameters_true (exact; the same processes), "
                "and go back to FSDP2 from a checkpoint saved once every depth trains")


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

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's load (DeepSpeed's engine reads its own folder), refused up front where it cannot work, and
        whole weights where the engine cannot read them:

        - a fit resumes only from a DeepSpeed folder written with a compatible ZeRO stage on as many processes (the
          optimizer shards are split per rank): anything else is refused with one line before a shard is opened
          (:func:`~lightning_mtp.checkpoint_files.refuse_deepspeed_layout`); a single file is refused too (it holds no
          optimizer state: start a new fit from it with ``init_from``), unless ``load_full_weights`` asks for it;
        - ``predict``/``validate``/``test`` from a ZeRO-3 folder (or under ZeRO-3): DeepSpeed 0.19's engine cannot
          load one without an optimizer, so the shards are read into one fp32 state dict with DeepSpeed's own
          ``zero_to_fp32`` (every rank, as Lightning's ``load_full_weights`` reads its file) and loaded into the
          (partitioned) module one gathered module at a time (:meth:`load_model_state_dict`); any number of
          processes;
        - ``predict``/``validate``/``test`` from a single checkpoint file (a converted folder, a DDP fit's): whole
          weights, loaded the same way at any stage.
        """
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_mtp.checkpoint_files import is_deepspeed_folder, read_checkpoint, refuse_deepspeed_layout

        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        path = Path(str(checkpoint_path))
        stage = zero_stage(self)
        self._mtp_whole_weights = False
        if is_deepspeed_folder(path):
            saved_stage = refuse_deepspeed_layout(path, stage, self.world_size, fitting)  # the layout read once
            if fitting or 3 not in (stage, saved_stage):
                return super().load_checkpoint(checkpoint_path, weights_only)
            checkpoint = read_checkpoint(path, "--ckpt_path")
            checkpoint["state_dict"] = zero_checkpoint_state_dict(path)
        elif path.is_file() and not fitting:
            checkpoint = read_checkpoint(path, "--ckpt_path")
            if "state_dict" not in checkpoint:
                raise ValueError(f"--ckpt_path {str(path)!r} holds no state_dict: not a checkpoint of a fit")
        elif path.is_file() and not (self.load_full_weights and self.zero_stage_3):
            raise ValueError(f"--ckpt_path {str(path)!r} is a single checkpoint file, but a DeepSpeed fit resumes from "
                             "the checkpoint folder it wrote (its optimizer shards): give that folder, or start a new "
                             f"fit from this file's weights with --model.init_args.init_from {str(path)!r}")
        else:
            return super().load_checkpoint(checkpoint_path, weights_only)
        self._mtp_whole_weights = True
        return {key: value for key, value in checkpoint.items() if key not in DEEPSPEED_STATES}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Whole weights that :meth:`load_checkpoint` read itself go into the module, ZeRO-3 partitions gathered one
        module at a time (:func:`~lightning_mtp.sharded.load_state_dict_whole`); otherwise the engine loaded them."""
        if not getattr(self, "_mtp_whole_weights", False):
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._mtp_whole_weights = False
        load_state_dict_whole(self.lightning_module, checkpoint["state_dict"], strict=strict)


DEEPSPEED_STATES = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
                    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "param_shapes", "frozen_param_shapes",
                    "frozen_param_fragments", "shared_params", "buffer_names")
"""DeepSpeed's own entries in a module-states file, left out of the Lightning checkpoint made from one."""


def zero_checkpoint_state_dict(folder: Any) -> dict[str, torch.Tensor]:
    """The fp32 weights of a DeepSpeed checkpoint folder (any ZeRO stage), read whole with DeepSpeed's
    ``zero_to_fp32`` (the shards of every rank), keyed as the LightningModule's ``state_dict``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    prefix = "_forward_module."  # written by Lightning < 2.1
    return {key[len(prefix):] if key.startswith(prefix) else key: value for key, value in state.items()}

