"""The user's data: text and chat records in JSONL, JSON, Parquet, CSV or text files, read with ``datasets``.

``--data.init_args.corpus`` names a file, a folder (searched recursively) or a glob of ``.jsonl``, ``.json``,
``.parquet``, ``.csv`` files (``.txt`` files beside them are one record each). They are read with the ``datasets``
library from local files into Arrow tables (memory-mapped from ``<cache_dir>/datasets``, so a corpus larger than
memory works), split into train and validation records by a hash of each record's index and the seed (appending
records never moves an earlier one), and tokenized with a progress bar in several processes; the result is cached
under ``<cache_dir>/records/<tokenizer>-<key>``, keyed by the files (paths, sizes, modification times), the tokenizer
and the settings, written in a private folder and renamed into place (runs sharing the cache never collide).

A record is **chat** when its ``messages_field`` (default ``"messages"``) holds a list of ``{"role", "content"}``
turns: it is rendered with the tokenizer's chat template, and with ``train_on="assistant"`` (the default for chat)
only the tokens the template marks as generated (``{% generation %}``) are trained, as ``transformers``'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks them. Otherwise it is **text**: its
``text_field`` (default ``"text"``; every ``.txt`` file is one text record) is one document, with the tokenizer's own
special tokens and EOS at its end, every token trained. Records of a ``prompt`` and a ``completion`` (``trl``'s SFT
format) are read too: :mod:`~lightning_mtp.data.completion_records`.

Rows follow ``transformers``' conventions: ``labels`` equal ``input_ids`` where a token is trained and -100
elsewhere (the model shifts). **Packed** (the default for text): documents are concatenated into rows of ``seq_len``
tokens with ``position_ids`` restarting at each document (a document longer than a row continues in the next with
positions from 0), as ``DataCollatorWithFlattening`` lays them out; the model keeps targets and attention inside a
document. **Padded** (the default for chat): one record per row, cut at ``seq_len``, right-padded in the batch with an
``attention_mask``. Both layouts: :mod:`~lightning_mtp.data.record_rows`.

Example::

    >>> from lightning_mtp.data.record_files import record_files
    >>> folder = getfixture("tmp_path")
    >>> _ = (folder / "docs.jsonl").write_text('{"text": "def f(): pass"}\\n{"text": "x = 1"}\\n')
    >>> [p.name for p in record_files(str(folder))]
    ['docs.jsonl']
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from torch.utils.data import Dataset

from lightning_mtp.data import completion_records as completions
from lightning_mtp.data.atomic import atomic_write, private_folder, publish_folder
from lightning_mtp.data.cache_dir import check_free_space, writing_cache
from lightning_mtp.data.chat_records import (
    TOOLS_FIELD,
    TURNS_VERSION,
    ChatEncoder,
    chat_turns,
    check_chat_settings,
    record_tools,
)
from lightning_mtp.data.corpus import CORPUS_FLAG
from lightning_mtp.data.record_files import RecordPart, datasets_library, join_record_parts, load_record_parts
from lightning_mtp.data.record_rows import PackedRows, PadCollator, RecordRows, pack, warn_cut_records
from lightning_mtp.data.record_sources import record_source
from lightning_mtp.data.tokenizers import Tokenizer, files_fingerprint

TRAIN_ON = ("all", "assistant")
_FORMAT_VERSION = 4
"""Bump when the split, tokenization or packing changes, so old caches are not reused (2: the split hashes each
record's index with the seed, independent of the number of records; caches written privately, then renamed; 3: CSV
cells such as "NA" or "null" are their text, no longer missing; 4: records in the order of their files' paths across
file types, and the skipped records counted in ``meta.json``, warned on every load)."""


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
    completion: bool = False  # plain prompt-completion records (completion_records)


def record_kind(dataset: Any, settings: RecordSettings, parts: Optional[Sequence[RecordPart]] = None) -> bool:
    """Whether the records are chat (``messages_field`` present) or text (``text_field``); refuses neither, records
    without the field the others have (:func:`refuse_missing_field`: a JSON record without it, or every record of a
    file without that column; in a CSV or Parquet file with the column a null is an empty value, skipped with the
    empty records), and text records whose field is not a string (:func:`refuse_non_string_text`). ``parts``: the
    :class:`RecordPart` s ``dataset`` joins, in order (``None``: one part of JSON records)."""
    parts = [RecordPart(dataset, [], True)] if parts is None else parts
    columns = dataset.column_names
    if completions.is_prompt_completion(columns, settings.text_field, settings.messages_field):
        pair = (completions.PROMPT, completions.COMPLETION)
        for field in pair:  # (no "mixed" advice: the other field is the record's own half)
            refuse_missing_field(dataset, field, f"a prompt-completion record's {field!r}", "", parts)
        conversational = completions.is_conversational(dataset)  # lists of turns: read as chat records
        for field in pair if not conversational else ():
            refuse_non_string_text(dataset, field, f"a prompt-completion record's {field!r}")
        return conversational
    for chat, field, flag, other in ((True, settings.messages_field, "--data.messages_field", settings.text_field),
                                     (False, settings.text_field, "--data.text_field", settings.messages_field)):
        if field in columns:
            refuse_missing_field(dataset, field, flag, other, parts)
            if not chat:
                refuse_non_string_text(dataset, field)
            return chat
    if "input_ids" in columns:
        raise ValueError(
            f"{CORPUS_FLAG}: the records hold token ids ('input_ids'), not text: the data module tokenizes text "
            f"({settings.text_field!r}, --data.text_field) or chat turns ({settings.messages_field!r}, "
            "--data.messages_field) itself with the model's tokenizer; give it those, or pass your own DataLoader of "
            "input_ids / labels batches to Trainer.fit (docs/data.md, 'Your own batches')"
        )
    raise ValueError(
        f"{CORPUS_FLAG}: the records have neither a {settings.text_field!r} field (--data.text_field) nor a "
        f"{settings.messages_field!r} field (--data.messages_field), nor 'prompt' and 'completion' fields; their "
        f"fields are {sorted(columns)}: name the field that holds the text or the chat turns (or give prompt-"
        "completion records those two fields)"
    )


def refuse_missing_field(dataset: Any, field: str, flag: str, other: str,
                         parts: Optional[Sequence[RecordPart]] = None) -> None:
    """Raise when some records lack ``field`` (a JSON record without it or with null there, or a file without the
    column): a file that mixes chats and texts, a folder of chat and text files, or records with a misspelt field
    would otherwise lose those records silently."""
    import pyarrow.compute as pc

    parts = [RecordPart(dataset, [], True)] if parts is None else parts
    missing, first, source, offset = 0, None, None, 0
    for part in parts:
        if field not in part.dataset.column_names:
            lacking, first_here = len(part.dataset), 0
        elif part.json:
            column = part.dataset.data.column(field)  # Arrow: records without the field hold null
            lacking = column.null_count
            first_here = pc.index(column.is_null(), True).as_py() if lacking else None
        else:
            lacking, first_here = 0, None
        if lacking and first is None:
            first = offset + first_here
            source = f"record {first_here} of {part.files[0]}" if len(parts) > 1 and len(part.files) == 1 else None
        missing += lacking
        offset += len(part.dataset)
    if missing == 0:
        return
    fields = sorted(key for key, value in dataset[first].items() if value is not None)
    mixed = f"; the corpus mixes {field!r} and {other!r} records, which one fit cannot train together" if (
        other in fields) else ""
    where = f"; {source}" if source else ""
    raise ValueError(f"{CORPUS_FLAG}: {missing} of {len(dataset)} records have no {field!r} field ({flag}); the "
                     f"first is record {first} (from 0, in the order read{where}), whose fields are {fields}{mixed}: "
                     "fix or remove those records")


def refuse_tools_without_chat(dataset: Any, chat: bool) -> None:
    """Raise when records that are not chats (texts, plain prompt-completion records) offer ``tools``: only a chat
    template renders them, and they would otherwise be dropped silently."""
    if chat or TOOLS_FIELD not in dataset.column_names:
        return
    column = dataset.data.column(TOOLS_FIELD)
    offering = len(column) - column.null_count
    if offering:
        raise ValueError(f"{CORPUS_FLAG}: {offering} of {len(dataset)} records have a {TOOLS_FIELD!r} field, and "
                         "they are not chats: tools are rendered by the chat template, into chat records' turns "
                         "(--data.messages_field) only; give those records as chats, or remove their "
                         f"{TOOLS_FIELD!r}")


def refuse_non_string_text(dataset: Any, field: str, flag: str = "--data.text_field") -> None:
    """Raise when some text records hold something other than a string (a number, a list) in ``field``: they would
    otherwise be read as empty texts and skipped."""
    if getattr(dataset.features[field], "dtype", None) in ("string", "large_string", "null"):
        return  # an Arrow string column: every value a string or null
    count, first, value, at = 0, None, None, 0
    for batch in dataset.select_columns([field]).iter(batch_size=4096):
        for index, item in enumerate(batch[field], start=at):
            if item is not None and not isinstance(item, str):
                count += 1
                if first is None:
                    first, value = index, item
        at += len(batch[field])
    if count:
        raise ValueError(f"{CORPUS_FLAG}: {count} of {len(dataset)} text records hold a {field!r} field "
                         f"({flag}) that is not a string; the first is record {first} (from 0, in the "
                         f"order read), whose {field!r} is {str(value)[:60]!r} ({type(value).__name__}): a text record "
                         "holds its text as a string: fix or remove those records")


def record_scores(count: int, seed: int) -> np.ndarray:
    """A score in [0, 1) for each record index ``0 .. count - 1``: a 64-bit integer hash (splitmix64) of the index
    mixed with the seed. Each score depends on ``(seed, index)`` alone, never on ``count``: records appended later
    leave the earlier records' scores (and so their split) as they were.

    Example::

        >>> bool((record_scores(5, seed=1) == record_scores(9, seed=1)[:5]).all())
        True
    """
    key = int.from_bytes(hashlib.sha256(f"lightning-mtp split {seed}".encode()).digest()[:8], "little")
    z = np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key)  # wraps mod 2**64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # the top 53 bits: exact in a float64


def split_records(dataset: Any, val_fraction: float, seed: int) -> tuple[Any, Any]:
    """Deterministic train / validation records: a record is held out when its score (:func:`record_scores`, a hash
    of its index and the seed) is below ``val_fraction``, so appending records never moves an earlier one between the
    splits (the records of a corpus come in the order of their files' sorted paths, whatever their types, so a file
    whose path sorts last only appends). At least one record goes to each side: with none held out, the lowest score
    is; with all, the highest is trained on (only tiny corpora need this, and only there can appending move that one
    record)."""
    train, val = split_positions(len(dataset), val_fraction, seed)
    return dataset.select(train), dataset.select(val)


def split_positions(count: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The positions of :func:`split_records`' (train, val) records among ``count``."""
    if count < 2:
        raise ValueError(f"{CORPUS_FLAG}: {count} record(s); at least 2 are needed (one to train, one to validate)")
    scores = record_scores(count, seed)
    is_val = scores < val_fraction
    if not is_val.any():
        is_val[int(np.argmin(scores))] = True
    if is_val.all():
        is_val[int(np.argmax(scores))] = False
    return np.flatnonzero(~is_val).tolist(), np.flatnonzero(is_val).tolist()


def cache_folder(files_state: list, tokenizer: Tokenizer, settings: RecordSettings, cache_dir: Path) -> Path:
    """``<cache_dir>/records/<tokenizer>-<key>``: the key hashes the files (``files_state``: their
    :func:`files_fingerprint` when they were read), the tokenizer (its chat template included) and the settings."""
    payload = {"files": files_state, "tokenizer": tokenizer.fingerprint,
               "template": getattr(tokenizer, "chat_template", None), "settings": asdict(settings),
               "format": _FORMAT_VERSION, "turns": TURNS_VERSION}
    key = hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode("utf-8")).hexdigest()
    return cache_dir / "records" / f"{tokenizer.name}-{key[:16]}"


def tokenize_records(train: Any, val: Any, chat: bool, tokenizer: Tokenizer, settings: RecordSettings,
                     folder: Path, num_proc: Optional[int] = None,
                     positions: Optional[tuple[list[int], list[int]]] = None,
                     completion: bool = False, locate: Optional[Callable[[int], str]] = None) -> TokenizedRecords:
    """Tokenize both splits into ``folder`` (or load them when a finished run left them there). ``positions``: the
    splits' records' positions in the corpus (:func:`split_positions`), which a refused chat record is named by;
    ``locate``: where the record at a corpus position is (:func:`~lightning_mtp.data.record_sources.record_source`),
    which the first skipped record is named by.

    The splits are written into a folder private to this process beside ``folder`` and renamed into place when
    complete (:func:`~lightning_mtp.data.atomic.publish_folder`): runs sharing a cache directory (a sweep started
    from one folder) never write into the files another one reads; when another run finished first, its folder is
    used and this one's dropped. Records with nothing to train on are counted in ``meta.json`` with where the first
    is, and warned about whenever the splits are loaded (:func:`_load_tokenized`), not only by the fit that tokenizes
    them. A write that fails (the disk full, here or in ``datasets``' tables under ``<cache_dir>/datasets``) is
    refused in one line naming ``--data.cache_dir`` (:func:`~lightning_mtp.data.cache_dir.writing_cache`), the
    private folder removed."""
    if _tokenized(folder):
        return _load_tokenized(folder, chat, completion)
    train_on = settings.train_on or ("assistant" if chat or completion else "all")
    if chat:
        check_chat_settings(tokenizer, train_on)
    elif train_on == "assistant" and not completion:
        raise ValueError(f"--data.train_on assistant needs chat records (a {settings.messages_field!r} field, "
                         f"--data.messages_field); these are text: use --data.train_on all")
    tools_feature = train.features.get(TOOLS_FIELD)  # how Arrow holds the records' tools (record_tools)
    encoders = {name: ChatEncoder(tokenizer, settings.messages_field, train_on == "assistant",
                                   None if positions is None else positions[i], tools_feature) if chat else
                completions.CompletionEncoder(tokenizer, train_on == "assistant") if completion else
                _TextEncoder(tokenizer, settings.text_field) for i, name in enumerate(("train", "val"))}
    procs = num_proc if num_proc is not None else max(1, min(4, os.cpu_count() or 1))
    # datasets caps a fingerprint at 64 characters, shard suffixes (_00000_of_00004) included: the folder's name
    # (the tokenizer's, e.g. a model folder's name, and the key) is hashed to fit whatever the model is called
    stem = hashlib.sha1(folder.name.encode("utf-8")).hexdigest()[:16]
    with writing_cache(folder.parent.parent, folder, "tokenized records"):
        remove_stale_private(folder.parent)
        tmp = private_folder(folder)
        try:
            kept, skipped = {}, {}
            for split, (name, part) in enumerate((("train", train), ("val", val))):
                mapped = part.map(encoders[name], batched=True, with_indices=True, remove_columns=part.column_names,
                                  desc=f"tokenizing {name}",
                                  num_proc=procs if procs > 1 and len(part) >= 256 * procs else None,
                                  new_fingerprint=f"{stem}-{name}")
                nonempty = mapped.filter(lambda lengths: [n > 0 for n in lengths], input_columns=["length"],
                                         batched=True, new_fingerprint=f"{stem}-{name}-nonempty")
                skipped[name] = [len(part) - len(nonempty), len(part)]
                if len(nonempty) < len(part):
                    skipped[name].append(_first_skipped(mapped, name, None if positions is None else positions[split],
                                                        locate))
                kept[name] = len(nonempty)
                nonempty.save_to_disk(str(tmp / name))
            for name, part, what, advice in (("train", train, "training", ""),
                                             ("val", val, "validation", ": raise --data.val_fraction")):
                if kept[name] == 0:  # a fit without validation would say so only in Lightning's warnings
                    raise ValueError(f"{CORPUS_FLAG}: no {what} record has a token to train on (its {len(part)} "
                                     f"record(s) are empty texts, or chats without an assistant turn){advice}")
            meta = {"chat": chat, "train_on": train_on, "skipped": skipped}
            atomic_write(tmp / "meta.json", lambda fh: fh.write(json.dumps(meta).encode("utf-8")))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_folder(tmp, folder, _tokenized)
    return _load_tokenized(folder, chat, completion)


def _first_skipped(mapped: Any, name: str, positions: Optional[list[int]],
                   locate: Optional[Callable[[int], str]]) -> str:
    """Where the first record of the split ``name`` tokenized into ``mapped`` with no token to train on is: its file
    and line (``locate`` of its corpus position, ``positions[index in the split]``) where they are known."""
    first = int(np.flatnonzero(np.asarray(mapped["length"]) == 0)[0])  # its place in the split
    if positions is None:
        return f"{name} record {first} (from 0)"
    at = positions[first]  # its place in the corpus
    return locate(at) if locate is not None else f"record {at} (from 0, in the order read)"


def _tokenized(folder: Path) -> bool:
    return (folder / "meta.json").is_file()


def _load_tokenized(folder: Path, chat: bool, completion: bool = False) -> TokenizedRecords:
    """The tokenized splits in ``folder``, warning about the records skipped when they were tokenized."""
    _warn_skipped(json.loads((folder / "meta.json").read_text(encoding="utf-8")).get("skipped", {}))
    datasets = datasets_library()
    return TokenizedRecords(datasets.load_from_disk(str(folder / "train")),
                            datasets.load_from_disk(str(folder / "val")), chat, folder, completion)


def _warn_skipped(skipped: dict[str, list]) -> None:
    """Warn (rank zero) about each split's records that have no token to train on (``{split: [skipped, total,
    where the first is]}``; a cache written before the place was kept has the counts alone)."""
    from lightning.pytorch.utilities import rank_zero_warn

    for name, (count, total, *first) in skipped.items():
        if count:
            where = f"; the first is {first[0]}" if first else ""
            rank_zero_warn(f"{CORPUS_FLAG}: {count} of {total} {name} records have no token to train on and are "
                           f"skipped (empty texts or completions, or chats without an assistant turn){where}")


_PRIVATE = re.compile(r"^\..+\.(\d+)-[^.]+\.(tmp|stale)$")
"""The name of a folder or file :mod:`~lightning_mtp.data.atomic` writes privately: ``.<name>.<pid>-<random>.tmp``
(or ``.stale``, one being removed); group 1 is the writer's pid."""


def remove_stale_private(parent: Path) -> None:
    """Remove the private folders and files in ``parent`` whose writer is gone (a build killed part-way, SIGKILL or
    out of memory, never removes them): those of a process that is no longer running on this machine. (A process
    of another machine writing into a shared cache folder has a pid this one cannot check: removed as well.)

    Example::

        >>> folder = getfixture("tmp_path")
        >>> (folder / ".rows.999999999-abc.tmp").mkdir()
        >>> remove_stale_private(folder)
        >>> list(folder.iterdir())
        []
    """
    if os.name != "posix" or not parent.is_dir():  # os.kill(pid, 0) tells a running process on POSIX only
        return
    for entry in parent.iterdir():
        match = _PRIVATE.match(entry.name)
        if match is None or _running(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Whether a process of ``pid`` is running (or may be: one of another user)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # none of that pid, or no pid at all
        return False
    except OSError:  # PermissionError: another user's
        return True
    return True


class _TextEncoder:
    """A batch of text records -> ids (the model's special tokens, EOS last), every token trained."""

    def __init__(self, tokenizer: Tokenizer, field: str) -> None:
        self.tokenizer, self.field = tokenizer, field

    def __call__(self, batch: dict, indices: Optional[list[int]] = None) -> dict:
        texts = [text if isinstance(text, str) else "" for text in batch[self.field]]
        encode = getattr(self.tokenizer, "encode_document", None)
        ids = encode(texts) if encode is not None else [
            [*self.tokenizer.encode(text), self.tokenizer.eos_id] for text in texts]
        ids = [row if text else [] for row, text in zip(ids, texts)]
        return {"input_ids": ids, "labels": ids, "length": [len(row) for row in ids]}


# ----------------------------------------------------------------------------------------------- the corpus
class RecordCorpus:
    """The records of ``files`` for a datamodule: raw splits (for training a BPE on), then tokenized rows.

    Example::

        >>> folder = getfixture("tmp_path")
        >>> lines = [json.dumps({"text": f"def f{i}(x):\\n    return x + {i}\\n"}) for i in range(40)]
        >>> _ = (folder / "code.jsonl").write_text("\\n".join(lines))
        >>> from lightning_mtp.data.record_files import record_files
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
        self._read_state: list = []  # the files' fingerprint when splits() read them (the cache key)
        self._parts: list[RecordPart] = []  # the files' records as splits() read them (record_source)
        self.positions: Optional[tuple[list[int], list[int]]] = None  # the (train, val) records' corpus positions
        self.chat: Optional[bool] = None
        self.completion = False  # plain prompt-completion records (conversational ones are read as chat records)
        self.tokenized: Optional[TokenizedRecords] = None
        self.train_rows: Optional[Dataset] = None
        self.val_rows: Optional[Dataset] = None
        self.packed: Optional[bool] = None

    def splits(self) -> tuple[Any, Any]:
        """The raw (train, val) records, read once (``datasets`` writes tables under ``<cache_dir>/datasets`` to join
        and split them: a write that fails is refused naming ``--data.cache_dir``)."""
        if self._splits is None:
            with writing_cache(self.cache_dir, self.cache_dir / "datasets", "Arrow tables of the records"):
                self._splits = self._read_splits()
        return self._splits

    def _read_splits(self) -> tuple[Any, Any]:
        """The raw (train, val) records, read from the files."""
        self._read_state = files_fingerprint(self.files)  # before reading: a file still being written gets the
        # cache key of what was read, not of the finished file (cache_folder)
        parts = self._parts = load_record_parts(self.files, self.cache_dir)
        records = join_record_parts(parts)
        settings = self.settings
        self.chat = record_kind(records, settings, parts)
        refuse_tools_without_chat(records, self.chat)
        if completions.is_prompt_completion(records.column_names, settings.text_field, settings.messages_field):
            self.completion = not self.chat
            if self.chat:
                records = completions.as_chat_records(records, settings.messages_field)
        self.positions = split_positions(len(records), self.settings.val_fraction, self.settings.seed)
        return records.select(self.positions[0]), records.select(self.positions[1])

    def training_texts_key(self) -> str:
        """What :meth:`training_texts` depends on beyond the files: the split and the fields read."""
        settings = self.settings
        return json.dumps({"split": [settings.seed, settings.val_fraction, _FORMAT_VERSION],
                           "fields": [settings.text_field, settings.messages_field]})

    def training_texts(self) -> Iterator[str]:
        """The train split's text (chat: every turn's content), e.g. to train a BPE tokenizer on."""
        train, _ = self.splits()
        if self.completion:
            yield from completions.training_texts(train)
            return
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
        folder = cache_folder(self._read_state, tokenizer, self.settings, self.cache_dir)
        parts = self._parts
        self.tokenized = tokenize_records(train, val, bool(self.chat), tokenizer, self.settings, folder, num_proc,
                                          self.positions, self.completion,
                                          lambda position: record_source(parts, position))
        remove_stale_private(folder)  # the packed rows' private folders of a killed build
        # padded by default for chats and prompt-completion records: packed, a record cut at a row's end would train
        # its answer's tail in the next row without its prompt
        self.packed = self.settings.packing if self.settings.packing is not None else not (self.chat or self.completion)
        seq_len = self.settings.seq_len
        if self.packed:
            self.train_rows = self._packed_rows(self.tokenized.train, folder / "packed-train")
            val_tokens = int(sum(self.tokenized.val["length"]))
            self.val_rows = (self._packed_rows(self.tokenized.val, folder / "packed-val")
                             if val_tokens >= seq_len else RecordRows(self.tokenized.val, seq_len))
        else:
            self.train_rows = RecordRows(self.tokenized.train, seq_len)
            self.val_rows = RecordRows(self.tokenized.val, seq_len)
            warn_cut_records(self.tokenized.train, seq_len)

    def _packed_rows(self, records: Any, target: Path) -> PackedRows:
        """The records packed into ``target`` (:func:`pack`), written after their room on the disk is checked: the
        arrays are filled through a memory map, and a disk found full while its pages are written kills the process
        (``SIGBUS``) instead of raising an error."""
        seq_len = self.settings.seq_len
        with writing_cache(self.cache_dir, target, "packed rows"):
            if not (target / "packed.json").is_file():  # (pack's own mark of a finished folder)
                needed = 3 * np.dtype(np.int64).itemsize * int(sum(records["length"]))  # ids, labels, positions
                check_free_space(self.cache_dir, target, "packed rows", needed)
            return PackedRows(pack(records, seq_len, target), seq_len)

    def collate(self, rows: Dataset, pad_id: int) -> Optional[PadCollator]:
        """The collator ``rows`` need: none for packed rows (all ``seq_len`` long), else right padding."""
        return None if isinstance(rows, PackedRows) else PadCollator(pad_id)

    def held_out_prompts(self, tokenizer: Tokenizer, count: int, prompt_tokens: int) -> tuple[list, list]:
        """(ids, text) of the first ``count`` validation records as prompts: a chat up to its last assistant turn
        with the generation prompt, a prompt-completion record's prompt, a text's first ``prompt_tokens`` tokens."""
        _, val = self.splits()
        prompts, texts = [], []
        field = (self.settings.messages_field if self.chat else completions.PROMPT if self.completion
                 else self.settings.text_field)
        columns = [field, TOOLS_FIELD] if self.chat and TOOLS_FIELD in val.column_names else [field]
        first = val.select_columns(columns).select(range(min(count, len(val))))
        offered = first[TOOLS_FIELD] if TOOLS_FIELD in columns else [None] * len(first)
        for value, tools in zip(first[field], offered):
            if self.chat:
                turns = chat_turns(value or [], "a held-out chat record")
                last = max((i for i, t in enumerate(turns) if t.get("role") == "assistant"), default=len(turns))
                tools = record_tools(tools, "a held-out chat record", val.features.get(TOOLS_FIELD))
                ids, _ = tokenizer.render_chat(turns[:last], generation_prompt=True, tools=tools)
            elif self.completion:
                ids = tokenizer.encode_prompt(value or "")
            else:
                ids = tokenizer.encode_prompt(value or "")[:prompt_tokens]
            if ids:
                prompts.append(ids)
                texts.append(tokenizer.decode(ids, skip_special_tokens=False))
        return prompts, texts
