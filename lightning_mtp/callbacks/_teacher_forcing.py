"""Teacher-forced evaluation of every MTP depth, shared by the coupling monitor and the draft calibration.

Depth k at position i drafts t(i+k+1); the main model verifies it with its own prediction at position i+k. Both are
computed on the real tokens (teacher forcing), under ``no_grad``, for every configured depth (inference drafts with
all of them, whatever the active depth of training is).

On a validation batch, the callbacks built on :class:`TeacherForcedCallback` read the forward that ``validation_step``
computed for the loss (``MTPMixin.mtp_validation_forward``), and one pass over the heads' logits feeds all of them:
the trunk, every depth and every head run once per batch, however many of these callbacks there are.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_mtp.callbacks._base import MTPCallback
from lightning_mtp.head_calls import chunk_rows, depth_head, head_logits, row_chunks
from lightning_mtp.mixin import MTPForward, MTPMixin, unpack_batch

_WAITING = "teacher_forced_readers"  # ValidationForward.derived: readers that asked for the batch, not yet fed
_FED = "teacher_forced_fed"  # ... and those already fed


class TeacherForcedCallback(MTPCallback):
    """Base of the callbacks that evaluate every depth on teacher-forced validation batches.

    A subclass reads a batch in three steps, :meth:`begin_batch`, :meth:`read_logits` for each chunk of sequences and
    :meth:`end_batch`, and calls :meth:`read_validation_batch` from ``on_validation_batch_end``. Before a batch it
    wants (:meth:`wants_batch`), it asks the module to keep that batch's forward; the first of these callbacks to
    reach ``on_validation_batch_end`` then feeds every one that asked, and chunks its logits the same way, in one pass
    over the heads' logits. The logits handed to :meth:`read_logits` are shared: read them, never modify them.
    """

    share_forward: bool = True
    """``False`` (on an instance): re-run the trunk, every depth and the heads for this callback alone, as before
    the forward was shared; for the tests and the benchmark that compare both. The re-run happens in the hook, outside
    the step's autocast: with mixed precision its metrics differ from the shared ones at bf16/fp16 rounding."""
    chunk_size: Optional[int] = None
    """Rows of logits per depth alive at once (``None``: the MTP loss's chunk size)."""

    def wants_batch(self, trainer: L.Trainer) -> bool:
        """Whether the next validation batch will be read (never during the sanity check)."""
        return not trainer.sanity_checking

    def begin_batch(self, pl_module: MTPMixin, fwd: MTPForward) -> None:
        """Before the batch's first chunk of logits."""

    def read_logits(
        self, pl_module: MTPMixin, fwd: MTPForward, part: slice, main: Tensor, depths: list[Tensor]
    ) -> None:
        """One chunk of sequences ``part``: main logits (b, T-1, V) and depth k's (b, T-k-1, V), fp32."""
        raise NotImplementedError

    def end_batch(self, pl_module: MTPMixin, fwd: MTPForward) -> None:
        """After the batch's last chunk of logits."""

    @override
    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.share_forward and self.wants_batch(trainer):
            # validation_step keeps every depth of this batch; the first reader feeds the others
            pl_module.mtp_validation_forward(batch).derived.setdefault(_WAITING, []).append(self)

    def read_validation_batch(self, pl_module: MTPMixin, batch: Any) -> None:
        """Feed this batch to this callback (begin, every chunk, end), unless another reader already did; readers
        waiting for the same batch with the same chunking are fed by the same pass."""
        if not self.share_forward:
            read_teacher_forced(pl_module, batch_forward(pl_module, batch), [self], self.chunk_size)
            return
        record = pl_module.mtp_validation_forward(batch)
        fed = record.derived.setdefault(_FED, [])
        if any(reader is self for reader in fed):
            return
        if record.forward is None:  # a host with its own validation_step: computed once here, for every reader
            record.forward = batch_forward(pl_module, batch)
        waiting = record.derived.setdefault(_WAITING, [])
        if not any(reader is self for reader in waiting):
            waiting.append(self)
        sequences = sequences_per_chunk(pl_module, record.forward, self.chunk_size)
        group = [r for r in waiting if sequences_per_chunk(pl_module, record.forward, r.chunk_size) == sequences]
        read_teacher_forced(pl_module, record.forward, group, self.chunk_size)
        record.derived[_WAITING] = [r for r in waiting if not any(r is g for g in group)]
        fed.extend(group)


def read_teacher_forced(
    module: MTPMixin, fwd: MTPForward, readers: Sequence[TeacherForcedCallback], chunk_size: Optional[int] = None
) -> None:
    """One pass over the logits of ``fwd``, chunked by ``chunk_size``, fed to every reader."""
    for reader in readers:
        reader.begin_batch(module, fwd)
    for part, main, depths in sequence_logits(module, fwd, chunk_size):
        for reader in readers:
            reader.read_logits(module, fwd, part, main, depths)
    for reader in readers:
        reader.end_batch(module, fwd)


def teacher_forced_forward(module: MTPMixin, input_ids: Tensor, labels: Optional[Tensor] = None) -> MTPForward:
    """Every configured depth's hidden states, and ``main_hidden``, under ``no_grad``."""
    with torch.no_grad():
        active = module.mtp_active_depth
        module.mtp_active_depth = module.mtp_config.depth
        try:
            hidden = module.mtp_trunk_hidden_states(input_ids)  # (B, T, H)
            fwd = module.mtp_forward(hidden, input_ids, labels)
        finally:
            module.mtp_active_depth = active
        fwd.main_hidden = module.mtp_final_norm()(hidden[:, :-1])  # (B, T-1, H)
    return fwd


def batch_forward(module: MTPMixin, batch: Any) -> MTPForward:
    input_ids, labels = unpack_batch(batch, module.mtp_config.ignore_index)
    return teacher_forced_forward(module, input_ids, labels)


def sequence_logits(
    module: MTPMixin, fwd: MTPForward, chunk_size: Optional[int] = None
) -> Iterator[tuple[slice, Tensor, list[Tensor]]]:
    """Per chunk of sequences: (the sequences, main logits (b, T-1, V), [depth k logits (b, T-k-1, V)]), fp32.

    Whole sequences go together so that depth k at i meets the main model at i+k; about ``chunk_size`` rows of
    logits per depth are alive at once (at least one sequence).
    """
    heads = [head_logits(module, depth_head(module, k)) for k in range(len(fwd.depth_hidden) + 1)]
    with torch.no_grad():
        for part in row_chunks(fwd.input_ids.shape[0], sequences_per_chunk(module, fwd, chunk_size)):
            main = heads[0](fwd.main_hidden[part])  # (b, T-1, V)
            depths = [heads[k](h[part]) for k, h in enumerate(fwd.depth_hidden, start=1)]  # (b, T-k-1, V) each
            yield part, main, depths


def sequences_per_chunk(module: MTPMixin, fwd: MTPForward, chunk_size: Optional[int] = None) -> int:
    """Whole sequences per chunk of :func:`sequence_logits`: about ``chunk_size`` rows, at least one sequence."""
    batch, length = fwd.input_ids.shape
    return max(1, chunk_rows(module, batch * length, chunk_size) // length)


def probed_columns(batch: int, length: int, max_positions: Optional[int], index: int) -> slice:
    """Positions along every sequence of a fixed-size subsample of a (``batch``, ``length``) batch: every s-th one,
    s = ⌈batch·length / max_positions⌉ (at most about ``max_positions`` in all), from an offset that rotates with
    ``index`` (the batch's number in the epoch) so that successive batches probe other positions; all of them when
    ``max_positions`` is ``None`` or not below batch·length."""
    if max_positions is None or batch * length <= max_positions:
        return slice(0, None)
    stride = -(-batch * length // max_positions)
    return slice(index % stride, None, stride)


def scored_positions(labels: Tensor, depth: int, length: int, ignore_index: int) -> Tensor:
    """(B, length) bool: the tokens t(i+1)..t(i+depth+1) drafted or verified at position i are all scored."""
    scored = labels[:, 1:] != ignore_index  # (B, T-1): target of main position j is t(j+1)
    valid = scored[:, :length].clone()
    for offset in range(1, depth + 1):
        valid &= scored[:, offset : offset + length]
    return valid
