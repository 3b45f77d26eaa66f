"""One forward per validation batch: ``validation_step`` computes the trunk and every depth once, scores the loss of
the active depths from them exactly as ``compute_lm_loss``, and the coupling monitor and the draft calibration read
them (the argmaxes of the loss's cross-entropy, and logits on their probed positions only) instead of re-running the
model. Their metrics equal those of the re-run path."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mtp.callbacks import MTPCouplingMonitor, MTPDraftCalibration
from lightning_mtp.callbacks._teacher_forcing import probed_columns
from lightning_mtp.models import CausalLM

VOCAB, BATCHES, BATCH_SIZE, LENGTH = 61, 3, 4, 16


def token_batches():
    return torch.randint(0, VOCAB, (BATCHES * BATCH_SIZE, LENGTH), generator=torch.Generator().manual_seed(0))


class MaskedTokens(torch.utils.data.Dataset):
    """Dict batches whose padding (attention_mask 0) is not scored: labels differ from input_ids."""

    def __init__(self):
        self.ids = token_batches()
        self.mask = torch.ones_like(self.ids)
        self.mask[::3, -5:] = 0

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


def loader(masked=False):
    return DataLoader(MaskedTokens() if masked else token_batches(), batch_size=BATCH_SIZE)


def both_callbacks(share: bool, monitor_chunk=None, max_batches=2, monitor_positions=128):
    monitor = MTPCouplingMonitor(chunk_size=monitor_chunk, max_positions=monitor_positions)
    calibration = MTPDraftCalibration(max_batches=max_batches)
    for callback in (monitor, calibration):
        callback.share_forward = share
    return [monitor, calibration]


def validate(model, callbacks, data):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=callbacks)
    trainer.validate(model, data, verbose=False)
    return {name: value.clone() for name, value in trainer.logged_metrics.items()}


class Counter:
    """Counts calls of a bound method, replaced on the instance."""

    def __init__(self, obj, name):
        self.calls, method = 0, getattr(obj, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        setattr(obj, name, counted)


@pytest.mark.parametrize(
    "architecture, active, masked, monitor_chunk, monitor_positions",
    [
        ("cascaded", 3, False, None, 128),
        ("cascaded", 1, True, None, 128),  # depths 2 and 3 run for the callbacks only
        ("parallel", 2, True, 16, 128),  # the monitor chunks one sequence at a time: its own pass over the logits
        ("cascaded", 3, True, 16, 20),  # JS and ECE on the same rotating subsample of positions either way
    ],
)
def test_callback_metrics_equal_those_of_the_rerun_path(
    make_tiny_model, architecture, active, masked, monitor_chunk, monitor_positions
):
    logged = {}
    for share in (True, False):
        model = make_tiny_model(depth=3, architecture=architecture)
        model.mtp_active_depth = active
        callbacks = both_callbacks(share, monitor_chunk, monitor_positions=monitor_positions)
        logged[share] = validate(model, callbacks, loader(masked))
        assert model.mtp_active_depth == active
    assert logged[True].keys() == logged[False].keys()
    names = [name for name in logged[True] if "temperature" in name or "accept" in name or "ece" in name]
    assert len(names) == 3 * 4  # every depth's temperature, acceptances and ECE were logged
    for name, value in logged[False].items():
        assert torch.equal(logged[True][name], value), name  # to the bit


class RowCounter:
    """Counts the rows (positions) a head module is called on."""

    def __init__(self, module):
        self.rows, forward = 0, module.forward

        def counted(hidden):
            self.rows += hidden.numel() // hidden.shape[-1]
            return forward(hidden)

        module.forward = counted


def test_trunk_runs_once_and_heads_only_on_probed_positions(make_tiny_model):
    """One trunk pass per batch; the argmaxes come from the loss's cross-entropy (which reads the head's weight, never
    calls the head), and the callbacks call the heads on their subsampled positions only, shared or not."""
    calls, rows = {}, {}
    monitor_positions, calibration_positions = 8, 32
    for share in (True, False):
        model = make_tiny_model(depth=3)
        trunk = Counter(model, "mtp_trunk_hidden_states")
        heads = RowCounter(model.lm_head)
        callbacks = both_callbacks(share, max_batches=BATCHES, monitor_positions=monitor_positions)
        validate(model, callbacks, loader())
        calls[share], rows[share] = trunk.calls, heads.rows
    assert calls == {True: BATCHES, False: 3 * BATCHES}
    # Per batch and depth k: the monitor probes depth k at its columns; the calibration probes depth k and the main
    # head (at i + k) at its own columns. Both rotate their columns from batch to batch.
    expected = sum(BATCH_SIZE * len(range(LENGTH - k - 1)[probed_columns(BATCH_SIZE, LENGTH - 2, n, index)]) * copies
                   for index in range(BATCHES) for k in (1, 2, 3)
                   for n, copies in ((monitor_positions, 1), (calibration_positions, 2)))
    assert rows == {True: expected, False: expected}
    every_position = sum(BATCH_SIZE * (LENGTH - k - 1) for k in range(4))  # one pass of full logits: 4 heads
    assert expected < BATCHES * every_position


def test_validation_loss_is_compute_lm_loss(make_tiny_model):
    """With or without callbacks, the logged losses are compute_lm_loss's: inactive depths never enter them."""
    batch = token_batches()[:BATCH_SIZE]
    for active in (0, 1, 3):
        model = make_tiny_model(depth=3)
        model.mtp_active_depth, model.mtp_loss_weight, model.mtp_depth_weights = active, 0.3, [1.0, 0.8, 0.64]
        data = DataLoader(batch, batch_size=BATCH_SIZE)
        with_callbacks = validate(model, both_callbacks(True), data)
        alone = validate(model, [], data)
        with torch.no_grad():
            out = model.compute_lm_loss(batch)
        # (an epoch's loss is summed in float64 over its tokens: one batch's equals compute_lm_loss's to float32's
        # rounding)
        assert with_callbacks["val/loss"] == alone["val/loss"] == pytest.approx(float(out.loss), rel=1e-6)
        assert with_callbacks["val/mtp/loss"] == alone["val/mtp/loss"] == pytest.approx(float(out.mtp_loss), rel=1e-6)
        assert with_callbacks["val/main/loss"] == out.main_loss
        for k in range(1, 4):
            assert (f"val/mtp/loss_depth{k}" in with_callbacks) == (k <= active)
            if k <= active:
                assert with_callbacks[f"val/mtp/loss_depth{k}"] == out.depth_losses[k - 1]


class Probe(L.Callback):
    """Records, around each batch, the module's shared forward: absent before the batch's first callback, full after
    the step (every configured depth, whatever the active depth)."""

    def __init__(self):
        self.before, self.after = [], []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.before.append(pl_module._mtp_validation_record)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        record = pl_module._mtp_validation_record
        self.after.append(None if record is None or record.forward is None else len(record.forward.depth_hidden))


def test_the_forward_lives_for_one_batch_and_only_when_asked(make_tiny_model):
    model = make_tiny_model(depth=3)
    model.mtp_active_depth = 1
    first, last = Probe(), Probe()
    validate(model, [first, *both_callbacks(True, max_batches=1), last], loader())
    assert first.before == [None] * BATCHES  # dropped after every batch
    assert last.after == [3, 3, 3]  # kept for the callbacks, with the depths that training has not activated
    assert model._mtp_validation_record is None
    only_calibration, probe = MTPDraftCalibration(max_batches=1), Probe()
    validate(model, [only_calibration, probe], loader())
    assert probe.after == [3, None, None]  # after max_batches, nobody asks: the step computes the loss alone


def test_sanity_check_asks_for_nothing(make_tiny_model, tmp_path):
    model = make_tiny_model(depth=2)
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, max_steps=1, val_check_interval=1, limit_val_batches=1,
                        num_sanity_val_steps=1,
                        callbacks=[*both_callbacks(True), probe], default_root_dir=tmp_path)
    trainer.fit(model, loader(), loader())
    assert probe.after == [None, 2]  # the sanity batch, then the validation after the step


class OwnValidationStep(CausalLM):
    """A host whose validation_step is its own: the callbacks compute the forward once between them."""

    def validation_step(self, batch, batch_idx):
        loss = self.compute_lm_loss(batch).loss
        self.log("val/loss", loss)
        return loss


def test_host_with_its_own_validation_step_runs_the_trunk_once_for_all_callbacks(make_tiny_model):
    logged = {}
    for share in (True, False):
        reference = make_tiny_model(depth=2)
        model = OwnValidationStep(reference.model_config, reference.mtp_config)
        model.configure_model()
        model.load_state_dict(reference.state_dict())
        trunk = Counter(model, "mtp_trunk_hidden_states")
        logged[share] = validate(model, both_callbacks(share, max_batches=BATCHES), loader())
        assert trunk.calls == (2 if share else 3) * BATCHES  # its own step, then once for both callbacks
    for name, value in logged[False].items():
        assert torch.equal(logged[True][name], value), name


def test_under_mixed_precision_the_callbacks_read_the_states_computed_under_autocast(make_tiny_model):
    """The shared states are the step's, computed under autocast; the re-run path computes them in full precision
    outside it (as before sharing). One trunk pass per batch still, and metrics within bf16's rounding."""
    logged, calls = {}, {}
    for share in (True, False):
        model = make_tiny_model(depth=2)
        trunk = Counter(model, "mtp_trunk_hidden_states")
        trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=both_callbacks(share, max_batches=BATCHES))
        trainer.validate(model, loader(), verbose=False)
        logged[share], calls[share] = {k: float(v) for k, v in trainer.logged_metrics.items()}, trunk.calls
    assert calls == {True: BATCHES, False: 3 * BATCHES}
    for k in (1, 2):
        name = f"val/mtp/temperature_depth{k}"
        assert logged[True][name] == pytest.approx(logged[False][name], rel=2e-2)
        name = f"val/mtp/accept_depth{k}"
        assert logged[True][name] == pytest.approx(logged[False][name], abs=0.05)


class RebuiltBatch(CausalLM):
    """The step gets a copy of the batch's dict, as DDP on GPUs hands it (its tensors are the same objects)."""

    def validation_step(self, batch, batch_idx):
        return super().validation_step(dict(batch), batch_idx)


def test_the_step_finds_the_forward_asked_for_when_its_batch_was_rebuilt(make_tiny_model):
    reference = make_tiny_model(depth=2)
    model = RebuiltBatch(reference.model_config, reference.mtp_config)
    model.configure_model()
    trunk = Counter(model, "mtp_trunk_hidden_states")
    validate(model, both_callbacks(True, max_batches=BATCHES), loader(masked=True))
    assert trunk.calls == BATCHES


def test_an_epochs_losses_are_means_over_its_scored_tokens_not_over_its_batches(make_tiny_model):
    """Two validation batches, one with few scored tokens (a padded chat batch), one with many: each logged epoch
    loss is the mean over every scored token (sums over counts), as one batch of both would give, and not the mean of
    the two batches' means, which would weigh a scored token of the small batch ten times as much."""
    ids = token_batches()[:8]
    labels = ids.clone()
    labels[:4, : LENGTH - 3] = -100  # the first batch scores a few tokens per row, the second all of them
    rows = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    model = make_tiny_model(depth=3)
    model.mtp_active_depth, model.mtp_loss_weight, model.mtp_depth_weights = 2, 0.3, [1.0, 0.8, 0.64]
    logged = validate(model, [], DataLoader(rows, batch_size=4))
    with torch.no_grad():
        outs = [model.compute_lm_loss(ids[s], labels[s]) for s in (slice(0, 4), slice(4, 8))]
    sums = sum(out.losses.per_depth.double() * out.losses.valid_counts for out in outs)
    counts = sum(out.losses.valid_counts for out in outs)
    means = sums / counts
    assert 4 * outs[0].losses.valid_counts[0] < outs[1].losses.valid_counts[0]  # the batches differ in scored tokens
    weights = torch.tensor(outs[0].losses.weights, dtype=torch.float64)
    expected = {"val/main/loss": means[0], "val/mtp/loss_depth1": means[1], "val/mtp/loss_depth2": means[2],
                "val/mtp/loss": (weights[1:] * means[1:]).sum(), "val/loss": (weights * means).sum()}
    for name, value in expected.items():
        assert float(logged[name]) == pytest.approx(float(value), rel=1e-6), name
        batch_mean = sum(float(out.losses.per_depth[0]) for out in outs) / 2
        assert name != "val/main/loss" or abs(float(logged[name]) - batch_mean) > 1e-3  # not the mean of means
    assert "val/mtp/loss_depth3" not in logged
