"""Export: a ``transformers`` folder with the trunk and its native MTP layers.

``export_native(module, folder)`` writes what ``AutoModelForCausalLM.from_pretrained(folder)`` loads and
``generate(..., use_mtp=True)`` decodes with: ``config.json`` with ``num_nextn_predict_layers`` = D, and safetensors
holding the trunk and, for MTP layer k, ``model.layers.{N+k}.{enorm, hnorm, eh_proj, shared_head.norm}.weight`` plus
the block's tensors under the names ``save_pretrained`` gives a main layer's (per-expert tensors for fused experts).
Unless ``serving_copies=False``, every MTP layer also gets ``embed_tokens.weight`` and ``shared_head.head.weight``,
copies of the trunk's input embedding and output head in its dtype, as the released checkpoints of both families lay
them out (DeepSeek-V3's ``model.layers.61.*``, GLM-4.5's ``model.layers.92.*``; GLM-4.6 ships without them): vLLM's
``deepseek_mtp.py`` loader needs them, ``transformers`` and SGLang's ``deepseek_nextn.py`` skip them. They cost two
[V, H] tensors per MTP layer on disk.

What ``transformers`` does with such a folder (checked in ``tests/test_native_mtp.py``):

* ``from_pretrained`` loads the trunk and reports the MTP tensors as unexpected keys (a log line, not an error) unless
  the class's static ``_keys_to_ignore_on_load_unexpected`` covers them; the MTP weights are not part of the model in
  memory.
* ``generate(use_mtp=True)`` reads them from the folder on every call (``MtpModel.from_pretrained``), selected by those
  same static patterns, which name the released layer counts only (glm4_moe: 46 and 92 main layers, deepseek_v3: 61).
  For any other N it finds none and raises ``RuntimeError: The following MtpModel weights are missing``; call
  :func:`~lightning_mtp.native.transformers_mtp.register_mtp_patterns` on the loaded model first (it sets the
  instance's patterns). :func:`export_native` logs that advice when N is not a released count.

Refused: lightning-layout modules (``transformers`` would read their keys with other semantics), parallel heads, and
trunks of families without native MTP (their config has no ``num_nextn_predict_layers``, so ``transformers`` would
never run the layers).

The folder is written whole or not at all (:func:`write_folder`): into a hidden ``.NAME.partial-XXXXXXXX`` beside it,
renamed into its place when complete, so an export that fails or is killed leaves the old folder as it was (a config
declaring MTP layers beside weights without them would otherwise be what a kill leaves). The partial folder a killed
export leaves is removed by the next export into the same folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_mtp.native.checkpoint import disk_state, module_state, serving_copy_state
from lightning_mtp.native.family import has_native_mtp
from lightning_mtp.native.transformers_mtp import INDEX_FILE, SINGLE_FILE, finds_mtp_layers

try:
    import fcntl
except ImportError:  # Windows: no flock; partial folders of interrupted exports are reported, not removed
    fcntl = None

MTP_SHARD = "model-mtp.safetensors"
"""The file MTP tensors go to when the trunk is saved in shards (listed in the index like any shard)."""
NUMBERED_SHARD = re.compile(r"model.*?-\d{5}-of-\d{5}\.(safetensors|bin)")
"""A numbered shard of an earlier save (what the trunk's ``save_pretrained`` removes when it does not rewrite it)."""
PARTIAL = re.compile(r"\..+\.partial-[0-9a-f]{8}")
"""The name of a folder being written (``.NAME.partial-XXXXXXXX``), renamed to NAME once complete."""


def check_exportable(module: nn.Module) -> None:
    """Refuse, naming the reason and the fix, what ``transformers`` could not load as native MTP layers."""
    cfg = module.mtp_config
    trunk = getattr(module, "trunk", None)
    name = type(module).__name__
    if trunk is None or not hasattr(trunk, "save_pretrained"):
        raise ValueError(f"{name} has no transformers trunk: only HFCausalLM modules export to a transformers folder")
    if not has_native_mtp(trunk):
        raise ValueError(
            f"{type(trunk).__name__} (model_type {trunk.config.model_type!r}) has no native MTP layers in transformers "
            "(its config has no num_nextn_predict_layers): generate(use_mtp=True) could not run exported MTP layers. "
            f"Instead, {heads_alone_advice(module)}; or train a family that has native MTP layers (e.g. glm4_moe, "
            "deepseek_v3)"
        )
    if cfg.layout != "native" or cfg.architecture != "cascaded":
        raise ValueError(
            f"{name} has MTPConfig.layout={cfg.layout!r}, architecture={cfg.architecture!r}; transformers runs only "
            "native cascaded MTP layers (post-norm chaining, the model's own decoder layer as the block). Train with "
            f"--model.mtp.layout native to export, or instead {heads_alone_advice(module)}"
        )


def heads_alone_advice(module: nn.Module) -> str:
    """How to keep ``module``'s MTP heads without a native export: alone (``save_mtp_heads``) where the trunk was
    frozen, so they load back onto its folder; with the fine-tuned trunk beside them where the fit trained it."""
    if getattr(module, "freeze_trunk", False):
        onto = ("the model folder (--model.init_args.pretrained DIR --model.init_args.mtp_heads FILE)"
                if getattr(module, "pretrained", None) else "the same model (HFCausalLM.from_model(model, mtp_heads="
                "FILE))")
        return f"save the MTP heads alone with save_mtp_heads(path) and load them onto {onto}"
    return ("serve the checkpoint itself (lightning-mtp predict --ckpt_path CKPT), or save the trunk with the heads: "
            "the fit trained the trunk, so the MTP heads belong to the trained trunk, not to any folder it started "
            "from (in Python: module.trunk.save_pretrained(DIR) and the tokenizer into DIR, module.save_mtp_heads("
            "FILE); then HFCausalLM(pretrained=DIR, mtp_heads=FILE))")


@torch.no_grad()
def export_native(module: nn.Module, folder: str, serving_copies: bool = True, *, shown_as: Optional[str] = None,
                  **save_kwargs: Any) -> list[str]:
    """Write ``module`` (an ``HFCausalLM`` with native-layout MTP modules) as a ``transformers`` folder; returns the
    checkpoint keys written for the MTP layers. ``serving_copies`` adds each layer's copies of the trunk's embedding
    and head (``embed_tokens.weight``, ``shared_head.head.weight``: what vLLM loads). ``save_kwargs`` go to the trunk's
    ``save_pretrained`` (``max_shard_size``, ...); in a sharded folder the MTP layers are one more shard,
    ``model-mtp.safetensors``. ``shown_as``: the folder's name in messages (``lightning-mtp export`` writes to a
    temporary folder that then takes ``--out``'s place).

    The folder is written whole or not at all (:func:`write_folder`): a failed or killed export leaves an earlier one
    in ``folder`` as it was. The files of ``folder`` that are not weights (a tokenizer, a README) are kept; the weights
    of an earlier save (``model.safetensors``, its index, numbered shards, ``model-mtp.safetensors``) are not, so an
    old index never sits beside a new single file (``transformers`` would load the wrong weights)."""
    check_exportable(module)
    trunk = module.trunk
    modules = module.require_mtp_modules()
    config = trunk.config.get_text_config()
    trunk_layers = config.num_hidden_layers
    state: dict[str, Tensor] = {}
    for k, layer in enumerate(modules):
        state.update(module_state(layer, trunk_layers, k))
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in disk_state(trunk, state).items()}
    if serving_copies:  # cloned: safetensors refuses tensors that share memory (tied embeddings, one per layer)
        tensors.update({key: t.detach().to("cpu", copy=True).contiguous() for k in range(len(modules))
                        for key, t in serving_copy_state(trunk, trunk_layers, k).items()})

    def write(staging: str) -> None:
        saved = config.num_mtp_layers
        config.num_mtp_layers = len(modules)  # written as num_nextn_predict_layers (the config's attribute_map)
        try:
            trunk.save_pretrained(staging, **save_kwargs)
        finally:
            config.num_mtp_layers = saved
        _add_tensors(staging, tensors)

    write_folder(folder, write)
    if not finds_mtp_layers(trunk, len(modules)):
        rank_zero_info(
            f"{shown_as or folder}: {type(trunk).__name__} finds MTP layers only at the layer numbers of its released "
            f"checkpoints (_keys_to_ignore_on_load_unexpected), not at {trunk_layers}: after from_pretrained, call "
            "lightning_mtp.native.register_mtp_patterns(model) before generate(use_mtp=True)"
        )
    return sorted(tensors)


def write_folder(folder: str, write: Callable[[str], object], keep_other_files: bool = True) -> None:
    """``write(path)`` into a new hidden folder beside ``folder`` (``.NAME.partial-XXXXXXXX``), then put that in
    ``folder``'s place with two renames: a write that fails or is killed leaves ``folder`` as it was.

    ``keep_other_files``: ``folder``'s files other than weights (:func:`_is_weight_file`) are copied into the new folder
    first, as writing in place would keep them; otherwise ``folder`` is replaced whole. Partial folders of ``folder``
    that a killed write left are removed first; those of a write still running (each holds a ``flock`` on its partial
    folder until it is in place) are kept. Writers into one parent take turns for those steps and for the renames
    (a ``flock`` on the parent), so ranks that all save the same folder each put a complete one in place.

    A ``folder`` that is itself a partial folder (an outer ``write_folder``'s, or ``lightning-mtp export``'s, which
    also writes the tokenizer) is written in place: nothing reads it until its own writer renames it."""
    target = _target(folder)
    if PARTIAL.fullmatch(target.name):
        write(str(target))
        return
    with _parent_lock(target):
        _remove_stale_partials(target)
        staging, held = _locked_sibling(target, "partial")
    try:
        if keep_other_files and target.is_dir():
            _copy_other_files(target, staging)
        write(str(staging))
        with _parent_lock(target):
            _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(held)


def _target(folder: str) -> Path:
    """``folder`` resolved (symlinks followed, so the partial folder lands beside the real one), its parents created;
    refused when it is a file, or a mount point (which nothing can be renamed onto)."""
    target = Path(os.path.realpath(folder))
    if target.exists() and not target.is_dir():
        raise ValueError(f"{folder} is a file, not a folder: give the path of a folder to write the model into")
    if target.is_dir() and os.path.ismount(target):
        raise ValueError(f"{folder} is a mount point, which the finished folder cannot be renamed onto (it is written "
                         "beside it first): give a folder inside it")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def _flock(fd: int, wait: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd``; ``False`` when another process holds it (``wait=False``) or the system
    cannot lock."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _parent_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``target``'s parent folder (writers into it take turns; none where the system
    cannot lock)."""
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        _flock(fd, wait=True)
        yield
    finally:
        os.close(fd)


def _locked_sibling(target: Path, purpose: str) -> tuple[Path, int]:
    """A new hidden folder ``.NAME.PURPOSE-XXXXXXXX`` beside ``target`` and a descriptor holding its ``flock`` (the
    system drops it when the process dies: that is how :func:`_remove_stale_partials` tells a live one)."""
    while True:
        sibling = target.with_name(f".{target.name}.{purpose}-{secrets.token_hex(4)}")
        try:
            sibling.mkdir()
        except FileExistsError:
            continue
        fd = os.open(sibling, os.O_RDONLY)
        _flock(fd, wait=False)
        return sibling, fd


def _remove_stale_partials(target: Path) -> None:
    """Remove the partial folders of ``target`` that interrupted writes left (no process holds their ``flock``)."""
    prefix = f".{target.name}.partial-"
    removed, kept = [], []
    for entry in sorted(os.scandir(target.parent), key=lambda e: e.name):
        if not (entry.name.startswith(prefix) and re.fullmatch("[0-9a-f]{8}", entry.name[len(prefix):])
                and entry.is_dir(follow_symlinks=False)):
            continue
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            if _flock(fd, wait=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            (removed if not os.path.lexists(entry.path) else kept).append(entry.name)
        finally:
            os.close(fd)
    if removed:
        rank_zero_info(f"{target}: removed {', '.join(removed)} beside it, left by an interrupted export")
    if kept:
        rank_zero_info(f"{target}: kept {', '.join(kept)} beside it: an export into it is running (or the system "
                       "cannot lock folders); delete them once none runs")


def _is_weight_file(name: str) -> bool:
    """A weight file of an earlier save, which a new save replaces or (numbered shards) removes."""
    return name in (SINGLE_FILE, INDEX_FILE, MTP_SHARD) or NUMBERED_SHARD.fullmatch(name) is not None


def _copy_other_files(source: Path, staging: Path) -> None:
    """Copy ``source``'s entries other than weights into ``staging`` (copies: a hard link would let the new save
    overwrite the old folder's file in place)."""
    for entry in os.scandir(source):
        if _is_weight_file(entry.name):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, staging / entry.name, symlinks=True)
        else:
            shutil.copy2(entry.path, staging / entry.name, follow_symlinks=False)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved aside first, and removed once the new one is
    in place (put back if the second rename fails)."""
    if not target.exists():
        os.rename(staging, target)
        return
    retired = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
    os.rename(target, retired)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)
    if retired.exists():
        rank_zero_warn(f"{target}: could not delete the previous folder, moved to {retired}: delete it")


def _add_tensors(folder: str, tensors: dict[str, Tensor]) -> None:
    """Put ``tensors`` into the folder's safetensors: into the single file, or as one more indexed shard."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as handle:
            index = json.load(handle)
        save_file(tensors, os.path.join(folder, MTP_SHARD), metadata={"format": "pt"})
        index["weight_map"].update({key: MTP_SHARD for key in tensors})
        metadata = index.setdefault("metadata", {})
        metadata["total_size"] = int(metadata.get("total_size", 0)) + sum(
            t.numel() * t.element_size() for t in tensors.values())
        with open(index_path, "w") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)
        return
    path = os.path.join(folder, SINGLE_FILE)
    with safe_open(path, framework="pt") as handle:
        existing = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata() or {"format": "pt"}
    overlap = sorted(set(existing) & set(tensors))
    if overlap:
        raise ValueError(f"{path} already holds {overlap[:3]}: the trunk's own layers collide with the MTP layers' "
                         "keys")
    partial = path + ".partial"
    save_file({**existing, **tensors}, partial, metadata=metadata)
    os.replace(partial, path)
