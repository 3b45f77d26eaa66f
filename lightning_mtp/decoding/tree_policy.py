"""Which drafter a decoding call uses and what each of its steps drafts.

``speculative=False``: none. ``speculative=True``: the chain drafter for ``draft_tokens <= D`` (its fixed or adaptive
length, :class:`~lightning_mtp.decoding.drafting.DraftLength`), else the tree drafter with one fixed shape
(:class:`FixedTree`: a static tree, a dynamic tree, or a chain longer than D). ``speculative="auto"``: the tree drafter
with :class:`~lightning_mtp.decoding.auto.AutoPolicy` choosing per step among plain steps, chains and trees (only plain
steps and chains on a host without tree verification). ``auto`` keeps the fixed chain of D under DeepSpeed ZeRO-3 on
several processes (every rank must run the same forwards) and when a chain-only option is set (``compile``,
``acceptance="typical"``, ``draft_confidence_threshold``, ``adaptive_draft_tokens``).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.auto import (
    CALIBRATION_ROWS,
    CALIBRATION_SAMPLES,
    MIN_CALIBRATION_ROUNDS,
    REFINE_OPTIONS,
    REFINE_ROUNDS,
    AutoMemory,
    AutoPolicy,
    RoundRobin,
    candidate_options,
    memory_for,
)
from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.host import supports_trees
from lightning_mtp.decoding.native_drafting import chain_drafter
from lightning_mtp.decoding.tree import MAX_DRAFT_DEPTH, MAX_RANK, TreeShape
from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter


class FixedTree:
    """Every step drafts the same tree (or chain) shape."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape
        self.max_nodes = shape.num_nodes + 1

    def next(self) -> TreeShape:
        return self.shape

    def observe_step(self, option: Any, extra: list, active_rows: int, seconds: float) -> None:
        """Nothing to learn."""


class AutoSteps:
    """:class:`~lightning_mtp.decoding.auto.AutoPolicy` as a decoding loop's policy (tree or chain drafter); with
    ``calibration`` set, the round-robin calibration run instead (:func:`calibrate_steps`)."""

    def __init__(self, policy: AutoPolicy, max_depth: int, tree_mode: bool) -> None:
        self.policy, self.max_depth, self.tree_mode = policy, max_depth, tree_mode
        self.max_nodes = max((o.num_nodes for o in policy.options if o is not None), default=0) + 1
        self.calibration: Optional[RoundRobin] = None
        self.sampling = False
        """A sampling call: it starts from the calibration's acceptance counts only (:meth:`start_sampling_call`)."""

    def start_sampling_call(self) -> None:
        """Where every sampling call starts: the calibration's acceptance counts (``StepCosts.acceptance``, the same
        for every call, so that which random numbers a step consumes does not depend on earlier calls' outcomes),
        and plain from the first step if they make every draft hopeless (measured at batch 8, where no chain pays:
        exploring and then retiring cost each call 5-7% against plain)."""
        policy = self.policy
        policy.memory.acceptance = dict(policy.memory.costs.acceptance)
        policy.begin_call()
        if policy.hopeless():
            policy.start_plain()

    def needs_calibration(self, context: int) -> bool:
        """Whether the call (decoding around ``context`` tokens) must calibrate first
        (:meth:`~lightning_mtp.decoding.auto.StepCosts.needs_calibration`)."""
        return self.policy.memory.costs.needs_calibration(context)

    @property
    def calibrated(self) -> bool:
        """A calibration decode may stop: the round robin has all its samples."""
        return self.calibration is not None and self.calibration.done

    @property
    def retired(self) -> bool:
        """The decoding loop drops the drafter (plain steps only) once the policy retires drafting."""
        return self.calibration is None and self.policy.retired

    def _as_step(self, option: Optional[TreeShape]) -> Any:
        if self.tree_mode:
            return option
        return 0 if option is None else option.depth  # the chain drafter takes a draft count

    def next(self) -> Any:
        chooser = self.calibration if self.calibration is not None else self.policy
        return self._as_step(chooser.next())

    def observe_step(self, option: Any, extra: list, active_rows: int, seconds: float) -> None:
        if not self.tree_mode:
            shape = None if option == 0 else TreeShape.chain(option)
        else:
            shape = option
        if self.calibration is not None:
            self.calibration.record(shape, seconds)  # and its acceptance is learned too
        if active_rows <= 0:
            return
        accepted = extra[: self.max_depth] if self.tree_mode else extra[:option]
        if shape is not None and shape.is_chain:  # depth d reached by the rows that accepted depth d-1
            ranks = [[active_rows if d == 1 else accepted[d - 2], accepted[d - 1]] for d in range(1, shape.depth + 1)]
        else:  # trees report, per depth: rows whose parent was reached, then accepted children by sibling rank
            flat = extra[self.max_depth:]
            width = MAX_RANK + 1
            depth = 0 if shape is None else shape.depth
            ranks = [flat[d * width: (d + 1) * width] for d in range(depth)]
        tokens = 1.0 + sum(accepted) / active_rows
        self.policy.update(shape, tokens, ranks)


def calibrate_steps(steps: AutoSteps, run: Callable[..., Any], prompts: Tensor, lengths: Tensor, new_tokens: int,
                    context: int) -> None:
    """Time every option on this machine and model, decoding the call's own prompts (its first
    ``CALIBRATION_ROWS`` rows) as the call will: for every drafting option X in turn, three plain steps then X twice,
    X's second step timed against the third plain step (:class:`~lightning_mtp.decoding.auto.RoundRobin`: near steps,
    so drift on a shared machine cancels, and steady steps of both kinds, no catch-up after another option); a warm-up
    (each option once), then enough rounds for ``CALIBRATION_SAMPLES`` timed steps, at least
    ``MIN_CALIBRATION_ROUNDS``. The decodes ("segments") run ``new_tokens`` tokens (at least
    ``CALIBRATION_MIN_SEGMENT``) from the prompts, again and again until the rounds are done, so the steps are timed
    at the call's context and with its acceptance: a step that accepts more drafts also recomputes more positions in
    the MTP modules (on random tokens, which draft nothing acceptable, a chain of 3 measured 8% cheaper and a chain
    of 2 12% dearer than in decoding). Then the ``REFINE_OPTIONS`` drafting options with the best expected rate (at
    these prices; greedy calls count the calibration's accepted drafts) get ``REFINE_ROUNDS`` more rounds, since
    their prices are the ones that decide. The plain decoding loop is timed on the same prompts, before and after.

    ``run(prompts, lengths, max_new_tokens, plain=False)`` decodes with ``steps`` as the policy (the call's greedy or
    sampling settings, its own generator), or with ``plain=True`` in the plain decoding loop, whose step time becomes
    the plain option's and the unit of the drafting options' ratios (:func:`plain_loop_samples`); the steady plain
    steps the round robin took inside the drafting loop give ``plain_in_loop_s`` (reported beside it).
    """
    options = steps.policy.options
    rounds = max(MIN_CALIBRATION_ROUNDS, -(-CALIBRATION_SAMPLES // len(options)))  # after a warm-up (each option once)
    rows = min(prompts.shape[0], CALIBRATION_ROWS)
    prompts, lengths = prompts[:rows], lengths[:rows]
    longest = int(lengths.max())
    segment = max(1, min(max(new_tokens, CALIBRATION_MIN_SEGMENT), context - longest))
    calibration = RoundRobin(options, rounds)
    loop_samples: list[float] = []  # the plain decoding loop, timed before and after the round robin (drift)
    if None in options:
        loop_samples += plain_loop_samples(run, prompts, lengths, segment)
    steps.calibration = calibration
    try:
        _run_segments(calibration, run, prompts, lengths, segment)
        if len(calibration.drafting) > REFINE_OPTIONS:
            # the contenders' prices decide: time them again (their estimate, with what calibration saw accepted)
            calibration.refine([None] + steps.policy.contenders(calibration.prices(), REFINE_OPTIONS), REFINE_ROUNDS)
            _run_segments(calibration, run, prompts, lengths, segment)
        measured = calibration.prices()
    finally:
        steps.calibration = None
    costs = steps.policy.memory.costs
    if not measured:
        return
    unit = measured["plain"]
    if loop_samples:
        loop_samples += plain_loop_samples(run, prompts, lengths, segment)
        costs.plain_in_loop_s = measured["plain"]
        # Prices in plain-loop seconds: each option's paired ratio to the steady in-loop plain step, taking that step
        # as the plain loop's (measured 0.96-1.05 of it; DRAFT_MARGIN covers the difference). So every comparison the
        # policy makes rests on ratios of near steps only: the plain loop is timed seconds apart from the round robin
        # on a machine that drifts, and scaling by their unpaired ratio moved prices by 10-20% from run to run.
        unit = statistics.median(loop_samples)
    costs.step_seconds.update({key: (unit if key == "plain" else ratio * unit) for key, ratio in measured.items()})
    costs.calibrated_context = longest + segment // 2
    costs.acceptance = dict(steps.policy.memory.acceptance)
    if steps.sampling:
        steps.start_sampling_call()  # the calibrating call starts where later ones will


def _run_segments(calibration: RoundRobin, run: Callable[..., Any], prompts: Tensor, lengths: Tensor,
                  segment: int) -> None:
    """Decode calibration segments until the round robin is done (at most ``MAX_CALIBRATION_SEGMENTS``)."""
    for _ in range(MAX_CALIBRATION_SEGMENTS):
        calibration.start_segment()
        run(prompts, lengths, segment)
        if calibration.done:
            break


CALIBRATION_MIN_SEGMENT = 64
"""Calibration decodes run at least this many tokens (a call of few new tokens still gives several rounds)."""
MAX_CALIBRATION_SEGMENTS = 16
"""At most this many calibration decodes (a short context holds few steps per decode)."""


def plain_loop_samples(run: Callable[..., Any], prompts: Tensor, lengths: Tensor, steps: int,
                       repeats: int = 1) -> list[float]:
    """Seconds per step of the plain decoding loop on ``prompts``, ``repeats`` samples: the cost ``auto`` weighs drafts
    against, since where drafting does not pay it retires to that loop (a plain step inside the drafting loop also
    feeds the drafter and can cost more). Each sample is the difference between decoding ``steps + 1`` tokens and 1
    token (prefill and set-up cancel)."""
    if steps < 1:
        return [float(run(prompts, lengths, 1, plain=True).stats.elapsed_s)]
    samples = []
    for _ in range(repeats):
        short = run(prompts, lengths, 1, plain=True).stats.elapsed_s
        long = run(prompts, lengths, steps + 1, plain=True).stats.elapsed_s
        samples.append(max(long - short, 1e-9) / steps)
    return samples


def draft_plan(module: nn.Module, host: Any, config: GenerationConfig, batch: int, device: torch.device,
               sync_ranks: bool) -> tuple[Optional[Any], Optional[Any]]:
    """(drafter, step policy) of a decoding call; ``(None, None)`` for plain decoding."""
    if config.speculative is False:
        return None, None
    modules = module.require_mtp_modules()
    depth = len(modules)
    cascaded = module.mtp_config.architecture == "cascaded"
    trees = supports_trees(host) and module.mtp_config.layout != "native"  # native blocks draft chains only
    if module.mtp_config.layout == "native" and config.tree_shape(depth) is not None:
        raise ValueError(
            f"native MTP layers (MTPConfig.layout='native') draft chains of at most D={depth} tokens, one per layer: "
            "draft_tree, draft_tree_nodes and draft_tokens > D are not available with them; use draft_tokens <= "
            f"{depth} (default D), or speculative='auto' without them"
        )
    if config.speculative is True:
        shape = config.tree_shape(depth)
        if shape is None:
            return chain_drafter(module), None
        if not trees:
            raise ValueError(
                f"{type(host).__name__} cannot verify draft trees or chains longer than the MTP depth D={depth} "
                "(draft_tree / draft_tree_nodes / draft_tokens > D need a host with forward_tree and keep_path, e.g. "
                "the bundled CausalLM); use draft_tokens <= D, or speculative='auto'"
            )
        return MTPTreeDrafter(module, shape.depth), FixedTree(shape)
    if sync_ranks or config.chain_options():  # a chain-only option, or every rank must draft the same
        if config.tree_shape(depth) is not None:
            why = "DeepSpeed ZeRO-3 on several processes" if sync_ranks else ", ".join(config.chain_options())
            raise ValueError(f"draft_tokens={config.draft_tokens} > D={depth} (a chain through re-applied modules) "
                             f"cannot be combined with {why}; use draft_tokens <= {depth}")
        return chain_drafter(module), None
    requested = config.tree_shape(depth)
    if requested is not None and not trees:
        raise ValueError(f"{type(host).__name__} cannot verify draft trees (draft_tree / draft_tree_nodes / "
                         f"draft_tokens > D={depth}); leave them unset with speculative='auto'")
    if requested is not None:
        options = [None, requested]
    else:
        max_depth = config.draft_tokens or (min(depth + 1, MAX_DRAFT_DEPTH) if cascaded else depth)
        options = candidate_options(max_depth, depth, cascaded, trees)
    if not trees:
        options = [o for o in options if o is None or (o.is_chain and o.depth <= depth)]
    elif config.sampling and requested is None:
        # Sampled trees verify sibling by sibling, each a residual update over the vocabulary: measured on CPU they
        # did not pay (benchmarks/results/quickstart_model: tree [3, 2] 1.00x, dynamic 0.52x, chain k=2 1.30x), so
        # sampling chooses among plain steps and chains (an explicit draft_tree is still honoured).
        options = [o for o in options if o is None or o.is_chain]
    dtype = module.mtp_output_head().weight.dtype
    key = (type(host).__name__, batch, str(device), str(dtype), config.sampling,
           tuple(o and o.describe() for o in options))
    memory = memory_for(module, key, AutoMemory)
    if config.sampling:
        # Which draft a step makes decides which random numbers it uses. So that a seed reproduces the samples,
        # sampling decides from the calibration (its prices and the acceptance its own steps saw) and this call's
        # own acceptance only, never from timings taken during decoding or from earlier calls (greedy output does
        # not depend on the drafts, so it learns freely).
        memory = AutoMemory(costs=memory.costs)  # the same costs: calibration fills them for both
    policy = AutoPolicy(memory, options, batch)
    max_depth = max(o.depth for o in options if o is not None)
    steps = AutoSteps(policy, max_depth, tree_mode=trees)
    if config.sampling:
        steps.sampling = True
        steps.start_sampling_call()
    if trees:
        drafter = MTPTreeDrafter(module, max_depth)
        drafter.report_ranks = True
        return drafter, steps
    return chain_drafter(module), steps
