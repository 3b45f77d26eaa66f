"""``lightning-mtp``: the LightningCLI entry point (fit / validate / test / predict).

Example::

    lightning-mtp fit --config configs/quickstart.yaml
    lightning-mtp fit --config configs/mtp.yaml --model.init_args.mtp.depth 2
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI


class MTPLightningCLI(LightningCLI):
    """LightningCLI whose model and data are chosen by ``class_path`` in the config (any MTP host, any data)."""

    def _parse_ckpt_path(self) -> None:
        """Model hyperparameters from ``--ckpt_path`` override the config, except ``generation`` (decoding settings
        belong to the predict config). lightning-mtp hosts save plain init args (no ``_class_path``), read here with
        ``torch.load(weights_only=True)``."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = dict(torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {}))
        hparams.pop("_instantiator", None)
        hparams.pop("generation", None)
        hparams.pop("init_from", None)
        if not hparams:
            return
        class_path = hparams.pop("_class_path", None) or self.config[subcommand].model.class_path
        update = {subcommand: {"model": {"class_path": class_path, "init_args": hparams}}}
        self.config = self.parser.parse_object(update, self.config)

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
