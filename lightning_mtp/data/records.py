"""The user's data: text and chat records in JSONL, JSON, Parquet, CSV or text files, read with ``datasets``.

``--data.init_args.corpus`` names a file, a folder (searched recursively) or a glob of ``.jsonl``, ``.json``,
``.parquet``, ``.csv`` or ``.txt`` files. They are read with the ``datasets`` library from local files into Arrow
tables (memory-mapped from ``<cache_dir>/datasets``, so a corpus larger than memory works), split into train and
validation records, and tokenized with a progress bar in several processes; the result is cached under
``<cache_dir>/records/<tokenizer>-<key>``, keyed by the files (paths, sizes, modification times), the tokenizer and
the settings.

A record is **chat** when its ``messages_field`` (default ``"messages"``) holds a list of ``{"role", "content"}``
turns: it is rendered with the tokenizer's chat template, and with ``train_on="assistant"`` (the default for chat)
only the tokens the template marks as generated (``{% generation %}``) are trained, as ``transformers``'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks them. Otherwise it is **text**: its
``text_field`` (default ``"text"``; every ``.txt`` file is one text record) is one document, with the tokenizer's own
special tokens and EOS at its end, every token trained.

Rows follow ``transformers``' conventions: ``labels`` equal ``input_ids`` where a token is trained and -100
elsewhere (the model shifts). **Packed** (the default for text): documents are concatenated into rows of ``seq_len``
tokens with ``position_ids`` restarting at each document (a document longer than a row continues in the next with
positions from 0), as ``DataCollatorWithFlattening`` lays them out; the model keeps targets and attention inside a
document. **Padded** (the default for chat): one record per row, cut at ``seq_len``, right-padded in the batch with an
``attention_mask``. Both layouts: :mod:`~lightning_mtp.data.record_rows`.

Example::

    >>> folder = getfixture("tmp_path")
    >>> _ = (folder / "docs.jsonl").write_text('{"text": "def f(): pass"}\\n{"text": "x = 1"}\\n')
    >>> [p.name for p in record_files(str(folder))]
    ['docs.jsonl']
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from torch.utils.data import Dataset

from lightning_mtp.data.atomic import atomic_write
from lightning_mtp.data.corpus import CORPUS_FLAG, is_glob
from lightning_mtp.data.record_rows import IGNORE_INDEX, PackedRows, PadCollator, RecordRows, pack, warn_cut_records
from lightning_mtp.data.tokenizers import Tokenizer, files_fingerprint

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")
"""File types read as records (``datasets`` builders: json, parquet, csv, text by document)."""
TRAIN_ON = ("all", "assistant")
_FORMAT_VERSION = 1
"""Bump when tokenization or packing changes, so old caches are not reused."""
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


def record_files(corpus: Optional[str]) -> Optional[list[Path]]:
    """The files of ``corpus`` to read as records, sorted; ``None`` when the corpus is read as raw files instead.

    A file is records when its suffix is one of :data:`RECORD_SUFFIXES`. A folder or glob is records when it holds a
    structured file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``): those and its ``.txt`` files are read, nothing
    else. Any other corpus (the standard library default, a folder of source or text files) is read raw: each file
    whole, filtered by ``--data.suffixes``, joined by EOS and cut into windows.
    """
    if corpus is None:
        return None
    if is_glob(corpus):
        found = [Path(p) for p in glob.glob(corpus, recursive=True) if Path(p).is_file()]
    elif Path(corpus).is_dir():
        found = []
        for root, dirs, names in os.walk(corpus):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            found += [Path(root) / name for name in names if not name.startswith(".")]
    else:
        found = [Path(corpus)]
    records = sorted(p for p in found if p.suffix.lower() in RECORD_SUFFIXES)
    structured = any(p.suffix.lower() != ".txt" for p in records)
    return records if records and (structured or len(found) == 1 and not Path(corpus).is_dir()) else None


@dataclass(frozen=True)
class RecordSettings:
    """How records become training rows (``TextDataModule``'s arguments of the same names)."""

    text_field: str = "text"
    messages_field: str = "messages"
    train_on: Optional[str] = None
    """``"assistant"`` or ``"all"``; ``None``: assistant tokens for chat, every token for text."""
    packing: Optional[bool] = None
    """``None``: packed for text, padded for chat."""
    seq_len: int = 256
    val_fraction: float = 0.05
    seed: int = 1234


@dataclass
class TokenizedRecords:
    """Both splits, tokenized: ``datasets.Dataset`` s with ``input_ids`` and ``labels`` (lists per record)."""

    train: Any
    val: Any
    chat: bool
    folder: Path


def load_records(files: Sequence[Path], cache_dir: Path) -> Any:
    """The records of ``files`` as one ``datasets.Dataset`` (Arrow, memory-mapped), local files only."""
    datasets = _datasets()
    parts = []
    for suffix in sorted({p.suffix.lower() for p in files}):
        chosen = [str(p) for p in files if p.suffix.lower() == suffix]
        options = {"sample_by": "document", "encoding_errors": "replace"} if suffix == ".txt" else {}
        try:
            part = datasets.load_dataset(_BUILDERS[suffix], data_files=chosen, split="train",
                                         cache_dir=str(cache_dir / "datasets"), **options)
        except Exception as error:  # noqa: BLE001 - a file datasets cannot read: name it and the reason
            raise ValueError(f"{CORPUS_FLAG}: cannot read the {suffix} files {chosen[:3]} as records: "
                             f"{_unreadable(chosen, error)[:300]}") from None
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    common = set.intersection(*(set(p.column_names) for p in parts))
    return datasets.concatenate_datasets([p.select_columns(sorted(common)) for p in parts])


def _is_blank(path: Path) -> bool:
    """Whether ``path`` holds nothing but whitespace (read until its first other byte)."""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _unreadable(files: Sequence[str], error: BaseException) -> str:
    """Why ``datasets`` could not read ``files``: an empty file, the first JSON line that does not parse
    (``file: line N``), else the innermost error of the chain (``datasets`` wraps the reader's own message)."""
    for name in files:
        if _is_blank(Path(name)):
            return f"{name} is empty: it holds no records"
        if Path(name).suffix.lower() != ".jsonl":
            continue
        with open(name, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, start=1):
                try:
                    if line.strip() and not isinstance(json.loads(line), dict):
                        return f"{name}: line {number} is not a JSON object ({{...}})"
                except json.JSONDecodeError as bad:
                    reason = bad.msg.removesuffix(" at")  # "Invalid control character at"
                    return f"{name}: line {number} is not valid JSON ({reason}, column {bad.colno})"
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _datasets() -> Any:
    import datasets

    return datasets


def record_kind(dataset: Any, settings: RecordSettings, json_records: bool = True) -> bool:
    """Whether the records are chat (``messages_field`` present) or text (``text_field``); refuses neither, and
    JSON records without the field the others have (:func:`refuse_missing_field`; in a CSV or Parquet file every
    record has every column, and a null is an empty value: skipped with the empty records)."""
    columns = dataset.column_names
    for chat, field, flag, other in ((True, settings.messages_field, "--data.messages_field", settings.text_field),
                                     (False, settings.text_field, "--data.text_field", settings.messages_field)):
        if field in columns:
            if json_records:
                refuse_missing_field(dataset, field, flag, other)
            return chat
    raise ValueError(
        f"{CORPUS_FLAG}: the records have neither a {settings.text_field!r} field (--data.text_field) nor a "
        f"{settings.messages_field!r} field (--data.messages_field); their fields are {sorted(columns)}: name the "
        "field that holds the text or the chat turns"
    )


def refuse_missing_field(dataset: Any, field: str, flag: str, other: str) -> None:
    """Raise when some records lack ``field`` (or hold null there): a file that mixes chats and texts, or records
    with a misspelt field, would otherwise lose those records silently."""
    column = dataset.data.column(field)  # Arrow: records without the field hold null
    missing = column.null_count
    if missing == 0:
        return
    first = next(i for i, value in enumerate(column.is_null().to_pylist()) if value)
    fields = sorted(key for key, value in dataset[first].items() if value is not None)
    mixed = f"; the corpus mixes {field!r} and {other!r} records, which one fit cannot train together" if (
        other in fields) else ""
    raise ValueError(f"{CORPUS_FLAG}: {missing} of {len(dataset)} records have no {field!r} field ({flag}); the "
                     f"first is record {first} (from 0, in file order), whose fields are {fields}{mixed}: fix or "
                     "remove those records")


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


def split_records(dataset: Any, val_fraction: float, seed: int) -> tuple[Any, Any]:
    """Deterministic train / validation records: each record's index is hashed with the seed (at least one each)."""
    count = len(dataset)
    if count < 2:
        raise ValueError(f"{CORPUS_FLAG}: {count} record(s); at least 2 are needed (one to train, one to validate)")
    scores = np.random.default_rng([seed, count]).random(count)
    val = np.flatnonzero(scores < val_fraction)
    if val.size == 0:
        val = np.array([int(np.argmin(scores))])
    if val.size == count:
        val = val[1:]
    is_val = np.zeros(count, dtype=bool)
    is_val[val] = True
    return dataset.select(np.flatnonzero(~is_val).tolist()), dataset.select(val.tolist())


def cache_folder(files: Sequence[Path], tokenizer: Tokenizer, settings: RecordSettings, cache_dir: Path) -> Path:
    """``<cache_dir>/records/<tokenizer>-<key>``: the key hashes the files, the tokenizer (its chat template
    included) and the settings."""
    payload = {"files": files_fingerprint(files), "tokenizer": tokenizer.fingerprint,
               "template": getattr(tokenizer, "chat_template", None), "settings": asdict(settings),
               "format": _FORMAT_VERSION}
    key = hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode("utf-8")).hexdigest()
    return cache_dir / "records" / f"{tokenizer.name}-{key[:16]}"


def tokenize_records(train: Any, val: Any, chat: bool, tokenizer: Tokenizer, settings: RecordSettings,
                     folder: Path, num_proc: Optional[int] = None) -> TokenizedRecords:
    """Tokenize both splits into ``folder`` (or load them when a finished run left them there)."""
    datasets = _datasets()
    meta = folder / "meta.json"
    if meta.is_file():
        return TokenizedRecords(datasets.load_from_disk(str(folder / "train")),
                                datasets.load_from_disk(str(folder / "val")), chat, folder)
    train_on = settings.train_on or ("assistant" if chat else "all")
    if chat:
        check_chat_settings(tokenizer, train_on)
    elif train_on == "assistant":
        raise ValueError(f"--data.train_on assistant needs chat records (a {settings.messages_field!r} field, "
                         f"--data.messages_field); these are text: use --data.train_on all")
    encode = _ChatEncoder(tokenizer, settings.messages_field, train_on == "assistant") if chat else _TextEncoder(
        tokenizer, settings.text_field)
    procs = num_proc if num_proc is not None else max(1, min(4, os.cpu_count() or 1))
    # datasets caps a fingerprint at 64 characters, shard suffixes (_00000_of_00004) included: the folder's name
    # (the tokenizer's, e.g. a model folder's name, and the key) is hashed to fit whatever the model is called
    stem = hashlib.sha1(folder.name.encode("utf-8")).hexdigest()[:16]
    out = {}
    for name, part in (("train", train), ("val", val)):
        mapped = part.map(encode, batched=True, remove_columns=part.column_names, desc=f"tokenizing {name}",
                          num_proc=procs if procs > 1 and len(part) >= 256 * procs else None,
                          new_fingerprint=f"{stem}-{name}")
        mapped = mapped.filter(lambda lengths: [n > 0 for n in lengths], input_columns=["length"], batched=True,
                               new_fingerprint=f"{stem}-{name}-nonempty")
        if len(mapped) < len(part):
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"{CORPUS_FLAG}: {len(part) - len(mapped)} of {len(part)} {name} records have no token to "
                           "train on and are skipped (empty texts, or chats without an assistant turn)")
        mapped.save_to_disk(str(folder / name))
        out[name] = datasets.load_from_disk(str(folder / name))
    if len(out["train"]) == 0:
        raise ValueError(f"{CORPUS_FLAG}: no training record has a token to train on (empty texts, or chats without "
                         "an assistant turn)")
    atomic_write(meta, lambda fh: fh.write(json.dumps({"chat": chat, "train_on": train_on}).encode("utf-8")))
    return TokenizedRecords(out["train"], out["val"], chat, folder)


class _TextEncoder:
    """A batch of text records -> ids (the model's special tokens, EOS last), every token trained."""

    def __init__(self, tokenizer: Tokenizer, field: str) -> None:
        self.tokenizer, self.field = tokenizer, field

    def __call__(self, batch: dict) -> dict:
        texts = [text if isinstance(text, str) else "" for text in batch[self.field]]
        encode = getattr(self.tokenizer, "encode_document", None)
        ids = encode(texts) if encode is not None else [
            [*self.tokenizer.encode(text), self.tokenizer.eos_id] for text in texts]
        ids = [row if text else [] for row, text in zip(ids, texts)]
        return {"input_ids": ids, "labels": ids, "length": [len(row) for row in ids]}


class _ChatEncoder:
    """A batch of chat records -> ids rendered with the chat template; labels -100 outside the assistant's tokens
    (``assistant_only``) or nowhere."""

    def __init__(self, tokenizer: Tokenizer, field: str, assistant_only: bool) -> None:
        self.tokenizer, self.field, self.assistant_only = tokenizer, field, assistant_only

    def __call__(self, batch: dict) -> dict:
        all_ids, all_labels = [], []
        for messages in batch[self.field]:
            if not messages:
                all_ids.append([])
                all_labels.append([])
                continue
            _check_messages(messages)
            ids, mask = self.tokenizer.render_chat(list(messages), assistant_mask=self.assistant_only)
            labels = ids if mask is None else [i if m else IGNORE_INDEX for i, m in zip(ids, mask)]
            if all(label == IGNORE_INDEX for label in labels):
                ids, labels = [], []  # nothing to train on (no assistant turn)
            all_ids.append(ids)
            all_labels.append(labels)
        return {"input_ids": all_ids, "labels": all_labels, "length": [len(row) for row in all_ids]}


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"--data.messages_field: a chat record must be a list of {{'role': str, 'content': str}} "
                         f"turns, got {str(messages)[:120]}")


# ----------------------------------------------------------------------------------------------- the corpus
class RecordCorpus:
    """The records of ``files`` for a datamodule: raw splits (for training a BPE on), then tokenized rows.

    Example::

        >>> folder = getfixture("tmp_path")
        >>> lines = [json.dumps({"text": f"def f{i}(x):\\n    return x + {i}\\n"}) for i in range(40)]
        >>> _ = (folder / "code.jsonl").write_text("\\n".join(lines))
        >>> from lightning_mtp.data.tokenizers import ByteTokenizer
        >>> corpus = RecordCorpus(record_files(str(folder)), RecordSettings(seq_len=32), folder / "cache")
        >>> corpus.build(ByteTokenizer(), num_proc=1)
        >>> row = corpus.train_rows[0]
        >>> sorted(row), row["input_ids"].shape
        (['input_ids', 'labels', 'position_ids'], torch.Size([32]))
    """

    def __init__(self, files: Sequence[Path], settings: RecordSettings, cache_dir: Path) -> None:
        self.files, self.settings, self.cache_dir = list(files), settings, Path(cache_dir)
        self._splits: Optional[tuple[Any, Any]] = None
        self.chat: Optional[bool] = None
        self.tokenized: Optional[TokenizedRecords] = None
        self.train_rows: Optional[Dataset] = None
        self.val_rows: Optional[Dataset] = None
        self.packed: Optional[bool] = None

    def splits(self) -> tuple[Any, Any]:
        """The raw (train, val) records, read once."""
        if self._splits is None:
            records = load_records(self.files, self.cache_dir)
            json_records = all(p.suffix.lower() in (".json", ".jsonl") for p in self.files)
            self.chat = record_kind(records, self.settings, json_records)
            self._splits = split_records(records, self.settings.val_fraction, self.settings.seed)
        return self._splits

    def training_texts(self) -> Iterator[str]:
        """The train split's text (chat: every turn's content), e.g. to train a BPE tokenizer on."""
        train, _ = self.splits()
        field = self.settings.messages_field if self.chat else self.settings.text_field
        for batch in train.select_columns([field]).iter(batch_size=1024):
            for value in batch[field]:
                if self.chat:
                    yield from (turn.get("content") or "" for turn in value or [])
                elif isinstance(value, str):
                    yield value

    def build(self, tokenizer: Tokenizer, num_proc: Optional[int] = None) -> None:
        """Tokenize (or load the cache) and lay the rows out: packed or one record per row."""
        if self.train_rows is not None:
            return
        train, val = self.splits()
        folder = cache_folder(self.files, tokenizer, self.settings, self.cache_dir)
        self.tokenized = tokenize_records(train, val, bool(self.chat), tokenizer, self.settings, folder, num_proc)
        self.packed = self.settings.packing if self.settings.packing is not None else not self.chat
        seq_len = self.settings.seq_len
        if self.packed:
            self.train_rows = PackedRows(pack(self.tokenized.train, seq_len, folder / "packed-train"), seq_len)
            val_tokens = int(sum(self.tokenized.val["length"]))
            self.val_rows = (PackedRows(pack(self.tokenized.val, seq_len, folder / "packed-val"), seq_len)
                             if val_tokens >= seq_len else RecordRows(self.tokenized.val, seq_len))
        else:
            self.train_rows = RecordRows(self.tokenized.train, seq_len)
            self.val_rows = RecordRows(self.tokenized.val, seq_len)
            warn_cut_records(self.tokenized.train, seq_len)

    def collate(self, rows: Dataset, pad_id: int) -> Optional[PadCollator]:
        """The collator ``rows`` need: none for packed rows (all ``seq_len`` long), else right padding."""
        return None if isinstance(rows, PackedRows) else PadCollator(pad_id)

    def held_out_prompts(self, tokenizer: Tokenizer, count: int, prompt_tokens: int) -> tuple[list, list]:
        """(ids, text) of the first ``count`` validation records as prompts: a chat up to its last assistant turn
        with the generation prompt, a text's first ``prompt_tokens`` tokens."""
        _, val = self.splits()
        prompts, texts = [], []
        field = self.settings.messages_field if self.chat else self.settings.text_field
        for value in val.select_columns([field]).select(range(min(count, len(val))))[field]:
            if self.chat:
                turns = list(value or [])
                last = max((i for i, t in enumerate(turns) if t.get("role") == "assistant"), default=len(turns))
                ids, _ = tokenizer.render_chat(turns[:last], generation_prompt=True)
            else:
                ids = tokenizer.encode_prompt(value or "")[:prompt_tokens]
            if ids:
                prompts.append(ids)
                texts.append(tokenizer.decode(ids, skip_special_tokens=False))
        return prompts, texts
