"""MTPWeightSchedule and ScalarSchedule: every λ schedule, distance-decayed and progressive depth weights, the token
counter under gradient accumulation, logging, bad arguments and state."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_mtp.callbacks import MTPWeightSchedule, ScalarSchedule


class Probe(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, pl_module.mtp_loss_weight, list(pl_module.mtp_depth_weights)))


def fit(model, schedule, steps, **kwargs):
    probe = Probe()
    data = DataLoader(torch.randint(0, 61, (64, 16)), batch_size=4)  # 64 tokens per micro-batch
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[schedule, probe], **kwargs)
    trainer.fit(model, data)
    return trainer, probe.rows


def test_scalar_schedule_kinds():
    assert ScalarSchedule("constant", value=0.3)(10**12) == 0.3
    step = ScalarSchedule("step", milestones={0: 0.3, 100: 0.1})
    assert (step(0), step(99), step(100), step(10**9)) == (0.3, 0.3, 0.1, 0.1)
    linear = ScalarSchedule("linear", start=0.3, end=0.1, begin=10, until=30)
    assert [linear(t) for t in (0, 10, 20, 30, 99)] == pytest.approx([0.3, 0.3, 0.2, 0.1, 0.1])
    cosine = ScalarSchedule("cosine", start=0.3, end=0.1, until=40)
    expected = [0.1 + 0.2 * 0.5 * (1 + math.cos(math.pi * t / 40)) for t in (0, 10, 20, 40)]
    assert [cosine(t) for t in (0, 10, 20, 40)] == pytest.approx(expected) and cosine(20) == pytest.approx(0.2)


def test_step_lambda_decayed_and_ramped_depth_weights_are_applied_and_logged(make_tiny_model):
    model = make_tiny_model(depth=3)
    schedule = MTPWeightSchedule(schedule="step", milestones={0: 0.3, 2: 0.1}, depth_decay=0.8, distant_ramp=2)
    trainer, rows = fit(model, schedule, steps=4)
    # (global step after the batch, λ and w_k used by that batch): the batch of step s sees the value at s
    assert [r[1] for r in rows] == [0.3, 0.3, 0.1, 0.1]
    weights = [w for *_, row in rows for w in row]
    assert weights == pytest.approx([1, 0, 0, 1, 0.4, 0.32, 1, 0.8, 0.64, 1, 0.8, 0.64])
    logged = trainer.logged_metrics
    assert float(logged["train/mtp/lambda"]) == pytest.approx(0.1)
    assert [float(logged[f"train/mtp/weight_depth{k}"]) for k in (1, 2, 3)] == pytest.approx([1, 0.8, 0.64])


def test_lambda_reaches_the_loss(make_tiny_model):
    model = make_tiny_model(depth=2)
    ids = torch.randint(0, 61, (2, 12))
    model.mtp_loss_weight, model.mtp_depth_weights = 0.5, [1.0, 0.25]
    out = model.compute_lm_loss(ids)
    expected = 0.5 * (out.depth_losses[0] + 0.25 * out.depth_losses[1]) / 2
    assert float(out.mtp_loss) == pytest.approx(float(expected), rel=1e-5)


def test_token_unit_counts_finished_optimizer_steps_under_accumulation(make_tiny_model):
    model = make_tiny_model(depth=2)
    # 64 tokens per micro-batch, 2 micro-batches per step: 128 tokens per optimizer step
    schedule = MTPWeightSchedule(schedule="step", unit="tokens", milestones={0: 0.3, 256: 0.1},
                                 depth_weights=[1.0, 0.5])
    trainer, rows = fit(model, schedule, steps=4, accumulate_grad_batches=2)
    assert [r[1] for r in rows] == [0.3, 0.3, 0.3, 0.3, 0.1, 0.1, 0.1, 0.1]  # one value per optimizer step
    assert schedule.tokens_seen == 8 * 64 and schedule.tokens_at_step == 3 * 128
    assert rows[0][2] == [1.0, 0.5]


def test_constant_defaults_to_the_config(make_tiny_model):
    model = make_tiny_model(depth=2, loss_weight=0.25, depth_weights=[1.0, 0.5])
    _, rows = fit(model, MTPWeightSchedule(), steps=1)
    assert rows == [(1, 0.25, [1.0, 0.5])]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="exponential"), "schedule must be one of .* got 'exponential'"),
        (dict(loss_weight=-0.1), r"value must be a number >= 0, got -0.1"),
        (dict(schedule="step", milestones={0: 0.3, 500: 0.2, 100: 0.1}),
         r"strictly increasing from 0, got \[0, 500, 100\]"),
        (dict(schedule="step", milestones={0: 0.3, 10: -1.0}), r"milestones\[10\] must be a number >= 0, got -1.0"),
        (dict(schedule="step"), "milestones must be a non-empty mapping"),
        (dict(schedule="cosine", start=0.3, end=0.1, until=0), "until must be an integer > begin = 0, got 0"),
        (dict(schedule="linear", start=0.3, end=-0.1, until=10), "end must be a number >= 0, got -0.1"),
        (dict(loss_weight=0.3, milestones={0: 0.1}), "milestones do.* not apply to kind 'constant'"),
        (dict(unit="epochs"), "unit must be one of .* got 'epochs'"),
        (dict(depth_decay=-0.8), "depth_decay must be a number >= 0, got -0.8"),
        (dict(depth_weights=[1.0, -0.5]), r"depth_weights\[1\] must be a number >= 0, got -0.5"),
        (dict(depth_decay=0.8, depth_weights=[1.0]), "not both"),
        (dict(distant_ramp=0), "distant_ramp must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_quote_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MTPWeightSchedule(**kwargs)


def test_setup_checks_depth_weights_against_the_config_and_the_module_type(make_tiny_model):
    trainer = L.Trainer(accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match=r"depth_weights has 3 entries \[1.0, 0.5, 0.25\], but MTPConfig.depth = 2"):
        MTPWeightSchedule(depth_weights=[1.0, 0.5, 0.25]).setup(trainer, make_tiny_model(depth=2), "fit")
    with pytest.raises(TypeError, match="uses MTPMixin"):
        MTPWeightSchedule().setup(trainer, torch.nn.Linear(2, 2), "fit")


def test_state_round_trip_and_defaults():
    schedule = MTPWeightSchedule(unit="tokens", loss_weight=0.3)
    schedule.tokens_seen, schedule.tokens_at_step, schedule.last_step = 640, 512, 4
    again = MTPWeightSchedule(unit="tokens", loss_weight=0.3)
    again.load_state_dict(schedule.state_dict())
    assert (again.tokens_seen, again.tokens_at_step, again.last_step) == (640, 512, 4)
    again.load_state_dict({})
    assert (again.tokens_seen, again.tokens_at_step, again.last_step) == (0, 0, -1)
    assert schedule.state_key != MTPWeightSchedule(unit="steps", loss_weight=0.3).state_key


def test_token_unit_counts_the_tokens_of_padded_rows_not_their_padding(make_tiny_model):
    """Padded chat rows counted their padding as tokens: a schedule in tokens ran ahead by the padding's share."""
    model = make_tiny_model(depth=2)
    ids = torch.randint(0, 61, (16, 16))
    mask = (torch.arange(16) < torch.arange(4, 20).clamp(max=16).unsqueeze(1)).long()  # rows of 4..16 tokens
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)]
    schedule = MTPWeightSchedule(schedule="step", unit="tokens", milestones={0: 0.3, 10_000: 0.1})
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[schedule])
    trainer.fit(model, DataLoader(rows, batch_size=4))
    assert schedule.tokens_seen == int(mask.sum()) < mask.numel()
