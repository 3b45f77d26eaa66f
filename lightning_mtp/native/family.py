"""Which ``transformers`` model families have native MTP layers, and what their MTP blocks are built from.

A family has native MTP when its config declares ``num_mtp_layers`` (``num_nextn_predict_layers`` in the
checkpoints' ``config.json``, an alias: ``Glm4MoeConfig.attribute_map``, ``DeepseekV3Config.attribute_map``). Its
MTP block is the family's own decoder-layer class, built from the MTP config (``PreTrainedConfig.get_mtp_config``:
``num_hidden_layers`` = the MTP layer count and ``first_k_dense_replace`` = 0, so the block is a mixture-of-experts
layer wherever the family has one), with layer index k for MTP layer k.

Example::

    >>> from transformers import AutoConfig
    >>> native_layer_count(AutoConfig.for_model("glm4_moe", num_nextn_predict_layers=2))
    2
    >>> native_layer_count(AutoConfig.for_model("llama")) is None
    True
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn


def native_layer_count(config: Any) -> Optional[int]:
    """MTP layers the family's config declares (``num_mtp_layers`` / ``num_nextn_predict_layers``); ``None`` when the
    family has no native MTP."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("num_mtp_layers", "num_nextn_predict_layers"):
        value = getattr(text, name, None)
        if value is not None:
            return int(value)
    return None


def has_native_mtp(model: nn.Module) -> bool:
    """Whether ``model`` (a ``*ForCausalLM``) belongs to a family with native MTP layers."""
    return native_layer_count(model.config) is not None


VERIFIED_FAMILIES = ("glm4_moe", "deepseek_v3")
"""Families whose native layout is tested against ``transformers``' ``MtpModel`` (``tests/test_native_mtp.py``)."""


def native_support_problem(model: nn.Module) -> Optional[str]:
    """Why lightning-mtp cannot run ``model``'s native MTP layers (``None``: it can).

    Our native module is DeepSeek-V3's layer: a per-layer ``post_norm``, full attention over its own positions
    (the drafting cache is positional), RoPE from the trunk. Families that chain through one shared norm
    (``chain_hidden_post_norm``), give their MTP layers other attention kinds (``mtp_layer_types``: sliding windows,
    linear attention) or have no rotary embedding are not supported.
    """
    if not has_native_mtp(model):
        return "its config has no num_nextn_predict_layers"
    config = model.config.get_text_config()
    if hasattr(config, "chain_hidden_post_norm"):
        return "its MTP layers chain through a shared norm (chain_hidden_post_norm)"
    kinds = set(getattr(config, "mtp_layer_types", None) or [])
    if kinds - {"full_attention"}:
        return f"its MTP layers use attention kinds {sorted(kinds - {'full_attention'})}"
    if getattr(model.get_decoder(), "rotary_emb", None) is None:
        return "it has no rotary embedding"
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The trunk's decoder layers (``model.model.layers`` for the families with native MTP)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(f"{type(model).__name__} has no decoder layers (get_decoder().layers) to build native MTP "
                        "blocks from")
    return layers


def block_class(model: nn.Module) -> type:
    """The decoder-layer class of the trunk: the class of every native MTP block."""
    return type(decoder_layers(model)[-1])


def norm_class(model: nn.Module) -> type:
    """The trunk's RMSNorm class (its last layer's ``input_layernorm``): that of ``enorm``/``hnorm``/``post_norm``."""
    layer = decoder_layers(model)[-1]
    norm = getattr(layer, "input_layernorm", None)
    if norm is None:
        norm = next((m for name, m in layer.named_modules() if name.endswith("norm")), None)
    if norm is None:
        raise TypeError(f"{type(layer).__name__} has no norm module to build native MTP norms from")
    return type(norm)


def mtp_block_config(config: Any, layers: int) -> Any:
    """The config that native MTP blocks are built from, for ``layers`` MTP layers.

    ``transformers``' own ``get_mtp_config`` on a copy whose ``num_mtp_layers`` is ``layers`` (our depth may exceed the
    checkpoint's count), so our blocks are what ``MtpModel`` builds: same MoE-vs-dense choice, same attention kind.
    """
    text = copy.deepcopy(config.get_text_config())
    text.num_mtp_layers = layers
    mtp = text.get_mtp_config()
    mtp._attn_implementation = config.get_text_config()._attn_implementation  # the trunk's kernel (eager / sdpa)
    return mtp


def checkpoint_prefix(trunk_layers: int, index: int) -> str:
    """Checkpoint key prefix of MTP layer ``index`` (0-based) after ``trunk_layers`` main layers."""
    return f"model.layers.{trunk_layers + index}."


def resolve_layout(mtp: Any, trunk: nn.Module) -> Any:
    """``MTPConfig`` with ``layout`` decided for a ``transformers`` trunk: an explicit layout stays (``"native"`` is
    checked against the family, :func:`native_support_problem`); unset, a family with native MTP layers we can run
    gets ``"native"`` (a setting the native layout cannot have, ``parallel`` or ``num_heads``, is refused: fresh
    lightning heads would leave the folder's trained layers unused without a word), everything else ``"lightning"``."""
    import dataclasses

    problem = native_support_problem(trunk)
    native = problem is None
    if mtp.layout == "native" and not native:
        raise ValueError(
            f"MTPConfig.layout (--model.mtp.layout) = 'native' needs a transformers family with native MTP layers "
            f"of DeepSeek-V3's kind (e.g. {', '.join(VERIFIED_FAMILIES)}); {type(trunk).__name__} (model_type "
            f"{trunk.config.model_type!r}) cannot: {problem}. Use --model.mtp.layout lightning"
        )
    if mtp.layout is not None:
        return mtp
    if native:
        try:
            return dataclasses.replace(mtp, layout="native")  # __post_init__ runs check_native
        except ValueError as error:  # a family whose folder holds MTP layers: never dropped for fresh heads unasked
            raise ValueError(f"{error} ({trunk.config.model_type!r} has native MTP layers, so the layout is 'native' "
                             "unless --model.mtp.layout lightning asks for lightning-mtp's heads, which start fresh "
                             "and leave the folder's MTP layers unused)") from None
    return dataclasses.replace(mtp, layout="lightning")
