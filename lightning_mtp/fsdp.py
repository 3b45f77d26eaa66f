"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for an MTP module: which submodules become units, and how the
root's group (the shared embedding and head) is whole wherever the mixin reads it. The setups FSDP refuses are in
:mod:`lightning_mtp.fsdp_settings`.

:func:`fully_shard_mtp` makes a unit of every trunk block (``MTPMixin.mtp_trunk_blocks()``), of every MTP module and
of the root. Everything else belongs to the root's group: the shared embedding and output head (one parameter with
one gradient when tied), the final norm, per-depth heads and a cascaded model's own embedding. FSDP2 keeps the root's
group whole from the root's first forward of a step until backward has used it, so the trunk, every depth and the
fused cross-entropy read the same whole head weight, and its gradient is reduce-scattered once per step.

The mixin reads the root's weights outside the root's ``forward`` (the loss reads the head's weight, the drafter
calls the head, a host's trunk may be called without ``self(...)``), so its entry points (``compute_lm_loss``,
``compute_mtp_loss``, ``mtp_run_trunk``, ``generate``, ``predict_step``, ...) first make the root's group whole
(:func:`whole_root`, an all-gather at most once per step; a no-op while it is whole). FSDP2 reshards it after
backward has used it. Each MTP module computes h_k and norm(h_k) in one call, recomputation included
(``module(..., recompute=chunks)``), so its weights are whole wherever they are read. MTP modules do not prefetch the
next unit in backward: a recomputed depth's backward is the step's peak, which then holds one block's weights.

Example (a module of your own; ``CausalLM`` and ``HFCausalLM`` do this by themselves)::

    class MyLM(MTPMixin, L.LightningModule):
        ...
        def mtp_trunk_blocks(self):          # the units of the trunk (default: the longest ModuleList found)
            return list(self.blocks)

        def configure_model(self):
            super().configure_model()        # builds the MTP modules
            if self.device_mesh is not None:  # under ModelParallelStrategy
                self.mtp_fully_shard()       # idempotent

    trainer = L.Trainer(strategy=lightning_mtp.strategies.FSDP2Strategy(), devices=8)  # or ModelParallelStrategy
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_mtp.sharded import is_fsdp2_module

FSDP2_CONFIG = "configs/fsdp.yaml"


def data_parallel_mesh(mesh: Any) -> Any:
    """The 1-D mesh to shard over: ``mesh`` itself, or its ``data_parallel`` dimension (``ModelParallelStrategy``'s
    2-D mesh), whose ``tensor_parallel`` dimension must have size 1.

    Raises:
        ValueError: a tensor-parallel dimension larger than 1 (lightning-mtp shards parameters over data-parallel
            ranks only; docs/distributed.md says what a tensor-parallel vocabulary head would need).
    """
    if mesh is None or mesh.ndim == 1:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    if "data_parallel" not in names:
        raise ValueError(f"FSDP2 with MTP shards over a 1-D mesh or the data_parallel dimension of a named mesh; "
                         f"got a {mesh.ndim}-D mesh with dimensions {names}")
    others = {name: mesh[name].size() for name in names if name != "data_parallel"}
    if any(size > 1 for size in others.values()):
        raise ValueError(
            f"lightning-mtp shards parameters over data-parallel ranks only (FSDP2), but the device mesh has "
            f"{others} (ModelParallelStrategy's tensor_parallel_size defaults to the processes of a node): use "
            f"lightning_mtp.strategies.FSDP2Strategy ({FSDP2_CONFIG}), or ModelParallelStrategy("
            f"data_parallel_size=<processes>, tensor_parallel_size=1). Tensor parallelism is not implemented "
            "(docs/distributed.md)"
        )
    return mesh["data_parallel"]


def fully_shard_mtp(
    module: nn.Module,
    mesh: Any = None,
    *,
    mp_policy: Any = None,
    offload_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply FSDP2 to an :class:`~lightning_mtp.MTPMixin` module in place (idempotent) and return it.

    Units: each of ``module.mtp_trunk_blocks()``, each MTP module, then the root (whose group keeps the shared
    embedding and head, one parameter when tied). The root's group stays whole from its first forward of a step
    until backward (FSDP2's default for a root); ``reshard_after_forward`` applies to the blocks and MTP modules.

    Args:
        mesh: the device mesh, 1-D or ``ModelParallelStrategy``'s (``data_parallel`` dimension); ``None``: all ranks.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. bf16 parameters, fp32 reductions).
        offload_policy: a ``torch.distributed.fsdp.OffloadPolicy`` (``CPUOffloadPolicy()`` keeps shards on CPU).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if is_fsdp2_module(module):
        return module
    module.require_mtp_modules()
    settings = dict(mesh=data_parallel_mesh(mesh), mp_policy=mp_policy or MixedPrecisionPolicy(),
                    offload_policy=offload_policy or OffloadPolicy())
    depths = list(module.mtp_modules)
    for block in module.mtp_trunk_blocks():
        if any(block is depth for depth in depths):
            raise ValueError(f"{type(module).__name__}.mtp_trunk_blocks() returned an MTP module: return the trunk's "
                             "own blocks")
        fully_shard(block, reshard_after_forward=reshard_after_forward, **settings)
    for depth in depths:
        fully_shard(depth, reshard_after_forward=reshard_after_forward, **settings)
    fully_shard(module, **settings)  # the root: FSDP2 keeps its group whole from forward until backward
    for depth in depths:
        # No backward prefetch from an MTP module: by default FSDP2 gathers the next unit while a depth's backward
        # runs, and that backward is the fit's peak (a recomputed depth's working set on top of every trunk
        # activation, tests and benchmarks/train_overhead.py --fsdp2): one block's weights more at the peak, against
        # D all-gathers not overlapped. Naming the root, already whole in backward, turns the prefetch off.
        depth.set_modules_to_backward_prefetch([module])
    return module


def whole_root(module: nn.Module) -> None:
    """Make the root's group of an FSDP2-sharded MTP module whole (nothing to do for any other module, or while it is
    whole): the shared embedding and head, the final norm and everything else outside the units. A collective the
    first time in a step: every rank runs the same entry points.

    FSDP2 takes the first module whose forward runs as its root; the mixin's entry points call this before anything
    else runs, so the root is the MTP module itself even for a host whose trunk is not called through ``self(...)``.
    Its group stays whole until backward has used it (FSDP2 reshards it then, as it does a root after its forward).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return
    fully_shard.state(module)._lazy_init()  # no-op once done: the root is this module, not its first unit called
    module.unshard()  # no-op while whole


def default_trunk_blocks(module: nn.Module) -> list[nn.Module]:
    """The trunk's repeated blocks of a host that does not name them: the elements of its longest ``nn.ModuleList``
    whose elements all hold parameters, outside what the mixin adds (``mtp_*``: the MTP modules, heads, metrics);
    ``[]`` when there is none (the trunk then belongs to the root's group)."""
    best: list[nn.Module] = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or name.split(".")[0].startswith("mtp_"):
            continue
        if len(sub) > len(best) and all(next(block.parameters(), None) is not None for block in sub):
            best = list(sub)
    return best


def transformers_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a ``transformers`` model: the modules of the classes it lists in ``_no_split_modules``
    (what ``accelerate`` and the HF Trainer wrap as FSDP units), outermost ones only."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for sub in model.modules():
        if id(sub) in inside or sub is model:
            continue
        if type(sub).__name__ in names:
            layers.append(sub)
            inside.update(id(s) for s in sub.modules())
    return layers


def mixed_precision(param_dtype: Optional[str], reduce_dtype: Optional[str]) -> Any:
    """A ``MixedPrecisionPolicy`` from dtype names (``"bfloat16"``, ``"float32"``, ...; ``None``: the parameters')."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_dtype(param_dtype, "param_dtype"),
                                reduce_dtype=_dtype(reduce_dtype, "reduce_dtype"))


def _dtype(name: Optional[str], flag: str) -> Optional[torch.dtype]:
    if name is None:
        return None
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"FSDP2Strategy.{flag} (--trainer.strategy.init_args.{flag}) must name a floating dtype "
                         f"(bfloat16, float16, float32), got {name!r}")
    return dtype
