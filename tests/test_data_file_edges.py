"""Edges of the files a corpus is read from: CSV cells that pandas would read as missing, record files beside others
that are empty or not UTF-8 (refused by name, as they are alone), and the split of a single small raw file (its
held-out share stays near ``val_fraction``)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from lightning_mtp.data.corpus import plan_splits, split_point
from lightning_mtp.data.record_files import load_records, record_files


def write_lines(path: Path, count: int = 20) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                            for i in range(count)), encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), str(path))
    return path


def refusal(files: list[Path], cache: Path) -> str:
    with pytest.raises(ValueError) as caught:
        load_records(files, cache)
    return str(caught.value)


# ----------------------------------------------------------------------------------------------- CSV cells
NA_WORDS = ["NA", "None", "null", "nan", "N/A", "n/a", "#N/A", "NULL", "NaN", "-nan", "<NA>", "True"]


def test_csv_cells_pandas_reads_as_missing_are_read_as_their_text(tmp_path):
    rows = [f"row {i} é" for i in range(10)] + NA_WORDS
    quoted = "".join(f'"{text}"\n' for text in NA_WORDS)  # quoted or not, a cell holds its text
    corpus = tmp_path / "words.csv"
    corpus.write_text("text\n" + "".join(f"{text}\n" for text in rows) + quoted + '""\n', encoding="utf-8")
    texts = load_records(record_files(str(corpus)), tmp_path / "cache")["text"]
    assert list(texts) == rows + NA_WORDS + [None]  # an empty cell is null: an empty value, as in Parquet


# ----------------------------------------------------------------------------------------------- files beside others
def test_a_text_file_beside_records_that_is_not_utf8_is_refused_naming_its_byte(tmp_path):
    write_lines(tmp_path / "mixed" / "a.jsonl")
    latin = tmp_path / "mixed" / "b.txt"
    latin.write_bytes("first line\ncaf\u00e9 latin\n".encode("latin-1"))
    message = refusal(record_files(str(tmp_path / "mixed")), tmp_path / "cache")
    assert re.match(r"--data.corpus: .*mixed/b.txt is not UTF-8 text: line 2 \(byte 14\) holds the byte 0xe9", message)
    latin.write_text("first line\ncaf\u00e9 utf-8\n", encoding="utf-8")  # the same file in UTF-8 reads
    records = load_records(record_files(str(tmp_path / "mixed")), tmp_path / "cache")
    assert records["text"][-1] == "first line\ncaf\u00e9 utf-8\n"


EMPTY_FILES = {
    "empty.jsonl": "",
    "blank.jsonl": "\n  \n",
    "empty.txt": "",
    "empty.json": " [ ]\n",
    "header.csv": "text\n\n",
}


@pytest.mark.parametrize("name", sorted(EMPTY_FILES))
def test_a_record_file_without_records_beside_others_is_refused_as_it_is_alone(tmp_path, name):
    folder = tmp_path / "corpus"
    write_lines(folder / "a.jsonl")
    (folder / "b.csv").write_text("text\nhello\nworld\n", encoding="utf-8")
    empty = folder / name
    empty.write_text(EMPTY_FILES[name], encoding="utf-8")
    files = record_files(str(folder))
    assert empty in files
    beside = refusal(files, tmp_path / "cache")
    assert re.fullmatch(rf"--data.corpus: cannot read the {empty.suffix} files \['.*{name}'\] as records: "
                        rf".*corpus/{name} is empty: it holds no records", beside)
    assert beside == refusal([empty], tmp_path / "cache")  # the message the file alone gets


def test_a_parquet_file_of_no_rows_beside_another_is_refused_naming_it(tmp_path):
    folder = tmp_path / "corpus"
    write_parquet(folder / "a.parquet", [f"text {i}" for i in range(10)])
    empty = write_parquet(folder / "b.parquet", [])
    for files in (record_files(str(folder)), [empty]):
        message = refusal(files, tmp_path / "cache")
        assert re.fullmatch(r"--data.corpus: cannot read the .parquet files \['.*b.parquet'\] as records: "
                            r".*corpus/b.parquet is empty: it holds no records", message), message


# ----------------------------------------------------------------------------------------------- a single file's split
def held_out(data: bytes, val_fraction: float) -> int:
    cut = split_point(data, val_fraction)
    assert 0 < cut < len(data)  # both parts get bytes
    return len(data) - cut


def test_a_small_single_file_holds_out_about_val_fraction(tmp_path):
    first = "Document 0: caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f642 \u2014 two  spaces\tand a tab.\n"
    data = (first + "word " * 30 + "end 0\n").encode("utf-8")  # two lines: the second is most of the file
    for val_fraction in (0.05, 0.2):
        assert held_out(data, val_fraction) <= 1.5 * val_fraction * len(data) + 1, val_fraction
    book = tmp_path / "book.txt"
    book.write_bytes(data)
    (train,), (val,) = plan_splits([book], 0.2, seed=0)
    assert train.stop == val.start and val.nbytes / len(data) < 0.3
    assert (train.read() + val.read()).encode("utf-8") == data


def test_a_single_files_held_out_share_stays_near_val_fraction_at_every_size():
    rng = random.Random(0)
    for size in [2, 3, 5, 10, 50, 236, 1000, 4000, 20_000]:
        lines = b"".join(b"x" * rng.randrange(0, 300) + b"\n" for _ in range(size // 10 + 2))[:size]
        for val_fraction in (0.01, 0.05, 0.2, 0.5, 0.9):
            target = size - min(max(round(size * (1 - val_fraction)), 1), size - 1)
            held = held_out(lines, val_fraction)
            assert held <= target + target // 2 + 3 and size - held >= (size - target) / 2, (size, val_fraction)


def test_a_large_file_still_starts_its_held_out_part_at_a_line():
    data = "".join(f"line_{i} = {i}  # \u00e9\n" for i in range(5000)).encode("utf-8")
    cut = split_point(data, 0.05)
    assert data[cut - 1:cut] == b"\n" and abs((len(data) - cut) / len(data) - 0.05) < 0.001


def test_a_file_too_short_to_split_is_refused():
    with pytest.raises(ValueError, match=r"--data.corpus: a single file of 1 byte\(s\) is too short to split in two"):
        split_point(b"x", 0.1)
