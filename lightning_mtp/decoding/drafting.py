"""Drafting with the MTP modules, and the cascaded modules' own KV caches.

Indexing (``n`` = position of a row's newest token, emitted but not yet run through the trunk; the trunk's cache and
its hidden states ``h_0`` cover positions ``< n``): depth k at position i predicts t(i+k+1), so every depth drafts at
position ``n - 1``:

* cascaded (DeepSeek-V3): module 1 reads h_0(n-1) and Emb(t(n)); module k reads h_(k-1)(n-1) and Emb(d_(k-1)),
  giving draft d_k = t(n+k);
* parallel (Meta 2024): head k reads h_0(n-1) alone.

Each MTP block attends over its own past positions, so it keeps a positional KV cache like the trunk's. Entry j of
module k holds what training computed there: inputs h_(k-1)(j) and Emb(t(j+k)). For j + k > n those tokens are this
step's drafts, so module k (re)computes a *window* of positions ending at n - 1 in one call: the entries whose inputs
changed since it last ran (newly accepted tokens, and draft-dependent ones) -- the refill and the draft are one
forward per module. Rejected entries are simply recomputed next time (rollback is a length change). After a step in
which the newest token moved by at most ``a`` positions, module k must recompute ``max(a, k)`` positions (cascaded)
or ``a`` (parallel); a module skipped by dynamic draft length adds ``a`` to its window. The windows are host-side
upper bounds over the rows (no sync); rows that need fewer positions recompute a few valid entries, which is
harmless.

The decoded drafts equal the argmax of the teacher-forced ``MTPMixin.mtp_forward`` over the committed tokens followed
by the drafts (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.sampling import SamplingParams, logits_to_probs, sample
from lightning_mtp.layers import KVCache

ADAPTIVE_PROBE_EVERY = 8
"""Adaptive draft length drafts the full depth every this many steps, so its acceptance estimates stay current."""


class Drafts(NamedTuple):
    tokens: Tensor
    """(B, k) int64 drafts; -1 where a row withdrew its draft (dynamic draft length): such drafts are never accepted."""
    probs: Optional[Tensor]
    """(B, k, V) the distributions ``q`` the drafts were sampled from (sampling only); all-zero rows for withdrawn
    drafts, so that verification samples from ``p`` there."""


def drafter_buffers(module: nn.Module, blocks: list[nn.Module], cascaded: bool, batch_size: int,
                    max_len: int) -> tuple[list[KVCache], Tensor, Tensor]:
    """A drafter's buffers: one positional KV cache per drafted depth (``blocks``: the MTP module of each depth),
    the hidden states by position (S, B, L, H) (S = depths for cascaded modules, 1 for parallel heads: h_0 only) and
    the row indices (B, 1)."""
    weight = module.mtp_output_head().weight
    device, dtype = weight.device, weight.dtype
    caches = [KVCache(batch_size, max_len, block.block.attn.n_kv_heads, block.block.attn.head_dim, device=device,
                      dtype=dtype) for block in blocks]
    slots = len(blocks) if cascaded else 1
    hidden = torch.zeros(slots, batch_size, max_len, weight.shape[1], device=device, dtype=dtype)
    return caches, hidden, torch.arange(batch_size, device=device).unsqueeze(1)


class Drafter(Protocol):
    """What the speculative loop needs from a drafter (MTP modules here; tests use stubs)."""

    max_drafts: int
    """Most drafts per step (the MTP depth D)."""

    def allocate(self, batch_size: int, max_len: int) -> Any:
        """Fresh drafter state for ``batch_size`` rows of up to ``max_len`` positions."""

    def observe(self, state: Any, hidden: Tensor, positions: Tensor) -> None:
        """The trunk's hidden states (B, T, H) at ``positions`` (B, T) (prefill and every verify forward)."""

    def draft(self, state: Any, tokens: Tensor, newest: Tensor, num_drafts: int, params: SamplingParams,
              generator: Optional[torch.Generator] = None, confidence_threshold: Optional[float] = None) -> Drafts:
        """Draft up to ``num_drafts`` tokens after position ``newest`` (B,) and write them into the sequence buffer
        ``tokens`` (B, L) at ``newest + 1 ..``; ``params.greedy`` drafts the argmax, else samples from ``q``."""

    def commit(self, state: Any, advanced: int) -> None:
        """The step is over; every row's newest token moved by at most ``advanced`` positions."""


@dataclass
class MTPDraftState:
    caches: list[KVCache]
    """One cache per MTP module (each module is one transformer block)."""
    hidden: Tensor
    """(S, B, L, H) by position: index 0 the trunk's h_0, index k the output h_k of cascaded module k (S = D for
    cascaded, 1 for parallel: the deepest module's output is never read)."""
    windows: list[int]
    """Per module: how many positions ending at ``n - 1`` it must (re)compute when it next runs."""
    rows: Tensor
    """(B, 1) row indices, for per-row gathers and scatters."""
    ran: int = 0
    """Modules run in the current step."""
    arange: dict[int, Tensor] = field(default_factory=dict)


class MTPDrafter:
    """Drafts with the MTP modules of an :class:`~lightning_mtp.MTPMixin` module (cascaded or parallel).

    Sampling drafts come from ``q_k = logits_to_probs(logits_k / mtp_draft_temperatures[k-1], temperature, top_k,
    top_p)``: the same processing as the target, plus the per-depth draft temperature on the draft logits only.
    ``max_depth = D + 1`` (cascaded modules): depth D + 1 re-applies the last module on its own output, with a cache
    of its own (the tree drafter's drafts beyond D, as one more depth of the chain).
    """

    def __init__(self, module: nn.Module, max_depth: Optional[int] = None) -> None:
        self.module = module
        self.modules = module.require_mtp_modules()
        self.cascaded = module.mtp_config.architecture == "cascaded"
        self.max_drafts = max_depth or len(self.modules)
        if self.max_drafts > (most := len(self.modules) + self.cascaded):
            raise ValueError(f"the chain drafter drafts at most D{' + 1' * self.cascaded} = {most} tokens, got "
                             f"max_depth={self.max_drafts}")
        self.depth_modules = [self.modules[min(k, len(self.modules)) - 1] for k in range(1, self.max_drafts + 1)]
        self.step_modules = list(self.depth_modules)  # what draft() calls: these, or compiled (compiled.py)
        # When set (compiled decoding), every module recomputes this many positions after a drafting step, whatever
        # the rows advanced: one shape per step, so one graph. It must be >= max_drafts + 1, the most a step needs.
        self.fixed_window: Optional[int] = None
        self.embed = module.mtp_draft_embedding() if self.cascaded else None

    def allocate(self, batch_size: int, max_len: int) -> MTPDraftState:
        caches, hidden, rows = drafter_buffers(self.module, self.depth_modules, self.cascaded, batch_size, max_len)
        return MTPDraftState(caches, hidden, [0] * self.max_drafts, rows)

    def observe(self, state: MTPDraftState, hidden: Tensor, positions: Tensor) -> None:
        state.hidden[0][state.rows, positions] = hidden.to(state.hidden.dtype)

    def _window(self, state: MTPDraftState, newest: Tensor, size: int) -> Tensor:
        steps = state.arange.get(size)
        if steps is None:
            steps = state.arange[size] = torch.arange(-size, 0, device=newest.device)
        return (newest.unsqueeze(1) + steps).clamp_min(0)  # (B, W) positions n-W .. n-1

    def draft(self, state: MTPDraftState, tokens: Tensor, newest: Tensor, num_drafts: int, params: SamplingParams,
              generator: Optional[torch.Generator] = None, confidence_threshold: Optional[float] = None) -> Drafts:
        batch, rows = tokens.shape[0], state.rows
        drafts, probs = [], []
        alive = None  # (B,) rows still drafting (dynamic draft length)
        state.ran = 0
        for k in range(1, num_drafts + 1):
            module = self.step_modules[k - 1]
            positions = self._window(state, newest, state.windows[k - 1])  # (B, W)
            if self.cascaded:
                h_in = state.hidden[k - 1][rows, positions]  # (B, W, H) h_(k-1)
                emb = self.embed(tokens[rows, positions + k])  # (B, W, H) Emb(t(j+k)), drafts beyond n
            else:
                h_in, emb = state.hidden[0][rows, positions], None  # (B, W, H) h_0
            cos, sin = self.module.mtp_rope(positions.shape[1], positions)
            out = module(h_in, emb, cos, sin, positions, state.caches[k - 1])  # (B, W, H)
            state.ran = k
            if self.cascaded and k < self.max_drafts:
                state.hidden[k][rows, positions] = out.to(state.hidden.dtype)  # (autocast computes lower)
            module_depth = min(k, len(self.modules))  # depth D + 1 re-applies module D
            logits = self.module.mtp_depth_logits(module_depth, out[:, -1])  # (B, V) at position n-1
            temperature = self.module.mtp_draft_temperatures[module_depth - 1]
            # Confidence = the drafter's top probability at depth k, known before d_k is drawn. Stopping on it (and on
            # the prefix and earlier drafts) keeps sampling exact: given that depth k is drafted, d_k is still a
            # sample of q_k, which is all rejection sampling needs. Stopping on q_k(d_k) would not be: a draft may
            # not be withdrawn because of its own value (surviving drafts would come from q_k cut to confident tokens).
            if params.greedy:
                token = logits.argmax(dim=-1)  # (B,)
                q = None
                if confidence_threshold is not None:
                    confidence = torch.softmax(logits.float() / temperature, dim=-1).amax(dim=-1)  # (B,)
            else:
                q = logits_to_probs(logits / temperature, params.temperature, params.top_k, params.top_p)  # (B, V)
                confidence = q.amax(dim=-1)  # (B,)
                token = sample(q, generator)
            tokens.scatter_(1, (newest + k).unsqueeze(1), token.unsqueeze(1))  # buffer keeps the real id
            if confidence_threshold is not None:
                confident = confidence >= confidence_threshold
                alive = confident if alive is None else alive & confident
                token = torch.where(alive, token, torch.full_like(token, -1))
                if q is not None:
                    q = q * alive.unsqueeze(1)
            drafts.append(token)
            probs.append(q)
            if alive is not None and k < num_drafts and not bool(alive.any()):
                break
        if alive is not None:
            # drop trailing drafts no row proposes: they would only widen the verify forward
            while drafts and not bool((drafts[-1] >= 0).any()):
                drafts.pop()
                probs.pop()
        draft_tokens = torch.stack(drafts, dim=1) if drafts else newest.new_empty((batch, 0))  # (B, k)
        draft_probs = None
        if not params.greedy:
            vocab = self.module.mtp_vocab_size()
            draft_probs = (
                torch.stack(probs, dim=1) if probs else torch.zeros(batch, 0, vocab, device=tokens.device)
            )  # (B, k, V)
        return Drafts(draft_tokens, draft_probs)

    def commit(self, state: MTPDraftState, advanced: int) -> None:
        for k in range(1, self.max_drafts + 1):
            if k <= state.ran:
                state.windows[k - 1] = self.fixed_window or max(advanced, k if self.cascaded else 1)
            else:
                state.windows[k - 1] += advanced
        state.ran = 0


class DraftLength:
    """How many drafts the next step makes: fixed, or adapted from the running acceptance.

    Adaptive: keeps an exponential moving average of P(the first j drafts are all accepted) for every depth j and
    drafts up to the deepest j whose estimate is ≥ ``min_reach`` (at least 1); every ``ADAPTIVE_PROBE_EVERY`` steps
    it drafts the full depth to refresh the estimates of depths it stopped using.
    """

    def __init__(self, max_drafts: int, adaptive: bool, min_reach: float, decay: float = 0.8) -> None:
        self.max_drafts, self.adaptive, self.min_reach, self.decay = max_drafts, adaptive, min_reach, decay
        self.reach = [1.0] * max_drafts
        self.step = 0

    def next(self) -> int:
        self.step += 1
        if not self.adaptive or self.step % ADAPTIVE_PROBE_EVERY == 0:
            return self.max_drafts
        k = 1
        while k < self.max_drafts and self.reach[k] >= self.min_reach:
            k += 1
        return k

    def observe_step(self, option: int, accepted: list[int], active_rows: int, seconds: float) -> None:
        """The decoding loop's report of a step (drafts ``option``; accepted drafts per depth)."""
        if not self.adaptive or active_rows == 0:
            return
        for j, count in enumerate(accepted):
            self.reach[j] = self.decay * self.reach[j] + (1 - self.decay) * count / active_rows
