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

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.auto import (
    CALIBRATION_ROWS,
    CALIBRATION_SAMPLES,
    MIN_CALIBRATION_ROUNDS,
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
        self._previous: Any = "prefill"  # the previous step's option: a draft times its steady cost only after itself

    def needs_calibration(self, context: int) -> bool:
        """Whether the call (decoding around ``context`` tokens) must calibrate first
        (:meth:`~lightning_mtp.decoding.auto.StepCosts.needs_calibration`)."""
        return self.policy.memory.costs.needs_calibration(context)

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
            self.calibration.record(shape, seconds)
            return
        # A draft right after prefill, plain steps or another option also catches the MTP modules up on positions
        # they skipped or computed for another shape: only a repeat of the previous option shows its steady cost.
        timed = shape is None or shape == self._previous
        self._previous = shape
        if active_rows <= 0:
            return
        if not self.tree_mode:
            accepted = extra[:option]
            ranks = []
            for d in range(1, option + 1):
                reached = active_rows if d == 1 else accepted[d - 2]
                ranks.append([reached, accepted[d - 1]])
        else:
            accepted = extra[: self.max_depth]
            flat = extra[self.max_depth:]
            width = MAX_RANK + 1
            depth = 0 if shape is None else shape.depth
            ranks = [flat[d * width: (d + 1) * width] for d in range(depth)]
        tokens = 1.0 + sum(accepted) / active_rows
        self.policy.update(shape, seconds, tokens, ranks, timed=timed)


def calibrate_steps(steps: AutoSteps, run: Callable[[Tensor, int], Any], vocab: int, batch: int, context: int,
                    device: torch.device, centre: Optional[int] = None) -> None:
    """Time every option on this machine and model: decode a random prompt taking, for every drafting option X in
    turn, a plain step then X twice, X's second step timed against the plain step before it
    (:class:`~lightning_mtp.decoding.auto.RoundRobin`: neighbouring steps, so drift on a shared machine cancels, and
    steady decoding with X, no catch-up after another option), a warm-up round, then enough rounds for
    ``CALIBRATION_SAMPLES`` timed steps, at least ``MIN_CALIBRATION_ROUNDS``; keep each option's price in the
    policy's memory.

    ``centre``: the context length (tokens) the call decodes around, e.g. its longest prompt plus half its new tokens
    (default: a quarter of ``context``, the longest allowed). The calibrated steps run there: the calibration's prompt
    is as long as puts the middle of its decode at ``centre``, and the plain loop is timed at ``centre`` too (a step
    at 200 tokens of context costs more than one at 40: attention reads every cached position, and at batch 8 that
    moved the plain step by 25%).

    ``run(prompts, max_new_tokens, plain=False)`` decodes with ``steps`` as the policy (the call's greedy or sampling
    settings, its own generator), or with ``plain=True`` in the plain decoding loop, whose step time becomes the
    plain option's (:func:`plain_loop_step`); the plain steps the round robin took inside the drafting loop give
    ``plain_in_loop_s``, and the two give ``plain_loop_ratio``.
    """
    options = steps.policy.options
    rounds = 1 + max(MIN_CALIBRATION_ROUNDS, -(-CALIBRATION_SAMPLES // len(options)))  # the first one warms up
    centre = max(1, min(context // 4 if centre is None else centre, context - 1))
    calibration = RoundRobin(options, rounds)
    total_steps = rounds * len(calibration.sequence)
    # decodes ("segments") of at most this many tokens, centred on `centre` where the context allows
    segment = max(1, min(3 * total_steps // 2, 2 * centre, context - 1))
    rows = min(batch, CALIBRATION_ROWS)
    generator = torch.Generator(device=device).manual_seed(0)
    loop_samples: list[float] = []  # the plain decoding loop, timed before and after the round robin (drift)
    if None in options:
        plain_steps = max(1, min(PLAIN_CALIBRATION_STEPS, context - 1))
        plain_len = max(1, min(centre - plain_steps // 2, context - plain_steps - 1))
        plain_prompts = torch.randint(0, vocab, (rows, plain_len), device=device, generator=generator)
        loop_samples += plain_loop_samples(run, plain_prompts, plain_steps)
    steps.calibration = calibration
    try:
        for _ in range(MAX_CALIBRATION_SEGMENTS):
            calibration.start_segment()
            remaining = total_steps - calibration.steps  # steps left; a random prompt's drafts are mostly rejected
            tokens = max(1, min(segment, remaining + remaining // 4 + 1))
            prompt_len = max(1, min(centre - tokens // 2, context - tokens))  # the decode centred on `centre`
            run(torch.randint(0, vocab, (rows, prompt_len), device=device, generator=generator), tokens)
            if calibration.done:
                break
        measured = calibration.medians()
    finally:
        steps.calibration = None
    costs = steps.policy.memory.costs
    if loop_samples:
        loop_samples += plain_loop_samples(run, plain_prompts, plain_steps)
        in_loop = measured.get("plain")
        measured["plain"] = sorted(loop_samples)[len(loop_samples) // 2]
        if in_loop:
            costs.plain_in_loop_s = in_loop
            costs.plain_loop_ratio = measured["plain"] / in_loop
    costs.step_seconds.update(measured)
    costs.calibrated_context = centre


PLAIN_CALIBRATION_STEPS = 24
"""Steps of the plain decoding loop timed by the calibration (three times; the median)."""
MAX_CALIBRATION_SEGMENTS = 16
"""At most this many calibration decodes (a short context holds few steps per decode)."""


def plain_loop_samples(run: Callable[..., Any], prompts: Tensor, steps: int, repeats: int = 2) -> list[float]:
    """Seconds per step of the plain decoding loop on ``prompts``, ``repeats`` samples: the cost ``auto`` weighs drafts
    against, since where drafting does not pay it retires to that loop (a plain step inside the drafting loop also
    feeds the drafter and can cost more). Each sample is the difference between decoding ``steps + 1`` tokens and 1
    token (prefill and set-up cancel)."""
    if steps < 1:
        return [float(run(prompts, 1, plain=True).stats.elapsed_s)]
    samples = []
    for _ in range(repeats):
        short = run(prompts, 1, plain=True).stats.elapsed_s
        long = run(prompts, steps + 1, plain=True).stats.elapsed_s
        samples.append(max(long - short, 1e-9) / steps)
    return samples


def plain_loop_step(run: Callable[..., Any], prompts: Tensor, steps: int) -> float:
    """The median of three :func:`plain_loop_samples`."""
    return sorted(plain_loop_samples(run, prompts, steps, repeats=3))[1]


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
        # sampling decides from the calibration and this call's own acceptance only, never from timings taken
        # during decoding or from earlier calls (greedy output does not depend on the drafts, so it learns freely).
        memory = AutoMemory(costs=memory.costs)  # the same costs: calibration fills them for both
    policy = AutoPolicy(memory, options, learn_costs=not config.sampling)
    max_depth = max(o.depth for o in options if o is not None)
    if trees:
        drafter = MTPTreeDrafter(module, max_depth)
        drafter.report_ranks = True
        return drafter, AutoSteps(policy, max_depth, tree_mode=True)
    return chain_drafter(module), AutoSteps(policy, max_depth, tree_mode=False)
