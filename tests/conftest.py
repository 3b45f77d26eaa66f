"""Shared fixtures: tiny models that run in milliseconds on CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: tiny models gain nothing from more, and under load two threads made them 10-40x slower.
torch.set_num_threads(1)


def tiny_model(depth: int = 3, architecture: str = "cascaded", vocab_size: int = 61, **mtp_kwargs):
    from lightning_mtp import MTPConfig
    from lightning_mtp.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model_kwargs = {k: mtp_kwargs.pop(k) for k in ("tie_embeddings", "n_kv_heads") if k in mtp_kwargs}
    model = CausalLM(
        ModelConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, max_seq_len=64, **model_kwargs),
        MTPConfig(depth=depth, architecture=architecture, **mtp_kwargs),
    )
    model.configure_model()
    return model


@pytest.fixture
def make_tiny_model():
    return tiny_model


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(REPO, "benchmarks"))  # benchmark helpers the tests share (model_folders); last in line


def tiny_fit_args(workdir, *extra: str) -> list[str]:
    """``lightning-mtp fit`` on the quickstart config shrunk to a few seconds (BPE 300, 1 layer, width 32).

    Checkpoints go to ``<workdir>/ckpt/last.ckpt``; caches to ``<workdir>/cache``. ``extra`` flags come last.
    """
    workdir = str(workdir)
    return [
        "fit", "--config", os.path.join(REPO, "configs", "quickstart.yaml"),
        "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", workdir,
        "--trainer.callbacks.init_args.dirpath", os.path.join(workdir, "ckpt"),
        "--data.init_args.vocab_size", "300", "--data.init_args.max_bytes", "120000",
        "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "4",
        "--data.init_args.cache_dir", os.path.join(workdir, "cache"),
        "--model.init_args.model.vocab_size", "300", "--model.init_args.model.dim", "32",
        "--model.init_args.model.n_layers", "1", "--model.init_args.model.max_seq_len", "64",
        *extra,
    ]


def tiny_predict_args(workdir, ckpt, *extra: str) -> list[str]:
    """``lightning-mtp predict --config configs/predict.yaml --ckpt_path CKPT`` with no ``--data`` tokenizer flags."""
    workdir = str(workdir)
    return [
        "predict", "--config", os.path.join(REPO, "configs", "predict.yaml"), "--ckpt_path", str(ckpt),
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
        workdir, "--trainer.callbacks.init_args.output_dir", os.path.join(workdir, "predictions"),
        "--data.init_args.cache_dir", os.path.join(workdir, "cache"), "--data.init_args.num_predict_prompts", "2",
        "--data.init_args.prompt_tokens", "8", "--model.init_args.generation.max_new_tokens", "6", *extra,
    ]


def cli_refusal(args: list[str], capsys) -> str:
    """Run ``lightning-mtp`` with ``args``; it must refuse with exit status 2 and a short message: return stderr."""
    from lightning_mtp.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and "weights_only=False" not in err, err
    assert "error:" in err, err
    return err


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """(workdir, path) of a depth-2 BPE-300 checkpoint (max_bytes 120000) written by ``lightning-mtp fit``."""
    from lightning_mtp.cli import main

    workdir = tmp_path_factory.mktemp("trained")
    main(tiny_fit_args(workdir, "--model.init_args.mtp.depth", "2"))
    return workdir, workdir / "ckpt" / "last.ckpt"


def save_checkpoint(module, path) -> str:
    """``module``'s checkpoint as a plain ``Trainer`` writes it (no ``_class_path`` in its hyper-parameters)."""
    import lightning as L

    trainer = L.Trainer(max_steps=0, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(path.parent))
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return str(path)


@pytest.fixture
def switches():
    """``speculative="auto"``'s mechanism switches (``lightning_mtp.decoding.auto.SWITCHES``), restored after the
    test."""
    from lightning_mtp.decoding.auto import SWITCHES

    saved = dict(vars(SWITCHES))
    yield SWITCHES
    vars(SWITCHES).update(saved)
