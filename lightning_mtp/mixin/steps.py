"""Lightning's steps: training/validation/test on token batches with per-depth logging, and generation
(``generate``, ``predict_step``) through :mod:`lightning_mtp.decoding`."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from lightning_mtp import decoding
from lightning_mtp.outputs import MTPLossOutput


class MTPSteps:
    """The default ``*_step`` methods, ``generate`` and ``predict_step``."""

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
        return decoding.generate(self, input_ids, max_new_tokens, **kwargs)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict:
        """Generate for a batch of prompts; returns tokens, texts and decoding stats (``decoding.predict_batch``)."""
        return decoding.predict_batch(self, batch, **getattr(self, "mtp_generate_kwargs", {}))

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
