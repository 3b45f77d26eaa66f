"""A catalogue of bad input, through the CLI and the Python API, as a new user would give it.

Each case asserts the refusal (exit status 2 with one short message, or the exception) and that the message names
the field or flag to fix. Nothing here trains beyond a few steps of a tiny model.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import cli_refusal, tiny_fit_args, tiny_predict_args
from torch import nn

from lightning_mtp import MTPConfig, MTPMixin
from lightning_mtp.decoding import GenerationConfig
from lightning_mtp.models import CausalLM, ModelConfig


class Pickled:
    """Not a plain type: a checkpoint holding it cannot be read with weights_only=True."""


def _bad_files(tmp_path, good):
    files = {"missing": tmp_path / "missing.ckpt", "empty": tmp_path / "empty.ckpt",
             "truncated": tmp_path / "truncated.ckpt", "text": tmp_path / "text.ckpt",
             "pickled": tmp_path / "pickled.ckpt"}
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(good.read_bytes()[:1000])
    files["text"].write_text("hello\n")
    torch.save({"state_dict": {}, "object": Pickled()}, files["pickled"])
    return files


# ------------------------------------------------------------------------------------------ CLI: config values
CONFIG_CASES = [
    (("--model.init_args.mtp.depth", "0"), "--model.mtp.depth"),
    (("--model.init_args.mtp.architecture", "tree"), "architecture"),
    (("--model.init_args.mtp.loss_weight", "-1"), "--model.mtp.loss_weight"),
    (("--model.init_args.mtp.depth_weights", "[1.0, 2.0, 3.0]"), "--model.mtp.depth_weights"),
    (("--model.init_args.mtp.num_heads", "5"), "--model.init_args.mtp.num_heads"),
    (("--model.init_args.mtp.num_heads", "32"), "--model.init_args.mtp.num_heads"),  # head size 1: odd for RoPE
    (("--model.init_args.mtp.loss_chunk_size", "0"), "--model.mtp.loss_chunk_size"),
    (("--model.init_args.model.dim", "30"), "--model.model.dim"),
    (("--model.init_args.model.n_kv_heads", "3"), "--model.model.n_kv_heads"),
    (("--model.init_args.learning_rate", "-1"), "learning_rate"),
    (("--model.init_args.generation.temperature", "-1"), "--model.generation.temperature"),
    (("--model.init_args.generation.top_p", "2"), "--model.generation.top_p"),
    (("--model.init_args.generation.seed", "-3"), "--model.generation.seed"),
    (("--data.init_args.tokenizer", "wordpiece"), "--data.tokenizer"),
    (("--data.init_args.vocab_size", "10"), "--data.vocab_size"),
    (("--data.init_args.seq_len", "1"), "--data.seq_len"),
    (("--data.init_args.val_fraction", "1.5"), "--data.val_fraction"),
    (("--data.init_args.batch_size", "0"), "--data.batch_size"),
    (("--data.init_args.suffixes", ".py"), "--data.init_args.suffixes"),
    (("--model.init_args.init_from", "/no/such/file.ckpt"), "--model.init_args.init_from"),
]


@pytest.mark.parametrize("flags, named", CONFIG_CASES, ids=[c[0][0].split(".")[-1] + "=" + c[0][1]
                                                              for c in CONFIG_CASES])
def test_bad_config_values_are_refused_naming_the_flag(tmp_path, capsys, flags, named):
    err = cli_refusal(tiny_fit_args(tmp_path, *flags), capsys)
    assert named in err
    assert len(err.strip().splitlines()) <= 4, err  # one short message, not a chained traceback


# ------------------------------------------------------------------------------------------ CLI: data vs model
DATA_CASES = [
    (("--data.init_args.corpus", "/no/such/corpus"), "--data.corpus"),
    (("--data.init_args.tokenizer", "byte", "--model.init_args.model.vocab_size", "200"), "--data.vocab_size"),
    (("--data.init_args.seq_len", "3", "--model.init_args.mtp.depth", "2"), "--model.mtp.depth"),
    (("--data.init_args.seq_len", "65"), "--model.init_args.model.max_seq_len"),
    (("--data.init_args.predict_prompts", "/no/prompts.txt"), "--data.predict_prompts"),
]


@pytest.mark.parametrize("flags, named", DATA_CASES, ids=["corpus", "vocab", "seq_len_depth", "seq_len_context",
                                                          "prompts"])
def test_data_that_does_not_fit_the_model_fails_before_training(tmp_path, capsys, flags, named):
    err = cli_refusal(tiny_fit_args(tmp_path, "--data.init_args.tokenizer", "byte", *flags), capsys)
    assert named in err
    assert not (tmp_path / "ckpt").exists()  # refused before any step


# ------------------------------------------------------------------------------------------ CLI: checkpoints
@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "text", "pickled"])
@pytest.mark.parametrize("via", ["--ckpt_path", "--model.init_args.init_from"])
def test_unreadable_checkpoints_are_refused_naming_path_and_flag(tiny_checkpoint, tmp_path, capsys, kind, via):
    path = _bad_files(tmp_path, tiny_checkpoint[1])[kind]
    if via == "--ckpt_path":
        err = cli_refusal(tiny_predict_args(tmp_path, path), capsys)
    else:
        err = cli_refusal(tiny_fit_args(tmp_path, via, str(path)), capsys)
    assert via in err and str(path) in err


@pytest.mark.parametrize("flags, named", [
    (("--data.init_args.tokenizer", "byte"), "--data.init_args.tokenizer"),
    (("--data.init_args.vocab_size", "512"), "--data.init_args.vocab_size"),
    (("--model.init_args.mtp.depth", "3"), "--model.init_args.mtp.depth"),
    (("--model.init_args.model.n_layers", "2"), "--model.init_args.model.n_layers"),
])
def test_predict_flags_contradicting_the_checkpoint_are_refused(tiny_checkpoint, tmp_path, capsys, flags, named):
    err = cli_refusal(tiny_predict_args(tmp_path, tiny_checkpoint[1], *flags), capsys)
    assert named in err and "checkpoint" in err


def test_validate_without_weights_is_refused(tmp_path, capsys):
    args = tiny_fit_args(tmp_path)
    args[0] = "validate"
    err = cli_refusal(args, capsys)
    assert "--ckpt_path" in err and "--random_weights" in err


def test_resume_with_another_depth_is_refused(tiny_checkpoint, tmp_path, capsys):
    err = cli_refusal(tiny_fit_args(tmp_path, "--ckpt_path", str(tiny_checkpoint[1]), "--model.init_args.mtp.depth",
                                    "1"), capsys)
    assert "--model.init_args.mtp.depth" in err and "--model.init_args.init_from" in err


def test_unknown_flag_is_refused(tmp_path, capsys):
    err = cli_refusal(tiny_fit_args(tmp_path, "--model.init_args.mtp.dept", "2"), capsys)
    assert "dept" in err


# ------------------------------------------------------------------------------------------ Python API
def test_python_predict_with_another_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    """trainer.predict(ckpt_path=...) with a datamodule whose BPE has the same size but other merges."""
    from lightning_mtp.data import TextDataModule

    _, ckpt = tiny_checkpoint
    hparams = torch.load(ckpt, weights_only=True)["hyper_parameters"]
    model = CausalLM(model=hparams["model"], mtp=hparams["mtp"])
    data = TextDataModule(tokenizer="bpe", vocab_size=300, max_bytes=60000, seq_len=32, cache_dir=tmp_path / "c")
    trainer = L.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu", default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer bpe-300 .*the same size but other merges.*--data\.tokenizer"):
        trainer.predict(model, datamodule=data, ckpt_path=ckpt)
    # load_from_checkpoint first, then predict with a byte-level datamodule: refused in setup.
    loaded = CausalLM.load_from_checkpoint(ckpt, weights_only=True)
    data = TextDataModule(tokenizer="byte", max_bytes=60000, seq_len=32, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"the model's weights: .*bpe-300.*byte"):
        L.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu").predict(loaded, datamodule=data)


class TinyHost(MTPMixin, L.LightningModule):
    def __init__(self, trunk_output: str = "ok"):
        super().__init__(mtp=MTPConfig(depth=1))
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
        self.trunk_output = trunk_output

    def mtp_token_embedding(self):
        return self.embed

    def mtp_output_head(self):
        return self.head

    def mtp_trunk_hidden_states(self, input_ids):
        hidden = self.embed(input_ids)  # (B, T, 16)
        if self.trunk_output == "logits":
            return self.head(hidden)  # (B, T, 50): wrong width
        if self.trunk_output == "flat":
            return hidden.reshape(-1, 16)  # (B*T, 16): wrong rank
        return hidden


@pytest.mark.parametrize("trunk_output", ["logits", "flat"])
def test_custom_host_returning_the_wrong_hidden_shape_is_named(trunk_output):
    host = TinyHost(trunk_output)
    host.configure_model()
    with pytest.raises(ValueError, match=r"TinyHost\.mtp_trunk_hidden_states\(input_ids\).*\(2, 8, 16\)"):
        host.compute_lm_loss(torch.randint(0, 50, (2, 8)))
    TinyHost().configure_model()  # the right shape is fine


def test_python_api_errors_name_the_field():
    with pytest.raises(ValueError, match=r"--model\.init_args\.mtp\.num_heads"):
        CausalLM(ModelConfig(vocab_size=64, dim=32, n_heads=4), MTPConfig(num_heads=3))
    with pytest.raises(ValueError, match=r"--model\.init_args\.init_from"):
        CausalLM(ModelConfig(vocab_size=64, dim=32, n_heads=4), init_from="/no/such.ckpt")
    with pytest.raises(ValueError, match=r"GenerationConfig\.max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    from lightning_mtp.callbacks import MTPDiversityRegularizer

    with pytest.raises(ValueError, match=r"MTPDiversityRegularizer\.name"):
        MTPDiversityRegularizer(name="not valid")
