"""Training and validation windows of a token stream, and a train loader that resumes mid-epoch."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from lightning_mtp.data.record_rows import IGNORE_INDEX


class TokenWindowDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` ids over a 1-D id array; a trailing partial window is dropped.

    Example::

        >>> ds = TokenWindowDataset(np.arange(10, dtype=np.uint16), seq_len=4)
        >>> len(ds), ds[1]["input_ids"].tolist()
        (2, [4, 5, 6, 7])
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        index %= len(self)
        window = self.tokens[index * self.seq_len : (index + 1) * self.seq_len]
        return {"input_ids": torch.from_numpy(np.asarray(window, dtype=np.int64))}  # [seq_len]


class EpochShuffleSampler(Sampler[int]):
    """A seeded permutation per pass (``numpy`` seed sequence ``[seed, epoch]``), optionally starting part-way.

    ``ResumableDataLoader`` sets ``epoch`` and ``start`` before each pass, so a resumed pass skips the windows already
    trained on without reading them.

    Example::

        >>> sampler = EpochShuffleSampler(6, seed=0)
        >>> full = list(sampler)
        >>> sampler.start = 4
        >>> list(sampler) == full[4:] and sorted(full) == list(range(6))
        True
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.epoch = 0
        self.start = 0  # samples of this pass to skip

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        return iter(order[self.start :].tolist())


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that can resume a pass part-way: ``state_dict()`` holds the pass (epoch) and the batches
    already yielded in it.

    Lightning saves the ``state_dict`` of stateful training loaders in the checkpoint and, on resume, calls
    ``load_state_dict`` before iterating: the resumed pass then yields exactly the batches the interrupted run had not
    reached. With an :class:`EpochShuffleSampler` the skipped windows are never read; with any other sampler (e.g. the
    one DDP injects) they are read and dropped. ``limit_batches`` is the trainer's ``limit_train_batches`` (an int:
    batches, a float: a fraction of the pass, as Lightning reads it): a pass that reached it is over, also across a
    resume from a checkpoint saved right there, and any other pass left unfinished counts as done when the next one
    starts.

    **Accumulation windows**: with ``accumulate`` > 1 (the trainer's ``accumulate_grad_batches``) the batches of a
    pass are read a window of ``accumulate`` ahead (batches ``w * accumulate`` to ``(w + 1) * accumulate - 1``, as
    Lightning groups them into optimizer steps), so that the step of a batch can ask for all the batches its gradient
    is accumulated with (:meth:`accumulation_window`): each token of the window then weighs the same, however many
    scored tokens each batch holds.
    """

    def __init__(self, *args: Any, accumulate: int = 1, limit_batches: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accumulate = max(int(accumulate), 1)
        self.limit_batches = limit_batches
        self._epoch = 0  # the pass being (or about to be) iterated
        self._yielded = 0  # batches of that pass handed out so far
        self._resuming = False
        self._saved_pass = 0  # batches of the pass a restored state was saved in (load_state_dict)
        self._saved_layout: dict[str, int] = {}  # and how its rows were dealt out
        self._windows: dict[int, tuple[int, list]] = {}  # window -> (its first batch's number, its batches)

    def __iter__(self):
        # A generator: the state is read when the first batch is requested, so a load_state_dict after iter() (as
        # Lightning may call them) still applies.
        if self._resuming:
            self._resuming = False
            if self._yielded >= self._saved_pass:  # the saved pass had ended
                self._check_pass_not_longer()
                self._epoch, self._yielded = self._epoch + 1, 0
            elif self._yielded:
                self._check_same_layout()
        elif self._yielded:  # the previous pass was left unfinished
            self._epoch, self._yielded = self._epoch + 1, 0
        skip = self._yielded
        if isinstance(self.sampler, EpochShuffleSampler):
            self.sampler.epoch, self.sampler.start = self._epoch, skip * self.batch_size
            batches = super().__iter__()
        else:
            batches = super().__iter__()
            for _ in range(skip):
                next(batches, None)
        self._windows = {}
        for batch in self._read_windows(batches, skip):
            self._yielded += 1
            yield batch
        self._epoch, self._yielded = self._epoch + 1, 0

    def _read_windows(self, batches, start: int):
        """``batches`` from the pass's batch ``start`` on, each window read whole before its first is handed out."""
        if self.accumulate == 1:
            yield from batches
            return
        ordinal = start
        while True:
            window = ordinal // self.accumulate
            read = list(itertools.islice(batches, (window + 1) * self.accumulate - ordinal))
            if not read:
                return
            self._windows[window] = (ordinal, read)
            for old in [w for w in self._windows if w < window - 2]:  # a prefetching loop is a batch ahead
                del self._windows[old]
            yield from read
            ordinal += len(read)

    def accumulation_window(self, batch_index: int, limit: Optional[int] = None) -> Optional[list]:
        """The batches (as collated, before any device transfer) of the window that the pass's batch
        ``batch_index`` belongs to, those before the pass's batch ``limit`` only (the trainer's
        ``limit_train_batches`` ends a pass early); ``None`` when it is not held (``accumulate`` is 1, or the window
        has passed)."""
        held = self._windows.get(batch_index // self.accumulate) if self.accumulate > 1 else None
        if held is None:
            return None
        first, batches = held
        return batches if limit is None else batches[: max(limit - first, 0)]

    def pass_length(self) -> int:
        """The batches a pass yields: all, or the first ``limit_batches`` (Lightning's reading of the limit)."""
        length, limit = len(self), self.limit_batches
        if limit is None or isinstance(limit, bool):
            return length
        if isinstance(limit, int):
            return min(length, limit)
        return int(length * limit)

    def state_dict(self) -> dict[str, int]:
        if self._resuming:  # restored and not iterated yet (a validation that runs first may save): as restored
            return {"epoch": self._epoch, "batches_yielded": self._yielded, "pass_batches": self._saved_pass,
                    **self._layout(), **self._saved_layout}
        return {"epoch": self._epoch, "batches_yielded": self._yielded, "pass_batches": self.pass_length(),
                **self._layout()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._epoch = int(state_dict.get("epoch", 0))
        self._yielded = int(state_dict.get("batches_yielded", 0))
        self._saved_layout = {key: int(state_dict[key]) for key in self._layout() if key in state_dict}
        # the batches the saved pass had (its batch size, processes and limit); a pass that had ended resumes at the
        # next, whatever it holds now
        self._saved_pass = int(state_dict.get("pass_batches", self.pass_length()))
        self._resuming = True

    def _layout(self) -> dict[str, int]:
        """How a pass's rows are dealt out: the processes sharing it (a distributed sampler's replicas) and the batch
        size. (A corpus that changed is warned by the data module, not refused: records may be appended.)"""
        return {"processes": int(getattr(self.sampler, "num_replicas", 1)), "batch_size": int(self.batch_size or 1)}

    def _check_pass_not_longer(self) -> None:
        """A pass that had ended after ``_yielded`` batches, resumed where a pass holds more (fewer processes, a
        smaller batch or a larger ``limit_train_batches``): Lightning's restored loop continues that epoch from its
        batch ``_yielded`` with the next pass's batches, and that pass's others are never trained. Refused."""
        now = self.pass_length()
        if self._yielded < now:
            saved, layout = self._saved_layout, self._layout()
            what = ", ".join(f"{key} {saved[key]} -> {layout[key]}" for key in saved if saved[key] != layout[key])
            raise ValueError(
                f"--ckpt_path: the checkpoint was saved at the end of an epoch of {self._yielded} batches, and an "
                f"epoch holds {now} now ({what or 'limit_train_batches'}): the resumed fit would continue that epoch "
                f"with {now - self._yielded} batches of the next and never train the next's others. Resume with the "
                "processes (--trainer.devices), batch size (--data.batch_size) and limit_train_batches it was saved "
                "with, or start a new fit from its weights (--model.init_args.init_from)")

    def _check_same_layout(self) -> None:
        """A pass resumed part-way skips the batches it had yielded: only with the rows dealt out as before does that
        land where the interrupted pass stopped (else rows are trained twice and others skipped)."""
        saved, now = self._saved_layout, self._layout()
        changed = [key for key in saved if saved[key] != now[key]]
        if not changed:
            return
        flags = {"processes": "--trainer.devices / --trainer.num_nodes", "batch_size": "--data.batch_size"}
        what = ", ".join(f"{key} {saved[key]} -> {now[key]} ({flags[key]})" for key in changed)
        raise ValueError(
            f"--ckpt_path: the checkpoint was saved {self._yielded} batches into an epoch, and the rows of that epoch "
            f"are dealt out differently now ({what}): skipping {self._yielded} batches would train some rows twice "
            "and others never. Resume with the settings it was saved with, or start a new fit from its weights "
            "(--model.init_args.init_from)")


class UnscoredPadding(Dataset):
    """``rows`` with every row carrying ``labels`` (``input_ids`` where it has none), and indices past the end
    (:class:`PaddingMarkedSampler`'s padding) giving row 0 with nothing scored (every label ``ignore_index``).

    Example::

        >>> rows = UnscoredPadding(TokenWindowDataset(np.arange(8, dtype=np.uint16), seq_len=4))
        >>> rows[1]["labels"].tolist(), rows[2]["labels"].tolist()
        ([4, 5, 6, 7], [-100, -100, -100, -100])
    """

    def __init__(self, rows: Dataset, ignore_index: int = IGNORE_INDEX) -> None:
        self.rows, self.ignore_index = rows, ignore_index

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        padding = index >= len(self.rows)
        row = dict(self.rows[0 if padding else index])
        labels = row.get("labels", row["input_ids"])
        row["labels"] = torch.full_like(labels, self.ignore_index) if padding else torch.as_tensor(labels).clone()
        return row


class PaddingMarkedSampler(DistributedSampler):
    """``DistributedSampler`` in order, whose padding (the rows that make every process's share equal) are indices
    past the dataset's end, which :class:`UnscoredPadding` scores as nothing: a validation's token-weighted means
    count every row once, where the stock sampler repeats the first rows (they were counted twice under DDP)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self):
        return iter(range(self.rank, self.total_size, self.num_replicas))
