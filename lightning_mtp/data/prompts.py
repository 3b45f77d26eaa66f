"""Prompts for ``predict``: read from a .txt or .jsonl file, right-padded into batches."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils.data import Dataset

from lightning_mtp.data.chat_records import TOOLS_FIELD, chat_turns, record_tools


class PromptDataset(Dataset):
    """Tokenized prompts for ``predict``: items ``{"input_ids": LongTensor[L_i], "prompt_text": str}``.

    ``lines`` holds each prompt's line number (from 1) in the prompts file it was read from; ``None`` when the prompts
    did not come from a file (held-out windows).

    Example::

        >>> ds = PromptDataset([[5, 6, 7], [8]], ["a", "b"], lines=[2, 5])
        >>> ds.too_long(2), ds.lines[ds.too_long(2)[0]]
        ([0], 2)
    """

    def __init__(
        self, prompts: Sequence[Sequence[int]], texts: Sequence[str], lines: Optional[Sequence[int]] = None
    ) -> None:
        if len(prompts) != len(texts):
            raise ValueError(f"PromptDataset: {len(prompts)} prompts but {len(texts)} texts")
        if lines is not None and len(lines) != len(texts):
            raise ValueError(f"PromptDataset: {len(texts)} prompts but {len(lines)} line numbers")
        self.prompts = [list(p) for p in prompts]
        self.texts = list(texts)
        self.lines = None if lines is None else list(lines)

    def too_long(self, max_tokens: int) -> list[int]:
        """Indices of the prompts of more than ``max_tokens`` tokens, in order."""
        return [i for i, prompt in enumerate(self.prompts) if len(prompt) > max_tokens]

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

PROMPTS_FLAG = "--data.predict_prompts"

PROMPT_SUFFIXES = (".txt", ".jsonl")
"""The prompts file formats ``read_prompts_file`` reads."""


def _unescape(line: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], line)


def check_prompts_path(path: str) -> None:
    """Fail fast (before any reading) when ``--data.predict_prompts`` is not a ``.txt`` / ``.jsonl`` file.

    Raises:
        ValueError: naming ``--data.predict_prompts`` when the path is missing, a folder or has another suffix.

    Example::

        >>> import tempfile
        >>> check_prompts_path(tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --data.predict_prompts: '...' is a folder, not a file; give a .txt or .jsonl prompts file ...
    """
    file = Path(path)
    if file.is_dir():
        raise ValueError(
            f"{PROMPTS_FLAG}: {path!r} is a folder, not a file; give a .txt or .jsonl prompts file (one prompt a line)"
        )
    if not file.is_file():
        raise ValueError(f"{PROMPTS_FLAG}: prompts file {path!r} does not exist")
    if file.suffix.lower() not in PROMPT_SUFFIXES:
        raise ValueError(f"{PROMPTS_FLAG}: prompts file {path!r} must end in .txt or .jsonl")


def decode_prompts_file(data: bytes, path: str) -> str:
    """``data`` decoded as UTF-8, a leading byte order mark dropped.

    Raises:
        ValueError: naming ``--data.predict_prompts``, the file, and the line and byte of the first undecodable byte.

    Example::

        >>> decode_prompts_file("ok\\ncaf\\u00e9 au lait\\n".encode("latin-1"), "p.txt")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --data.predict_prompts: prompts file 'p.txt' is not UTF-8 text: line 2 has byte 0xe9 ...
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"{PROMPTS_FLAG}: prompts file {path!r} is not UTF-8 text: line {line} has byte 0x{data[err.start]:02x} "
            f"(byte {err.start - line_start + 1} of the line, offset {err.start} in the file) that UTF-8 cannot "
            "decode; save the file as UTF-8 (Latin-1 text converts with: iconv -f latin1 -t utf-8 FILE > NEW_FILE)"
        ) from None
    return text[1:] if text.startswith("\ufeff") else text


class ChatPrompt(list):
    """A chat prompt of a prompts file: its turns (a list of ``{"role", "content"}`` dicts, as before), and the
    ``tools`` its record offers (JSON-schema function dicts, rendered by the chat template; ``None``: none).

    Example::

        >>> prompt = ChatPrompt([{"role": "user", "content": "Hi"}], tools=[{"type": "function"}])
        >>> prompt == [{"role": "user", "content": "Hi"}], prompt.tools
        (True, [{'type': 'function'}])
    """

    def __init__(self, turns: Sequence[dict], tools: Optional[list[dict]] = None) -> None:
        super().__init__(turns)
        self.tools = tools


def read_numbered_prompts(path: str) -> list[tuple[int, Union[str, list[dict]]]]:
    """``(line number, prompt)`` pairs of a ``.txt`` file (one prompt per line; ``\\n``, ``\\t`` and ``\\\\``
    escapes decoded) or a ``.jsonl`` file (one ``{"prompt": "..."}`` per line, or a chat ``{"messages": [{"role",
    "content"}, ...]}`` or ``{"prompt": [turns]}``, which comes back as its list of turns, a :class:`ChatPrompt`
    holding the record's ``tools`` too, to be rendered with the chat template). Lines are split
    at ``\\n`` (a trailing ``\\r`` dropped) and numbered from 1 as in an editor; blank lines (and blank prompts) are
    skipped.

    Raises:
        ValueError: naming ``--data.predict_prompts`` when the file is missing, a folder, not UTF-8, malformed or has
            no prompts.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "prompts.txt"
        >>> _ = path.write_text("def f():\\\\n\\n\\nimport os\\r\\n", encoding="utf-8")
        >>> read_numbered_prompts(str(path))
        [(1, 'def f():\\n'), (3, 'import os')]
    """
    check_prompts_path(path)
    jsonl = Path(path).suffix.lower() == ".jsonl"
    prompts = []
    for number, line in enumerate(decode_prompts_file(Path(path).read_bytes(), path).split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        prompt = _jsonl_prompt(line, path, number) if jsonl else _unescape(line)
        if prompt if isinstance(prompt, list) else prompt.strip():
            prompts.append((number, prompt))
    if not prompts:
        raise ValueError(f"{PROMPTS_FLAG}: prompts file {path!r} has no (non-blank) prompts; write one prompt a line")
    return prompts


def _jsonl_prompt(line: str, path: str, number: int) -> Union[str, list[dict]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{PROMPTS_FLAG}: {path}:{number} is not valid JSON ({err.msg})") from None
    # a chat: "messages", or a conversational prompt-completion record's "prompt" turns (trl's format), read as
    # training reads a chat record's (an assistant turn calling tools may have a null content)
    turns = record.get("messages", record.get("prompt")) if isinstance(record, dict) else None
    if isinstance(turns, list):
        where = f"{path}:{number}"
        return ChatPrompt(chat_turns(turns, where, flag=PROMPTS_FLAG),
                          record_tools(record.get(TOOLS_FIELD), where, flag=PROMPTS_FLAG))
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f'{PROMPTS_FLAG}: {path}:{number} must be an object with a string "prompt" or a chat '
                         f'"messages" (or "prompt") list of {{"role", "content"}} turns, got {line[:80]!r}')
    if record_tools(record.get(TOOLS_FIELD), f"{path}:{number}", flag=PROMPTS_FLAG):
        raise ValueError(f"{PROMPTS_FLAG}: {path}:{number} offers {TOOLS_FIELD!r} with a text prompt, which is "
                         "encoded as it is, without the chat template that renders tools: give it as a chat, "
                         '{"messages": [{"role": "user", "content": "..."}], "tools": [...]}, or remove its '
                         f"{TOOLS_FIELD!r}")
    return record["prompt"]


def chat_prompt(tokenizer: Any, messages: list[dict], path: str, line: int) -> list[int]:
    """A chat prompt's ids: ``messages`` rendered with the tokenizer's chat template and its generation prompt (the
    assistant's turn opens), with the tools a :class:`ChatPrompt` offers, as the model saw chats in training."""
    render = getattr(tokenizer, "render_chat", None)
    if render is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{PROMPTS_FLAG}: {path}:{line} is a chat prompt, and the tokenizer "
                         f"{getattr(tokenizer, 'name', '?')} has no chat template: use text prompts "
                         '({"prompt": "..."}), or a model trained with a tokenizer that has one')
    return render(messages, generation_prompt=True, tools=getattr(messages, "tools", None))[0]


def read_prompts_file(path: str) -> list[Union[str, list[dict]]]:
    """The prompts of a ``.txt`` or ``.jsonl`` file, without their line numbers (see ``read_numbered_prompts``)."""
    return [prompt for _, prompt in read_numbered_prompts(path)]
