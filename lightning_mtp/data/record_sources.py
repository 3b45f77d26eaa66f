"""Where a record is, for a user to open: its file and line (JSON lines), row (CSV, Parquet), place in a JSON array,
or whole file (text), from its position among the records of :func:`~lightning_mtp.data.record_files.load_record_parts`'
parts (the skipped-records warning names the first one so).

Example::

    >>> folder = getfixture("tmp_path")
    >>> _ = (folder / "a.jsonl").write_text('{"text": "x"}\\n\\n{"text": ""}\\n')
    >>> parts = [RecordPart([0, 1], [str(folder / "a.jsonl")], True)]
    >>> record_source(parts, 1).replace(str(folder), "DIR")
    'DIR/a.jsonl line 3'
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lightning_mtp.data.record_files import JSON_LINES, RecordPart, open_record_bytes, parquet_rows, record_type


def record_source(parts: Sequence[RecordPart], position: int) -> str:
    """Where the record at ``position`` (from 0, in the order read) of the joined ``parts`` is, for a user to open:
    its file and line (JSON lines, blank lines counted as the file has them), its row (CSV: after the header, as
    read; Parquet: from 0), its place in a JSON file's array, or its whole file (text). Files of a part read together
    are counted record by record up to it; one that cannot be counted leaves the position among the part's files.

    Example::

        >>> folder = getfixture("tmp_path")
        >>> _ = (folder / "a.jsonl").write_text('{"text": "x"}\\n\\n{"text": ""}\\n')
        >>> _ = (folder / "b.csv").write_text("text\\nx\\n\\ny\\n")
        >>> parts = [RecordPart([0, 1], [str(folder / "a.jsonl")], True),
        ...          RecordPart([0, 1], [str(folder / "b.csv")], False)]
        >>> [record_source(parts, i).replace(str(folder), "DIR") for i in (1, 3)]
        ['DIR/a.jsonl line 3', 'DIR/b.csv row 2 after its header']
    """
    offset = 0
    for part in parts:
        size = len(part.dataset)
        if position < offset + size:
            return _source_in_files(part.files, position - offset)
        offset += size
    return f"record {position} (from 0, in the order read)"


def _source_in_files(files: Sequence[str], index: int) -> str:
    """Where the ``index`` th record (from 0) of ``files`` read together is."""
    at = index
    for name in files[:-1] if len(files) > 1 else ():
        count = _record_count(Path(name))
        if count is None:
            return f"record {index} (from 0) of the files {list(files[:3])}"
        if at < count:
            return _source_in_file(Path(name), at)
        at -= count
    return _source_in_file(Path(files[-1]), at) if files else f"record {index} (from 0, in the order read)"


def _source_in_file(path: Path, index: int) -> str:
    """Where the ``index`` th record (from 0) of the record file ``path`` is."""
    suffix = record_type(path) or path.suffix.lower()
    if suffix in JSON_LINES:
        with open_record_bytes(path) as fh:  # lines end at b"\n" alone, as the JSON lines reader cuts them
            records = (number for number, line in enumerate(fh, start=1) if line.strip())
            number = next((n for i, n in enumerate(records) if i == index), None)
        return f"{path} line {number}" if number is not None else f"{path} record {index} (from 0)"
    if suffix in (".csv", ".csv.gz"):
        return f"{path} row {index + 1} after its header"
    if suffix == ".txt":
        return f"{path} (its whole text: one record)"
    if suffix == ".parquet":
        return f"{path} row {index} (from 0)"
    return f"{path} record {index} (from 0, in its array)"


def _record_count(path: Path) -> Optional[int]:
    """How many records ``datasets`` reads from ``path`` (JSON lines: its lines that are not blank; CSV: its rows
    after the header but blank lines; a JSON array's items; a Parquet file's rows; a text file is one); ``None``
    when that cannot be told."""
    suffix = record_type(path) or path.suffix.lower()
    try:
        if suffix == ".txt":
            return 1
        if suffix == ".parquet":
            return parquet_rows(path)
        if suffix in JSON_LINES:
            with open_record_bytes(path) as fh:
                return sum(1 for line in fh if line.strip())
        with io.TextIOWrapper(open_record_bytes(path), encoding="utf-8-sig", errors="replace", newline="") as fh:
            if suffix in (".csv", ".csv.gz"):
                limit = csv.field_size_limit(1 << 30)  # a cell as long as pandas takes it
                try:
                    return max(sum(1 for row in csv.reader(fh) if row) - 1, 0)
                finally:
                    csv.field_size_limit(limit)
            items = json.load(fh)
            return len(items) if isinstance(items, list) else None
    except (OSError, ValueError, csv.Error):  # not what its suffix says: the position stays among the files
        return None
