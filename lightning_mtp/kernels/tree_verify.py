"""Draft-tree verification in Triton: same signature, semantics, random numbers and tokens as :func:`verify_tree_torch`.

Greedy, two launches:

1. :func:`_tree_argmax_tile_kernel`, grid ``(node blocks, vocab tiles)``: every node of every row (the ``B·T`` rows of
   ``target``), each vocab tile's max and first argmax (the cost: one read of ``target``).
2. :func:`_tree_walk_kernel`, grid ``(B,)``: reduces the partials to each node's target argmax (max, then smallest id
   among ties, like ``torch.argmax``), then walks the tree: a node is reached when its token is the argmax after its
   parent and its parent is reached; the deepest reached node (first in index order) ends the path. Tree tables are
   ``(T,)`` vectors; "value at my parent" is a ``(T, T)`` one-hot reduction (T is small).

Sampling, two launches:

1. :func:`_tree_sampling_kernel`, grid ``(B,)``: one program per row walks the levels and tries the current node's
   children in sibling order (recursive rejection sampling). The current residual ``p_i`` lives in a ``(B, V)``
   float64 scratch row; each refresh of it (entering a node, or after a rejection) is three passes over the vocab
   in tiles: maxima, fixed-point totals (:func:`~lightning_mtp.kernels.tree_verify_torch.exact_total`: integer sums,
   so the same in any order), then the normalised write. ``q``'s rejected siblings are kept as a short list of
   tokens, not a copy of ``q``. The acceptance tests are scalar loads. At the end the program runs the exponential
   race on its final residual and stores the last accepted node and the next token.
2. :func:`_tree_walk_kernel` with ``SAMPLING``: path and output tokens from that node.

Every float operation is the twin's, in the twin's order, in IEEE float64 (divisions rounded to nearest, race keys
with ``tl.div_rn``), and the only reductions are maxima and integer sums, so the tokens are bitwise the twin's.

Example (CUDA tensors; CPU tensors work under ``TRITON_INTERPRET=1``, slowly)::

    tokens = torch.tensor([[7, 2, 3, 4]], device="cuda")    # root, candidates 2 and 3, then 4 under 3
    parents = torch.tensor([[0, 0, 0, 2]], device="cuda")
    depths = torch.tensor([[0, 1, 1, 2]], device="cuda")
    logits = torch.randn(1, 4, 128256, device="cuda")
    out = verify_tree_triton(tokens, parents, depths, logits, mode="greedy", max_depth=2)
    # identical to verify_tree_torch(tokens, parents, depths, logits, mode="greedy", max_depth=2)
"""

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from lightning_mtp.kernels.dispatch import LazyKernel, check_triton_usable, interpreter_enabled, next_power_of_2
from lightning_mtp.kernels.tree_verify_torch import (
    TreeVerifyOutput,
    check_tree_inputs,
    fixed_point_scale,
    max_children_of,
    tree_randomness,
    verify_tree_torch,
)

try:  # kernels are plain functions built lazily (see LazyKernel); without triton only the annotations need `tl`
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    tl = SimpleNamespace(constexpr=None)


def _tree_argmax_tile_kernel(
    target_ptr,  # (B, T, V) logits or probabilities, last dim contiguous
    stride_tb,
    stride_tt,
    part_val_ptr,  # (B·T, NT) fp32 out: each tile's max
    part_idx_ptr,  # (B·T, NT) int64 out: its first argmax
    R,  # B·T node rows
    T,
    V,
    NT,  # vocab tiles
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_r = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # (BLOCK_R,) node rows b·T + t
    row_ok = rows < R
    offs = pid_t * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)  # (BLOCK_V,)
    mask = row_ok[:, None] & (offs < V)[None, :]  # (BLOCK_R, BLOCK_V)
    base = (rows // T) * stride_tb + (rows % T) * stride_tt  # (BLOCK_R,)
    x = tl.load(target_ptr + base[:, None] + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=1)  # (BLOCK_R,)
    best_idx = tl.min(tl.where(mask & (x == best[:, None]), offs[None, :], V), axis=1)  # masked lanes never win
    tl.store(part_val_ptr + rows * NT + pid_t, best, mask=row_ok)
    tl.store(part_idx_ptr + rows * NT + pid_t, best_idx, mask=row_ok)


def _tree_sampling_kernel(
    target_ptr,  # (B, T, V) target probabilities p, last dim contiguous
    stride_tb,
    stride_tt,
    q_ptr,  # (B, T, V) draft probabilities q (HAS_Q; any tensor otherwise)
    stride_qb,
    stride_qt,
    tokens_ptr,  # (B, T) int64, contiguous
    parents_ptr,  # (B, T) int64, contiguous
    u_ptr,  # (B, depth + 1, C') float64 uniforms, contiguous
    stride_ub,
    stride_ul,
    e_ptr,  # (B, V) float32 exponentials, contiguous
    r_ptr,  # (B, V) float64 scratch: the row's current residual p_i
    best_ptr,  # (B,) int64 out: last accepted node
    next_ptr,  # (B,) int64 out: next token
    T,
    V,
    C,  # most children of any node
    DEPTH,  # max_depth
    FIX_SCALE,  # 2^K, K = fixed_point_scale(V)
    FIX_UNIT,  # 2^-K
    HAS_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_T).to(tl.int64)
    node_ok = nodes < T
    parents = tl.load(parents_ptr + b * T + nodes, mask=node_ok, other=-1)  # (BLOCK_T,)
    tokens = tl.load(tokens_ptr + b * T + nodes, mask=node_ok, other=-1)
    slots = tl.arange(0, BLOCK_C).to(tl.int64)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)
    zeros_v = tl.zeros([BLOCK_V], dtype=tl.int64)  # to broadcast scalars (a scalar in a mask trips the interpreter)
    r_row = r_ptr + b * V

    cur = tl.full([], 0, tl.int64)  # the node the walk is at
    searching = tl.full([], 1, tl.int32)
    for level in range(0, DEPTH + 1):
        t_row = target_ptr + b * stride_tb + cur * stride_tt
        q_row = q_ptr + b * stride_qb + cur * stride_qt
        refresh = searching  # recompute the residual before the next try: on entry, then after each rejection
        x = tl.full([], -1, tl.int64)  # the sibling just rejected (-1 on entry)
        removed = tl.full([BLOCK_C], -1, tl.int64)  # tokens of the siblings rejected before x (q mass removed)
        q_total = tl.full([], 0.0, tl.float64)  # exact total of the remaining q
        last = cur  # last child seen (children come after their parent)
        moved = tl.full([], 0, tl.int32)
        for rank in range(0, C + 1):  # the last round only refreshes after the last sibling's rejection
            if refresh != 0:
                # new: entry -> the node's target row; rejection -> max(0, p_i - q_i), or p_i without x when that is
                # all zero or when there is no q (deterministic candidates). q_next: q without x.
                entry_v = (zeros_v + x) < 0
                peak_new = tl.full([], 0.0, tl.float64)
                peak_alt = tl.full([], 0.0, tl.float64)
                peak_q = tl.full([], 0.0, tl.float64)
                units_new = tl.full([], 0, tl.int64)
                units_q = tl.full([], 0, tl.int64)
                use_alt = tl.full([], 0, tl.int32)
                total_new = tl.full([], 1.0, tl.float64)
                q_div = tl.where(q_total > 0, q_total, 1.0)
                # phase 0: maxima; phase 1: fixed-point totals; phase 2: write p_{i+1} = new / total(new)
                for phase in tl.static_range(3):
                    for start in range(0, V, BLOCK_V):
                        offs = start + cols
                        in_vocab = offs < V
                        p = tl.load(r_row + offs, mask=in_vocab & ~entry_v, other=0.0)
                        t = tl.load(t_row + offs, mask=in_vocab & entry_v, other=0.0).to(tl.float32).to(tl.float64)
                        alt = tl.where(offs == x, 0.0, p)
                        if HAS_Q:
                            q = tl.load(q_row + offs, mask=in_vocab, other=0.0).to(tl.float32).to(tl.float64)
                            gone = tl.max((offs[:, None] == removed[None, :]).to(tl.int32), axis=1) > 0
                            q = tl.where(gone, 0.0, q)  # (BLOCK_V,) remaining mass, before x's removal
                            q_next = tl.where(offs == x, 0.0, q)
                            residual = tl.maximum(p - q / q_div, 0.0)
                            new = tl.where(entry_v, t, residual)
                        else:
                            q_next = alt  # unused
                            new = tl.where(entry_v, t, alt)
                        if phase == 0:
                            peak_new = tl.maximum(peak_new, tl.max(new, axis=0))
                            peak_alt = tl.maximum(peak_alt, tl.max(alt, axis=0))
                            if HAS_Q:
                                peak_q = tl.maximum(peak_q, tl.max(q_next, axis=0))
                        else:
                            new = tl.where((zeros_v + use_alt) != 0, alt, new)
                            if phase == 1:
                                units_new += tl.sum((new / peak_new * FIX_SCALE).to(tl.int64), axis=0)
                                if HAS_Q:
                                    units_q += tl.sum((q_next / peak_q * FIX_SCALE).to(tl.int64), axis=0)
                            else:
                                tl.store(r_row + offs, new / total_new, mask=in_vocab)
                    if phase == 0:
                        if HAS_Q:  # an all-zero residual (p_i == q_i up to rounding): drop x from p_i instead
                            use_alt = ((x >= 0) & (peak_new == 0.0)).to(tl.int32)
                            peak_new = tl.where(use_alt != 0, peak_alt, peak_new)
                        # totals are zero iff the row is: divide by 1 then (as exact_total's callers do)
                        peak_true_new = peak_new
                        peak_true_q = peak_q
                        peak_new = tl.where(peak_new > 0, peak_new, 1.0)
                        peak_q = tl.where(peak_q > 0, peak_q, 1.0)
                    if phase == 1:
                        total_new = units_new.to(tl.float64) * peak_true_new * FIX_UNIT
                        total_new = tl.where(total_new > 0, total_new, 1.0)
                        if HAS_Q:
                            q_total = units_q.to(tl.float64) * peak_true_q * FIX_UNIT
                tl.debug_barrier()  # the scalar loads below read what other threads wrote
                removed = tl.where(slots == rank - 1, x, removed)

            # try the child of rank `rank`
            child = tl.min(tl.where(node_ok & (parents == cur) & (nodes > last), nodes, BLOCK_T), axis=0)
            has_child = child < T
            last = tl.where(has_child, child, last)
            token = tl.sum(tl.where(nodes == child, tokens, 0), axis=0)
            trying = (searching != 0) & (moved == 0) & has_child & (rank < C) & (level < DEPTH)
            trying = trying & (token >= 0) & (token < V)
            x_safe = tl.minimum(tl.maximum(token, 0), V - 1)
            u = tl.load(u_ptr + b * stride_ub + level * stride_ul + tl.minimum(rank, C - 1))
            p_x = tl.load(r_row + x_safe)
            if HAS_Q:
                q_x = tl.load(q_row + x_safe).to(tl.float32).to(tl.float64)
                q_x = tl.where(tl.max((removed == x_safe).to(tl.int32), axis=0) > 0, 0.0, q_x)
                q_x = q_x / tl.where(q_total > 0, q_total, 1.0)
                accepted = trying & (q_x > 0.0) & (u * q_x < p_x)
            else:
                accepted = trying & (u < p_x)
            refresh = (trying & ~accepted).to(tl.int32)
            x = x_safe
            moved = moved | accepted.to(tl.int32)
            cur = tl.where(accepted, child, cur)
        searching = searching & moved

    # exponential race on the final residual: argmax_v float32(p_v) / E_v, first index among ties
    best_key = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        in_vocab = offs < V
        p = tl.load(r_row + offs, mask=in_vocab, other=0.0)
        e = tl.load(e_ptr + b * V + offs, mask=in_vocab, other=1.0)
        key = tl.where(p > 0.0, tl.div_rn(p.to(tl.float32), e), -1.0)
        key = tl.where(in_vocab, key, float("-inf"))
        tile_key = tl.max(key, axis=0)
        tile_idx = tl.min(tl.where(in_vocab & (key == tile_key), offs, V), axis=0)
        best_idx = tl.where(tile_key > best_key, tile_idx, best_idx)  # strict: earlier tiles win ties
        best_key = tl.maximum(best_key, tile_key)
    tl.store(best_ptr + b, cur)
    tl.store(next_ptr + b, tl.minimum(best_idx, V - 1))


def _tree_walk_kernel(
    tokens_ptr,  # (B, T) int64, contiguous
    parents_ptr,  # (B, T) int64, contiguous
    depths_ptr,  # (B, T) int64, contiguous
    part_val_ptr,  # (B·T, NT) fp32 (greedy)
    part_idx_ptr,  # (B·T, NT) int64 (greedy)
    best_ptr,  # (B,) int64: in (sampling)
    next_ptr,  # (B,) int64: in (sampling)
    num_accepted_ptr,  # (B,) int64 out
    path_ptr,  # (B, depth + 1) int64 out
    out_ptr,  # (B, depth + 1) int64 out
    T,
    V,
    NT,
    DEPTH,
    SAMPLING: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_NT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_T).to(tl.int64)
    node_ok = nodes < T
    tokens = tl.load(tokens_ptr + b * T + nodes, mask=node_ok, other=-1)  # (BLOCK_T,)
    parents = tl.load(parents_ptr + b * T + nodes, mask=node_ok, other=-1)
    depths = tl.load(depths_ptr + b * T + nodes, mask=node_ok, other=-1)
    is_parent = (parents[:, None] == nodes[None, :]) & node_ok[:, None]  # (BLOCK_T, BLOCK_T): [i, j] j parent of i
    if SAMPLING:
        best = tl.load(best_ptr + b)
        next_token = tl.load(next_ptr + b)
    else:
        tiles = tl.arange(0, BLOCK_NT).to(tl.int64)
        mask = node_ok[:, None] & (tiles < NT)[None, :]  # (BLOCK_T, BLOCK_NT)
        part = (b * T + nodes)[:, None] * NT + tiles[None, :]
        val = tl.load(part_val_ptr + part, mask=mask, other=float("-inf"))
        idx = tl.load(part_idx_ptr + part, mask=mask, other=V)
        peak = tl.max(val, axis=1)
        ids = tl.min(tl.where(mask & (val == peak[:, None]), idx, V), axis=1)  # (BLOCK_T,) target argmax per node
        ids = tl.minimum(tl.maximum(ids, 0), V - 1)
        after_parent = tl.sum(tl.where(is_parent, ids[None, :], 0), axis=1)  # (BLOCK_T,) argmax at the parent
        match = ((tokens >= 0) & (tokens < V) & (tokens == after_parent)) | (nodes == 0)
        match = match & node_ok
        reached = match  # after k rounds: self and k ancestors match (the twin's ancestors() with k = DEPTH)
        for _ in range(0, DEPTH):
            parent_reached = tl.max(tl.where(is_parent, reached.to(tl.int32)[None, :], 0), axis=1) > 0
            reached = match & parent_reached
        score = tl.where(reached, depths * T - nodes, -1)
        top = tl.max(score, axis=0)
        best = tl.min(tl.where(node_ok & (score == top), nodes, BLOCK_T), axis=0)
        next_token = tl.sum(tl.where(nodes == best, ids, 0), axis=0)
    # the path: best and its ancestors, one per depth
    on_path = nodes == best
    for _ in range(0, DEPTH):
        parent_of_on = tl.max(tl.where(is_parent & on_path[:, None], 1, 0), axis=0) > 0  # (BLOCK_T,) over j
        on_path = on_path | parent_of_on
    n = tl.sum(tl.where(nodes == best, depths, 0), axis=0)
    steps = tl.arange(0, BLOCK_D).to(tl.int64)
    steps_ok = steps <= DEPTH
    at_step = on_path[None, :] & (depths[None, :] == steps[:, None])  # (BLOCK_D, BLOCK_T)
    path = tl.max(tl.where(at_step, nodes[None, :], -1), axis=1)
    path = tl.where((steps <= n) & (path >= 0), path, best)
    after_step = on_path[None, :] & (depths[None, :] == steps[:, None] + 1)
    drafts = tl.max(tl.where(after_step, tokens[None, :], -1), axis=1)  # token of the path node at depth step + 1
    out = tl.where(steps < n, drafts, tl.where(steps == n, next_token, -1))
    tl.store(path_ptr + b * (DEPTH + 1) + steps, path, mask=steps_ok)
    tl.store(out_ptr + b * (DEPTH + 1) + steps, out, mask=steps_ok)
    tl.store(num_accepted_ptr + b, n)


tree_argmax_tile_kernel = LazyKernel(_tree_argmax_tile_kernel)
tree_sampling_kernel = LazyKernel(_tree_sampling_kernel)
tree_walk_kernel = LazyKernel(_tree_walk_kernel)


def _block_sizes(rows: int, vocab: int, interpret: bool):
    """(BLOCK_R, BLOCK_V argmax, BLOCK_V sampling): one node row × 4096 ids per argmax program and 1024 float64 ids
    per sampling tile on GPU; many rows × small tiles under the interpreter (several tiles, a partial last one)."""
    if interpret:
        return min(1024, next_power_of_2(rows)), min(64, next_power_of_2(vocab)), min(32, next_power_of_2(vocab))
    return 1, min(4096, next_power_of_2(vocab)), min(1024, next_power_of_2(vocab))


def verify_tree_triton(
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
) -> TreeVerifyOutput:
    """Triton twin of :func:`verify_tree_torch`: same arguments (documented there), outputs and random numbers.

    Needs CUDA tensors, or ``TRITON_INTERPRET=1`` for CPU tensors (tests).
    """
    batch, size, vocab = check_tree_inputs(tokens, parents, depths, target, draft_probs, mode)
    check_triton_usable(tokens, parents, depths, target, draft_probs)
    device = target.device
    depth = int(depths.max()) if max_depth is None else max_depth
    tokens, parents, depths = (t.to(device=device, dtype=torch.long).contiguous() for t in (tokens, parents, depths))
    if target.stride(-1) != 1:
        target = target.contiguous()
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.zeros((batch, depth + 1), dtype=torch.long, device=device)
    out_tokens = torch.full((batch, depth + 1), -1, dtype=torch.long, device=device)
    if batch == 0:
        return TreeVerifyOutput(num_accepted, path, out_tokens)

    interpret = interpreter_enabled()
    block_r, block_v, block_v_sampling = _block_sizes(batch * size, vocab, interpret)
    block_t = next_power_of_2(size)
    if mode == "greedy":
        num_tiles = triton_cdiv(vocab, block_v)
        part_val = torch.empty((batch * size, num_tiles), dtype=torch.float32, device=device)
        part_idx = torch.empty((batch * size, num_tiles), dtype=torch.long, device=device)
        tree_argmax_tile_kernel[(triton_cdiv(batch * size, block_r), num_tiles)](
            target, target.stride(0), target.stride(1), part_val, part_idx, batch * size, size, vocab, num_tiles,
            BLOCK_R=block_r, BLOCK_V=block_v, num_warps=4,
        )
        best = next_token = num_accepted  # unused
    else:
        max_children = max_children_of(parents)
        uniforms, exponentials = tree_randomness(uniforms, exponentials, batch, depth, max_children, vocab, device,
                                                 generator)
        has_q = draft_probs is not None
        q = (draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()) if has_q else target
        scale = fixed_point_scale(vocab)
        residual = torch.empty((batch, vocab), dtype=torch.float64, device=device)  # scratch
        best = torch.empty(batch, dtype=torch.long, device=device)
        next_token = torch.empty(batch, dtype=torch.long, device=device)
        tree_sampling_kernel[(batch,)](
            target, target.stride(0), target.stride(1), q, q.stride(0), q.stride(1), tokens, parents,
            uniforms, uniforms.stride(0), uniforms.stride(1), exponentials, residual, best, next_token,
            size, vocab, max_children, depth, 2.0**scale, 2.0**-scale,
            HAS_Q=has_q, BLOCK_T=block_t, BLOCK_C=next_power_of_2(max_children), BLOCK_V=block_v_sampling,
            num_warps=1 if interpret else 4,
        )
        num_tiles, part_val, part_idx = 1, target, target  # unused
    tree_walk_kernel[(batch,)](
        tokens, parents, depths, part_val, part_idx, best, next_token, num_accepted, path, out_tokens,
        size, vocab, num_tiles, depth,
        SAMPLING=mode == "sampling", BLOCK_T=block_t, BLOCK_NT=next_power_of_2(num_tiles),
        BLOCK_D=next_power_of_2(depth + 1), num_warps=1 if interpret else (4 if block_t <= 64 else 8),
    )
    return TreeVerifyOutput(num_accepted, path, out_tokens)


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division (what ``triton.cdiv`` does, without importing triton)."""
    return -(-a // b)


__all__ = ["TreeVerifyOutput", "verify_tree_torch", "verify_tree_triton"]
