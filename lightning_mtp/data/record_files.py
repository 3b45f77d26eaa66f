"""Finding and reading the record files of a corpus with ``datasets``: which files are records (and which corpora are
read raw), each file type read into Arrow tables, files of one type with other fields read apart, and the parts
joined with one type per field. Files that cannot be read are refused naming the file and the reason (not UTF-8,
empty, the first line that is not JSON, a ``save_to_disk`` folder), each file on its own: an empty or non-UTF-8 file
is refused beside others as it is alone. Records come in the order of their files' sorted paths, whatever their types
(the split hashes a record's position: a file sorting after the others never moves an earlier record). Gzip'd JSON and
CSV files are read decompressed; other compressed files are refused. The Arrow tables ``datasets`` writes are kept
under ``<cache_dir>/datasets/<files>/<version>``, one version (the files' sizes and modification times) at a time; a
write there that fails (the disk full) is told as the cache's, never as a corpus file that cannot be read, and the
temporary files ``datasets`` leaves behind when a build is killed or fails are removed once they are old
(:func:`remove_stale_temporaries`).

Example::

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\\n")
    >>> [p.name for p in record_files(str(folder))]
    ['a.jsonl']
"""

from __future__ import annotations

import codecs
import csv
import glob
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

from lightning_mtp.data.cache_dir import cache_write_error, cache_write_failure, writing_cache
from lightning_mtp.data.corpus import (
    COMPRESSED_RECORDS,
    CORPUS_FLAG,
    is_compressed,
    is_glob,
    walk_folder,
    warn_skipped_links,
)

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".ndjson", ".jsonl.gz", ".json.gz", ".csv.gz")
"""File types read as records (``datasets`` builders: json, parquet, csv, text by document; ``.ndjson`` is JSON
lines; the gzip'd ones are read decompressed)."""
_BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv",
             ".txt": "text", ".jsonl.gz": "json", ".json.gz": "json", ".csv.gz": "csv"}
_CSV_OPTIONS = {"keep_default_na": False, "na_values": [""]}
_BUILDER_OPTIONS: dict[str, dict[str, Any]] = {
    ".txt": {"sample_by": "document"},
    # pandas reads "NA", "None", "null", "nan", "N/A", "#N/A"... as missing by default, which would drop real texts
    # as empty records: only an empty cell is missing (null, as a Parquet file's empty value), any other is its text
    ".csv": _CSV_OPTIONS,
    ".csv.gz": _CSV_OPTIONS,
}
"""What each builder is given beyond the files."""
JSON_LINES = (".jsonl", ".ndjson", ".jsonl.gz")
_JSON_TYPES = (".json", ".json.gz", *JSON_LINES)


def record_type(path: Path) -> Optional[str]:
    """The record file type of ``path`` (a ``RECORD_SUFFIXES`` entry, lower case: ``.jsonl.gz`` for a gzip'd JSON
    lines file), or ``None`` when it is not read as records.

    Example::

        >>> record_type(Path("a.JSONL.gz")), record_type(Path("a.txt.gz")), record_type(Path("b.csv"))
        ('.jsonl.gz', None, '.csv')
    """
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes[-1:] == [".gz"] and "".join(suffixes[-2:]) in RECORD_SUFFIXES:
        return "".join(suffixes[-2:])
    suffix = Path(path).suffix.lower()
    return suffix if suffix in RECORD_SUFFIXES else None


def open_record_bytes(path: Path) -> BinaryIO:
    """``path`` opened for reading its bytes: decompressed for a gzip'd record file."""
    return gzip.open(path, "rb") if Path(path).suffix.lower() == ".gz" else open(path, "rb")  # noqa: SIM115


def record_files(corpus: Optional[str]) -> Optional[list[Path]]:
    """The files of ``corpus`` to read as records, sorted; ``None`` when the corpus is read as raw files instead.

    A file, folder or glob is records when it holds a structured file (``.jsonl``, ``.json``, ``.parquet``,
    ``.csv``, ``.ndjson``, or gzip'd ``.jsonl.gz``, ``.json.gz``, ``.csv.gz``): those and its ``.txt`` files (one
    record each) are read, nothing else, a compressed file of any other record type refused (``.jsonl.bz2``,
    ``.txt.gz``: it would not be read). Any other corpus (the standard library default, a source or ``.txt`` file, a
    folder or glob of them) is read raw: each file whole, filtered by ``--data.suffixes``, joined by EOS and cut into
    windows (a single file holds out its tail). A folder's symlinked folders are read (a link to a folder already
    read, such as one above it, is skipped with a warning). A folder that ``datasets``' ``save_to_disk`` wrote is
    refused: its Arrow files are not read.
    """
    if corpus is None:
        return None
    skipped: list[str] = []
    if is_glob(corpus):
        found = [Path(p) for p in glob.glob(corpus, recursive=True) if Path(p).is_file()]
    elif Path(corpus).is_dir():
        folders, skipped = walk_folder(Path(corpus), lambda name: name.startswith(".") or name == "__pycache__")
        found = [folder / name for folder, names in folders for name in names if not name.startswith(".")]
    else:
        found = [Path(corpus)]
    _refuse_saved_dataset(corpus, found)
    records = sorted(p for p in found if record_type(p) is not None)
    if not any(record_type(p) != ".txt" for p in records):
        return None  # read raw (which warns about skipped links itself)
    _refuse_compressed_records(found)
    warn_skipped_links(skipped)
    return records


def _refuse_compressed_records(found: Sequence[Path]) -> None:
    """Refuse a compressed file beside records whose inner ending is a record type that is not read compressed
    (``.jsonl.bz2``, ``.parquet.gz``, ``.txt.gz``): it would be left out without a word."""
    inner = {suffix for suffix in RECORD_SUFFIXES if suffix.count(".") == 1}
    for path in sorted(found):
        if is_compressed(path) and record_type(path) is None and Path(path.stem).suffix.lower() in inner:
            raise ValueError(
                f"{CORPUS_FLAG}: {path} is compressed ({path.suffix}) and would not be read: records are read "
                f"compressed from {COMPRESSED_RECORDS} files only; decompress it, or move it out of the corpus")


_SAVED_DATASET = ("dataset_info.json", "state.json")
"""The files ``datasets.Dataset.save_to_disk`` writes beside its ``data-*.arrow`` files."""


def _refuse_saved_dataset(corpus: str, found: Sequence[Path]) -> None:
    """Refuse a ``save_to_disk`` folder (``state.json``, ``dataset_info.json`` and Arrow files, or a
    ``dataset_dict.json``), which is not a format the corpus is read in."""
    names = {(p.parent, p.name) for p in found}
    saved = sorted({str(p.parent) for p in found if p.name == "dataset_dict.json" or (
        p.name == _SAVED_DATASET[1] and (p.parent, _SAVED_DATASET[0]) in names)})
    if saved:
        raise ValueError(
            f"{CORPUS_FLAG}: {saved[0]!r} is a folder that datasets' save_to_disk wrote (Arrow files with "
            f"{' and '.join(_SAVED_DATASET)}), which is not read: the corpus is records in .jsonl, .json, .parquet or "
            ".csv files (with .txt files beside them), or raw text files; write the records out, e.g. "
            "datasets.load_from_disk(DIR).to_parquet('records.parquet'), and give that file")


@dataclass
class RecordPart:
    """Records read from files of one type: in JSON a record without a field holds null there (missing); in CSV
    and Parquet every record has every column, and null is an empty value."""

    dataset: Any
    files: list[str]
    json: bool


def load_record_parts(files: Sequence[Path], cache_dir: Path) -> list[RecordPart]:
    """The records of ``files``, read with ``datasets`` (Arrow, memory-mapped, local files only), in the order of
    ``files`` (sorted paths, whatever their types): one part per run of files of one type, or per file when files of
    one type have different fields (a chat file beside a text file)."""
    arrow = arrow_cache(files, cache_dir)
    remove_stale_temporaries(cache_dir / "datasets")
    parts = []
    for suffix, chosen in _runs_of_one_type(files):
        json_part = suffix in _JSON_TYPES
        if suffix != ".parquet":
            _refuse_non_utf8(chosen, cache_dir)
        _refuse_empty(suffix, chosen)
        try:
            parts.append(RecordPart(_load(suffix, chosen, arrow), chosen, json_part))
            continue
        except Exception as error:  # noqa: BLE001 - a file datasets cannot read: name it and the reason
            if len(chosen) == 1 or cache_write_failure(error) is not None:
                raise _not_loaded(suffix, chosen, error, cache_dir, arrow) from None
        for name in chosen:  # files of one type that do not read together: each on its own
            try:
                parts.append(RecordPart(_load(suffix, [name], arrow), [name], json_part))
            except Exception as error:  # noqa: BLE001
                raise _not_loaded(suffix, [name], error, cache_dir, arrow) from None
    _drop_other_versions(arrow)
    return parts


def _runs_of_one_type(files: Sequence[Path]) -> list[tuple[str, list[str]]]:
    """``files`` in their order, cut where the type changes: ``(type, names)`` per run.

    Example::

        >>> _runs_of_one_type([Path("a.jsonl"), Path("b.jsonl"), Path("c.csv"), Path("d.jsonl")])
        [('.jsonl', ['a.jsonl', 'b.jsonl']), ('.csv', ['c.csv']), ('.jsonl', ['d.jsonl'])]
    """
    runs: list[tuple[str, list[str]]] = []
    for path in files:
        kind = record_type(Path(path)) or Path(path).suffix.lower()
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(str(path))
        else:
            runs.append((kind, [str(path)]))
    return runs


def arrow_cache(files: Sequence[Path], cache_dir: Path) -> Path:
    """``<cache_dir>/datasets/<files>/<version>``: where ``datasets`` keeps the Arrow tables of ``files``. ``<files>``
    hashes their paths, ``<version>`` their sizes and modification times too: a file rewritten keeping its
    modification time (``cp -p``, ``rsync -t``, ``tar -x``), which ``datasets``' own cache would take for the old one,
    gets a new version when its size changed, as the records cache does."""
    rows = []
    for path in files:
        stat = Path(path).stat()
        rows.append([str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns])
    names = hashlib.sha1(json.dumps([row[0] for row in rows]).encode("utf-8")).hexdigest()[:16]
    version = hashlib.sha1(json.dumps(rows).encode("utf-8")).hexdigest()[:16]
    return cache_dir / "datasets" / names / version


def _drop_other_versions(arrow: Path) -> None:
    """Remove the Arrow tables of the files' other versions (older ones: their files have changed since)."""
    for other in arrow.parent.iterdir() if arrow.parent.is_dir() else ():
        if other != arrow and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)


def _load(suffix: str, files: list[str], arrow: Path) -> Any:
    return datasets_library().load_dataset(_BUILDERS[suffix], data_files=files, split="train", cache_dir=str(arrow),
                                           **_BUILDER_OPTIONS.get(suffix, {}))


def _not_loaded(suffix: str, files: list[str], error: BaseException, cache_dir: Path, arrow: Path) -> ValueError:
    """Why ``files`` did not load: the Arrow tables could not be written under ``--data.cache_dir`` (the disk full:
    the files are not to blame), else why they cannot be read (:func:`_cannot_read`)."""
    failure = cache_write_failure(error)
    if failure is not None:
        return cache_write_error(cache_dir, arrow, "Arrow tables of the record files", failure)
    return _cannot_read(suffix, files, error)


_TEMPORARY = re.compile(r"^tmp[a-z0-9_]{8}$")
"""The name of a temporary file ``datasets`` writes a table into (``tempfile.NamedTemporaryFile`` beside the cache
file it becomes, in ``map``, ``filter`` and ``select``) before renaming it."""
STALE_TEMPORARY_SECONDS = 3600
"""How long a ``datasets`` temporary file goes unmodified before it is taken for one a killed or failed build left
behind. A build that is running writes its file batch after batch (a few seconds apart): an hour leaves room for a
slow tokenizer or a process paused a while, and a concurrent run's file is never removed under it."""


def remove_stale_temporaries(folder: Path, older_than: float = STALE_TEMPORARY_SECONDS) -> list[Path]:
    """Remove the temporary files ``datasets`` left under ``folder`` (``<cache_dir>/datasets``), returning them.
    ``datasets`` removes its own when a build raises, unless removing needs a write that fails again (a full disk);
    a build killed (SIGKILL, out of memory) removes none. They are told by their name (:data:`_TEMPORARY`) and
    their age: unmodified for ``older_than`` seconds, so a concurrent run sharing the cache, which keeps writing its
    files and takes no lock while it maps, never loses one it is writing. Their names carry no process id to check,
    as this package's private files do (:func:`~lightning_mtp.data.records.remove_stale_private`).

    Example::

        >>> folder = getfixture("tmp_path")
        >>> old, new = folder / "tmpabcd1234", folder / "tmpwxyz9876"
        >>> _ = old.write_bytes(b"x"), new.write_bytes(b"x")
        >>> os.utime(old, (0, 0))
        >>> [p.name for p in remove_stale_temporaries(folder)], new.exists()
        (['tmpabcd1234'], True)
    """
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    cutoff = time.time() - older_than
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent) / name
            if not _TEMPORARY.match(name) or path.is_symlink():
                continue
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed.append(path)
            except OSError:  # gone meanwhile (another run removed it), or not ours to remove
                continue
    return removed


def _cannot_read(suffix: str, files: list[str], error: BaseException) -> ValueError:
    return _refusal(suffix, files, _unreadable(files, error))


def _refusal(suffix: str, files: list[str], reason: str) -> ValueError:
    return ValueError(f"{CORPUS_FLAG}: cannot read the {suffix} files {files[:3]} as records: {reason[:300]}")


def _refuse_empty(suffix: str, files: Sequence[str]) -> None:
    """Refuse a file of ``files`` that holds no records, naming it (the message a file alone gets, which ``datasets``
    cannot read): read beside other files it would add nothing, and a file left empty by mistake (an export that
    failed, a path mixed up) would pass unnoticed."""
    for name in files:
        if _holds_no_records(Path(name)):
            raise _refusal(suffix, [name], _empty_reason(name))


def _empty_reason(name: str) -> str:
    return f"{name} is empty: it holds no records"


def _holds_no_records(path: Path) -> bool:
    """Whether ``path`` holds no record: nothing but whitespace, a Parquet file of 0 rows, a CSV file of a header
    alone or a JSON file of an empty array (each told from the file's start or its Parquet footer, without reading
    it whole). A file that is not what its suffix says is not told empty: reading it names what is wrong."""
    if _is_blank(path):
        return True
    suffix = record_type(path) or path.suffix.lower()
    if suffix == ".parquet":
        return parquet_rows(path) == 0
    if suffix in (".csv", ".csv.gz"):
        return _csv_header_alone(path)
    if suffix in (".json", ".json.gz"):
        with open_record_bytes(path) as fh:
            start = fh.read(1 << 12).removeprefix(codecs.BOM_UTF8).lstrip()
        return start.startswith(b"[") and start[1:].lstrip().startswith(b"]")
    return False


def _csv_header_alone(path: Path) -> bool:
    """Whether a CSV file holds its header row and nothing after it but blank lines (which pandas skips). The rows
    after the header are not parsed (a cell may be longer than the ``csv`` module takes): a line that is not blank
    is a record."""
    with io.TextIOWrapper(open_record_bytes(path), encoding="utf-8-sig", errors="replace", newline="") as fh:
        try:
            header = next(csv.reader(fh), None)
        except csv.Error:  # a header the csv module cannot take: reading it with datasets names the reason
            return False
        return header is not None and not any(line.strip() for line in fh)


def parquet_rows(path: Path) -> Optional[int]:
    """The number of rows a Parquet file's footer gives; ``None`` when it cannot be read as Parquet."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # noqa: BLE001 - not Parquet: reading it with datasets names the reason
        return None


def join_record_parts(parts: Sequence[RecordPart]) -> Any:
    """One ``datasets.Dataset`` of every part's records, in order: each field cast to one type (a ``.jsonl`` file
    reads text as ``string``, a ``.parquet`` file may hold ``large_string``), and a field some parts lack is null
    there."""
    datasets = datasets_library()
    if len(parts) == 1:
        return parts[0].dataset
    features: dict[str, Any] = {}
    where: dict[str, str] = {}
    for part in parts:
        for name, feature in part.dataset.features.items():
            if name not in features or _is_null(features[name]):
                features[name], where[name] = feature, part.files[0]
    joined = []
    for part in parts:
        dataset = part.dataset
        for name in features:
            if name not in dataset.column_names:
                dataset = dataset.add_column(name, [None] * len(dataset), feature=features[name])
        dataset = dataset.select_columns(list(features))
        target = datasets.Features({name: features[name] for name in features})
        if dataset.features != target:
            try:
                dataset = dataset.cast(target)
            except Exception as error:  # noqa: BLE001 - fields of types that do not convert
                bad = next((n for n in features if dataset.features[n] != features[n]), "?")
                raise ValueError(
                    f"{CORPUS_FLAG}: the field {bad!r} holds {_type_name(dataset.features.get(bad))} in "
                    f"{part.files[0]} and {_type_name(features.get(bad))} in {where.get(bad)}, which cannot be read "
                    f"as one ({type(error).__name__}): give the field one type in every file") from None
        joined.append(dataset)
    return datasets.concatenate_datasets(joined)


def load_records(files: Sequence[Path], cache_dir: Path) -> Any:
    """The records of ``files`` as one ``datasets.Dataset`` (:func:`load_record_parts`, :func:`join_record_parts`)."""
    return join_record_parts(load_record_parts(files, cache_dir))


def _is_null(feature: Any) -> bool:
    return getattr(feature, "dtype", None) == "null"


def _type_name(feature: Any) -> str:
    dtype = getattr(feature, "dtype", None)
    return str(dtype) if isinstance(dtype, str) else type(feature).__name__


def _refuse_non_utf8(files: Sequence[str], cache_dir: Path) -> None:
    """Refuse a JSON, CSV or text file that is not UTF-8 (Arrow keeps a JSON file's bytes, and decoding them fails
    while tokenizing; a text file would be read with U+FFFD in place of its bytes, and trained on), naming the file,
    the line and the byte (of its decompressed text, for a gzip'd file): the same for every record file of a corpus.
    A file found UTF-8 is marked under ``<cache_dir>/utf8`` (by path, size and modification time), so a second fit
    does not read it again."""
    for name in files:
        stat = Path(name).stat()
        key = hashlib.sha1(f"{Path(name).resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
        mark = cache_dir / "utf8" / key
        if mark.is_file():
            continue
        try:
            where = _first_non_utf8(Path(name))
        except (OSError, EOFError) as error:  # a gzip'd file cut short or not gzip at all
            raise ValueError(f"{CORPUS_FLAG}: {name} cannot be decompressed ({type(error).__name__}: {error}): "
                             "give it whole, compressed with gzip, or decompressed") from None
        if where is None:
            with writing_cache(cache_dir, mark.parent, "marks of the record files found UTF-8"):
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.touch()
        else:
            line, offset, byte = where
            raise ValueError(f"{CORPUS_FLAG}: {name} is not UTF-8 text: line {line} (byte {offset}) holds the byte "
                             f"0x{byte:02x}, which is not UTF-8; records must be UTF-8: convert the file (e.g. "
                             "iconv -f latin1 -t utf-8)")


def _first_non_utf8(path: Path) -> Optional[tuple[int, int, int]]:
    """(line from 1, byte offset from 0, the byte) of the first byte of ``path`` that is not UTF-8; ``None`` when it
    is all UTF-8 (decoded in large blocks; read line by line only when a block fails)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open_record_bytes(path) as fh:
            while block := fh.read(1 << 24):
                decoder.decode(block)
        decoder.decode(b"", final=True)
        return None
    except UnicodeDecodeError:
        pass
    offset = 0
    with open_record_bytes(path) as fh:
        for number, line in enumerate(fh, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return number, offset + bad.start, line[bad.start]
            offset += len(line)
    return None


def _is_blank(path: Path) -> bool:
    """Whether ``path`` holds nothing but whitespace (read until its first other byte)."""
    with open_record_bytes(path) as fh:
        while chunk := fh.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _unreadable(files: Sequence[str], error: BaseException) -> str:
    """Why ``datasets`` could not read ``files``: an empty file, the first JSON line that does not parse
    (``file: line N``), else the innermost error of the chain (``datasets`` wraps the reader's own message)."""
    for name in files:
        if _holds_no_records(Path(name)):
            return _empty_reason(name)
        bad = _first_non_utf8(Path(name)) if Path(name).suffix.lower() != ".parquet" else None
        if bad is not None:
            return (f"{name} is not UTF-8 text: line {bad[0]} (byte {bad[1]}) holds the byte 0x{bad[2]:02x}; convert "
                    "the file to UTF-8")
        if record_type(Path(name)) not in JSON_LINES:
            continue
        with io.TextIOWrapper(open_record_bytes(Path(name)), encoding="utf-8", errors="replace") as fh:
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


def datasets_library() -> Any:
    import datasets

    return datasets
