"""Teacher-forced evaluation of every MTP depth, shared by the coupling monitor and the draft calibration.

Depth k at position i drafts t(i+k+1); the main model verifies it with its own prediction at position i+k. Both are
computed on the real tokens (teacher forcing), under ``no_grad``, for every configured depth (inference drafts with
all of them, whatever the active depth of training is).

On a validation batch, the callbacks built on :class:`TeacherForcedCallback` read the forward that ``validation_step``
computed for the loss (``MTPMixin.mtp_validation_forward``): the trunk and every depth run once per batch, however
many of these callbacks there are. The argmax of every position and depth, which the acceptance statistics need
everywhere, is the one the loss's fused cross-entropy computed anyway (:func:`teacher_forced_argmax`; depths the loss
does not score yet get the same cross-entropy's forward alone). Statistics that need whole distributions (softmaxes,
the calibration's temperature grid) read a fixed-size subsample of positions per batch (``max_positions``), and each
callback calls the heads on those rows only (:func:`probed_logits`): no full-vocabulary logits over whole sequences.

Only positions whose tokens are all scored count (:func:`scored_positions`): labels ``ignore_index`` and, in a packed
batch (``MTPForward.position_ids``), tokens of another document are left out, as in the loss.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_mtp.callbacks._base import MTPCallback
from lightning_mtp.head_calls import chunk_rows, depth_head, head_logits, row_chunks
from lightning_mtp.loss import DepthLossSpec, same_document, score_jointly
from lightning_mtp.mixin import MTPForward, MTPMixin, batch_position_ids, unpack_batch


class TeacherForcedCallback(MTPCallback):
    """Base of the callbacks that evaluate every depth on teacher-forced validation batches.

    A subclass implements :meth:`read_forward` and calls :meth:`read_validation_batch` from
    ``on_validation_batch_end``. Before a batch it wants (:meth:`wants_batch`), it asks the module to keep that batch's
    forward (every depth's states), which ``validation_step`` then fills; the argmaxes of every position
    (:func:`teacher_forced_argmax`) are cached on that forward, so every reader shares them too.
    """

    share_forward: bool = True
    """``False`` (on an instance): re-run the trunk, every depth and the argmax pass for this callback alone, as
    before the forward was shared; for the tests and the benchmark that compare both. The re-run happens in the hook,
    outside the step's autocast: with mixed precision its metrics differ from the shared ones at bf16/fp16 rounding."""
    chunk_size: Optional[int] = None
    """Rows of probed logits per depth alive at once (``None``: the MTP loss's chunk size)."""

    def wants_batch(self, trainer: L.Trainer) -> bool:
        """Whether the next validation batch will be read (never during the sanity check)."""
        return not trainer.sanity_checking

    def read_forward(self, pl_module: MTPMixin, fwd: MTPForward) -> None:
        """Read one teacher-forced batch (every configured depth's states in ``fwd``)."""
        raise NotImplementedError

    @override
    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.share_forward and self.wants_batch(trainer):
            pl_module.mtp_validation_forward(batch)  # validation_step keeps every depth of this batch

    def read_validation_batch(self, pl_module: MTPMixin, batch: Any) -> None:
        """Read this batch from the forward ``validation_step`` kept (computed here once, for every reader, when the
        host has its own ``validation_step``), or from a re-run of its own without ``share_forward``."""
        if not self.share_forward:
            self.read_forward(pl_module, batch_forward(pl_module, batch))
            return
        record = pl_module.mtp_validation_forward(batch)
        if record.forward is None:  # a host with its own validation_step: computed once here, for every reader
            record.forward = batch_forward(pl_module, batch)
        self.read_forward(pl_module, record.forward)


def teacher_forced_argmax(module: MTPMixin, fwd: MTPForward) -> list[Tensor]:
    """Per depth k = 0..D (0: the main head): (B, T-k-1) argmax of every position's (transformed) logits.

    Those the validation loss computed (``fwd.argmax``, the fused cross-entropy's row argmax) are reused; the missing
    ones (depths the loss does not score yet, or a forward computed outside ``validation_step``) come from the same
    cross-entropy's forward alone, each depth a part of its own chunked by its own rows as in the loss, so both agree
    to the bit. They are cached on ``fwd`` for the other readers.
    """
    cfg = module.mtp_config
    states = [fwd.main_hidden, *fwd.depth_hidden]  # (B, T-k-1, H) each
    missing = [k for k in range(len(states)) if k not in fwd.argmax]
    if missing:
        specs = [DepthLossSpec(module.mtp_depth_head_weight(k), fwd.targets(k, states[k].shape[1], cfg.ignore_index),
                               1.0, cfg.ignore_index, cfg.loss_chunk_size, module.mtp_depth_head(k)) for k in missing]
        with torch.no_grad():
            parts = score_jointly(specs, [states[k] for k in missing], module.mtp_logit_transform())
        for k, part in zip(missing, parts):
            fwd.argmax[k] = part.row_argmax.view(states[k].shape[:2])
    return [fwd.argmax[k] for k in range(len(states))]


def teacher_forced_forward(
    module: MTPMixin, input_ids: Tensor, labels: Optional[Tensor] = None, position_ids: Optional[Tensor] = None
) -> MTPForward:
    """Every configured depth's hidden states, and ``main_hidden``, under ``no_grad``; ``position_ids`` (B, T) for a
    packed batch (documents kept apart)."""
    with torch.no_grad():
        active = module.mtp_active_depth
        module.mtp_active_depth = module.mtp_config.depth
        try:
            hidden = module.mtp_run_trunk(input_ids, position_ids)  # (B, T, H)
            fwd = module.mtp_forward(hidden, input_ids, labels, position_ids)
        finally:
            module.mtp_active_depth = active
        fwd.main_hidden = module.mtp_final_norm()(hidden[:, :-1])  # (B, T-1, H)
    return fwd


def batch_forward(module: MTPMixin, batch: Any) -> MTPForward:
    input_ids, labels = unpack_batch(batch, module.mtp_config.ignore_index)
    return teacher_forced_forward(module, input_ids, labels, batch_position_ids(batch))


def sequence_logits(
    module: MTPMixin, fwd: MTPForward, chunk_size: Optional[int] = None
) -> Iterator[tuple[slice, Tensor, list[Tensor]]]:
    """Per chunk of sequences: (the sequences, main logits (b, T-1, V), [depth k logits (b, T-k-1, V)]), fp32.

    Every position's logits, as the heads and the host's transform give them (for tests and analysis; the callbacks
    read :func:`teacher_forced_argmax` and :func:`probed_logits` instead). Whole sequences go together so that depth k
    at i meets the main model at i+k; about ``chunk_size`` rows of logits per depth are alive at once.
    """
    heads = [head_logits(module, depth_head(module, k)) for k in range(len(fwd.depth_hidden) + 1)]
    with torch.no_grad():
        for part in row_chunks(fwd.input_ids.shape[0], sequences_per_chunk(module, fwd, chunk_size)):
            main = heads[0](fwd.main_hidden[part])  # (b, T-1, V)
            depths = [heads[k](h[part]) for k, h in enumerate(fwd.depth_hidden, start=1)]  # (b, T-k-1, V) each
            yield part, main, depths


def probed_logits(
    module: MTPMixin, fwd: MTPForward, depth: int, part: slice, columns: slice, offset: int = 0
) -> Tensor:
    """Depth ``depth``'s logits (0: the main head) at positions ``offset`` + ``columns`` of sequences ``part``:
    (b, n, V) fp32, the head called on those rows of the states only."""
    states = fwd.main_hidden if depth == 0 else fwd.depth_hidden[depth - 1]  # (B, T-k-1, H)
    length = states.shape[1] - offset
    rows = states[part, offset : offset + length][:, columns]  # (b, n, H)
    with torch.no_grad():
        return head_logits(module, depth_head(module, depth))(rows)


def sequences_per_chunk(
    module: MTPMixin, fwd: MTPForward, chunk_size: Optional[int] = None, rows_per_sequence: Optional[int] = None
) -> int:
    """Whole sequences per chunk: about ``chunk_size`` rows of logits (each sequence has ``rows_per_sequence``,
    default its length), at least one sequence."""
    batch, length = fwd.input_ids.shape
    per_sequence = max(1, length if rows_per_sequence is None else rows_per_sequence)
    return max(1, chunk_rows(module, batch * length, chunk_size) // per_sequence)


def probed_columns(batch: int, length: int, max_positions: Optional[int], index: int) -> slice:
    """Positions along every sequence of a fixed-size subsample of a (``batch``, ``length``) batch: every s-th one,
    s = ⌈batch·length / max_positions⌉ (at most about ``max_positions`` in all), from an offset that rotates with
    ``index`` (the batch's number in the epoch) so that successive batches probe other positions; all of them when
    ``max_positions`` is ``None`` or not below batch·length."""
    if max_positions is None or batch * length <= max_positions:
        return slice(0, None)
    stride = -(-batch * length // max_positions)
    return slice(index % stride, None, stride)


def scored_positions(
    labels: Tensor, depth: int, length: int, ignore_index: int, position_ids: Optional[Tensor] = None
) -> Tensor:
    """(B, length) bool: the tokens t(i+1)..t(i+depth+1) drafted or verified at position i are all scored, and with
    ``position_ids`` (B, T) of a packed batch all lie in i's document (:func:`~lightning_mtp.loss.same_document`)."""
    scored = labels[:, 1:] != ignore_index  # (B, T-1): target of main position j is t(j+1)
    valid = scored[:, :length].clone()
    for offset in range(1, depth + 1):
        valid &= scored[:, offset : offset + length]
    if position_ids is not None:
        valid &= same_document(position_ids, depth, length)  # documents are contiguous: the tokens between too
    return valid
