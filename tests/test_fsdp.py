"""FSDP2 with MTP on 2 CPU processes (gloo), against DDP and DeepSpeed ZeRO-3, and the FSDP setups refused at setup.

The two-process runs are ``tests/fsdp_script.py`` subprocesses, one per strategy, each fitting every variant in turn
(both MTP architectures with and without recompute and detach_trunk, a ``transformers`` trunk, a module of one's
own); a run that fails or hangs fails the tests that read it, with its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).with_name("fsdp_script.py")
ROOT = SCRIPT.parents[1]
RUN_TIMEOUT_S = 420
sys.path.insert(0, str(SCRIPT.parent))

from fsdp_script import MAX_NEW_TOKENS, VARIANTS, prompts  # noqa: E402


def _run(strategy: str, parts: str, out: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "DS_ACCELERATOR": "cpu"}
    env.pop("LOCAL_RANK", None)
    env.pop("MTP_VARIANTS", None)
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), strategy, str(out), parts], cwd=out, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{strategy} run timed out after {RUN_TIMEOUT_S}s (a hang?)\n"
                    f"{(error.stdout or b'')[-4000:]}\n{(error.stderr or b'')[-8000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{strategy} run failed (rc={proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-12000:]}")
    (out / "stderr.txt").write_text(proc.stderr)
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return _run("ddp", "equivalence,callbacks", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    return _run("fsdp2", "equivalence,callbacks,lifecycle,bf16,native", tmp_path_factory.mktemp("fsdp2"))


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _run("zero3", "equivalence,callbacks", tmp_path_factory.mktemp("zero3"))


def assert_same_training(reference: Path, other: Path, variant: str) -> None:
    """Same start, then the same parameters after 3 steps: per tensor, ||a - b|| <= 1e-5 ||b||."""
    ref, got = (torch.load(folder / f"{variant}.pt", weights_only=True) for folder in (reference, other))
    assert set(got["after"]) == set(ref["after"])
    for name, value in ref["before"].items():
        torch.testing.assert_close(got["before"][name], value, rtol=0, atol=0, msg=name)
    moved = max(float((ref["after"][n] - ref["before"][n]).abs().max()) for n in ref["after"])
    assert moved > 1e-4  # the steps did train
    for name, value in ref["after"].items():
        difference = float((got["after"][name] - value).norm() / value.norm())
        assert difference <= 1e-5, (variant, name, difference)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_trains_as_ddp(ddp_run, fsdp2_run, variant):
    assert_same_training(ddp_run, fsdp2_run, variant)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_zero3_trains_as_ddp_recompute_and_detach_trunk_included(ddp_run, zero3_run, variant):
    assert_same_training(ddp_run, zero3_run, variant)


def test_units_are_the_blocks_every_depth_and_the_root_with_one_shared_weight(fsdp2_run):
    causal = torch.load(fsdp2_run / "cascaded.pt", weights_only=True)
    assert causal["units"] == ["", "layers.0", "layers.1", "mtp_modules.0", "mtp_modules.1"]
    assert causal["tied"]  # the embedding and the head are still one parameter
    assert "lm_head.weight" not in causal["after"]  # (named_parameters lists it once, as embed.weight)
    hf = torch.load(fsdp2_run / "hf_llama.pt", weights_only=True)
    assert hf["units"] == ["", "trunk.model.layers.0", "trunk.model.layers.1", "mtp_modules.0", "mtp_modules.1"]
    own = torch.load(fsdp2_run / "own_module.pt", weights_only=True)
    assert own["units"] == ["", "blocks.0", "blocks.1", "mtp_modules.0", "mtp_modules.1"]


@pytest.mark.parametrize("sharded, rel", [("fsdp2_run", 1e-4), ("zero3_run", 2e-3)])
def test_every_callback_of_the_mtp_config_logs_as_under_ddp(ddp_run, sharded, rel, request):
    """Depth warmup, weight schedule, diversity, coupling monitor, draft calibration, self-distillation, recompute:
    the same metrics with the same values. (ZeRO's optimizer steps a depth that warmup has not activated yet on a zero
    gradient, with weight decay and Adam's step count, where DDP's and FSDP2's skip it: docs/distributed.md. After 2
    such steps depth 2's losses differ by a few 1e-4.)"""
    runs = (ddp_run, request.getfixturevalue(sharded))
    ddp, other = (json.loads((run / "callbacks.json").read_text()) for run in runs)
    assert list(other) == list(ddp) == ["step1", "step2", "val2", "step3", "step4", "val4"]
    for when, values in ddp.items():
        assert set(other[when]) == set(values), when
        for name, value in values.items():
            assert other[when][name] == pytest.approx(value, rel=rel, abs=1e-5), (when, name)
    names = set(ddp["val4"])
    assert {"val/mtp/loss_depth2", "val/mtp/coupling_depth1", "val/mtp/accept_chained_depth2", "val/mtp/ece_depth2",
            "val/mtp/temperature_depth2", "train/mtp/diversity", "train/mtp/distill", "train/mtp/lambda",
            "train/mtp/active_depth", "train/mtp/weight_depth2"} <= names


def test_callbacks_log_synced_values_without_lightnings_unsynced_warning(ddp_run):
    """The coupling monitor's and the draft calibration's epoch values are equal on every rank (torchmetrics' sync,
    summed statistics); logged as plain tensors Lightning warned once per name and rank to use sync_dist."""
    stderr = (ddp_run / "stderr.txt").read_text()
    assert "val/mtp/coupling_depth1" in (ddp_run / "callbacks.json").read_text()
    assert "sync_dist=True" not in stderr, [line for line in stderr.splitlines() if "sync_dist=True" in line][:3]


def test_a_fit_stopped_by_safe_checkpoint_resumes_exactly(fsdp2_run):
    fits = torch.load(fsdp2_run / "resume.pt", weights_only=True)
    assert fits["global_step"] == 4
    for name, value in fits["straight"].items():
        torch.testing.assert_close(fits["resumed"][name], value, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(fits["first"][n], v) for n, v in fits["straight"].items())


def test_the_consolidated_checkpoint_is_one_file_with_mtp_metadata(fsdp2_run):
    checkpoint = torch.load(fsdp2_run / "step4.ckpt", weights_only=True)
    assert checkpoint["mtp"]["module_class"] == "lightning_mtp.models.causal_lm.CausalLM"  # not FSDPCausalLM
    assert checkpoint["mtp"]["depth"] == 2
    assert {"embed.weight", "lm_head.weight", "mtp_modules.1.block.attn.qkv.weight"} <= set(checkpoint["state_dict"])
    assert checkpoint["optimizer_states"] and checkpoint["lr_schedulers"]


def test_speculative_predict_keeps_ranks_in_lockstep_and_equals_one_process(fsdp2_run):
    """Rank 0's prompts accept drafts where rank 1's do not: the ranks run the same number of forwards (padding steps
    on the rank that is done), and every row equals decoding it alone in one process from the FSDP checkpoint."""
    from lightning_mtp.models import load_causal_lm

    model = load_causal_lm(str(fsdp2_run / "step4.ckpt")).eval()
    records = [json.loads((fsdp2_run / f"predict.rank{rank}.json").read_text()) for rank in (0, 1)]
    for name in ("plain", "eos"):
        assert records[0][name]["main_forwards"] == records[1][name]["main_forwards"]  # lockstep
        for record in records:
            eos = record[name]["eos"]
            for row, tokens in zip(record["rows"], record[name]["tokens"]):
                alone = model.generate(prompts()[row : row + 1], MAX_NEW_TOKENS, eos_token_id=eos)
                assert tokens == alone.new_tokens[0, : int(alone.num_new_tokens[0])].tolist(), (name, row)
    plain = [record["plain"] for record in records]
    accepted = [[sum(batch) for batch in p["accepted"]] for p in plain]  # per batch (one row each), per rank
    assert accepted[0] != accepted[1]  # uneven acceptance between the ranks
    own_needs = [[rows[0] for rows in p["row_forwards"]] for p in plain]
    assert own_needs[0] != own_needs[1] and own_needs[0] != plain[0]["main_forwards"]  # one rank ran padding steps
    eos = records[0]["eos"]
    assert eos["row_forwards"][0] == [1] and eos["main_forwards"][0] > 1  # rank 0 stopped at once, kept stepping


def test_init_from_reads_the_fsdp_checkpoint(fsdp2_run, tmp_path):
    import lightning as L
    from fsdp_script import make_model, repeating_data
    from torch.utils.data import DataLoader

    model = make_model(architecture="cascaded", recompute=True)
    model.init_from = str(fsdp2_run / "step4.ckpt")
    trainer = L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(repeating_data(), batch_size=2))
    assert model.mtp_load_report.clean
    trained = torch.load(fsdp2_run / "resume.pt", weights_only=True)["resumed"]
    params = dict(model.named_parameters())
    for name, value in trained.items():
        torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=0, msg=name)


def test_native_layers_export_from_an_fsdp_checkpoint(fsdp2_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from lightning_mtp.cli import main

    main(["export", "--ckpt_path", str(fsdp2_run / "native.ckpt"), "--out", str(tmp_path / "exported")])
    exported = {}
    for file in (tmp_path / "exported").glob("*.safetensors"):
        exported.update(load_file(file))
    trained = torch.load(fsdp2_run / "native_weights.pt", weights_only=True)
    layers = 2  # the trunk's; MTP layer k sits at model.layers.{2 + k}
    for k in range(2):
        for ours, theirs in (("eh_proj.weight", "eh_proj.weight"), ("post_norm.weight", "shared_head.norm.weight")):
            torch.testing.assert_close(exported[f"model.layers.{layers + k}.{theirs}"],
                                       trained[f"mtp_modules.{k}.{ours}"], rtol=0, atol=0)
    head = trained.get("trunk.lm_head.weight", trained.get("trunk.model.embed_tokens.weight"))  # (tied or not)
    torch.testing.assert_close(exported["lm_head.weight"], head, rtol=0, atol=0)


def test_bf16_parameters_with_fp32_reductions_stay_within_bf16_tolerance(fsdp2_run):
    record = json.loads((fsdp2_run / "bf16.json").read_text())
    assert record["fp32"]["compute_dtype"] == "torch.float32"
    assert record["bf16"]["compute_dtype"] == "torch.bfloat16"  # the gathered parameters, hence the compute
    assert record["bf16"]["sharded_dtype"] == "torch.float32"  # shards and optimizer stay fp32
    for ours, reference in zip(record["bf16"]["losses"], record["fp32"]["losses"]):
        assert ours == pytest.approx(reference, rel=2 ** -7)  # bf16's 8 significant bits


def test_the_cli_fits_with_the_fsdp_config_and_predicts_from_its_checkpoint_in_one_process(tmp_path):
    """``lightning-mtp fit --config quickstart.yaml --config fsdp.yaml`` on 2 processes, ``SafeCheckpoint`` included:
    its checkpoint carries the MTP record and the tokenizer, and ``lightning-mtp predict`` reads it in one process."""
    from conftest import tiny_fit_args, tiny_predict_args

    from lightning_mtp.cli import main

    cli = Path(sys.executable).with_name("lightning-mtp")
    if not cli.is_file():
        pytest.skip("the lightning-mtp console script is not installed beside this interpreter")
    args = tiny_fit_args(tmp_path, "--config", str(ROOT / "configs" / "fsdp.yaml"), "--trainer.devices", "2",
                         "--model.init_args.mtp.recompute", "true")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([str(cli), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3
    assert checkpoint["mtp"]["module_class"] == "lightning_mtp.models.causal_lm.CausalLM"
    assert checkpoint["tokenizer"]["vocab_size"] == 300
    main(tiny_predict_args(tmp_path, tmp_path / "ckpt" / "last.ckpt"))
    generations = (tmp_path / "predictions" / "generations.jsonl").read_text().splitlines()
    assert len(generations) == 2


# ----------------------------------------------------------------------------------------------- no processes
def test_lightning_fsdp1_strategy_is_refused_pointing_to_the_fsdp2_config():
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_mtp.fsdp_settings import validate_mtp_under_fsdp

    with pytest.raises(ValueError, match=r"FSDPStrategy \(FSDP1.*configs/fsdp\.yaml"):
        validate_mtp_under_fsdp(SimpleNamespace(strategy=FSDPStrategy(), world_size=2))


class FakeMesh:
    def __init__(self, sizes: dict):
        self.sizes, self.ndim, self.mesh_dim_names = sizes, len(sizes), tuple(sizes)

    def __getitem__(self, name):
        return SimpleNamespace(size=lambda: self.sizes[name], ndim=1, name=name)


def test_a_tensor_parallel_dimension_is_refused():
    from lightning_mtp.fsdp import data_parallel_mesh

    with pytest.raises(ValueError, match=r"data-parallel ranks only.*tensor_parallel_size=1"):
        data_parallel_mesh(FakeMesh({"data_parallel": 1, "tensor_parallel": 2}))
    assert data_parallel_mesh(FakeMesh({"data_parallel": 2, "tensor_parallel": 1})).name == "data_parallel"


def test_draft_confidence_threshold_is_refused_under_fsdp2_on_several_processes(make_tiny_model):
    from lightning_mtp.fsdp_settings import validate_mtp_under_fsdp
    from lightning_mtp.strategies import FSDP2Strategy

    model = make_tiny_model(depth=2)
    model.mtp_generate_kwargs = {**model.mtp_generate_kwargs, "draft_confidence_threshold": 0.5}
    trainer = SimpleNamespace(strategy=FSDP2Strategy(), world_size=2, lightning_module=model)
    with pytest.raises(ValueError, match="draft_confidence_threshold.*FSDP2 on 2 processes"):
        validate_mtp_under_fsdp(trainer)
    validate_mtp_under_fsdp(SimpleNamespace(strategy=FSDP2Strategy(), world_size=1, lightning_module=model))


def test_an_unsharded_module_under_model_parallel_is_refused(make_tiny_model):
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = make_tiny_model(depth=2)
    model._trainer = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2)
    with pytest.raises(RuntimeError, match=r"not sharded.*mtp_fully_shard\(\).*FSDP2Strategy"):
        model.mtp_check_sharded()
    model._trainer = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=1)
    model.mtp_check_sharded()  # one process: nothing to average


def test_mixed_precision_names_are_checked():
    from lightning_mtp.strategies import FSDP2Strategy

    settings = FSDP2Strategy(param_dtype="bfloat16", reduce_dtype="float32").mtp_fsdp_settings
    assert settings["mp_policy"].param_dtype == torch.bfloat16 and settings["mp_policy"].reduce_dtype == torch.float32
    with pytest.raises(ValueError, match=r"param_dtype.*floating dtype.*int8"):
        FSDP2Strategy(param_dtype="int8")


def test_the_trunk_blocks_of_a_module_of_ones_own_are_found():
    from fsdp_script import OwnLM

    from lightning_mtp import MTPConfig

    model = OwnLM(MTPConfig(depth=3))
    model.configure_model()  # the MTP modules (3) and the metrics' lists are longer, but not the trunk's
    assert model.mtp_trunk_blocks() == list(model.blocks)


def test_a_sharded_fsdp2_checkpoint_folder_reads_as_its_metadata(tmp_path):
    """``save_distributed_checkpoint=True`` writes shards and ``meta.pt``: the CLI reads the settings from it."""
    from lightning_mtp.checkpoint_files import read_checkpoint

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"shards")
    torch.save({"hyper_parameters": {"learning_rate": 0.1}, "mtp": {"depth": 2}}, folder / "meta.pt")
    assert read_checkpoint(folder)["mtp"] == {"depth": 2}
    (folder / "meta.pt").unlink()
    with pytest.raises(ValueError, match="nor a sharded FSDP2 one"):
        read_checkpoint(folder)


def test_the_config_layers_on_a_model_config(capsys):
    import yaml

    from lightning_mtp.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", "quickstart", "--config", "fsdp", "--trainer.devices", "4", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_mtp.strategies.FSDP2Strategy"
    assert config["trainer"]["strategy"]["init_args"]["save_distributed_checkpoint"] is False
    assert str(config["trainer"]["devices"]) == "4"
    assert config["model"]["class_path"] == "lightning_mtp.models.CausalLM"


def test_a_checkpoint_with_parameters_never_stepped_is_refused_under_fsdp2_naming_the_exact_way(tmp_path):
    """A depth MTPDepthWarmup had not activated has no AdamW state: FSDP2's load failed with torch's "Missing
    optimizer state for parameter 'mtp_modules.1.eh_proj.weight'" (a traceback; the fit could not be continued), and a
    load that skips them did not resume exactly (3e-3 off); DDP resumes it exactly."""
    from lightning_mtp.strategies import refuse_unstepped_parameters

    stepped = {"optimizer_states": [{"state": {0: {}, 1: {}}, "param_groups": [{"params": [0, 1]}]}]}
    refuse_unstepped_parameters(stepped, tmp_path / "last.ckpt")
    warming = {"optimizer_states": [{"state": {0: {}}, "param_groups": [{"params": [0]}, {"params": [1, 2]}]}]}
    with pytest.raises(ValueError, match=r"no state yet for 2 parameters .*--trainer.strategy "
                                         r"ddp_find_unused_parameters_true"):
        refuse_unstepped_parameters(warming, tmp_path / "last.ckpt")


def test_a_checkpoint_saved_without_fsdp2_is_refused_for_an_fsdp2_resume(tmp_path, fsdp2_run):
    """A DDP checkpoint resumed under FSDP2 failed in torch's optimizer load ("The size of tensor a (48) must match
    the size of tensor b (96)"); the checkpoints record how their optimizer state is laid out."""
    from lightning_mtp.strategies import refuse_unstepped_parameters

    sharded = torch.load(fsdp2_run / "step4.ckpt", weights_only=True)
    assert sharded["mtp"]["fsdp2"] is True
    refuse_unstepped_parameters(sharded, tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match="was saved without FSDP2 .*--trainer.strategy"):
        refuse_unstepped_parameters({**sharded, "mtp": {**sharded["mtp"], "fsdp2": False}}, tmp_path / "last.ckpt")
