"""Writes to the data caches under ``--data.cache_dir`` that fail part-way (the disk or the quota full), the temporary
files ``datasets`` leaves behind a killed or failed build, and the skipped-records warning naming the first one.

A full disk is made by the lowest write ``datasets`` makes (``ArrowWriter.write_table``, under its Arrow tables, its
``map`` / ``filter`` / ``select`` cache files and ``save_to_disk``) raising ``ENOSPC`` as the kernel does."""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from pathlib import Path

import pytest

from lightning_mtp.data import TextDataModule


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def texts(count: int, prefix: str = "record") -> list[str]:
    return [json.dumps({"text": f"def {prefix}_{i}(x): return x + {i}"}) for i in range(count)]


def byte_dm(corpus: Path, cache: Path, **kwargs) -> TextDataModule:
    settings = dict(tokenizer="byte", seq_len=16, batch_size=2, num_proc=1, val_fraction=0.2)
    settings.update(kwargs)
    return TextDataModule(corpus=str(corpus), cache_dir=str(cache), **settings)


@pytest.fixture
def full_disk(monkeypatch):
    """Call it to make every Arrow write ``datasets`` makes from then on fail as a full disk does."""
    from datasets.arrow_writer import ArrowWriter

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return lambda: monkeypatch.setattr(ArrowWriter, "write_table", no_space)


def assert_disk_full_refusal(error: pytest.ExceptionInfo, cache: Path, folder: str, corpus: Path) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    assert message.startswith(f"--data.cache_dir {str(cache)!r}: writing the "), message
    assert f"{str(cache / folder)}" in message, message
    assert "the disk is full (ENOSPC)" in message and "free space" in message, message
    assert "point --data.cache_dir at a disk with room" in message, message
    assert str(corpus) not in message and "cannot read" not in message, message  # the corpus is not to blame


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------- a full disk
def test_a_full_disk_while_the_arrow_tables_are_written_is_the_caches_not_the_corpus(tmp_path, full_disk):
    """It was refused as ``--data.corpus: cannot read the .jsonl files [...] as records: OSError: [Errno 28]``."""
    corpus = write_jsonl(tmp_path / "data" / "a.jsonl", texts(40))
    write_jsonl(tmp_path / "data" / "b.jsonl", texts(10, "other"))  # two files read together, then each alone
    cache = tmp_path / "cache"
    full_disk()
    with pytest.raises(ValueError) as error:
        byte_dm(corpus.parent, cache).setup("fit")
    assert_disk_full_refusal(error, cache, "datasets", corpus)
    left = files_under(cache / "datasets")
    assert not [name for name in left if name.endswith((".arrow", "dataset_info.json"))], left


def test_a_full_disk_while_records_are_tokenized_is_refused_and_leaves_no_cache_taken_for_complete(
        tmp_path, full_disk, monkeypatch):
    """It was a raw ``OSError: [Errno 28] No space left on device`` traceback from deep in ``datasets``."""
    corpus = write_jsonl(tmp_path / "a.jsonl", texts(60))
    cache = tmp_path / "cache"
    dm = byte_dm(corpus, cache)
    dm.records.splits()  # the corpus's tables fit; the tokenized records do not
    full_disk()
    with pytest.raises(ValueError) as error:
        dm.setup("fit")
    assert_disk_full_refusal(error, cache, "records", corpus)
    assert files_under(cache / "records") == []  # no private folder, no meta.json
    monkeypatch.undo()  # room again: the next fit builds the records anew and trains on every one of them
    again = byte_dm(corpus, cache)
    again.setup("fit")
    fresh = byte_dm(corpus, tmp_path / "fresh_cache")
    fresh.setup("fit")
    assert (len(again.train_dataset), len(again.val_dataset)) == (len(fresh.train_dataset), len(fresh.val_dataset))


def test_packed_rows_that_the_disk_cannot_hold_are_refused_before_they_are_written(tmp_path, monkeypatch):
    """The packed arrays are filled through a memory map: on a disk found full while the pages are written (seen on
    a 1 MiB tmpfs) the fit died of SIGBUS ("Bus error") leaving its private folder. Their size is checked first."""
    import shutil

    corpus = write_jsonl(tmp_path / "a.jsonl", texts(60))
    cache = tmp_path / "cache"
    dm = byte_dm(corpus, cache)
    dm.records.splits()
    real = shutil.disk_usage

    def little_room(path):
        usage = real(path)
        free = 1000 if Path(path).is_relative_to(cache / "records") else usage.free
        return type(usage)(usage.total, usage.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", little_room)
    with pytest.raises(ValueError) as error:
        dm.setup("fit")
    assert_disk_full_refusal(error, cache, "records", corpus)
    assert "packed rows" in str(error.value) and "0.0 MB are free" in str(error.value), error.value
    assert not list((cache / "records").glob("*/packed-*")) and not list((cache / "records").glob("*/.packed-*"))


def test_a_full_disk_while_the_token_ids_of_a_raw_corpus_are_saved_is_refused_in_one_line(tmp_path, monkeypatch):
    """A raw corpus's token ids are saved with numpy (``np.save`` into a private file renamed when complete)."""
    import numpy as np

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"mod{i}.py").write_text(f"x{i} = {i}\n" * 200, encoding="utf-8")

    def save_part_of_it(fh, array, *args, **kwargs):
        fh.write(b"\x93NUMPY half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", save_part_of_it)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError) as error:
        byte_dm(corpus, cache, suffixes=None).setup("fit")
    assert_disk_full_refusal(error, cache, "tokens", corpus)
    assert files_under(cache / "tokens") == []  # the half-written array is not left to be loaded


# ----------------------------------------------------------------------------------------------- datasets' temporaries
def test_datasets_temporary_files_a_killed_build_left_are_removed_once_old(tmp_path):
    corpus = write_jsonl(tmp_path / "a.jsonl", texts(40))
    cache = tmp_path / "cache"
    byte_dm(corpus, cache).setup("fit")
    (table,) = {p.parent for p in (cache / "datasets").rglob("cache-*.arrow")}  # where map writes its tables
    stale, running, other = table / "tmp4xka95gh", table / "tmpq1w2e3r4", table / "tmp-notes"
    for path in (stale, running, other):
        path.write_bytes(b"half an Arrow table")
    hours_ago = os.stat(stale).st_mtime - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    byte_dm(corpus, cache).setup("fit")  # a later fit on the same cache
    assert not stale.exists()
    assert running.exists(), "a file another build may still be writing is kept"
    assert other.exists(), "only datasets' temporary names are removed"


# ----------------------------------------------------------------------------------------------- skipped records
def skipped_warnings(dm: TextDataModule) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dm.setup("fit")
    return [str(w.message) for w in record if "have no token to train on and are skipped" in str(w.message)]


def test_the_skipped_records_warning_names_the_first_skipped_record_by_file_and_line(tmp_path):
    folder = tmp_path / "data"
    write_jsonl(folder / "a.jsonl", texts(30))  # no empty record: the first skipped one is in b.jsonl
    lines_b = []
    for i in range(30):
        if i % 5 == 0:
            lines_b.append("")  # a blank line: not a record, but a line of the file
        lines_b.append(json.dumps({"text": "" if i % 3 == 1 else f"y{i} = {i}"}))
    write_jsonl(folder / "b.jsonl", lines_b)
    for fit in range(2):  # the tokenizing fit and the one loading the cache
        dm = byte_dm(folder, tmp_path / "cache", val_fraction=0.3)
        found = skipped_warnings(dm)
        records = [(folder / "a.jsonl", n) for n in range(1, 31)] + [
            (folder / "b.jsonl", n) for n, line in enumerate(lines_b, start=1) if line]  # (file, line) per record
        empty = {k for k, (path, n) in enumerate(records)
                 if path.name == "b.jsonl" and json.loads(lines_b[n - 1])["text"] == ""}
        train_positions, val_positions = dm.records.positions
        for split, positions in (("train", train_positions), ("val", val_positions)):
            first = next(p for p in positions if p in empty)  # the split keeps the corpus order
            path, line = records[first]
            (message,) = [m for m in found if f" {split} records " in m]
            assert re.search(rf"the first is {re.escape(str(path))} line {line}$", message), (fit, message)
