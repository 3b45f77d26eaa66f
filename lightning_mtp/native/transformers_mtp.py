"""What ``transformers`` needs to find a folder's MTP layers, and the folder's MTP tensors on disk.

``generate(use_mtp=True)`` builds ``MtpModel.from_pretrained(main_model)`` on every call
(``generation/candidate_generator.py``, ``MTPCandidateGenerator.__init__``), which reads the MTP tensors from
``main_model.config.name_or_path`` -- the folder, not the weights in memory -- selecting them with the patterns of
the class's *static* ``_keys_to_ignore_on_load_unexpected`` whose layer number is >= ``num_hidden_layers``
(``MtpModel.get_mtp_weights_regex``, ``modeling_layers.py``). Those patterns name the released layer counts only
(``Glm4MoePreTrainedModel``: ``model.layers.46`` / ``92``; ``DeepseekV3PreTrainedModel``: ``model.layers.61``), so a
model with another depth finds no MTP tensor and ``generate`` fails with "weights are missing". The lookup reads the
attribute through the instance, so :func:`register_mtp_patterns` on the loaded model fixes it.

Example::

    model = AutoModelForCausalLM.from_pretrained("exported")
    register_mtp_patterns(model)       # only needed when the layer count is not a released one
    model.generate(ids, do_sample=False, use_mtp=True)
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

from torch import nn

from lightning_mtp.native.family import native_layer_count

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def mtp_pattern(layer: int) -> str:
    """The ``_keys_to_ignore_on_load_unexpected`` pattern of checkpoint layer ``layer`` (``model\\.layers\\.N\\..*``;
    the dot after N keeps layer 2 from matching layer 20)."""
    return rf"model\.layers\.{layer}\..*"


def register_mtp_patterns(model: nn.Module, layers: Optional[int] = None) -> list[str]:
    """Add the patterns of MTP layers ``N .. N+layers-1`` to ``model``'s own ``_keys_to_ignore_on_load_unexpected``
    (an instance attribute: the class's list is left alone), so that ``generate(use_mtp=True)`` finds them.

    ``layers`` defaults to the config's ``num_nextn_predict_layers``. Returns the patterns added.
    """
    layers = native_layer_count(model.config) if layers is None else layers
    if not layers:
        raise ValueError(f"{type(model).__name__}'s config declares no MTP layers (num_nextn_predict_layers)")
    trunk_layers = model.config.get_text_config().num_hidden_layers
    own = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    added = [mtp_pattern(trunk_layers + k) for k in range(layers) if mtp_pattern(trunk_layers + k) not in own]
    model._keys_to_ignore_on_load_unexpected = own + added
    return added


def finds_mtp_layers(model: nn.Module, layers: int) -> bool:
    """Whether ``transformers`` would find MTP layers ``N .. N+layers-1`` of ``model``'s checkpoint with the patterns
    it has now (the class's, plus any :func:`register_mtp_patterns` added)."""
    trunk_layers = model.config.get_text_config().num_hidden_layers
    patterns = [p for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
                if (m := re.search(r"\.(\d+)", p)) is None or int(m.group(1)) >= trunk_layers]
    return all(any(re.search(p, f"model.layers.{trunk_layers + k}.enorm.weight") for p in patterns)
               for k in range(layers))


def checkpoint_files(folder: str) -> dict[str, str]:
    """Checkpoint key -> safetensors file of a ``save_pretrained`` folder (single file or sharded index)."""
    from safetensors import safe_open

    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        return {key: os.path.join(folder, name) for key, name in weight_map.items()}
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(single):
        raise ValueError(f"{folder} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); native MTP layers "
                         "are read from safetensors only")
    with safe_open(single, framework="pt") as handle:
        return {key: single for key in handle.keys()}


def tensor_shapes(files: dict[str, str], keys: list[str]) -> dict[str, tuple[int, ...]]:
    """Shapes of ``keys`` (present ones) without reading the tensors."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[str, list[str]] = {}
    for key in keys:
        if key in files:
            by_file.setdefault(files[key], []).append(key)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for name in names:
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
