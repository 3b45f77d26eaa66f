"""``PredictionWriter``: the callback of ``lightning-mtp predict`` that writes the generations and the decoding stats.

One JSON line per prompt goes to ``<output_dir>/generations.jsonl`` and the decoding stats of the whole run to
``<output_dir>/stats.json`` (``self.log`` is not allowed in predict hooks). Both are written to hidden partial files
and moved into place when the run ends well, so a run that fails or is stopped (an exception, Ctrl-C, SIGTERM) leaves
the previous run's outputs untouched. Under several processes each writes its share of the prompts to its own hidden
partial file, and rank 0 merges the shares into the same two files, in prompt order.
"""

from __future__ import annotations

import dataclasses
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
        output_dir: directory for the files (created). Under several processes rank 0 gathers the processes' shares
            of the prompts into the same two files as one process writes: ``generations.jsonl`` in prompt order
            (the padding rows that even the shares out are not written) and ``stats.json`` over the prompts (the
            padding rows left out of the per-row counts). Where the rows carry no prompt index that is the same on
            every process (Lightning gave no ``batch_indices``, or every process decoded every prompt under
            ``--trainer.use_distributed_sampler false``) the shares cannot be merged: each process's share goes to
            ``generations.rank<N>.jsonl`` and ``stats.rank<N>.json``, with a message saying why. A run removes the
            files an earlier run of the other layout left.

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
        self._indexed = True  # every row written so far carries its prompt's own index (Lightning's batch_indices)
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
        self._stats, self._rows, self._indexed = [], 0, True
        self._signal = None
        if threading.current_thread() is threading.main_thread():  # Lightning's own handler does not stop predict
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, prediction: dict,
                           batch_indices: Optional[Sequence[int]], batch: Any, batch_idx: int,
                           dataloader_idx: int = 0) -> None:
        prompts = prediction.get("prompt_text") or [None] * len(prediction["tokens"])
        texts = prediction.get("texts") or [None] * len(prediction["tokens"])
        indices = list(batch_indices) if batch_indices else range(self._rows, self._rows + len(prediction["tokens"]))
        self._indexed = self._indexed and bool(batch_indices)  # the fallback counts this process's rows only
        dataset = getattr(getattr(trainer, "datamodule", None), "predict_dataset", None)
        lines = getattr(dataset, "lines", None)  # each prompt's line in a prompts file (blank lines skipped)
        count = len(dataset) if dataset is not None and batch_indices else None
        kept = []  # the batch's rows that are prompts
        with self._partial(trainer, "generations.jsonl").open("a", encoding="utf-8") as file:
            for row, (index, prompt, text, tokens) in enumerate(zip(indices, prompts, texts, prediction["tokens"])):
                if count is not None and int(index) >= count:
                    continue  # padding that gives every process as many batches (a repeat of the first prompt)
                record = {"index": int(index), "prompt": prompt, "completion": text, "tokens": tokens}  # prompt's own
                if lines is not None and batch_indices:
                    record["line"] = lines[int(index)]
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
                self._rows += 1
                kept.append(row)
        if kept or count is None:  # a batch of padding only decoded nothing the run asked for
            self._stats.append(_prompt_rows(prediction["stats"], kept, len(prediction["tokens"])))
        self._stop_if_signalled(trainer)

    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule, stats: list[DecodeStats]) -> str:
        """``stats.json``'s text: ``DecodeStats.combine`` over ``stats`` and the generation settings."""
        summary = DecodeStats.combine(stats)
        generation = summary["generation"] = dict(getattr(pl_module, "mtp_generate_kwargs", {}) or {})
        datamodule = getattr(trainer, "datamodule", None)
        if generation.get("eos_token_id") is None and getattr(datamodule, "stop_ids", None):
            generation["eos_token_id"] = list(datamodule.stop_ids)  # what the rows stopped at (predict_batch)
        summary["tau_counts_bonus_token"] = True
        return json.dumps(summary, indent=1)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        share = self._partial(trainer, "generations.jsonl")
        if trainer.world_size == 1:
            self._publish({"generations.jsonl": share, "stats.json": self._summary(trainer, pl_module, self._stats)})
        else:
            part = {"rows": share.read_text(encoding="utf-8"), "stats": self._stats, "indexed": self._indexed}
            share.unlink()  # before the gather: rank 0 may write a file of this name after it
            parts = _gather_on_rank_zero(trainer, part)  # every process done, or none replaces the outputs
            if trainer.is_global_zero:
                self._publish(self._merged(trainer, pl_module, parts))
            trainer.strategy.barrier("predict outputs")  # predict returns with the outputs in place on every process
        self._restore_handler()

    def _merged(self, trainer: L.Trainer, pl_module: L.LightningModule, parts: list[dict]) -> dict[str, Any]:
        """The processes' shares as one process writes them (rows in prompt order), or per process where the rows
        carry no index that is the same on every process."""
        records = [(json.loads(line)["index"], line) for part in parts for line in part["rows"].splitlines()]
        indexed = all(part["indexed"] for part in parts)
        if indexed and len({index for index, _ in records}) == len(records):
            rows = "".join(line + "\n" for _, line in sorted(records, key=lambda record: record[0]))
            stats = [s for part in parts for s in part["stats"]]
            return {"generations.jsonl": rows, "stats.json": self._summary(trainer, pl_module, stats)}
        why = ("Lightning gave the predict batches no batch_indices (the rows are numbered per process)" if not indexed
               else "the processes decoded the same prompts (--trainer.use_distributed_sampler false?)")
        print(f"lightning-mtp: {why}: generations.jsonl cannot hold every prompt once in prompt order; each process's "
              f"rows are in {self.output_dir}/generations.rank<N>.jsonl and its stats in stats.rank<N>.json",
              file=sys.stderr, flush=True)
        outputs: dict[str, Any] = {f"generations.rank{rank}.jsonl": part["rows"] for rank, part in enumerate(parts)}
        for rank, part in enumerate(parts):
            outputs[f"stats.rank{rank}.json"] = self._summary(trainer, pl_module, part["stats"])
        return outputs

    def _publish(self, outputs: dict[str, Any]) -> None:
        """Move ``outputs`` (a name's text, or its hidden partial file that holds it) into place: the folder holds this
        run's files only and, whenever the process stops, never files of two runs: each is written to a hidden
        partial first; the stats files and the files of another layout go before any generations file is replaced
        (a reader of ``stats.json`` finds its generations in place); the stats files come last."""
        partials = {}
        for name, content in outputs.items():
            partials[name] = partial = self.output_dir / f".{name}.partial"
            if isinstance(content, str):
                partial.write_text(content, encoding="utf-8")
        several = sum(name.startswith("generations") for name in outputs) > 1
        for name in self.FILES:
            stem, ext = name.rsplit(".", 1)
            for path in [self.output_dir / name, *sorted(self.output_dir.glob(f"{stem}.rank*.{ext}"))]:
                if path.name not in outputs or name == "stats.json" or several:
                    path.unlink(missing_ok=True)
        for name, partial in partials.items():  # generations first
            os.replace(partial, self.output_dir / name)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        for name in self.FILES:
            self._partial(trainer, name).unlink(missing_ok=True)
            if trainer.is_global_zero:  # the merged outputs of several processes
                (self.output_dir / f".{name}.partial").unlink(missing_ok=True)
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


def _prompt_rows(stats: Optional[DecodeStats], kept: list[int], rows: int) -> Optional[DecodeStats]:
    """A batch's stats over its prompt rows ``kept`` (of ``rows``): the padding rows leave the per-row counts (rows,
    new tokens, row forwards); the batch-wide counts (main forwards, drafts, acceptance histogram, time) cannot be
    split by row and keep a padding row's share when it shares a batch with prompts. ``None`` for padding only."""
    if stats is None or len(kept) == rows:
        return stats
    if not kept:
        return None
    return dataclasses.replace(stats, batch_size=len(kept), row_forwards=[stats.row_forwards[i] for i in kept],
                               new_tokens=[stats.new_tokens[i] for i in kept])


def _gather_on_rank_zero(trainer: L.Trainer, part: dict) -> list[dict]:
    """Every process's ``part``, in rank order, on rank 0 (an empty list elsewhere): a collective of all processes,
    so the outputs need no folder that every process can see."""
    gathered: Optional[list] = [None] * trainer.world_size if trainer.is_global_zero else None
    torch.distributed.gather_object(part, gathered, dst=0)
    return gathered or []
