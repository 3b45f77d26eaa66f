"""Reading a checkpoint: one file (``torch.load(weights_only=True)``) or a DeepSpeed checkpoint folder (its rank-0
module states, every shard checked whole), refusing what is not a checkpoint a fit wrote (an MTP-heads file, a bare
state dict, a safetensors file, a folder of another layout) with a message that says what to give instead.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

HEADS_ONLY_KEY = "mtp_heads_only"  # a checkpoint without the trunk's weights (HFCausalLM's frozen trunk)


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
