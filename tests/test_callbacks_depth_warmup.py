"""MTPDepthWarmup: step and linear schedules, no compute or loss for inactive depths, untouched parameter groups,
no weight decay of inactive heads, gradient accumulation, bad arguments and state."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_mtp.callbacks import MTPDepthWarmup


class Probe(Callback):
    """Per micro-batch: (global step, active depth, forward calls of each MTP module during the step)."""

    def __init__(self, model):
        self.rows, self.calls = [], [0] * len(model.mtp_modules)
        for k, module in enumerate(model.mtp_modules):
            module.register_forward_hook(lambda *args, k=k: self.calls.__setitem__(k, self.calls[k] + 1))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls[:] = [0] * len(self.calls)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step, pl_module.mtp_active_depth, list(self.calls)))


def fit(model, callbacks, steps, **kwargs):
    torch.manual_seed(0)
    data = DataLoader(torch.randint(0, 61, (64, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)
    trainer.fit(model, data)
    return trainer


def test_depth_at_step_schedule_and_linear_ramp():
    warmup = MTPDepthWarmup(schedule={0: 1, 1000: 2, 3000: 3})
    assert [warmup.depth_at(s) for s in (0, 999, 1000, 2999, 3000, 10**9)] == [1, 1, 2, 2, 3, 3]
    ramp = MTPDepthWarmup(start_depth=1, end_depth=3, begin=100, until=300)
    assert [ramp.depth_at(s) for s in (0, 100, 199, 200, 299, 300, 400)] == [1, 1, 1, 2, 2, 3, 3]


def test_inactive_depths_run_no_forward_get_no_loss_and_no_weight_decay(make_tiny_model):
    model = make_tiny_model(depth=3)
    model.weight_decay = 0.5  # strong decoupled decay: an inactive head stepped by AdamW would visibly shrink
    probe = Probe(model)
    groups = {}
    frozen = {k: [p.detach().clone() for p in model.mtp_modules[k].parameters()] for k in (1, 2)}

    class Check(Callback):
        def on_train_start(self, trainer, pl_module):
            groups["start"] = [[id(p) for p in g["params"]] for g in trainer.optimizers[0].param_groups]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:  # depth 3 has never been active
                assert all(torch.equal(a, b) for a, b in zip(frozen[2], model.mtp_modules[2].parameters()))
                assert "train/mtp/loss_depth3" not in trainer.callback_metrics

        def on_train_end(self, trainer, pl_module):
            groups["end"] = [[id(p) for p in g["params"]] for g in trainer.optimizers[0].param_groups]

    trainer = fit(model, [MTPDepthWarmup(schedule={0: 1, 2: 2, 3: 3}), probe, Check()], steps=4)
    assert [(s, d) for s, d, _ in probe.rows] == [(1, 1), (2, 1), (3, 2), (4, 3)]
    assert [calls for *_, calls in probe.rows] == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert groups["start"] == groups["end"]  # parameter groups untouched
    all_params = {i for group in groups["start"] for i in group}
    assert {id(p) for p in model.mtp_modules.parameters()} <= all_params  # every module existed from the start
    assert not all(torch.equal(a, b) for a, b in zip(frozen[2], model.mtp_modules[2].parameters()))  # trained at 3
    assert trainer.logged_metrics["train/mtp/active_depth"] == 3


def test_gradient_accumulation_sees_one_depth_per_optimizer_step(make_tiny_model):
    model = make_tiny_model(depth=2)
    probe = Probe(model)
    fit(model, [MTPDepthWarmup(start_depth=1, until=2), probe], steps=3, accumulate_grad_batches=2)
    # (global step at batch end, active depth): the step advances after every second micro-batch
    assert [(s, d) for s, d, _ in probe.rows] == [(0, 1), (1, 1), (1, 1), (2, 1), (2, 2), (3, 2)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule={0: 1, 3000: 3, 1000: 2}), r"strictly increasing from 0, got \[0, 3000, 1000\]"),
        (dict(schedule={10: 1}), r"strictly increasing from 0, got \[10\]"),
        (dict(schedule={0: 2, 10: 1}), r"depths must not decrease, got \{0: 2, 10: 1\}"),
        (dict(schedule={0: 0}), r"schedule\[0\] must be an integer >= 1, got 0"),
        (dict(schedule={0: 1}, until=10), "exactly one of"),
        (dict(), "exactly one of"),
        (dict(until=0), "until must be an integer > begin = 0, got 0"),
        (dict(start_depth=3, end_depth=2, until=10), "end_depth must be >= start_depth = 3, got 2"),
        (dict(start_depth=0, until=10), "start_depth must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_quote_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MTPDepthWarmup(**kwargs)


def test_setup_rejects_depths_beyond_the_config_and_non_mtp_modules(make_tiny_model):
    model, trainer = make_tiny_model(depth=2), L.Trainer(accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match=r"schedule\[50\] asks for depth 3, beyond .*MTPConfig.depth = 2"):
        MTPDepthWarmup(schedule={0: 1, 50: 3}).setup(trainer, model, "fit")
    with pytest.raises(ValueError, match="end_depth asks for depth 4"):
        MTPDepthWarmup(end_depth=4, until=5).setup(trainer, model, "fit")
    with pytest.raises(TypeError, match="needs a LightningModule that uses MTPMixin.*got BoringModel"):
        from lightning.pytorch.demos.boring_classes import BoringModel

        MTPDepthWarmup(until=5).setup(trainer, BoringModel(), "fit")


def test_state_round_trip_and_defaults():
    warmup = MTPDepthWarmup(schedule={0: 1, 5: 2})
    warmup.last_step, warmup.active_depth = 7, 2
    again = MTPDepthWarmup(schedule={0: 1, 5: 2})
    again.load_state_dict(warmup.state_dict())
    assert (again.last_step, again.active_depth) == (7, 2)
    again.load_state_dict({})  # an older checkpoint without these keys
    assert (again.last_step, again.active_depth) == (-1, None)
    assert warmup.state_key != MTPDepthWarmup(schedule={0: 1, 9: 2}).state_key  # instances can coexist


def test_plain_ddp_is_refused_before_training_while_a_depth_is_inactive(make_tiny_model):
    """DDP fails at the first backward on the inactive depths' unused parameters (a long traceback per rank): refused
    at train start, after a resume is restored, so a fit resumed past the warmup (every depth active) is not."""
    from lightning.pytorch.strategies import DDPStrategy

    model = make_tiny_model(depth=3)
    warmup = MTPDepthWarmup(schedule={0: 1, 10: 3})

    def start(strategy, step=0):
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
        trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total.completed = step
        trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
        warmup.setup(trainer, model, "fit")
        warmup.on_train_start(trainer, model)

    with pytest.raises(ValueError, match=r"--trainer.strategy ddp_find_unused_parameters_true"):
        start(DDPStrategy())
    start(DDPStrategy(find_unused_parameters=True))
    start(DDPStrategy(), step=10)  # resumed past the warmup
    start("auto")
