"""``PredictionWriter``: the callback of ``lightning-mtp predict`` that writes the generations and the decoding stats.

One JSON line per prompt goes to ``<output_dir>/generations.jsonl`` and the decoding stats of the whole run to
``<output_dir>/stats.json`` (``self.log`` is not allowed in predict hooks). Both are written to hidden partial files
and moved into place when the run ends well, so a run that fails or is stopped (an exception, Ctrl-C, SIGTERM) leaves
the previous run's outputs untouched.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_mtp.decoding.stats import DecodeStats


class PredictionWriter(BasePredictionWriter):
    """Writes ``generations.jsonl`` (one line per prompt) and ``stats.json`` (decoding stats of the run).

    Both are written to hidden ``.<name>.partial`` files in ``output_dir`` and moved into place when the run ends
    well: a run that fails or is stopped leaves the previous run's outputs untouched (and removes its partial files).

    Args:
        output_dir: directory for the files (created). Under several processes the files get a ``.rank<N>`` suffix;
            each holds its process's share of the prompts (the padding rows that even the shares out are not
            written), and a run removes the files of an earlier run on another number of processes.

    Example::

        trainer = L.Trainer(callbacks=[PredictionWriter("predictions")])
        trainer.predict(model, datamodule=dm, return_predictions=False)
    """

    FILES = ("generations.jsonl", "stats.json")
    """Outputs; a SIGTERM stops the run after the current batch (exit status 143) with the previous ones kept."""

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"PredictionWriter.output_dir (--trainer.callbacks.init_args.output_dir) "
                             f"{str(output_dir)!r} is a file: give a folder for generations.jsonl and stats.json")
        self._stats: list[DecodeStats] = []
        self._rows = 0
        self._signal: Optional[int] = None  # a SIGTERM received during the run
        self._previous_handler: Any = None

    def _path(self, trainer: L.Trainer, name: str) -> Path:
        suffix = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        stem, ext = name.rsplit(".", 1)
        return self.output_dir / f"{stem}{suffix}.{ext}"

    def _partial(self, trainer: L.Trainer, name: str) -> Path:
        final = self._path(trainer, name)
        return final.with_name(f".{final.name}.partial")

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"PredictionWriter.output_dir (--trainer.callbacks.init_args.output_dir) "
                             f"{str(self.output_dir)!r} cannot be created: {error.strerror or error}") from None
        self._partial(trainer, "generations.jsonl").write_text("", encoding="utf-8")
        connector = getattr(trainer, "_accelerator_connector", None)
        if trainer.world_size > 1 and not getattr(connector, "use_distributed_sampler", True) and \
                trainer.is_global_zero:
            print("lightning-mtp: --trainer.use_distributed_sampler false: every process decodes every prompt (each "
                  "generations.rank<N>.jsonl holds them all)", file=sys.stderr, flush=True)
        self._stats, self._rows = [], 0
        self._signal = None
        if threading.current_thread() is threading.main_thread():  # Lightning's own handler does not stop predict
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, prediction: dict,
                           batch_indices: Optional[Sequence[int]], batch: Any, batch_idx: int,
                           dataloader_idx: int = 0) -> None:
        prompts = prediction.get("prompt_text") or [None] * len(prediction["tokens"])
        texts = prediction.get("texts") or [None] * len(prediction["tokens"])
        indices = list(batch_indices) if batch_indices else range(self._rows, self._rows + len(prediction["tokens"]))
        dataset = getattr(getattr(trainer, "datamodule", None), "predict_dataset", None)
        lines = getattr(dataset, "lines", None)  # each prompt's line in a prompts file (blank lines skipped)
        count = len(dataset) if dataset is not None and batch_indices else None
        with self._partial(trainer, "generations.jsonl").open("a", encoding="utf-8") as file:
            for index, prompt, text, tokens in zip(indices, prompts, texts, prediction["tokens"]):
                if count is not None and int(index) >= count:
                    continue  # padding that gives every process as many batches (a repeat of the first prompt)
                record = {"index": int(index), "prompt": prompt, "completion": text, "tokens": tokens}  # prompt's own
                if lines is not None and batch_indices:
                    record["line"] = lines[int(index)]
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
                self._rows += 1
        self._stats.append(prediction["stats"])
        self._stop_if_signalled(trainer)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = DecodeStats.combine(self._stats)
        generation = summary["generation"] = dict(getattr(pl_module, "mtp_generate_kwargs", {}) or {})
        datamodule = getattr(trainer, "datamodule", None)
        if generation.get("eos_token_id") is None and getattr(datamodule, "stop_ids", None):
            generation["eos_token_id"] = list(datamodule.stop_ids)  # what the rows stopped at (predict_batch)
        summary["tau_counts_bonus_token"] = True
        self._partial(trainer, "stats.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        if trainer.world_size > 1:
            trainer.strategy.barrier("predict outputs")  # every process done, or none replaces its outputs
        for name in self.FILES:  # generations first: a reader of stats.json finds its generations in place
            os.replace(self._partial(trainer, name), self._path(trainer, name))
        if trainer.is_global_zero:
            self._remove_other_layouts(trainer.world_size)
        self._restore_handler()

    def _remove_other_layouts(self, world_size: int) -> None:
        """Remove the outputs an earlier run on another number of processes left (``generations.jsonl`` beside
        ``generations.rank<N>.jsonl``): the folder holds this run's files only, whatever reads them."""
        for name in self.FILES:
            stem, ext = name.rsplit(".", 1)
            mine = {f"{stem}.rank{rank}.{ext}" for rank in range(world_size)} if world_size > 1 else {name}
            for path in [self.output_dir / name, *self.output_dir.glob(f"{stem}.rank*.{ext}")]:
                if path.name not in mine:
                    path.unlink(missing_ok=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        for name in self.FILES:
            self._partial(trainer, name).unlink(missing_ok=True)
        self._restore_handler()

    # ----------------------------------------------------------------- SIGTERM
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Only mark the stop (no collective in a handler): :meth:`_stop_if_signalled` acts after the batch."""
        self._signal = signum

    def _stop_if_signalled(self, trainer: L.Trainer) -> None:
        """After a batch: stop every rank (one all-gather under several processes, so they stop at the same batch)
        when any received SIGTERM, with exit status 143 and the previous outputs kept."""
        stop = int(self._signal or 0)
        if trainer.world_size > 1:
            mine = torch.tensor([stop], device=trainer.strategy.root_device)
            stop = int(trainer.strategy.all_gather(mine).max())
        if stop:
            if trainer.is_global_zero:
                print(f"lightning-mtp: {signal.Signals(stop).name}: predict stopped; {self.output_dir}'s earlier "
                      "outputs are kept", file=sys.stderr, flush=True)
            raise SIGTERMException(128 + stop)

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
