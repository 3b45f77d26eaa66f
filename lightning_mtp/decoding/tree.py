"""Draft trees: their shapes, the batched node tables a step builds, and the attention masks that verify them.

A step's tree has a root, node 0 = each row's newest token (emitted, not yet run through the trunk), and ``N`` draft
nodes ``1..N`` in breadth-first order (every parent has a smaller index than its children; siblings are in candidate
order). Node ``i`` sits at depth ``depth[i]`` (the root at 0), so its position is ``newest + depth[i]``; in the trunk's
positional KV cache it is written at slot ``newest + i`` during verification, and after acceptance the accepted path's
entries are moved to slots ``newest + 1, newest + 2, ...`` (their real positions).

Two kinds of tree:

* **static** (:class:`TreeShape` ``branching=(4, 2, 1)``, Medusa / SGLang style): every node at depth ``d - 1`` gets the
  ``branching[d-1]`` best candidates of depth ``d``; ``(1, 1, 1)`` is the chain of three drafts.
* **dynamic** (``nodes=N``, EAGLE-2 style): each depth expands the ``top_k`` nodes with the highest cumulative draft
  log-probability, and the tree is the ``N`` best candidates of all depths (an ancestor-closed set, since a child's
  cumulative score never exceeds its parent's).

Example::

    >>> shape = TreeShape(branching=(2, 1))
    >>> shape.num_nodes, shape.depth
    (4, 2)
    >>> static_layout(shape).parents.tolist()
    [0, 0, 0, 1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from lightning_mtp.kernels.tree_verify_torch import ancestors, children_table, path_to  # noqa: F401 (re-exported)

MAX_DRAFT_DEPTH = 16
"""Deepest draft (tree depth or chain length) a step may propose; drafts beyond the MTP depth D re-apply the last
cascaded module (see :mod:`lightning_mtp.decoding.tree_drafting`)."""


@dataclass(frozen=True)
class TreeShape:
    """The shape of a step's draft tree: ``branching`` (static) or ``nodes`` + ``top_k`` + ``depth`` (dynamic)."""

    branching: Optional[tuple[int, ...]] = None
    """Static tree: children per node at each depth, e.g. ``(4, 2, 1)``."""
    nodes: Optional[int] = None
    """Dynamic tree: the number of draft nodes kept (the verify forward scores ``nodes + 1`` tokens per row)."""
    top_k: int = 4
    """Dynamic tree: candidates per expanded node, and nodes expanded per depth."""
    max_depth: int = 0
    """Dynamic tree: deepest level drafted."""

    def __post_init__(self) -> None:
        if (self.branching is None) == (self.nodes is None):
            raise ValueError("a TreeShape is either static (branching) or dynamic (nodes), not both")
        if self.branching is not None:
            if not self.branching or any(not isinstance(b, int) or b < 1 for b in self.branching):
                raise ValueError(f"branching must be a non-empty list of integers >= 1, got {self.branching!r}")
        elif self.nodes < 1 or self.top_k < 1 or self.max_depth < 1:
            raise ValueError("a dynamic tree needs nodes, top_k and max_depth >= 1")

    @property
    def dynamic(self) -> bool:
        return self.nodes is not None

    @property
    def depth(self) -> int:
        return len(self.branching) if self.branching is not None else self.max_depth

    @property
    def num_nodes(self) -> int:
        """Draft nodes per row (the root excluded)."""
        if self.dynamic:
            return self.nodes
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    @property
    def is_chain(self) -> bool:
        return not self.dynamic and all(b == 1 for b in self.branching)

    def describe(self) -> str:
        if self.dynamic:
            return f"dynamic(nodes={self.nodes}, top_k={self.top_k}, depth={self.max_depth})"
        return "chain" + str(self.depth) if self.is_chain else "tree" + str(list(self.branching))

    @staticmethod
    def chain(length: int) -> TreeShape:
        return TreeShape(branching=(1,) * length)


class StaticLayout(NamedTuple):
    """Node tables of a static tree (nodes ``1..N``; index 0 of ``parents`` / ``depths`` is the root)."""

    parents: Tensor
    """(N+1,) parent of each node (the root is its own parent)."""
    depths: Tensor
    """(N+1,) depth of each node (root 0)."""
    ranks: Tensor
    """(N+1,) position of each node among its siblings (candidate order; root 0)."""


def static_layout(shape: TreeShape, device: Optional[torch.device] = None) -> StaticLayout:
    """Breadth-first node tables of a static tree; siblings are consecutive, in candidate order."""
    parents, depths, ranks = [0], [0], [0]
    frontier = [0]
    for d, b in enumerate(shape.branching, start=1):
        nxt = []
        for parent in frontier:
            for r in range(b):
                parents.append(parent)
                depths.append(d)
                ranks.append(r)
                nxt.append(len(parents) - 1)
        frontier = nxt
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return StaticLayout(as_tensor(parents), as_tensor(depths), as_tensor(ranks))


class DraftTree(NamedTuple):
    """One step's draft trees, one per row (the same node count in every row)."""

    tokens: Tensor
    """(B, N+1) token of each node: column 0 the newest token, then the drafts; -1 = no candidate (never accepted)."""
    parents: Tensor
    """(B, N+1) parent index of each node (root: 0)."""
    depths: Tensor
    """(B, N+1) depth of each node (root: 0)."""
    probs: Optional[Tensor]
    """(B, N+1, V) sampling with sampled candidates: at each node, the draft distribution ``q`` its children were drawn
    from (without replacement, in sibling order). ``None``: greedy, or deterministic candidates (verified as point
    masses, see :mod:`lightning_mtp.kernels.tree_verify_torch`)."""
    anc: Optional[Tensor] = None
    """(B or 1, N+1, N+1) :func:`ancestors` of ``parents``, when known (static trees: computed once per shape)."""

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1] - 1


def tree_attention_mask(prefix_end: Tensor, first_slot: Tensor, anc: Tensor, cache_len: int,
                        linear_positions: Optional[Tensor] = None) -> Tensor:
    """(B, 1, W + T, S) bool mask of a forward over ``W`` linear positions followed by ``T`` tree nodes, over the
    first ``S = cache_len`` cache slots (at least every slot in use: :func:`~lightning_mtp.layers.attention_width`).

    Linear queries (``linear_positions`` (B, W)) see slots ``0..position`` (causal). Tree node i sees the slots
    ``<= prefix_end`` (B,) and the slots ``first_slot + j`` (``first_slot`` (B,)) of its ancestors-or-self j in
    ``anc`` (B, T, T).
    """
    batch, size, _ = anc.shape
    slots = torch.arange(cache_len, device=anc.device)
    tree = (slots.view(1, 1, -1) <= prefix_end.view(-1, 1, 1)).expand(batch, size, cache_len).clone()  # (B, T, S)
    columns = (first_slot.view(-1, 1) + torch.arange(size, device=anc.device)).view(batch, 1, size)
    tree.scatter_(2, columns.expand(batch, size, size), anc)
    if linear_positions is None or linear_positions.shape[1] == 0:
        return tree.unsqueeze(1)
    linear = slots.view(1, 1, -1) <= linear_positions.unsqueeze(-1)  # (B, W, S)
    return torch.cat([linear, tree], dim=1).unsqueeze(1)
