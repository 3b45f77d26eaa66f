"""The data pipeline under the conditions real use brings: a corpus that grows (the split must not move a record),
a resume on changed files (said, not silent), two runs sharing one cache directory (a sweep: neither may crash or
read the other's half-written files), mixed folders and bad inputs refused with one line naming ``--data.corpus``."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from lightning_mtp.data import TextDataModule
from lightning_mtp.data.records import split_records


def write_lines(path: Path, records: list[dict], mode: str = "w") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode, encoding="utf-8") as fh:
        fh.write("".join(json.dumps(record) + "\n" for record in records))
    return path


def texts(count: int, start: int = 0) -> list[dict]:
    return [{"text": f"def h{i}(x):\n    return x * {i} + {i % 5}\n"} for i in range(start, start + count)]


def byte_dm(corpus: Path, cache: Path, **kwargs) -> TextDataModule:
    settings = dict(tokenizer="byte", seq_len=32, batch_size=4, num_proc=1, cache_dir=str(cache), val_fraction=0.1)
    settings.update(kwargs)
    return TextDataModule(corpus=str(corpus), **settings)


# ----------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("seed", [0, 1234])
def test_appending_records_never_moves_an_earlier_record_between_the_splits(seed):
    import datasets

    rows = [{"text": f"r{i}"} for i in range(1000)]
    train, val = split_records(datasets.Dataset.from_list(rows), 0.05, seed)
    for extra in (1, 37, 500):
        grown_train, grown_val = split_records(datasets.Dataset.from_list(rows + [{"text": f"new{i}"}
                                                                                  for i in range(extra)]), 0.05, seed)
        assert set(val["text"]) <= set(grown_val["text"])  # every earlier val record stays val
        assert set(train["text"]) <= set(grown_train["text"])  # every earlier train record stays train
    again_train, again_val = split_records(datasets.Dataset.from_list(rows), 0.05, seed)
    assert again_val["text"] == val["text"] and again_train["text"] == train["text"]  # deterministic
    assert 20 <= len(val) <= 80  # about 5%


def test_a_bpe_trained_on_another_splits_records_is_not_reused(tmp_path):
    """A BPE is trained on the train records only; another seed or val_fraction splits them otherwise, so a tokenizer
    cached for one split (which saw the other's held-out records) must not serve it."""
    corpus = write_lines(tmp_path / "code.jsonl", texts(200))
    for seed in (0, 1, 0):
        dm = TextDataModule(corpus=str(corpus), tokenizer="bpe", vocab_size=300, seq_len=32, batch_size=4,
                            num_proc=1, cache_dir=str(tmp_path / "cache"), val_fraction=0.1, seed=seed)
        dm.prepare_data()
    assert len(list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json"))) == 2  # one per split; 0 reused


def test_a_small_corpus_still_gets_a_record_on_each_side():
    import datasets

    for count in (2, 3, 5):
        for fraction in (0.01, 0.99):
            train, val = split_records(datasets.Dataset.from_list([{"text": str(i)} for i in range(count)]),
                                       fraction, seed=7)
            assert len(train) >= 1 and len(val) >= 1 and len(train) + len(val) == count


def test_appended_records_keep_the_earlier_validation_rows(tmp_path):
    corpus = write_lines(tmp_path / "docs.jsonl", texts(300))
    before = byte_dm(corpus, tmp_path / "cache")
    before.setup("fit")
    val_before = set(before.records.splits()[1]["text"])
    write_lines(corpus, texts(40, start=300), mode="a")
    after = byte_dm(corpus, tmp_path / "cache")
    after.setup("fit")
    train_after, val_after = (set(part["text"]) for part in after.records.splits())
    assert val_before <= val_after and not val_before & train_after
    assert after.records.tokenized.folder != before.records.tokenized.folder  # the files changed: tokenized again


# ----------------------------------------------------------------------------------------------- resume
def test_resuming_on_a_changed_corpus_warns_and_on_the_same_one_does_not(tmp_path):
    corpus = write_lines(tmp_path / "docs.jsonl", texts(200))
    first = byte_dm(corpus, tmp_path / "cache")
    loader = first.train_dataloader()
    batches = iter(loader)
    next(batches), next(batches)
    state = first.state_dict()  # what Lightning saves in the checkpoint
    assert state["train_loader"]["batches_yielded"] == 2 and state["corpus"]["count"] == 1
    json.dumps(state)  # plain types

    same = byte_dm(corpus, tmp_path / "cache")
    same.setup("fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)

    write_lines(corpus, texts(20, start=200), mode="a")  # appended, then resumed: legitimate, but said
    grown = byte_dm(corpus, tmp_path / "cache")
    grown.setup("fit")
    with pytest.warns(UserWarning, match=r"^--data.corpus: the corpus changed since the checkpoint was saved \(1 "
                                         r"changed \(first docs.jsonl: \d+ -> \d+ bytes\)\): the resumed fit trains "
                                         r"on the corpus as it is now.*exact resume is impossible"):
        grown.load_state_dict(state)
    assert grown.train_dataloader().state_dict() == state["train_loader"]  # still resumed where it stopped

    folder = tmp_path / "folder"
    write_lines(folder / "a.jsonl", texts(100))
    saved = byte_dm(folder, tmp_path / "cache")
    saved.setup("fit")
    state = saved.state_dict()
    write_lines(folder / "b.jsonl", texts(30, start=100))
    added = byte_dm(folder, tmp_path / "cache")
    added.setup("fit")
    with pytest.warns(UserWarning, match=r"corpus changed since the checkpoint was saved \(1 file\(s\) added "
                                         r"\(first b.jsonl\)\)"):
        added.load_state_dict(state)


def test_the_corpus_fingerprint_travels_in_a_lightning_checkpoint(tmp_path):
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(258, 4)

        def training_step(self, batch, _):
            return self.emb(batch["input_ids"]).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    corpus = write_lines(tmp_path / "docs.jsonl", texts(200))

    def fit(ckpt_path=None, steps=3):
        trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, accelerator="cpu",
                            default_root_dir=str(tmp_path))
        trainer.fit(Tiny(), datamodule=byte_dm(corpus, tmp_path / "cache"), ckpt_path=ckpt_path)
        return trainer

    fit().save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["TextDataModule"]["corpus"]["files"][0][0] == "docs.jsonl"
    write_lines(corpus, texts(20, start=200), mode="a")
    with pytest.warns(UserWarning, match=r"the corpus changed since the checkpoint was saved"):
        fit(tmp_path / "last.ckpt", steps=5)


# ----------------------------------------------------------------------------------------------- shared cache
def _prepare_rows(corpus: str, cache: str, barrier, results) -> None:
    """One of two runs started together on one cache directory: the digest of every row it serves."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import datasets

    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
    dm = TextDataModule(corpus=corpus, tokenizer="byte", seq_len=64, batch_size=4, num_proc=1, cache_dir=cache,
                        val_fraction=0.05)
    barrier.wait()  # both past their imports: tokenize, save and pack at the same moment
    dm.setup("fit")
    digest = hashlib.sha1()
    for rows in (dm.train_dataset, dm.val_dataset):
        for name in ("ids", "labels", "positions"):
            digest.update(np.ascontiguousarray(getattr(rows, name)).tobytes())
    results.put((len(dm.train_dataset), len(dm.val_dataset), digest.hexdigest()))


def test_two_runs_preparing_one_corpus_in_one_cache_at_once_both_succeed(tmp_path):
    corpus = write_lines(tmp_path / "docs.jsonl", texts(4000))
    cache = tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    runs = [context.Process(target=_prepare_rows, args=(str(corpus), str(cache), barrier, results))
            for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=240)
    assert [run.exitcode for run in runs] == [0, 0]
    first, second = results.get(timeout=5), results.get(timeout=5)
    assert first == second and first[0] > 0
    records = cache / "records"
    assert not [p.name for p in records.rglob("*") if p.name.endswith((".tmp", ".partial", ".stale"))]
    folder, = records.iterdir()  # one finished folder, nothing left half-written beside it
    assert {p.name for p in folder.iterdir()} == {"train", "val", "meta.json", "packed-train", "packed-val"}


# ----------------------------------------------------------------------------------------------- mixed folders
def chats(count: int, start: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Write f{i}."},
                          {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}\n"}]}
            for i in range(start, start + count)]


def write_parquet(path: Path, records: list[dict], large: bool = True) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    kind = pa.large_string() if large else pa.string()  # pandas and polars write large_string
    pq.write_table(pa.table({"text": pa.array([r["text"] for r in records], type=kind)}), str(path))
    return path


def refusal(dm: TextDataModule, match: str) -> str:
    with pytest.raises(ValueError, match=match) as caught:
        dm.setup("fit")
    assert "\n" not in str(caught.value)  # one line
    return str(caught.value)


def test_a_folder_mixing_jsonl_and_parquet_text_records_reads_them_all(tmp_path):
    folder = tmp_path / "mixed"
    write_lines(folder / "a.jsonl", texts(30))
    write_parquet(folder / "b.parquet", texts(30, start=30))
    dm = byte_dm(folder, tmp_path / "cache")
    dm.setup("fit")
    train, val = dm.records.splits()
    assert sorted(list(train["text"]) + list(val["text"])) == sorted(r["text"] for r in texts(60))
    assert len(dm.train_dataset) > 0


@pytest.mark.parametrize("text_file", ["b.jsonl", "b.parquet"])
def test_a_folder_of_chat_and_text_files_is_refused_naming_the_first_text_record(tmp_path, text_file):
    folder = tmp_path / "mixed"
    write_lines(folder / "a.jsonl", chats(12))
    if text_file.endswith(".jsonl"):
        write_lines(folder / text_file, texts(5))
    else:
        write_parquet(folder / text_file, texts(5))
    refusal(byte_dm(folder, tmp_path / "cache"),
            rf"^--data.corpus: 5 of 17 records have no 'messages' field \(--data.messages_field\); the first is "
            rf"record 12 \(from 0, in the order read; record 0 of .*{text_file}\), whose fields are \['text'\]; "
            r"the corpus mixes 'messages' and 'text' records")


# ----------------------------------------------------------------------------------------------- bad inputs
def test_a_jsonl_file_that_is_not_utf8_is_refused_naming_the_line_before_tokenizing(tmp_path, monkeypatch):
    from lightning_mtp.data import records

    corpus = tmp_path / "latin.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) for r in texts(10)]
    lines[3] = '{"text": "caf\u00e9 na\u00efve"}'
    corpus.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    offset = len(("\n".join(lines[:3]) + "\n").encode("latin-1")) + len('{"text": "caf')
    monkeypatch.setattr(records, "tokenize_records", lambda *a, **k: pytest.fail("tokenized"))
    refusal(byte_dm(corpus, tmp_path / "cache"),
            rf"^--data.corpus: .*latin.jsonl is not UTF-8 text: line 4 \(byte {offset}\) holds the byte 0xe9")


def test_a_single_text_file_is_read_raw_like_a_folder_of_them(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("".join(f"Line {i} of a plain text book.\n" for i in range(300)), encoding="utf-8")
    dm = byte_dm(book, tmp_path / "cache")
    assert dm.records is None  # not one record: raw text, its tail held out
    dm.setup("fit")
    assert len(dm.train_dataset) > 0 and len(dm.val_dataset) > 0
    assert bytes(dm.train_dataset[0]["input_ids"].tolist()).decode() == book.read_text()[:32]
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text(book.read_text(), encoding="utf-8")
    assert byte_dm(folder, tmp_path / "cache", suffixes=[".txt"]).records is None  # the same as a folder of them


def test_a_text_record_whose_text_is_not_a_string_is_refused_naming_it(tmp_path):
    rows = texts(20)
    rows[7] = {"text": 3}
    refusal(byte_dm(write_lines(tmp_path / "x.jsonl", rows), tmp_path / "cache"),
            r"^--data.corpus: 1 of 20 text records hold a 'text' field \(--data.text_field\) that is not a string; "
            r"the first is record 7 .*whose 'text' is '3' \(int\)")


def test_a_save_to_disk_folder_is_refused_naming_the_formats_read(tmp_path):
    import datasets

    datasets.Dataset.from_list(texts(10)).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"^--data.corpus: .*saved' is a folder that datasets' save_to_disk wrote "
                                         r".*which is not read: the corpus is records in .jsonl, .json, .parquet or "
                                         r".csv files") as caught:
        byte_dm(tmp_path / "saved", tmp_path / "cache")
    assert "\n" not in str(caught.value)
