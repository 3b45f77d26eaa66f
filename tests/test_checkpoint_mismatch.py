"""Checkpoints and MTP-heads files that do not fit are refused in one line, naming what differs and what to do:
heads of another depth or architecture (``mtp_heads``), files that are not a fit's checkpoint (``--ckpt_path``), trunk
weights of another shape (``init_from``, a vocabulary resized on one side), and heads whose trunk trained with them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="HFCausalLM needs the optional transformers dependency")

from conftest import cli_refusal, save_checkpoint, tiny_model  # noqa: E402

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.checkpoint_files import read_checkpoint  # noqa: E402
from lightning_mtp.checkpointing import load_weights  # noqa: E402
from lightning_mtp.models import CausalLM, HFCausalLM, ModelConfig  # noqa: E402
from lightning_mtp.native.export import check_exportable  # noqa: E402

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=3, pad_token_id=0)


def llama_folder(path, vocab_size: int = 96) -> str:
    """A tiny Llama ``save_pretrained`` folder (seeded: the same weights every time)."""
    torch.manual_seed(0)
    HFCausalLM("llama", {**LLAMA, "vocab_size": vocab_size}).trunk.save_pretrained(path)
    return str(path)


def heads_file(tmp_path, folder: str, depth: int = 2, architecture: str = "cascaded") -> tuple[HFCausalLM, str]:
    """(module, path): MTP heads of ``depth`` saved with ``save_mtp_heads`` over the trunk of ``folder``."""
    torch.manual_seed(1)
    model = HFCausalLM(pretrained=folder, freeze_trunk=True, mtp=MTPConfig(depth=depth, architecture=architecture))
    model.configure_model()
    path = str(tmp_path / f"heads_d{depth}_{architecture}.pt")
    model.save_mtp_heads(path)
    return model, path


# ----------------------------------------------------------------------------------------------- mtp_heads
def test_heads_of_another_depth_or_architecture_are_refused_naming_both_values_and_the_flag(tmp_path):
    """A heads file of depth 2 loaded with depth 3 decoded with an untrained depth 3, and with another architecture
    none of its weights loaded: warnings only, exit status 0."""
    folder = llama_folder(tmp_path / "base")
    saved, path = heads_file(tmp_path, folder, depth=2)
    cases = [
        (dict(depth=3), r"mtp_heads .*heads_d2_cascaded.pt holds MTP heads of depth 2, but "
                        r"--model.init_args.mtp.depth is 3: depth 3 would decode untrained\. Give "
                        r"--model.init_args.mtp.depth 2"),
        (dict(depth=1), r"of depth 2, but --model.init_args.mtp.depth is 1: its depth 2 would be dropped"),
        (dict(depth=2, architecture="parallel"), r"holds cascaded MTP heads, but --model.init_args.mtp.architecture "
                                                 r"is 'parallel': none of their weights would load\. Give "
                                                 r"--model.init_args.mtp.architecture cascaded"),
    ]
    for mtp, message in cases:
        model = HFCausalLM(pretrained=folder, mtp=MTPConfig(**mtp), mtp_heads=path)
        with pytest.raises(ValueError, match=message) as refusal:
            model.configure_model()
        assert "\n" not in str(refusal.value)
    same = HFCausalLM(pretrained=folder, mtp=MTPConfig(depth=2), mtp_heads=path)  # the same settings: every weight
    same.configure_model()
    assert same.mtp_load_report.clean
    for key, value in saved.mtp_state_dict().items():
        assert torch.equal(same.mtp_state_dict()[key], value), key


def test_a_heads_file_without_mtp_metadata_that_lacks_weights_is_refused(tmp_path):
    folder = llama_folder(tmp_path / "base")
    saved, path = heads_file(tmp_path, folder, depth=2)
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["mtp"]
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if ".1." not in k}  # depth 2 gone
    torch.save(checkpoint, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"partial.pt lacks MTP weights of HFCausalLM \(depth 2, cascaded\): "
                                         r"mtp_modules\.1\."):
        HFCausalLM(pretrained=folder, mtp=MTPConfig(depth=2), mtp_heads=str(tmp_path / "partial.pt")
                   ).configure_model()


def test_init_from_still_grows_the_depth_from_a_shallower_heads_file(tmp_path):
    """A new fit from the weights (what the refusal advises) keeps depths 1-2 and starts depth 3 fresh."""
    folder = llama_folder(tmp_path / "base")
    saved, path = heads_file(tmp_path, folder, depth=2)
    deeper = HFCausalLM(pretrained=folder, mtp=MTPConfig(depth=3))
    deeper.configure_model()
    with pytest.warns(UserWarning, match="new \\(freshly initialised\\) weights: mtp_modules.2 \\(depth 3\\)"):
        report = load_weights(deeper, path)
    assert report.new and all(".2." in key for key in report.new) and not report.dropped
    for key, value in saved.mtp_state_dict().items():
        assert torch.equal(deeper.mtp_state_dict()[key], value), key


# ----------------------------------------------------------------------------------------------- --ckpt_path
def test_files_that_are_not_a_fits_checkpoint_are_refused_as_ckpt_path(tmp_path):
    """torch.load reads a safetensors file as a flat dict and a save_mtp_heads file as a dict with a state_dict:
    both were taken as checkpoints and failed deep in Lightning or with an unrelated message."""
    from safetensors.torch import save_file

    folder = llama_folder(tmp_path / "base")
    _, heads = heads_file(tmp_path, folder)
    weights = str(tmp_path / "base" / "model.safetensors")
    bare = tmp_path / "bare.pt"
    torch.save(tiny_model(depth=1).state_dict(), bare)
    save_file({"x": torch.zeros(2)}, tmp_path / "small.safetensors")
    refusals = [
        (weights, r"'.*model.safetensors' is a safetensors weights file .*--model.init_args.pretrained DIR"),
        (str(tmp_path / "small.safetensors"), "'.*small.safetensors' is a safetensors weights file"),
        (heads, r"'.*heads_d2_cascaded.pt' is an MTP-heads file written by save_mtp_heads, not a checkpoint of a fit: "
                r"load it with --model lightning_mtp.models.HFCausalLM --model.init_args.pretrained '.*base' "
                r"--model.init_args.mtp_heads '.*heads_d2_cascaded.pt'"),
        (str(bare), r"'.*bare.pt' holds a bare state dict of weights, not a checkpoint written by a fit"),
    ]
    for path, message in refusals:
        with pytest.raises(ValueError, match=r"^--ckpt_path " + message):
            read_checkpoint(path, "--ckpt_path")
    # what the other flags read is not refused: heads for mtp_heads, a bare state dict for init_from
    assert read_checkpoint(heads, "--model.init_args.mtp_heads")["mtp_heads_only"]
    assert "embed.weight" in read_checkpoint(str(bare), "--model.init_args.init_from")
    with pytest.raises(ValueError, match="--model.init_args.init_from .* is a safetensors weights file"):
        read_checkpoint(weights, "--model.init_args.init_from")
    fit = save_checkpoint(tiny_model(depth=1), tmp_path / "fit.ckpt")  # a fit's checkpoint still reads
    assert "state_dict" in read_checkpoint(fit, "--ckpt_path")


def test_the_cli_refuses_a_non_checkpoint_ckpt_path_before_building_a_model(tmp_path, capsys):
    from conftest import tiny_predict_args

    folder = llama_folder(tmp_path / "base")
    _, heads = heads_file(tmp_path, folder)
    for path, expected in ((tmp_path / "base" / "model.safetensors", "is a safetensors weights file"),
                           (heads, "is an MTP-heads file written by save_mtp_heads")):
        err = cli_refusal(tiny_predict_args(tmp_path, path), capsys)
        assert len(err.strip().splitlines()) == 1 and expected in err and str(path) in err, err
    err = cli_refusal(["export", "--ckpt_path", heads, "--out", str(tmp_path / "out")], capsys)
    assert "is an MTP-heads file written by save_mtp_heads" in err, err


# ----------------------------------------------------------------------------------------------- init_from shapes
def test_init_from_a_checkpoint_with_another_vocabulary_names_the_weight_both_shapes_and_the_cause(tmp_path):
    """A checkpoint trained over a 96-row embedding, started on a folder resized to 90 rows: torch's "size mismatch"
    traceback."""
    trained = HFCausalLM(pretrained=llama_folder(tmp_path / "wide"), mtp=MTPConfig(depth=2))
    trained.configure_model()
    ckpt = save_checkpoint(trained, tmp_path / "wide.ckpt")
    narrow = HFCausalLM(pretrained=llama_folder(tmp_path / "narrow", vocab_size=90), mtp=MTPConfig(depth=2))
    narrow.configure_model()
    before = {k: v.clone() for k, v in narrow.state_dict().items()}
    message = (r"^--model.init_args.init_from .*wide.ckpt does not fit HFCausalLM: its weight "
               r"'trunk.model.embed_tokens.weight' has shape \(96, 32\), but HFCausalLM's has shape \(90, 32\): the "
               r"vocabulary sizes differ: 96 ids in the checkpoint, 90 in HFCausalLM")
    with pytest.raises(ValueError, match=message) as refusal:
        load_weights(narrow, ckpt)
    assert "\n" not in str(refusal.value)
    assert all(torch.equal(narrow.state_dict()[k], v) for k, v in before.items())  # nothing loaded


def test_loading_a_checkpoint_into_another_model_size_is_refused_on_the_lightning_path_too(tmp_path):
    """``load_from_checkpoint`` (what predict and resume run) reaches ``on_load_checkpoint`` first."""
    ckpt = save_checkpoint(tiny_model(depth=1), tmp_path / "model.ckpt")
    with pytest.raises(ValueError, match=r"the checkpoint does not fit CausalLM: its weight 'embed.weight' has shape "
                                         r"\(61, 32\), but CausalLM's has shape \(64, 32\): the vocabulary sizes "
                                         r"differ: 61 ids in the checkpoint, 64 in CausalLM \(set by "
                                         r"--model.init_args.model.vocab_size\)"):
        CausalLM.load_from_checkpoint(ckpt, weights_only=True, model=ModelConfig(
            vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64))
    with pytest.raises(ValueError, match=r"its weight 'embed.weight' has shape \(61, 32\), but CausalLM's has shape "
                                         r"\(61, 48\): the checkpoint was trained with another model width or size"):
        CausalLM.load_from_checkpoint(ckpt, weights_only=True, model=ModelConfig(
            vocab_size=61, dim=48, n_layers=2, n_heads=4, max_seq_len=64))


# ----------------------------------------------------------------------------------------------- a trained trunk
def test_heads_of_a_fit_that_trained_the_trunk_say_so_and_load_beside_the_fine_tuned_trunk(tmp_path):
    """After the default fine-tune, "save_mtp_heads(path) instead" gave heads that the original folder refused with
    a message that read as a contradiction (the same folder named twice)."""
    folder = llama_folder(tmp_path / "base")
    model = HFCausalLM(pretrained=folder, mtp=MTPConfig(depth=2))
    model.configure_model()
    with torch.no_grad():  # stands for a fit that trained the trunk (freeze_trunk=False, the default)
        for parameter in model.trunk.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    with pytest.raises(ValueError, match=r"serve the checkpoint itself \(lightning-mtp predict --ckpt_path CKPT\), or "
                                         r"save the trunk with the heads: the fit trained the trunk.*save_mtp_heads"):
        check_exportable(model)
    model.save_mtp_heads(str(tmp_path / "heads.pt"))
    message = (r"heads.pt holds MTP heads of a fit that trained its trunk too \(starting from the weights loaded from "
               r"'.*base'.*the heads belong to the fine-tuned trunk.*model.trunk.save_pretrained\(DIR\)")
    with pytest.raises(ValueError, match=message):
        HFCausalLM(pretrained=folder, mtp=MTPConfig(depth=2), mtp_heads=str(tmp_path / "heads.pt")).configure_model()
    # what the message advises works: the fine-tuned trunk saved beside the heads
    model.trunk.save_pretrained(tmp_path / "fine_tuned")
    served = HFCausalLM(pretrained=str(tmp_path / "fine_tuned"), mtp=MTPConfig(depth=2),
                        mtp_heads=str(tmp_path / "heads.pt"))
    served.configure_model()
    ids = torch.tensor([[4, 5, 6, 7]])
    assert torch.equal(served.eval().generate(ids, 8).new_tokens, model.eval().generate(ids, 8).new_tokens)


def test_export_advice_for_a_frozen_trunk_is_the_heads_alone(tmp_path):
    frozen = HFCausalLM(pretrained=llama_folder(tmp_path / "base"), freeze_trunk=True, mtp=MTPConfig(depth=2))
    frozen.configure_model()
    with pytest.raises(ValueError, match=r"Instead, save the MTP heads alone with save_mtp_heads\(path\) and load them "
                                         r"onto the model folder \(--model.init_args.pretrained DIR "
                                         r"--model.init_args.mtp_heads FILE\)"):
        check_exportable(frozen)


def test_save_trunk_false_is_refused_for_a_trunk_that_trains(tmp_path):
    """``save_trunk=False`` leaves the trunk out of checkpoints: with a trunk that trains, its training would be lost
    on resume and in predict (the heads would load over the folder's untrained weights), so it needs
    ``freeze_trunk``."""
    folder = llama_folder(tmp_path / "model")
    with pytest.raises(ValueError, match=r"save_trunk false .*freeze_trunk is false"):
        HFCausalLM(pretrained=folder, save_trunk=False, mtp=MTPConfig(depth=1))
    frozen = HFCausalLM(pretrained=folder, freeze_trunk=True, save_trunk=False, mtp=MTPConfig(depth=1))
    assert frozen.save_trunk is False
