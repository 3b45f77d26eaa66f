"""Verification of a draft tree in plain torch: the CPU path and the reference of the Triton kernel.

Each row has a tree of ``T = N + 1`` nodes (node 0 the root = the row's newest token, then the drafts in breadth-first
order, siblings in candidate order; ``parents`` (B, T), ``depths`` (B, T)), and the target model scored every node in
one forward: ``target[b, i]`` is the distribution of the token that follows node i's path.

* ``mode="greedy"``: a node is accepted when its token is the target argmax at its parent and its parent is accepted
  (siblings are distinct, so at most one child of a node matches). The accepted path ends at the deepest accepted
  node; the next token is the target argmax there. The output equals plain greedy decoding.
* ``mode="sampling"``: from the root, the children of the current node are tried in sibling order (recursive
  rejection sampling, Jeon et al. 2024, "Recursive Speculative Decoding"). With the target distribution ``p`` of the
  current node and the distribution ``q`` its children were drawn from, **without replacement** in sibling order:
  candidate ``x_i`` is accepted when ``u_i · q_i(x_i) < p_i(x_i)`` where ``q_i`` is ``q`` with the earlier siblings
  removed and renormalised, and ``p_i`` the residual: ``p_1 = p``, ``p_{i+1} = norm(max(0, p_i - q_i))``. A rejected
  sibling always has ``p_i(x) < q_i(x)``, so it has no mass left in ``p_{i+1}``, consistently with its removal from
  ``q``. When ``draft_probs`` is ``None`` the candidates are *deterministic* (e.g. the drafter's top-k, or a dynamic
  tree): each is then a point mass, ``q_i = δ(x_i)``, so ``x_i`` is accepted with probability ``p_i(x_i)`` and the
  residual is ``p_i`` without ``x_i``. Either way the emitted token at each node has exactly the distribution ``p``
  (each rejection step is standard speculative sampling between ``p_i`` and ``q_i``, and the next candidate's law
  ``q_{i+1}`` holds conditionally on the rejected ones). On acceptance the walk continues at the accepted child with
  that child's own ``p``; when no child is accepted the next token is drawn from the last residual, and at a leaf the
  bonus token from its ``p``, both by the exponential race ``argmax_v r_v / E_v``.

Randomness: :func:`tree_sampling_randomness` draws ``uniforms (B, depth + 1, C)`` float64 (one per tried sibling) then
``exponentials (B, V)`` float32 (one race per row); the Triton kernel consumes the same tensors.

Arithmetic (what lets the kernel return the same tokens bit for bit): float64 throughout; ``p_1`` is the node's
target row normalised on entering the node, and a residual is normalised once, when its sibling is rejected. Every
normalising total is :func:`exact_total` (fixed point, so independent of the order of the additions), an empty
residual is detected by its max, and the race keys are ``float32(p_v) / E_v``. Nodes deeper than ``max_depth`` are
treated as absent.

Example::

    >>> import torch
    >>> tokens = torch.tensor([[7, 2, 3, 4]])            # root, two depth-1 candidates (2, 3), child 4 under 3
    >>> parents = torch.tensor([[0, 0, 0, 2]])
    >>> depths = torch.tensor([[0, 1, 1, 2]])
    >>> logits = torch.zeros(1, 4, 8)
    >>> logits[0, 0, 3] = logits[0, 2, 4] = logits[0, 3, 5] = 1.0   # target: after root 3, after 3 -> 4, then 5
    >>> out = verify_tree_torch(tokens, parents, depths, logits, mode="greedy")
    >>> out.num_accepted.tolist(), out.path.tolist(), out.output_tokens.tolist()
    ([2], [[0, 2, 3]], [[3, 4, 5]])
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

MODES = ("greedy", "sampling")


# ----------------------------------------------------------------------------------------------- tree tables
def ancestors(parents: Tensor, max_depth: int) -> Tensor:
    """(B, T, T) bool: ``[b, i, j]`` is True when node j is node i or one of its ancestors. ``parents`` (B, T)."""
    batch, size = parents.shape
    eye = torch.eye(size, dtype=torch.bool, device=parents.device).expand(batch, size, size)
    anc = eye
    index = parents.unsqueeze(2).expand(batch, size, size)  # row i reads row parents[i]
    for _ in range(max_depth):
        anc = eye | anc.gather(1, index)
    return anc


def children_table(parents: Tensor, max_children: int) -> Tensor:
    """(B, T, C) children of every node in sibling (index) order, -1 padded. ``parents`` (B, T) (root at 0)."""
    batch, size = parents.shape
    device = parents.device
    nodes = torch.arange(1, size, device=device)
    same = parents[:, 1:].unsqueeze(2) == parents[:, 1:].unsqueeze(1)  # (B, N, N)
    earlier = torch.ones(size - 1, size - 1, dtype=torch.bool, device=device).tril(-1)  # [i, j]: j < i
    rank = (same & earlier).sum(dim=2)  # (B, N) position among siblings
    table = torch.full((batch, size * max_children + 1), -1, dtype=torch.long, device=device)
    flat = torch.where(rank < max_children, parents[:, 1:] * max_children + rank, size * max_children)
    table.scatter_(1, flat, nodes.expand(batch, -1))
    return table[:, :-1].view(batch, size, max_children)


def path_to(best: Tensor, anc: Tensor, depths: Tensor, length: int) -> Tensor:
    """(B, length + 1) node indices from the root (column 0) down to node ``best`` (B,), padded with ``best``.

    ``anc`` (B, T, T) from :func:`ancestors`, ``depths`` (B, T).
    """
    batch, size = depths.shape
    rows = torch.arange(batch, device=best.device)
    on_path = anc[rows, best]  # (B, T)
    column = torch.where(on_path, depths, torch.full_like(depths, length + 1))  # (B, T)
    path = best.view(-1, 1).repeat(1, length + 2)
    path.scatter_(1, column, torch.arange(size, device=best.device).expand(batch, size))
    best_depth = depths.gather(1, best.view(-1, 1))  # (B, 1)
    steps = torch.arange(length + 1, device=best.device).view(1, -1)
    return torch.where(steps <= best_depth, path[:, : length + 1], best.view(-1, 1))


# ------------------------------------------------------------------------------------ exact, order-free totals
def fixed_point_scale(vocab: int) -> int:
    """``K`` such that ``vocab`` terms of at most ``2^K`` sum below ``2^63`` (int64)."""
    return 63 - vocab.bit_length()


def exact_total(x: Tensor) -> Tensor:
    """(B,) float64 totals of ``x`` (B, V) float64 >= 0, the same in any summation order (so the kernel's too).

    Each entry is scaled by the row's max into ``[0, 2^K]`` and truncated to an integer; integer sums are exact, so
    the total does not depend on the order of the additions. Relative error below ``V · 2^-K < 2^(2·bits(V) - 63)``
    (2e-9 at V = 128256, far below the float32 rounding of the probabilities themselves); zero iff ``x`` is.
    """
    scale = fixed_point_scale(x.shape[1])
    peak = x.amax(dim=1)  # (B,)
    units = (x / torch.where(peak > 0, peak, 1.0).view(-1, 1) * 2.0**scale).long()  # (B, V) in [0, 2^K]
    return units.sum(dim=1).double() * peak * 2.0**-scale


def positive(total: Tensor) -> Tensor:
    """``total`` with zeros replaced by 1 (dividing an all-zero row leaves it zero)."""
    return torch.where(total > 0, total, torch.ones_like(total))


def normalise(x: Tensor) -> Tensor:
    """(B, V) rows of ``x`` divided by their :func:`exact_total`."""
    return x / positive(exact_total(x)).view(-1, 1)


class TreeVerifyOutput(NamedTuple):
    num_accepted: Tensor
    """(B,) int64: drafts accepted (the depth of the accepted path's last node)."""
    path: Tensor
    """(B, depth + 1) node indices of the accepted path from the root; entries past ``num_accepted`` repeat the last
    accepted node."""
    output_tokens: Tensor
    """(B, depth + 1): the accepted drafts then the next token (corrected or bonus), then -1."""


def check_tree_inputs(tokens: Tensor, parents: Tensor, depths: Tensor, target: Tensor,
                      draft_probs: Optional[Tensor], mode: str) -> tuple[int, int, int]:
    """Validate shapes; returns ``(B, T, V)``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if tokens.dim() != 2 or parents.shape != tokens.shape or depths.shape != tokens.shape:
        raise ValueError(f"tokens, parents and depths must be (B, T), got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(depths.shape)}")
    batch, size = tokens.shape
    if target.dim() != 3 or tuple(target.shape[:2]) != (batch, size):
        raise ValueError(f"target must be (B, T, V) = ({batch}, {size}, V), got {tuple(target.shape)}")
    vocab = target.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, size, vocab):
        raise ValueError(f"draft_probs must be ({batch}, {size}, {vocab}), got {tuple(draft_probs.shape)}")
    return batch, size, vocab


def tree_sampling_randomness(batch: int, depth: int, max_children: int, vocab: int, device: torch.device,
                             generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """``uniforms (B, depth + 1, C)`` float64 and ``exponentials (B, V)`` float32 ~ Exp(1), drawn in that order."""
    uniforms = torch.rand((batch, depth + 1, max_children), dtype=torch.float64, device=device, generator=generator)
    exponentials = torch.empty((batch, vocab), dtype=torch.float32, device=device)
    exponentials.exponential_(generator=generator)
    return uniforms, exponentials


def tree_randomness(uniforms: Optional[Tensor], exponentials: Optional[Tensor], batch: int, depth: int,
                    max_children: int, vocab: int, device: torch.device,
                    generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """The draws of :func:`tree_sampling_randomness` when either is missing, else the given ones checked: uniforms
    (B, depth + 1, >= C) cast to float64, exponentials (B, V) cast to float32, both contiguous on ``device``."""
    if uniforms is None or exponentials is None:
        uniforms, exponentials = tree_sampling_randomness(batch, depth, max_children, vocab, device, generator)
    if uniforms.dim() != 3 or tuple(uniforms.shape[:2]) != (batch, depth + 1) or uniforms.shape[2] < max_children:
        raise ValueError(f"uniforms must be ({batch}, {depth + 1}, >= {max_children}), got {tuple(uniforms.shape)}")
    if tuple(exponentials.shape) != (batch, vocab):
        raise ValueError(f"exponentials must be ({batch}, {vocab}), got {tuple(exponentials.shape)}")
    return uniforms.to(device, torch.float64).contiguous(), exponentials.to(device, torch.float32).contiguous()

def output_tokens(tokens: Tensor, path: Tensor, num_accepted: Tensor, next_token: Tensor) -> Tensor:
    """(B, depth + 1): tokens of the accepted path's drafts, then ``next_token``, then -1."""
    steps = torch.arange(path.shape[1], device=path.device).view(1, -1)
    drafts = tokens.gather(1, path[:, 1:])  # (B, depth) tokens of path nodes 1..depth
    drafts = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)  # (B, depth + 1)
    n = num_accepted.view(-1, 1)
    filler = torch.where(steps == n, next_token.view(-1, 1), torch.full_like(drafts, -1))
    return torch.where(steps < n, drafts, filler)


def max_children_of(parents: Tensor) -> int:
    """Largest number of children of any node (one host sync)."""
    if parents.shape[1] <= 1:
        return 1
    counts = torch.zeros_like(parents).scatter_add_(1, parents[:, 1:], torch.ones_like(parents[:, 1:]))
    return max(1, int(counts.max()))


def verify_tree_torch(
    tokens: Tensor,
    parents: Tensor,
    depths: Tensor,
    target: Tensor,
    draft_probs: Optional[Tensor] = None,
    *,
    mode: str = "greedy",
    max_depth: Optional[int] = None,
    uniforms: Optional[Tensor] = None,
    exponentials: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    anc: Optional[Tensor] = None,
) -> TreeVerifyOutput:
    """Accept the longest valid path of each row's tree and append one corrected (or bonus) token.

    Args:
        tokens: (B, T) node tokens (column 0 the root; -1 = no candidate, never accepted).
        parents: (B, T) parent of each node (breadth-first order: parents before children; root 0).
        depths: (B, T) node depths (root 0).
        target: (B, T, V) target logits or probabilities (greedy) / processed target probabilities ``p`` (sampling).
        draft_probs: (B, T, V) sampling: at each node the distribution its children were drawn from without
            replacement; ``None``: deterministic candidates (point masses).
        max_depth: the trees' depth (computed with one host sync when not given).
        uniforms, exponentials, generator: randomness (see :func:`tree_sampling_randomness`).
        anc: (B or 1, T, T) :func:`ancestors` of ``parents`` when the caller has it already.
    """
    batch, size, vocab = check_tree_inputs(tokens, parents, depths, target, draft_probs, mode)
    depth = int(depths.max()) if max_depth is None else max_depth
    anc = ancestors(parents, depth) if anc is None else anc.expand(batch, size, size)
    rows = torch.arange(batch, device=target.device)
    valid = (tokens >= 0) & (tokens < vocab)
    valid[:, 0] = True
    if mode == "greedy":
        ids = target.argmax(dim=-1)  # (B, T)
        match = valid & (tokens == ids.gather(1, parents))  # (B, T) token is the target's choice after its parent
        match[:, 0] = True
        reached = (~anc | match.unsqueeze(1)).all(dim=2)  # (B, T) every ancestor-or-self matches
        score = torch.where(reached, depths * size - torch.arange(size, device=tokens.device), -1)
        best = score.argmax(dim=1)  # (B,) deepest accepted node (unique: siblings are distinct)
        num_accepted = depths[rows, best]
        path = path_to(best, anc, depths, depth)
        next_token = ids[rows, best]
        return TreeVerifyOutput(num_accepted, path, output_tokens(tokens, path, num_accepted, next_token))

    children = children_table(parents, max_children_of(parents))  # (B, T, C)
    max_children = children.shape[2]
    uniforms, exponentials = tree_randomness(uniforms, exponentials, batch, depth, max_children, vocab, target.device,
                                             generator)
    safe_tokens = tokens.clamp(0, vocab - 1)
    current = torch.zeros(batch, dtype=torch.long, device=target.device)  # (B,) node the walk is at
    searching = torch.ones(batch, dtype=torch.bool, device=target.device)
    final_p = torch.zeros(batch, vocab, dtype=torch.float64, device=target.device)  # (B, V) law of the next token
    for level in range(depth + 1):
        p = normalise(target[rows, current].double())  # (B, V) p_1 at the current node
        q = None if draft_probs is None else draft_probs[rows, current].double()  # (B, V) remaining draft mass
        q_total = None if q is None else exact_total(q)  # (B,)
        moved = torch.zeros(batch, dtype=torch.bool, device=target.device)
        for rank in range(max_children):
            child = children[rows, current, rank]  # (B,)
            trying = searching & ~moved & (child >= 0) & (level < depth)  # nodes deeper than max_depth: ignored
            child = child.clamp_min(0)
            trying &= valid[rows, child]
            x = safe_tokens[rows, child].view(-1, 1)  # (B, 1)
            u = uniforms[:, level, rank]
            p_x = p.gather(1, x).squeeze(1)
            without_x = p.scatter(1, x, 0.0)  # (B, V)
            if q is None:
                accepted = trying & (u < p_x)
                residual = without_x
            else:
                q_i = q / positive(q_total).view(-1, 1)
                q_x = q_i.gather(1, x).squeeze(1)
                accepted = trying & (q_x > 0) & (u * q_x < p_x)
                residual = (p - q_i).clamp_min(0.0)
                empty = residual.amax(dim=1, keepdim=True) == 0  # p_i == q_i: cannot happen but for rounding
                residual = torch.where(empty, without_x, residual)
            rejected = trying & ~accepted
            p = torch.where(rejected.view(-1, 1), normalise(residual), p)
            if q is not None:
                q = torch.where(rejected.view(-1, 1), q.scatter(1, x, 0.0), q)
                q_total = torch.where(rejected, exact_total(q), q_total)
            current = torch.where(accepted, child, current)
            moved |= accepted
        stopped = searching & ~moved  # every row stops by level == depth
        final_p = torch.where(stopped.view(-1, 1), p, final_p)
        searching &= moved
    keys = torch.where(final_p > 0, final_p.float() / exponentials, torch.full_like(exponentials, -1.0))
    next_token = keys.argmax(dim=1)
    num_accepted = depths[rows, current]
    path = path_to(current, anc, depths, depth)
    return TreeVerifyOutput(num_accepted, path, output_tokens(tokens, path, num_accepted, next_token))
