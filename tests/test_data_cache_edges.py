"""Edges of the data caches and of the files a corpus is found in: the record order across file types (the split),
a file rewritten with its modification time kept, the warnings a cached fit repeats, compressed record files,
symlinked folders, the raw-only ``--data.max_bytes`` / ``--data.suffixes``, a ``--data.cache_dir`` that cannot be
written, and the private folders a killed build leaves behind."""

from __future__ import annotations

import csv
import errno
import gzip
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lightning_mtp.data import TextDataModule
from lightning_mtp.data.record_files import load_records, record_files


def write_jsonl(path: Path, texts: list[str], opener=open) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return path


def byte_dm(corpus: Path, cache: Path, **kwargs) -> TextDataModule:
    settings = dict(tokenizer="byte", seq_len=16, batch_size=2, num_proc=1, val_fraction=0.1)
    settings.update(kwargs)
    return TextDataModule(corpus=str(corpus), cache_dir=str(cache), **settings)


def split_texts(dm: TextDataModule) -> tuple[set[str], set[str]]:
    train, val = dm.records.splits()
    return set(train["text"]), set(val["text"])


def warned(action, pattern: str) -> list[str]:
    """The messages of the warnings ``action()`` gives that match ``pattern``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in record if re.search(pattern, str(w.message))]


# ----------------------------------------------------------------------------------------------- record order
def test_a_file_of_another_type_sorting_last_moves_no_earlier_record_between_the_splits(tmp_path):
    folder = tmp_path / "data"
    write_jsonl(folder / "a.jsonl", [f"orig record {i}" for i in range(200)])
    train0, val0 = split_texts(byte_dm(folder, tmp_path / "cache"))
    with open(folder / "zzz.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["text"])
        writer.writerows([f"new csv record {i}"] for i in range(30))
    train1, val1 = split_texts(byte_dm(folder, tmp_path / "cache"))
    assert val0 and val0 <= val1 and train0 <= train1


def test_records_are_read_in_the_order_of_their_files_paths_across_types(tmp_path):
    folder = tmp_path / "data"
    write_jsonl(folder / "a.jsonl", ["a0", "a1"])
    (folder / "b.csv").write_text("text\nb0\nb1\n", encoding="utf-8")
    write_jsonl(folder / "c.jsonl", ["c0"])
    (folder / "d.txt").write_text("d0", encoding="utf-8")
    assert list(load_records(record_files(str(folder)), tmp_path / "cache")["text"]) == ["a0", "a1", "b0", "b1", "c0",
                                                                                           "d0"]


# ----------------------------------------------------------------------------------------------- stale Arrow cache
def test_a_file_rewritten_with_its_modification_time_kept_is_read_anew(tmp_path):
    corpus = tmp_path / "data" / "a.jsonl"
    stamp = (1_700_000_000, 1_700_000_000)
    write_jsonl(corpus, [f"OLD record {i}" for i in range(20)])
    os.utime(corpus, stamp)
    assert all("OLD" in text for part in split_texts(byte_dm(corpus.parent, tmp_path / "cache")) for text in part)
    write_jsonl(corpus, [f"NEWNEW record {i}" for i in range(20)])  # another size, the same mtime (cp -p, rsync -t)
    os.utime(corpus, stamp)
    train, val = split_texts(byte_dm(corpus.parent, tmp_path / "cache"))
    assert all("NEWNEW" in text for text in train | val)
    # the Arrow tables of the old version are not kept beside the new ones
    assert len(list((tmp_path / "cache" / "datasets").glob("*/*"))) == 1


# ----------------------------------------------------------------------------------------------- warnings per fit
def test_the_undecodable_bytes_warning_is_repeated_by_a_fit_that_loads_the_cache(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"mod{i}.py").write_text(f"x{i} = {i}\n" * 40, encoding="utf-8")
    (corpus / "notes.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 40)
    for fit in range(2):
        dm = byte_dm(corpus, tmp_path / "cache", suffixes=None, val_fraction=0.3)
        assert len(warned(lambda dm=dm: dm.setup("fit"), r"^--data.corpus: .* are U\+FFFD .*notes.txt")) == 1, fit


def test_the_skipped_records_warning_is_repeated_by_a_fit_that_loads_the_cache(tmp_path):
    corpus = write_jsonl(tmp_path / "e.jsonl", ["" if i % 4 == 0 else f"def g{i}(): return {i}" for i in range(40)])
    for fit in range(2):
        dm = byte_dm(corpus, tmp_path / "cache", val_fraction=0.2)
        found = warned(lambda dm=dm: dm.setup("fit"), r"records have no token to train on and are skipped")
        assert found and all(m.startswith("--data.corpus: ") for m in found), fit


# ----------------------------------------------------------------------------------------------- compressed files
def test_gzip_record_files_are_read_decompressed(tmp_path):
    folder = tmp_path / "data"
    write_jsonl(folder / "a.jsonl.gz", [f"gz line {i} caf\u00e9" for i in range(10)], opener=gzip.open)
    with gzip.open(folder / "b.json.gz", "wt", encoding="utf-8") as fh:
        json.dump([{"text": "json 0"}, {"text": "json 1"}], fh)
    with gzip.open(folder / "c.csv.gz", "wt", encoding="utf-8") as fh:
        fh.write("text\nNA\ncsv 1\n")
    (folder / "d.ndjson").write_text(json.dumps({"text": "nd 0"}) + "\n", encoding="utf-8")
    files = record_files(str(folder))
    assert [p.name for p in files] == ["a.jsonl.gz", "b.json.gz", "c.csv.gz", "d.ndjson"]
    texts = list(load_records(files, tmp_path / "cache")["text"])
    assert texts == [f"gz line {i} caf\u00e9" for i in range(10)] + ["json 0", "json 1", "NA", "csv 1", "nd 0"]
    single = record_files(str(folder / "a.jsonl.gz"))  # a single file too
    assert single == [folder / "a.jsonl.gz"]


def test_a_gzip_record_file_that_is_not_utf8_or_empty_inside_is_refused_naming_it(tmp_path):
    latin = tmp_path / "latin.jsonl.gz"
    with gzip.open(latin, "wb") as fh:
        fh.write(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl.gz is not UTF-8 text: line 2 \(byte 28\) holds the byte 0xe9"):
        load_records([latin], tmp_path / "cache")
    empty = tmp_path / "empty.csv.gz"
    with gzip.open(empty, "wt") as fh:
        fh.write("text\n")
    with pytest.raises(ValueError, match=r"empty.csv.gz is empty: it holds no records"):
        load_records([empty], tmp_path / "cache")


@pytest.mark.parametrize("name", ["notes.txt.gz", "code.py.bz2", "data.xz", "data.zst", "data.zip"])
def test_a_compressed_raw_file_is_refused_naming_it(tmp_path, name):
    corpus = tmp_path / name
    corpus.write_bytes(gzip.compress(b"x = 1\n" * 100))
    with pytest.raises(ValueError, match=rf"^--data.corpus: .*{re.escape(name)} is compressed"):
        byte_dm(corpus, tmp_path / "cache").setup("fit")


def test_a_folder_of_compressed_files_is_not_advised_to_be_read_raw(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(2):
        (folder / f"part{i}.txt.gz").write_bytes(gzip.compress(b"words " * 100))
    with pytest.raises(ValueError) as caught:
        byte_dm(folder, tmp_path / "cache").setup("fit")
    assert "'[.gz]'" not in str(caught.value) and "decompress" in str(caught.value), str(caught.value)
    with pytest.raises(ValueError, match=r"part0.txt.gz is compressed"):
        byte_dm(folder, tmp_path / "cache", suffixes=[".gz"]).setup("fit")


def test_a_compressed_record_file_of_another_kind_beside_records_is_refused_naming_it(tmp_path):
    folder = tmp_path / "data"
    write_jsonl(folder / "a.jsonl", ["a"] * 5)
    (folder / "b.jsonl.bz2").write_bytes(b"BZh91AY&SY")
    with pytest.raises(ValueError, match=r"^--data.corpus: .*b.jsonl.bz2 is compressed"):
        record_files(str(folder))


def test_a_folder_of_tsv_files_is_not_advised_to_be_read_raw(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.tsv").write_text("text\tlabel\nhello\t1\n", encoding="utf-8")
    with pytest.raises(ValueError) as caught:
        byte_dm(folder, tmp_path / "cache").setup("fit")
    assert "'[.tsv]'" not in str(caught.value) and ".csv" in str(caught.value), str(caught.value)


# ----------------------------------------------------------------------------------------------- symlinked folders
def test_symlinked_folders_of_a_record_corpus_are_read(tmp_path):
    write_jsonl(tmp_path / "store" / "shard1" / "a.jsonl", [f"SHARD {i}" for i in range(20)])
    write_jsonl(tmp_path / "data" / "local.jsonl", [f"LOCAL {i}" for i in range(20)])
    os.symlink(tmp_path / "store" / "shard1", tmp_path / "data" / "shard1")
    assert [p.name for p in record_files(str(tmp_path / "data"))] == ["local.jsonl", "a.jsonl"]
    train, val = split_texts(byte_dm(tmp_path / "data", tmp_path / "cache"))
    assert len(train | val) == 40


def test_symlinked_folders_of_a_raw_corpus_are_read(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "b.py").write_text("y = 2\n" * 50, encoding="utf-8")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n" * 50, encoding="utf-8")
    os.symlink(tmp_path / "store", tmp_path / "src" / "linked")
    dm = byte_dm(tmp_path / "src", tmp_path / "cache", val_fraction=0.5)
    train, val = dm.corpus_splits()
    assert sorted(s.path.name for s in train + val) == ["a.py", "b.py"]


def test_a_link_to_a_folder_above_is_skipped_with_a_warning_naming_it(tmp_path):
    write_jsonl(tmp_path / "data" / "sub" / "a.jsonl", ["a"] * 5)
    os.symlink(tmp_path / "data", tmp_path / "data" / "sub" / "loop")
    found = []
    messages = warned(lambda: found.extend(record_files(str(tmp_path / "data"))), r"loop")
    assert found == [tmp_path / "data" / "sub" / "a.jsonl"]
    assert len(messages) == 1 and "sub/loop" in messages[0] and messages[0].startswith("--data.corpus: ")
    (tmp_path / "data" / "sub" / "a.jsonl").rename(tmp_path / "data" / "sub" / "a.py")  # a raw corpus: the same
    (tmp_path / "data" / "b.py").write_text("y = 2\n" * 50, encoding="utf-8")
    splits = []
    messages = warned(lambda: splits.append(byte_dm(tmp_path / "data", tmp_path / "cache").corpus_splits()), r"loop")
    assert sorted(s.path.name for s in splits[0][0] + splits[0][1]) == ["a.py", "b.py"]
    assert len(messages) == 1 and "sub/loop" in messages[0]


# ----------------------------------------------------------------------------------------------- raw-only flags
def test_max_bytes_and_suffixes_on_a_record_corpus_warn_that_records_are_read_whole(tmp_path):
    corpus = write_jsonl(tmp_path / "a.jsonl", [f"record number {i}" for i in range(40)])
    dm = byte_dm(corpus, tmp_path / "cache", max_bytes=100, suffixes=[".csv"])
    (message,) = warned(lambda: dm.setup("fit"), r"--data.max_bytes")
    for part in ("--data.max_bytes", "--data.suffixes", "raw", "--trainer.max_steps", "--trainer.limit_train_batches"):
        assert part in message, message
    assert len(dm.records.tokenized.train) + len(dm.records.tokenized.val) == 40
    dm = byte_dm(corpus, tmp_path / "cache", max_bytes=100)  # the default suffixes are not named
    (message,) = warned(lambda: dm.setup("fit"), r"--data.max_bytes")
    assert "--data.suffixes" not in message
    assert not warned(lambda: byte_dm(corpus, tmp_path / "cache").setup("fit"), r"--data.max_bytes")


# ----------------------------------------------------------------------------------------------- cache_dir
def test_a_cache_dir_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    corpus = write_jsonl(tmp_path / "a.jsonl", [f"record {i}" for i in range(20)])
    (tmp_path / "afile").write_text("x")
    for cache in (tmp_path / "afile", tmp_path / "afile" / "below"):
        with pytest.raises(ValueError, match=r"^--data.cache_dir .*afile.* cannot be written: .*is a file"):
            byte_dm(corpus, cache).setup("fit")


def test_a_cache_dir_that_cannot_be_written_is_refused_naming_the_flag(tmp_path, monkeypatch):
    import lightning_mtp.data.cache_dir as cache_dir

    def read_only(folder):
        raise OSError(errno.EROFS, "Read-only file system", str(folder))

    monkeypatch.setattr(cache_dir, "write_probe", read_only)
    corpus = write_jsonl(tmp_path / "a.jsonl", [f"record {i}" for i in range(20)])
    with pytest.raises(ValueError, match=r"^--data.cache_dir .*cache.* cannot be written: Read-only file system"):
        byte_dm(corpus, tmp_path / "cache").setup("fit")


# ----------------------------------------------------------------------------------------------- killed builds
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_private_folders_a_killed_build_left_are_removed_by_the_next_build(tmp_path):
    corpus = write_jsonl(tmp_path / "a.jsonl", [f"record {i}" for i in range(20)])
    records = tmp_path / "cache" / "records"
    records.mkdir(parents=True)
    dead = records / f".byte-0123456789abcdef.{_dead_pid()}-abcd1234.tmp"
    alive = records / f".byte-0123456789abcdef.{os.getpid()}-abcd1234.tmp"
    for folder in (dead, alive):
        (folder / "train").mkdir(parents=True)
    byte_dm(corpus, tmp_path / "cache").setup("fit")
    assert not dead.exists() and alive.exists()


def test_a_records_file_still_being_written_when_read_is_not_cached_as_the_finished_file(tmp_path, monkeypatch):
    """A fit read a JSONL file half written by another job (an export still running), which then finished it: the
    tokenized records were cached under the finished file's key (the files were looked at after reading), so every
    later fit on the complete file trained on half of it, and a resume of that fit saw no change. The key and the
    checkpoint's corpus record are the files as they were when read."""
    import lightning_mtp.data.records as records_module

    corpus = write_jsonl(tmp_path / "data" / "part.jsonl", [f"record {i} " * 4 for i in range(40)])
    real = records_module.load_record_parts

    def read_then_finish(files, cache_dir):  # the other job appends the rest right after the fit's read
        parts = real(files, cache_dir)
        with open(corpus, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": f"record {i} " * 4}) + "\n" for i in range(40, 80))
        return parts

    monkeypatch.setattr(records_module, "load_record_parts", read_then_finish)
    first = byte_dm(corpus, tmp_path / "cache")
    first.setup("fit")
    assert sum(map(len, first.records.splits())) == 40
    saved = first.state_dict()
    monkeypatch.setattr(records_module, "load_record_parts", real)

    later = byte_dm(corpus, tmp_path / "cache")
    later.setup("fit")
    assert sum(map(len, later.records.splits())) == 80
    fresh = byte_dm(corpus, tmp_path / "fresh_cache")
    fresh.setup("fit")  # rows of every record, as a cache of the complete file has them (not the half one's)
    assert (len(later.train_dataset), len(later.val_dataset)) == (len(fresh.train_dataset), len(fresh.val_dataset))
    assert warned(lambda: byte_dm(corpus, tmp_path / "cache").load_state_dict(saved), "corpus changed")


def test_a_cache_subfolder_that_cannot_be_written_is_named_before_anything_is_read(tmp_path):
    """A shared cache whose ``records`` folder this process cannot write (another user's, mode 755; here a file in
    its place, which root cannot write into either) failed with a traceback from deep in the build: refused naming
    ``--data.cache_dir``, the subfolder and why."""
    corpus = write_jsonl(tmp_path / "data" / "part.jsonl", [f"record {i} " * 4 for i in range(20)])
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "records").write_text("not a folder")
    with pytest.raises(ValueError, match=r"--data.cache_dir .*its 'records' folder cannot be written: it is a file"):
        byte_dm(corpus, tmp_path / "cache").setup("fit")
