"""The FSDP setups an MTP fit refuses at setup, naming the setting and what to use instead.

``MTPMixin.setup`` calls :func:`validate_mtp_under_fsdp` under every strategy (nothing is checked without FSDP).
"""

from __future__ import annotations

from typing import Any

from lightning_mtp.fsdp import FSDP2_CONFIG, data_parallel_mesh


def validate_mtp_under_fsdp(trainer: Any) -> None:
    """Raise at setup for FSDP setups that cannot train or decode MTP correctly.

    Refused:

    - Lightning's ``FSDPStrategy`` (FSDP1, ``--trainer.strategy fsdp``): outside a wrapped module's forward its
      parameters are views of one flat shard, so the MTP loss cannot read the shared head's weight and the recomputed
      depths cannot read theirs. FSDP2 (``ModelParallelStrategy``, ``lightning_mtp.strategies.FSDP2Strategy``) is
      supported instead.
    - ``ModelParallelStrategy`` with a tensor-parallel dimension larger than 1: parameters are sharded over
      data-parallel ranks only (:func:`lightning_mtp.fsdp.data_parallel_mesh`).
    - ``generation.draft_confidence_threshold`` under FSDP2 on several processes: draft lengths would depend on each
      rank's data, so the ranks would run different numbers of MTP forwards, each of which all-gathers, and hang.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "Lightning's FSDPStrategy (FSDP1, --trainer.strategy fsdp) is not supported with MTP: outside a wrapped "
            "module's forward its parameters are views of one flat shard, which the MTP loss (the shared head's "
            "weight) and recompute (the depths' weights) must read. Use FSDP2: --config "
            f"{FSDP2_CONFIG} (lightning_mtp.strategies.FSDP2Strategy, Lightning's ModelParallelStrategy with every "
            "process data-parallel)"
        )
    if not isinstance(strategy, ModelParallelStrategy):
        return
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None:
        data_parallel_mesh(mesh)  # refuses a tensor-parallel dimension
    module = getattr(trainer, "lightning_module", None)
    threshold = (getattr(module, "mtp_generate_kwargs", None) or {}).get("draft_confidence_threshold")
    if threshold is not None and trainer.world_size > 1:
        raise ValueError(
            "generation.draft_confidence_threshold (--model.generation.draft_confidence_threshold) cannot be used "
            f"with FSDP2 on {trainer.world_size} processes: draft lengths would differ per rank and the ranks' "
            "parameter all-gathers would hang; leave it unset"
        )
