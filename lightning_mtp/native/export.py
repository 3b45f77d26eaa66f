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
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_mtp.native.checkpoint import disk_state, module_state, serving_copy_state
from lightning_mtp.native.family import has_native_mtp
from lightning_mtp.native.transformers_mtp import INDEX_FILE, SINGLE_FILE, finds_mtp_layers

MTP_SHARD = "model-mtp.safetensors"
"""The file MTP tensors go to when the trunk is saved in shards (listed in the index like any shard)."""


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
            "Save the MTP heads alone with save_mtp_heads(path) instead, or train a family that has native MTP layers "
            "(e.g. glm4_moe, deepseek_v3)"
        )
    if cfg.layout != "native" or cfg.architecture != "cascaded":
        raise ValueError(
            f"{name} has MTPConfig.layout={cfg.layout!r}, architecture={cfg.architecture!r}; transformers runs only "
            "native cascaded MTP layers (post-norm chaining, the model's own decoder layer as the block). Train with "
            "--model.mtp.layout native to export, or save the MTP heads alone with save_mtp_heads(path)"
        )


@torch.no_grad()
def export_native(module: nn.Module, folder: str, serving_copies: bool = True, *, shown_as: Optional[str] = None,
                  **save_kwargs: Any) -> list[str]:
    """Write ``module`` (an ``HFCausalLM`` with native-layout MTP modules) as a ``transformers`` folder; returns the
    checkpoint keys written for the MTP layers. ``serving_copies`` adds each layer's copies of the trunk's embedding
    and head (``embed_tokens.weight``, ``shared_head.head.weight``: what vLLM loads). ``save_kwargs`` go to the trunk's
    ``save_pretrained`` (``max_shard_size``, ...); in a sharded folder the MTP layers are one more shard,
    ``model-mtp.safetensors``. ``shown_as``: the folder's name in messages (``lightning-mtp export`` writes to a
    temporary folder that then takes ``--out``'s place).

    Weights of an earlier save in ``folder`` (``model.safetensors``, its index, ``model-mtp.safetensors``) are removed
    first: the trunk's ``save_pretrained`` removes stale numbered shards only, and an old index beside a new single
    file (or an old single file beside a new index) would make ``transformers`` load the wrong weights."""
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
    saved = config.num_mtp_layers
    config.num_mtp_layers = len(modules)  # written as num_nextn_predict_layers (the config's attribute_map)
    try:
        _remove_earlier_weights(folder)
        trunk.save_pretrained(folder, **save_kwargs)
    finally:
        config.num_mtp_layers = saved
    _add_tensors(folder, tensors)
    if not finds_mtp_layers(trunk, len(modules)):
        rank_zero_info(
            f"{shown_as or folder}: {type(trunk).__name__} finds MTP layers only at the layer numbers of its released "
            f"checkpoints (_keys_to_ignore_on_load_unexpected), not at {trunk_layers}: after from_pretrained, call "
            "lightning_mtp.native.register_mtp_patterns(model) before generate(use_mtp=True)"
        )
    return sorted(tensors)


def _remove_earlier_weights(folder: str) -> None:
    """Remove the weight files a previous export to ``folder`` may have left that this one might not rewrite."""
    for name in (SINGLE_FILE, INDEX_FILE, MTP_SHARD):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            os.remove(path)


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
