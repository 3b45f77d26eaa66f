"""Building the MTP modules (``configure_model``, idempotent for DeepSpeed ZeRO-3) and reaching each depth's head."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.heads import build_mtp_modules
from lightning_mtp.layers import Linear, RotaryTable
from lightning_mtp.metrics import MTPMetrics
from lightning_mtp.native.module import NativeRotaryPlaceholder
from lightning_mtp.sharded import call_whole, is_zero3_partition


class MTPConstruction:
    """``configure_model`` and the accessors of the built modules."""

    def configure_model(self) -> None:
        """Build the MTP modules once (idempotent), so that DeepSpeed ZeRO-3 can partition them."""
        super().configure_model()
        if self.mtp_modules is not None:
            return
        cfg = self.mtp_config
        embed = self.mtp_token_embedding()
        dim = embed.embedding_dim  # the native modules' width: the trunk's hidden size
        if cfg.layout == "native":
            self._build_native_modules()
        else:
            spec = check_block_spec(self.mtp_block_spec(), type(self).__name__)
            self.mtp_modules = build_mtp_modules(
                cfg.architecture, cfg.depth, spec["dim"], spec["n_heads"], spec["n_kv_heads"], spec["mlp_hidden"],
                spec["eps"],
            )
            self.mtp_rope = RotaryTable(spec["max_positions"], spec["dim"] // spec["n_heads"])
            dim = spec["dim"]
        if not cfg.share_output_head:
            self.mtp_output_heads = nn.ModuleList(
                Linear(dim, self.mtp_vocab_size(), bias=False) for _ in range(cfg.depth)
            )
        if not cfg.share_embedding and cfg.architecture == "cascaded":
            # The cascaded modules' own embedding, starting from the trunk's values (when they are readable).
            self.mtp_embedding = nn.Embedding(embed.num_embeddings, embed.embedding_dim)
            if not is_zero3_partition(embed.weight):
                with torch.no_grad():
                    self.mtp_embedding.weight.copy_(embed.weight)
        if cfg.recompute and any(is_zero3_partition(p) for p in self.mtp_modules.parameters()):
            # ZeRO-3 (inside deepspeed.zero.Init): each MTP module becomes a leaf, whose call gathers all its weights
            # (and again for its backward): recompute reads them directly, inside that call (heads.recomputed_depth)
            from deepspeed.utils import set_z3_leaf_module

            for module in self.mtp_modules:
                set_z3_leaf_module(module, True)
        self.mtp_metrics = MTPMetrics(cfg.depth, self.mtp_vocab_size(), cfg.ignore_index)
        device = embed.weight.device if embed.weight.device.type != "meta" else None
        if device is not None:
            for part in (self.mtp_modules, self.mtp_rope, self.mtp_metrics, self.mtp_output_heads,
                         getattr(self, "mtp_embedding", None)):
                if part is not None:
                    part.to(device)

    def _build_native_modules(self) -> None:
        """``MTPConfig.layout="native"``: the host builds the modules (``mtp_native_modules()``: its own decoder-layer
        class as the block, :mod:`lightning_mtp.native`); RoPE is the host's, applied inside each module."""
        builder = getattr(self, "mtp_native_modules", None)
        if builder is None:
            raise ValueError(
                f"MTPConfig.layout (--model.mtp.layout) = 'native' needs a host with native MTP layers (HFCausalLM on "
                f"a transformers family with num_nextn_predict_layers, e.g. glm4_moe, deepseek_v3); "
                f"{type(self).__name__} has none: use --model.mtp.layout lightning"
            )
        self.mtp_modules = builder()
        self.mtp_rope = NativeRotaryPlaceholder()

    def mtp_draft_embedding(self) -> nn.Embedding:
        """Embedding of the cascaded modules' input tokens: the host's own unless ``share_embedding=False``."""
        own = getattr(self, "mtp_embedding", None)
        return own if own is not None else self.mtp_token_embedding()

    def require_mtp_modules(self) -> nn.ModuleList:
        """The MTP modules, built first (``configure_model``) if they are not yet."""
        if self.mtp_modules is None:
            self.configure_model()
        return self.mtp_modules

    def mtp_check_dtypes(self, caller: str) -> None:
        """Refuse MTP modules whose weights are of another dtype than the output head's (heads cast to float32 over a
        bfloat16 trunk): the loss and the drafter's caches failed inside torch with "expected m1 and m2 to have the
        same dtype". (A few tensors kept wider on purpose, such as MoE routers, do not decide.)"""
        head = self.mtp_output_head().weight.dtype
        modules = dominant_dtype(self.require_mtp_modules().parameters()) or head
        if modules != head:
            raise ValueError(f"{caller}: the MTP modules' weights are {modules} but the model's output head is {head}: "
                             f"cast the whole model to one dtype (model.to({head})), or let the trainer's precision "
                             "do it")

    # ----------------------------------------------------------------- forward
    def mtp_depth_head_weight(self, depth: int) -> Tensor:
        """(V, H) output weight used by ``depth`` (0 = the trunk's own head)."""
        if depth == 0 or self.mtp_output_heads is None:
            return self.mtp_output_head().weight
        return self.mtp_output_heads[depth - 1].weight

    def mtp_depth_head(self, depth: int) -> nn.Module:
        """The output head module of ``depth`` (0 = the trunk's own head); call it rather than read its weight."""
        if depth == 0 or self.mtp_output_heads is None:
            return self.mtp_output_head()
        return self.mtp_output_heads[depth - 1]

    def mtp_depth_logits(self, depth: int, hidden: Tensor) -> Tensor:
        """Logits of depth k ≥ 1 from its pre-norm hidden state (B, T, H) -> (B, T, V), transformed as the host's.

        The depth's output norm is called outside its module's call: with whole weights where the module is sharded
        (ZeRO-3, FSDP2; :func:`~lightning_mtp.sharded.call_whole`, a collective)."""
        normed = call_whole(self.mtp_modules[depth - 1].norm, hidden)
        return self.mtp_logit_transform()(self.mtp_depth_head(depth)(normed))


def check_block_spec(spec: dict, host: str) -> dict:
    """Refuse an MTP block shape that cannot be built (``num_heads`` not dividing the width, odd RoPE head size)."""
    dim, n_heads, n_kv = spec["dim"], spec["n_heads"], spec.get("n_kv_heads")
    if dim % n_heads:
        raise ValueError(
            f"MTPConfig.num_heads (--model.init_args.mtp.num_heads) = {n_heads} does not divide the hidden size "
            f"{dim} of {host}: pick a divisor of {dim}, or leave it unset to use the host's attention heads"
        )
    if (dim // n_heads) % 2:
        raise ValueError(
            f"MTPConfig.num_heads (--model.init_args.mtp.num_heads) = {n_heads} gives {host}'s MTP blocks a head size "
            f"of {dim // n_heads}, which must be even for rotary position embeddings"
        )
    if n_kv is not None and n_heads % n_kv:
        raise ValueError(f"{host}: the MTP blocks' {n_kv} key/value heads must divide their {n_heads} heads")
    return spec


def dominant_dtype(tensors: Iterable[Any]) -> Optional[torch.dtype]:
    """The floating dtype that holds most of the elements of ``tensors`` (a few tensors kept wider on purpose, such
    as MoE routers in float32, do not decide); ``None`` when there is none.

    Example::

        >>> dominant_dtype([torch.zeros(8, dtype=torch.bfloat16), torch.zeros(2), torch.zeros(3, dtype=torch.long)])
        torch.bfloat16
    """
    sizes: dict[torch.dtype, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return max(sizes, key=sizes.get, default=None)
