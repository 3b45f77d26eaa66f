"""Training and validation windows of a token stream, and a train loader that resumes mid-epoch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


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
    one DDP injects) they are read and dropped. A pass that is left unfinished (``limit_train_batches``) counts as done
    when the next one starts, except across a resume from a checkpoint saved right at that point.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch = 0  # the pass being (or about to be) iterated
        self._yielded = 0  # batches of that pass handed out so far
        self._resuming = False

    def __iter__(self):
        # A generator: the state is read when the first batch is requested, so a load_state_dict after iter() (as
        # Lightning may call them) still applies.
        if self._resuming:
            self._resuming = False
            if self._yielded >= len(self):
                self._epoch, self._yielded = self._epoch + 1, 0
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
        for batch in batches:
            self._yielded += 1
            yield batch
        self._epoch, self._yielded = self._epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches_yielded": self._yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._epoch = int(state_dict.get("epoch", 0))
        self._yielded = int(state_dict.get("batches_yielded", 0))
        self._resuming = True
