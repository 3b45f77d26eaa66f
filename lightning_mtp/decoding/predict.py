"""``predict_step`` and ``lightning-mtp predict``: decode batches of prompts and write the generations.

``predict_batch`` only wraps :func:`~lightning_mtp.decoding.generate`. :class:`PredictionWriter` writes one JSON line
per prompt to ``<output_dir>/generations.jsonl`` and the decoding stats of the whole run to
``<output_dir>/stats.json`` (``self.log`` is not allowed in predict hooks).

Example (``configs/predict.yaml``)::

    lightning-mtp predict --config configs/predict.yaml --ckpt_path model.ckpt --data.predict_prompts prompts.txt
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor, nn

from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.speculative import generate
from lightning_mtp.decoding.stats import DecodeStats


def _datamodule(module: nn.Module) -> Any:
    trainer = getattr(module, "_trainer", None)
    return getattr(trainer, "datamodule", None) if trainer is not None else None


def _generator(module: nn.Module, seed: Optional[int], device: torch.device) -> Optional[torch.Generator]:
    """One generator per module and seed, so that successive batches continue the same random stream."""
    if seed is None:
        return None
    key = (seed, str(device))
    cached = getattr(module, "_mtp_predict_generator", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.Generator(device=device).manual_seed(seed))
        module._mtp_predict_generator = cached
    return cached[1]


def predict_batch(module: nn.Module, batch: Any, **generation_kwargs: Any) -> dict:
    """Generate for a batch of prompts.

    Args:
        module: the model (an ``MTPMixin`` module).
        batch: ``{"input_ids": (B, L) right-padded, "lengths": (B,), "prompt_text": [...]}`` (TextDataModule's
            predict batches), or a dict with ``attention_mask`` instead of ``lengths``, or a (B, L) tensor.
        **generation_kwargs: :class:`~lightning_mtp.decoding.GenerationConfig` fields. ``eos_token_id`` and
            ``pad_token_id`` default to the datamodule's EOS and pad ids.

    Returns:
        ``{"tokens": [[new ids] per row], "texts": [decoded new text] or None, "prompt_text": [...] or None,
        "stats": DecodeStats}``.
    """
    if isinstance(batch, Tensor):
        batch = {"input_ids": batch}
    input_ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask")
    if attention_mask is None and batch.get("lengths") is not None:
        lengths = batch["lengths"].to(input_ids.device)
        attention_mask = torch.arange(input_ids.shape[1], device=input_ids.device) < lengths.unsqueeze(1)  # (B, L)
    datamodule = _datamodule(module)
    config = GenerationConfig(**generation_kwargs)
    if config.eos_token_id is None and getattr(datamodule, "eos_id", None) is not None:
        config.eos_token_id = int(datamodule.eos_id)
    if config.pad_token_id is None and getattr(datamodule, "pad_id", None) is not None:
        config.pad_token_id = int(datamodule.pad_id)
    kwargs = config.to_kwargs()
    seed = kwargs.pop("seed")
    device = next(module.parameters()).device
    out = generate(module, input_ids, kwargs.pop("max_new_tokens"), attention_mask=attention_mask,
                   generator=_generator(module, seed, device), **kwargs)
    tokens = [row[:count].tolist() for row, count in zip(out.new_tokens.cpu(), out.num_new_tokens.tolist())]
    tokenizer = getattr(datamodule, "tokenizer", None) if datamodule is not None else None
    texts = [tokenizer.decode(row) for row in tokens] if tokenizer is not None else None
    return {"tokens": tokens, "texts": texts, "prompt_text": batch.get("prompt_text"), "stats": out.stats}


class PredictionWriter(BasePredictionWriter):
    """Writes ``generations.jsonl`` (one line per prompt) and ``stats.json`` (decoding stats of the run).

    Both are written to hidden ``.<name>.partial`` files in ``output_dir`` and moved into place when the run ends
    well: a run that fails or is stopped leaves the previous run's outputs untouched (and removes its partial files).

    Args:
        output_dir: directory for the files (created). Under several processes the files get a ``.rank<N>`` suffix.

    Example::

        trainer = L.Trainer(callbacks=[PredictionWriter("predictions")])
        trainer.predict(model, datamodule=dm, return_predictions=False)
    """

    FILES = ("generations.jsonl", "stats.json")

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"PredictionWriter.output_dir (--trainer.callbacks.init_args.output_dir) "
                             f"{str(output_dir)!r} is a file: give a folder for generations.jsonl and stats.json")
        self._stats: list[DecodeStats] = []
        self._rows = 0

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
        self._stats, self._rows = [], 0

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, prediction: dict,
                           batch_indices: Optional[Sequence[int]], batch: Any, batch_idx: int,
                           dataloader_idx: int = 0) -> None:
        prompts = prediction.get("prompt_text") or [None] * len(prediction["tokens"])
        texts = prediction.get("texts") or [None] * len(prediction["tokens"])
        indices = list(batch_indices) if batch_indices else range(self._rows, self._rows + len(prediction["tokens"]))
        with self._partial(trainer, "generations.jsonl").open("a", encoding="utf-8") as file:
            for index, prompt, text, tokens in zip(indices, prompts, texts, prediction["tokens"]):
                record = {"index": int(index), "prompt": prompt, "completion": text, "tokens": tokens}  # prompt's own
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
                self._rows += 1
        self._stats.append(prediction["stats"])

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = DecodeStats.combine(self._stats)
        summary["generation"] = dict(getattr(pl_module, "mtp_generate_kwargs", {}) or {})
        summary["tau_counts_bonus_token"] = True
        self._partial(trainer, "stats.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        for name in self.FILES:  # generations first: a reader of stats.json finds its generations in place
            os.replace(self._partial(trainer, name), self._path(trainer, name))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        for name in self.FILES:
            self._partial(trainer, name).unlink(missing_ok=True)
