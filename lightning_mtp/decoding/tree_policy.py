"""Which drafter a decoding call uses and what each of its steps drafts.

``speculative=False``: none. ``True``: the chain drafter for ``draft_tokens <= D`` (fixed or adaptive length,
:class:`~lightning_mtp.decoding.drafting.DraftLength`), else the tree drafter with one :class:`FixedTree` shape.
``"auto"``: :class:`~lightning_mtp.decoding.auto.AutoPolicy` choosing per step among a plain step and chains of 1..D
(D + 1 for cascaded modules; the chain drafter), or a plain step and a named tree or longer chain (the tree
drafter). ``auto`` keeps the fixed chain of D when decoding is sharded over several processes (every rank must run
the same forwards) and with a chain-only option (``compile``, ``acceptance="typical"``,
``draft_confidence_threshold``, ``adaptive_draft_tokens``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_mtp.decoding.auto import SWITCHES, AutoMemory, AutoPolicy, candidate_options, memory_for
from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.host import supports_trees
from lightning_mtp.decoding.native_drafting import chain_drafter
from lightning_mtp.decoding.step_cost import draft_cost_share
from lightning_mtp.decoding.tree import TreeShape
from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter


class FixedTree:
    """Every step drafts the same tree (or chain) shape."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape, self.max_nodes = shape, shape.num_nodes + 1

    def next(self) -> TreeShape:
        return self.shape

    def observe_step(self, option: Any, extra: list, active_rows: int, seconds: float) -> None:
        """Nothing to learn."""


class AutoSteps:
    """:class:`~lightning_mtp.decoding.auto.AutoPolicy` as a decoding loop's policy, for the chain drafter (options
    are draft counts) or, for a named tree or a chain longer than D, the tree drafter (``tree_mode``: shapes)."""

    def __init__(self, policy: AutoPolicy, tree_mode: bool) -> None:
        self.policy, self.tree_mode = policy, tree_mode
        self.max_nodes = max(o.num_nodes for o in policy.options if o is not None) + 1 if tree_mode else 0
        self.retired = policy.retired  # the call decodes plainly from its first step (no drafter is set up)
        self.per_row = policy.batch_size > 1  # the loop reports each row's accepted drafts and budget (one row's: none)

    def next(self) -> Any:
        option = self.policy.next()
        if self.tree_mode:
            return option
        return 0 if option is None else option.depth  # the chain drafter takes a draft count

    def observe_step(self, option: Any, reached: list, active_rows: int, seconds: float, **rows: list) -> None:
        """``reached``: per depth, the rows whose accepted path reached it (zeros beyond the step's draft); ``rows``:
        each row's accepted drafts (``rows``, -1: finished) and the tokens it may still emit (``remaining``)."""
        shape = option if self.tree_mode else (None if option == 0 else TreeShape.chain(option))
        self.policy.observe(shape, active_rows, reached[: 0 if shape is None else shape.depth], seconds, **rows)


def draft_plan(module: nn.Module, host: Any, config: GenerationConfig, batch: int, device: torch.device,
               sync_ranks: bool, seeded: bool = False) -> tuple[Optional[Any], Optional[Any]]:
    """(drafter, step policy) of a decoding call; ``(None, None)`` for plain decoding. ``seeded``: the call samples
    from a seed or a generator (see :mod:`~lightning_mtp.decoding.auto`)."""
    if config.speculative is False:
        return None, None
    modules = module.require_mtp_modules()
    module.mtp_check_dtypes("speculative decoding")
    depth = len(modules)
    trees = supports_trees(host) and module.mtp_config.layout != "native"  # native blocks draft chains only
    widest = max(getattr(config.tree_shape(depth), "branching", None) or [0])
    if widest > host.vocab_size:  # top-k of more candidates than there are tokens
        raise ValueError(f"draft_tree: {widest} candidates per node, more than the {host.vocab_size} token ids")
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
                f"{getattr(host, 'tree_refusal', None) or type(host).__name__}: it cannot verify draft trees or "
                f"chains longer than the MTP depth D={depth} (draft_tree / draft_tree_nodes / draft_tokens > D need a "
                "host with forward_tree and keep_path, e.g. the bundled CausalLM); use draft_tokens <= D, or "
                "speculative='auto'"
            )
        return MTPTreeDrafter(module, shape.depth), FixedTree(shape)
    if sync_ranks or config.chain_options():  # a chain-only option, or every rank must draft the same
        if config.tree_shape(depth) is not None:
            why = "sharded decoding on several processes" if sync_ranks else ", ".join(config.chain_options())
            raise ValueError(f"draft_tokens={config.draft_tokens} > D={depth} (a chain through re-applied modules) "
                             f"cannot be combined with {why}; use draft_tokens <= {depth}")
        return chain_drafter(module), None
    requested = config.tree_shape(depth)
    if requested is not None and not trees:
        raise ValueError(f"{getattr(host, 'tree_refusal', None) or type(host).__name__}: it cannot verify draft "
                         f"trees (draft_tree / draft_tree_nodes / draft_tokens > D={depth}); leave them unset with "
                         "speculative='auto'")
    # Chains of 1..D by the chain drafter, and of D + 1 for cascaded modules (the last module re-applied: it paid on
    # the quickstart model, docs/decoding.md).
    beyond = int(module.mtp_config.architecture == "cascaded" and module.mtp_config.layout != "native")
    options = [None, requested] if requested is not None else candidate_options(config.draft_tokens or depth + beyond)
    # A seeded sampling call decides without timings or earlier calls: which draft a step makes decides which random
    # numbers it consumes, so a seed must give the same samples wherever it runs (the prior cost model and the call's
    # own acceptance only).
    timings = not (config.sampling and seeded)
    dtype = module.mtp_output_head().weight.dtype
    key = (type(host).__name__, batch, str(device), str(dtype), config.sampling, timings,
           tuple(o and o.describe() for o in options))
    build = lambda: AutoMemory.fresh(draft_cost_share(module), learn_costs=timings)  # noqa: E731  (weights read once)
    memory = memory_for(module, key, build) if SWITCHES.memory and timings else build()
    policy = AutoPolicy(memory, options, batch, timings=timings, max_new_tokens=config.max_new_tokens)
    deepest = max(o.depth for o in options if o is not None)
    if deepest > depth + beyond or not options[-1].is_chain:  # a tree, or a longer chain: the tree drafter
        return MTPTreeDrafter(module, deepest), AutoSteps(policy, tree_mode=True)
    return chain_drafter(module, deepest), AutoSteps(policy, tree_mode=False)
