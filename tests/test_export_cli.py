"""``lightning-mtp export``'s handling of ``--out``: refused when not empty unless ``--overwrite``, then replaced whole;
a failed export leaves nothing half-written. (Refusals of an unusable ``--out`` and of models without a
``transformers`` layout are in ``tests/test_bad_input.py``.)
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

pytest.importorskip("transformers", reason="export writes transformers folders")

from conftest import cli_refusal, save_checkpoint  # noqa: E402
from test_native_mtp import family_config, native_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.cli import main as cli_main  # noqa: E402
from lightning_mtp.models import HFCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """(module, checkpoint path) of a tiny glm4_moe HFCausalLM with one native MTP layer."""
    model = native_model("glm4_moe", 1)
    return model, save_checkpoint(model, tmp_path_factory.mktemp("native") / "native.ckpt")


def export_args(ckpt, out, *extra: str) -> list[str]:
    return ["export", "--ckpt_path", str(ckpt), "--out", str(out), *extra]


def folder_state(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def sharded_export(model: HFCausalLM, folder) -> dict[str, bytes]:
    """An earlier export in shards (an index, numbered shards, ``model-mtp.safetensors``) plus a file of the user's."""
    model.save_pretrained(str(folder), max_shard_size="40KB")
    (folder / "notes.txt").write_text("mine")
    assert "model.safetensors.index.json" in os.listdir(folder)
    return folder_state(folder)


# ----------------------------------------------------------------------------------------------- 1. non-empty --out
def test_a_non_empty_out_is_refused_without_overwrite_and_left_unchanged(tmp_path, native, capsys):
    model, ckpt = native
    before = sharded_export(model, tmp_path / "out")
    err = cli_refusal(export_args(ckpt, tmp_path / "out"), capsys)
    assert len(err.strip().splitlines()) == 1, err
    assert "--out" in err and "--overwrite" in err and str(tmp_path / "out") in err, err
    assert folder_state(tmp_path / "out") == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_flag_abbreviation_is_refused_and_deletes_nothing(tmp_path, native, capsys):
    """``--over`` is not ``--overwrite`` (which deletes the folder's files): refused before anything is read or written,
    the earlier export left as it was."""
    model, ckpt = native
    before = sharded_export(model, tmp_path / "out")
    err = cli_refusal(export_args(ckpt, tmp_path / "out", "--over"), capsys)
    assert "unrecognized arguments: --over" in err, err
    assert folder_state(tmp_path / "out") == before


def test_overwrite_replaces_an_earlier_sharded_export_whole(tmp_path, native, capsys):
    model, ckpt = native
    sharded_export(model, tmp_path / "out")
    cli_main(export_args(ckpt, tmp_path / "fresh"))
    capsys.readouterr()
    cli_main(export_args(ckpt, tmp_path / "out", "--overwrite"))
    assert "wrote" in capsys.readouterr().out
    assert folder_state(tmp_path / "out") == folder_state(tmp_path / "fresh")  # no stale index, shard or user file
    assert sorted(os.listdir(tmp_path)) == ["fresh", "out"]  # no temporary or retired folder left beside it
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for key, tensor in model.trunk.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], tensor, atol=0, rtol=0)


def test_an_empty_out_needs_no_overwrite_and_messages_name_it(tmp_path, native, caplog):
    (tmp_path / "out").mkdir()
    with caplog.at_level(logging.INFO):
        cli_main(export_args(native[1], tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert f"{tmp_path / 'out'}: Glm4MoeForCausalLM finds MTP layers only" in caplog.text  # not the temporary folder
    assert ".partial-" not in caplog.text


@pytest.mark.parametrize("first, second", [("40KB", None), (None, "40KB")], ids=["sharded-then-single",
                                                                                 "single-then-sharded"])
def test_save_pretrained_over_an_earlier_export_leaves_no_stale_weights(tmp_path, native, first, second):
    """``HFCausalLM.save_pretrained`` into a folder of an earlier export: no old index beside the new single file, no
    old single file beside the new index (``transformers`` removes only stale numbered shards)."""
    model = native[0]
    model.save_pretrained(str(tmp_path), **({"max_shard_size": first} if first else {}))
    model.save_pretrained(str(tmp_path), **({"max_shard_size": second} if second else {}))
    names = set(os.listdir(tmp_path))
    if second:
        assert "model.safetensors" not in names and "model-mtp.safetensors" in names
    else:
        assert names == {"config.json", "generation_config.json", "model.safetensors"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for key, tensor in model.trunk.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], tensor, atol=0, rtol=0)


class WriteThenFail(Exception):
    pass


def make_save_fail(monkeypatch) -> None:
    """``save_pretrained`` from now on writes one file, then fails like a full disk would."""

    def save_then_fail(module, folder, **kwargs):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as handle:
            handle.write("{}")
        raise WriteThenFail("disk full")

    monkeypatch.setattr(HFCausalLM, "save_pretrained", save_then_fail)


def test_a_failed_export_leaves_the_old_folder_untouched(tmp_path, native, monkeypatch):
    before = sharded_export(native[0], tmp_path / "out")
    make_save_fail(monkeypatch)
    with pytest.raises(WriteThenFail):
        cli_main(export_args(native[1], tmp_path / "out", "--overwrite"))
    assert folder_state(tmp_path / "out") == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failed_export_leaves_no_half_written_folder(tmp_path, native, monkeypatch):
    make_save_fail(monkeypatch)
    with pytest.raises(WriteThenFail):
        cli_main(export_args(native[1], tmp_path / "new" / "out"))
    assert not (tmp_path / "new" / "out").exists()
    assert not os.listdir(tmp_path / "new")


def test_overwrite_refuses_a_folder_holding_the_checkpoint(tmp_path, native, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    ckpt = save_checkpoint(native[0], folder / "last.ckpt")
    err = cli_refusal(export_args(ckpt, folder, "--overwrite"), capsys)
    assert "--overwrite" in err and "--ckpt_path" in err and "delete" in err, err
    assert os.listdir(folder) == ["last.ckpt"]


def test_hf_refusals_read_as_one_line_naming_the_fix(tmp_path, capsys):
    llama = HFCausalLM("llama", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4))
    lightning = HFCausalLM("glm4_moe", family_config("glm4_moe", 1), mtp=MTPConfig(layout="lightning"))
    lightning.configure_model()
    for model, expected in ((llama, "save_mtp_heads"), (lightning, "--model.mtp.layout native")):
        ckpt = save_checkpoint(model, tmp_path / "model.ckpt")
        err = cli_refusal(export_args(ckpt, tmp_path / "out"), capsys)
        assert len(err.strip().splitlines()) == 1 and expected in err, err
        assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["model.ckpt"]


def test_a_bf16_checkpoint_exports_as_bf16_with_its_exact_values(tmp_path):
    """A ``bf16-true`` fit's checkpoint holds bf16 weights; the export must not widen them to float32 (twice the
    size) and must keep every value."""
    from safetensors.torch import load_file

    model = native_model("glm4_moe", 1).to(torch.bfloat16)
    ckpt = save_checkpoint(model, tmp_path / "bf16.ckpt")
    cli_main(export_args(ckpt, tmp_path / "out"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} <= {torch.bfloat16, torch.float32}
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    embed = saved["trunk.model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16 and torch.equal(exported["model.embed_tokens.weight"], embed)
    floats = [t for t in exported.values() if t.is_floating_point()]
    assert sum(t.dtype == torch.bfloat16 for t in floats) >= len(floats) - 4  # the MoE routers may stay float32


def test_a_byte_tokenizer_checkpoint_exports_saying_no_tokenizer_is_written(tmp_path, capsys):
    """The byte tokenizer has no transformers form: the folder has no tokenizer files, and export says so."""
    from lightning_mtp.data.tokenizers import ByteTokenizer

    model = native_model("glm4_moe", 1)
    model.mtp_tokenizer = ByteTokenizer().spec()
    cli_main(export_args(save_checkpoint(model, tmp_path / "byte.ckpt"), tmp_path / "out"))
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert "no tokenizer written" in capsys.readouterr().err
