"""Prompt-completion records, as ``trl``'s SFT data has them: ``{"prompt": ..., "completion": ...}``.

Read when a corpus has neither its text field nor its messages field but both of these. **Conversational** ones
(each a list of ``{"role", "content"}`` turns) become chat records, ``messages = prompt + completion``, so the chat
template renders them and the completion's turns train as the assistant's. **Plain** ones (strings) are one
document each: the prompt's ids as a prompt is encoded for decoding (the model's BOS, as ``predict`` encodes the
prompt later), then the completion's and EOS; with ``train_on="assistant"`` (their default) only the completion and
its EOS are trained, as ``trl``'s ``completion_only_loss``.

Example::

    >>> from lightning_mtp.data.tokenizers import ByteTokenizer
    >>> row = CompletionEncoder(ByteTokenizer(), completion_only=True)({"prompt": ["1+1="], "completion": ["2"]})
    >>> row["input_ids"][0], row["labels"][0]
    ([49, 43, 49, 61, 50, 256], [-100, -100, -100, -100, 50, 256])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from lightning_mtp.data.record_rows import IGNORE_INDEX
from lightning_mtp.data.tokenizers import Tokenizer

PROMPT, COMPLETION = "prompt", "completion"
"""The fields of a prompt-completion record (``trl``'s names)."""


def is_prompt_completion(columns: list[str], text_field: str, messages_field: str) -> bool:
    """Whether records of ``columns`` are prompt-completion ones: both fields, and neither the text nor the messages
    field (which would say what the records are)."""
    return {PROMPT, COMPLETION} <= set(columns) and text_field not in columns and messages_field not in columns


def is_conversational(dataset: Any) -> bool:
    """Whether the prompts are lists of turns (else strings): Arrow gives a column one type."""
    value = next((v for v in dataset[PROMPT] if v is not None), None) if len(dataset) else None
    return isinstance(value, list)


def as_chat_records(dataset: Any, messages_field: str) -> Any:
    """Conversational prompt-completion records as chat records: ``messages_field`` = the prompt's turns, then the
    completion's (a record without one of them holds an empty list there: refused or skipped as chat records are)."""
    def join(batch: dict) -> dict:
        return {messages_field: [(prompt or []) + (completion or []) if prompt is not None and completion is not None
                                 else None for prompt, completion in zip(batch[PROMPT], batch[COMPLETION])]}

    return dataset.map(join, batched=True, remove_columns=[PROMPT, COMPLETION], desc="joining prompt and completion")


def training_texts(dataset: Any) -> Iterator[str]:
    """Every prompt and completion (to train a BPE tokenizer on)."""
    for batch in dataset.select_columns([PROMPT, COMPLETION]).iter(batch_size=1024):
        for prompt, completion in zip(batch[PROMPT], batch[COMPLETION]):
            yield from (text for text in (prompt, completion) if isinstance(text, str))


class CompletionEncoder:
    """A batch of plain prompt-completion records -> the prompt's ids (``encode_prompt``), the completion's and EOS;
    labels -100 on the prompt (``completion_only``) or nowhere. A record without a completion has nothing to train on
    (skipped and counted, as an empty text)."""

    def __init__(self, tokenizer: Tokenizer, completion_only: bool) -> None:
        self.tokenizer, self.completion_only = tokenizer, completion_only

    def __call__(self, batch: dict, indices: Optional[list[int]] = None) -> dict:
        all_ids, all_labels = [], []
        for prompt, completion in zip(batch[PROMPT], batch[COMPLETION]):
            if not isinstance(completion, str) or not completion:
                all_ids.append([])
                all_labels.append([])
                continue
            head = self.tokenizer.encode_prompt(prompt if isinstance(prompt, str) else "")
            tail = [*self.tokenizer.encode(completion), self.tokenizer.eos_id]
            all_ids.append(head + tail)
            all_labels.append(([IGNORE_INDEX] * len(head) if self.completion_only else head) + tail)
        return {"input_ids": all_ids, "labels": all_labels, "length": [len(row) for row in all_ids]}
