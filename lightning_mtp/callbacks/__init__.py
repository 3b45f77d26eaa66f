"""Training callbacks for MTP: schedules, a regulariser, and validation-time monitoring and calibration.

============================  =========================================================================================
callback                      what it does
============================  =========================================================================================
``MTPDepthWarmup``            raises the active depth on a schedule (inactive depths cost no compute and no loss)
``MTPWeightSchedule``         schedules λ (constant, step, linear, cosine) and the per-depth weights w_k
``MTPDiversityRegularizer``   penalises the collision probability of adjacent depths (loss term ``diversity``)
``MTPCouplingMonitor``        logs coupling, JS divergence, greedy acceptance, τ per draft length and calibration
``MTPDraftCalibration``       fits one draft temperature per depth to the main model on validation data
``SafeCheckpoint``            ``ModelCheckpoint`` that keeps ``last.ckpt`` current (every validation, every N minutes,
                              on SIGTERM / Ctrl-C), writes atomically and allows one fit per folder
============================  =========================================================================================

Every callback checks its arguments in ``__init__`` (quoting the bad value) and that the module uses ``MTPMixin`` in
``setup``, keeps its schedule position in ``state_dict`` for exact resume, and works on logits obtained by calling
the head modules, never on their (possibly ZeRO-3-partitioned) weights.

Logged names (k = 1..D; pairs k = 1..D-1; n = 1..D):

- ``train/mtp/active_depth`` (MTPDepthWarmup);
- ``train/mtp/lambda``, ``train/mtp/weight_depth{k}`` (MTPWeightSchedule);
- ``train/mtp/diversity``, ``train/mtp/diversity_weight``, ``train/mtp/diversity_collision_depth{k}`` (pairs)
  (MTPDiversityRegularizer; ``diversity`` is its ``name``);
- ``val/mtp/coupling_depth{k}``, ``val/mtp/js_depth{k}`` (pairs), ``val/mtp/accept_depth{k}``,
  ``val/mtp/accept_chained_depth{k}``, ``val/mtp/tau_draft{n}``, ``val/mtp/tau_walk_draft{n}``, ``val/mtp/ece_depth{k}``
  (MTPCouplingMonitor);
- ``val/mtp/temperature_depth{k}``, ``val/mtp/draft_kl_depth{k}`` (MTPDraftCalibration);
- ``train/mtp/distill`` (the self-distillation loss term, ``MTPConfig.distill_weight > 0``).

Example::

    from lightning_mtp.callbacks import MTPCouplingMonitor, MTPDepthWarmup, MTPWeightSchedule

    trainer = L.Trainer(callbacks=[
        MTPDepthWarmup(schedule={0: 1, 1000: 2, 3000: 3}),
        MTPWeightSchedule(schedule="step", milestones={0: 0.3, 20000: 0.1}, depth_decay=0.8),
        MTPCouplingMonitor(),
    ])
"""

from lightning_mtp.callbacks.coupling_monitor import AcceptanceStats, MTPCouplingMonitor, teacher_forced_acceptance
from lightning_mtp.callbacks.depth_warmup import MTPDepthWarmup
from lightning_mtp.callbacks.diversity import MTPDiversityRegularizer, collision_sum
from lightning_mtp.callbacks.draft_calibration import MTPDraftCalibration
from lightning_mtp.callbacks.safe_checkpoint import SafeCheckpoint
from lightning_mtp.callbacks.schedules import ScalarSchedule
from lightning_mtp.callbacks.weight_schedule import MTPWeightSchedule

__all__ = [
    "AcceptanceStats",
    "MTPCouplingMonitor",
    "MTPDepthWarmup",
    "MTPDiversityRegularizer",
    "MTPDraftCalibration",
    "MTPWeightSchedule",
    "SafeCheckpoint",
    "ScalarSchedule",
    "collision_sum",
    "teacher_forced_acceptance",
]
