"""Speculative verification in Triton: same signature, semantics and random numbers as :func:`verify_drafts_torch`.

Two launches cover the whole batch:

1. :func:`_verify_tile_kernel`, grid ``(row blocks, vocab tiles)``: each program takes ``BLOCK_B`` rows and one
   ``BLOCK_V`` vocab tile. Greedy: the tile's max and first argmax at every one of the ``k + 1`` positions. Sampling:
   the acceptance test (``k`` gathered probabilities per row, cheap, recomputed by every tile; tile 0 stores
   ``num_accepted``), then the tile's winner of the exponential race at the row's correction position ``n``, both on
   the residual ``max(0, p_n - q_n)`` and, for the fallback, on ``p_n``.
2. :func:`_verify_finalize_kernel`, grid ``(row blocks,)``: reduces the per-tile partials (max value, then smallest id
   among ties, so the result is the first argmax like ``torch.argmax``) and writes ``num_accepted`` and
   ``output_tokens``.

Vocab tiles are masked (masked lanes never win) and the final ids are clamped to ``[0, V)``. Divisions use
``tl.div_rn`` (IEEE round-to-nearest) so race keys are bitwise those of the torch twin.

Example (CUDA tensors; CPU tensors work under ``TRITON_INTERPRET=1``, slowly)::

    p = torch.softmax(torch.randn(64, 5, 128256, device="cuda"), -1)  # target probs, k = 4
    q = torch.softmax(torch.randn(64, 4, 128256, device="cuda"), -1)  # draft probs
    drafts = torch.multinomial(q.flatten(0, 1), 1).view(64, 4)
    gen = torch.Generator("cuda").manual_seed(0)
    out = verify_drafts_triton(drafts, p, q, mode="sampling", generator=gen)
    # identical to verify_drafts_torch(drafts, p, q, mode="sampling", generator=<same seed>)
"""

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from lightning_mtp.kernels.dispatch import LazyKernel, check_triton_usable, interpreter_enabled, next_power_of_2
from lightning_mtp.kernels.speculative_verify_torch import (
    VerifyOutput,
    check_verify_inputs,
    sampling_randomness,
    verify_drafts_torch,
)

try:  # kernels are plain functions built lazily (see LazyKernel); without triton only the annotations need `tl`
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    tl = SimpleNamespace(constexpr=None)


def _verify_tile_kernel(
    draft_ptr,  # (B, k) int64
    stride_db,
    target_ptr,  # (B, k+1, V) logits/probs (greedy) or p (sampling), last dim contiguous
    stride_tb,
    stride_tj,
    q_ptr,  # (B, k, V) draft probs (sampling; any tensor otherwise)
    stride_qb,
    stride_qj,
    u_ptr,  # (B, k) float64 uniforms (sampling)
    stride_ub,
    e_ptr,  # (B, V) float32 exponentials (sampling)
    stride_eb,
    num_accepted_ptr,  # (B,) int64 out (sampling)
    part_val_ptr,  # (B, S, T) fp32 out; S = k+1 positions (greedy) or 2 races (sampling)
    part_idx_ptr,  # (B, S, T) int64 out
    B,
    K,
    V,
    T,
    SAMPLING: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1).to(tl.int64)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)  # (BLOCK_B,)
    row_ok = rows < B
    offs = pid_t * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)  # (BLOCK_V,)
    mask = row_ok[:, None] & (offs < V)[None, :]  # (BLOCK_B, BLOCK_V)
    if SAMPLING:
        # acceptance: alive while every draft so far passed u * q(x) < p(x), in float64
        alive = row_ok
        n = tl.zeros([BLOCK_B], dtype=tl.int64)
        for j in range(0, K):
            x = tl.load(draft_ptr + rows * stride_db + j, mask=row_ok, other=-1)
            x_ok = (x >= 0) & (x < V)
            x_safe = tl.minimum(tl.maximum(x, 0), V - 1)
            p_x = tl.load(target_ptr + rows * stride_tb + j * stride_tj + x_safe, mask=row_ok, other=0.0)
            q_x = tl.load(q_ptr + rows * stride_qb + j * stride_qj + x_safe, mask=row_ok, other=0.0)
            p_x = p_x.to(tl.float32).to(tl.float64)
            q_x = q_x.to(tl.float32).to(tl.float64)
            u = tl.load(u_ptr + rows * stride_ub + j, mask=row_ok, other=1.0)
            alive = alive & x_ok & (q_x > 0.0) & (u * q_x < p_x)
            n += alive.to(tl.int64)
        first_tile = (tl.zeros([BLOCK_B], dtype=tl.int64) + pid_t) == 0  # (a scalar in a mask trips the interpreter)
        tl.store(num_accepted_ptr + rows, n, mask=row_ok & first_tile)

        # exponential race at position n on the residual max(0, p - q) (q = 0 at the bonus position n == k)
        p = tl.load(
            target_ptr + rows[:, None] * stride_tb + n[:, None] * stride_tj + offs[None, :], mask=mask, other=0.0
        )
        p = p.to(tl.float32)
        n_q = tl.maximum(tl.minimum(n, K - 1), 0)
        q_mask = mask & (n < K)[:, None]
        q = tl.load(
            q_ptr + rows[:, None] * stride_qb + n_q[:, None] * stride_qj + offs[None, :], mask=q_mask, other=0.0
        )
        q = q.to(tl.float32)
        e = tl.load(e_ptr + rows[:, None] * stride_eb + offs[None, :], mask=mask, other=1.0).to(tl.float32)
        residual = tl.maximum(p - q, 0.0)
        safe_e = tl.where(mask, e, 1.0)
        key_r = tl.where(residual > 0.0, tl.div_rn(residual, safe_e), -1.0)
        key_p = tl.where(p > 0.0, tl.div_rn(p, safe_e), -1.0)
        # this tile's winner of each race: max key, smallest id among ties; masked lanes never win
        out_off = rows * (2 * T) + pid_t  # slot 0: residual race, slot 1 (+T): fallback race on p
        key_r = tl.where(mask, key_r, float("-inf"))
        best_r = tl.max(key_r, axis=1)  # (BLOCK_B,)
        tl.store(part_val_ptr + out_off, best_r, mask=row_ok)
        tl.store(
            part_idx_ptr + out_off,
            tl.min(tl.where(mask & (key_r == best_r[:, None]), offs[None, :], V), axis=1),
            mask=row_ok,
        )
        key_p = tl.where(mask, key_p, float("-inf"))
        best_p = tl.max(key_p, axis=1)
        tl.store(part_val_ptr + out_off + T, best_p, mask=row_ok)
        tl.store(
            part_idx_ptr + out_off + T,
            tl.min(tl.where(mask & (key_p == best_p[:, None]), offs[None, :], V), axis=1),
            mask=row_ok,
        )
    else:
        for j in range(0, K + 1):
            x = tl.load(
                target_ptr + rows[:, None] * stride_tb + j * stride_tj + offs[None, :], mask=mask, other=float("-inf")
            ).to(tl.float32)
            best = tl.max(x, axis=1)
            best_idx = tl.min(tl.where(mask & (x == best[:, None]), offs[None, :], V), axis=1)
            out_off = rows * ((K + 1) * T) + j * T + pid_t
            tl.store(part_val_ptr + out_off, best, mask=row_ok)
            tl.store(part_idx_ptr + out_off, best_idx, mask=row_ok)


def _verify_finalize_kernel(
    draft_ptr,  # (B, k) int64
    stride_db,
    num_accepted_ptr,  # (B,) int64: in (sampling) / out (greedy)
    part_val_ptr,  # (B, S, T) fp32
    part_idx_ptr,  # (B, S, T) int64
    out_ptr,  # (B, k+1) int64 out
    stride_ob,
    B,
    K,
    V,
    T,
    SAMPLING: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    row_ok = rows < B
    tiles = tl.arange(0, BLOCK_T).to(tl.int64)
    mask = row_ok[:, None] & (tiles < T)[None, :]  # (BLOCK_B, BLOCK_T)
    if SAMPLING:
        n = tl.load(num_accepted_ptr + rows, mask=row_ok, other=0)
        base = rows[:, None] * (2 * T) + tiles[None, :]
        val_r = tl.load(part_val_ptr + base, mask=mask, other=float("-inf"))
        idx_r = tl.load(part_idx_ptr + base, mask=mask, other=V)
        best_r = tl.max(val_r, axis=1)
        tok_r = tl.min(tl.where(mask & (val_r == best_r[:, None]), idx_r, V), axis=1)
        val_p = tl.load(part_val_ptr + base + T, mask=mask, other=float("-inf"))
        idx_p = tl.load(part_idx_ptr + base + T, mask=mask, other=V)
        best_p = tl.max(val_p, axis=1)
        tok_p = tl.min(tl.where(mask & (val_p == best_p[:, None]), idx_p, V), axis=1)
        token = tl.where(best_r >= 0.0, tok_r, tok_p)  # residual all zero (p == q): fall back to p
        token = tl.minimum(tl.maximum(token, 0), V - 1)
        for j in range(0, K + 1):
            # a vector, not the scalar `j < K`: `bool_vector & scalar` yields a non-bool mask in the interpreter
            has_draft = (tl.zeros([BLOCK_B], dtype=tl.int64) + j) < K
            d = tl.load(draft_ptr + rows * stride_db + j, mask=row_ok & has_draft, other=-1)
            value = tl.where(j < n, d, tl.where(j == n, token, -1))
            tl.store(out_ptr + rows * stride_ob + j, value, mask=row_ok)
    else:
        alive = row_ok
        n = tl.zeros([BLOCK_B], dtype=tl.int64)
        for j in range(0, K + 1):
            base = rows[:, None] * ((K + 1) * T) + j * T + tiles[None, :]
            val = tl.load(part_val_ptr + base, mask=mask, other=float("-inf"))
            idx = tl.load(part_idx_ptr + base, mask=mask, other=V)
            best = tl.max(val, axis=1)
            target_id = tl.min(tl.where(mask & (val == best[:, None]), idx, V), axis=1)
            target_id = tl.minimum(tl.maximum(target_id, 0), V - 1)
            # while alive, the output at j is the target argmax (== the draft when it is accepted)
            tl.store(out_ptr + rows * stride_ob + j, tl.where(alive, target_id, -1), mask=row_ok)
            has_draft = (tl.zeros([BLOCK_B], dtype=tl.int64) + j) < K
            d = tl.load(draft_ptr + rows * stride_db + j, mask=row_ok & has_draft, other=-1)
            alive = alive & has_draft & (d == target_id)
            n += alive.to(tl.int64)
        tl.store(num_accepted_ptr + rows, n, mask=row_ok)


verify_tile_kernel = LazyKernel(_verify_tile_kernel)
verify_finalize_kernel = LazyKernel(_verify_finalize_kernel)


def _block_sizes(batch: int, vocab: int, interpret: bool):
    """(BLOCK_B, BLOCK_V): one row × 4096 ids per program on GPU; many rows × small tiles under the interpreter."""
    if interpret:  # programs run one after another: few big row blocks, small vocab tiles to exercise the reduction
        return min(1024, next_power_of_2(batch)), min(64, next_power_of_2(vocab))
    return 1, min(4096, next_power_of_2(vocab))


def verify_drafts_triton(
    draft_tokens: Tensor,
    target: Tensor,
    draft_probs: Optional[Tensor] = None,
    *,
    mode: str = "greedy",
    uniforms: Optional[Tensor] = None,
    exponentials: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> VerifyOutput:
    """Triton twin of :func:`verify_drafts_torch`: same arguments (documented there), outputs and random numbers.

    Needs CUDA tensors, or ``TRITON_INTERPRET=1`` for CPU tensors (tests).
    """
    batch, k, vocab = check_verify_inputs(draft_tokens, target, draft_probs, mode)
    check_triton_usable(draft_tokens, target, draft_probs)
    device = target.device
    sampling = mode == "sampling"
    drafts = draft_tokens.to(device=device, dtype=torch.long).contiguous()  # (B, k)
    if target.stride(-1) != 1:
        target = target.contiguous()
    if sampling:
        uniforms, exponentials = sampling_randomness(batch, k, vocab, device, uniforms, exponentials, generator)
        q = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    else:  # unused pointers: any valid tensor
        q, uniforms, exponentials = target, target, target
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    output_tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    if batch == 0:
        return VerifyOutput(num_accepted, output_tokens)

    block_b, block_v = _block_sizes(batch, vocab, interpreter_enabled())
    num_tiles = triton_cdiv(vocab, block_v)
    slots = 2 if sampling else k + 1
    part_val = torch.empty((batch, slots, num_tiles), dtype=torch.float32, device=device)
    part_idx = torch.empty((batch, slots, num_tiles), dtype=torch.long, device=device)
    row_blocks = triton_cdiv(batch, block_b)
    verify_tile_kernel[(row_blocks, num_tiles)](
        drafts,
        max(drafts.stride(0), 1),
        target,
        target.stride(0),
        target.stride(1),
        q,
        q.stride(0) if sampling else 0,
        q.stride(1) if sampling and k > 0 else 0,
        uniforms,
        max(uniforms.stride(0), 1) if sampling else 0,
        exponentials,
        exponentials.stride(0) if sampling else 0,
        num_accepted,
        part_val,
        part_idx,
        batch,
        k,
        vocab,
        num_tiles,
        SAMPLING=sampling,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        num_warps=4,
    )
    verify_finalize_kernel[(row_blocks,)](
        drafts,
        max(drafts.stride(0), 1),
        num_accepted,
        part_val,
        part_idx,
        output_tokens,
        output_tokens.stride(0),
        batch,
        k,
        vocab,
        num_tiles,
        SAMPLING=sampling,
        BLOCK_B=block_b,
        BLOCK_T=next_power_of_2(num_tiles),
        num_warps=1,
    )
    return VerifyOutput(num_accepted, output_tokens)


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division (what ``triton.cdiv`` does, without importing triton)."""
    return -(-a // b)


__all__ = ["VerifyOutput", "verify_drafts_torch", "verify_drafts_triton"]
