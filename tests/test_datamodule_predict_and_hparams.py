"""``TextDataModule`` for ``predict`` with a prompts file reads the prompts alone (not the corpus), and a module with
hyper-parameters of its own (``vocab_size``: its embedding rows) trains with it and a logger.

A prompts file needs only the tokenizer (the checkpoint's record, or the model folder's): before, ``setup("predict")``
and ``prepare_data`` read and tokenized the whole training corpus (the standard library by default) all the same.
Lightning merges the module's and the datamodule's hyper-parameters for the loggers and refused ``vocab_size`` with
two values (the README's ``MyLM(vocab_size=258)`` beside the datamodule's default 4096, which ``"byte"`` ignores).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger
from test_mixin import GRUTrunkHost

import lightning_mtp.data.datamodule as datamodule_module
from lightning_mtp import MTPConfig
from lightning_mtp.checkpointing import TOKENIZER_KEY
from lightning_mtp.cli import main
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPTS = ["def main():", "import os", "class Point:\n    x = 1"]


def write_corpus(folder: Path) -> Path:
    """Six small Python files (about 9 kB): a train and a val split of a few hundred windows of 32 bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # step {j}\n\n" for j in range(30))
        (folder / f"mod{i}.py").write_text(body, encoding="utf-8")
    return folder


def write_prompts(path: Path) -> Path:
    path.write_text("\n".join(p.replace("\n", "\\n") for p in PROMPTS) + "\n", encoding="utf-8")
    return path


def forbid_reading_the_corpus(monkeypatch) -> None:
    """Fail the test if the corpus is looked for or tokenized."""
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was read for predict with a prompts file")

    monkeypatch.setattr(datamodule_module, "find_corpus_files", refuse)
    monkeypatch.setattr(datamodule_module, "tokenize_documents", refuse)


def tiny_causal_lm() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=4, max_seq_len=64), MTPConfig(depth=2))


def quiet_trainer(**kwargs) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    return L.Trainer(**{**options, **kwargs})


def byte_dm(corpus: Path, cache: Path, **kwargs) -> TextDataModule:
    return TextDataModule(corpus=str(corpus), tokenizer="byte", seq_len=32, batch_size=4, cache_dir=str(cache),
                          **kwargs)


# ----------------------------------------------------------------------------------------------- predict


def test_predict_setup_with_a_prompts_file_reads_only_the_prompts(tmp_path, monkeypatch):
    corpus, cache = write_corpus(tmp_path / "corpus"), tmp_path / "cache"
    dm = byte_dm(corpus, cache, predict_prompts=str(write_prompts(tmp_path / "prompts.txt")))
    forbid_reading_the_corpus(monkeypatch)
    dm.setup("predict")
    assert dm.train_dataset is None and dm.val_dataset is None
    assert not (cache / "tokens").exists()
    assert dm.prompt_dataset().texts == PROMPTS
    assert dm.prompt_dataset().prompts == [list(p.encode("utf-8")) for p in PROMPTS]
    # What predict needs besides the prompts comes from the tokenizer alone.
    assert (dm.vocab_size, dm.pad_id, dm.stop_ids) == (258, dm.tokenizer.pad_id, [dm.tokenizer.eos_id])
    dm.check_prompts_fit(40, "test")
    with pytest.raises(ValueError, match="line 3"):
        dm.check_prompts_fit(12, "test")
    batch = next(iter(dm.predict_dataloader()))
    assert batch["prompt_text"] == PROMPTS and batch["lengths"].tolist() == [len(p.encode()) for p in PROMPTS]
    assert dm.tokenizer_record()["data"]["vocab_size"] == 4096  # the checkpoint's record is unchanged
    assert not (cache / "tokens").exists()


def test_predict_without_a_prompts_file_still_takes_held_out_windows(tmp_path):
    corpus, cache = write_corpus(tmp_path / "corpus"), tmp_path / "cache"
    dm = byte_dm(corpus, cache, num_predict_prompts=2, prompt_tokens=8)
    dm.setup("predict")
    assert dm.val_dataset is not None and (cache / "tokens").is_dir()
    assert dm.prompt_dataset().prompts == [dm.val_tokens[i * 32: i * 32 + 8].tolist() for i in range(2)]


def test_trainer_predict_with_a_prompts_file_skips_the_corpus_and_generates_the_same(tmp_path, monkeypatch):
    """Lightning calls ``prepare_data`` for predict too: it must not tokenize the corpus either. The generations are
    those of a datamodule that built its windows first (the old path)."""
    corpus, prompts = write_corpus(tmp_path / "corpus"), write_prompts(tmp_path / "prompts.txt")
    model = tiny_causal_lm()
    model.mtp_generate_kwargs = {"max_new_tokens": 6, "speculative": False}
    old = byte_dm(corpus, tmp_path / "old", predict_prompts=str(prompts))
    old.setup("fit")  # windows built, as predict did before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes about the CPU run and loader workers
        expected = quiet_trainer().predict(model, datamodule=old)
        forbid_reading_the_corpus(monkeypatch)
        new = byte_dm(corpus, tmp_path / "new", predict_prompts=str(prompts))
        got = quiet_trainer().predict(model, datamodule=new)
    assert not (tmp_path / "new" / "tokens").exists() and (tmp_path / "old" / "tokens").is_dir()
    assert [out["prompt_text"] for out in got] == [out["prompt_text"] for out in expected] == [PROMPTS]
    assert [out["tokens"] for out in got] == [out["tokens"] for out in expected]
    assert [out["texts"] for out in got] == [out["texts"] for out in expected]
    assert all(len(row) == 6 for row in got[0]["tokens"])


def test_cli_predict_with_a_prompts_file_does_not_tokenize_the_default_corpus(tmp_path, monkeypatch):
    """``lightning-mtp predict --ckpt_path CKPT --data.init_args.predict_prompts FILE``: the checkpoint's tokenizer and
    the prompts; the corpus (the standard library, as the checkpoint's own corpus is left out) is not read. The
    generations equal those of the old path, which tokenized the corpus first."""
    corpus, prompts = write_corpus(tmp_path / "corpus"), write_prompts(tmp_path / "prompts.txt")
    model = tiny_causal_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
        trainer.fit(model, datamodule=byte_dm(corpus, tmp_path / "fit_cache"))
    ckpt = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=True)[TOKENIZER_KEY]["kind"] == "byte"

    def predict(name: str) -> list[dict]:
        out = tmp_path / name
        main(["predict", "--config", str(README.parent / "configs" / "predict.yaml"), "--ckpt_path", str(ckpt),
              "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
              "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks.init_args.output_dir", str(out),
              "--data.init_args.cache_dir", str(tmp_path / f"{name}_cache"), "--data.init_args.max_bytes", "40000",
              "--data.init_args.predict_prompts", str(prompts),
              "--model.init_args.generation.max_new_tokens", "6"])
        return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]

    setup = TextDataModule.setup

    def old_setup(self, stage=None):  # what setup did before: the corpus windows whatever the stage
        self._setup_windows()
        setup(self, stage)

    with monkeypatch.context() as patch:
        patch.setattr(TextDataModule, "setup", old_setup)
        expected = predict("old")
    assert (tmp_path / "old_cache" / "tokens").is_dir()
    forbid_reading_the_corpus(monkeypatch)
    got = predict("new")
    assert not (tmp_path / "new_cache" / "tokens").exists()
    assert len(got) == len(PROMPTS)
    strip = [{k: v for k, v in row.items() if "time" not in k and "seconds" not in k} for row in got]
    assert strip == [{k: v for k, v in row.items() if "time" not in k and "seconds" not in k} for row in expected]


# ----------------------------------------------------------------------------------------------- hyper-parameters


class GRULM(GRUTrunkHost):
    """The README's own-module example at test size: ``vocab_size`` is one of its hyper-parameters."""

    def __init__(self, vocab_size: int = 258, dim: int = 32, lr: float = 1e-2):
        super().__init__(vocab_size, dim)
        self.save_hyperparameters()


@pytest.mark.parametrize("tokenizer, data_vocab, model_vocab", [("byte", 4096, 258), ("bpe", 300, 320)])
def test_own_module_with_another_vocab_size_fits_with_a_logger(tmp_path, tokenizer, data_vocab, model_vocab):
    corpus = write_corpus(tmp_path / "corpus")
    dm = TextDataModule(corpus=str(corpus), tokenizer=tokenizer, vocab_size=data_vocab, seq_len=32, batch_size=4,
                        cache_dir=str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = GRULM(vocab_size=model_vocab)
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer(logger=logger, max_steps=2, limit_val_batches=1, val_check_interval=2)
        trainer.fit(model, datamodule=dm)  # RuntimeError: Error while merging hparams (before)
    assert trainer.global_step == 2
    logged = yaml.load((Path(logger.log_dir) / "hparams.yaml").read_text(), Loader=yaml.FullLoader)  # suffixes: a tuple
    assert logged["vocab_size"] == model_vocab and logged["data/vocab_size"] == data_vocab
    assert logged["tokenizer"] == tokenizer and logged["seq_len"] == 32
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    # What a checkpoint needs keeps its names: the datamodule's settings and the tokenizer record.
    assert saved["datamodule_hyper_parameters"]["vocab_size"] == data_vocab
    assert saved["hyper_parameters"]["vocab_size"] == model_vocab
    assert saved[TOKENIZER_KEY]["data"]["vocab_size"] == data_vocab
    assert saved[TOKENIZER_KEY]["kind"] == tokenizer
    assert dict(dm.hparams)["vocab_size"] == data_vocab and "data/vocab_size" not in dm.hparams


def test_equal_shared_hyper_parameters_keep_their_names(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    dm = byte_dm(corpus, tmp_path / "cache", vocab_size=258)
    trainer = quiet_trainer()
    trainer.strategy.connect(GRULM(vocab_size=258))
    dm.trainer = trainer
    assert dm.hparams_initial["vocab_size"] == 258 and "data/vocab_size" not in dm.hparams_initial


def test_readme_module_fits_under_the_cli_with_a_byte_text_datamodule(tmp_path, monkeypatch):
    """``lightning-mtp fit --model mylm.MyLM --model.vocab_size 258 --data TextDataModule --data.tokenizer byte``
    with the CLI's default logger (TensorBoard): the README's module, read from README.md."""
    section = README.read_text().split("## Add MTP to your own module\n", 1)[1].split("\n## ", 1)[0]
    (tmp_path / "mylm.py").write_text(re.findall(r"```python\n(.*?)```", section, flags=re.S)[0], encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    corpus = write_corpus(tmp_path / "corpus")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["fit", "--model", "mylm.MyLM", "--model.vocab_size", "258", "--model.dim", "32",
              "--data", "TextDataModule", "--data.tokenizer", "byte", "--data.corpus", str(corpus),
              "--data.seq_len", "32", "--data.batch_size", "4", "--data.cache_dir", str(tmp_path / "cache"),
              "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.accelerator", "cpu",
              "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
              "--trainer.default_root_dir", str(tmp_path / "run")])
    (hparams,) = (tmp_path / "run").rglob("hparams.yaml")
    logged = yaml.load(hparams.read_text(), Loader=yaml.FullLoader)  # suffixes: a tuple
    assert logged["vocab_size"] == 258 and logged["data/vocab_size"] == 4096
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=True)
    assert saved["hyper_parameters"]["vocab_size"] == 258
    assert saved["datamodule_hyper_parameters"]["vocab_size"] == 4096
    assert saved[TOKENIZER_KEY]["kind"] == "byte"
