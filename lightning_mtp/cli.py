"""``lightning-mtp``: the LightningCLI entry point (fit / validate / test / predict).

Example::

    lightning-mtp fit --config configs/quickstart.yaml
    lightning-mtp fit --config configs/mtp.yaml --model.init_args.mtp.depth 2
"""

from __future__ import annotations

import os
from typing import Optional

import lightning as L
from lightning.pytorch.cli import LightningCLI


class MTPLightningCLI(LightningCLI):
    """LightningCLI whose model and data are chosen by ``class_path`` in the config (any MTP host, any data)."""

    def before_instantiate_classes(self) -> None:
        # Quiet the one-line tokenizers fork warning that would otherwise repeat per dataloader worker.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(args: Optional[list[str]] = None) -> None:
    MTPLightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
