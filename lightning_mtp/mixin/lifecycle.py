"""Lifecycle hooks: data checks before training starts (vocabulary, sequence length, tokenizer), the custom-scalars
layout, and MTP metadata and tokenizer in checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_mtp import checkpointing
from lightning_mtp.finite import TrainingDiverged, check_finite_state_dict
from lightning_mtp.fsdp_settings import validate_mtp_under_fsdp
from lightning_mtp.metrics import log_custom_scalars_layout
from lightning_mtp.mixin.construction import dominant_dtype
from lightning_mtp.zero_settings import validate_mtp_under_zero


class MTPLifecycle:
    """``setup``, ``on_fit_start``, ``on_validation_start``, ``on_test_start``, ``on_predict_start``,
    ``on_save_checkpoint``, ``on_load_checkpoint``; every hook calls ``super()``."""

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.mtp_check_sharded()

    def on_test_start(self) -> None:
        super().on_test_start()
        self.mtp_check_sharded()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self._trainer is not None:
            validate_mtp_under_zero(self.trainer)  # nothing to check without DeepSpeed
            validate_mtp_under_fsdp(self.trainer)  # nor without FSDP
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None:
            return
        data_vocab = getattr(datamodule, "vocab_size", None)
        model_vocab = self.mtp_vocab_size_hint()
        if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
            raise ValueError(
                f"the data's vocabulary ({data_vocab} tokens, --data.vocab_size / --data.tokenizer) is larger than "
                f"the model's ({model_vocab}, {self.mtp_vocab_flag()})"
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
                self._check_data_tokenizer(record, "the model's weights", fitting=stage == "fit")

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.mtp_check_sharded()
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(datamodule, "check_prompts_fit"):  # after the checkpoint (and its tokenizer) is loaded
            self._check_prompts_fit(datamodule)

    def _check_prompts_fit(self, datamodule) -> None:
        """Refuse, naming the prompt's line, a prompt too long for the context left after ``max_new_tokens``."""
        from lightning_mtp.decoding.host import decoding_host

        context = decoding_host(self).max_context
        new_tokens = (getattr(self, "mtp_generate_kwargs", None) or {}).get("max_new_tokens", 64)
        why = (f"the model's decoding context of {context} tokens ({self.mtp_context_flag()}) minus "
               f"--model.init_args.generation.max_new_tokens {new_tokens}")
        if new_tokens >= context:  # no prompt fits, however short: the budget alone is the fault
            raise ValueError(f"--model.init_args.generation.max_new_tokens {new_tokens} leaves no room for a prompt in "
                             f"the model's decoding context of {context} tokens ({self.mtp_context_flag()}): give at "
                             f"most {context - 1}")
        datamodule.check_prompts_fit(context - new_tokens, why)

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
            fitting = self.trainer.state.fn == TrainerFn.FITTING
            self._check_data_tokenizer(datamodule.tokenizer_record(), source, fitting)

    def _check_data_tokenizer(self, data_record: dict, source: str, fitting: bool) -> None:
        """Refuse data whose tokenizer maps the weights' tokens to other ids. One that keeps every id and adds
        tokens (a model folder's special tokens added, its embedding resized) is accepted, and a fit records it: the
        weights are trained with it from now on."""
        from lightning_mtp.data.tokenizer_choice import ids_changed  # (the data package imports the mixin's parts)

        reason = checkpointing.tokenizer_mismatch(self.mtp_tokenizer, data_record)
        if reason is None:
            return
        if ids_changed(data_record, self.mtp_tokenizer) is not None:
            raise ValueError(f"{source}: {reason}")
        if fitting:
            self.mtp_tokenizer = data_record

    def mtp_vocab_size_hint(self) -> Optional[int]:
        """The model's vocabulary size before ``configure_model`` may have run; ``None`` when unknown."""
        try:
            return self.mtp_vocab_size()
        except (AttributeError, NotImplementedError):
            return None

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.mtp_check_sharded()
        log_custom_scalars_layout(self.loggers, self.mtp_config.depth)

    def on_train_start(self) -> None:
        super().on_train_start()
        depth, active = self.mtp_config.depth, self.mtp_active_depth
        warmup = any(getattr(callback, "sets_active_depth", False) for callback in self.trainer.callbacks)
        if getattr(self, "_mtp_active_depth_restored", False) and active < depth and not warmup:
            # the depth a warmup had reached, restored without the warmup that raises it: frozen for the whole fit
            rank_zero_warn(f"resumed at MTP depth {active} of {depth}, where the checkpoint's fit was warming the "
                           f"depths up, without an MTPDepthWarmup: all {depth} depths train from here (add the "
                           "warmup with its schedule to continue it)")
            self.mtp_active_depth = depth

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        # A diverged fit stops before its weights turn non-finite (MTPDivergenceGuard); this catches any other way,
        # an optimizer step that wrote NaN from finite gradients (fp16 overflow, a huge learning rate) among them
        try:
            check_finite_state_dict(checkpoint.get("state_dict") or {}, "refusing to write a checkpoint")
        except ValueError as error:
            if self._trainer is not None and self.trainer.state.fn == "fit":  # (its validations' saves included)
                step = self.trainer.global_step
                raise TrainingDiverged(f"training diverged by global step {step}: {error}") from None
            raise
        hparams = checkpoint.get("hyper_parameters")
        if hparams:  # a module's own MTPConfig / GenerationConfig arguments (save_hyperparameters): plain dicts, which
            # these arguments take too, so that load_from_checkpoint(weights_only=True) reads them
            for name, value in list(hparams.items()):
                if dataclasses.is_dataclass(value) and not isinstance(value, type):
                    hparams[name] = dataclasses.asdict(value)
        checkpoint[checkpointing.CHECKPOINT_KEY] = checkpointing.mtp_metadata(self)
        if self.mtp_tokenizer is not None:
            checkpoint[checkpointing.TOKENIZER_KEY] = self.mtp_tokenizer

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.require_mtp_modules()
        fitting = self._trainer is not None and self.trainer.training
        if fitting:
            refuse_rounding_resume(str(self.trainer.precision), checkpoint.get("state_dict") or {})
        self.mtp_load_report = checkpointing.reconcile_state_dict(self, checkpoint, resuming=fitting)
        # Only a resumed fit continues the old schedule; loading for predict/validate or into a new fit does not.
        checkpointing.restore_runtime_state(self, checkpoint, schedule=fitting)
        self._mtp_active_depth_restored = fitting
        if checkpoint.get(checkpointing.TOKENIZER_KEY):
            self.bind_mtp_tokenizer(checkpoint[checkpointing.TOKENIZER_KEY], "the checkpoint")


_NARROW_PRECISIONS = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
"""Trainer precisions that keep the weights themselves in 16 bits."""


def refuse_rounding_resume(precision: str, state_dict: dict) -> None:
    """Refuse to resume, under a precision that keeps 16-bit weights, a fit whose weights are mostly wider (trained
    under ``32-true`` or a mixed precision): its weights and optimizer states would be rounded to 16 bits without a
    word. (A few wider tensors, such as MoE routers kept in float32, do not decide.)"""
    narrow = _NARROW_PRECISIONS.get(precision)
    if narrow is None:
        return
    saved = dominant_dtype(state_dict.values()) or narrow
    if saved.itemsize > narrow.itemsize:
        raise ValueError(
            f"--trainer.precision {precision}: the checkpoint's weights are {str(saved).replace('torch.', '')} (a fit "
            f"under 32-true or a mixed precision); resuming would round them and the optimizer's states to "
            f"{str(narrow).replace('torch.', '')}. Resume with the precision it was trained with, or start a new fit "
            "from its weights with --model.init_args.init_from")
