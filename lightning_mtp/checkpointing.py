"""MTP metadata in checkpoints, and loading checkpoints whose MTP heads differ from the module's (reading the file or
DeepSpeed folder, and refusing what is not a checkpoint: :mod:`lightning_mtp.checkpoint_files`).

A checkpoint carries ``checkpoint["mtp"]`` (plain types only, so ``torch.load(weights_only=True)`` reads it): the
depth, the architecture, the whole ``MTPConfig`` and the runtime schedule state (λ, per-depth weights, active depth,
draft temperatures). Loading a checkpoint trained with another depth, or a plain checkpoint without MTP weights,
fills the missing MTP weights from the module's fresh initialisation and drops the extra ones, and says which: it is
never a silent mismatch. Resuming a *fit* across such a mismatch is refused, because the optimizer state cannot match.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_mtp.checkpoint_files import read_checkpoint, refuse_deepspeed_folder
from lightning_mtp.sharded import gathered_weights, is_fsdp2_module, load_state_dict_whole, state_shapes

CHECKPOINT_KEY = "mtp"
TOKENIZER_KEY = "tokenizer"
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
