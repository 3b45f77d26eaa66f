"""``MTPCouplingMonitor``: what the MTP heads will do at inference, measured on validation data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryCalibrationError
from typing_extensions import override

from lightning_mtp.callbacks._base import check_int, require_mtp_module
from lightning_mtp.callbacks._teacher_forcing import (
    TeacherForcedCallback,
    probed_columns,
    probed_logits,
    scored_positions,
    sequences_per_chunk,
    teacher_forced_argmax,
    teacher_forced_forward,
)
from lightning_mtp.head_calls import row_chunks
from lightning_mtp.mixin import MTPForward, MTPMixin


@dataclass
class AcceptanceStats:
    """Per-position teacher-forced outcomes of one batch. Lists run over depths k = 1..D (pairs k = 1..D-1)."""

    accept: list[Tensor]
    """(B, T-k-1) bool: depth k's argmax at i equals the main model's argmax at i+k."""
    chained: list[Tensor]
    """(B, T-k-1) bool: depths 1..k all matched at i (the k-th draft of a step starting at i is accepted)."""
    valid: list[Tensor]
    """(B, T-k-1) bool: every token drafted or verified (t(i+1)..t(i+k+1)) is scored."""
    coupling: list[Tensor]
    """(B, T-k-2) bool: depth k's argmax equals depth k+1's at the same position."""
    js: list[Tensor]
    """(B, T-k-2) Jensen-Shannon divergence (nats) between depths k and k+1 at the same position (where probed)."""
    confidence: list[Tensor]
    """(B, T-k-1) top probability of depth k's draft distribution softmax(logits / T_k) (where probed)."""
    correct: list[Tensor]
    """(B, T-k-1) bool: depth k's argmax equals the real token t(i+k+1)."""
    probed: list[Tensor] = field(default_factory=list)
    """(B, T-k-1) bool: the positions where ``js`` and ``confidence`` were computed (empty: all of them)."""

    def tau(self, draft_length: int) -> tuple[Tensor, Tensor]:
        """Tokens per main-model forward for ``draft_length`` drafts, per position, counting the bonus token:
        1 + Σ_{j ≤ n} chained_j, and the mask of positions where it is defined."""
        return 1.0 + self.leading_matches(draft_length).float(), self.valid[draft_length - 1]

    def leading_matches(self, draft_length: int) -> Tensor:
        """(B, T-n-1) long: how many of the ``draft_length`` drafts of a step starting at i are accepted."""
        length = self.accept[draft_length - 1].shape[1]
        return sum(self.chained[j][:, :length].long() for j in range(draft_length))

    def tau_walk(self, draft_length: int) -> tuple[Tensor, Tensor]:
        """(tokens, steps) summed over greedy decoding walks on these tokens, one walk from every scored position.

        A step starting at i emits 1 + its leading matched drafts and the next step starts right after them, as in
        decoding. Steps start at a biased sample of positions (after long accepts, a position is skipped), so when
        acceptance is correlated along the sequence, tokens / steps is what decoding measures and the per-position
        mean of :meth:`tau` is not; with independent positions both agree.
        """
        emitted = 1 + self.leading_matches(draft_length)  # (B, L)
        valid = self.valid[draft_length - 1]
        batch, length = emitted.shape
        # The walk from i visits i, after(i), after(after(i)), ... while positions are scored. Position L ends every
        # walk: it emits nothing and leads to itself. Pointer jumping: after r rounds each position holds the sums
        # of the first 2^r steps of its walk, and a walk has at most L steps.
        # https://en.wikipedia.org/wiki/Pointer_jumping
        start = torch.arange(length, device=emitted.device)
        end = torch.full((batch, 1), length, dtype=torch.long, device=emitted.device)
        after = torch.cat([torch.where(valid, (start + emitted).clamp(max=length), end), end], 1)  # (B, L+1)
        tokens = torch.cat([emitted * valid, torch.zeros_like(end)], 1)  # (B, L+1)
        steps = torch.cat([valid.long(), torch.zeros_like(end)], 1)
        for _ in range(length.bit_length()):
            tokens = tokens + tokens.gather(1, after)
            steps = steps + steps.gather(1, after)
            after = after.gather(1, after)
        return tokens.sum(), steps.sum()


def teacher_forced_acceptance(
    module: MTPMixin,
    input_ids: Tensor,
    labels: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    fwd: Optional[MTPForward] = None,
    max_positions: Optional[int] = None,
    index: int = 0,
    position_ids: Optional[Tensor] = None,
) -> AcceptanceStats:
    """Greedy acceptance, coupling and calibration inputs of every depth on teacher-forced tokens.

    Args:
        module: the MTP module (logits come from its heads).
        input_ids: (B, T) tokens.
        labels: (B, T) targets aligned with ``input_ids``, ``ignore_index`` where not scored (default: input_ids).
        chunk_size: rows of probed logits per depth alive at once.
        fwd: a :func:`teacher_forced_forward` of these tokens, when already computed.
        max_positions: compute ``js`` and ``confidence`` on about this many positions only (``None``: all).
        index: the batch's number in the epoch, which rotates the probed positions.
        position_ids: (B, T) positions of a packed batch (documents kept apart; pairs across documents not counted).
    """
    fwd = fwd if fwd is not None else teacher_forced_forward(module, input_ids, labels, position_ids)
    return TeacherForcedOutcomes(module, fwd, max_positions, index).read(module, fwd, chunk_size).stats()


class TeacherForcedOutcomes:
    """What :func:`teacher_forced_acceptance` gathers from a batch: every depth's argmax and draft confidence, the
    main model's argmax, and the JS divergence of adjacent depths.

    The argmaxes cover every position and come from :func:`teacher_forced_argmax` (the loss pass's, in validation);
    the confidences and JS divergences, which need softmaxes over the vocabulary, cover the positions of
    :func:`probed_columns` (``max_positions`` per batch, rotated by ``index``), whose logits alone are computed."""

    def __init__(
        self, module: MTPMixin, fwd: MTPForward, max_positions: Optional[int] = None, index: int = 0
    ) -> None:
        self.labels = labels = fwd.labels
        self.position_ids = fwd.position_ids  # (B, T) of a packed batch, else None
        self.ignore_index = module.mtp_config.ignore_index
        self.depth = depth = len(fwd.depth_hidden)
        batch, length = labels.shape
        self.temperatures = [float(t) for t in module.mtp_draft_temperatures]
        self.main_argmax, *self.argmax = teacher_forced_argmax(module, fwd)  # (B, T-1), (B, T-k-1) per depth
        self.confidence = [torch.zeros(batch, length - k - 1, device=labels.device) for k in range(1, depth + 1)]
        self.js = [torch.zeros(batch, length - k - 2, device=labels.device) for k in range(1, depth)]
        self.columns = probed_columns(batch, length - 2, max_positions, index)  # the same for every depth
        self.probed = [torch.zeros(batch, length - k - 1, dtype=torch.bool, device=labels.device)
                       for k in range(1, depth + 1)]
        for probed in self.probed:
            probed[:, self.columns] = True

    def read(self, module: MTPMixin, fwd: MTPForward, chunk_size: Optional[int] = None) -> TeacherForcedOutcomes:
        """Compute the probed logits of every depth, about ``chunk_size`` rows per depth at a time, and add them."""
        batch, length = fwd.labels.shape
        probed = len(range(length - 2)[self.columns])  # probed positions per sequence (depth 1's)
        for part in row_chunks(batch, sequences_per_chunk(module, fwd, chunk_size, probed)):
            self.add(part, [probed_logits(module, fwd, k, part, self.columns) for k in range(1, self.depth + 1)])
        return self

    def add(self, part: slice, depths: list[Tensor]) -> None:
        """One chunk of sequences: depth k's logits at the probed positions, (b, n_k, V) each."""
        columns = self.columns
        log_probs = []  # depth k's log-softmax at the probed positions, (b, n_k, V): shared by both of its JS pairs
        for k, probed in enumerate(depths, start=1):
            # top of softmax(z / T) = 1 / Σ exp((z - max z) / T); floored at -80, where exp is subnormal (slow on x86)
            # and adds nothing next to the maximum's 1
            scaled = (probed - probed.amax(-1, keepdim=True)).div_(self.temperatures[k - 1]).clamp_(min=-80.0)
            self.confidence[k - 1][part, columns] = scaled.exp_().sum(-1).reciprocal_()
            if self.depth > 1:
                log_probs.append(torch.log_softmax(probed, -1))
        for k in range(1, self.depth):
            pairs = log_probs[k].shape[1]  # probed positions of depth k+1: depth k's first ones
            self.js[k - 1][part, columns] = _jensen_shannon_log(log_probs[k - 1][:, :pairs], log_probs[k])

    def stats(self) -> AcceptanceStats:
        labels, argmax, main_argmax = self.labels, self.argmax, self.main_argmax
        length = labels.shape[1]
        accept, chained, valid, correct = [], [], [], []
        for k in range(1, self.depth + 1):
            span = length - k - 1
            accept.append(argmax[k - 1] == main_argmax[:, k : k + span])  # draft of t(i+k+1) vs main at i+k
            chained.append(accept[-1] if k == 1 else chained[-1][:, :span] & accept[-1])
            valid.append(scored_positions(labels, k, span, self.ignore_index, self.position_ids))
            correct.append(argmax[k - 1] == labels[:, k + 1 : k + 1 + span])
        coupling = [argmax[k - 1][:, : length - k - 2] == argmax[k] for k in range(1, self.depth)]
        return AcceptanceStats(accept, chained, valid, coupling, self.js, self.confidence, correct, self.probed)


def _jensen_shannon_log(log_p: Tensor, log_q: Tensor) -> Tensor:
    """JS(p, q) = ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q) / 2, in nats, from log-probabilities; (..., V) -> (...)."""
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    return 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1)


class MTPCouplingMonitor(TeacherForcedCallback):
    """Logs, on validation, how the MTP heads will behave as drafters.

    For every configured depth k (all of them, whatever ``MTPDepthWarmup`` has activated), on teacher-forced
    validation tokens, from the hidden states ``validation_step`` computed for the loss (the trunk is not run again;
    the draft calibration, when present, reads the same states) and the argmaxes its cross-entropy computed:

    - ``val/mtp/coupling_depth{k}``: how often depth k's argmax equals depth k+1's at the same position (k < D);
    - ``val/mtp/js_depth{k}``: Jensen-Shannon divergence (nats) between depths k and k+1 (k < D);
    - ``val/mtp/accept_depth{k}``: how often depth k's argmax at i equals the main model's argmax at i+k (greedy
      acceptance of draft k, unconditional);
    - ``val/mtp/accept_chained_depth{k}``: the share of positions where drafts 1..k all match (the joint rate, as
      ``predict``'s ``acceptance_per_depth``; over depth k-1's it is the rate given depths 1..k-1 matched);
    - ``val/mtp/tau_draft{n}``: expected tokens per main-model forward with n drafts, n = 1..D, counting the bonus
      token: τ_n = mean over positions of 1 + Σ_{j ≤ n} chained_j;
    - ``val/mtp/tau_walk_draft{n}``: the same, but averaged over the positions where greedy decoding would start its
      steps: walks over the tokens that, from every position, emit 1 + the leading matched drafts and jump past them
      (Σ tokens / Σ steps). Decoding samples step starts this way, so when acceptance is correlated along the text
      (repetitive code, loops) this is the τ that decoding measures and the per-position mean overestimates it; on
      the model's own greedy output the walk replays decoding exactly;
    - ``val/mtp/ece_depth{k}``: expected calibration error (torchmetrics, ``n_bins`` bins, L1) of depth k's draft
      distribution softmax(logits / T_k) (T_k from ``pl_module.mtp_draft_temperatures``) against the real token.

    Every metric but ``js`` and ``ece`` reads every position. These two need a softmax over the vocabulary per position
    and depth, so they read a fixed-size subsample of each batch: every s-th position of each sequence, about
    ``max_positions`` per batch (offset rotating from batch to batch; the same positions for every depth), those whose
    tokens are scored. Their values are then means over an unbiased subsample of the epoch's positions: the same
    quantities, estimated with more sampling noise; ``max_positions=None`` reads every position.

    Values are means over all scored positions of the epoch (torchmetrics objects, synchronised across ranks). When
    a coupling passes ``coupling_threshold``, it warns once, on rank zero. The probed logits come from calling the
    head modules, so it works under DeepSpeed ZeRO-3.

    Args:
        coupling_threshold: warn when a coupling (fraction in [0, 1]) exceeds it.
        n_bins: bins of the calibration error.
        chunk_size: rows of probed logits per depth alive at once (default: the MTP loss's chunk size).
        max_positions: positions per batch of ``js`` and ``ece`` (≥ 1; ``None``: all of them).

    Example::

        from lightning_mtp.callbacks import MTPCouplingMonitor

        trainer = L.Trainer(callbacks=[MTPCouplingMonitor(coupling_threshold=0.5)], val_check_interval=500)
    """

    def __init__(
        self,
        coupling_threshold: float = 0.5,
        n_bins: int = 15,
        chunk_size: Optional[int] = None,
        max_positions: Optional[int] = 128,
    ) -> None:
        if isinstance(coupling_threshold, bool) or not isinstance(coupling_threshold, (int, float)) or not (
            0 <= coupling_threshold <= 1
        ):
            raise ValueError(f"MTPCouplingMonitor.coupling_threshold must be in [0, 1], got {coupling_threshold!r}")
        self.coupling_threshold = float(coupling_threshold)
        self.n_bins = check_int("MTPCouplingMonitor.n_bins", n_bins, 1)
        self.chunk_size = None if chunk_size is None else check_int("MTPCouplingMonitor.chunk_size", chunk_size, 1)
        self.max_positions = (None if max_positions is None
                              else check_int("MTPCouplingMonitor.max_positions", max_positions, 1))
        self.warned = False
        self._batches = 0  # read this epoch: rotates the probed positions
        self.means: dict[str, MeanMetric] = {}
        self.calibration: dict[str, BinaryCalibrationError] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(coupling_threshold=self.coupling_threshold)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        depth = require_mtp_module(pl_module, "MTPCouplingMonitor").mtp_config.depth
        names = [f"val/mtp/{q}_depth{k}" for k in range(1, depth + 1) for q in ("accept", "accept_chained")]
        names += [f"val/mtp/{q}_depth{k}" for k in range(1, depth) for q in ("coupling", "js")]
        names += [f"val/mtp/{q}_draft{n}" for n in range(1, depth + 1) for q in ("tau", "tau_walk")]
        self.means = {name: MeanMetric() for name in names}
        self.calibration = {f"val/mtp/ece_depth{k}": BinaryCalibrationError(n_bins=self.n_bins, norm="l1")
                            for k in range(1, depth + 1)}

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for metric in [*self.means.values(), *self.calibration.values()]:
            metric.reset()
            metric.to(pl_module.device)
        self._batches = 0

    @override
    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.wants_batch(trainer):
            self.read_validation_batch(pl_module, batch)

    @override
    def read_forward(self, pl_module: MTPMixin, fwd: MTPForward) -> None:
        outcomes = TeacherForcedOutcomes(pl_module, fwd, self.max_positions, self._batches)
        self._batches += 1
        self.update(outcomes.read(pl_module, fwd, self.chunk_size).stats())

    def update(self, stats: AcceptanceStats) -> None:
        """Add one batch's outcomes to the epoch's metrics."""
        for k in range(1, len(stats.accept) + 1):
            valid = stats.valid[k - 1]
            self._update(f"val/mtp/accept_depth{k}", stats.accept[k - 1], valid)
            self._update(f"val/mtp/accept_chained_depth{k}", stats.chained[k - 1], valid)
            self._update(f"val/mtp/tau_draft{k}", *stats.tau(k))
            tokens, steps = stats.tau_walk(k)
            if steps > 0:  # a ratio of sums over the epoch: Σ tokens / Σ steps
                self.means[f"val/mtp/tau_walk_draft{k}"].update(tokens.float() / steps, weight=steps.float())
            probed = valid & stats.probed[k - 1] if stats.probed else valid
            if probed.any():
                self.calibration[f"val/mtp/ece_depth{k}"].update(stats.confidence[k - 1][probed],
                                                                 stats.correct[k - 1][probed].long())
        for k in range(1, len(stats.coupling) + 1):
            pair_valid = stats.valid[k]  # both depths' targets scored
            self._update(f"val/mtp/coupling_depth{k}", stats.coupling[k - 1], pair_valid)
            pair_probed = pair_valid & stats.probed[k] if stats.probed else pair_valid
            self._update(f"val/mtp/js_depth{k}", stats.js[k - 1], pair_probed)

    def _update(self, name: str, values: Tensor, valid: Tensor) -> None:
        if valid.any():
            self.means[name].update(values[valid].float())

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = [*self.means.items(), *self.calibration.items()]
        updated = torch.tensor([float(metric.update_count > 0) for _, metric in metrics], device=pl_module.device)
        if trainer.world_size > 1:  # every rank computes (a collective) what any rank saw; the others add nothing
            updated = trainer.strategy.reduce(updated, reduce_op="max")
            for (name, metric), anywhere in zip(metrics, updated.tolist()):
                if anywhere and not metric.update_count:
                    empty = torch.zeros(0, device=pl_module.device)
                    metric.update(*((empty,) if name in self.means else (empty, empty.long())))
        values = {}
        for (name, metric), anywhere in zip(metrics, updated.tolist()):
            if anywhere:
                values[name] = metric.compute()  # synchronised across ranks by torchmetrics
        if values:
            # equal on every rank already: a max over them changes no bit (Lightning warns of unsynced epoch values)
            pl_module.log_dict(values, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        coupled = {name: float(v) for name, v in values.items()
                   if name.startswith("val/mtp/coupling_") and float(v) > self.coupling_threshold}
        if coupled and not self.warned:
            self.warned = True
            listed = ", ".join(f"{name} = {v:.3f}" for name, v in coupled.items())
            rank_zero_warn(
                f"MTP heads are coupled: {listed} exceeds coupling_threshold = {self.coupling_threshold}. Adjacent "
                "depths predict the same token, so drafts repeat themselves; consider MTPDiversityRegularizer."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"warned": self.warned}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.warned = state_dict.get("warned", False)
