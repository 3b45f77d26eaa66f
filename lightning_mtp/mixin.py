"""``MTPMixin``: adds multi-token prediction heads and their loss to an existing LightningModule.

The host keeps its model; the mixin needs exactly three things from it:

1. ``mtp_token_embedding()`` -> the token embedding module (``nn.Embedding``), shared with the cascaded modules;
2. ``mtp_output_head()`` -> the vocabulary projection (``nn.Linear``), shared by every depth, and
   ``mtp_final_norm()`` -> the trunk's final norm (default: identity) used for the next-token loss;
3. ``mtp_trunk_hidden_states(input_ids)`` -> the trunk's last hidden state (B, T, H), before the final norm.

Example::

    import lightning as L
    from torch import nn
    from lightning_mtp import MTPConfig, MTPMixin

    class TinyLM(MTPMixin, L.LightningModule):
        def __init__(self, vocab=256, dim=64):
            super().__init__(mtp=MTPConfig(depth=2))
            self.embed = nn.Embedding(vocab, dim)
            self.trunk = nn.GRU(dim, dim, batch_first=True)  # any causal trunk
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def mtp_token_embedding(self): return self.embed
        def mtp_output_head(self): return self.head
        def mtp_final_norm(self): return self.norm
        def mtp_trunk_hidden_states(self, input_ids): return self.trunk(self.embed(input_ids))[0]

        def configure_optimizers(self): ...

The default ``training_step``/``validation_step`` take batches of token ids (a tensor, or a dict with
``input_ids`` and optional ``labels``). Hosts with their own ``training_step`` call :meth:`MTPMixin.compute_mtp_loss`
with their hidden states and add its ``loss`` to theirs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mtp import checkpointing
from lightning_mtp.config import MTPConfig
from lightning_mtp.heads import build_mtp_modules
from lightning_mtp.layers import Linear, RotaryTable, mlp_hidden_size
from lightning_mtp.loss import (
    DepthLosses,
    DepthLossPart,
    DepthLossSpec,
    LogitTransform,
    combine_parts,
    depth_targets,
    run_depth,
    score_jointly,
)
from lightning_mtp.metrics import MTPMetrics, log_custom_scalars_layout

LossTerm = Callable[["MTPMixin", "MTPForward"], Tensor]


@dataclass
class MTPForward:
    """What one MTP forward produced; handed to registered loss terms (callbacks)."""

    input_ids: Tensor  # (B, T)
    labels: Tensor  # (B, T), ignore_index on padding
    trunk_hidden: Tensor  # (B, T, H) h_0, before the final norm
    depth_hidden: list[Tensor]  # per active depth k: (B, T-k-1, H) after the depth's output norm
    main_hidden: Optional[Tensor] = None  # (B, T-1, H) final-normed trunk states, when the main loss is computed


@dataclass
class MTPLossOutput:
    """Result of :meth:`MTPMixin.compute_mtp_loss` and :meth:`MTPMixin.compute_lm_loss`."""

    loss: Tensor
    """Differentiable total: λ · mean_k(w_k · L_k) [+ main loss when computed] + registered terms."""
    mtp_loss: Tensor
    """Detached λ · mean_k(w_k · L_k)."""
    depth_losses: Tensor
    """(D,) detached mean loss of each depth; 0 for inactive depths."""
    main_loss: Optional[Tensor] = None
    extra_terms: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    forward: Optional[MTPForward] = None
    losses: Optional[DepthLosses] = None  # raw per-row predictions/targets, entry 0 = main when computed


class MTPMixin:
    """Multi-token prediction for a LightningModule; see the module docstring for what the host provides."""

    def __init__(self, *args: Any, mtp: Union[MTPConfig, dict, None] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(mtp, dict):
            mtp = MTPConfig(**mtp)
        self.mtp_config: MTPConfig = mtp if mtp is not None else MTPConfig()
        # Runtime schedule state, driven by callbacks and saved in checkpoints.
        self.mtp_loss_weight: float = self.mtp_config.loss_weight
        self.mtp_depth_weights: list[float] = list(self.mtp_config.depth_weights or [1.0] * self.mtp_config.depth)
        self.mtp_active_depth: int = self.mtp_config.depth
        self.mtp_draft_temperatures: list[float] = [1.0] * self.mtp_config.depth
        self._mtp_loss_terms: dict[str, LossTerm] = {}
        self.mtp_modules: Optional[nn.ModuleList] = None
        self.mtp_output_heads: Optional[nn.ModuleList] = None
        self.mtp_load_report: Optional[checkpointing.LoadReport] = None
        self.mtp_tokenizer: Optional[dict] = None  # Tokenizer.spec() of the tokenizer the weights were trained with
        self.mtp_distill_weight: float = self.mtp_config.distill_weight
        if self.mtp_config.distill_weight > 0:
            from lightning_mtp.distillation import self_distillation_term

            self.register_mtp_loss_term("distill", self_distillation_term)

    # ----------------------------------------------------------------- what the host provides
    def mtp_token_embedding(self) -> nn.Embedding:
        raise NotImplementedError(f"{type(self).__name__} must implement mtp_token_embedding() for MTPMixin")

    def mtp_output_head(self) -> nn.Linear:
        raise NotImplementedError(f"{type(self).__name__} must implement mtp_output_head() for MTPMixin")

    def mtp_final_norm(self) -> nn.Module:
        return nn.Identity()

    def mtp_trunk_hidden_states(self, input_ids: Tensor) -> Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} must implement mtp_trunk_hidden_states(input_ids) to use MTPMixin's default "
            "training_step; hosts with their own training_step call compute_mtp_loss(hidden, input_ids) instead"
        )

    def mtp_block_spec(self) -> dict:
        """Shape of each MTP block: ``dim``, ``n_heads``, ``n_kv_heads``, ``mlp_hidden``, ``eps``, ``max_positions``.

        Hosts with attention heads or a context length of their own override this; the default infers the width from
        the embedding and uses 64-wide heads.
        """
        dim = self.mtp_token_embedding().embedding_dim
        n_heads = self.mtp_config.num_heads or max(1, dim // 64)
        ratio = self.mtp_config.mlp_ratio or 8 / 3
        return dict(dim=dim, n_heads=n_heads, n_kv_heads=None, mlp_hidden=mlp_hidden_size(dim, ratio), eps=1e-6,
                    max_positions=4096)

    def mtp_vocab_size(self) -> int:
        return self.mtp_output_head().out_features

    def mtp_logit_transform(self) -> LogitTransform:
        """What the host's forward does to its head's outputs (logit scaling, soft-capping); default: nothing.

        Every depth's logits get it: in the loss, in :meth:`mtp_depth_logits` (drafting), and wherever logits are
        formed by calling a head (``transform(mtp_depth_head(k)(normed))``). Hosts like Gemma-2 or Cohere override it.
        """
        return LogitTransform()

    def mtp_decoding_host(self):
        """A :class:`lightning_mtp.decoding.DecodingHost` for :meth:`generate`; ``None`` uses the CausalLM adapter.

        Hosts whose trunk keeps its own KV cache (e.g. Hugging Face models) return an adapter here.
        """
        return None

    # ----------------------------------------------------------------- construction
    def configure_model(self) -> None:
        """Build the MTP modules once (idempotent), so that DeepSpeed ZeRO-3 can partition them."""
        super().configure_model()
        if self.mtp_modules is not None:
            return
        spec = check_block_spec(self.mtp_block_spec(), type(self).__name__)
        cfg = self.mtp_config
        self.mtp_modules = build_mtp_modules(
            cfg.architecture, cfg.depth, spec["dim"], spec["n_heads"], spec["n_kv_heads"], spec["mlp_hidden"],
            spec["eps"],
        )
        if not cfg.share_output_head:
            self.mtp_output_heads = nn.ModuleList(
                Linear(spec["dim"], self.mtp_vocab_size(), bias=False) for _ in range(cfg.depth)
            )
        embed = self.mtp_token_embedding()
        if not cfg.share_embedding and cfg.architecture == "cascaded":
            # The cascaded modules' own embedding, starting from the trunk's values (when they are readable).
            self.mtp_embedding = nn.Embedding(embed.num_embeddings, embed.embedding_dim)
            if not hasattr(embed.weight, "ds_id"):
                with torch.no_grad():
                    self.mtp_embedding.weight.copy_(embed.weight)
        self.mtp_rope = RotaryTable(spec["max_positions"], spec["dim"] // spec["n_heads"])
        self.mtp_metrics = MTPMetrics(cfg.depth, self.mtp_vocab_size(), cfg.ignore_index)
        device = embed.weight.device if embed.weight.device.type != "meta" else None
        if device is not None:
            for part in (self.mtp_modules, self.mtp_rope, self.mtp_metrics, self.mtp_output_heads,
                         getattr(self, "mtp_embedding", None)):
                if part is not None:
                    part.to(device)

    def mtp_draft_embedding(self) -> nn.Embedding:
        """Embedding of the cascaded modules' input tokens: the host's own unless ``share_embedding=False``."""
        own = getattr(self, "mtp_embedding", None)
        return own if own is not None else self.mtp_token_embedding()

    def register_mtp_loss_term(self, name: str, term: LossTerm) -> None:
        """Add ``term(module, forward) -> scalar`` to the training loss; it is logged as ``train/mtp/<name>``."""
        self._mtp_loss_terms[name] = term

    def unregister_mtp_loss_term(self, name: str) -> None:
        """Remove a term added by :meth:`register_mtp_loss_term` (no error when absent)."""
        self._mtp_loss_terms.pop(name, None)

    def _require_modules(self) -> nn.ModuleList:
        if self.mtp_modules is None:
            self.configure_model()
        return self.mtp_modules

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
        """Logits of depth k ≥ 1 from its pre-norm hidden state (B, T, H) -> (B, T, V), transformed as the host's."""
        return self.mtp_logit_transform()(self.mtp_depth_head(depth)(self.mtp_modules[depth - 1].norm(hidden)))

    def mtp_forward(self, hidden: Tensor, input_ids: Tensor, labels: Optional[Tensor] = None) -> MTPForward:
        """Run every active depth on teacher-forced tokens; returns per-depth normed hidden states.

        hidden: (B, T, H) trunk's last hidden state h_0. Depth k covers positions 0..T-k-2, the ones with a target.
        """
        return self._run_depths(hidden, input_ids, labels, with_loss=False)[0]

    def _score(
        self, fwd: MTPForward, specs: list[DepthLossSpec], main: Optional[DepthLossSpec] = None
    ) -> MTPLossOutput:
        """Score the main head (if given) and every active depth jointly: one cross-entropy call per head."""
        hidden = ([fwd.main_hidden] if main is not None else []) + list(fwd.depth_hidden)
        if not (self._mtp_loss_terms and torch.is_grad_enabled()):
            # Nothing reads the normed states after scoring: let the scorer free them as soon as they are copied.
            fwd.main_hidden, fwd.depth_hidden = None, []
        parts = score_jointly(([main] if main is not None else []) + specs, hidden, self.mtp_logit_transform())
        main_part = parts.pop(0) if main is not None else None
        return self._finish(fwd, parts, main_part)

    def _run_depths(
        self, hidden: Tensor, input_ids: Tensor, labels: Optional[Tensor], with_loss: bool
    ) -> tuple[MTPForward, list[DepthLossSpec]]:
        """The depth loop. With ``recompute`` each depth (block and norm) is one activation-checkpointed unit, so
        between forward and backward a depth keeps only its input alive."""
        modules = self._require_modules()
        cfg = self.mtp_config
        B, T = input_ids.shape
        self._check_trunk_hidden(hidden, input_ids)
        if T < cfg.depth + 2:
            raise ValueError(
                f"sequence length {T} is shorter than MTPConfig.depth + 2 = {cfg.depth + 2}: depth {cfg.depth} "
                "would have no target (raise --data.seq_len or lower --model.mtp.depth)"
            )
        labels = input_ids if labels is None else labels
        trunk = hidden.detach() if cfg.detach_trunk else hidden
        embeddings = None
        if cfg.architecture == "cascaded":
            with torch.set_grad_enabled(torch.is_grad_enabled() and not cfg.detach_trunk):
                embeddings = self.mtp_draft_embedding()(input_ids)  # (B, T, H)
        cos, sin = self.mtp_rope(T)
        recompute = cfg.recompute and torch.is_grad_enabled()
        scale = self.mtp_loss_weight / max(self.mtp_active_depth, 1)
        previous, depth_hidden, specs = trunk, [], []
        for k in range(1, self.mtp_active_depth + 1):
            length = T - k - 1
            h_in = previous[:, :length] if cfg.architecture == "cascaded" else trunk[:, :length]
            emb_in = embeddings[:, k : k + length] if embeddings is not None else None  # Emb(t(i+k))
            loss_spec = None
            if with_loss:
                head_weight = self.mtp_depth_head_weight(k)
                if cfg.detach_trunk and self.mtp_output_heads is None:
                    head_weight = head_weight.detach()  # the MTP loss must not move the shared head
                loss_spec = DepthLossSpec(head_weight, depth_targets(labels, k, length),
                                          scale * self.mtp_depth_weights[k - 1], cfg.ignore_index,
                                          self._mtp_chunk_size(), self.mtp_depth_head(k))
            run = functools.partial(run_depth, modules[k - 1], cos[:, :length], sin[:, :length], recompute)
            if recompute:
                out, normed = checkpoint(run, h_in, emb_in, use_reentrant=False)
            else:
                out, normed = run(h_in, emb_in)
            depth_hidden.append(normed)
            specs.append(loss_spec)
            previous = out
        # Under detach_trunk, loss terms (callbacks) read the detached trunk state: no MTP-side gradient reaches it.
        return MTPForward(input_ids, labels, trunk, depth_hidden), specs

    def _check_trunk_hidden(self, hidden: Tensor, input_ids: Tensor) -> None:
        norm = getattr(self.mtp_modules[0], "norm", None)
        weight = getattr(norm, "weight", None)
        width = int(getattr(weight, "ds_shape", weight.shape)[0]) if weight is not None else None  # ZeRO-3: ds_shape
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(input_ids.shape) or (
            width is not None and hidden.shape[-1] != width
        ):
            raise ValueError(
                f"{type(self).__name__}.mtp_trunk_hidden_states(input_ids) (or the hidden states given to "
                f"compute_mtp_loss) must be (batch, tokens, hidden) = ({input_ids.shape[0]}, {input_ids.shape[1]}, "
                f"{width if width is not None else 'H'}) for input_ids of shape {tuple(input_ids.shape)}, got "
                f"{tuple(hidden.shape)}: return the trunk's last hidden state, one vector per token, before the final "
                "norm (not logits, not a pooled or flattened state)"
            )

    def _finish(self, fwd: MTPForward, parts: list[DepthLossPart], main: Optional[DepthLossPart]) -> MTPLossOutput:
        cfg = self.mtp_config
        losses = combine_parts(([main] if main is not None else []) + parts)
        per_depth = losses.per_depth[int(main is not None):]
        depth_losses = torch.zeros(cfg.depth, device=per_depth.device)
        depth_losses[: per_depth.shape[0]] = per_depth
        mtp_weighted = per_depth.new_zeros(())
        for i, part in enumerate(parts):
            mtp_weighted = mtp_weighted + part.weight * per_depth[i]
        total = losses.loss
        extra = {}
        if torch.is_grad_enabled():
            if cfg.detach_trunk and fwd.main_hidden is not None:
                # The main loss was scored from it with gradient; the MTP-side terms read it detached.
                fwd = dataclasses.replace(fwd, main_hidden=fwd.main_hidden.detach())
            for name, term in self._mtp_loss_terms.items():
                extra[name] = term(self, fwd)
                total = total + extra[name]
        return MTPLossOutput(
            loss=total,
            mtp_loss=mtp_weighted.detach(),
            depth_losses=depth_losses,
            main_loss=losses.per_depth[0] if main is not None else None,
            extra_terms={k: v.detach() for k, v in extra.items()},
            forward=fwd,
            losses=losses,
        )

    def _mtp_chunk_size(self) -> Optional[int]:
        return self.mtp_config.loss_chunk_size

    def compute_mtp_loss(self, hidden: Tensor, input_ids: Tensor, labels: Optional[Tensor] = None) -> MTPLossOutput:
        """The weighted MTP loss for hosts that keep their own ``training_step``.

        Args:
            hidden: (B, T, H) the trunk's last hidden state (before the final norm).
            input_ids: (B, T) token ids.
            labels: (B, T) targets aligned with ``input_ids`` (``ignore_index`` on padding); default ``input_ids``.

        Returns:
            ``loss`` = λ · mean_k(w_k · L_k) (+ registered terms) to add to the host's own loss, and
            ``depth_losses`` (D,) for logging.
        """
        return self._score(*self._run_depths(hidden, input_ids, labels, with_loss=True))

    def compute_lm_loss(self, input_ids: Tensor, labels: Optional[Tensor] = None) -> MTPLossOutput:
        """Next-token loss plus the MTP loss; every depth's cross-entropy is chunked."""
        hidden = self.mtp_trunk_hidden_states(input_ids)  # (B, T, H)
        fwd, specs = self._run_depths(hidden, input_ids, labels, with_loss=True)
        fwd.main_hidden = self.mtp_final_norm()(hidden[:, :-1])  # (B, T-1, H)
        main = DepthLossSpec(self.mtp_depth_head_weight(0), depth_targets(fwd.labels, 0, hidden.shape[1] - 1), 1.0,
                             self.mtp_config.ignore_index, self._mtp_chunk_size(), self.mtp_depth_head(0))
        return self._score(fwd, specs, main)

    # ----------------------------------------------------------------- Lightning steps
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels = unpack_batch(batch, self.mtp_config.ignore_index)
        out = self.compute_lm_loss(input_ids, labels)
        self._log_mtp(out, "train", input_ids.shape[0])
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels = unpack_batch(batch, self.mtp_config.ignore_index)
        out = self.compute_lm_loss(input_ids, labels)
        self._log_mtp(out, "val", input_ids.shape[0])
        return out.loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels = unpack_batch(batch, self.mtp_config.ignore_index)
        out = self.compute_lm_loss(input_ids, labels)
        self._log_mtp(out, "test", input_ids.shape[0])
        return out.loss

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any):
        """Self-speculative decoding with the MTP heads as drafters; see :func:`lightning_mtp.decoding.generate`."""
        from lightning_mtp.decoding import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict:
        """Generate for a batch of prompts; returns tokens, texts and decoding stats (``decoding.predict_batch``)."""
        from lightning_mtp.decoding import predict_batch

        return predict_batch(self, batch, **getattr(self, "mtp_generate_kwargs", {}))

    def _log_mtp(self, out: MTPLossOutput, stage: str, batch_size: int) -> None:
        on_step = stage == "train"
        sync = stage != "train"
        values = {f"{stage}/loss": out.loss.detach(), f"{stage}/mtp/loss": out.mtp_loss}
        if out.main_loss is not None:
            values[f"{stage}/main/loss"] = out.main_loss
        for k in range(1, self.mtp_active_depth + 1):
            values[f"{stage}/mtp/loss_depth{k}"] = out.depth_losses[k - 1]
        for name, value in out.extra_terms.items():
            values[f"{stage}/mtp/{name}"] = value
        self.log_dict(values, on_step=on_step, on_epoch=not on_step, prog_bar=False, batch_size=batch_size,
                      sync_dist=sync)
        self.log(f"{stage}_loss", out.loss.detach(), on_step=on_step, on_epoch=not on_step, prog_bar=True,
                 batch_size=batch_size, sync_dist=sync, logger=False)
        metrics = self.mtp_metrics.accuracies(stage)
        first = 0 if out.main_loss is not None else None
        for i, (pred, target) in enumerate(zip(out.losses.predictions, out.losses.targets)):
            depth = i if first == 0 else i + 1
            metric = metrics[depth]
            metric(pred, target)  # forward: updates the epoch state and caches the batch value for on_step
            name = f"{stage}/main/acc" if depth == 0 else f"{stage}/mtp/acc_depth{depth}"
            self.log(name, metric, on_step=on_step, on_epoch=not on_step, batch_size=batch_size)

    # ----------------------------------------------------------------- lifecycle hooks
    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None:
            return
        data_vocab = getattr(datamodule, "vocab_size", None)
        model_vocab = self.mtp_vocab_size_hint()
        if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
            raise ValueError(
                f"the data's vocabulary ({data_vocab} tokens, --data.vocab_size / --data.tokenizer) is larger than "
                f"the model's ({model_vocab}, --model.vocab_size)"
            )
        seq_len = getattr(datamodule, "seq_len", None)
        if seq_len is not None and seq_len < self.mtp_config.depth + 2:
            raise ValueError(
                f"--data.seq_len={seq_len} is shorter than --model.mtp.depth + 2 = {self.mtp_config.depth + 2}: "
                "the deepest MTP depth would have no target"
            )
        context = self.mtp_max_sequence_length()
        if seq_len is not None and context is not None and stage in ("fit", "validate", "test") and seq_len > context:
            raise ValueError(
                f"--data.seq_len={seq_len} is longer than the model's context of {context} tokens "
                f"({self.mtp_context_flag()}): lower --data.seq_len or raise the model's context"
            )
        record = datamodule.tokenizer_record() if hasattr(datamodule, "tokenizer_record") else None
        if record is not None:
            if self.mtp_tokenizer is None and stage == "fit":
                self.mtp_tokenizer = record  # a new fit binds the weights to the data's tokenizer
            else:
                self._refuse_other_tokenizer(record, "the model's weights")

    def mtp_max_sequence_length(self) -> Optional[int]:
        """Longest training sequence the host supports (``None``: unknown); ``--data.seq_len`` is checked against it
        before training starts."""
        return None

    def mtp_context_flag(self) -> str:
        """The flag or field that sets :meth:`mtp_max_sequence_length`, for error messages."""
        return f"{type(self).__name__}.mtp_max_sequence_length()"

    def bind_mtp_tokenizer(self, record: dict, source: str = "the checkpoint") -> None:
        """Record the tokenizer these weights were trained with (``Tokenizer.spec()`` plus data settings, as
        ``checkpoint["tokenizer"]`` holds it); data with another tokenizer is refused from then on.

        Example::

            from lightning_mtp.data import tokenizer_from_spec
            model = CausalLM.load_from_checkpoint("last.ckpt", weights_only=True)
            tokenizer = tokenizer_from_spec(model.mtp_tokenizer)   # decode generate()'s ids with it
        """
        self.mtp_tokenizer = record
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "tokenizer_record"):
            self._refuse_other_tokenizer(datamodule.tokenizer_record(), source)

    def _refuse_other_tokenizer(self, data_record: dict, source: str) -> None:
        reason = checkpointing.tokenizer_mismatch(self.mtp_tokenizer, data_record)
        if reason is not None:
            raise ValueError(f"{source}: {reason}")

    def mtp_vocab_size_hint(self) -> Optional[int]:
        """The model's vocabulary size before ``configure_model`` may have run; ``None`` when unknown."""
        try:
            return self.mtp_vocab_size()
        except (AttributeError, NotImplementedError):
            return None

    def on_fit_start(self) -> None:
        super().on_fit_start()
        log_custom_scalars_layout(self.loggers, self.mtp_config.depth)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[checkpointing.CHECKPOINT_KEY] = checkpointing.mtp_metadata(self)
        if self.mtp_tokenizer is not None:
            checkpoint[checkpointing.TOKENIZER_KEY] = self.mtp_tokenizer

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._require_modules()
        fitting = self._trainer is not None and self.trainer.training
        self.mtp_load_report = checkpointing.reconcile_state_dict(self, checkpoint, resuming=fitting)
        # Only a resumed fit continues the old schedule; loading for predict/validate or into a new fit does not.
        checkpointing.restore_runtime_state(self, checkpoint, schedule=fitting)
        if checkpoint.get(checkpointing.TOKENIZER_KEY):
            self.bind_mtp_tokenizer(checkpoint[checkpointing.TOKENIZER_KEY], "the checkpoint")


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


def unpack_batch(batch: Any, ignore_index: int = -100) -> tuple[Tensor, Optional[Tensor]]:
    """Token ids and labels from a (B, T) tensor, or a dict with ``input_ids`` and optional ``labels``/mask."""
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (list, tuple)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    input_ids = batch["input_ids"]
    labels = batch.get("labels")
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = (input_ids if labels is None else labels).masked_fill(mask == 0, ignore_index)
    return input_ids, labels
