"""``SafeCheckpoint``: a ``ModelCheckpoint`` that never loses a fit's work.

What it adds to Lightning's ``ModelCheckpoint`` (whose arguments it takes, for top-k files too):

- ``last.ckpt`` after every validation, every ``save_every_minutes`` of training and at the end of the fit, whatever
  ``save_top_k`` is (Lightning's writes it only next to a top-k file, and at the end only if it never wrote one, so
  the steps after the last validation were lost);
- only where an optimizer step has just ended: with ``accumulate_grad_batches`` the gradients of a window's first
  batches are in no checkpoint, so a save (or a stop) that falls inside a window waits for its step;
- every file is written atomically: to a hidden ``.<name>.partial`` in the same folder, then renamed over the old
  one, so a kill during a save leaves the previous checkpoint intact (a DeepSpeed checkpoint folder is swapped the
  same way, the old one kept as ``.<name>.previous`` until the new one is in place, and brought back if a crash left
  only that);
- on SIGTERM (a scheduler's preemption, ``kill``, ``docker stop``) or SIGINT (Ctrl-C) the fit finishes its current
  batch (its optimizer step, when accumulating), saves ``last.ckpt`` and stops with exit status 128 + the signal's
  number (143, 130); ``--ckpt_path last.ckpt`` then resumes it exactly (a validation due at that step, or under way,
  is not waited for: the resumed fit runs it first). The signal may reach one rank or all of them: the ranks agree
  on it after every batch, so all stop at the same one. A second Ctrl-C stops at once and keeps the ``last.ckpt``
  written before;
- one fit per folder: a lock (:mod:`~lightning_mtp.callbacks.folder_lock`) refuses a second fit into the same folder,
  naming the process that writes there; a new fit (nothing resumed) into a folder that holds an earlier fit's
  ``last.ckpt`` is refused too (its first save would replace it): resume it, or give the new fit another folder;
- a fit that diverged (:class:`~lightning_mtp.finite.TrainingDiverged`) saves nothing: the last good checkpoint stays.

Example::

    trainer = L.Trainer(callbacks=[SafeCheckpoint(dirpath="outputs/run/checkpoints", save_every_minutes=10)])

    # a config (every bundled fit config uses it):
    #   - class_path: lightning_mtp.callbacks.SafeCheckpoint
    #     init_args: {dirpath: outputs/run/checkpoints, save_every_minutes: 10}
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_mtp.callbacks import folder_lock
from lightning_mtp.finite import TrainingDiverged


class SafeCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with ``last.ckpt`` kept current, atomic writes, a save on SIGTERM / SIGINT, and one fit
    per folder (see the module docstring).

    Args:
        dirpath: the checkpoint folder (default: Lightning's, under the logger's folder).
        filename: name pattern of top-k files (``ModelCheckpoint``'s).
        monitor: metric for top-k files; ``None`` with ``save_top_k=0`` keeps ``last.ckpt`` only.
        save_top_k: how many best files to keep besides ``last.ckpt`` (default 0).
        save_every_minutes: also write ``last.ckpt`` once this many minutes of training have passed since the last
            save (``None``: at validations, at the end and on a signal only).
        enable_version_counter: ``True`` lets a new fit write ``last-v1.ckpt`` beside an earlier fit's ``last.ckpt``;
            ``False`` (default) keeps one ``last.ckpt`` per folder, and a new fit into a folder that holds one is
            refused (:meth:`check_new_fit`).
        **kwargs: the other arguments of ``ModelCheckpoint`` (``mode``, ``every_n_train_steps``, ...).
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        save_top_k: int = 0,
        save_every_minutes: Optional[float] = 30.0,
        enable_version_counter: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("save_last", True) is not True:
            raise ValueError("SafeCheckpoint.save_last cannot be changed: keeping last.ckpt current is its purpose "
                             "(use lightning.pytorch.callbacks.ModelCheckpoint for top-k files only)")
        if save_every_minutes is not None and (isinstance(save_every_minutes, bool) or not isinstance(
                save_every_minutes, (int, float)) or not 0 < save_every_minutes < float("inf")):
            raise ValueError(f"SafeCheckpoint.save_every_minutes must be a number of minutes > 0 or None, "
                             f"got {save_every_minutes!r}")
        super().__init__(dirpath=dirpath, filename=filename, monitor=monitor, save_top_k=save_top_k, save_last=True,
                         enable_version_counter=enable_version_counter, **kwargs)
        self.save_every_minutes = save_every_minutes
        self._last_save_time = time.monotonic()
        self._signal: Optional[int] = None  # the signal this process received (SIGINT or SIGTERM), or None
        self._stop_signal: Optional[int] = None  # the one all ranks agreed to stop for
        self._previous_sigint: Any = None
        self._validation_skipped = False  # the stop skipped a validation (due at its step, or under way): saved
        self._validate_first = False  # restored from a checkpoint whose stop skipped one: run it before training
        self._finishing = False  # a stop came at the fit's last step: its last validation runs, then the fit ends
        self._at_train_end = False  # the save at the fit's end is being written (on_save_checkpoint)
        self._at_step = True  # the last training batch ended an optimizer step (not inside an accumulation window)
        self._save_pending = False  # a save fell inside an accumulation window: made at the window's step

    # ----------------------------------------------------------------- one fit per folder
    def lock_folder(self) -> None:
        """Take the folder's lock in this process; ``ValueError`` naming the holder when another fit has it. The CLI
        calls this before it launches the fit (so not even its config is written), ``setup`` on global rank 0."""
        refusal = self._lock_refusal()
        if refusal:
            raise ValueError(refusal)

    def _lock_refusal(self) -> Optional[str]:
        holder = folder_lock.hold(self.dirpath).refusal if self.dirpath else None
        if holder is None:
            return None
        return (f"another fit is writing checkpoints to {self.dirpath}: {holder}. Wait for it to end, or give this fit "
                "another folder: SafeCheckpoint's dirpath in the config (--trainer.callbacks.init_args.dirpath sets "
                "the last callback's of the config's list), and the logger's --trainer.logger.init_args.save_dir")

    def check_new_fit(self, resuming: bool) -> None:
        """Refuse a new fit (``resuming`` false: no checkpoint restored) into a folder that holds an earlier fit's
        ``last.ckpt``: its first save would replace that fit's work (a rerun of a stopped fit's command without
        ``--ckpt_path last``, say). The CLI calls this before it launches the fit, ``on_train_start`` on every fit."""
        if resuming or not self.dirpath or self._enable_version_counter:
            return
        last = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        if last.exists() or restore_interrupted_swap(str(last)):
            raise ValueError(
                f"{last} is an earlier fit's checkpoint, which this new fit would replace: resume it with --ckpt_path "
                "last (or its path), start from its weights in another folder (--model.init_args.init_from), or "
                "give this fit another folder: SafeCheckpoint's dirpath in the config (--trainer.callbacks.init_args."
                "dirpath sets the last callback's of the config's list), or move that one away")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        refusal = trainer.strategy.broadcast(self._lock_refusal() if trainer.is_global_zero else None)
        if refusal:
            raise ValueError(refusal)  # on every rank alike
        if trainer.is_global_zero and self.dirpath:
            _recover_interrupted_swaps(Path(self.dirpath))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._restore_sigint()
        if stage == "fit" and trainer.is_global_zero and self.dirpath:
            folder_lock.release(self.dirpath)

    # ----------------------------------------------------------------- when to save
    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        self._install_signal_handlers()  # Lightning registered its SIGTERM handler just before: replace it

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        refusal = None
        if trainer.is_global_zero:
            try:
                self.check_new_fit(resuming=trainer.ckpt_path is not None)
            except ValueError as error:
                refusal = str(error)
        refusal = trainer.strategy.broadcast(refusal)
        if refusal:
            raise ValueError(refusal)  # on every rank alike
        self._last_save_time = time.monotonic()
        self._at_step, self._save_pending = True, False  # a fit starts, or resumes, between two optimizer steps
        self._install_signal_handlers()  # already done when a sanity check ran
        if self._validate_first:
            # The stop saved at once (a scheduler's grace period may not last a validation) and skipped the
            # validation due at its step; Lightning's restored loops would not run it (they count a checkpoint of that
            # step as validated): run it now, at the step it belongs to, as the uninterrupted fit did.
            self._validate_first = False
            _run_validation(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validation_skipped": self._validation_skipped}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._validate_first = bool(state_dict.get("validation_skipped", False))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # Lightning's saves only when nothing was saved before
        if not self._should_skip_saving_checkpoint(trainer):  # the steps since the last save
            self._at_train_end = True
            try:
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            finally:
                self._at_train_end = False
        self._restore_sigint()

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._at_train_end and _pass_unfinished(trainer):
            _epoch_in_progress(checkpoint)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        due = (self.save_every_minutes is not None
               and time.monotonic() - self._last_save_time >= 60 * self.save_every_minutes)
        due = self._agree(trainer, due)  # every rank must stop, and take part in a save, at the same batch
        self._at_step = _optimizer_stepped(trainer)
        if not self._at_step:  # inside an accumulation window: a stop or a save waits for its step
            self._save_pending = self._save_pending or due
            return
        if self._stop_signal and not self._finishing:
            self._validation_skipped = _validation_due(trainer)
            if self._validation_skipped and _fit_ends_here(trainer):
                # a resumed fit that has reached its end runs nothing, so a skipped last validation would never run
                # (its metrics and the draft calibration's fit lost): save, then let it run and the fit end
                self._finishing = True
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
                _tell(trainer, "stopping at the fit's last step: its last validation runs first")
                return
            _log_this_step(trainer)  # stopping here skips the loop's logging of the step that was trained and saved
            raise SIGTERMException  # on_exception saves last.ckpt; the same path as Lightning's SIGTERM
        if (due or self._save_pending) and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._save_pending = False

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        self._agree(trainer, False)
        if self._stop_signal and self._at_step and not self._finishing and not (
                _fit_ends_here(trainer) and not trainer.sanity_checking):  # the last validation: finished first
            # (inside a window: after the validation, at the window's step)
            self._validation_skipped = not trainer.sanity_checking
            raise SIGTERMException  # the resumed fit runs this validation first (on_train_start)

    def _agree(self, trainer: L.Trainer, due: bool) -> bool:
        """One collective that every rank reaches after the same batch (and no other anywhere for a signal): returns
        whether a save is due (rank 0's clock decides) and sets ``_stop_signal`` to the signal any rank received (the
        larger number when they differ, so that every rank exits with the same status), or leaves it None."""
        mine = torch.tensor([int(due), int(self._signal or 0)], device=trainer.strategy.root_device)
        every = trainer.strategy.all_gather(mine).reshape(-1, 2)  # row r: rank r's (one row on a single device)
        self._stop_signal = int(every[:, 1].max()) or None
        return bool(every[0, 0])

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._finishing or (self._stop_signal and not trainer.sanity_checking and _fit_ends_here(trainer)):
            self._finishing, self._validation_skipped = True, False  # the last validation ran: saved as done
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        elif not self._at_step:  # a validation inside an accumulation window: saved at the window's step
            self._save_pending = True
        elif not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        try:
            self._save_on_exception(trainer, pl_module, exception)
        finally:
            self._restore_sigint()
            if trainer.is_global_zero and self.dirpath:
                folder_lock.release(self.dirpath)

    def _save_on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, TrainingDiverged):
            return  # keep the last good checkpoint; nothing of the diverged step is saved
        super().on_exception(trainer, pl_module, exception)
        if not isinstance(exception, SIGTERMException):
            return
        signum = self._stop_signal or signal.SIGTERM  # None: Lightning's own SIGTERM path (before training started)
        exception.code = 128 + int(signum)  # the exit status of a process stopped by that signal
        name = signal.Signals(signum).name
        if trainer.state.fn != "fit" or trainer.sanity_checking or trainer.global_step == 0:
            _tell(trainer, f"{name}: stopped before any training step; nothing saved")
            return
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        _tell(trainer, f"{name}: stopped at step {trainer.global_step}; saved {self.last_model_path}. Resume with "
                       f"--ckpt_path {self.last_model_path}")

    # ----------------------------------------------------------------- SIGTERM, Ctrl-C
    def _install_signal_handlers(self) -> None:
        """SIGTERM and Ctrl-C only mark the stop, which ``_agree`` shares at the next batch end: after the current
        batch, with ``last.ckpt`` saved.

        Ours replaces Lightning's SIGTERM handler, which runs a ``broadcast`` inside the handler, wherever the rank
        happens to be, once per SIGTERM received, and forwards the signal to the other local ranks: when a scheduler
        signals every process, rank 1 gets it twice and rank 0 once, their collectives no longer pair up, and both wait
        forever.

        Lightning's handler is not put back: ours stays until Lightning's teardown restores the SIGTERM handler the fit
        started with, so that a late SIGTERM (``torchrun`` forwards one besides the scheduler's) finds no collective
        to run while the ranks save and stop."""
        if self._previous_sigint is not None or threading.current_thread() is not threading.main_thread():
            return
        self._signal = self._stop_signal = None
        self._previous_sigint = signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Mark the stop; no collective, no forwarding here (see ``_install_signal_handlers``)."""
        if self._signal is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: stop at once, keeping the last checkpoint written
                self._restore_sigint()
                raise KeyboardInterrupt
            return  # a second SIGTERM: the stop is under way
        self._signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        print(f"lightning-mtp: {name}: saving last.ckpt after this batch (or optimizer step), then stopping{again}",
              file=sys.stderr, flush=True)

    def _restore_sigint(self) -> None:
        """Ctrl-C means what it meant before the fit again (SIGTERM: see ``_install_signal_handlers``)."""
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    # ----------------------------------------------------------------- how to save
    @override
    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        partial = _hidden_sibling(filepath, "partial")
        if trainer.is_global_zero:
            _remove(partial)
        trainer.strategy.barrier("SafeCheckpoint.partial")
        trainer.save_checkpoint(partial, self.save_weights_only)  # every rank (DeepSpeed writes shards)
        if trainer.is_global_zero:
            _move_into_place(partial, filepath)
        trainer.strategy.barrier("SafeCheckpoint.replace")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        self._last_save_time = time.monotonic()
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(weakref.proxy(self))


def _hidden_sibling(path: str, kind: str) -> str:
    """``dir/last.ckpt`` -> ``dir/.last.ckpt.partial``: same folder (renames stay atomic), hidden from listings."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{kind}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _move_into_place(source: str, target: str) -> None:
    """Rename ``source`` over ``target``: one atomic rename for a file; for a folder (DeepSpeed), the old one is moved
    aside to ``.<name>.previous`` first and removed once the new one is in place."""
    if not os.path.isdir(source):
        os.replace(source, target)
        return
    previous = _hidden_sibling(target, "previous")
    _remove(previous)
    if os.path.lexists(target):
        os.replace(target, previous)
    os.replace(source, target)
    _remove(previous)


def restore_interrupted_swap(path: str) -> bool:
    """A crash between the two renames of a folder swap leaves ``.<name>.previous`` and no ``<name>``: bring
    ``path`` back from it (the CLI does this for ``--ckpt_path`` before reading it); whether it did."""
    previous = _hidden_sibling(str(path).rstrip(os.sep), "previous")
    if os.path.lexists(path) or not os.path.lexists(previous):
        return False
    os.replace(previous, path)
    return True


def _recover_interrupted_swaps(folder: Path) -> None:
    """Every interrupted swap in ``folder`` undone (:func:`restore_interrupted_swap`); half-written ``.partial``
    files are dropped."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".previous"):
            restore_interrupted_swap(str(folder / entry.name[1 : -len(".previous")]))
        elif entry.name.startswith(".") and entry.name.endswith(".partial"):
            _remove(str(entry))


def _optimizer_stepped(trainer: L.Trainer) -> bool:
    """Whether the training batch that just ended ran an optimizer step (Lightning's own test of it; ``True`` without
    accumulation): a checkpoint taken inside an accumulation window would miss the gradients accumulated so far."""
    try:
        return not trainer.fit_loop.epoch_loop._should_accumulate()
    except Exception:  # noqa: BLE001 - another Lightning's loop: every batch counts as a step
        return True


def _pass_unfinished(trainer: L.Trainer) -> bool:
    """Whether the training loader stopped part-way through its pass (``max_steps``, ``max_time`` or a stop request
    ended the fit mid-epoch) and holds its position (:class:`~lightning_mtp.data.loading.ResumableDataLoader`)."""
    from lightning_mtp.data.loading import ResumableDataLoader

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = [loader for loader in getattr(combined, "flattened", []) if isinstance(loader, ResumableDataLoader)]
    return any(0 < loader.state_dict()["batches_yielded"] < min(len(loader), trainer.num_training_batches)
               for loader in loaders)


def _epoch_in_progress(checkpoint: dict) -> None:
    """Make ``checkpoint``'s loops say the current epoch is in progress, as a checkpoint saved after that step's batch
    does: at the fit's end Lightning's loops count an epoch that ended part-way as completed, and a fit extended from
    there (a larger ``max_steps``) would start the next epoch's count while the loader resumes the pass where it
    stopped: that epoch's remaining batches counted as the next epoch, and the fit ended an epoch early."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress")
    if not progress or progress["total"]["completed"] < 1:
        return
    for counts in (progress["total"], progress["current"]):
        counts["processed"] -= 1
        counts["completed"] -= 1
    checkpoint["epoch"] = progress["current"]["completed"]


def _fit_ends_here(trainer: L.Trainer) -> bool:
    """Whether the fit ends after the current step (``max_steps`` reached, or the last batch of the last epoch)."""
    if trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step:
        return True
    epochs, loop = trainer.max_epochs, trainer.fit_loop.epoch_loop
    return (epochs is not None and 0 <= epochs <= trainer.current_epoch + 1
            and bool(getattr(loop.batch_progress, "is_last_batch", False)))


def _validation_due(trainer: L.Trainer) -> bool:
    """Whether the training loop validates after the batch that just ended (Lightning's own test of it)."""
    loop = trainer.fit_loop.epoch_loop
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    try:
        return fetcher is not None and bool(loop._should_check_val_fx(fetcher))
    except Exception:  # noqa: BLE001 - another Lightning's loop: no validation is run again on resume
        return False


def _run_validation(trainer: L.Trainer) -> None:
    """Run the fit's validation loop from scratch now, as the training loop does after a batch (Lightning's loop
    internals, as its ``on_advance_end`` sets them: checked by tests/test_safe_checkpoint.py)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.restarting = False
    val_loop.batch_progress.reset_on_run()
    trainer.validating = True
    first_loop_iter = trainer._logger_connector._first_loop_iter
    val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter
    # the restored training loop still restarts: it must take its first iteration (which clears that) and not count
    # this run as the validation of its restart, or it ends every epoch at once without clearing it
    val_loop._has_run = False


def _log_this_step(trainer: L.Trainer) -> None:
    """What the training loop does after ``on_train_batch_end`` to log a step (Lightning 2.x's logger connector), so
    that the step a signal stops at reaches TensorBoard: the resumed fit starts at the next one."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "update_train_step_metrics"):
        connector.on_batch_end()
        connector.update_train_step_metrics()
        for logger in trainer.loggers:
            logger.save()


def _tell(trainer: L.Trainer, message: str) -> None:
    if trainer.is_global_zero:
        print(f"lightning-mtp: {message}", file=sys.stderr, flush=True)
