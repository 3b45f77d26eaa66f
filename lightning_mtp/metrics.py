"""Per-depth accuracies (torchmetrics) and the TensorBoard names and custom-scalars layout.

Logged names (``stage`` is ``train``, ``val`` or ``test``; k = 1..D):

- ``{stage}/loss``: total loss; ``{stage}/main/loss``, ``{stage}/main/acc``: the next-token head;
- ``{stage}/mtp/loss``: λ · mean_k(w_k · L_k), the MTP part of the total;
- ``{stage}/mtp/loss_depth{k}``, ``{stage}/mtp/acc_depth{k}``: depth k's own mean loss and top-1 accuracy.

``train`` values are the step's batch's; ``val`` and ``test`` losses are means over the epoch's scored tokens
(:class:`TokenWeightedLoss`), as the accuracies are.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

STAGES = ("train", "val", "test")


class TokenWeightedLoss(Metric):
    """An epoch's loss over every scored token: each part's (main head, depth k) summed cross-entropy over its scored
    tokens, gathered over batches and processes, then ``Σ_p coefficient_p · mean_p``. A mean of batch means would
    weigh a batch of 6 scored tokens like one of 600 (padded chat rows), and the epoch's value would depend on how
    the records fall into batches.

    ``parts`` picks what it reports: ``"total"`` (the main loss and every depth at its weight: the loss),
    ``"mtp"`` (the depths at their weights), or an int ``p`` (part p's mean alone: 0 the main head, k depth k).
    States are float64 and stay so whatever dtype the module is cast to (bf16 sums would lose counts above 256).

    Example::

        >>> metric = TokenWeightedLoss(depth=1, parts=1)
        >>> metric.update(torch.tensor([2.0, 1.0]), torch.tensor([10, 2]), [1.0, 0.3])
        >>> metric.update(torch.tensor([4.0, 4.0]), torch.tensor([30, 6]), [1.0, 0.3])
        >>> round(float(metric.compute()), 4)  # (1 * 2 + 4 * 6) / 8, not (1 + 4) / 2
        3.25
    """

    full_state_update = False

    def __init__(self, depth: int, parts: Union[int, str] = "total") -> None:
        super().__init__()
        self.parts = parts
        self.add_state("sums", default=torch.zeros(depth + 1, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", default=torch.zeros(depth + 1, dtype=torch.float64), dist_reduce_fx="sum")
        self.coefficients = torch.zeros(depth + 1, dtype=torch.float64)  # of the last update (fixed in an epoch)

    def update(self, means: Tensor, counts: Tensor, weights: list[float], first: int = 0) -> None:
        """A batch's ``means`` (P,) and scored ``counts`` (P,) of parts ``first..first+P-1`` with ``weights``."""
        span = slice(first, first + means.shape[0])
        counts = counts.to(self.counts.device, torch.float64)
        self.sums[span] += means.detach().to(self.sums.device, torch.float64) * counts
        self.counts[span] += counts
        coefficients = torch.zeros_like(self.coefficients)
        coefficients[span] = torch.tensor(weights, dtype=torch.float64)
        self.coefficients = coefficients

    def compute(self) -> Tensor:
        means = self.sums / self.counts.clamp(min=1)
        if isinstance(self.parts, int):
            return means[self.parts].float()
        chosen = self.coefficients.to(means.device).clone()
        if self.parts == "mtp":
            chosen[0] = 0.0
        return (chosen * means).sum().float()

    def _apply(self, fn: Callable, exclude_state: Optional[tuple] = ()) -> nn.Module:
        # the states follow the module's device, never its dtype (torchmetrics guards .half() and the like, not .to)
        this = super()._apply(fn, exclude_state=("sums", "counts", *exclude_state))
        for key in ("sums", "counts"):  # this.device: where fn moved torchmetrics' own probe
            setattr(this, key, getattr(this, key).to(this.device))
            this._defaults[key] = this._defaults[key].to(this.device)
        return this


class MTPMetrics(nn.Module):
    """Top-1 accuracy per stage and depth (index 0 = next-token head), as torchmetrics objects."""

    def __init__(self, depth: int, vocab_size: int, ignore_index: int = -100) -> None:
        super().__init__()
        self.by_stage = nn.ModuleDict(
            {
                f"{stage}_acc": nn.ModuleList(
                    MulticlassAccuracy(num_classes=vocab_size, average="micro", ignore_index=ignore_index)
                    for _ in range(depth + 1)
                )
                for stage in STAGES
            }
        )

        self.epoch_losses = nn.ModuleDict({stage: nn.ModuleDict({
            "loss": TokenWeightedLoss(depth, "total"), "mtp/loss": TokenWeightedLoss(depth, "mtp"),
            "main/loss": TokenWeightedLoss(depth, 0),
            **{f"mtp/loss_depth{k}": TokenWeightedLoss(depth, k) for k in range(1, depth + 1)}})
            for stage in STAGES if stage != "train"})

    def accuracies(self, stage: str) -> nn.ModuleList:
        return self.by_stage[f"{stage}_acc"]

    def losses(self, stage: str) -> nn.ModuleDict:
        """The token-weighted epoch losses of ``stage`` (``val``, ``test``) by logged name (without the stage)."""
        return self.epoch_losses[stage]


def custom_scalars_layout(depth: int) -> dict:
    """TensorBoard custom-scalars layout: one chart per stage and quantity with every depth on it."""
    layout = {}
    for stage in ("train", "val"):
        layout[f"MTP {stage}"] = {
            "loss per depth": ["Multiline", [f"{stage}/main/loss"] + [f"{stage}/mtp/loss_depth{k}" for k in
                                                                      range(1, depth + 1)]],
            "accuracy per depth": ["Multiline", [f"{stage}/main/acc"] + [f"{stage}/mtp/acc_depth{k}" for k in
                                                                        range(1, depth + 1)]],
        }
    return layout


def log_custom_scalars_layout(loggers: Iterable, depth: int) -> None:
    """Write the layout through every TensorBoard logger (others are left alone)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_custom_scalars(custom_scalars_layout(depth))
