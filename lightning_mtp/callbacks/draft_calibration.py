"""``MTPDraftCalibration``: one temperature per MTP depth, fitted on validation data to the main model."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_mtp.callbacks._base import check_int, require_mtp_module
from lightning_mtp.callbacks._teacher_forcing import (
    TeacherForcedCallback,
    probed_columns,
    probed_logits,
    scored_positions,
    sequences_per_chunk,
)
from lightning_mtp.head_calls import row_chunks
from lightning_mtp.mixin import MTPForward, MTPMixin


class MTPDraftCalibration(TeacherForcedCallback):
    r"""Fits a temperature T_k per depth so that depth k's draft distribution matches the main model's.

    A fixed temperature per draft position is a guess. Instead, on the validation data, T_k minimises the NLL of
    depth k's tempered distribution under the main model's distribution at the verified position:

    .. math::

        T_k = \arg\min_T \sum_i \mathrm{CE}\big(p_{\mathrm{main}}(\cdot|i+k),\ \mathrm{softmax}(z_k(i) / T)\big)
            = \arg\min_T \sum_i \mathrm{KL}\big(p_{\mathrm{main}}(\cdot|i+k)\ \|\ \mathrm{softmax}(z_k(i) / T)\big)

    over the positions i whose tokens are scored. With β = 1/T the objective f(β) = Σ_i [logsumexp(β z_i) - β
    E_{p_main}[z_i]] is convex, with f'(β) = Σ_i (E_{q_β}[z_i] - E_{p_main}[z_i]) and f''(β) = Σ_i Var_{q_β}[z_i].
    The callback accumulates f, f' and f'' on a log-spaced grid of ``grid_size`` temperatures in
    [``min_temperature``, ``max_temperature``] over the validation epoch (no logits are kept, only those sums, so
    memory is constant), brackets the minimum between two grid points and refines it by cubic interpolation.

    The grid costs ``grid_size`` exponentials per logit, so each batch contributes a fixed-size subsample of its
    positions: every s-th position of each sequence, about ``max_positions`` per batch (offset rotating from batch to
    batch, the same positions for every depth), those whose tokens are scored. The fit is then the same minimisation
    over fewer positions: an unbiased subsample of the epoch's, so T_k changes only statistically (one scalar per
    depth, fitted on ``max_positions`` × batches positions); ``max_positions=None`` fits on every position.

    At the end of each validation epoch (not the sanity check) it sets ``pl_module.mtp_draft_temperatures``, which the
    checkpoint saves with the model and which decoding uses for the draft distribution in sampling mode. Logits come
    from calling the head modules (DeepSpeed ZeRO-3 safe) on the probed rows only of the hidden states
    ``validation_step`` computed for the loss (shared with ``MTPCouplingMonitor``); the sums are all-reduced across
    ranks.

    Logs ``val/mtp/temperature_depth{k}`` and ``val/mtp/draft_kl_depth{k}`` (mean KL(main ‖ tempered draft) at T_k).

    Args:
        grid_size: temperatures evaluated per depth (≥ 3).
        min_temperature: lowest temperature (> 0).
        max_temperature: highest temperature (> ``min_temperature``).
        max_batches: calibrate on the first ``max_batches`` validation batches of each epoch (default: all).
        chunk_size: rows of probed logits per depth alive at once (default: the MTP loss's chunk size).
        max_positions: positions per batch the fit reads (≥ 1; ``None``: all of them).

    Example::

        from lightning_mtp.callbacks import MTPDraftCalibration

        trainer = L.Trainer(callbacks=[MTPDraftCalibration(max_batches=50)])
        trainer.validate(model, datamodule)  # model.mtp_draft_temperatures now holds T_1..T_D
    """

    def __init__(
        self,
        grid_size: int = 25,
        min_temperature: float = 0.05,
        max_temperature: float = 20.0,
        max_batches: Optional[int] = None,
        chunk_size: Optional[int] = None,
        max_positions: Optional[int] = 32,
    ) -> None:
        self.grid_size = check_int("MTPDraftCalibration.grid_size", grid_size, 3)
        for name, value in (("min_temperature", min_temperature), ("max_temperature", max_temperature)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"MTPDraftCalibration.{name} must be a number > 0, got {value!r}")
        if max_temperature <= min_temperature:
            raise ValueError(
                f"MTPDraftCalibration.max_temperature must be > min_temperature = {min_temperature}, "
                f"got {max_temperature!r}"
            )
        self.min_temperature, self.max_temperature = float(min_temperature), float(max_temperature)
        self.max_batches = None if max_batches is None else check_int("MTPDraftCalibration.max_batches", max_batches, 1)
        self.chunk_size = None if chunk_size is None else check_int("MTPDraftCalibration.chunk_size", chunk_size, 1)
        self.max_positions = (None if max_positions is None
                              else check_int("MTPDraftCalibration.max_positions", max_positions, 1))
        # β = 1/T from high to low temperature: increasing
        self.betas = torch.logspace(-math.log10(self.max_temperature), -math.log10(self.min_temperature),
                                    self.grid_size, dtype=torch.float64)
        self.fits = 0
        self._sums: Optional[Tensor] = None  # (D, 3, G): Σ f, f', f'' per depth and grid β; see accumulate()
        self._counts: Optional[Tensor] = None  # (D,) positions
        self._entropy: Optional[Tensor] = None  # (D,) Σ H(p_main), to report KL instead of cross-entropy
        self._batches = 0
        self._read = 0  # batches read this epoch: rotates the probed positions

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(grid_size=self.grid_size, min_temperature=self.min_temperature,
                                        max_temperature=self.max_temperature)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        require_mtp_module(pl_module, "MTPDraftCalibration")

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reset(pl_module.mtp_config.depth, pl_module.device)

    def reset(self, depth: int, device: Optional[torch.device] = None) -> None:
        """Empty sums for ``depth`` depths (called at the start of each validation epoch)."""
        self._sums = torch.zeros(depth, 3, self.grid_size, dtype=torch.float64, device=device)
        self._counts = torch.zeros(depth, dtype=torch.float64, device=device)
        self._entropy = torch.zeros(depth, dtype=torch.float64, device=device)
        self._batches = self._read = 0

    @override
    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.wants_batch(trainer):
            return
        self._batches += 1
        self.read_validation_batch(pl_module, batch)  # read_forward() on the forward shared with other readers

    @override
    def wants_batch(self, trainer: L.Trainer) -> bool:
        return super().wants_batch(trainer) and (self.max_batches is None or self._batches < self.max_batches)

    def accumulate(self, module: MTPMixin, fwd: MTPForward) -> None:
        """Add one teacher-forced batch (every depth) to the epoch's sums."""
        self.read_forward(module, fwd)

    @override
    def read_forward(self, pl_module: MTPMixin, fwd: MTPForward) -> None:
        batch, length = fwd.labels.shape
        columns = probed_columns(batch, length - 2, self.max_positions, self._read)  # the same for every depth
        self._read += 1
        probed = len(range(length - 2)[columns])  # probed positions per sequence
        for part in row_chunks(batch, sequences_per_chunk(pl_module, fwd, self.chunk_size, probed)):
            for k in range(1, len(fwd.depth_hidden) + 1):
                span = length - k - 1
                positions = None if fwd.position_ids is None else fwd.position_ids[part]
                valid = scored_positions(fwd.labels[part], k, span, pl_module.mtp_config.ignore_index,
                                         positions)[:, columns]
                # depth k at i, main at i+k, on the probed positions only; (b, n, V)[valid] -> (N, V)
                draft = probed_logits(pl_module, fwd, k, part, columns)
                main = probed_logits(pl_module, fwd, 0, part, columns, offset=k)
                self.add_logits(k, draft[valid], main[valid])

    def add_logits(self, depth: int, draft_logits: Tensor, main_logits: Tensor) -> None:
        """Add rows (N, V) of depth ``depth``'s logits z and the main model's logits at the verified positions:
        Σ f, f', f'' at every grid β, and Σ H(p_main).

        With s = z - max(z) ≤ 0 and e_β = exp(β·s), every grid point needs the same three sums per row: Σ e_β,
        Σ e_β·s and Σ e_β·s², one batched matmul over all of β at once. Then logsumexp(β·z) = β·max(z) + log Σ e_β,
        E_q[z] = max(z) + E_q[s], and Var_q[z] = Var_q[s] (the shift also keeps the variance out of the cancellation
        of E[z²] - E[z]²). β·s is floored at -80: below about -87 exp is subnormal, nothing next to the row's
        maximum (e_β = 1), yet 20-80x slower on x86 CPUs (measured on this project's machine).
        """
        if self._sums is None:
            raise RuntimeError("MTPDraftCalibration.add_logits before on_validation_epoch_start")
        z = draft_logits.float()  # (N, V)
        main_logp = torch.log_softmax(main_logits.float(), dim=-1)
        p = main_logp.exp()
        expected = (p * z).sum(-1, keepdim=True)  # E_main[z], (N, 1)
        self._entropy[depth - 1] += -(p * main_logp).sum().double()
        self._counts[depth - 1] += z.shape[0]
        del main_logp, p
        rows, grid = z.shape[0], self.grid_size
        if rows == 0:
            return
        top = z.amax(-1, keepdim=True)  # (N, 1)
        shifted = z - top  # (N, V)
        powers = torch.stack([torch.ones_like(shifted), shifted, shifted * shifted], dim=1)  # (N, 3, V)
        betas = self.betas.to(device=z.device, dtype=torch.float32)[:, None]  # (G, 1)
        sums = z.new_empty(rows, 3, grid)  # (N, 3, G): Σ e_β, Σ e_β·s, Σ e_β·s² per row and β
        block = max(1, 4 * rows // grid)  # rows per (block, G, V) buffer: about four copies of the logits in all
        weights = z.new_empty(min(block, rows), grid, z.shape[1])
        for part in row_chunks(rows, block):
            e = weights[: part.stop - part.start]  # (n, G, V)
            torch.mul(betas, shifted[part, None, :], out=e)  # β·s
            e.clamp_(min=-80.0).exp_()
            torch.bmm(powers[part], e.mT, out=sums[part])  # (n, 3, V) @ (n, V, G)
        total, first, second = sums.unbind(1)  # (N, G) each
        mean = first / total  # E_q[s]
        betas = betas.T  # (1, G)
        values = torch.log(total) + betas * (top - expected)  # f: logsumexp(β·z) - β·E_main[z]
        slopes = top + mean - expected  # f': E_q[z] - E_main[z]
        curvatures = (second / total - mean * mean).clamp(min=0)  # f'': Var_q[z]
        for i, per_row in enumerate((values, slopes, curvatures)):
            self._sums[depth - 1, i] += per_row.double().sum(0)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._sums is None:
            return
        self._sums, self._counts, self._entropy = (trainer.strategy.reduce(t, reduce_op="sum")
                                                   for t in (self._sums, self._counts, self._entropy))
        fitted = self.solve()
        if not fitted:
            return
        temperatures = list(pl_module.mtp_draft_temperatures)
        logged = {}
        for k, (temperature, kl) in fitted.items():
            temperatures[k - 1] = temperature
            logged[f"val/mtp/temperature_depth{k}"] = temperature
            logged[f"val/mtp/draft_kl_depth{k}"] = kl
        pl_module.mtp_draft_temperatures = temperatures
        self.fits += 1
        # equal on every rank (fitted to the summed statistics): a max over them changes no bit (Lightning warns of
        # unsynced epoch values)
        pl_module.log_dict(logged, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")

    def solve(self) -> dict[int, tuple[float, float]]:
        """{depth: (T_k, mean KL(main ‖ softmax(z / T_k)))} for every depth that saw positions."""
        fitted = {}
        for k in range(1, self._sums.shape[0] + 1):
            count = float(self._counts[k - 1])
            if count == 0:
                continue
            beta, objective = self.fit(self._sums[k - 1])
            fitted[k] = (1.0 / beta, max(0.0, (objective - float(self._entropy[k - 1])) / count))
        return fitted

    def fit(self, sums: Tensor) -> tuple[float, float]:
        """(β*, f(β*)) from the grid sums (3, G) of f, f', f''.

        f is convex in β, so f' increases: the minimum lies between the last grid point with f' ≤ 0 and the next one.
        Inside that bracket f' is interpolated by the cubic Hermite polynomial through f' and f'' at both ends, and its
        root found by bisection; f(β*) comes from the cubic Hermite polynomial through f and f'.
        """
        values, slopes, curvatures = (sums[i].cpu().double().tolist() for i in range(3))
        betas = self.betas.tolist()
        rising = sum(slope <= 0 for slope in slopes)  # grid points left of the minimum
        if rising == 0:
            return betas[0], values[0]
        if rising == len(betas):
            return betas[-1], values[-1]
        a, b = rising - 1, rising
        width = betas[b] - betas[a]
        slope_at = functools.partial(_hermite, slopes[a], curvatures[a] * width, slopes[b], curvatures[b] * width)
        low, high = 0.0, 1.0
        for _ in range(60):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if slope_at(mid) <= 0 else (low, mid)
        s = 0.5 * (low + high)
        value = _hermite(values[a], slopes[a] * width, values[b], slopes[b] * width, s)
        return betas[a] + s * width, value

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"fits": self.fits}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fits = state_dict.get("fits", 0)


def _hermite(y0: float, dy0: float, y1: float, dy1: float, s: float) -> float:
    """Cubic Hermite interpolation on [0, 1] through (0, y0, dy0) and (1, y1, dy1), at s."""
    s2, s3 = s * s, s * s * s
    return (2 * s3 - 3 * s2 + 1) * y0 + (s3 - 2 * s2 + s) * dy0 + (-2 * s3 + 3 * s2) * y1 + (s3 - s2) * dy1
