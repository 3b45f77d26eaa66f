"""Prompts for ``predict``: read from a .txt or .jsonl file, right-padded into batches."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset


class PromptDataset(Dataset):
    """Tokenized prompts for ``predict``: items ``{"input_ids": LongTensor[L_i], "prompt_text": str}``."""

    def __init__(self, prompts: Sequence[Sequence[int]], texts: Sequence[str]) -> None:
        if len(prompts) != len(texts):
            raise ValueError(f"PromptDataset: {len(prompts)} prompts but {len(texts)} texts")
        self.prompts = [list(p) for p in prompts]
        self.texts = list(texts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": torch.tensor(self.prompts[index], dtype=torch.long), "prompt_text": self.texts[index]}


class PromptCollator:
    """Right-pads prompts of different lengths with ``pad_id``.

    Batch: ``{"input_ids": LongTensor[B, L_max], "lengths": LongTensor[B], "prompt_text": list[str]}``.

    Example::

        >>> batch = PromptCollator(pad_id=0)([{"input_ids": torch.tensor([5, 6, 7]), "prompt_text": "a"},
        ...                                   {"input_ids": torch.tensor([8]), "prompt_text": "b"}])
        >>> batch["input_ids"].tolist(), batch["lengths"].tolist()
        ([[5, 6, 7], [8, 0, 0]], [3, 1])
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        lengths = torch.tensor([len(item["input_ids"]) for item in items], dtype=torch.long)  # [B]
        input_ids = torch.full((len(items), int(lengths.max())), self.pad_id, dtype=torch.long)  # [B, L_max]
        for row, item in enumerate(items):
            input_ids[row, : len(item["input_ids"])] = item["input_ids"]
        return {"input_ids": input_ids, "lengths": lengths, "prompt_text": [item["prompt_text"] for item in items]}


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(line: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], line)


def read_prompts_file(path: str) -> list[str]:
    """Prompts from a ``.txt`` file (one per line; ``\\n``, ``\\t`` and ``\\\\`` escapes decoded) or a ``.jsonl``
    file (one ``{"prompt": "..."}`` per line). Blank lines are skipped.

    Raises:
        ValueError: naming ``--data.predict_prompts`` when the file is missing, malformed or has no prompts.
    """
    flag = "--data.predict_prompts"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag}: prompts file {path!r} does not exist")
    suffix = file.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{flag}: prompts file {path!r} must end in .txt or .jsonl")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if suffix == ".txt":
            prompts.append(_unescape(line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{flag}: {path}:{number} is not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{flag}: {path}:{number} must be an object with a string "prompt", got {line[:80]!r}')
        if record["prompt"].strip():
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{flag}: prompts file {path!r} has no (non-blank) prompts")
    return prompts
