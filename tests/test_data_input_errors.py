"""Bad data input is refused (or warned about) in one line that names the flag, the file and what to do: prompts files
that are not UTF-8, folders or empty; prompts too long for the model; corpora of undecodable bytes."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_mtp.data import TextDataModule, read_prompts_file
from lightning_mtp.data.corpus import UNDECODABLE_WARN_SHARE

WHY = "the model's context of 64 tokens (--model.init_args.model.max_seq_len) minus max_new_tokens 24"
LATIN1_PROMPTS = "def main():\nimport os\n# café au lait\n".encode("latin-1")  # 0xe9 at line 3, byte 6 of it, offset 27


def byte_dm(tmp_path: Path, **kwargs) -> TextDataModule:
    """A byte-level datamodule on 20 kB of the standard library (tokenized in well under a second)."""
    return TextDataModule(tokenizer="byte", seq_len=32, batch_size=2, max_bytes=20_000,
                          cache_dir=str(tmp_path / "cache"), **kwargs)


# ----------------------------------------------------------------------------------------------- prompts files


def test_non_utf8_prompts_file_names_the_line_and_byte(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(LATIN1_PROMPTS)
    with pytest.raises(ValueError) as info:
        read_prompts_file(str(path))
    message = str(info.value)
    assert message.startswith("--data.predict_prompts: ") and "\n" not in message
    for part in (repr(str(path)), "not UTF-8", "line 3", "0xe9", "byte 6 of the line", "offset 27 in the file",
                 "save the file as UTF-8"):
        assert part in message, message
    with pytest.raises(ValueError, match="--data.predict_prompts: .* line 3 "):
        byte_dm(tmp_path, predict_prompts=str(path)).setup("predict")


def test_prompts_folder_is_called_a_folder(tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    expected = r"--data.predict_prompts: '.*prompts' is a folder, not a file; give a \.txt or \.jsonl prompts file"
    with pytest.raises(ValueError, match=expected):
        TextDataModule(tokenizer="byte", predict_prompts=str(folder))
    with pytest.raises(ValueError, match=expected):
        read_prompts_file(str(folder))


@pytest.mark.parametrize(
    "name, content",
    [("empty.txt", ""), ("blank.txt", "\n   \n\t\r\n"), ("empty.jsonl", ""), ("blank.jsonl", '\n{"prompt": "  "}\n')],
)
def test_empty_or_blank_prompts_file_says_it_has_no_prompts(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    dm = TextDataModule(tokenizer="byte", cache_dir=str(tmp_path), predict_prompts=str(path))
    with pytest.raises(ValueError, match=r"^--data.predict_prompts: prompts file '.*' has no \(non-blank\) prompts"):
        dm.prompt_dataset()


def test_prompt_line_numbers_count_blank_lines_and_crlf(tmp_path):
    txt = tmp_path / "prompts.txt"
    txt.write_bytes(b"\xef\xbb\xbfa\r\n\r\n  \r\nb\\nc\r\n")  # BOM, CRLF line ends
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('\n{"prompt": "a"}\n{"prompt": " "}\n\n{"prompt": "b\\nc"}\n', encoding="utf-8")
    for path, lines in ((txt, [1, 4]), (jsonl, [2, 5])):
        dataset = byte_dm(tmp_path, predict_prompts=str(path)).prompt_dataset()
        assert dataset.texts == ["a", "b\nc"] and dataset.lines == lines


# ----------------------------------------------------------------------------------------------- prompt lengths


def write_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("short\n\n   \n" + "x" * 50 + "\n" + "y" * 60 + "\n", encoding="utf-8")  # long ones: lines 4, 5
    return path


def test_check_prompts_fit_names_the_file_line_and_tokens(tmp_path):
    path = write_prompts(tmp_path)
    dm = byte_dm(tmp_path, predict_prompts=str(path))
    dm.setup("predict")
    dm.check_prompts_fit(60, WHY)  # all fit
    with pytest.raises(ValueError) as info:
        dm.check_prompts_fit(40, WHY)
    message = str(info.value)
    assert message.startswith("--data.predict_prompts: the prompt on line 4 of ") and "\n" not in message
    for part in (repr(str(path)), "is 50 tokens long (the first of 2 too long), more than the 40 token(s)", WHY,
                 "shorten that prompt", "--model.init_args.generation.max_new_tokens"):
        assert part in message, message


def test_check_prompts_fit_gives_jsonl_line_numbers(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": "' + "z" * 30 + '"}\n', encoding="utf-8")
    dm = byte_dm(tmp_path, predict_prompts=str(path))
    dm.setup("predict")
    with pytest.raises(ValueError, match=r"line 3 of .*prompts\.jsonl' is 30 tokens long, more than the 10 token"):
        dm.check_prompts_fit(10, WHY)


def test_check_prompts_fit_does_not_tokenize_again(tmp_path, monkeypatch):
    dm = byte_dm(tmp_path, predict_prompts=str(write_prompts(tmp_path)))
    dm.setup("predict")
    monkeypatch.setattr(type(dm.tokenizer), "encode_batch", lambda *a: pytest.fail("prompts tokenized twice"))
    with pytest.raises(ValueError, match="line 4"):
        dm.check_prompts_fit(40, WHY)
    assert next(iter(dm.predict_dataloader()))["prompt_text"][0] == "short"


def test_check_prompts_fit_names_prompt_tokens_for_held_out_prompts(tmp_path):
    dm = byte_dm(tmp_path, prompt_tokens=20, num_predict_prompts=2)
    dm.setup("predict")
    dm.check_prompts_fit(20, WHY)
    with pytest.raises(ValueError) as info:
        dm.check_prompts_fit(12, WHY)
    message = str(info.value)
    assert message.startswith("--data.prompt_tokens: the held-out prompts are 20 tokens long"), message
    assert WHY in message and "lower --data.prompt_tokens to at most 12" in message
    assert "--data.predict_prompts" not in message


class _ChecksPromptsInSetup(L.LightningModule):
    """Calls ``check_prompts_fit`` from its ``setup`` hook, as the model does for ``predict``."""

    def __init__(self, max_prompt_tokens: int) -> None:
        super().__init__()
        self.max_prompt_tokens = max_prompt_tokens
        self.layer = torch.nn.Linear(1, 1)

    def setup(self, stage: str) -> None:
        if stage == "predict":
            self.trainer.datamodule.check_prompts_fit(self.max_prompt_tokens, WHY)

    def predict_step(self, batch, batch_idx):
        return batch["lengths"]


def test_check_prompts_fit_works_from_the_lightning_module_setup_hook(tmp_path):
    dm = byte_dm(tmp_path, predict_prompts=str(write_prompts(tmp_path)))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="--data.predict_prompts: the prompt on line 4 "):
        trainer.predict(_ChecksPromptsInSetup(40), datamodule=dm)
    lengths = torch.cat(trainer.predict(_ChecksPromptsInSetup(60), datamodule=dm))
    assert lengths.tolist() == [5, 50, 60]


# ----------------------------------------------------------------------------------------------- undecodable corpus


def write_corpus(root: Path, binary: bool) -> Path:
    root.mkdir()
    for i in range(4):  # valid UTF-8, including U+FFFD written in the files themselves (not decode errors)
        (root / f"mod{i}.py").write_text(f"x{i} = '\ufffd\ufffd naïve 日本'\n" * 40, encoding="utf-8")
    if binary:
        (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)) * 8 + b"\n")
        (root / "notes.txt").write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 20)
    return root


def expected_share(root: Path) -> float:
    texts = {f: f.read_bytes().decode("utf-8", errors="replace") for f in root.iterdir()}
    replaced = sum(t.count("\ufffd") - f.read_bytes().count("\ufffd".encode()) for f, t in texts.items())
    return replaced / sum(len(t) for t in texts.values())


def test_corpus_of_undecodable_bytes_warns_with_share_and_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", binary=True)
    share = expected_share(corpus)
    assert share > UNDECODABLE_WARN_SHARE
    dm = TextDataModule(corpus=str(corpus), suffixes=None, tokenizer="byte", seq_len=16, val_fraction=0.3,
                        cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="--data.corpus: .* are U\\+FFFD") as record:
        dm.setup("fit")
    (message,) = [str(w.message) for w in record if "U+FFFD" in str(w.message)]
    assert f"{share:.1%} of the corpus characters" in message and "\n" not in message
    for part in ("in 2 file(s)", "(worst: logo.png ", ", notes.txt ", "not UTF-8 text",
                 "binary files or another encoding", "replacement characters", "--data.suffixes",
                 "convert the files to UTF-8"):
        assert part in message, message
    assert "mod0.py" not in message


def test_valid_corpus_with_literal_replacement_characters_does_not_warn(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", binary=False)
    dm = TextDataModule(corpus=str(corpus), suffixes=None, tokenizer="byte", seq_len=16, val_fraction=0.3,
                        cache_dir=str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dm.setup("fit")
    assert not [w for w in record if "U+FFFD" in str(w.message)]


def test_a_folder_without_the_suffixes_read_names_the_files_it_has(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "words " * 40 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^--data.corpus: directory .*docs' \(files ending in \.py\) holds none, only "
                                         r"files ending in \.txt: name the endings to read with --data.suffixes"):
        byte_dm(tmp_path, corpus=str(folder)).setup("fit")
    dm = byte_dm(tmp_path, corpus=str(folder), suffixes=[".txt"], val_fraction=0.34)
    dm.setup("fit")  # named: read
    assert len(dm.train_dataset) > 0
