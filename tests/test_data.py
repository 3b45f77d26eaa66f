"""Tests of lightning_mtp.data: corpus discovery and splitting, tokenizers, TextDataModule (real files, real
tokenizers, small corpora so each test stays fast)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_mtp.data import (
    BPETokenizer,
    ByteTokenizer,
    PromptCollator,
    TextDataModule,
    build_tokenizer,
    find_corpus_files,
    plan_splits,
    split_files,
    stdlib_root,
    tokenize_documents,
)
from lightning_mtp.data import datamodule as datamodule_module
from lightning_mtp.data.atomic import atomic_write
from lightning_mtp.data.corpus import cap_bytes, corpus_root, read_text, split_point

SMALL = 200_000  # corpus bytes used by the datamodule tests
NON_ASCII = "# Grüße, naïve café — 日本語 🙂\nname = 'Ωμέγα'\t# tab\r\n\x00 end\n"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the module, so the small BPE tokenizer is trained once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def stdlib_sample() -> list[Path]:
    names = {"os.py", "glob.py", "textwrap.py", "json/decoder.py", "email/utils.py"}
    root = stdlib_root()
    return [f for f in find_corpus_files(None) if f.relative_to(root).as_posix() in names]


def make_tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "a.py").write_text("import os\nprint(os.sep)\n" * 50)
    (root / "pkg" / "sub" / "b.py").write_text("def f(x):\n    return x + 1\n" * 50)
    (root / "pkg" / "notes.txt").write_text("plain text notes\n" * 20)
    (root / "pkg" / "empty.py").write_text("")
    (root / ".git" / "hidden.py").write_text("x = 1\n")
    (root / "pkg" / "__pycache__" / "c.py").write_text("x = 2\n")
    return root / "pkg"


# ----------------------------------------------------------------------------------------------- corpus


def test_default_corpus_is_stdlib_code_without_tests():
    root = stdlib_root()
    files = find_corpus_files(None)
    assert root / "os.py" in files and root / "json" / "decoder.py" in files
    assert files == sorted(files) and len(files) > 100
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    for f in files:
        assert f.suffix == ".py" and f.stat().st_size > 0
        assert not excluded & set(f.relative_to(root).parts[:-1]), f


def test_directory_glob_and_single_file_corpora(tmp_path):
    pkg = make_tree(tmp_path)
    rel = lambda files: [f.relative_to(pkg).as_posix() for f in files]  # noqa: E731
    assert rel(find_corpus_files(str(pkg))) == ["a.py", "sub/b.py"]  # empty, hidden and __pycache__ skipped
    assert rel(find_corpus_files(str(pkg), suffixes=None)) == ["a.py", "notes.txt", "sub/b.py"]
    assert rel(find_corpus_files(str(pkg / "**" / "*.txt"))) == ["notes.txt"]
    assert rel(find_corpus_files(str(pkg / "**" / "*.py"))) == ["a.py", "sub/b.py"]
    assert rel(find_corpus_files(str(pkg / "notes.txt"))) == ["notes.txt"]
    assert corpus_root(str(pkg / "**" / "*.py")) == pkg


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: d, "is empty"),
        (lambda d: [(d / n).write_text("") for n in ("a.py", "b.py")] and d, "is empty: all its 2 file"),
        (lambda d: d / "*.nothing", "is empty"),
        (lambda d: d / "nodir" / "*.py", "does not exist"),
    ],
    ids=["missing", "empty-dir", "empty-files", "glob-no-match", "glob-missing-dir"],
)
def test_bad_corpus_names_the_flag(tmp_path, make, match):
    corpus = str(make(tmp_path))
    with pytest.raises(ValueError, match=match) as err:
        find_corpus_files(corpus)
    assert "--data.corpus" in str(err.value)
    if match == "does not exist":  # fails already when the datamodule is built, before any training
        with pytest.raises(ValueError, match="--data.corpus"):
            TextDataModule(corpus=corpus)


def test_split_is_deterministic_disjoint_and_stable_when_files_are_added():
    files = [Path(f"/corpus/mod{i}.py") for i in range(400)]
    train, val = split_files(files, 0.1, seed=7)
    assert (train, val) == split_files(list(reversed(files)), 0.1, seed=7)
    assert not set(train) & set(val) and set(train) | set(val) == set(files)
    assert 20 <= len(val) <= 60
    more = files + [Path(f"/corpus/new{i}.py") for i in range(50)]
    train2, val2 = split_files(more, 0.1, seed=7)
    assert set(val) <= set(val2) and set(train) <= set(train2)
    assert split_files(files, 0.1, seed=8)[1] != val


def test_split_depends_on_relative_paths_only():
    names = [f"pkg/m{i}.py" for i in range(50)]
    split_a = split_files([Path("/a") / n for n in names], 0.2, seed=1, root=Path("/a"))
    split_b = split_files([Path("/elsewhere/b") / n for n in names], 0.2, seed=1, root=Path("/elsewhere/b"))
    assert [p.name for p in split_a[1]] == [p.name for p in split_b[1]]


def test_split_gives_each_side_a_file():
    two = [Path("/c/a.py"), Path("/c/b.py")]
    for fraction in (0.001, 0.999):
        train, val = split_files(two, fraction, seed=0)
        assert len(train) == 1 and len(val) == 1
    with pytest.raises(ValueError, match="--data.val_fraction"):
        split_files(two, 1.0, seed=0)


def test_max_bytes_caps_first_files_and_single_file_splits_its_tail(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text("x" * 10)
    files = sorted(tmp_path.iterdir())
    assert list(cap_bytes(files, 25).values()) == [10, 10, 5]
    train, val = plan_splits(files, 0.3, seed=0, max_bytes=25)
    assert sum(s.nbytes for s in train + val) == 25 and train and val

    single = tmp_path / "one.py"
    single.write_text("".join(f"line_{i} = {i}  # é\n" for i in range(200)), encoding="utf-8")
    (train_span,), (val_span,) = plan_splits([single], 0.1, seed=0)
    assert train_span.stop == val_span.start and val_span.stop == single.stat().st_size
    assert train_span.read() + val_span.read() == single.read_text(encoding="utf-8")
    assert val_span.read().startswith("line_") and 0.05 < val_span.nbytes / single.stat().st_size < 0.15
    assert split_point(b"a\nb\nc\nd\n", 0.25) == 6


def test_read_text_cuts_at_character_boundaries(tmp_path):
    path = tmp_path / "u.txt"
    path.write_text("aé日", encoding="utf-8")  # 1 + 2 + 3 bytes
    assert [read_text(path, stop) for stop in range(1, 7)] == ["a", "a", "aé", "aé", "aé", "aé日"]


# ----------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_real_code(stdlib_sample):
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    for text in [f.read_text(encoding="utf-8") for f in stdlib_sample] + [NON_ASCII]:
        ids = tok.encode(text)
        assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.decode([104, 105, tok.eos_id, tok.pad_id]) == "hi"
    assert tok.decode([104, tok.eos_id], skip_special_tokens=False) == "h<|endoftext|>"
    assert tok.decode([0xFF, 104]) == "\ufffdh"


def test_bpe_tokenizer_round_trips_real_code(stdlib_sample, cache_dir):
    tok = BPETokenizer.train(stdlib_sample, vocab_size=512, cache_dir=cache_dir)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (512, 0, 1)
    texts = [f.read_text(encoding="utf-8") for f in stdlib_sample]
    for text, ids in zip([*texts, NON_ASCII], tok.encode_batch([*texts, NON_ASCII]), strict=True):
        assert ids == tok.encode(text) and tok.decode(ids) == text
        assert min(ids) >= 2 and max(ids) < tok.vocab_size  # special tokens are never produced by encode
    assert sum(map(len, tok.encode_batch(texts))) < 0.5 * sum(len(t.encode()) for t in texts)  # it compresses
    literal = 'EOS = "<|endoftext|>"\n'
    assert tok.eos_id not in tok.encode(literal) and tok.decode(tok.encode(literal)) == literal


def test_bpe_cache_is_reused_and_keyed(stdlib_sample, cache_dir, monkeypatch, tmp_path):
    path = BPETokenizer.cache_path(stdlib_sample, 512, cache_dir)
    first = BPETokenizer.train(stdlib_sample, vocab_size=512, cache_dir=cache_dir)
    assert path.is_file()
    mtime = path.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although cached")

    with monkeypatch.context() as m:
        m.setattr(BPETokenizer, "train_from_texts", no_training)
        again = BPETokenizer.train(stdlib_sample, vocab_size=512, cache_dir=cache_dir)
    assert path.stat().st_mtime_ns == mtime and again.fingerprint == first.fingerprint
    assert BPETokenizer.cache_path(stdlib_sample, 600, cache_dir) != path
    assert BPETokenizer.cache_path(stdlib_sample[:-1], 512, cache_dir) != path

    saved = tmp_path / "tok.json"
    first.save(saved)
    loaded = BPETokenizer.load(saved)
    assert loaded.encode(NON_ASCII) == first.encode(NON_ASCII) and loaded.fingerprint == first.fingerprint


def test_a_full_disk_while_caching_the_trained_tokenizer_names_the_cache_dir(stdlib_sample, tmp_path, monkeypatch):
    """The disk fills while the trained BPE tokenizer is written into ``--data.cache_dir``: one ``ValueError`` names
    the flag, the folder and the reason, and no tokenizer file (nor its temporary) is left to be loaded later."""
    from lightning_mtp.data import tokenizers

    def full_disk(fh):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tokenizers, "atomic_write", lambda path, write: atomic_write(path, full_disk))
    with pytest.raises(ValueError, match=r"^--data.cache_dir .*: writing the BPE tokenizer trained on --data.corpus "
                       r"into .*tokenizers.* failed: the disk is full \(ENOSPC\)"):
        BPETokenizer.train(stdlib_sample, vocab_size=512, cache_dir=tmp_path)  # (a cache of its own: none yet)
    folder = BPETokenizer.cache_path(stdlib_sample, 512, tmp_path).parent
    assert list(folder.iterdir()) == []


def test_tokenizer_errors_name_the_flag(stdlib_sample, cache_dir):
    with pytest.raises(ValueError, match="--data.vocab_size must be >= 258"):
        BPETokenizer.train(stdlib_sample, vocab_size=257, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="--data.tokenizer"):
        build_tokenizer("sentencepiece", stdlib_sample, 512, cache_dir)
    assert build_tokenizer("byte").vocab_size == 258


def test_tokenize_documents_joins_with_eos():
    ids = tokenize_documents(["ab", "", "c"], ByteTokenizer())
    assert ids.dtype == np.uint16 and ids.tolist() == [97, 98, 256, 256, 99]


# ----------------------------------------------------------------------------------------------- datamodule


@pytest.fixture(scope="module")
def bpe_dm(cache_dir) -> TextDataModule:
    dm = TextDataModule(vocab_size=512, seq_len=64, batch_size=4, max_bytes=SMALL, cache_dir=str(cache_dir))
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_datamodule_batches(bpe_dm):
    batch = next(iter(bpe_dm.train_dataloader()))
    assert set(batch) == {"input_ids"}
    ids = batch["input_ids"]
    assert ids.shape == (4, 64) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < bpe_dm.vocab_size == 512
    val = list(bpe_dm.val_dataloader())
    assert sum(len(b["input_ids"]) for b in val) == len(bpe_dm.val_tokens) // 64 > 0
    assert torch.equal(val[0]["input_ids"][0], torch.from_numpy(bpe_dm.val_tokens[:64].astype(np.int64)))
    assert len(bpe_dm.test_dataloader()) == len(bpe_dm.val_dataloader())
    assert (bpe_dm.eos_id, bpe_dm.pad_id, bpe_dm.seq_len) == (0, 1, 64)


def test_datamodule_val_tokens_come_from_held_out_files_only(bpe_dm):
    train, val = bpe_dm.corpus_splits()
    assert {s.path for s in train}.isdisjoint({s.path for s in val})
    assert sum(s.nbytes for s in train + val) == SMALL
    expected_val = tokenize_documents([s.read() for s in val], bpe_dm.tokenizer)
    expected_train = tokenize_documents([s.read() for s in train], bpe_dm.tokenizer)
    assert np.array_equal(bpe_dm.val_tokens, expected_val)
    assert np.array_equal(bpe_dm.train_tokens, expected_train)
    # the tokenizer was trained on the train split only
    assert bpe_dm.tokenizer.fingerprint == BPETokenizer.train(train, 512, bpe_dm.cache_dir).fingerprint


def test_prepare_data_reuses_the_token_cache(bpe_dm, monkeypatch):
    out = bpe_dm.token_cache_dir()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.npy", "val.npy"]
    assert np.load(out / "train.npy").dtype == np.uint16
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("retokenized although cached")

    monkeypatch.setattr(datamodule_module, "tokenize_documents", no_tokenizing)
    monkeypatch.setattr(BPETokenizer, "train_from_texts", no_tokenizing)
    again = TextDataModule(vocab_size=512, seq_len=64, batch_size=4, max_bytes=SMALL, cache_dir=str(bpe_dm.cache_dir))
    again.prepare_data()
    again.setup("fit")  # a fresh object, as on another rank
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    assert again.token_cache_dir() == out and np.array_equal(again.val_tokens, bpe_dm.val_tokens)


def test_setup_without_prepare_data_and_byte_vocab(tmp_path):
    dm = TextDataModule(
        tokenizer="byte", vocab_size=99999, seq_len=32, batch_size=2, max_bytes=20_000, cache_dir=str(tmp_path)
    )
    assert dm.vocab_size == 258 and dm.eos_id == 256 and dm.pad_id == 257
    dm.setup("fit")
    assert len(dm.train_tokens) + len(dm.val_tokens) == 20_000 + len(dm.corpus_splits()[0]) - 1 + (
        len(dm.corpus_splits()[1]) - 1
    )  # every byte of the first 20 kB, plus one EOS between neighbouring files of each split
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (2, 32)


def test_train_shuffling_is_seeded(tmp_path):
    def first_batch(seed):
        dm = TextDataModule(
            tokenizer="byte", seq_len=16, batch_size=8, max_bytes=20_000, seed=seed, cache_dir=str(tmp_path)
        )
        return next(iter(dm.train_dataloader()))["input_ids"]

    assert torch.equal(first_batch(3), first_batch(3))


def test_single_file_corpus(tmp_path):
    source = tmp_path / "one.py"
    source.write_text("".join(f"value_{i} = {i} * 2\n" for i in range(400)))
    dm = TextDataModule(corpus=str(source), tokenizer="byte", seq_len=32, batch_size=2, cache_dir=str(tmp_path / "c"))
    dm.setup("fit")
    assert ByteTokenizer().decode(dm.train_tokens.tolist()) + ByteTokenizer().decode(dm.val_tokens.tolist()) == (
        source.read_text()
    )


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"tokenizer": "wordpiece"}, "--data.tokenizer"),
        ({"vocab_size": 100}, "--data.vocab_size"),
        ({"seq_len": 1}, "--data.seq_len"),
        ({"batch_size": 0}, "--data.batch_size"),
        ({"val_fraction": 0.0}, "--data.val_fraction"),
        ({"val_fraction": 1.5}, "--data.val_fraction"),
        ({"max_bytes": 0}, "--data.max_bytes"),
        ({"num_workers": -1}, "--data.num_workers"),
        ({"prompt_tokens": 0}, "--data.prompt_tokens"),
        ({"corpus": "/no/such/corpus"}, "--data.corpus"),
        ({"predict_prompts": "/no/such/prompts.txt"}, "--data.predict_prompts"),
    ],
)
def test_bad_arguments_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError) as err:
        TextDataModule(**kwargs)
    assert flag in str(err.value) and str(list(kwargs.values())[0]) in str(err.value)


def test_empty_corpus_fails_when_preparing(tmp_path):
    (tmp_path / "a.py").write_text("")
    dm = TextDataModule(corpus=str(tmp_path), tokenizer="byte", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="--data.corpus.*is empty"):
        dm.prepare_data()


def test_too_small_val_split_is_explained(tmp_path):
    dm = TextDataModule(tokenizer="byte", seq_len=4096, max_bytes=30_000, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--data.val_fraction"):
        dm.setup("fit")


# ----------------------------------------------------------------------------------------------- predict


def check_right_padded(batch, pad_id):
    ids, lengths = batch["input_ids"], batch["lengths"]
    assert ids.dtype == torch.long and lengths.dtype == torch.long and ids.shape[1] == int(lengths.max())
    for row, length in zip(ids, lengths.tolist(), strict=True):
        assert (row[length:] == pad_id).all() and (row[:length] != pad_id).all()


def test_predict_prompts_from_txt_and_jsonl(bpe_dm, tmp_path):
    txt = tmp_path / "prompts.txt"
    txt.write_text("def main():\\n    \n\n   \nimport os\nclass Grüße:\n", encoding="utf-8")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "def main():\\n    "}\n\n{"prompt": "import os"}\n{"prompt": "class Grüße:"}\n')
    for path in (txt, jsonl):
        dm = TextDataModule(vocab_size=512, max_bytes=SMALL, cache_dir=str(bpe_dm.cache_dir), predict_prompts=str(path))
        batches = list(dm.predict_dataloader())
        (batch,) = batches
        assert batch["prompt_text"] == ["def main():\n    ", "import os", "class Grüße:"]
        check_right_padded(batch, dm.pad_id)
        for row, length, text in zip(batch["input_ids"], batch["lengths"], batch["prompt_text"], strict=True):
            assert row[:length].tolist() == dm.tokenizer.encode(text)


def test_predict_prompts_file_errors(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    for path, match in ((blank, "no \\(non-blank\\) prompts"), (bad, 'string "prompt"')):
        dm = TextDataModule(tokenizer="byte", cache_dir=str(tmp_path), predict_prompts=str(path))
        with pytest.raises(ValueError, match=f"--data.predict_prompts.*{match}"):
            dm.predict_dataloader()


def test_predict_prompts_from_held_out_data(bpe_dm):
    dm = TextDataModule(
        vocab_size=512,
        seq_len=64,
        batch_size=3,
        max_bytes=SMALL,
        cache_dir=str(bpe_dm.cache_dir),
        num_predict_prompts=5,
        prompt_tokens=10,
    )
    batches = list(dm.predict_dataloader())
    assert [len(b["prompt_text"]) for b in batches] == [3, 2]
    for i, row in enumerate(torch.cat([b["input_ids"] for b in batches])):
        assert row.tolist() == dm.val_tokens[i * 64 : i * 64 + 10].tolist()
    assert all((b["lengths"] == 10).all() for b in batches)


def test_prompt_collator_right_pads():
    items = [{"input_ids": torch.tensor(ids), "prompt_text": str(ids)} for ids in ([5, 6, 7], [8], [9, 10])]
    batch = PromptCollator(pad_id=1)(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1], [9, 10, 1]]
    assert batch["lengths"].tolist() == [3, 1, 2] and batch["prompt_text"] == ["[5, 6, 7]", "[8]", "[9, 10]"]


def test_lightning_cli_can_build_the_datamodule(tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(TextDataModule, "data")
    cfg = parser.parse_args(
        ["--data.tokenizer=byte", "--data.seq_len=32", f"--data.cache_dir={tmp_path}", "--data.suffixes=[.py, .pyi]"]
    )
    dm = TextDataModule(**cfg.data.as_dict())
    assert dm.seq_len == 32 and dm.suffixes == (".py", ".pyi") and dm.vocab_size == 258
    assert json.loads(json.dumps(dict(dm.hparams)))["seq_len"] == 32
