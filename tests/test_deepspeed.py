"""DeepSpeed ZeRO-2/3 on 2 CPU processes (gloo): gradients, checkpoint, resume, fp32 conversion, speculative predict.

The two-process runs are ``tests/deepspeed_script.py`` subprocesses (one per stage, shared by the tests of that stage);
a run that fails or hangs fails the tests with its output.
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
import yaml

from lightning_mtp.strategies import CPUDeepSpeedStrategy, validate_mtp_under_zero

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).with_name("deepspeed_script.py")
ROOT = SCRIPT.parents[1]
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["zero1", "zero2", "zero3"])
def zero_run(request, tmp_path_factory):
    """One fit (2 steps) + save + resume (2 more) + predict run of a ZeRO stage; returns (stage, output dir)."""
    stage = request.param
    out = tmp_path_factory.mktemp(f"zero{stage}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), str(stage), str(out)], cwd=out, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"ZeRO-{stage} run timed out after {RUN_TIMEOUT_S}s (a hang?)\n"
                    f"{(error.stdout or b'')[-4000:]}\n{(error.stderr or b'')[-8000:]}")
    if proc.returncode != 0 or not (out / "result.json").is_file():
        pytest.fail(f"ZeRO-{stage} run failed (rc={proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-12000:]}")
    return stage, out


def test_gradients_reach_shared_weights_as_without_deepspeed(zero_run):
    """Step 0's full gradient of the tied embedding/head and of an MTP weight equals a plain single-process run."""
    _, out = zero_run
    report = json.loads((out / "grads.json").read_text())
    assert "embed.weight" in report["names"] and "mtp_modules.0.eh_proj.weight" in report["names"]
    for name in report["names"]:
        assert report["ref_norm"][name] > 0
        assert report["max_abs_diff"][name] < 1e-5 * max(1.0, report["ref_norm"][name]), (name, report)
    assert report["mtp_part_norm_shared"] > 0  # the MTP depths' own contribution to the shared weight


def test_checkpoint_resumes(zero_run):
    _, out = zero_run
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["resumed_global_step"] == 4  # restored at step 2, then 2 more steps


def _convert(out: Path) -> Path:
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    target = out / "fp32.ckpt"
    if not target.is_file():
        convert_zero_checkpoint_to_fp32_state_dict(str(out / "step4.ckpt"), str(target))
    return target


def test_fp32_conversion_keeps_mtp_heads_and_tied_weights(zero_run):
    """Lightning #10964, #12230, litgpt #1727: tied embedding/head weights went missing after conversion."""
    from lightning_mtp.models import load_causal_lm

    _, out = zero_run
    path = _convert(out)
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    assert {"embed.weight", "lm_head.weight"} <= set(state)
    assert any(key.startswith("mtp_modules.1.") for key in state)
    model = load_causal_lm(str(path))
    assert model.lm_head.weight is model.embed.weight
    assert not model.mtp_load_report.new and not model.mtp_load_report.dropped
    trained = torch.load(out / "gathered_weights.pt", map_location="cpu", weights_only=True)
    params = dict(model.named_parameters())
    assert set(trained) == set(params)
    for name, value in trained.items():
        torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=0, msg=name)


def test_speculative_predict_equals_single_process(zero_run):
    """Each rank decodes its own prompts; ranks stay in lockstep (equal forward counts, padding steps for the rank
    whose rows stop at EOS first) and every row equals decoding it alone in one process."""
    from lightning_mtp.models import load_causal_lm

    sys.path.insert(0, str(SCRIPT.parent))
    from deepspeed_script import MAX_NEW_TOKENS, prompts

    stage, out = zero_run
    model = load_causal_lm(str(_convert(out))).eval()
    records = [json.loads((out / f"predict.rank{rank}.json").read_text()) for rank in (0, 1)]
    for name in ("plain", "eos"):
        if stage == 3:  # every forward all-gathers: every batch runs the same number of trunk forwards on both ranks
            assert records[0][name]["main_forwards"] == records[1][name]["main_forwards"]
        for record in records:
            eos = record[name]["eos"]
            for row, tokens in zip(record["rows"], record[name]["tokens"]):
                alone = model.generate(prompts()[row : row + 1], MAX_NEW_TOKENS, eos_token_id=eos)
                assert tokens == alone.new_tokens[0, : int(alone.num_new_tokens[0])].tolist(), (name, row)
    # Rank 0's first row stops at once under EOS; under ZeRO-3 it runs padding steps while rank 1 decodes on.
    eos_run = records[0]["eos"]
    assert eos_run["row_forwards"][0] == [1]
    if stage == 3:
        assert eos_run["main_forwards"][0] == records[1]["eos"]["main_forwards"][0] > 1
    else:
        assert eos_run["main_forwards"][0] == 1  # ZeRO-2 has whole weights: no lockstep needed, none imposed


# ----------------------------------------------------------------------------------------------- no processes
def _trainer(module=None, callbacks=(), world_size=2):
    return SimpleNamespace(callbacks=list(callbacks), lightning_module=module, world_size=world_size,
                           strategy=None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unsupported_callbacks_named_with_the_stage(stage):
    from lightning.pytorch.callbacks import BackboneFinetuning, GradientAccumulationScheduler

    with pytest.raises(ValueError, match=f"GradientAccumulationScheduler.*ZeRO stage {stage}"):
        validate_mtp_under_zero(_trainer(callbacks=[GradientAccumulationScheduler({0: 2})]), stage)
    with pytest.raises(ValueError, match=f"BackboneFinetuning.*ZeRO stage {stage}"):
        validate_mtp_under_zero(_trainer(callbacks=[BackboneFinetuning()]), stage)


def test_zero3_rejects_draft_lengths_that_differ_per_rank(make_tiny_model):
    model = make_tiny_model(depth=2)
    model.mtp_generate_kwargs = {**model.mtp_generate_kwargs, "draft_confidence_threshold": 0.5}
    with pytest.raises(ValueError, match="draft_confidence_threshold.*ZeRO stage 3"):
        validate_mtp_under_zero(_trainer(model), 3)
    validate_mtp_under_zero(_trainer(model), 2)  # ZeRO-2 keeps whole parameters: fine


@pytest.mark.parametrize("mtp_kwargs", [{"recompute": True}, {"detach_trunk": True},
                                        {"recompute": True, "detach_trunk": True}])
def test_zero3_allows_recompute_and_detach_trunk(make_tiny_model, mtp_kwargs):
    """Refused before: now each MTP module is a ZeRO-3 leaf whose call gathers its weights (recompute reads them
    there), and a detached shared head is gathered for the fused cross-entropy; tests/test_fsdp.py trains both under
    ZeRO-3 on 2 processes to DDP's parameters."""
    validate_mtp_under_zero(_trainer(make_tiny_model(depth=2, **mtp_kwargs)), 3)


def test_the_mixin_refuses_at_setup_under_the_stock_strategy(make_tiny_model):
    """The stock DeepSpeedStrategy (what GPU users run) gets the same refusal, from the module's own setup."""
    import lightning as L
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.strategies import DeepSpeedStrategy

    model = make_tiny_model(depth=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=3), logger=False,
                        callbacks=[GradientAccumulationScheduler({0: 2})])
    trainer.strategy.connect(model)
    model.trainer = trainer
    with pytest.raises(ValueError, match="GradientAccumulationScheduler.*ZeRO stage 3"):
        model.setup("fit")


def test_zero3_allows_separate_heads_with_detach_trunk(make_tiny_model):
    model = make_tiny_model(depth=2, detach_trunk=True, share_output_head=False)
    validate_mtp_under_zero(_trainer(model), 3)
    validate_mtp_under_zero(_trainer(None), 3)


def test_partitioned_head_path_matches_fused_loss(make_tiny_model):
    """The ZeRO-3 path (head module calls, per-chunk checkpointing) gives the fused kernel's loss and gradients."""
    batch = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for partitioned in (False, True):
        model = make_tiny_model(depth=2, loss_chunk_size=7)
        if partitioned:
            model.lm_head.weight.ds_id = 0  # looks like a ZeRO-3 parameter: score_jointly calls the head module
        out = model.compute_lm_loss(batch)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got.loss, ref.loss)
    torch.testing.assert_close(got.depth_losses, ref.depth_losses)
    assert set(got_grads) == set(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_strategy_root_device_has_an_index():
    assert CPUDeepSpeedStrategy(stage=2).root_device == torch.device("cpu", 0)


@pytest.mark.parametrize("stage", [2, 3])
def test_configs_use_the_cpu_strategy(stage):
    config = yaml.safe_load((ROOT / "configs" / f"deepspeed_zero{stage}.yaml").read_text())
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_mtp.strategies.CPUDeepSpeedStrategy"
    assert strategy["init_args"]["stage"] == stage
    assert config["trainer"]["devices"] == 2
