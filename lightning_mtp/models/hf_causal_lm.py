"""``HFCausalLM``: any Hugging Face ``transformers`` causal LM as an MTP host.

The trunk is a ``*ForCausalLM`` built from a config (``model_type`` + keyword arguments, or a config dict from YAML)
or loaded from a *local* directory with ``from_pretrained`` (nothing is fetched from a hub). The MTP modules share
the model's ``get_input_embeddings()`` and ``get_output_embeddings()``; decoding uses the model's own ``DynamicCache``
through :class:`~lightning_mtp.models.hf_host.HFCacheHost`.

Which hidden state the MTP modules read: ``transformers`` base models return ``last_hidden_state`` *after* their
final norm (``LlamaModel.norm``, ``GPT2Model.ln_f``, ...), and the same holds for ``output_hidden_states[-1]``. We use
that output as the trunk state h_0 and report ``mtp_final_norm()`` = identity, so the next-token loss is
``lm_head(h_0)`` exactly as the model computes it, and ``MTPMixin``'s contract ("pre-final-norm state + final norm =
what the head reads") holds for every architecture without locating the norm module or hooking into it. The MTP
modules normalise h_0 again (DeepSeek-V3's ``hnorm``); an RMSNorm of an already-normalised state is harmless.

What the model's forward does to ``lm_head``'s output (Cohere multiplies by ``logit_scale``, Granite divides by
``logits_scaling``, Gemma-2 soft-caps with ``final_logit_softcapping``, ...) is read from
:data:`~lightning_mtp.models.hf_trunk.LOGIT_TRANSFORMS` (:func:`~lightning_mtp.models.hf_trunk.logit_transform_of`)
and applied to every depth's logits, in the fused loss and in decoding, so the main loss equals the model's own
``loss``. Models that transform their logits in a way we cannot reproduce are refused.

Example::

    >>> import torch
    >>> from lightning_mtp import MTPConfig
    >>> from lightning_mtp.models import HFCausalLM
    >>> model = HFCausalLM("llama", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                    num_attention_heads=4, max_position_embeddings=128), mtp=MTPConfig(depth=2))
    >>> model.configure_model()
    >>> model.compute_lm_loss(torch.randint(0, 64, (2, 16))).depth_losses.shape
    torch.Size([2])

Packed batches (``position_ids`` restarting at each document): the ids go to the model with no attention mask, and
``transformers``' ``masking_utils`` turn them into block-diagonal causal masks; a model whose modeling code does not
build its mask that way is refused with the flag to turn packing off (:func:`packing_support_problem`).

Native MTP layers (issue #14): for families released with MTP layers (a config with ``num_nextn_predict_layers``:
glm4_moe, deepseek_v3) ``MTPConfig.layout`` defaults to ``"native"`` -- the MTP blocks are the model's own decoder
layers with the checkpoints' semantics (:mod:`lightning_mtp.native`). ``HFCausalLM(pretrained=DIR)`` then imports the
folder's MTP layers (``mtp_native_report`` says which), depths beyond them start fresh, and
:meth:`HFCausalLM.save_pretrained` writes a folder that ``transformers``' ``generate(use_mtp=True)`` decodes with.

Retrofit (Medusa-1 style): ``HFCausalLM(pretrained="path/to/dir", freeze_trunk=True)`` freezes the trunk, detaches
the MTP loss from it, trains only the heads, and its checkpoints (and :meth:`HFCausalLM.save_mtp_heads`) hold only the
MTP weights and metadata; ``HFCausalLM(pretrained=..., mtp_heads="heads.pt")`` restores them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_mtp import checkpoint_files, checkpointing
from lightning_mtp.config import MTPConfig, settings_from
from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.fsdp import transformers_decoder_layers
from lightning_mtp.layers import mlp_hidden_size
from lightning_mtp.loss import LogitTransform
from lightning_mtp.mixin import MTPMixin, check_block_spec
from lightning_mtp.models.hf_host import HFCacheHost, new_rollbackable_cache
from lightning_mtp.models.hf_trunk import (
    build_trunk,
    check_trunk,
    context_length,
    logit_transform_of,
    packing_support_problem,
    plain_config,
    trunk_summary,
    weights_fingerprint,
)
from lightning_mtp.native import build_native_modules, keep_fp32
from lightning_mtp.native.checkpoint import NativeImportReport, import_native_layers, refuse_other_layout
from lightning_mtp.native.export import export_native
from lightning_mtp.native.family import resolve_layout
from lightning_mtp.optim import adamw_warmup_cosine, check_optimizer_args, estimated_total_steps
from lightning_mtp.sharded import is_dtensor

TRUNK_PREFIX = "trunk."
HEADS_ONLY_KEY = checkpoint_files.HEADS_ONLY_KEY

class HFCausalLM(MTPMixin, L.LightningModule):
    """A ``transformers`` causal LM trained with next-token + MTP loss, decoded self-speculatively.

    Args:
        model_type: ``transformers`` model type (``"llama"``, ``"qwen2"``, ``"gpt2"``, ...) for a fresh trunk.
        config: keyword arguments of that model type's config (may also carry ``model_type``).
        pretrained: a local directory written by ``save_pretrained``; the trunk's weights come from it, and with
            ``mtp.layout="native"`` the MTP layers it holds (``model.layers.{N+k}.*``) too.
        mtp: the MTP heads and loss.
        freeze_trunk: train only the MTP modules (retrofit): the trunk's parameters (shared embedding and head
            included) get no gradient, the trunk stays in eval mode, ``mtp.detach_trunk`` is forced on, and
            checkpoints hold only the MTP weights (see ``save_trunk``).
        save_trunk: keep the trunk's weights in Lightning checkpoints (default: ``not freeze_trunk``, and always
            when there is no ``pretrained`` folder to take them from again: a wrapped or config-built trunk);
            ``False`` only with ``freeze_trunk`` (a trunk that trains must be kept).
        mtp_heads: a heads-only checkpoint (:meth:`save_mtp_heads`, or a fit with ``freeze_trunk``) loaded into the
            MTP modules when they are built.
        init_from: a checkpoint of a fit (full, or heads-only over the same ``pretrained`` trunk) whose weights start
            this fit; unlike ``--ckpt_path`` it does not resume optimizer or loop state, so the learning rate,
            schedule and steps may change.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW decoupled weight decay on matrices (not on norms, biases or embeddings).
        warmup_steps: linear warmup, then cosine decay to 10% over the run.
        attn_implementation: passed to ``transformers`` (``"sdpa"``, ``"eager"``; ``None``: its default).
        generation: how ``predict_step`` decodes.
        trunk: Python only: an already-built ``*ForCausalLM`` to wrap (instead of the three trunk arguments).
    """

    def __init__(
        self,
        model_type: Optional[str] = None,
        config: Optional[dict] = None,
        pretrained: Optional[str] = None,
        mtp: Union[MTPConfig, dict, None] = None,
        freeze_trunk: bool = False,
        save_trunk: Optional[bool] = None,
        mtp_heads: Optional[str] = None,
        init_from: Optional[str] = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        attn_implementation: Optional[str] = None,
        generation: Union[GenerationConfig, dict, None] = None,
        trunk: Optional[nn.Module] = None,
    ) -> None:
        mtp = settings_from(MTPConfig, mtp, "--model.init_args.mtp") or MTPConfig()
        if freeze_trunk and not mtp.detach_trunk:
            mtp = dataclasses.replace(mtp, detach_trunk=True)  # a frozen trunk must not receive the MTP gradient
        check_optimizer_args(learning_rate, weight_decay, warmup_steps)
        if trunk is None:
            trunk = build_trunk(model_type, config, pretrained, attn_implementation)
        check_trunk(trunk)
        mtp = resolve_layout(mtp, trunk)  # native for families released with MTP layers, unless asked otherwise
        super().__init__(mtp=mtp)
        self._logit_transform = logit_transform_of(trunk)  # refuses logit transforms we cannot reproduce
        self.trunk = trunk
        self.pretrained = pretrained
        # what a heads-only checkpoint's trunk must be: its weights as loaded or wrapped now (trunk_summary)
        self._trunk_weights = _whole_weights_fingerprint(trunk)
        self.mtp_native_report: Optional[NativeImportReport] = None
        if self.mtp_config.layout != "native":
            check_block_spec(self.mtp_block_spec(), type(self).__name__)  # before training, naming the flag
        self.freeze_trunk = freeze_trunk
        # a heads-only checkpoint takes its trunk from the folder again; without one it would get random weights
        self.save_trunk = (not freeze_trunk or pretrained is None) if save_trunk is None else save_trunk
        if not self.save_trunk and not freeze_trunk:
            raise ValueError("HFCausalLM: --model.init_args.save_trunk false leaves the trunk out of checkpoints, but "
                             "--model.init_args.freeze_trunk is false: the trunk trains, and a resumed fit, predict "
                             "and the heads would all start from its untrained weights again. Set freeze_trunk true "
                             "to train the MTP heads alone, or keep the trunk in checkpoints (save_trunk null)")
        self.mtp_heads = mtp_heads
        if init_from is not None and not os.path.exists(init_from):
            raise ValueError(f"--model.init_args.init_from {init_from!r}: no such checkpoint file")
        self.init_from = init_from
        self.learning_rate, self.weight_decay, self.warmup_steps = learning_rate, weight_decay, warmup_steps
        generation = settings_from(GenerationConfig, generation, "--model.init_args.generation")
        self.generation_config = generation or GenerationConfig()
        self.mtp_generate_kwargs = self.generation_config.to_kwargs()
        if freeze_trunk:
            self.trunk.requires_grad_(False)
            self.trunk.eval()
        else:
            self.trunk.train()  # from_pretrained returns it in eval mode; a module starts in train mode
        # Plain types only (checkpoints load with weights_only=True). A wrapped or pretrained trunk is described by
        # its config, so load_from_checkpoint rebuilds the architecture and the state dict fills the weights.
        if pretrained is None:
            model_type, config = trunk.config.model_type, plain_config(trunk.config)
        self.save_hyperparameters({
            "model_type": model_type, "config": config, "mtp": asdict(self.mtp_config),
            "pretrained": os.path.abspath(pretrained) if pretrained else None,  # found from any working folder
            "freeze_trunk": freeze_trunk, "save_trunk": save_trunk, "mtp_heads": mtp_heads, "init_from": init_from,
            "learning_rate": learning_rate, "weight_decay": weight_decay, "warmup_steps": warmup_steps,
            "attn_implementation": attn_implementation, "generation": asdict(self.generation_config),
        })

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs: Any) -> HFCausalLM:
        """Wrap an already-built ``transformers`` ``*ForCausalLM`` (e.g. one just trained)."""
        return cls(trunk=model, **kwargs)

    # ----------------------------------------------------------------- construction
    def configure_model(self) -> None:
        built = self.mtp_modules is None
        super().configure_model()
        if built:
            dtype = self.trunk.get_input_embeddings().weight.dtype
            self.mtp_modules.to(dtype)
            if self.mtp_output_heads is not None:
                self.mtp_output_heads.to(dtype)
            if self.mtp_config.layout == "native":
                keep_fp32(self.trunk, self.mtp_modules)  # the MoE router stays in fp32, as in the trunk
                if self.pretrained is not None:
                    self.mtp_native_report = import_native_layers(self.mtp_modules, self.trunk, self.pretrained)
                    rank_zero_info(self.mtp_native_report.summary())
            if self.mtp_heads:
                self.mtp_load_report = self.load_mtp_heads(self.mtp_heads)
                rank_zero_info(f"MTP weights loaded from --model.init_args.mtp_heads {self.mtp_heads}"
                               + (" (over the model folder's MTP layers)" if self.mtp_native_report else "")
                               + f": {self.mtp_load_report.summary()}")
            if self.init_from and self._trainer is not None:  # a fit, not load_from_checkpoint
                self.mtp_load_report = checkpointing.load_weights(self, self.init_from)
        self.mtp_shard_under_model_parallel()  # FSDP2 units (decoder layers, MTP modules, root) under ModelParallel

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        if self.freeze_trunk:
            self.trunk.eval()  # no dropout in a frozen trunk: the heads learn its inference-time states
        return self

    def mtp_native_modules(self) -> nn.ModuleList:
        """``MTPConfig.layout="native"``: D native MTP layers built from the trunk's own decoder-layer class."""
        return build_native_modules(self.trunk, self.mtp_config.depth)

    def save_pretrained(self, folder: str, serving_copies: bool = True, **save_kwargs: Any) -> str:
        """Write a ``transformers`` folder: the trunk, its config with ``num_nextn_predict_layers`` = D, and the MTP
        layers under ``model.layers.{N+k}.*`` -- loadable with ``AutoModelForCausalLM.from_pretrained`` and decoded
        by ``generate(use_mtp=True)`` (:func:`lightning_mtp.native.export.export_native`, which explains the layer
        count caveat). Only native-layout modules can be written so. ``serving_copies=False`` leaves out each MTP
        layer's copies of the embedding and head (``embed_tokens.weight``, ``shared_head.head.weight``), which
        vLLM's loader needs. ``save_kwargs`` go to the trunk's own ``save_pretrained`` (``max_shard_size``, ...).
        Returns ``folder``."""
        export_native(self, folder, serving_copies=serving_copies, **save_kwargs)
        return folder

    # ----------------------------------------------------------------- what MTPMixin needs
    def mtp_token_embedding(self) -> nn.Embedding:
        return self.trunk.get_input_embeddings()

    def mtp_output_head(self) -> nn.Linear:
        return self.trunk.get_output_embeddings()

    def mtp_trunk_blocks(self) -> list[nn.Module]:
        """The FSDP2 units of the trunk: the model's decoder layers (the classes in its ``_no_split_modules``, as
        ``accelerate`` wraps them), whatever the family."""
        return transformers_decoder_layers(self.trunk)

    def mtp_trunk_hidden_states(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """:meth:`forward`; a packed batch's ``position_ids`` go to the model, which keeps documents apart (no
        attention mask is passed, so ``transformers`` builds a block-diagonal one from them).

        Raises:
            ValueError: ``position_ids`` given and the model cannot use them so (:func:`packing_support_problem`).
        """
        if position_ids is not None:
            self._check_packing()
        return self(input_ids, position_ids=position_ids)

    def _check_packing(self) -> None:
        problem = getattr(self, "_packing_problem", ...)
        if problem is ...:  # the model's code does not change: read it once
            problem = self._packing_problem = packing_support_problem(self.trunk)
        if problem is not None:
            raise ValueError(
                f"packed batches (position_ids) need the model to keep documents apart, but {type(self.trunk).__name__}"
                f" (model_type {self.trunk.config.model_type!r}) cannot: {problem}. Use --data.init_args.packing false"
            )

    def mtp_block_spec(self) -> dict:
        cfg = self.trunk.config.get_text_config()
        dim = cfg.hidden_size
        n_heads = self.mtp_config.num_heads or cfg.num_attention_heads
        n_kv = None if self.mtp_config.num_heads else getattr(cfg, "num_key_value_heads", None)
        if self.mtp_config.mlp_ratio:
            mlp_hidden = mlp_hidden_size(dim, self.mtp_config.mlp_ratio)
        else:  # the trunk's own SwiGLU width where it has one, else the usual 8/3 · H
            mlp_hidden = getattr(cfg, "intermediate_size", None) or mlp_hidden_size(dim, 8 / 3)
        eps = getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_epsilon", None) or 1e-6
        return dict(dim=dim, n_heads=n_heads, n_kv_heads=n_kv, mlp_hidden=mlp_hidden, eps=eps,
                    max_positions=self.max_positions + self.mtp_config.depth + 1)

    def mtp_vocab_size(self) -> int:
        return self.mtp_output_head().out_features

    def mtp_logit_transform(self) -> LogitTransform:
        """The model's own scaling / soft-capping of its LM head's output (:func:`logit_transform_of`)."""
        return self._logit_transform

    def on_fit_start(self) -> None:
        super().on_fit_start()
        try:
            new_rollbackable_cache(self.trunk)
        except TypeError as error:  # the fit is fine; say now what predict will say after it
            rank_zero_warn(f"this model trains, but its decoding (predict, generate) will be refused: {error}")

    def mtp_decoding_host(self) -> HFCacheHost:
        self.require_mtp_modules()
        new_rollbackable_cache(self.trunk)  # refuse non-rollbackable caches before decoding starts
        return HFCacheHost(self.trunk, self.max_context, self.mtp_logit_transform())

    # ----------------------------------------------------------------- trunk
    @property
    def max_positions(self) -> int:
        """The model's context: its config's ``max_position_embeddings`` or a family's own name for it (GPT-2's
        ``n_positions``, MPT's ``max_seq_len``...); 4096 for a model that has none (ALiBi: Bloom)."""
        return context_length(self.trunk.config) or 4096

    def mtp_pad_token_id(self) -> Optional[int]:
        """The checkpoint tokenizer's pad id, else the model's own ``generation_config.pad_token_id``."""
        own = super().mtp_pad_token_id()
        if own is not None:
            return own
        generation = getattr(self.trunk, "generation_config", None)
        return getattr(generation, "pad_token_id", None)

    def mtp_stop_token_ids(self) -> list[int]:
        """The model folder's stop ids (``generation_config.json``'s ``eos_token_id``, one or a list, as
        ``transformers``' ``generate`` reads them); none for a model built from a config, whose defaults name no token
        of its tokenizer."""
        if self.pretrained is None:
            return []
        eos = getattr(getattr(self.trunk, "generation_config", None), "eos_token_id", None)
        return [int(i) for i in ([] if eos is None else [eos] if isinstance(eos, int) else eos)]

    def mtp_max_sequence_length(self) -> int:
        return self.max_positions

    def mtp_context_flag(self) -> str:
        if self.pretrained is not None:  # the folder's own context: not a flag (config is refused with pretrained)
            return f"max_position_embeddings in {self.pretrained}/config.json, fixed by its training"
        return "the transformers config's max_position_embeddings, --model.init_args.config.max_position_embeddings"

    def mtp_vocab_flag(self) -> str:
        if self.pretrained is not None:
            return f"the output embedding of {self.pretrained}: resize it to the tokenizer (resize_token_embeddings)"
        return "--model.init_args.config.vocab_size"

    @property
    def max_context(self) -> int:
        """Prompt + generation budget: verification addresses D positions past it, which must still be valid
        positions for models with learned position embeddings (GPT-2)."""
        return self.max_positions - self.mtp_config.depth

    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None
    ) -> Tensor:
        """The trunk's last hidden state (B, T, H) from the model's own output (after its final norm).

        ``position_ids`` (B, T): a packed batch's positions, passed to the model (with no ``attention_mask``, the
        model's ``masking_utils`` derive block-diagonal causal attention from them)."""
        extra = {} if position_ids is None else {"position_ids": position_ids}
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_trunk):
            out = self.trunk.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        return out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits (B, T, V) from :meth:`forward`'s hidden states, scaled / capped as the model's own."""
        return self.mtp_logit_transform()(self.mtp_output_head()(hidden))

    # ----------------------------------------------------------------- heads-only checkpoints
    def mtp_state_dict(self) -> dict[str, Tensor]:
        """The MTP modules' weights (no trunk weight; the shared embedding and head belong to the trunk)."""
        self.require_mtp_modules()
        return {k: v for k, v in self.state_dict().items() if not k.startswith(TRUNK_PREFIX)}

    def save_mtp_heads(self, path: str) -> None:
        """Write the MTP weights and metadata only (``torch.load(weights_only=True)`` reads it); the trunk is
        described by its weights as they are now (a trunk trained with the heads is not the folder's any more)."""
        trunk = self._trunk_summary(now=True)
        # a trunk that trained with the heads (the default fine-tune): they belong to its weights, not to the folder's
        now, loaded = trunk.get("weights"), self._trunk_weights
        trunk["trained"] = bool(now and loaded and now != loaded)
        torch.save({"state_dict": self.mtp_state_dict(), checkpointing.CHECKPOINT_KEY: checkpointing.mtp_metadata(self),
                    HEADS_ONLY_KEY: True, "trunk": trunk}, path)

    def load_mtp_heads(self, path: str) -> checkpointing.LoadReport:
        """Load MTP weights from a heads-only (or full) checkpoint; the trunk's weights are left as they are."""
        checkpoint = checkpoint_files.read_checkpoint(path, "--model.init_args.mtp_heads")
        if "state_dict" not in checkpoint:  # a DeepSpeed or sharded FSDP2 folder: its weights are not in one file
            raise ValueError(f"--model.init_args.mtp_heads {path!r} holds no weights in one file: give a checkpoint "
                             "file (a DeepSpeed folder converts with the command in docs/distributed.md)")
        self._check_trunk_summary(checkpoint, path)
        refuse_other_layout(self.mtp_config.layout, checkpoint, path)
        state = {k: v for k, v in checkpoint.get("state_dict", {}).items() if not k.startswith(TRUNK_PREFIX)}
        checkpoint = {**checkpoint, "state_dict": state}
        # heads to serve or continue: all of them load, or none (another depth or architecture is a new fit's)
        checkpointing.refuse_other_heads(self, checkpoint, f"--model.init_args.mtp_heads {path}")
        report = checkpointing.reconcile_state_dict(self, checkpoint, resuming=False)
        missing, unexpected = self.load_state_dict(checkpoint["state_dict"], strict=False)
        missing = [k for k in missing if not k.startswith(TRUNK_PREFIX)]
        if missing or unexpected:
            raise ValueError(f"{path} does not fit {type(self).__name__}: missing {missing}, unexpected {unexpected}")
        checkpointing.restore_runtime_state(self, checkpoint, schedule=False)  # weights only: a new run's schedule
        return report

    def _trunk_summary(self, now: bool = False) -> dict:
        """The trunk's description; ``now``: its weights' fingerprint taken again (a trunk that trained), where its
        weights are whole on this process (not sharded: then none, and no weights check)."""
        weights = _whole_weights_fingerprint(self.trunk) if now and not self.freeze_trunk else self._trunk_weights
        return trunk_summary(self.trunk, weights, self.pretrained)

    def _check_trunk_summary(self, checkpoint: dict, path: str) -> None:
        """Refuse MTP heads trained over another trunk: other sizes, or (both loaded from folders) other weights."""
        saved, own = checkpoint.get("trunk"), self._trunk_summary()
        if saved and (saved["hidden_size"], saved["vocab_size"]) != (own["hidden_size"], own["vocab_size"]):
            raise ValueError(f"{path} holds MTP heads for a {saved['class']} (hidden {saved['hidden_size']}, vocab "
                             f"{saved['vocab_size']}), but this trunk is a {own['class']} (hidden "
                             f"{own['hidden_size']}, vocab {own['vocab_size']})")
        if saved and saved.get("weights") and own.get("weights") and saved["weights"] != own["weights"]:
            mine = (f"the trunk loaded from {self.pretrained!r}" if self.pretrained else
                    "this module's trunk (wrapped, or built from its config with fresh weights)")
            fine_tuned = ("save the fine-tuned trunk and its tokenizer into a folder DIR (model.trunk.save_pretrained("
                          "DIR), tokenizer.save_pretrained(DIR)) and load HFCausalLM(pretrained=DIR, mtp_heads=...), "
                          "or serve the fit's own checkpoint (lightning-mtp predict --ckpt_path CKPT)")
            if saved.get("trained"):  # save_mtp_heads after a fit that trained the trunk
                started = (f"the weights loaded from {saved['pretrained']!r}" if saved.get("pretrained") else
                           "the trunk it wrapped")
                raise ValueError(f"{path} holds MTP heads of a fit that trained its trunk too (starting from {started}"
                                 f"; only freeze_trunk=True leaves it as it was): the heads belong to the fine-tuned "
                                 f"trunk, and {mine} has other weights. To serve them, {fine_tuned}")
            theirs = (f"the weights loaded from {saved['pretrained']!r}" if saved.get("pretrained") else
                      "a trunk that was wrapped or built from its config (HFCausalLM.from_model, trunk=)")
            raise ValueError(f"{path} holds MTP heads trained over {theirs}, but {mine} has other weights (another "
                             "model, or it changed since, or the fit that wrote the heads trained the trunk, as the "
                             "default fine-tune does: the heads then belong to the fine-tuned trunk, not to its "
                             "folder): load the heads onto the trunk they were trained over (its folder, or "
                             f"HFCausalLM.from_model(model, mtp_heads=...)); for a fine-tuned trunk, {fine_tuned}; or "
                             "train new heads on this one")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if not self.save_trunk and "state_dict" in checkpoint:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                        if not k.startswith(TRUNK_PREFIX)}
            checkpoint[HEADS_ONLY_KEY] = True
            checkpoint["trunk"] = self._trunk_summary()

    def mtp_keys_not_saved(self, checkpoint: dict) -> set[str]:
        """The weights ``checkpoint`` leaves out on purpose: a frozen trunk's (they come from ``pretrained``)."""
        if not checkpoint.get(HEADS_ONLY_KEY):
            return set()
        return {name for name, _ in self.named_parameters() if name.startswith(TRUNK_PREFIX)}

    def mtp_complete_checkpoint(self, checkpoint: dict, source: str) -> None:
        """Refuse a checkpoint of another layout or, heads-only, of another trunk; fill a heads-only checkpoint's
        trunk keys with this trunk's weights (they come from ``pretrained``), so that a strict load succeeds."""
        refuse_other_layout(self.mtp_config.layout, checkpoint, source)
        if checkpoint.get(HEADS_ONLY_KEY) and "state_dict" in checkpoint:
            self._check_trunk_summary(checkpoint, source)
            own = {k: v for k, v in self.state_dict().items() if k.startswith(TRUNK_PREFIX)}
            checkpoint["state_dict"] = {**own, **checkpoint["state_dict"]}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.mtp_complete_checkpoint(checkpoint, "the checkpoint")
        super().on_load_checkpoint(checkpoint)

    # ----------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        return adamw_warmup_cosine(self, self.learning_rate, self.weight_decay, self.warmup_steps,
                                   estimated_total_steps(self))


def _whole_weights_fingerprint(trunk: nn.Module) -> Optional[str]:
    """:func:`weights_fingerprint` of a trunk whose weights are all on this process; ``None`` for one that is sharded
    (FSDP2, ZeRO-3) or not materialised (meta): nothing to check against then."""
    whole = all(not is_dtensor(p) and not p.is_meta and p.numel() > 0 for p in trunk.parameters())
    return weights_fingerprint(trunk) if whole else None
