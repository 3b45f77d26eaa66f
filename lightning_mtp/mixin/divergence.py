"""Stop a fit at the first non-finite loss or gradient, before the optimizer step writes it into the weights.

``training_step`` hands its losses to :meth:`MTPDivergenceGuard.mtp_watch_loss` (no host sync there: the finite
check is a device tensor). At each optimizer step the mixin's ``on_before_optimizer_step`` reads that flag together
with the gradient norm, agreed across processes (one all-reduce of one number under several processes), and raises
:class:`~lightning_mtp.finite.TrainingDiverged` on every rank alike. The step is not taken: the weights stay finite
and the checkpoints already written are kept (``SafeCheckpoint`` saves nothing for a diverged fit).

Mixed precision with a loss scaler (fp16) skips steps with infinite gradients by design, so only the loss is checked
there; gradients that live outside ``param.grad`` (DeepSpeed ZeRO) are left to their engine, the loss is checked.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mtp.finite import TrainingDiverged, describe_names, divergence_message, nonfinite_tensors
from lightning_mtp.outputs import MTPLossOutput
from lightning_mtp.sharded import is_dtensor


class MTPDivergenceGuard:
    """``on_before_optimizer_step``: raise :class:`TrainingDiverged` at a non-finite loss or gradient norm."""

    _mtp_loss_nonfinite: Optional[Tensor] = None  # () bool: a non-finite loss since the last optimizer step
    _mtp_watched_losses: Optional[dict[str, Tensor]] = None  # the last training_step's losses, detached

    def mtp_watch_loss(self, out: MTPLossOutput) -> None:
        """Remember a training step's losses for the check at the next optimizer step (called by ``training_step``;
        a host with its own ``training_step`` may call it too)."""
        loss = out.loss.detach()
        bad = ~torch.isfinite(loss)
        self._mtp_loss_nonfinite = bad if self._mtp_loss_nonfinite is None else self._mtp_loss_nonfinite | bad
        losses = {"loss": loss}
        if out.main_loss is not None:
            losses["main"] = out.main_loss.detach()
        for k, value in enumerate(out.depth_losses.detach().reshape(-1), start=1):
            losses[f"depth {k}"] = value
        self._mtp_watched_losses = losses

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        loss_bad = self._mtp_loss_nonfinite
        self._mtp_loss_nonfinite = None
        norm = self._mtp_gradient_norm()
        bad = torch.zeros((), dtype=torch.bool) if loss_bad is None else loss_bad
        if norm is not None:
            bad = bad.to(norm.device) | ~torch.isfinite(norm)
        diverged = self.trainer.strategy.reduce_boolean_decision(bool(bad), all=False)
        if diverged:
            raise TrainingDiverged(self._mtp_divergence_report(None if norm is None else float(norm)))

    def _mtp_gradient_norm(self) -> Optional[Tensor]:
        """The total 2-norm of the gradients in ``param.grad``; ``None`` when there are none, or when a loss scaler
        owns infinite gradients (fp16 mixed precision skips those steps itself)."""
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return None
        grads = [p.grad.detach() for p in self.parameters() if p.grad is not None]
        if not grads:
            return None
        if any(is_dtensor(g) for g in grads):  # FSDP2: each rank holds shards; one all-reduce for the total
            total = torch.nn.utils.get_total_norm(grads)
            return total.full_tensor() if is_dtensor(total) else total
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))

    def _mtp_divergence_report(self, gradient_norm: Optional[float]) -> str:
        losses = {name: float(value) for name, value in (self._mtp_watched_losses or {}).items()}
        step = self.trainer.global_step
        rate = getattr(self, "learning_rate", None)
        lower = "a lower learning rate" + (f" (--model.init_args.learning_rate, now {rate:g})" if rate else "")
        checkpoint = getattr(self.trainer.checkpoint_callback, "last_model_path", None) or None
        kept = (f"the last checkpoint, {checkpoint}, was written before it and is kept" if checkpoint
                else "no checkpoint was written before it")
        tries = [lower, "a longer warmup (--model.init_args.warmup_steps)"]
        if not self.trainer.gradient_clip_val:  # advice the fit already follows is left out
            tries.append("gradient clipping (--trainer.gradient_clip_val 1.0)")
        if str(self.trainer.precision) in ("16-true", "16", "half"):  # diverges at any learning rate
            tries.insert(0, "--trainer.precision 16-mixed or bf16-mixed instead of 16-true (in float16 AdamW's eps "
                            "1e-8 and small squared gradients round to 0, and its update divides 0 by 0)")
        if str(self.trainer.precision) not in ("32-true", "32", "64-true", "64"):
            tries.append("full precision (--trainer.precision 32-true)")
        bad = nonfinite_tensors({name: p.to_local() if is_dtensor(p) else p for name, p in self.named_parameters()})
        applied = ("The step was not applied and nothing was saved from it" if not bad else
                   f"The weights were already NaN or infinite ({describe_names(bad)}): the update of the step before "
                   "made them so, its loss and gradients finite; nothing was saved from it")
        advice = (
            f"{applied}; {kept}. Try {', '.join(tries[:-1])} or "
            f"{tries[-1]}"
            + (f", starting from the kept checkpoint's weights with --model.init_args.init_from {checkpoint} in "
               "another checkpoint folder (--trainer.callbacks.init_args.dirpath)" if checkpoint else "")
        )
        return divergence_message(step, losses, gradient_norm, advice)
