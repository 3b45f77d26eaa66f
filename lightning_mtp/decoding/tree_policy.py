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

from typing import Any, Optional

import torch
from torch import nn

from lightning_mtp.decoding.auto import (
    AutoMemory,
    AutoPolicy,
    candidate_options,
    memory_for,
)
from lightning_mtp.decoding.calibration import RoundRobin
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
    ``calibration`` set, the round-robin calibration run instead
    (:func:`~lightning_mtp.decoding.calibration.calibrate_steps`)."""

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
        else:
            self.policy.observe_seconds(shape, seconds)  # greedy: paired steps correct the prices
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
    policy = AutoPolicy(memory, options, batch, config.max_new_tokens, learn_prices=not config.sampling)
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
