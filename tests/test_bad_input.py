"""A catalogue of bad input, through the CLI and the Python API, as a new user would give it.

Each case asserts the refusal (exit status 2 with one short message, or the exception) and that the message names
the field or flag to fix, or that nothing is lost or silently wrong (previous outputs kept, nothing written outside
the output folder, settings applied). Nothing here trains beyond a few steps of a tiny model. The units behind these
cases have tests of their own: ``test_data_input_errors.py`` (prompts files and lengths, corpora), ``test_export_cli``
(export folders), ``test_divergence.py`` and ``test_safe_checkpoint.py`` (diverged, killed and concurrent fits).
"""

from __future__ import annotations

import os
import re

import lightning as L
import pytest
import torch
from conftest import cli_refusal, save_checkpoint, tiny_fit_args, tiny_model, tiny_predict_args
from test_mixin import GRUTrunkHost
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
    why = {"missing": "does not exist", "empty": "is an empty file", "truncated": "truncated or not a PyTorch",
           "text": "it is not a PyTorch checkpoint", "pickled": "holds pickled Python objects"}[kind]
    assert why in err, err  # a text file was said to hold pickled objects


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


def test_a_misspelt_option_of_a_class_given_by_flags_is_named(capsys):
    """jsonargparse's own words were ``Expected a str. Got value: NestedArg(key='stag', val='3')``."""
    err = cli_refusal(["fit", "--config", "deepspeed_zero2", "--trainer.strategy.init_args.stag", "3"], capsys)
    assert "--trainer.strategy: no option 'stag'" in err and "NestedArg" not in err


def test_configs_in_the_wrong_order_say_which_order_works(tmp_path, capsys):
    """``--config finetune --config deepspeed_zero3``: the second config's model class took the first's settings."""
    err = cli_refusal(["fit", "--config", "finetune", "--config", "deepspeed_zero3", "--model.init_args.pretrained",
                       str(tmp_path)], capsys)
    assert "Option 'pretrained' is not accepted" in err and "--config deepspeed_zero3 --config finetune" in err


def test_a_typo_in_a_second_config_gets_no_config_order_hint(tmp_path, capsys):
    """A misspelt option in a second ``--config`` is a typo, not an option the first config's class had: the hint
    about config order sent the user the wrong way."""
    (tmp_path / "typo.yaml").write_text("data:\n  init_args:\n    seq_lenn: 32\n")
    err = cli_refusal(["fit", "--config", "quickstart", "--config", str(tmp_path / "typo.yaml")], capsys)
    assert "Option 'seq_lenn' is not accepted" in err and "later --config" not in err


def test_a_config_that_is_not_yaml_is_named_with_its_line(tmp_path, capsys):
    """jsonargparse said only "Problems parsing config: while parsing a flow sequence" (no file, no line)."""
    (tmp_path / "bad.yaml").write_text("data:\n  init_args:\n    seq_len: [32\n")
    err = cli_refusal(["fit", "--config", "quickstart", "--config", str(tmp_path / "bad.yaml")], capsys)
    assert f"--config {tmp_path / 'bad.yaml'}: not valid YAML (line 4, column 1)" in err


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


# ------------------------------------------------------------------------------------------ prompts
LATIN1_PROMPTS = "def main():\nimport os\n# café au lait\n".encode("latin-1")  # 0xe9 at line 3


@pytest.mark.parametrize("kind", ["non-utf8", "folder", "blank"])
def test_cli_refuses_bad_prompts_files_in_one_line(tiny_checkpoint, tmp_path, capsys, kind):
    workdir, ckpt = tiny_checkpoint
    path = tmp_path / ("prompts" if kind == "folder" else "prompts.txt")
    if kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(LATIN1_PROMPTS if kind == "non-utf8" else b"\n \n")
    err = cli_refusal(tiny_predict_args(workdir, ckpt, "--data.init_args.predict_prompts", str(path)), capsys)
    line = err.strip().splitlines()[-1]
    assert line.startswith("lightning-mtp: error: --data.predict_prompts: "), err
    expected = {"non-utf8": "is not UTF-8 text: line 3", "folder": "is a folder", "blank": "has no (non-blank) prompts"}
    assert expected[kind] in line, err


def test_cli_refuses_a_prompts_folder_before_training(tmp_path, capsys):
    err = cli_refusal(tiny_fit_args(tmp_path, "--data.init_args.predict_prompts", str(tmp_path)), capsys)
    assert "--data.predict_prompts: " in err and "is a folder" in err, err


def test_a_prompt_too_long_for_the_context_names_its_line(tiny_checkpoint, tmp_path, capsys):
    workdir, ckpt = tiny_checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f():\n\n" + "x = 1\\n" * 40 + "\n", encoding="utf-8")  # line 3: ~200 tokens
    err = cli_refusal(tiny_predict_args(workdir, ckpt, "--data.init_args.predict_prompts", str(prompts)), capsys)
    assert "line 3" in err and str(prompts) in err and "--model.init_args.generation.max_new_tokens" in err, err


def test_max_new_tokens_filling_the_whole_context_is_named_not_the_prompt(tiny_checkpoint, tmp_path, capsys):
    workdir, ckpt = tiny_checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f():\n", encoding="utf-8")
    err = cli_refusal(tiny_predict_args(workdir, ckpt, "--data.init_args.predict_prompts", str(prompts),
                                        "--model.init_args.generation.max_new_tokens", "5000"), capsys)
    assert "--model.init_args.generation.max_new_tokens 5000 leaves no room for a prompt" in err, err
    assert "line 1" not in err and "-" not in err.split("context of")[1].split("tokens")[0], err


# ------------------------------------------------------------------------------------------ predict outputs
def test_a_refused_predict_leaves_the_previous_outputs_untouched(tiny_checkpoint, tmp_path, capsys):
    workdir, ckpt = tiny_checkpoint
    from lightning_mtp.cli import main

    main(tiny_predict_args(tmp_path, ckpt))
    outputs = tmp_path / "predictions"
    before = {p.name: p.read_bytes() for p in outputs.iterdir()}
    assert set(before) == {"generations.jsonl", "stats.json"} and before["generations.jsonl"]
    cli_refusal(tiny_predict_args(tmp_path, ckpt, "--model.init_args.generation.max_new_tokens", "60"), capsys)
    assert {p.name: p.read_bytes() for p in outputs.iterdir()} == before  # no partial file left either


def test_predict_writes_nothing_outside_its_output_folder(tiny_checkpoint, tmp_path, monkeypatch):
    workdir, ckpt = tiny_checkpoint
    from lightning_mtp.cli import main

    here = tmp_path / "here"
    here.mkdir()
    (here / "config.yaml").write_text("mine\n")
    monkeypatch.chdir(here)
    main(tiny_predict_args(tmp_path, ckpt, "--trainer.callbacks.init_args.output_dir", str(tmp_path / "out")))
    assert sorted(p.name for p in here.iterdir()) == ["config.yaml"] and (here / "config.yaml").read_text() == "mine\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["generations.jsonl", "stats.json"]


def test_an_output_dir_that_is_a_file_is_refused(tiny_checkpoint, tmp_path, capsys):
    workdir, ckpt = tiny_checkpoint
    (tmp_path / "taken").write_text("x")
    err = cli_refusal(tiny_predict_args(tmp_path, ckpt, "--trainer.callbacks.init_args.output_dir",
                                        str(tmp_path / "taken")), capsys)
    assert "--trainer.callbacks.init_args.output_dir" in err and "is a file" in err


# ------------------------------------------------------------------------------------------ generation settings
class OwnLM(GRUTrunkHost):
    """A module of one's own, as the README writes one: no ``generation`` argument."""

    def __init__(self, vocab: int = 300, dim: int = 32):
        super().__init__(vocab, dim)
        self.save_hyperparameters()


@pytest.fixture(scope="module")
def own_checkpoint(tmp_path_factory):
    from lightning_mtp.cli import main

    workdir = tmp_path_factory.mktemp("own")
    main(tiny_fit_args(workdir, "--model", "test_bad_input.OwnLM", "--trainer.max_steps", "2"))
    return workdir / "ckpt" / "last.ckpt"


def test_generation_settings_apply_to_a_module_of_ones_own(own_checkpoint, tmp_path):
    import json

    from lightning_mtp.cli import main

    main(tiny_predict_args(tmp_path, own_checkpoint, "--model.init_args.generation.max_new_tokens", "5",
                           "--model.init_args.generation.speculative", "true"))
    rows = [json.loads(line) for line in (tmp_path / "predictions" / "generations.jsonl").read_text().splitlines()]
    stats = json.loads((tmp_path / "predictions" / "stats.json").read_text())
    assert rows and all(len(row["tokens"]) == 5 for row in rows)  # predict.yaml's 128 overridden, not 64 either
    assert stats["generation"]["max_new_tokens"] == 5 and stats["generation"]["speculative"] is True


# ------------------------------------------------------------------------------------------ generate()
@pytest.mark.parametrize("name", ["eos_token_id", "pad_token_id"])
def test_special_ids_outside_the_vocabulary_are_refused(make_tiny_model, name):
    model = make_tiny_model(depth=2)
    with pytest.raises(ValueError, match=rf"{name} .*--model.generation.{name}\) is 61, outside the model's "
                                         r"vocabulary of 61 ids"):
        model.generate(torch.tensor([[1, 2, 3]]), 4, **{name: 61})


# ------------------------------------------------------------------------------------------ checkpoints of other models
def without_class_record(path: str) -> str:
    """The checkpoint as lightning-mtp wrote it before checkpoints named their module class."""
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["mtp"].pop("module_class", None)
    torch.save(checkpoint, path)
    return path


def tiny_hf_model():
    from lightning_mtp.models import HFCausalLM

    return HFCausalLM("llama", dict(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4), mtp=MTPConfig(depth=2))


def test_a_transformers_host_checkpoint_given_to_the_bundled_model_names_its_class(tmp_path, capsys):
    pytest.importorskip("transformers")
    ckpt = without_class_record(save_checkpoint(tiny_hf_model(), tmp_path / "hf.ckpt"))
    err = cli_refusal(tiny_predict_args(tmp_path, ckpt, "--random_weights", "false"), capsys)
    assert "holds a HFCausalLM" in err and "--model lightning_mtp.models.HFCausalLM" in err, err
    assert "is not accepted" not in err


def test_the_bundled_models_checkpoint_given_to_a_module_of_ones_own_names_its_class(tmp_path, capsys):
    ckpt = without_class_record(save_checkpoint(CausalLM(ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4)),
                                                tmp_path / "causal.ckpt"))
    err = cli_refusal(tiny_predict_args(tmp_path, ckpt, "--model", "test_bad_input.OwnLM"), capsys)
    assert "holds a CausalLM" in err and "--model lightning_mtp.models.CausalLM" in err, err


def test_a_checkpoint_naming_its_class_is_read_with_it(tmp_path):
    """Checkpoints record their module class: predict.yaml's CausalLM yields to the HFCausalLM a checkpoint holds."""
    pytest.importorskip("transformers")
    from lightning_mtp.cli import main

    ckpt = save_checkpoint(tiny_hf_model(), tmp_path / "hf.ckpt")
    assert torch.load(ckpt, weights_only=True)["mtp"]["module_class"].endswith("HFCausalLM")
    main(tiny_predict_args(tmp_path, ckpt, "--data.init_args.tokenizer", "byte",
                           "--data.init_args.max_bytes", "20000"))
    assert (tmp_path / "predictions" / "generations.jsonl").read_text()


def test_a_module_of_ones_own_checkpoint_given_to_the_bundled_model_says_so(tmp_path, capsys):
    """Weights of another class are refused naming it (they were refused as 'trained with another model width')."""
    ckpt = save_checkpoint(OwnLM(), tmp_path / "own.ckpt")
    with pytest.raises(ValueError, match=r"the checkpoint's weights are not CausalLM's: it holds weights CausalLM has "
                                         r"not \(embed\.weight|head\.weight|trunk.*written by a test_bad_input\.OwnLM"):
        CausalLM.load_from_checkpoint(ckpt, weights_only=True)
    checkpoint = torch.load(ckpt, weights_only=True)  # as written before checkpoints named their class
    del checkpoint["mtp"]["module_class"], checkpoint["hyper_parameters"]
    torch.save(checkpoint, ckpt)
    err = cli_refusal(tiny_predict_args(tmp_path, ckpt, "--data.init_args.tokenizer", "byte",
                                        "--data.init_args.max_bytes", "20000"), capsys)
    assert "the checkpoint's weights are not CausalLM's" in err and "--model path.to.TheClass" in err, err


# ------------------------------------------------------------------------------------------ export
def export_args(ckpt, out, *extra: str) -> list[str]:
    return ["export", "--ckpt_path", str(ckpt), "--out", str(out), *extra]


def unusable_out(tmp_path, case: str):
    (tmp_path / "a_file").write_text("x")
    if case == "file":
        return tmp_path / "a_file"
    if case == "under a file":
        return tmp_path / "a_file" / "deeper" / "out"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked / "out"


@pytest.mark.parametrize("case", ["file", "under a file", "not writable"])
def test_an_unusable_out_is_refused_in_one_line_before_the_checkpoint_is_read(tmp_path, case, capsys, monkeypatch):
    out = unusable_out(tmp_path, case)
    if case == "not writable" and os.geteuid() == 0:  # root may write anywhere: deny it as the kernel would a user
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(out.parent) and access(path, mode))
    err = cli_refusal(export_args(tmp_path / "missing.ckpt", out), capsys)  # --out is checked first
    assert len(err.strip().splitlines()) == 1, err
    assert "--out" in err and str(out) in err and "--ckpt_path" not in err, err


class OwnModule(L.LightningModule):
    """A user's module whose hyper-parameters share a name (``config``) with ``HFCausalLM``'s."""

    def __init__(self, config: dict = None, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, width)


def other_checkpoint(tmp_path, kind: str) -> str:
    if kind == "own module":
        return save_checkpoint(OwnModule(), tmp_path / "own.ckpt")
    path = save_checkpoint(tiny_model(depth=2), tmp_path / "causal.ckpt")
    if kind == "CausalLM via the CLI":  # what lightning-mtp fit records
        checkpoint = torch.load(path, weights_only=True)
        checkpoint["hyper_parameters"]["_class_path"] = "lightning_mtp.models.CausalLM"
        torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("kind, named", [
    ("CausalLM via a Trainer", "a CausalLM"), ("CausalLM via the CLI", "a CausalLM"),
    ("own module", "hyper-parameters config, width")])
def test_a_model_without_a_transformers_layout_is_refused_naming_what_exports(tmp_path, kind, named, capsys):
    ckpt = other_checkpoint(tmp_path, kind)
    err = cli_refusal(export_args(ckpt, tmp_path / "out"), capsys)
    assert len(err.strip().splitlines()) == 1, err
    assert named in err, err
    for part in ("HFCausalLM", "--model.mtp.layout native", "glm4_moe", "save_mtp_heads"):
        assert part in err, (part, err)
    assert "--model.init_args.model_type" not in err, err
    assert not (tmp_path / "out").exists()




# ------------------------------------------------------------------------------------------ training batches
@pytest.mark.parametrize("batch, named", [
    ({"ids": torch.zeros(2, 8, dtype=torch.long)}, "a dict with 'input_ids'"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 7, dtype=torch.long)},
     "labels must have input_ids' shape (2, 8), got (2, 7)"),
    ({"input_ids": torch.full((2, 8), 61)}, "input_ids range over [61, 61], outside the model's vocabulary [0, 61)"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.full((2, 8), 99)},
     "labels (other than ignore_index -100) range over [99, 99]"),
    ({"input_ids": torch.zeros(2, 8)}, "integer token ids"),
], ids=["no input_ids", "labels shape", "ids", "labels", "float ids"])
def test_bad_training_batches_are_named(make_tiny_model, tmp_path, batch, named):
    model = make_tiny_model(depth=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError) as refused:
        trainer.fit(model, torch.utils.data.DataLoader([batch], batch_size=None))
    assert named in str(refused.value)


# ------------------------------------------------------------------------------------------ the command line
def test_the_top_level_help_lists_export(capsys):
    from lightning_mtp.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "lightning-mtp export --ckpt_path" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("flags, message", [
    (["--trainer.max_steps", "-5"], r"--trainer: `max_steps` must be a non-negative integer"),
    (["--trainer.devices", "0"], r"--trainer: `Trainer\(devices='0'\)` value is not a valid input"),
    (["--trainer.strategy", "fsdp"], r"--trainer: The strategy `fsdp` requires a GPU.*FSDP2: --config fsdp"),
    (["--trainer.val_check_interval", "0"], r"--trainer.val_check_interval must be > 0"),
])
def test_trainer_settings_lightning_refuses_end_in_one_line_before_training(tmp_path, capsys, flags, message):
    """Lightning's own checks of the trainer (and one it leaves to a division by zero inside the training loop) end
    with one line and exit status 2, not a 30-line traceback."""
    err = cli_refusal(tiny_fit_args(tmp_path, *flags), capsys)
    assert re.search(message, err), err
    assert not (tmp_path / "ckpt").exists()


def test_a_process_whose_peer_failed_says_so_in_one_line(monkeypatch, capsys):
    """Rank 0 refuses bad data in ``prepare_data`` while rank 1 waits at a barrier: rank 1's gloo error ("Connection
    closed by peer") is said in one line pointing at the other process's error, not a 30-line traceback."""
    import lightning_mtp.cli as cli

    def broken(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500")

    monkeypatch.setattr(cli, "MTPLightningCLI", broken)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["fit"])
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and "Traceback" not in err
    assert err.strip() == ("lightning-mtp: error: process 1 stopped: another process of this run failed (its error "
                           "is printed above or below)")
    monkeypatch.setattr(cli, "MTPLightningCLI", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        cli.main(["fit"])


def test_labels_masked_with_minus_100_and_another_ignore_index_name_the_setting():
    """The data masks with -100; an ``ignore_index`` of 5 made that read as labels outside the vocabulary, blamed on
    the tokenizer."""
    model = tiny_model(depth=2, ignore_index=5)
    labels = torch.randint(0, 61, (2, 8))
    labels[:, :3] = -100
    with pytest.raises(ValueError, match=r"labels hold -100 .*--model.init_args.mtp.ignore_index\) is 5: set it"):
        model.training_step({"input_ids": torch.randint(0, 61, (2, 8)), "labels": labels}, 0)


def test_an_unknown_field_of_a_settings_dict_names_the_flag_and_the_field_it_resembles():
    """``HFCausalLM(mtp={...})`` (a config file's or a flag's dict): Python's TypeError named neither."""
    from lightning_mtp.models import HFCausalLM

    with pytest.raises(ValueError, match=r"^--model.init_args.mtp.dept: MTPConfig has no field 'dept' \(did you mean "
                                         r"'depth'\?\)"):
        HFCausalLM("llama", {"hidden_size": 32, "num_hidden_layers": 1}, mtp={"dept": 3})
    with pytest.raises(ValueError, match=r"^--model.init_args.generation.temprature: GenerationConfig has no field"):
        tiny_model(depth=1).__class__(generation={"temprature": 0.5})


@pytest.mark.parametrize("flags, message", [
    (["--model.init_args.generation.speculative", "maybe"],
     r"speculative: Expected a bool, or typing.Literal\['auto'\]. Got value: maybe"),
    (["--trainer.precision", "17"],
     r"--trainer.precision: Expected a typing.Literal\[64, 32, 16\], or .*'bf16-mixed'.*Got value: 17"),
])
def test_a_value_a_union_refuses_names_every_accepted_kind(tmp_path, capsys, flags, message):
    """A flag that takes several kinds of value (bool or 'auto'; the precision's three literal sets): the error
    named only the first, so 'auto' or 'bf16-mixed' seemed refused."""
    err = cli_refusal(tiny_fit_args(tmp_path, *flags), capsys)
    assert re.search(message, err), err


def test_mtp_modules_of_another_dtype_than_the_head_are_refused_by_name():
    """Heads cast to float32 over a bfloat16 model failed inside torch ("expected m1 and m2 to have the same dtype",
    "Expected query, key, and value to have the same dtype")."""
    model = tiny_model(depth=2).to(torch.bfloat16)
    model.mtp_modules.float()
    ids = torch.randint(3, 61, (2, 12))
    with pytest.raises(ValueError, match=r"compute_lm_loss: the MTP modules' weights are torch.float32 but the "
                                         r"model's output head is torch.bfloat16"):
        model.compute_lm_loss(ids)
    with pytest.raises(ValueError, match="speculative decoding: the MTP modules' weights are torch.float32"):
        model.generate(ids[:1], 4, speculative=True)
    assert model.generate(ids[:1], 4, speculative=False).new_tokens.shape == (1, 4)  # plain decoding needs no heads
