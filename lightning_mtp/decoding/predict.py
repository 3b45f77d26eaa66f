"""``predict_step`` and ``lightning-mtp predict``: decode batches of prompts and write the generations.

``predict_batch`` only wraps :func:`~lightning_mtp.decoding.generate`;
:class:`~lightning_mtp.prediction_writer.PredictionWriter` writes what it returns.

Example (``configs/predict.yaml``)::

    lightning-mtp predict --config configs/predict.yaml --ckpt_path model.ckpt --data.predict_prompts prompts.txt
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.speculative import generate


def _datamodule(module: nn.Module) -> Any:
    trainer = getattr(module, "_trainer", None)
    return getattr(trainer, "datamodule", None) if trainer is not None else None


RANK_STREAM = 0x9E3779B97F4A7C15
"""Process ``r`` of a predict on several seeds its generator with ``seed + r * RANK_STREAM`` (mod 2**63): each
process draws its own stream (the same seed on every process gave their n-th rows the same samples)."""


def _generator(module: nn.Module, seed: Optional[int], device: torch.device) -> Optional[torch.Generator]:
    """One generator per module and seed, so that successive batches continue the same random stream; on several
    processes one stream per process (:data:`RANK_STREAM`), the same for the same seed and number of processes."""
    if seed is None:
        return None
    trainer = getattr(module, "_trainer", None)
    rank = int(getattr(trainer, "global_rank", 0) or 0) if trainer is not None else 0
    key = (seed, str(device), rank)
    cached = getattr(module, "_mtp_predict_generator", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.Generator(device=device).manual_seed((seed + rank * RANK_STREAM) % 2**63))
        module._mtp_predict_generator = cached
    return cached[1]


def stop_ids(module: nn.Module, datamodule: Any) -> Optional[list[int]]:
    """Where ``predict`` ends a row when no ``eos_token_id`` is given: the tokenizer's EOS and end-of-turn ids, and
    those the model's folder lists (``generation_config.json``'s ``eos_token_id``, as ``transformers``' ``generate``
    reads it: Llama 3.1's ``<|eom_id|>``, Qwen2.5's ``<|endoftext|>``); ``None`` where neither names one."""
    ids = list(getattr(datamodule, "stop_ids", None) or []) if datamodule is not None else []
    if not ids and getattr(datamodule, "eos_id", None) is not None:
        ids = [int(datamodule.eos_id)]
    hook = getattr(module, "mtp_stop_token_ids", None)
    ids += [i for i in (hook() if callable(hook) else []) if i not in ids]
    return ids or None


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
    if config.eos_token_id is None:
        config.eos_token_id = stop_ids(module, datamodule)
    if config.pad_token_id is None and getattr(datamodule, "pad_id", None) is not None:
        config.pad_token_id = int(datamodule.pad_id)
    kwargs = config.to_kwargs()
    seed = kwargs.pop("seed")
    device = next(module.parameters()).device
    out = generate(module, input_ids, kwargs.pop("max_new_tokens"), attention_mask=attention_mask,
                   generator=_generator(module, seed, device), **kwargs)
    tokens = [row[:count].tolist() for row, count in zip(out.new_tokens.cpu(), out.num_new_tokens.tolist())]
    tokenizer = getattr(datamodule, "tokenizer", None) if datamodule is not None else None
    texts = None
    if tokenizer is not None:  # each row's new text as it reads after its prompt (the prompt's padding left out)
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).bool().cpu()
        prompts = [row[keep].tolist() for row, keep in zip(input_ids.cpu(), mask)]
        texts = [tokenizer.decode_continuation(prompt, row) for prompt, row in zip(prompts, tokens)]
    return {"tokens": tokens, "texts": texts, "prompt_text": batch.get("prompt_text"), "stats": out.stats}
