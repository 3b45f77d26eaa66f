"""MTP metadata in checkpoints, and loading checkpoints whose MTP heads differ from the module's.

A checkpoint carries ``checkpoint["mtp"]`` (plain types only, so ``torch.load(weights_only=True)`` reads it): the
depth, the architecture, the whole ``MTPConfig`` and the runtime schedule state (λ, per-depth weights, active depth,
draft temperatures). Loading a checkpoint trained with another depth, or a plain checkpoint without MTP weights,
fills the missing MTP weights from the module's fresh initialisation and drops the extra ones, and says which: it is
never a silent mismatch. Resuming a *fit* across such a mismatch is refused, because the optimizer state cannot match.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_mtp.sharded import gathered_weights, is_fsdp2_module, load_state_dict_whole, state_shapes

CHECKPOINT_KEY = "mtp"
TOKENIZER_KEY = "tokenizer"
HEADS_ONLY_KEY = "mtp_heads_only"  # a checkpoint without the trunk's weights (HFCausalLM's frozen trunk)
"""``checkpoint["tokenizer"]``: the tokenizer the weights were trained with (``Tokenizer.spec()``) and the data
settings it was built from; ``lightning-mtp`` decodes and evaluates with it and refuses data that asks for another."""
FORMAT_VERSION = 1
MTP_PREFIXES = ("mtp_modules.", "mtp_output_heads.", "mtp_embedding.")


@dataclass
class LoadReport:
    """Which MTP weights a load had to create fresh (``new``) or leave out (``dropped``)."""

    new: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    checkpoint_depth: Optional[int] = None
    checkpoint_architecture: Optional[str] = None

    @property
    def clean(self) -> bool:
        return not self.new and not self.dropped

    def summary(self) -> str:
        def groups(keys: list[str]) -> str:
            names = sorted({re.sub(r"^(mtp_\w+)\.(\d+)\..*$", lambda m: f"{m[1]}.{m[2]} (depth {int(m[2]) + 1})", k)
                            for k in keys})
            return ", ".join(names) if names else "none"

        return (
            f"checkpoint has MTP depth {self.checkpoint_depth} ({self.checkpoint_architecture}); "
            f"new (freshly initialised) weights: {groups(self.new)}; dropped weights: {groups(self.dropped)}"
        )


def mtp_metadata(module: Any) -> dict:
    """Plain-typed description of the module's MTP heads and schedule state."""
    cfg = module.mtp_config
    return {
        "version": FORMAT_VERSION,
        "module_class": f"{module_class(module).__module__}.{module_class(module).__qualname__}",
        "depth": cfg.depth,
        "architecture": cfg.architecture,
        "config": asdict(cfg),
        "loss_weight": float(module.mtp_loss_weight),
        "depth_weights": [float(w) for w in module.mtp_depth_weights],
        "active_depth": int(module.mtp_active_depth),
        "draft_temperatures": [float(t) for t in module.mtp_draft_temperatures],
        "fsdp2": is_fsdp2_module(module),  # how the optimizer state is laid out (FSDP2Strategy.load_checkpoint)
        **trunk_config(module),
    }


def module_class(module: Any) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps it for a generated ``FSDP<Name>`` subclass, which no
    other process can import, so checkpoints name the class it was made from."""
    cls = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return cls
    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule))
    return cls


def trunk_config(module: Any) -> dict:
    """``{"trunk_config": {...}}``, the ``transformers`` config of a module's trunk in plain types, so a checkpoint
    that holds the trunk's weights rebuilds the model without the folder it was loaded from; ``{}`` otherwise."""
    config = getattr(getattr(module, "trunk", None), "config", None)
    to_json = getattr(config, "to_json_string", None)
    return {"trunk_config": json.loads(to_json(use_diff=False))} if callable(to_json) else {}


def _is_mtp_key(key: str) -> bool:
    return key.startswith(MTP_PREFIXES)


def reconcile_state_dict(module: Any, checkpoint: dict, resuming: bool = False,
                         source: str = "the checkpoint") -> LoadReport:
    """Make ``checkpoint["state_dict"]`` load into ``module`` and report what differed in the MTP weights.
    ``source``: the checkpoint as messages name it (``"--model.init_args.init_from PATH"``).

    Raises:
        ValueError: when resuming a fit across a depth/architecture mismatch, when an MTP weight has another
            shape (a different hidden size), or when a weight outside the MTP heads has another shape (another
            vocabulary or model size).
    """
    meta = checkpoint.get(CHECKPOINT_KEY) or {}
    report = LoadReport(checkpoint_depth=meta.get("depth", 0), checkpoint_architecture=meta.get("architecture"))
    state = checkpoint.get("state_dict")
    if state is None:
        return report
    refuse_other_model(module, checkpoint, source)
    own = {k: shape for k, shape in state_shapes(module).items() if _is_mtp_key(k)}  # ZeRO-3: real shapes
    saved = {k for k in state if _is_mtp_key(k)}
    arch = module.mtp_config.architecture
    arch_changed = report.checkpoint_architecture not in (None, arch)
    # heads of another architecture read other inputs: none of their weights is loaded, even where the names agree
    report.new = sorted(set(own) if arch_changed else set(own) - saved)
    report.dropped = sorted(saved if arch_changed else saved - set(own))
    for key in sorted(set() if arch_changed else saved & set(own)):
        if tuple(state[key].shape) != own[key]:
            raise ValueError(
                f"MTP weight {key!r} has shape {tuple(state[key].shape)} in the checkpoint but {own[key]} "
                f"in {type(module).__name__}: the checkpoint was trained with another model width or MTP architecture"
            )
    if report.clean and not arch_changed:
        return report
    if resuming and "optimizer_states" in checkpoint:
        differs = [f"--model.mtp.{name} {value}" for name, value, mine in (
            ("depth", report.checkpoint_depth, module.mtp_config.depth),
            ("architecture", report.checkpoint_architecture, arch)) if value is not None and value != mine]
        raise ValueError(
            f"cannot resume this fit: {report.summary()}, but the module has depth {module.mtp_config.depth} "
            f"({arch}); the optimizer state cannot match. Start a new fit from the checkpoint's weights "
            "(--model.init_from PATH) instead of --ckpt_path, or resume with the checkpoint's "
            f"{' and '.join(differs) or 'MTP settings'}."
        )
    tensors = {**module.state_dict(), **dict(module.named_parameters(remove_duplicate=False))}
    for key in report.dropped:  # first: another architecture's weights may share a name with a new one
        del state[key]
    for key in report.new:  # the module's own (fresh) weights; ZeRO-3 partitions gathered (every rank calls this)
        with gathered_weights([tensors[key]]):
            state[key] = tensors[key].detach().clone()
    if arch_changed:
        rank_zero_warn(f"checkpoint MTP architecture {report.checkpoint_architecture!r} differs from {arch!r}: none of "
                       "its MTP weights is loaded, the heads start fresh")
    rank_zero_warn(f"Loading MTP weights into {type(module).__name__} (depth {module.mtp_config.depth}): "
                   f"{report.summary()}")
    return report


def refuse_other_heads(module: Any, checkpoint: dict, source: str) -> None:
    """Raise ``ValueError`` when a heads file (``source``: ``"--model.init_args.mtp_heads PATH"``) holds MTP heads of
    another architecture or depth than ``module``'s, or lacks some of its MTP weights: the heads it lacks would
    decode untrained. (A new fit from its weights, ``init_from``, starts them fresh and trains them.)"""
    meta = checkpoint.get(CHECKPOINT_KEY) or {}
    cfg = module.mtp_config
    depth, architecture = meta.get("depth"), meta.get("architecture")
    new_fit = ("or start a new fit from them with --model.init_args.init_from FILE instead of "
               "--model.init_args.mtp_heads (the heads they lack start fresh and train)")
    if architecture is not None and architecture != cfg.architecture:
        raise ValueError(f"{source} holds {architecture} MTP heads, but --model.init_args.mtp.architecture is "
                         f"{cfg.architecture!r}: none of their weights would load. Give --model.init_args.mtp."
                         f"architecture {architecture} to use them, or train {cfg.architecture} heads (a new fit)")
    if depth is not None and depth != cfg.depth:
        effect = (f"depths {depth + 1}-{cfg.depth} would decode untrained" if depth + 1 < cfg.depth else
                  f"depth {cfg.depth} would decode untrained" if depth < cfg.depth else
                  f"its depths {cfg.depth + 1}-{depth} would be dropped" if cfg.depth + 1 < depth else
                  f"its depth {depth} would be dropped")
        raise ValueError(f"{source} holds MTP heads of depth {depth}, but --model.init_args.mtp.depth is "
                         f"{cfg.depth}: {effect}. Give --model.init_args.mtp.depth {depth} to use them, {new_fit}")
    own = {k for k in module.state_dict() if _is_mtp_key(k)}
    lacking = sorted(own - set(checkpoint.get("state_dict") or {}))
    if lacking:  # a file without MTP metadata (not written by lightning-mtp), or of another layout
        raise ValueError(f"{source} lacks MTP weights of {type(module).__name__} (depth {cfg.depth}, "
                         f"{cfg.architecture}): {', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}. Give a "
                         "file written by save_mtp_heads (or a fit's checkpoint) for these MTP settings, " + new_fit)


def refuse_other_model(module: Any, checkpoint: dict, source: str = "the checkpoint") -> None:
    """Raise ``ValueError`` when the checkpoint's weights outside the MTP heads are not ``module``'s (another model
    class, or another number of layers, or weights of other shapes: :func:`refuse_other_shapes`): say which class
    wrote it, when it says, and how to load it with that class. A checkpoint of MTP weights alone (a frozen trunk's)
    is not checked here."""
    state = checkpoint.get("state_dict") or {}
    saved = {k for k in state if not _is_mtp_key(k)}
    if not saved:
        return
    own = {k for k in module.state_dict() if not _is_mtp_key(k)}
    foreign, missing = sorted(saved - own), sorted(own - saved)
    if not foreign and not missing:
        refuse_other_shapes(module, state, source)
        return
    name = type(module).__name__
    written_by = (checkpoint.get(CHECKPOINT_KEY) or {}).get("module_class") or (
        checkpoint.get("hyper_parameters") or {}).get("_class_path")
    parts = ([f"weights {name} has not ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"] if foreign
             else []) + ([f"none of {name}'s {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}"]
                         if missing else [])
    origin = f"it was written by a {written_by}" if written_by else "it was written by another model"
    raise ValueError(
        f"the checkpoint's weights are not {name}'s: it holds {' and '.join(parts)}; {origin}. Load it with the "
        f"class that wrote it ({'--model ' + written_by if written_by else '--model path.to.TheClass'} on the "
        "command line, or TheClass.load_from_checkpoint in Python)"
    )


def refuse_other_shapes(module: Any, state: dict, source: str = "the checkpoint") -> None:
    """Raise ``ValueError`` when a weight outside the MTP heads has another shape in ``state`` than in ``module``
    (torch's ``load_state_dict`` would fail with a "size mismatch" traceback): name the weight, both shapes and the
    likely cause. Under ZeRO-3 the module's real shapes are compared; an empty tensor that stands for a partitioned
    weight (a placeholder, see ``load_state_dict_whole``) is not a weight and is skipped."""
    own = state_shapes(module)
    for key, value in state.items():
        if _is_mtp_key(key) or key not in own or not isinstance(value, torch.Tensor):
            continue
        saved = tuple(value.shape)
        if saved == own[key] or (value.numel() == 0 and len(own[key]) > 0 and 0 not in own[key]):
            continue
        name = type(module).__name__
        rows_differ = len(saved) == len(own[key]) == 2 and saved[1:] == own[key][1:] and saved[0] != own[key][0]
        if rows_differ and module_vocab_size(module) in (saved[0], own[key][0]):
            vocab_flag = getattr(module, "mtp_vocab_flag", lambda: "its vocabulary size")()
            cause = (f"the vocabulary sizes differ: {saved[0]} ids in the checkpoint, {own[key][0]} in {name} (set by "
                     f"{vocab_flag}): was one of the two embeddings resized to another size? Start "
                     f"from a checkpoint trained with this vocabulary, or give the model the checkpoint's {saved[0]} "
                     "ids")
        else:
            cause = (f"the checkpoint was trained with another model width or size: give {name} the settings it was "
                     "trained with, or start from a checkpoint of this model")
        raise ValueError(f"{source} does not fit {name}: its weight {key!r} has shape {saved}, but {name}'s has shape "
                         f"{own[key]}: {cause}")


def module_vocab_size(module: Any) -> Optional[int]:
    """The module's vocabulary size (its output head's rows), ``None`` where it does not say."""
    try:
        return int(module.mtp_vocab_size())
    except Exception:  # noqa: BLE001 - an unbuilt or unusual module: the message then names no vocabulary
        return None


def restore_runtime_state(module: Any, checkpoint: dict, schedule: bool = True) -> None:
    """Restore the draft temperatures (a calibration of these weights) and, with ``schedule``, λ, the per-depth
    weights and the active depth, where the depths agree.

    Only a resumed fit restores the schedule: a new fit (``init_from``, weights loaded into a new config) starts
    from its own config, or its deeper depths might never train.
    """
    meta = checkpoint.get(CHECKPOINT_KEY)
    if not meta or meta.get("depth") != module.mtp_config.depth:
        return
    module.mtp_draft_temperatures = list(meta.get("draft_temperatures", module.mtp_draft_temperatures))
    if schedule:
        refuse_other_weights_config(module, meta.get("config") or {})
        module.mtp_loss_weight = meta.get("loss_weight", module.mtp_loss_weight)
        module.mtp_depth_weights = list(meta.get("depth_weights", module.mtp_depth_weights))
        module.mtp_active_depth = meta.get("active_depth", module.mtp_active_depth)


def refuse_other_weights_config(module: Any, saved: dict) -> None:
    """Raise ``ValueError`` when a resumed module's ``loss_weight`` or ``depth_weights`` differ from those of the fit
    it resumes (``saved``: the checkpoint's ``MTPConfig``): the resume restores the fit's λ and per-depth weights
    (their schedule's state), so a new value would be ignored without a word. The CLI refuses the flags earlier."""
    for name in ("loss_weight", "depth_weights"):
        mine = getattr(module.mtp_config, name)
        if name in saved and saved[name] != mine:
            raise ValueError(
                f"cannot resume this fit with MTPConfig.{name} = {mine!r}: the checkpoint's fit has {saved[name]!r}, "
                f"and a resumed fit continues its λ and per-depth weights. Resume with the checkpoint's value, or "
                "start a new fit from its weights (init_from, --model.init_args.init_from PATH) to change it")


DEEPSPEED_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""Rank 0's module-states file in a DeepSpeed checkpoint's tag folder: ZeRO-1/2 write the first, ZeRO-3 (one file per
rank, the module's parameters partitioned) the second. Either holds Lightning's checkpoint less its ``state_dict``
and ``optimizer_states`` (hyperparameters, MTP record, tokenizer, loops, ``global_step``)."""


def convert_command(path: Any) -> str:
    """The one-line command that converts the DeepSpeed checkpoint folder ``path`` to a single fp32 file."""
    return ("python -c \"from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict "
            f"as c; c('{path}', 'model.ckpt')\"")


def deepspeed_model_states(folder: Path, path: Any, flag: str) -> Path:
    """Rank 0's module-states file of the DeepSpeed checkpoint folder ``folder`` (``path`` as the user gave it),
    after checking that every ``*_states.pt`` shard beside it is a whole zip archive (see ``check_shards``).

    Raises:
        ValueError: the folder is neither a DeepSpeed checkpoint nor a sharded FSDP2 one, or a shard is unreadable.
    """
    tag_folder = deepspeed_tag_folder(folder)
    found = rank0_model_states(folder)
    if found is None:
        raise ValueError(f"{flag} {str(path)!r} is a directory but not a DeepSpeed checkpoint (neither "
                         f"{' nor '.join(DEEPSPEED_MODEL_STATES)} under {tag_folder.name}/) nor a sharded FSDP2 one "
                         "(no meta.pt): give a checkpoint file or a directory written by a DeepSpeed or FSDP2 fit")
    check_shards(tag_folder, path, flag)
    return found


def deepspeed_tag_folder(folder: Path) -> Path:
    """The folder of a DeepSpeed checkpoint's shards: the tag named in ``latest`` (Lightning's is ``checkpoint``)."""
    tag_file = folder / "latest"
    return folder / (tag_file.read_text().strip() if tag_file.is_file() else "checkpoint")


def rank0_model_states(folder: Path) -> Optional[Path]:
    """Rank 0's module-states file (:data:`DEEPSPEED_MODEL_STATES`) in ``folder``'s tag folder; ``None``: none."""
    tag_folder = deepspeed_tag_folder(folder)
    return next((tag_folder / name for name in DEEPSPEED_MODEL_STATES if (tag_folder / name).is_file()), None)


def check_shards(tag_folder: Path, path: Any, flag: str) -> None:
    """Raise ``ValueError`` when a ``*_states.pt`` file of a DeepSpeed checkpoint is empty or not a whole zip
    archive (``torch.save``'s format; a truncated file has lost the archive's directory at its end). Reads only each
    file's end, so a resume fails here with one message instead of in DeepSpeed's loader on every rank."""
    for shard in sorted(tag_folder.glob("*_states.pt")):
        if shard.stat().st_size == 0 or not zipfile.is_zipfile(shard):
            raise ValueError(f"{flag} {str(path)!r} cannot be read: its shard {shard.relative_to(tag_folder.parent)} "
                             "is empty, truncated or not a PyTorch checkpoint (was its writing interrupted?)")


def deepspeed_layout(checkpoint: dict) -> tuple[Optional[int], Optional[int], int]:
    """``(zero_stage, dp_world_size, mp_world_size)`` recorded in a DeepSpeed module-states dict (``None``: unknown)."""
    config = checkpoint.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    world = checkpoint.get("dp_world_size")
    return (int(stage) if isinstance(stage, int) else None, int(world) if isinstance(world, int) else None,
            int(checkpoint.get("mp_world_size") or 1))


def read_deepspeed_layout(folder: Any) -> tuple[Optional[int], Optional[int], int]:
    """:func:`deepspeed_layout` of the DeepSpeed checkpoint folder ``folder``, read from rank 0's module-states file
    (memory-mapped: ZeRO-1/2's holds the whole module, which is not read)."""
    found = rank0_model_states(Path(folder))
    if found is None:
        return None, None, 1
    return deepspeed_layout(torch.load(found, mmap=True, map_location="cpu", weights_only=True))


def expected_shards(stage: Optional[int], world: Optional[int], mp_world: int = 1) -> list[str]:
    """The module- and optimizer-states files a ZeRO-``stage`` fit on ``world`` data-parallel processes writes into
    its tag folder (optimizer files may carry a ``bf16_`` prefix); ``[]`` where the layout is unknown or not ZeRO."""
    if stage not in (1, 2, 3) or not world or mp_world != 1:
        return []
    ranks = range(world)
    models = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks] if stage == 3
              else ["mp_rank_00_model_states.pt"])
    return models + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks]


def check_shard_set(tag_folder: Path, checkpoint: dict, path: Any, flag: str) -> None:
    """Raise ``ValueError`` when a shard that the folder's recorded ZeRO stage and world size call for is missing
    (a folder copied in part, or a fit stopped while the ranks wrote), before any rank opens the shards."""
    stage, world, mp_world = deepspeed_layout(checkpoint)
    missing = [name for name in expected_shards(stage, world, mp_world) if not (tag_folder / name).is_file()
               and not (name.endswith("_optim_states.pt") and (tag_folder / f"bf16_{name}").is_file())]
    if missing:
        raise ValueError(f"{flag} {str(path)!r} is incomplete: its DeepSpeed ZeRO-{stage} fit ran on {world} "
                         f"processes, but {', '.join(f'{tag_folder.name}/{m}' for m in missing[:3])}"
                         f"{' and more' if len(missing) > 3 else ''} {'is' if len(missing) == 1 else 'are'} missing "
                         "(was the folder copied in part, or its writing interrupted?)")


def refuse_deepspeed_layout(path: Any, stage: Optional[int], world_size: int, fitting: bool,
                            flag: str = "--ckpt_path") -> Optional[int]:
    """The ZeRO stage the DeepSpeed checkpoint folder ``path`` records (``None``: unknown, or not such a folder).
    Raises ``ValueError`` (one line) when it cannot be resumed by a fit
    (``fitting``) under ZeRO ``stage`` on ``world_size`` processes: its optimizer shards are split for the recorded
    data-parallel world size (DeepSpeed cannot re-split them), and a ZeRO-3 folder and a ZeRO-1/2 one have other
    files. Loading weights for predict/validate/test is not refused: it reads the shards whole."""
    if not is_deepspeed_folder(path):
        return None
    saved_stage, saved_world, mp_world = read_deepspeed_layout(path)
    if not fitting:
        return saved_stage
    new_fit = f"or start a new fit from its weights with --model.init_args.init_from (convert it first: " \
              f"{convert_command(path)})"
    # ZeRO-1 and ZeRO-2 write the same files (the optimizer partitioned alike); ZeRO-3 and no ZeRO other ones.
    if saved_stage is not None and stage is not None and saved_stage != stage and not {saved_stage, stage} <= {1, 2}:
        raise ValueError(f"{flag} {str(path)!r} is a DeepSpeed ZeRO stage {saved_stage} checkpoint, but this fit runs "
                         f"ZeRO stage {stage}, which cannot load its shards: resume with "
                         f"--trainer.strategy.init_args.stage {saved_stage}, {new_fit}")
    if saved_world is not None and saved_stage and mp_world == 1 and saved_world != world_size:
        raise ValueError(f"{flag} {str(path)!r} was written by a DeepSpeed ZeRO-{saved_stage} fit on {saved_world} "
                         f"process{'es' if saved_world != 1 else ''}, but this fit runs on {world_size}: ZeRO's "
                         f"optimizer shards cannot be split anew, so resume with --trainer.devices {saved_world} "
                         f"(--trainer.devices x --trainer.num_nodes = {saved_world} processes), {new_fit}")
    return saved_stage


def without_zero3_placeholders(checkpoint: dict) -> dict:
    """Drop a ZeRO-3 module-states file's ``module`` entry: its parameters are empty placeholders (the weights are in
    the optimizer shards), never to be read as weights. ZeRO-1/2's ``module`` holds whole weights and stays."""
    module = checkpoint.get("module")
    if isinstance(module, dict) and any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in module.values()):
        checkpoint = {k: v for k, v in checkpoint.items() if k != "module"}
    return checkpoint


def read_checkpoint(path: Any, flag: str = "--ckpt_path", of_a_fit: Optional[bool] = None) -> dict:
    """``torch.load(path, weights_only=True)`` with errors that name the path and the flag it came from.

    A safetensors file (a model folder's weights, which ``torch.load`` also reads) is refused for every flag. With
    ``of_a_fit`` (default: when ``flag`` is ``--ckpt_path``, which Lightning reads next) a file must be a checkpoint
    written by a fit (:func:`refuse_non_checkpoint`): not an MTP-heads file nor a bare state dict.

    A DeepSpeed checkpoint directory reads as its rank-0 module-states file (ZeRO-1/2's ``mp_rank_00_...``, ZeRO-3's
    ``zero_pp_rank_0_mp_rank_00_...``; its shards are checked to be whole, and ZeRO-3's placeholder ``module``
    entry is left out; every shard that its recorded ZeRO stage and world size call for must be there), a sharded
    FSDP2 checkpoint directory (``ModelParallelStrategy(save_distributed_checkpoint=
    True)``) as its ``meta.pt`` (hyperparameters, MTP metadata, tokenizer; the sharded weights stay where they are).
    Neither has a ``state_dict``: the strategy that wrote the folder loads its weights (see ``is_deepspeed_folder``).

    Raises:
        ValueError: the file is missing, empty, truncated, not a checkpoint, or holds pickled objects (lightning-mtp
            writes plain types only and never unpickles arbitrary objects).
    """
    file = Path(path)
    tag_folder = None
    if file.is_dir() and (file / "meta.pt").is_file():  # torch.distributed.checkpoint shards and Lightning's metadata
        file = file / "meta.pt"
    elif file.is_dir():  # a DeepSpeed checkpoint: its metadata sits beside rank 0's module states
        tag_folder = deepspeed_tag_folder(file)
        file = deepspeed_model_states(file, path, flag)
    if not file.is_file():
        raise ValueError(f"{flag} {str(path)!r} does not exist")
    if file.stat().st_size == 0:
        raise ValueError(f"{flag} {str(path)!r} is an empty file, not a checkpoint (was its writing interrupted?)")
    if is_safetensors_file(file):
        raise ValueError(f"{flag} {str(path)!r} is a safetensors weights file (a model folder's weights), not a "
                         "checkpoint written by lightning-mtp: load the folder that holds it with "
                         "--model.init_args.pretrained DIR (HFCausalLM), and MTP heads saved for it with "
                         "--model.init_args.mtp_heads FILE")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - every failure is reported the same way, without torch's advice
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        with open(file, "rb") as fh:
            head = fh.read(2)
        if head not in (b"PK", b"\x80\x02"):  # neither of torch.save's formats (a zip archive; legacy pickle)
            reason = "it is not a PyTorch checkpoint (torch.save writes a zip archive; this is not one)"
        elif "weights only load failed" in first_line.lower() or "weights_only" in first_line:
            reason = "it holds pickled Python objects, which lightning-mtp does not load (checkpoints it writes hold "
            reason += "tensors and plain types only)"
        else:
            reason = f"it is truncated or not a PyTorch checkpoint ({type(error).__name__}: {first_line[:160]})"
        raise ValueError(f"{flag} {str(path)!r} cannot be read: {reason}") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{flag} {str(path)!r} is not a checkpoint: it holds a {type(checkpoint).__name__}, "
                         "not a dict with a state_dict")
    if tag_folder is not None:
        check_shard_set(tag_folder, checkpoint, path, flag)
    elif file == Path(path) and (flag == "--ckpt_path" if of_a_fit is None else of_a_fit):
        refuse_non_checkpoint(checkpoint, path, flag)
    return without_zero3_placeholders(checkpoint)


def is_safetensors_file(file: Path) -> bool:
    """Whether ``file`` starts as a safetensors file does: the length of its JSON header (8 bytes, little-endian),
    then the header's ``{``."""
    with open(file, "rb") as fh:
        head = fh.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 0 < int.from_bytes(head[:8], "little") <= file.stat().st_size - 8


LIGHTNING_KEYS = ("pytorch-lightning_version", "hyper_parameters", "global_step", "epoch", "loops")
"""Entries a Lightning checkpoint carries beside its weights (``Trainer.save_checkpoint``)."""


def refuse_non_checkpoint(checkpoint: dict, path: Any, flag: str = "--ckpt_path") -> None:
    """Raise ``ValueError`` when the file ``path`` (read as ``checkpoint``) is not a checkpoint written by a fit: an
    MTP-heads file (:meth:`HFCausalLM.save_mtp_heads`) or a bare state dict, which Lightning would otherwise take as
    one and fail on deep inside (a missing ``state_dict``, a model class it cannot rebuild)."""
    if any(key in checkpoint for key in LIGHTNING_KEYS):
        return
    if checkpoint.get(HEADS_ONLY_KEY):
        trunk = checkpoint.get("trunk") or {}
        folder = trunk.get("pretrained") if not trunk.get("trained") else None
        which = ("" if folder else " (DIR: the folder of the fine-tuned trunk the heads were trained with, written by "
                 "model.trunk.save_pretrained)" if trunk.get("trained") else " (DIR: the model folder the heads were "
                 "trained over)")
        raise ValueError(f"{flag} {str(path)!r} is an MTP-heads file written by save_mtp_heads, not a checkpoint of a "
                         f"fit: load it with --model lightning_mtp.models.HFCausalLM --model.init_args.pretrained "
                         f"{repr(folder) if folder else 'DIR'} --model.init_args.mtp_heads {str(path)!r}{which} "
                         "instead of --ckpt_path")
    if "state_dict" not in checkpoint:
        bare = checkpoint and all(isinstance(value, torch.Tensor) for value in checkpoint.values())
        what = "a bare state dict of weights" if bare else "no state_dict"
        instead = ", or start a new fit from these weights with --model.init_args.init_from FILE" if bare else ""
        raise ValueError(f"{flag} {str(path)!r} holds {what}, not a checkpoint written by a fit (lightning-mtp fit, "
                         f"Trainer.save_checkpoint), which records the model's class and settings: give such a "
                         f"checkpoint{instead}")


def is_deepspeed_folder(path: Any) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder (any ZeRO stage)."""
    folder = Path(path)
    return folder.is_dir() and not (folder / "meta.pt").is_file() and rank0_model_states(folder) is not None


def refuse_deepspeed_folder(path: Any, flag: str = "--ckpt_path", use: str = "predict") -> None:
    """Raise ``ValueError`` when ``path`` is a DeepSpeed checkpoint folder, which only a resumed DeepSpeed fit loads
    (Lightning reads a file without DeepSpeed; DeepSpeed 0.19 fails to load a ZeRO-3 folder for inference): the
    message says how to convert it to the single fp32 file that ``use`` (predict, export, ...) reads."""
    if is_deepspeed_folder(path):
        raise ValueError(f"{flag} {str(path)!r} is a DeepSpeed checkpoint folder, which only a resumed DeepSpeed fit "
                         f"loads: for {use}, convert it to one fp32 file with {convert_command(path)} and give "
                         f"{flag} model.ckpt")


def tokenizer_mismatch(trained: Optional[dict], used: Optional[dict]) -> Optional[str]:
    """Why the tokenizer ``used`` by the data is not the one the weights were ``trained`` with (``None``: same, or
    one of them unknown). Both are ``Tokenizer.spec()`` records."""
    if not trained or not used or trained.get("fingerprint") == used.get("fingerprint"):
        return None
    settings = trained.get("data") or {}
    how = f"--data.tokenizer {trained.get('kind')}"
    if trained.get("kind") == "bpe":
        how += f" --data.vocab_size {settings.get('vocab_size', trained.get('vocab_size'))} trained on the same corpus"
    return (
        f"the weights were trained with the tokenizer {trained.get('name')} ({trained.get('vocab_size')} ids), but "
        f"the data uses {used.get('name')} ({used.get('vocab_size')} ids"
        + (", the same size but other merges" if used.get("name") == trained.get("name") else "")
        + "): the ids would mean other text. Leave --data.tokenizer / --data.vocab_size / --data.max_bytes unset "
        f"so that lightning-mtp uses the checkpoint's tokenizer, or give {how}"
    )


def load_weights(module: Any, path: str, flag: str = "--model.init_args.init_from") -> LoadReport:
    """Load a checkpoint's weights (not its optimizer, loop or schedule state) into ``module`` with a report.

    Uses ``torch.load(weights_only=True)``: lightning-mtp checkpoints hold plain types only. The checkpoint's
    tokenizer record (if any) is kept on the module (``mtp_tokenizer``), so that data with another tokenizer is
    refused. Under DeepSpeed ZeRO-3 (a fit's ``configure_model`` runs inside ``deepspeed.zero.Init``) the weights are
    compared by their real shapes and loaded into the partitions, one gathered module at a time; every rank calls it.
    """
    refuse_deepspeed_folder(path, flag, "a new fit from its weights")  # its module states hold no (whole) weights
    checkpoint = read_checkpoint(path, flag)
    if "state_dict" not in checkpoint:
        checkpoint = {"state_dict": checkpoint}
    report = reconcile_state_dict(module, checkpoint, resuming=False, source=f"{flag} {path}")
    complete = getattr(module, "mtp_complete_checkpoint", None)  # HFCausalLM: a frozen trunk's keys, its checks
    if complete is not None:
        complete(checkpoint, f"{flag} {path}")
    # Into ZeRO-3 partitions too (a fit's configure_model runs inside deepspeed.zero.Init): gathered module by module.
    missing, unexpected = load_state_dict_whole(module, checkpoint["state_dict"], strict=False)
    missing = [k for k in missing if not _is_mtp_key(k)]
    if missing or unexpected:
        raise ValueError(f"{flag} {path} does not fit {type(module).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    restore_runtime_state(module, checkpoint, schedule=False)
    if checkpoint.get(TOKENIZER_KEY):
        module.bind_mtp_tokenizer(checkpoint[TOKENIZER_KEY], f"{flag} {path}")
    return report
