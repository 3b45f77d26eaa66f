"""Tokenized records laid out as training rows, as ``transformers`` lays them out: **packed** (:func:`pack`,
:class:`PackedRows`: documents concatenated into rows of ``seq_len`` tokens with ``position_ids`` restarting at each
document) or **padded** (:class:`RecordRows`, :class:`PadCollator`: one record per row, cut at ``seq_len``,
right-padded in the batch with an ``attention_mask``). :mod:`~lightning_mtp.data.records` reads and tokenizes them.

Example::

    >>> import torch
    >>> PadCollator(pad_id=0)([{"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([5, 6])}])["input_ids"]
    tensor([[5, 6]])
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_mtp.data.atomic import atomic_write, private_folder, publish_folder

IGNORE_INDEX = -100


def pack(records: Any, seq_len: int, folder: Path) -> Path:
    """Concatenate the records' documents into rows of ``seq_len`` (``ids.npy``, ``labels.npy``,
    ``positions.npy``: (rows, seq_len) each, memory-mapped), positions restarting at each document and each row;
    the tail that does not fill a row is dropped. Returns ``folder``.

    The arrays are written into a folder private to this process and renamed to ``folder`` when complete, so runs
    sharing a cache never write into one another's files (the first to finish is kept)."""
    if _packed(folder):
        return folder
    total = int(sum(records["length"]))
    rows = total // seq_len
    if rows == 0:
        raise ValueError(f"--data.seq_len: the records hold {total} tokens, fewer than one row of --data.seq_len="
                         f"{seq_len}: use more data or a smaller --data.seq_len")
    tmp = private_folder(folder)
    try:
        arrays = {name: np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", dtype=np.int64,
                                                  shape=(rows * seq_len,)) for name in ("ids", "labels", "positions")}
        at = 0
        for ids, labels in _documents(records):
            take = min(len(ids), rows * seq_len - at)
            if take <= 0:
                break
            arrays["ids"][at : at + take] = ids[:take]
            arrays["labels"][at : at + take] = labels[:take]
            offsets = np.arange(at, at + take)
            starts = np.maximum(at, offsets - offsets % seq_len)  # restart at the document's start or the row's
            arrays["positions"][at : at + take] = offsets - starts
            at += take
        for name in list(arrays):
            arrays.pop(name).flush()  # and closed: the last reference goes
        atomic_write(tmp / "packed.json", lambda fh: fh.write(json.dumps({"rows": rows, "seq_len": seq_len}).encode()))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_folder(tmp, folder, _packed)
    return folder


def _packed(folder: Path) -> bool:
    return (folder / "packed.json").is_file()


def _documents(records: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for batch in records.iter(batch_size=1024):
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            yield np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)


def warn_cut_records(records: Any, seq_len: int) -> None:
    """Say how many records one row cannot hold (they are cut at ``seq_len``), and how many of those lose every
    trained token (a chat whose answer starts after ``seq_len``)."""
    lengths = np.asarray(records["length"])
    cut = np.flatnonzero(lengths > seq_len)
    if cut.size == 0:
        return
    lost = sum(1 for labels in records.select(cut.tolist())["labels"]
               if all(label == IGNORE_INDEX for label in labels[:seq_len]))
    if lost == len(lengths):
        raise ValueError(f"--data.seq_len: every training record is longer than --data.seq_len={seq_len} and loses "
                         f"every trained token when cut there (the longest has {int(lengths.max())} tokens): raise "
                         "--data.seq_len, or pack them (--data.packing true)")
    from lightning.pytorch.utilities import rank_zero_warn

    rank_zero_warn(f"--data.seq_len: {cut.size} of {len(lengths)} training records are longer than "
                   f"--data.seq_len={seq_len} and are cut there ({lost} of them lose every trained token); the "
                   f"longest has {int(lengths.max())} tokens: raise --data.seq_len, or pack them "
                   "(--data.packing true) to keep every token")


class PackedRows(Dataset):
    """Rows of packed documents: ``{"input_ids", "labels", "position_ids"}``, each ``LongTensor[seq_len]``."""

    def __init__(self, folder: Path, seq_len: int) -> None:
        self.seq_len = seq_len
        self.ids, self.labels, self.positions = (np.load(folder / f"{n}.npy", mmap_mode="r")
                                                 for n in ("ids", "labels", "positions"))

    def __len__(self) -> int:
        return len(self.ids) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        span = slice(index * self.seq_len, (index + 1) * self.seq_len)
        return {"input_ids": torch.from_numpy(np.array(self.ids[span])),
                "labels": torch.from_numpy(np.array(self.labels[span])),
                "position_ids": torch.from_numpy(np.array(self.positions[span]))}


class RecordRows(Dataset):
    """One record per row, cut at ``seq_len``: ``{"input_ids", "labels"}`` of its own length (padded in batches by
    :class:`PadCollator`)."""

    def __init__(self, records: Any, seq_len: int) -> None:
        self.records, self.seq_len = records.with_format("numpy", columns=["input_ids", "labels"]), seq_len

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.records[int(index)]
        return {"input_ids": torch.as_tensor(row["input_ids"][: self.seq_len], dtype=torch.long),
                "labels": torch.as_tensor(row["labels"][: self.seq_len], dtype=torch.long)}


class PadCollator:
    """Right-pads rows to the batch's longest: ``input_ids`` with ``pad_id``, ``labels`` with -100, and an
    ``attention_mask`` of 1 on real tokens.

    Example::

        >>> batch = PadCollator(pad_id=0)([{"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([5, 6])},
        ...                                {"input_ids": torch.tensor([7]), "labels": torch.tensor([-100])}])
        >>> batch["input_ids"].tolist(), batch["labels"].tolist(), batch["attention_mask"].tolist()
        ([[5, 6], [7, 0]], [[5, 6], [-100, -100]], [[1, 1], [1, 0]])
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)
        batch = {"input_ids": torch.full((len(rows), width), self.pad_id, dtype=torch.long),  # (B, T)
                 "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
                 "attention_mask": torch.zeros(len(rows), width, dtype=torch.long)}
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][i, :n] = row["input_ids"]
            batch["labels"][i, :n] = row["labels"]
            batch["attention_mask"][i, :n] = 1
        return batch
