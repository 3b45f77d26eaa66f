"""Native MTP layers in ``transformers`` checkpoints: their keys, and importing them into our modules.

MTP layer k (0-based) of a model with N main layers sits under ``model.layers.{N+k}.``: ``enorm.weight``,
``hnorm.weight``, ``eh_proj.weight`` [H, 2H], ``shared_head.norm.weight`` (our ``post_norm``) and the decoder block's
own keys (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``; for mixture-of-experts
blocks the router's ``mlp.gate.e_score_correction_bias`` too). Released checkpoints (DeepSeek-V3's layer 61,
GLM-4.5's layer 92) also carry ``embed_tokens.weight`` and ``shared_head.head.weight`` per MTP layer, copies of the
main model's embedding and head (:func:`serving_copy_state`; vLLM's loader reads them, ``transformers`` and SGLang do
not): the import reports them as ignored, since the main model's head and embedding serve every depth.

On disk a block's keys are those ``save_pretrained`` writes, which are not always the module's own (glm4_moe and
deepseek_v3 store each expert's ``gate_proj``/``up_proj``/``down_proj``, their modules hold fused ``gate_up_proj``
tensors): :func:`disk_state` goes from module names to disk names with ``transformers``' own reverse conversion, and
the import reads the tensors through ``transformers``' ``MtpModel.from_pretrained`` (its forward conversion), so what
we load is exactly what ``generate(use_mtp=True)`` would run.

The import refuses, naming the folder, weights that do not hold exactly the MTP layers ``config.json`` declares
(``num_nextn_predict_layers``: none of them, some of them, or more layers than it declares, which would be ignored)
and MTP tensors holding NaN or infinite values. A folder whose config declares 0 MTP layers starts every depth fresh.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_mtp.finite import nonfinite_tensors
from lightning_mtp.native.family import checkpoint_prefix, native_layer_count
from lightning_mtp.native.transformers_mtp import checkpoint_files, register_mtp_patterns, tensor_shapes

OWN_KEYS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "post_norm.weight": "shared_head.norm.weight"}
"""Our module's keys outside the block -> the checkpoint's names (under the layer's prefix)."""

SERVING_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""Per-layer copies of the main model's embedding and head that released checkpoints carry: never read on import,
written on export for the serving engines that load them per layer (:func:`serving_copy_state`)."""
LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
"""A checkpoint key of a decoder layer; group 1 is its layer number."""


@dataclass
class NativeImportReport:
    """What :func:`import_native_layers` loaded (``HFCausalLM.mtp_native_report``)."""

    folder: str
    checkpoint_layers: int
    """MTP layers the folder holds (its config's ``num_nextn_predict_layers``)."""
    loaded: dict[int, list[str]] = field(default_factory=dict)
    """Depth (1-based) -> the checkpoint keys loaded into it."""
    fresh: list[int] = field(default_factory=list)
    """Depths freshly initialised (``MTPConfig.depth`` beyond the folder's layers)."""
    ignored: list[str] = field(default_factory=list)
    """Checkpoint keys under the MTP layers' prefixes that were not read (shared head / embedding copies)."""

    def summary(self) -> str:
        keys = sum(len(v) for v in self.loaded.values())
        text = (f"native MTP layers from {self.folder}: depths {sorted(self.loaded)} loaded ({keys} tensors) of the "
                f"{self.checkpoint_layers} in the folder")
        if self.fresh:
            text += f"; depths {self.fresh} freshly initialised"
        if self.ignored:
            more = ", ..." if len(self.ignored) > 3 else ""
            text += f"; ignored {len(self.ignored)} keys ({', '.join(self.ignored[:3])}{more})"
        return text


def module_state(module: nn.Module, trunk_layers: int, index: int) -> dict[str, Tensor]:
    """One native module's tensors under checkpoint names (module-side names inside the block: not yet reverted)."""
    prefix = checkpoint_prefix(trunk_layers, index)
    state = {prefix + key: tensor for key, tensor in module.block.state_dict().items()}
    for own, name in OWN_KEYS.items():
        state[prefix + name] = module.state_dict()[own]
    return state


def serving_copy_state(trunk: nn.Module, trunk_layers: int, index: int) -> dict[str, Tensor]:
    """MTP layer ``index``'s copies of the trunk's input embedding and output head, as the released checkpoints lay
    them out: ``model.layers.{N+k}.embed_tokens.weight`` [V, H] and ``model.layers.{N+k}.shared_head.head.weight``
    [V, H] (the same tensors for tied embeddings). vLLM's ``deepseek_mtp.py`` loads the head per layer and the
    embedding per layer (older versions) or from the first MTP layer, and fails on a folder without them."""
    prefix = checkpoint_prefix(trunk_layers, index)
    return {prefix + SERVING_COPIES[0]: trunk.get_input_embeddings().weight,
            prefix + SERVING_COPIES[1]: trunk.get_output_embeddings().weight}


def disk_state(trunk: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoint-named module tensors -> what ``save_pretrained`` would write for them (``transformers``'
    ``revert_weight_conversion`` with the trunk's conversion mapping: per-expert tensors for fused experts, ...)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(trunk, dict(state)))


def import_native_layers(modules: nn.ModuleList, trunk: nn.Module, folder: str) -> NativeImportReport:
    """Load the MTP layers of the ``transformers`` folder ``folder`` into ``modules`` (depth k <- layer k-1); depths
    beyond the folder's layers keep their fresh initialisation (all of them when its config declares 0 layers).

    Raises:
        ValueError: naming the folder and the keys, when the weights hold only some, or more, of the MTP layers its
            config declares (none of them: warned, every depth fresh), when a layer lacks a required tensor or holds
            one of another shape than the module's, or when an imported tensor holds NaN or infinite values.
    """
    declared = native_layer_count(trunk.config) or 0
    trunk_layers = trunk.config.get_text_config().num_hidden_layers
    files = checkpoint_files(folder)
    declared = _check_declared(folder, files, declared, trunk_layers)  # 0 when the weights hold none of them
    report = NativeImportReport(folder, declared)
    count = min(declared, len(modules))
    report.fresh = list(range(count + 1, len(modules) + 1))
    if not declared:  # nothing to import: every depth starts fresh
        return report
    expected: dict[int, dict[str, Tensor]] = {
        k: disk_state(trunk, module_state(modules[k], trunk_layers, k)) for k in range(count)}
    _check_folder(folder, files, expected, trunk_layers)
    for k in range(count):
        copies = serving_copy_state(trunk, trunk_layers, k)
        report.ignored += [key for key in files if key in copies]
        differing = _differing_copies(files, {key: t for key, t in copies.items() if key in files})
        if differing:
            rank_zero_warn(f"{folder}: {', '.join(differing)} differ from the trunk's embedding / head: the import "
                           "ignores them (the trunk's serve every depth, as in transformers and SGLang), vLLM would "
                           "draft with them, and an export writes the trunk's in their place")
    loaded = _read_with_transformers(trunk, folder, declared)
    _refuse_nonfinite(folder, files, loaded, expected)
    for k in range(count):
        state = {key.removeprefix(f"layers.{k}."): t for key, t in loaded.items() if key.startswith(f"layers.{k}.")}
        ours = {("block." + key.removeprefix("mtp_block.")) if key.startswith("mtp_block.") else key: t
                for key, t in state.items()}
        missing, unexpected = modules[k].load_state_dict(ours, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: MTP layer {k} (model.layers.{trunk_layers + k}.*) does not fit depth "
                             f"{k + 1}'s module: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        report.loaded[k + 1] = sorted(expected[k])
    return report


def _held_layers(files: dict[str, str], trunk_layers: int) -> dict[int, list[str]]:
    """MTP layer index (0-based) -> the folder's keys under it (``model.layers.{N+k}.*``), for every layer the weights
    hold, declared or not."""
    held: dict[int, list[str]] = {}
    for key in sorted(files):
        match = LAYER_KEY.match(key)
        if match and int(match.group(1)) >= trunk_layers:
            held.setdefault(int(match.group(1)) - trunk_layers, []).append(key)
    return held


def _check_declared(folder: str, files: dict[str, str], declared: int, trunk_layers: int) -> int:
    """How many MTP layers to import: ``declared``, or 0 (warned) when the weights hold none of them, as every folder
    ``transformers``' own ``save_pretrained`` writes. Refuses weights holding layers beyond the count (the import
    would ignore them) or only some of the declared ones (an interrupted save)."""
    held = _held_layers(files, trunk_layers)
    undeclared = {k: keys for k, keys in held.items() if k >= declared}
    if undeclared:
        first = min(undeclared)
        keys = undeclared[first]
        shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
        layers = ", ".join(f"model.layers.{trunk_layers + k}.*" for k in sorted(undeclared))
        raise ValueError(f"{folder}: the weights hold MTP layers {layers} ({len(keys)} keys under layer "
                         f"{trunk_layers + first}: {shown}) that config.json does not declare "
                         f"(num_nextn_predict_layers={declared}): the import would ignore them; set "
                         f"num_nextn_predict_layers to {max(held) + 1} in config.json or remove those keys")
    if not declared or len(held) == declared:
        return declared
    if not held:  # transformers' own save_pretrained writes no MTP layer: a fine-tuned folder looks so, loudly fresh
        rank_zero_warn(f"{folder}: config.json declares num_nextn_predict_layers={declared} but the weights hold no "
                       "MTP layer (transformers' save_pretrained leaves them out): every MTP depth starts fresh")
        return 0
    wanted = ", ".join(f"model.layers.{trunk_layers + k}.*" for k in range(declared))
    found = "MTP layers " + ", ".join(f"model.layers.{trunk_layers + k}.*" for k in sorted(held)) + " only"
    raise ValueError(f"{folder}: config.json declares num_nextn_predict_layers={declared} but the weights hold "
                     f"{found} (expected {wanted}): an interrupted save; fix the weights, or set "
                     "num_nextn_predict_layers to 0 in config.json to start every depth fresh")


def _refuse_nonfinite(folder: str, files: dict[str, str], loaded: dict[str, Tensor],
                      expected: dict[int, dict[str, Tensor]]) -> None:
    """Refuse the import when a tensor of the MTP layers being imported holds NaN or infinite values, naming the
    first such key on disk (checked in memory after the load; the disk is read only to name it)."""
    for k in sorted(expected):
        state = {key: t for key, t in loaded.items() if key.startswith(f"layers.{k}.")}
        bad = _nonfinite(state)
        if bad:
            key = _first_nonfinite_on_disk(files, sorted(expected[k])) or bad[0]
            raise ValueError(f"{folder}: MTP layer {k}'s {key} holds NaN or infinite values: the import refuses it "
                             "(it comes from a fit that diverged); use a folder saved before the divergence")


def _nonfinite(state: dict[str, Tensor]) -> list[str]:
    """:func:`~lightning_mtp.finite.nonfinite_tensors` of ``state``, one tensor at a time: 8-bit floats (which
    ``isfinite`` does not take) compared in fp32, tensors without storage (meta) skipped."""
    return [key for key, t in state.items() if not t.is_meta and nonfinite_tensors(
        {key: t.float() if t.is_floating_point() and t.element_size() == 1 else t})]


def _first_nonfinite_on_disk(files: dict[str, str], keys: list[str]) -> Optional[str]:
    """The first of ``keys`` whose tensor in the folder holds NaN or infinite values."""
    from safetensors import safe_open

    for key in keys:
        if key in files:
            with safe_open(files[key], framework="pt") as handle:
                if _nonfinite({key: handle.get_tensor(key)}):
                    return key
    return None


def _differing_copies(files: dict[str, str], copies: dict[str, Tensor]) -> list[str]:
    """The folder's serving copies whose values are not the trunk's tensors ``copies`` (checked only where the trunk's
    are materialised, unsharded and of the same shape)."""
    from safetensors import safe_open

    differing = []
    for key, ours in copies.items():
        if ours.is_meta or type(ours.data) is not Tensor:  # deferred init, or a DTensor shard
            continue
        with safe_open(files[key], framework="pt") as handle:
            theirs = handle.get_tensor(key)
        if theirs.shape != ours.shape or not torch.equal(theirs.to(ours.device, ours.dtype), ours.detach()):
            differing.append(key)
    return differing


def _check_folder(folder: str, files: dict[str, str], expected: dict[int, dict[str, Tensor]],
                  trunk_layers: int) -> None:
    """Refuse imported layers that lack a tensor of the module's, hold one of another shape, or one it has no
    place for."""
    problems = []
    for state in expected.values():
        shapes = tensor_shapes(files, list(state))
        for key, tensor in state.items():
            if key not in shapes:
                problems.append(f"{key} missing")
            elif shapes[key] != tuple(tensor.shape):
                problems.append(f"{key} has shape {list(shapes[key])}, the module's is {list(tensor.shape)}")
    for k, state in expected.items():  # tensors our block has no place for: another block configuration
        prefix = checkpoint_prefix(trunk_layers, k)
        problems += [f"{key} unexpected" for key in sorted(files)
                     if key.startswith(prefix) and key not in state and not key.endswith(SERVING_COPIES)]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
        raise ValueError(f"{os.path.abspath(folder)}: its native MTP layers do not fit this model's: {shown}")


def _read_with_transformers(trunk: nn.Module, folder: str, layers: int) -> dict[str, Tensor]:
    """``MtpModel.from_pretrained``'s state (keys ``layers.{k}.{enorm,hnorm,eh_proj,post_norm,mtp_block.*}``)."""
    from transformers.modeling_layers import MtpModel

    register_mtp_patterns(trunk, layers)
    config = trunk.config
    saved_path: Optional[str] = config.name_or_path
    config.name_or_path = folder
    try:
        device = trunk.get_input_embeddings().weight.device
        mtp = MtpModel.from_pretrained(trunk, device_map={"": device})
    finally:
        config.name_or_path = saved_path
    return {key: tensor for key, tensor in mtp.state_dict().items() if key.startswith("layers.")}


def refuse_other_layout(layout: str, checkpoint: dict, source: str) -> None:
    """Refuse a Lightning checkpoint whose MTP modules follow another layout than ``layout``: the keys differ, and
    loading would silently start the MTP modules from scratch. Checkpoints written before layouts existed hold the
    lightning layout."""
    config = (checkpoint.get("mtp") or {}).get("config") or {}
    if not config and not any(key.startswith("mtp_modules.") for key in checkpoint.get("state_dict") or {}):
        return  # no MTP modules in it: nothing to mix up
    saved = config.get("layout") or "lightning"
    if saved != layout:
        raise ValueError(f"{source} holds MTP modules of layout {saved!r}, but this model's are {layout!r} "
                         f"(MTPConfig.layout, --model.mtp.layout): pass --model.mtp.layout {saved} to load it")
