"""Chat records: their turns (and the tools a record offers) as a chat template gets them, rendered into ids with the
template, and labels on the tokens the template marks as generated (``{% generation %}``, as ``transformers``'
``return_assistant_tokens_mask`` marks them); the checks a template must pass for that."""

from __future__ import annotations

import json
from typing import Any, Optional

from lightning_mtp.data.record_rows import IGNORE_INDEX
from lightning_mtp.data.tokenizers import Tokenizer

TURNS_VERSION = 3
"""Bump when chat turns are rendered differently (2: a turn's null keys are dropped first, :func:`chat_turns`; 3: a
record's ``tools`` are rendered too, :func:`record_tools`)."""

TOOLS_FIELD = "tools"
"""The field of a chat record (or chat prompt) holding the tools it offers: a list of JSON-schema function dicts, as
``transformers``' ``apply_chat_template(messages, tools=...)`` takes them and ``trl`` reads its ``tools`` column."""


def check_chat_settings(tokenizer: Tokenizer, train_on: str) -> None:
    """Chat records need a chat template, and ``train_on="assistant"`` one that marks the generated tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError(
            f"--data.messages_field: the records are chat, and the tokenizer {tokenizer.name} has no chat template: "
            "give --data.tokenizer the model folder whose tokenizer_config.json (or chat_template.jinja) has one"
        )
    if train_on == "assistant" and not tokenizer.marks_generation():
        raise ValueError(
            "--data.train_on assistant: the chat template does not mark the assistant's tokens with "
            "{% generation %} ... {% endgeneration %}, so they cannot be told apart: add those marks around the "
            "assistant content in the template, or train on every token with --data.train_on all"
        )
    if train_on == "assistant" and not _trains_end_of_turn(tokenizer):
        from lightning.pytorch.utilities import rank_zero_warn

        token = tokenizer.decode([tokenizer.end_of_turn_id], skip_special_tokens=False)
        rank_zero_warn(f"--data.train_on assistant: the chat template's end of turn {token!r} lies outside its "
                       "{% generation %} marks, so the model is never trained to end an answer with it (predict stops "
                       "there, or at EOS): move {% endgeneration %} after it in the template")


def _trains_end_of_turn(tokenizer: Tokenizer) -> bool:
    """Whether the template's end-of-turn token (``end_of_turn_id``) is among the tokens it marks as generated, in a
    short rendered chat (``True`` where there is none to check)."""
    turn = getattr(tokenizer, "end_of_turn_id", None)
    if turn is None:
        return True
    try:
        ids, mask = tokenizer.render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}],
                                          assistant_mask=True)
    except Exception:  # noqa: BLE001 - a template that needs other turns: nothing to check here
        return True
    return any(token == turn and marked for token, marked in zip(ids, mask or []))


class ChatEncoder:
    """A batch of chat records -> ids rendered with the chat template; labels -100 outside the assistant's tokens
    (``assistant_only``) or nowhere."""

    def __init__(self, tokenizer: Tokenizer, field: str, assistant_only: bool,
                 positions: Optional[list[int]] = None, tools_feature: Any = None) -> None:
        self.tokenizer, self.field, self.assistant_only = tokenizer, field, assistant_only
        self.positions = positions  # the split's records' positions in the corpus (None: the split's own)
        self.tools_feature = tools_feature  # the records' ``datasets`` feature of TOOLS_FIELD (record_tools)

    def __call__(self, batch: dict, indices: Optional[list[int]] = None) -> dict:
        all_ids, all_labels = [], []
        offered = batch[TOOLS_FIELD] if TOOLS_FIELD in batch else [None] * len(batch[self.field])
        for offset, (messages, tools) in enumerate(zip(batch[self.field], offered)):
            if not messages:
                all_ids.append([])
                all_labels.append([])
                continue
            index = None if indices is None else indices[offset]
            where = ("a chat record" if index is None else
                     f"chat record {index if self.positions is None else self.positions[index]} of the corpus "
                     "(counting from 0, files in sorted order)")
            turns = chat_turns(messages, where)
            tools = record_tools(tools, where, self.tools_feature)
            try:
                ids, mask = self.tokenizer.render_chat(turns, assistant_mask=self.assistant_only, tools=tools)
            except Exception as error:  # noqa: BLE001 - the template's own refusal (a role it lacks), named
                roles = [turn.get("role") for turn in turns]
                offers = "" if tools is None else f", {len(tools)} tools"
                raise ValueError(f"--data.messages_field: the chat template refused {where} (roles {roles}{offers}): "
                                 f"{type(error).__name__}: {error}") from error
            labels = ids if mask is None else [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
            if all(label == IGNORE_INDEX for label in labels):
                ids, labels = [], []  # nothing to train on (no assistant turn)
            all_ids.append(ids)
            all_labels.append(labels)
        return {"input_ids": all_ids, "labels": all_labels, "length": [len(row) for row in all_ids]}


def chat_turns(messages: Any, where: str = "a chat record", flag: str = "--data.messages_field") -> list[dict]:
    """A chat record's turns as the chat template gets them: each a ``{"role": str, "content": str}`` dict, whose
    other keys (``tool_calls``, ``name``...) are kept where the record has them; an assistant turn that calls tools
    may have no content (null, as OpenAI's format writes it). A key that is null is dropped: Arrow gives every turn
    of a file each key any turn has, and a template testing ``'tool_calls' in message`` must not see it on others.
    A turn of another shape is refused naming ``flag`` and ``where``.

    Example::

        >>> chat_turns([{"role": "user", "content": "Hi", "tool_calls": None}])
        [{'role': 'user', 'content': 'Hi'}]
    """
    if not isinstance(messages, list):
        raise ValueError(f"{flag}: {where} must be a list of {{'role': str, 'content': str}} turns, "
                         f"got {type(messages).__name__} {str(messages)[:80]}")
    turns = []
    for number, turn in enumerate(messages):
        problem = None
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            problem = "has no 'role' string"
        elif not isinstance(turn.get("content"), str) and not (turn.get("content") is None and turn.get("tool_calls")):
            problem = (f"has {type(turn.get('content')).__name__} content (a string is needed; null only with "
                       "'tool_calls')")
        if problem is not None:
            raise ValueError(f"{flag}: turn {number} of {where} {problem}: {str(turn)[:120]}")
        turns.append({key: value for key, value in turn.items() if value is not None or key == "content"})
    return turns


def record_tools(value: Any, where: str = "a chat record", feature: Any = None,
                 flag: str = "--data.corpus") -> Optional[list[dict]]:
    """A chat record's ``tools`` as the chat template gets them (``apply_chat_template(messages, tools=...)``): a list
    of JSON-schema function dicts, or a JSON string of one (as some data sets store it); ``None`` (null, absent or a
    blank string) for none. ``feature``: the column's ``datasets`` feature, where the records were read into Arrow: a
    key whose value is null inside an Arrow struct is dropped (:func:`without_arrow_nulls`), as Arrow gives every
    record's tools each key any record's have; values ``datasets`` keeps as JSON reach the template as the file holds
    them.

    Raises:
        ValueError: naming ``flag``, ``where`` and the field when the value is neither.

    Example::

        >>> record_tools('[{"type": "function", "function": {"name": "search"}}]')
        [{'type': 'function', 'function': {'name': 'search'}}]
        >>> record_tools(None) is None
        True
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    problem = f"{flag}: the {TOOLS_FIELD!r} field of {where} must be a list of JSON-schema function dicts"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{problem} (or a JSON string of one); it is a string that is not JSON ({error.msg}): "
                             f"{value[:80]!r}") from None
        feature = None  # parsed from the file's own text: nothing of Arrow's to drop
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        kind = type(value).__name__ if not isinstance(value, list) else "list of " + ", ".join(
            sorted({type(tool).__name__ for tool in value}))
        raise ValueError(f'{problem} ({{"type": "function", "function": {{"name": ..., "parameters": ...}}}}, or a '
                         f"JSON string of that list), got {kind} {str(value)[:80]}: fix the record, or remove its "
                         f"{TOOLS_FIELD!r}")
    return without_arrow_nulls(value, feature)


def without_arrow_nulls(value: Any, feature: Any) -> Any:
    """``value`` without the null keys of the dicts that ``feature`` (a ``datasets`` feature) reads as Arrow structs:
    a struct has one set of keys for every record of a column, null where a record lacks one, and the file's own null
    cannot be told from it there. Values under a feature that is not a struct (``datasets``' ``Json``, a string) are
    the file's own and kept whole; ``feature=None`` keeps everything.

    Example::

        >>> from datasets import Value
        >>> without_arrow_nulls([{"name": "f", "description": None}], [{"name": Value("string"),
        ...                                                            "description": Value("string")}])
        [{'name': 'f'}]
    """
    if isinstance(value, dict) and isinstance(feature, dict):
        return {key: without_arrow_nulls(item, feature.get(key)) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
        return [without_arrow_nulls(item, inner) for item in value]
    return value
