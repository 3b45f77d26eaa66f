"""Building a native MTP stack for a ``transformers`` trunk.

Example::

    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> trunk = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", vocab_size=64, hidden_size=32,
    ...     intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    ...     n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
    ...     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
    >>> [type(m.block.mlp).__name__ for m in build_native_modules(trunk, depth=2)]
    ['DeepseekV3MoE', 'DeepseekV3MoE']
"""

from __future__ import annotations

import re

import torch
from torch import nn

from lightning_mtp.native.family import block_class, mtp_block_config, norm_class
from lightning_mtp.native.module import NativeMTPModule


def build_native_modules(trunk: nn.Module, depth: int) -> nn.ModuleList:
    """``depth`` :class:`NativeMTPModule` s for ``trunk`` (index k-1 holding depth k), freshly initialised the way
    ``transformers`` initialises the trunk's own layers (``_init_weights``), on the trunk's device."""
    config = mtp_block_config(trunk.config, depth)
    layer_class, norm = block_class(trunk), norm_class(trunk)
    rotary = getattr(trunk.get_decoder(), "rotary_emb", None)
    hidden_first = bool(getattr(config, "mtp_hidden_states_first", False))
    eps = getattr(config, "rms_norm_eps", 1e-6)
    modules = nn.ModuleList(
        NativeMTPModule(layer_class(config, k), norm, config.hidden_size, eps, k + 1, rotary, hidden_first)
        for k in range(depth)
    )
    if hasattr(trunk, "_init_weights"):
        with torch.no_grad():
            modules.apply(trunk._init_weights)
    device = trunk.get_input_embeddings().weight.device
    return modules.to(device) if device.type != "meta" else modules


def keep_fp32(trunk: nn.Module, modules: nn.Module) -> None:
    """Put back in fp32 what the family keeps in fp32 whatever the model's dtype (``_keep_in_fp32_modules_strict``:
    the MoE router's weight and score-correction bias), after a cast of ``modules``."""
    names = list(getattr(trunk, "_keep_in_fp32_modules_strict", None) or [])
    names += list(getattr(trunk, "_keep_in_fp32_modules", None) or [])
    if not names:
        return
    pattern = re.compile("|".join(rf"(^|\.){re.escape(n)}($|\.)" for n in names))
    for name, tensor in [*modules.named_parameters(), *modules.named_buffers()]:
        if pattern.search(name) and tensor.is_floating_point() and tensor.dtype != torch.float32:
            tensor.data = tensor.data.float()
