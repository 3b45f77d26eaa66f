"""Per-depth accuracies (torchmetrics) and the TensorBoard names and custom-scalars layout.

Logged names (``stage`` is ``train``, ``val`` or ``test``; k = 1..D):

- ``{stage}/loss``: total loss; ``{stage}/main/loss``, ``{stage}/main/acc``: the next-token head;
- ``{stage}/mtp/loss``: λ · mean_k(w_k · L_k), the MTP part of the total;
- ``{stage}/mtp/loss_depth{k}``, ``{stage}/mtp/acc_depth{k}``: depth k's own mean loss and top-1 accuracy.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn
from torchmetrics.classification import MulticlassAccuracy

STAGES = ("train", "val", "test")


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

    def accuracies(self, stage: str) -> nn.ModuleList:
        return self.by_stage[f"{stage}_acc"]


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
