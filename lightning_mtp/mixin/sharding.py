"""Sharding the host and its MTP modules with FSDP2 (``MTPSharding.mtp_fully_shard``), and the checks that keep a
sharded fit from running unsharded by mistake."""

from __future__ import annotations

from typing import Any, Optional

from lightning_mtp.fsdp import FSDP2_CONFIG, fully_shard_mtp, whole_root
from lightning_mtp.sharded import is_fsdp2_module


class MTPSharding:
    """``mtp_fully_shard``: FSDP2 units for the trunk's blocks, every MTP module and the root."""

    def mtp_fully_shard(self, mesh: Any = None, mp_policy: Any = None, offload_policy: Any = None,
                        reshard_after_forward: Optional[bool] = None):
        """Apply FSDP2 to this module (:func:`lightning_mtp.fsdp.fully_shard_mtp`; idempotent): one unit per trunk
        block (:meth:`mtp_trunk_blocks`), one per MTP module, and the root, whose group keeps the shared embedding and
        output head one parameter with one gradient. Call it at the end of ``configure_model`` under Lightning's
        ``ModelParallelStrategy``; ``lightning_mtp.strategies.FSDP2Strategy`` calls it for you.

        Settings left ``None`` come from the trainer's strategy where it is an ``FSDP2Strategy`` (its mixed
        precision, offload and resharding), and ``mesh`` from ``ModelParallelStrategy``'s device mesh (its
        ``data_parallel`` dimension); without a trainer: every rank, no mixed precision.
        """
        strategy = self._trainer.strategy if getattr(self, "_trainer", None) is not None else None
        settings = dict(getattr(strategy, "mtp_fsdp_settings", None) or {})
        for name, value in (("mp_policy", mp_policy), ("offload_policy", offload_policy),
                            ("reshard_after_forward", reshard_after_forward)):
            if value is not None:
                settings[name] = value
        if mesh is None:
            mesh = getattr(self, "_device_mesh", None)
        return fully_shard_mtp(self, mesh, **settings)

    def mtp_whole_root(self) -> None:
        """Under FSDP2, make the root's group whole (the shared embedding and head, the final norm): every entry point
        of the mixin calls it first (:func:`lightning_mtp.fsdp.whole_root`); nothing to do otherwise."""
        whole_root(self)

    def mtp_shard_under_model_parallel(self) -> None:
        """:meth:`mtp_fully_shard` when Lightning's ``ModelParallelStrategy`` gave the module a device mesh (the end
        of the bundled hosts' ``configure_model``); nothing otherwise."""
        if getattr(self, "_device_mesh", None) is not None:
            self.mtp_fully_shard()

    def mtp_check_sharded(self) -> None:
        """Refuse to run unsharded under ``ModelParallelStrategy`` on several processes: nothing would average the
        ranks' gradients, and each would silently train a replica of its own."""
        trainer = getattr(self, "_trainer", None)
        if trainer is None or trainer.world_size < 2 or is_fsdp2_module(self):
            return
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(trainer.strategy, ModelParallelStrategy):
            raise RuntimeError(
                f"{type(self).__name__} is not sharded under ModelParallelStrategy on {trainer.world_size} processes: "
                "call self.mtp_fully_shard() at the end of configure_model, or use "
                f"lightning_mtp.strategies.FSDP2Strategy ({FSDP2_CONFIG}), which shards the module itself"
            )
