"""The bundled host: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, optional GQA) with MTP heads and a KV cache.

Example::

    >>> import torch
    >>> from lightning_mtp import MTPConfig
    >>> from lightning_mtp.models import CausalLM, ModelConfig
    >>> model = CausalLM(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4), MTPConfig(depth=2))
    >>> model.configure_model()
    >>> out = model.compute_lm_loss(torch.randint(0, 64, (2, 16)))
    >>> out.depth_losses.shape
    torch.Size([2])
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass
from typing import Optional, Union

import lightning as L
import torch
from torch import Tensor, nn

from lightning_mtp import checkpointing
from lightning_mtp.config import MTPConfig, settings_from
from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.tree import MAX_DRAFT_DEPTH
from lightning_mtp.finite import is_finite_number
from lightning_mtp.layers import (
    Block,
    KVCache,
    Linear,
    RMSNorm,
    RotaryTable,
    attention_width,
    document_mask,
    mlp_hidden_size,
    visible_slots,
)
from lightning_mtp.mixin import MTPMixin, check_block_spec
from lightning_mtp.optim import adamw_warmup_cosine, check_optimizer_args, estimated_total_steps


@dataclass
class ModelConfig:
    """Size of the bundled decoder. The defaults give about 6M parameters (plus the MTP modules)."""

    vocab_size: int = 4096
    """Output vocabulary; must be ≥ the tokenizer's (--data.vocab_size)."""
    dim: int = 256
    """Hidden size H."""
    n_layers: int = 6
    """Transformer blocks of the trunk."""
    n_heads: int = 4
    """Attention heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (default: ``n_heads``, i.e. multi-head attention)."""
    mlp_ratio: float = 8 / 3
    """SwiGLU width as a multiple of ``dim``."""
    max_seq_len: int = 1024
    """Context length (RoPE table and largest KV cache)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_base: float = 10000.0
    """RoPE frequency base."""
    tie_embeddings: bool = True
    """Share the token embedding and the output head (one weight)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} (--model.model.{name}) must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelConfig.dim={self.dim} (--model.model.dim) must be divisible by n_heads={self.n_heads}"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} (--model.model.n_kv_heads) must divide "
                f"n_heads={self.n_heads}"
            )
        for name in ("mlp_ratio", "norm_eps", "rope_base"):
            value = getattr(self, name)
            if not (is_finite_number(value) and value > 0):
                raise ValueError(f"ModelConfig.{name} (--model.model.{name}) must be a finite number > 0, "
                                 f"got {value!r}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head size dim/n_heads = {self.dim // self.n_heads} must be even for RoPE")


class CausalLM(MTPMixin, L.LightningModule):
    """Llama-style decoder-only LM trained with next-token + MTP loss.

    Args:
        model: decoder size.
        mtp: the MTP heads and loss.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW decoupled weight decay on matrices (not on norms or embeddings).
        warmup_steps: linear warmup, then cosine decay to 10% over the run.
        init_from: a checkpoint whose weights start this fit (MTP heads of another depth are reported and
            reinitialised); unlike ``--ckpt_path`` it does not resume optimizer or loop state.
        generation: how ``predict_step`` decodes (``lightning-mtp predict``).
    """

    def __init__(
        self,
        model: Optional[ModelConfig] = None,
        mtp: Optional[MTPConfig] = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        init_from: Optional[str] = None,
        generation: Optional[GenerationConfig] = None,
    ) -> None:
        model = settings_from(ModelConfig, model, "--model.init_args.model") or ModelConfig()
        super().__init__(mtp=mtp)
        check_optimizer_args(learning_rate, weight_decay, warmup_steps)
        self.model_config = model
        self.learning_rate, self.weight_decay, self.warmup_steps = learning_rate, weight_decay, warmup_steps
        if init_from is not None and not os.path.isfile(init_from):
            raise ValueError(f"--model.init_args.init_from {init_from!r}: no such checkpoint file")
        self.init_from = init_from
        check_block_spec(self.mtp_block_spec(), type(self).__name__)
        generation = settings_from(GenerationConfig, generation, "--model.init_args.generation")
        self.generation_config = generation or GenerationConfig()
        self.mtp_generate_kwargs = self.generation_config.to_kwargs()
        # Plain types only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters({
            "model": asdict(model), "mtp": asdict(self.mtp_config), "learning_rate": learning_rate,
            "weight_decay": weight_decay, "warmup_steps": warmup_steps, "init_from": init_from,
            "generation": asdict(self.generation_config),
        })
        self.embed: Optional[nn.Embedding] = None

    # ----------------------------------------------------------------- construction
    def configure_model(self) -> None:
        if self.embed is None:
            cfg = self.model_config
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            hidden = mlp_hidden_size(cfg.dim, cfg.mlp_ratio)
            self.layers = nn.ModuleList(
                Block(cfg.dim, cfg.n_heads, cfg.n_kv_heads, hidden, cfg.norm_eps) for _ in range(cfg.n_layers)
            )
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                # One weight for input and output embeddings (Press & Wolf 2017, https://arxiv.org/abs/1608.05859).
                self.lm_head.weight = self.embed.weight
            positions = cfg.max_seq_len + max(self.mtp_config.depth, MAX_DRAFT_DEPTH) + 1  # + verify/draft depth
            self.rope = RotaryTable(positions, cfg.dim // cfg.n_heads, cfg.rope_base)
            self._init_weights([self.embed, self.layers, self.norm, self.lm_head])
        built_mtp = self.mtp_modules is None
        super().configure_model()
        if built_mtp:
            self._init_weights([self.mtp_modules] + ([self.mtp_output_heads] if self.mtp_output_heads else []))
            if self.init_from and self._trainer is not None:  # a fit, not load_from_checkpoint
                self.mtp_load_report = checkpointing.load_weights(self, self.init_from)
        self.mtp_shard_under_model_parallel()  # FSDP2 units (blocks, MTP modules, root) under ModelParallelStrategy

    def _init_weights(self, modules: list[nn.Module]) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 · n_layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.model_config.n_layers)
        for root in modules:
            for name, module in root.named_modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    std = residual_std if name.endswith(("proj", "down")) and not name.endswith("eh_proj") else 0.02
                    with gathered_for_init(module.weight):
                        nn.init.normal_(module.weight, mean=0.0, std=std)

    def _ensure_built(self) -> None:
        if self.embed is None or self.mtp_modules is None:
            self.configure_model()

    # ----------------------------------------------------------------- what MTPMixin needs
    def mtp_token_embedding(self) -> nn.Embedding:
        return self.embed

    def mtp_output_head(self) -> nn.Linear:
        return self.lm_head

    def mtp_final_norm(self) -> nn.Module:
        return self.norm

    def mtp_trunk_blocks(self) -> list[nn.Module]:
        """The FSDP2 units of the trunk: its transformer blocks."""
        self._ensure_built()
        return list(self.layers)

    def mtp_trunk_hidden_states(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward` in training: causal, or packed documents kept apart when ``position_ids`` are given."""
        return self(input_ids, position_ids)

    def mtp_block_spec(self) -> dict:
        cfg = self.model_config
        return dict(
            dim=cfg.dim,
            n_heads=self.mtp_config.num_heads or cfg.n_heads,
            n_kv_heads=None if self.mtp_config.num_heads else cfg.n_kv_heads,
            mlp_hidden=mlp_hidden_size(cfg.dim, self.mtp_config.mlp_ratio or cfg.mlp_ratio),
            eps=cfg.norm_eps,
            max_positions=cfg.max_seq_len + max(self.mtp_config.depth, MAX_DRAFT_DEPTH) + 1,
        )

    def mtp_vocab_size(self) -> int:
        return self.model_config.vocab_size

    def mtp_max_sequence_length(self) -> int:
        return self.model_config.max_seq_len

    def mtp_context_flag(self) -> str:
        return "--model.init_args.model.max_seq_len"

    def mtp_vocab_flag(self) -> str:
        return "--model.init_args.model.vocab_size"

    # ----------------------------------------------------------------- trunk
    def forward(
        self,
        input_ids: Tensor,
        positions: Optional[Tensor] = None,
        caches: Optional[list[KVCache]] = None,
        slots: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Trunk's last hidden state (B, T, H), before the final norm.

        Training: ``caches`` is ``None``; without ``positions`` attention is causal over each row. Packed rows:
        ``positions`` (B, T) are each token's position within its document (restarting at 0 at each document's first
        token, ``transformers``' ``position_ids``): RoPE runs at them and attention is block-diagonal causal, no token
        seeing another document (:func:`~lightning_mtp.layers.document_mask`, built here unless ``mask`` is given).
        Decoding:
        ``positions`` (B, T) are each token's position (rotary embedding, and by default its cache slot), ``caches``
        one :class:`KVCache` per layer. Tree verification writes the tokens at other cache ``slots`` (B, T) and passes
        the ``mask`` (B, 1, T, W) of the slots each token sees among the first W (its ancestors;
        :mod:`lightning_mtp.decoding.tree`); attention reads those W slots only (:func:`attention_width`).
        """
        self._ensure_built()
        # Cached decoding validates its prompts once (decoding.generate) and feeds back only the model's own tokens,
        # so the per-step forwards skip this check (two host syncs per forward).
        if caches is None and input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= self.model_config.vocab_size
        ):
            raise ValueError(
                f"token ids must lie in [0, {self.model_config.vocab_size}), got range "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )
        cos, sin = self.rope(input_ids.shape[1], positions)
        if caches is not None and mask is None:
            mask = visible_slots(positions, attention_width(positions, caches[0].max_len))  # (B, 1, T, W), all layers
        elif caches is None and positions is not None and mask is None:
            mask = document_mask(positions)  # (B, 1, T, T), packed documents, all layers
        slots = positions if slots is None else slots
        x = self.embed(input_ids)  # (B, T, H)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, slots, None if caches is None else caches[i], mask=mask)
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits (B, T, V) from trunk hidden states."""
        return self.lm_head(self.norm(hidden))

    def allocate_kv_caches(self, batch_size: int, max_len: int, dtype: Optional[torch.dtype] = None) -> list[KVCache]:
        """One static cache per trunk layer, ``max_len`` slots each."""
        self._ensure_built()
        cfg = self.model_config
        n_kv = cfg.n_kv_heads or cfg.n_heads
        dtype = dtype or self.embed.weight.dtype
        return [
            KVCache(batch_size, max_len, n_kv, cfg.dim // cfg.n_heads, device=self.embed.weight.device, dtype=dtype)
            for _ in range(cfg.n_layers)
        ]

    @property
    def max_context(self) -> int:
        return self.model_config.max_seq_len

    # ----------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.learning_rate, self.weight_decay, self.warmup_steps,
                                   estimated_total_steps(self))


def gathered_for_init(weight: Tensor):
    """Under DeepSpeed ZeRO-3 (``deepspeed.zero.Init``), the whole weight, initialised on rank 0 and re-partitioned."""
    if not hasattr(weight, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight], modifier_rank=0)


def load_causal_lm(path: str, **overrides: Union[MTPConfig, dict]) -> CausalLM:
    """Load a ``CausalLM`` checkpoint with ``weights_only=True``; ``overrides`` replace saved init arguments."""
    return CausalLM.load_from_checkpoint(path, map_location="cpu", weights_only=True, **overrides)
