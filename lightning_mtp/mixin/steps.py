"""Lightning's steps: training/validation/test on token batches with per-depth logging, and generation
(``generate``, ``predict_step``) through :mod:`lightning_mtp.decoding`.

A validation batch runs the trunk once: callbacks that read every depth's hidden states (the coupling monitor, the
draft calibration) ask for them in ``on_validation_batch_start`` (:meth:`MTPSteps.mtp_validation_forward`), and
``validation_step`` keeps what it computed for the loss, plus the depths that training has not activated yet.

A batch is a (B, T) tensor of token ids, or a dict in ``transformers``' conventions (:func:`unpack_batch`,
:func:`batch_position_ids`):

- ``input_ids`` (B, T), required;
- ``labels`` (B, T): the token where it is trained, ``ignore_index`` (-100) elsewhere; unshifted (the model shifts:
  the main head at i predicts ``labels[i+1]``, depth k ``labels[i+k+1]``); default ``input_ids``;
- ``attention_mask`` (B, T): right padding, 1 on tokens, 0 on padding, whose labels become ``ignore_index``;
- ``position_ids`` (B, T): packed documents, positions restarting at 0 at each document's first token
  (``transformers.DataCollatorWithFlattening``); attention and targets stay within documents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mtp import decoding
from lightning_mtp.mixin.batches import batch_mask, batch_position_ids, unpack_batch
from lightning_mtp.mixin.objective import check_loss_inputs
from lightning_mtp.mixin.step_tokens import StepTokens
from lightning_mtp.outputs import MTPForward, MTPLossOutput


@dataclass
class ValidationForward:
    """The teacher-forced forward of one validation batch, shared by every consumer of that batch."""

    input_ids: Tensor
    """(B, T) token ids of the batch it belongs to, compared by identity: the step and the batch hooks get the same
    tensor, even where a wrapper (DDP on GPUs) rebuilds the batch's dict or tuple on its way to the step."""
    forward: Optional[MTPForward] = None
    """Every configured depth's normed states (all D, whatever the active depth), ``main_hidden`` and the trunk's
    state; filled by ``validation_step`` (under its precision context: autocast with mixed precision), or by the first
    consumer when the host has its own ``validation_step``."""
    derived: dict = field(default_factory=dict)
    """What its consumers share besides ``forward`` (the callbacks that read it: who waits, who was fed); dropped
    with it."""


class MTPSteps:
    """The default ``*_step`` methods, ``generate`` and ``predict_step``, and the validation batch's shared forward."""

    _mtp_validation_record: Optional[ValidationForward] = None  # the current validation batch's, when asked for

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The loss over the batch's scored tokens, each weighing what it weighs among every token of its optimizer
        step (every batch its gradient accumulates, every process: :mod:`~lightning_mtp.mixin.step_tokens`); the
        logged values are the batch's own means."""
        input_ids, labels, position_ids = self.mtp_checked_batch(batch)
        tokens = self.__dict__.get("_mtp_step_tokens") or self.__dict__.setdefault("_mtp_step_tokens", StepTokens())
        normalizers = tokens.normalizers(self, labels, input_ids, position_ids, batch_idx)
        self._mtp_step_normalizers = normalizers
        try:
            out = self.compute_lm_loss(input_ids, labels, position_ids)
        finally:
            self._mtp_step_normalizers = None
        self.mtp_watch_loss(out)
        batch_loss = None if normalizers is None else batch_mean_loss(out)
        self._log_mtp(out, "train", input_ids.shape[0], batch_loss)
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels, position_ids = self.mtp_checked_batch(batch)
        record = self._mtp_validation_record
        if record is not None and record.input_ids is not input_ids:
            record = self._mtp_validation_record = None  # another batch's, left by a hook that skipped super()
        if record is not None and record.forward is None:
            out, record.forward = self._lm_loss_keeping_every_depth(input_ids, labels, position_ids)
        else:
            out = self.compute_lm_loss(input_ids, labels, position_ids)
        self._log_mtp(out, "val", input_ids.shape[0])
        return out.loss

    def mtp_checked_batch(self, batch: Any) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """(input_ids, labels, position_ids) of a batch (:func:`unpack_batch`, :func:`batch_position_ids`), checked:
        a dict has ``input_ids``; ``labels``, ``attention_mask`` and ``position_ids`` have its shape; ids lie in the
        vocabulary and labels too, or equal ``ignore_index``; ``attention_mask`` is right padding; ``position_ids``
        are non-negative integers (one host sync for the value checks)."""
        if isinstance(batch, dict) and "input_ids" not in batch:
            raise ValueError(f"a batch must be a (B, T) tensor of token ids or a dict with 'input_ids' (and optional "
                             f"'labels', 'attention_mask', 'position_ids'); got a dict with keys "
                             f"{sorted(map(str, batch))}")
        ignore = self.mtp_config.ignore_index
        input_ids, labels = unpack_batch(batch, ignore)
        position_ids = batch_position_ids(batch)
        check_loss_inputs(input_ids, labels, position_ids, "a batch's ")
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"a batch's attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(mask.shape)}")
        self._check_batch_values(input_ids, labels, position_ids, batch_mask(batch))
        return input_ids, labels, position_ids

    def _check_batch_values(self, input_ids: Tensor, labels: Optional[Tensor], position_ids: Optional[Tensor],
                            mask: Optional[Tensor]) -> None:
        """The value checks of :meth:`mtp_checked_batch`, read back in one host sync."""
        ignore, vocab = self.mtp_config.ignore_index, self.mtp_vocab_size_hint()
        if vocab is None and position_ids is None and mask is None:
            return
        zero = input_ids.new_zeros(())
        scored = input_ids if labels is None else labels.masked_fill(labels == ignore, 0)
        padding = None if mask is None else mask == 0  # (B, T)
        after_padding = zero if padding is None else (padding[:, :-1] & ~padding[:, 1:]).any()  # a token after padding
        values = [input_ids.min(), input_ids.max(), scored.min(), scored.max(),
                  zero if position_ids is None else position_ids.min().to(zero.dtype), after_padding.to(zero.dtype)]
        low, high, label_low, label_high, position_low, left_padded = torch.stack(values).tolist()
        if position_low < 0:
            raise ValueError(f"a batch's position_ids must be >= 0 (each document's positions restart at 0), got "
                             f"{position_low}")
        if left_padded:
            raise ValueError("a batch's attention_mask must be right padding (each row's 1s, then its 0s): attention "
                             "is causal, so tokens after padding would attend to it; pad on the right")
        if vocab is None:
            return
        if low < 0 or high >= vocab or label_low < 0 or label_high >= vocab:
            what = "input_ids" if low < 0 or high >= vocab else f"labels (other than ignore_index {ignore})"
            span = (low, high) if what == "input_ids" else (label_low, label_high)
            if what != "input_ids" and label_low == -100 and ignore != -100:
                raise ValueError(f"a batch's labels hold -100 (the mask of tokens not trained, as the data module and "
                                 f"transformers write it), but MTPConfig.ignore_index (--model.init_args.mtp."
                                 f"ignore_index) is {ignore}: set it to -100")
            raise ValueError(f"a batch's {what} range over [{span[0]}, {span[1]}], outside the model's vocabulary "
                             f"[0, {vocab}): the data's tokenizer does not fit the model (--data.tokenizer, "
                             "--data.vocab_size and the model's vocabulary size must agree)")

    def mtp_validation_forward(self, batch: Any) -> ValidationForward:
        """The shared forward of validation batch ``batch``; the first call for a batch asks for it.

        Asked for in ``on_validation_batch_start``, ``validation_step`` runs every configured depth (not only the
        active ones; the loss still scores only those) and keeps the states in ``.forward`` for the callbacks'
        ``on_validation_batch_end``. The mixin's own ``on_validation_batch_end``, which Lightning calls after the
        callbacks', drops the record, so nothing is held between batches. ``.forward`` stays ``None`` when nobody
        asked before the step or the host has its own ``validation_step``: the first consumer fills it then.
        """
        input_ids = unpack_batch(batch)[0]
        record = self._mtp_validation_record
        if record is None or record.input_ids is not input_ids:
            record = self._mtp_validation_record = ValidationForward(input_ids)
        return record

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_validation_batch_end(outputs, batch, batch_idx, dataloader_idx)
        self._mtp_validation_record = None  # every callback has read it (Lightning calls theirs first)

    def _lm_loss_keeping_every_depth(
        self, input_ids: Tensor, labels: Optional[Tensor], position_ids: Optional[Tensor] = None
    ) -> tuple[MTPLossOutput, MTPForward]:
        """``compute_lm_loss`` and the teacher-forced forward of every configured depth, from one trunk pass and one
        pass per depth. The loss is ``compute_lm_loss``'s to the bit: the active depths only, weighted as there. The
        forward carries ``position_ids``, so its readers mask cross-document targets as the loss does."""
        hidden = self.mtp_run_trunk(input_ids, position_ids)  # (B, T, H)
        fwd, specs = self._run_depths(hidden, input_ids, labels, with_loss=True, run_depths=self.mtp_config.depth,
                                      position_ids=position_ids)
        main = self._main_loss_spec(hidden, fwd)
        active = len(specs)
        # _score drops the states it scored from the forward it is given: give it a copy, keep the full one.
        scored = dataclasses.replace(fwd, depth_hidden=fwd.depth_hidden[:active])
        out = self._score(scored, specs, main, states_kept=True)
        # The fused cross-entropy's argmax of every scored position (main head, then the active depths): the
        # callbacks' acceptance statistics need exactly these, so they are kept rather than recomputed.
        states = [fwd.main_hidden, *fwd.depth_hidden[:active]]
        fwd.argmax = {k: pred.view(h.shape[:2]) for k, (pred, h) in enumerate(zip(out.losses.predictions, states))}
        return out, fwd

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        input_ids, labels, position_ids = self.mtp_checked_batch(batch)
        out = self.compute_lm_loss(input_ids, labels, position_ids)
        self._log_mtp(out, "test", input_ids.shape[0])
        return out.loss

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs: Any):
        """Self-speculative decoding with the MTP heads as drafters; see :func:`lightning_mtp.decoding.generate`.
        Decodes in eval mode (dropout off: otherwise greedy output would be random, and not plain decoding's), and
        puts back the mode it was called in."""
        self.mtp_whole_root()  # FSDP2: the shared embedding and head, whole for the whole call
        training = self.training
        self.eval()
        try:
            return decoding.generate(self, input_ids, max_new_tokens, **kwargs)
        finally:
            self.train(training)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict:
        """Generate for a batch of prompts; returns tokens, texts and decoding stats (``decoding.predict_batch``).
        The batch is what ``training_step`` takes: a dict, a (B, T) tensor, or a tuple of them (a ``TensorDataset``'s:
        the prompts first)."""
        self.mtp_whole_root()
        if isinstance(batch, (list, tuple)):
            batch = batch[0]
        return decoding.predict_batch(self, batch, **getattr(self, "mtp_generate_kwargs", {}))

    def _log_mtp(self, out: MTPLossOutput, stage: str, batch_size: int, batch_loss: Optional[Tensor] = None) -> None:
        on_step = stage == "train"
        sync = stage != "train"
        names = [f"{stage}/loss", f"{stage}/mtp/loss"]
        values = {names[0]: out.loss.detach() if batch_loss is None else batch_loss, names[1]: out.mtp_loss}
        if out.main_loss is not None:
            values[f"{stage}/main/loss"] = out.main_loss
        for k in range(1, self.mtp_active_depth + 1):
            values[f"{stage}/mtp/loss_depth{k}"] = out.depth_losses[k - 1]
        if not on_step and out.losses is not None:
            # an epoch's losses are means over its scored tokens (metrics.TokenWeightedLoss), not over batches
            losses = self.mtp_metrics.losses(stage)
            for name in values:
                metric = losses[name[len(stage) + 1:]]
                metric.update(out.losses.per_depth, out.losses.valid_counts, out.losses.weights,
                              first=int(out.main_loss is None))
                values[name] = metric
        for name, value in out.extra_terms.items():
            values[f"{stage}/mtp/{name}"] = value
        self.log_dict(values, on_step=on_step, on_epoch=not on_step, prog_bar=False, batch_size=batch_size,
                      sync_dist=sync)
        self.log(f"{stage}_loss", values[names[0]], on_step=on_step, on_epoch=not on_step, prog_bar=True,
                 batch_size=batch_size, sync_dist=sync, logger=False)
        metrics = self.mtp_metrics.accuracies(stage)
        first = 0 if out.main_loss is not None else None
        for i, (pred, target) in enumerate(zip(out.losses.predictions, out.losses.targets)):
            depth = i if first == 0 else i + 1
            metric = metrics[depth]
            metric(pred, target)  # forward: updates the epoch state and caches the batch value for on_step
            name = f"{stage}/main/acc" if depth == 0 else f"{stage}/mtp/acc_depth{depth}"
            self.log(name, metric, on_step=on_step, on_epoch=not on_step, batch_size=batch_size)


def batch_mean_loss(out: MTPLossOutput) -> Tensor:
    """The batch's total loss over its own scored tokens (what ``out.loss`` is unless it was divided by an optimizer
    step's tokens): Σ_p weight_p · mean_p, plus the registered terms."""
    losses = out.losses
    weights = torch.as_tensor(losses.weights, dtype=losses.per_depth.dtype, device=losses.per_depth.device)
    return (weights * losses.per_depth).sum() + sum(out.extra_terms.values(), torch.zeros(()).to(weights))
