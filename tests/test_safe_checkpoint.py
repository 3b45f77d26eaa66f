"""``SafeCheckpoint``: a fit that is stopped keeps its work and resumes exactly; saves are atomic; one fit per folder.

Real fits of a tiny ``CausalLM`` on a slice of the standard library (byte tokenizer); real signals sent to the fitting
process (in this process, and to a ``lightning-mtp fit`` subprocess); real files on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import REPO, cli_refusal, tiny_fit_args, tiny_predict_args
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import TorchCheckpointIO

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import MTPDepthWarmup, MTPDraftCalibration, MTPWeightSchedule, SafeCheckpoint, folder_lock
from lightning_mtp.data import TextDataModule
from lightning_mtp.models import CausalLM, ModelConfig

STEPS = 8


class SendSignal(Callback):
    """Sends ``signum`` to this process once: after training step ``step`` (``during="train"``), or before the first
    batch of the validation that follows it (``during="val"``)."""

    def __init__(self, step: int, signum: int, during: str = "train", times: int = 1) -> None:
        self.step, self.signum, self.during, self.times = step, signum, during, times
        self.sent = False

    def _send(self) -> None:
        if not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.during == "train" and trainer.global_step == self.step:
            self._send()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.during == "val" and trainer.global_step == self.step and not trainer.sanity_checking:
            self._send()


class SaveLog(Callback):
    """The global step of every checkpoint written (``on_save_checkpoint`` runs once per file)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.steps.append(trainer.global_step)


def fit(folder: Path, cache: Path, *, ckpt_path=None, extra=(), checkpoint=None, plugins=None, **trainer_kwargs):
    torch.manual_seed(0)
    datamodule = TextDataModule(
        tokenizer="byte", seq_len=64, batch_size=8, max_bytes=3_000, val_fraction=0.2, cache_dir=str(cache)
    )
    model = CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=4, max_seq_len=64), MTPConfig(depth=2),
                     learning_rate=3e-3, warmup_steps=3)
    checkpoint = checkpoint or SafeCheckpoint(dirpath=str(folder / "ckpt"), save_every_minutes=None)
    saves = SaveLog()
    callbacks = [MTPDepthWarmup(schedule={0: 1, 5: 2}), MTPWeightSchedule(schedule="linear", start=0.5, end=0.1,
                 until=STEPS), MTPDraftCalibration(grid_size=5), saves, *extra, checkpoint]
    settings = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=4, check_val_every_n_epoch=None,
                    max_steps=STEPS, default_root_dir=folder)
    settings.update(trainer_kwargs)
    trainer = L.Trainer(callbacks=callbacks, plugins=plugins, **settings)
    trainer.fit(model, datamodule, ckpt_path=ckpt_path)
    return trainer, model, saves


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    trainer, model, saves = fit(folder, folder / "cache")
    return folder / "cache", model, saves


def test_last_checkpoint_is_written_at_every_validation(uninterrupted):
    _, _, saves = uninterrupted
    assert saves.steps == [4, 8]  # val_check_interval 4 (ModelCheckpoint with save_top_k 0 wrote only the last)


def test_last_checkpoint_is_written_every_interval(tmp_path, uninterrupted):
    cache = uninterrupted[0]
    every_step = SafeCheckpoint(dirpath=str(tmp_path / "ckpt"), save_every_minutes=1e-9)
    _, _, saves = fit(tmp_path, cache, checkpoint=every_step, limit_val_batches=0, max_steps=3)
    assert saves.steps == [1, 2, 3]


@pytest.mark.parametrize("signum, during, status", [
    (signal.SIGTERM, "train", 143),
    (signal.SIGINT, "train", 130),
    (signal.SIGTERM, "val", 143),
])
def test_a_signal_saves_last_and_the_resumed_fit_equals_the_uninterrupted(tmp_path, uninterrupted, signum, during,
                                                                          status):
    cache, reference, _ = uninterrupted
    stop_at = 5 if during == "train" else 4
    handler = signal.getsignal(signal.SIGINT)  # Python's default; ignored in a process started in the background
    with pytest.raises(SystemExit) as stopped:
        fit(tmp_path, cache, extra=[SendSignal(stop_at, signum, during)])
    assert stopped.value.code == status
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == stop_at
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C means what it meant before the fit again

    _, resumed, _ = fit(tmp_path, cache, ckpt_path=str(last))
    assert_same_weights(reference, resumed)
    assert resumed.mtp_draft_temperatures == pytest.approx(reference.mtp_draft_temperatures, abs=1e-9)


class StepLog(Logger):
    """The steps at which ``train/loss`` was logged (what TensorBoard would plot)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    name, version = "steps", 0

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.steps.append(step)

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_the_step_a_signal_stops_at_is_logged_once_and_the_resumed_fit_logs_the_rest(tmp_path, uninterrupted):
    cache = uninterrupted[0]
    stopped, resumed = StepLog(), StepLog()
    with pytest.raises(SystemExit):
        fit(tmp_path, cache, extra=[SendSignal(5, signal.SIGTERM)], logger=stopped, log_every_n_steps=1)
    fit(tmp_path, cache, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), logger=resumed, log_every_n_steps=1)
    assert stopped.steps == [0, 1, 2, 3, 4]  # the fifth step's loss included: it was trained and saved
    assert resumed.steps == [5, 6, 7]


def test_a_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(tmp_path, uninterrupted):
    cache = uninterrupted[0]
    with pytest.raises(SystemExit) as stopped:
        fit(tmp_path, cache, extra=[SendSignal(5, signal.SIGINT, times=2)])
    assert stopped.value.code == 1  # Lightning's KeyboardInterrupt exit: nothing saved at step 5
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4


class FailingWrite(TorchCheckpointIO):
    """Writes half of a checkpoint and dies: a kill in the middle of a save."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        raise RuntimeError("killed while writing")


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_intact(tmp_path, uninterrupted):
    cache = uninterrupted[0]
    fit(tmp_path, cache, max_steps=4)
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(RuntimeError, match="killed while writing"):
        fit(tmp_path, cache, ckpt_path=str(last), plugins=[FailingWrite()])
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=True)["global_step"] == 4
    _, _, saves = fit(tmp_path, cache, ckpt_path=str(last))  # the next fit clears the half-written file
    assert saves.steps == [8] and not list((tmp_path / "ckpt").glob(".*partial"))


def test_a_deepspeed_style_checkpoint_folder_is_swapped_whole(tmp_path):
    from lightning_mtp.callbacks.safe_checkpoint import _move_into_place, _recover_interrupted_swaps

    target, partial = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial"
    for folder, text in ((target, "old"), (partial, "new")):
        folder.mkdir()
        (folder / "shard").write_text(text)
    _move_into_place(str(partial), str(target))
    assert (target / "shard").read_text() == "new" and not partial.exists()
    assert not (tmp_path / ".last.ckpt.previous").exists()
    # a crash between the two renames leaves only .previous: the next fit brings it back
    os.replace(target, tmp_path / ".last.ckpt.previous")
    _recover_interrupted_swaps(tmp_path)
    assert (target / "shard").read_text() == "new"


# ------------------------------------------------------------------------------ a real process, killed
def _cli(workdir: Path, *extra: str) -> list[str]:
    return tiny_fit_args(workdir, "--trainer.val_check_interval", "5", "--data.init_args.tokenizer", "byte",
                         "--model.init_args.model.vocab_size", "258", *extra)


def test_a_killed_fit_resumes_exactly_and_a_second_fit_into_its_folder_is_refused(tmp_path, capsys):
    """``lightning-mtp fit`` in a subprocess; a second fit into its folder is refused while it runs; SIGTERM saves
    last.ckpt and exits 143; ``--ckpt_path`` resumes it to the end, equal to an uninterrupted fit."""
    from lightning_mtp.cli import main

    steps = ("--trainer.max_steps", "60")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
               TOKENIZERS_PARALLELISM="false")
    # one thread, as this process (conftest): the same sums in the same order, so the runs can agree to 1e-6
    code = ("import torch; torch.set_num_threads(1); from lightning_mtp.cli import main; "
            f"main({_cli(tmp_path / 'killed', *steps)!r})")
    process = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        first_save = tmp_path / "killed" / "ckpt" / "last.ckpt"
        deadline = time.monotonic() + 120
        while not first_save.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_save.exists(), process.stderr.read() if process.poll() is not None else "no checkpoint in 120 s"

        process.send_signal(signal.SIGSTOP)  # paused mid-fit, holding its folder, while a second fit tries it
        err = cli_refusal(_cli(tmp_path / "second", *steps, "--trainer.callbacks.init_args.dirpath",
                               str(tmp_path / "killed" / "ckpt")), capsys)
        assert "another fit is writing checkpoints" in err and f"process {process.pid}" in err
        assert not (tmp_path / "second").exists()  # refused before writing anything of its own

        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    assert "Resume with --ckpt_path" in stderr
    stopped_at = torch.load(first_save, weights_only=True)["global_step"]
    assert 5 <= stopped_at < 60

    main(_cli(tmp_path / "killed", *steps, "--ckpt_path", str(first_save)))
    main(_cli(tmp_path / "whole", *steps))
    resumed = torch.load(first_save, weights_only=True)
    whole = torch.load(tmp_path / "whole" / "ckpt" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == whole["global_step"] == 60
    for name, value in whole["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, atol=1e-6, rtol=0, msg=name)


def test_the_folder_lock_is_released_with_its_process(tmp_path):
    holder = subprocess.run([sys.executable, "-c", "import sys; from lightning_mtp.callbacks import folder_lock; "
                             f"assert folder_lock.hold({str(tmp_path)!r}).refusal is None"],
                            env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert holder.returncode == 0
    assert folder_lock.hold(tmp_path).refusal is None  # its process ended: nothing stale blocks this one
    folder_lock.release(tmp_path)


def test_a_checkpoint_left_aside_by_an_interrupted_swap_is_found_by_the_cli(tiny_checkpoint, tmp_path):
    """A kill between the two renames of a folder swap (DeepSpeed) leaves ``.last.ckpt.previous`` and no
    ``last.ckpt``: ``--ckpt_path .../last.ckpt`` must bring it back, not say the checkpoint does not exist."""
    import json
    import shutil

    from lightning_mtp.cli import main

    _, ckpt = tiny_checkpoint
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(ckpt, folder / ".last.ckpt.previous")
    main(tiny_predict_args(tmp_path, folder / "last.ckpt"))
    assert (folder / "last.ckpt").is_file() and not (folder / ".last.ckpt.previous").exists()
    assert len((tmp_path / "predictions" / "generations.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "predictions" / "generations.jsonl").read_text().splitlines()[0])["tokens"]


def test_sigterm_stops_predict_after_the_batch_keeping_the_previous_outputs(tiny_checkpoint, tmp_path):
    """``predict`` on many prompts in a subprocess: SIGTERM (a scheduler, ``docker stop``) stops it after the current
    batch with exit status 143, and the previous run's outputs stay as they were (Lightning's own handler only logged
    the signal and let the run go on to replace them)."""
    _, ckpt = tiny_checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"def f{i}(x):\n" for i in range(400)))
    out = tmp_path / "predictions"
    out.mkdir()
    for name in ("generations.jsonl", "stats.json"):
        (out / name).write_text("previous run\n")
    args = tiny_predict_args(tmp_path, ckpt, "--data.init_args.predict_prompts", str(prompts),
                             "--model.init_args.generation.max_new_tokens", "24", "--data.init_args.batch_size", "1")
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen([sys.executable, "-c", f"from lightning_mtp.cli import main; main({args!r})"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        partial, deadline = out / ".generations.jsonl.partial", time.monotonic() + 120
        while not (partial.exists() and partial.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    assert "SIGTERM: predict stopped" in stderr
    assert sorted(p.name for p in out.iterdir()) == ["generations.jsonl", "stats.json"]  # no partial file left
    assert all((out / name).read_text() == "previous run\n" for name in ("generations.jsonl", "stats.json"))


class ValidationLog(Callback):
    """The step and ``val/loss`` of every validation of a fit (not the sanity check)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float]] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.runs.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


@pytest.mark.parametrize("during, stop_at, interval", [("train", 4, 4), ("val", 4, 4), ("train", 2, 2)])
def test_the_validation_a_signal_skips_runs_first_when_the_fit_resumes(tmp_path, uninterrupted, during, stop_at,
                                                                         interval):
    """A stop on a step due for validation (after its batch, or during the validation) saves at once, and the
    resumed fit validates that step before training on: the same validations, at the same steps, with the same
    losses as the uninterrupted fit (Lightning's restored loops counted that step as validated and never ran it).
    Step 2 of 2 validates mid-epoch, step 4 at an epoch's end."""
    cache = uninterrupted[0]
    reference = ValidationLog()
    fit(tmp_path / "reference", cache, extra=[reference], val_check_interval=interval)
    first, resumed = ValidationLog(), ValidationLog()
    with pytest.raises(SystemExit):
        fit(tmp_path, cache, extra=[SendSignal(stop_at, signal.SIGTERM, during), first], val_check_interval=interval)
    fit(tmp_path, cache, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), extra=[resumed], val_check_interval=interval)
    assert [step for step, _ in first.runs] == [s for s, _ in reference.runs if s < stop_at]
    assert [step for step, _ in first.runs + resumed.runs] == [step for step, _ in reference.runs]
    assert [loss for _, loss in first.runs + resumed.runs] == pytest.approx([loss for _, loss in reference.runs],
                                                                            abs=1e-6)


def test_a_new_fit_over_an_earlier_fits_last_ckpt_is_refused_at_train_start(tmp_path):
    """A ``Trainer`` of one's own: a fit that resumes nothing into a folder holding ``last.ckpt`` is refused before
    its first step (the file kept); resuming it, or ``enable_version_counter`` (``last-v1.ckpt`` beside it), is not."""
    cache = tmp_path / "cache"
    fit(tmp_path, cache, max_steps=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()
    with pytest.raises(ValueError, match="earlier fit's checkpoint.*--ckpt_path last"):
        fit(tmp_path, cache, max_steps=2)
    assert last.read_bytes() == before
    trainer, _, _ = fit(tmp_path, cache, ckpt_path=str(last), max_steps=3)
    assert trainer.global_step == 3
    fit(tmp_path, cache, max_steps=1, checkpoint=SafeCheckpoint(dirpath=str(tmp_path / "ckpt"),
                                                                 save_every_minutes=None, enable_version_counter=True))
    assert (tmp_path / "ckpt" / "last-v1.ckpt").exists()


class SignalAtBatch(Callback):
    """Sends SIGTERM to this process once, after training batch ``batch`` (counted over the fit)."""

    def __init__(self, batch: int) -> None:
        self.batch, self.sent = batch, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        if not self.sent and done == self.batch + 1:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class SaveDueAtBatch(Callback):
    """Makes ``checkpoint``'s ``save_every_minutes`` save due at training batch ``batch`` (its clock set back)."""

    def __init__(self, checkpoint: SafeCheckpoint, batch: int) -> None:
        self.checkpoint, self.batch = checkpoint, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.epoch_loop.batch_progress.total.ready == self.batch + 1:
            self.checkpoint._last_save_time = float("-inf")


def saved_batches(path: Path) -> int:
    return torch.load(path, weights_only=True)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"]


def test_a_stop_or_save_inside_an_accumulation_window_waits_for_its_step_and_resumes_exactly(tmp_path):
    """With ``accumulate_grad_batches 2`` a SIGTERM after a window's first batch, a timed save there, or a validation
    there, wait for the window's optimizer step: a checkpoint inside a window misses its first batch's gradient (the
    resumed fit differed by up to 0.035 in a weight). The resumed fit equals the uninterrupted one."""
    cache = tmp_path / "cache"
    settings = dict(accumulate_grad_batches=2, max_steps=4, val_check_interval=3, limit_val_batches=1)
    _, reference, saves = fit(tmp_path / "straight", cache, **settings)
    assert saves.steps == [2, 3, 4]  # validations after batches 3 and 6 (inside windows): saved at their steps
    assert saved_batches(tmp_path / "straight" / "ckpt" / "last.ckpt") == 8  # the fit's end

    folder = tmp_path / "stopped"
    with pytest.raises(SystemExit) as stopped:
        fit(folder, cache, extra=[SignalAtBatch(4)], **settings)  # batch 4 of 0..7: the first of step 3's window
    assert stopped.value.code == 143
    last = folder / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3 and saved_batches(last) == 6
    _, resumed, _ = fit(folder, cache, ckpt_path=str(last), **settings)
    assert_same_weights(reference, resumed)

    timed = SafeCheckpoint(dirpath=str(tmp_path / "timed" / "ckpt"), save_every_minutes=60)
    _, _, saves = fit(tmp_path / "timed", cache, checkpoint=timed, extra=[SaveDueAtBatch(timed, 0)],
                      **{**settings, "limit_val_batches": 0, "max_steps": 2})
    assert saves.steps == [1, 2]  # due at batch 0 (inside step 1's window): saved at step 1; then the fit's end


def test_last_ckpt_is_written_at_the_end_of_a_fit_past_its_last_validation(tmp_path, uninterrupted):
    """Lightning's ``ModelCheckpoint`` saves at the end only when it never saved: the steps after the last validation
    were in no checkpoint."""
    _, _, saves = fit(tmp_path, uninterrupted[0], max_steps=6)
    assert saves.steps == [4, 6]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 6


@pytest.mark.parametrize("during", ["train", "val"])
def test_a_signal_at_the_fits_last_step_runs_its_last_validation_before_the_fit_ends(tmp_path, uninterrupted, during):
    """A resumed fit that has reached max_steps runs nothing (Lightning's fit loop returns at once), so a last
    validation the stop skipped never ran: its metrics and the draft calibration's last fit were lost. Now that
    validation runs and the fit ends; last.ckpt equals the uninterrupted fit's."""
    cache, reference, _ = uninterrupted
    _, stopped, saves = fit(tmp_path, cache, extra=[SendSignal(STEPS, signal.SIGTERM, during)])
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == STEPS and saves.steps[-1] == STEPS
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("SafeCheckpoint"))
    assert state["validation_skipped"] is False
    assert_same_weights(reference, stopped)
    assert checkpoint["mtp"]["draft_temperatures"] == pytest.approx(reference.mtp_draft_temperatures, abs=1e-9)


class BatchLog(Callback):
    """(epoch, first ids of each row) of every training batch."""

    def __init__(self) -> None:
        self.batches: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, tuple(batch["input_ids"][:, :4].flatten().tolist())))


def test_a_fit_ended_by_max_steps_mid_epoch_and_extended_trains_the_rest_of_that_epoch(tmp_path, uninterrupted):
    """``last.ckpt`` written at the end of a fit that ``max_steps`` stopped part-way through an epoch counted that
    epoch as completed (Lightning's loops do) beside the loader's mid-epoch position: the extended fit labelled the
    epoch's remaining batches the next epoch and ended an epoch early (22 steps of 33 in the tester's run)."""
    whole, straight = tmp_path / "whole", BatchLog()
    trainer, _, _ = fit(whole, uninterrupted[0], extra=[straight], max_steps=-1, max_epochs=3)
    per_epoch = trainer.num_training_batches
    assert trainer.global_step == 3 * per_epoch and per_epoch >= 3
    first, then = BatchLog(), BatchLog()
    fit(tmp_path / "parts", uninterrupted[0], extra=[first], max_steps=per_epoch + 2, max_epochs=3)
    trainer, _, _ = fit(tmp_path / "parts", uninterrupted[0], extra=[then], max_steps=-1, max_epochs=3,
                              ckpt_path=str(tmp_path / "parts" / "ckpt" / "last.ckpt"))
    assert first.batches + then.batches == straight.batches  # (the weights differ: the cosine schedule's length did)
    assert trainer.global_step == 3 * per_epoch


def test_a_stop_at_the_end_of_a_limited_epoch_resumes_with_the_next_epoch(tmp_path, uninterrupted):
    """``limit_train_batches`` ends each pass early. A stop at a limited pass's last batch resumed that pass (the loader
    measured it against its full length): the resumed epoch trained the batches the limit leaves out, and every later
    epoch ran one pass behind (18 steps of 21 in the tester's run)."""
    whole, straight = tmp_path / "whole", BatchLog()
    trainer, reference, _ = fit(whole, uninterrupted[0], extra=[straight], max_steps=-1, max_epochs=3,
                                limit_train_batches=3)
    assert trainer.global_step == 9 and trainer.fit_loop.max_batches == 3
    first, then = BatchLog(), BatchLog()
    with pytest.raises(SystemExit):
        fit(tmp_path / "parts", uninterrupted[0], extra=[first, SendSignal(3, signal.SIGTERM)], max_steps=-1,
            max_epochs=3, limit_train_batches=3)
    trainer, resumed, _ = fit(tmp_path / "parts", uninterrupted[0], extra=[then], max_steps=-1, max_epochs=3,
                              limit_train_batches=3, ckpt_path=str(tmp_path / "parts" / "ckpt" / "last.ckpt"))
    assert first.batches + then.batches == straight.batches
    assert_same_weights(reference, resumed)


def test_a_resume_refused_for_another_batch_size_leaves_last_ckpt_as_it_was(tmp_path, uninterrupted):
    """A stop that skipped a validation resumes by running it first, which saved ``last.ckpt`` with the new batch size
    before the loader refused it: the same resume tried again was accepted and trained rows twice."""
    stop = tmp_path / "stopped"
    with pytest.raises(SystemExit):
        fit(stop, uninterrupted[0], extra=[SendSignal(2, signal.SIGTERM)], max_steps=-1, max_epochs=3,
            val_check_interval=2)
    last = stop / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["callbacks"] and saved["TextDataModule"]["train_loader"]["batches_yielded"] == 2

    def resume_with_batch_size(size):
        datamodule = TextDataModule(tokenizer="byte", seq_len=64, batch_size=size, max_bytes=3_000, val_fraction=0.2,
                                    cache_dir=str(uninterrupted[0]))
        model = CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=4, max_seq_len=64),
                         MTPConfig(depth=2), learning_rate=3e-3, warmup_steps=3)
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=2,
                            check_val_every_n_epoch=None, max_epochs=3, default_root_dir=stop,
                            callbacks=[SafeCheckpoint(dirpath=str(stop / "ckpt"), save_every_minutes=None)])
        trainer.fit(model, datamodule, ckpt_path=str(last))

    for _ in range(2):
        with pytest.raises(ValueError, match=r"batch_size 8 -> 4"):
            resume_with_batch_size(4)
        assert torch.load(last, weights_only=False)["TextDataModule"] == saved["TextDataModule"]


@pytest.mark.parametrize("setting, value", [("seed", 99), ("seq_len", 48)])
def test_a_resume_of_ones_own_with_another_data_seed_or_seq_len_is_refused(tmp_path, uninterrupted, setting, value):
    """The CLI refuses these on resume; ``Trainer.fit(ckpt_path=...)`` of one's own took them silently (with another
    seed the tester's resumed epoch trained 46 rows twice and 46 never, and the validation split changed)."""
    with pytest.raises(SystemExit):
        fit(tmp_path, uninterrupted[0], extra=[SendSignal(2, signal.SIGTERM)])
    datamodule = TextDataModule(**{"tokenizer": "byte", "seq_len": 64, "batch_size": 8, "max_bytes": 3_000,
                                   "val_fraction": 0.2, "cache_dir": str(uninterrupted[0]), setting: value})
    model = CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=4, max_seq_len=64), MTPConfig(depth=2))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        max_steps=STEPS, enable_checkpointing=False)
    with pytest.raises(ValueError, match=rf"--data\.{setting} .* -> {value}"):
        trainer.fit(model, datamodule, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
