"""``speculative="auto"``: each step drafts what pays on this machine and model, or nothing.

A step that drafts a tree of N nodes and depth d costs one trunk forward over N+1 tokens per row plus d drafting
calls, and returns 1 + (expected accepted drafts) tokens per row. Plain decoding costs one forward of 1 token and
returns 1. :class:`AutoPolicy` picks, before each step, the option with the most expected tokens per second:

* **costs** come from a short calibration at the first call (:func:`calibrate`: the trunk's forward over 1..64 tokens
  per row, one MTP module call and one output-head call, timed at the call's batch size), then from the measured
  time of every step taken with that option (an exponential moving average of measured / predicted);
* **acceptance** is a running estimate per (depth, sibling rank) of the probability that the candidate of that rank
  is accepted given its parent was; a static tree's expected accepted length is the sum over its nodes of the
  product of those estimates along the node's path (dynamic trees use their own measured average).

Both are kept per model, batch size and device, so later greedy calls start from what earlier calls learned. Every
option is lossless, so the policy only changes speed: greedy output stays identical to plain decoding and sampling
keeps the model's distribution. With sampling, which draft a step makes decides which random numbers it consumes, so
there the policy decides from the (cached) calibration and the call's own acceptance only: the same seed gives the
same samples within a process (across processes the calibration is re-measured; ``speculative=True`` or ``False``
make samples reproducible everywhere).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lightning_mtp.decoding.tree import TreeShape

CALIBRATION_TOKENS = (1, 2, 4, 8, 16, 32, 64)
"""Tokens per row at which the trunk's forward is timed (other sizes are interpolated)."""
CALIBRATION_MAX_TOKENS = 16384
"""Calibration skips sizes whose batch would run more tokens than this (larger sizes are extrapolated)."""
PRIOR_ACCEPTANCE = 0.6
"""Prior probability that the best candidate of a depth is accepted given its parent (rank r: prior / (r + 1)^2)."""
RETRY_EVERY = 16
"""A drafting option within 10% of the best one's expected rate is re-tried at least this often (estimates refresh)."""


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """Fastest of ``repeats`` runs of ``fn`` after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class Costs:
    """Measured seconds per step component at one batch size."""

    trunk: dict[int, float]
    """Trunk forward over T tokens per row (cached decoding), by T."""
    module: dict[int, float]
    """One MTP module call over T tokens per row, by T."""
    head: dict[int, float]
    """Depth logits for F rows per batch row, by F."""

    @staticmethod
    def _interpolate(table: dict[int, float], size: int) -> float:
        keys = sorted(table)
        if size <= keys[0]:
            return table[keys[0]]
        for low, high in zip(keys, keys[1:]):
            if size <= high:
                return table[low] + (table[high] - table[low]) * (size - low) / (high - low)
        return table[keys[-1]] * size / keys[-1]

    def step(self, shape: Optional[TreeShape], window: float) -> float:
        """Predicted seconds of a step: verify ``N + 1`` tokens, plus each depth's module call and head call."""
        if shape is None:
            return self._interpolate(self.trunk, 1)
        total = self._interpolate(self.trunk, shape.num_nodes + 1)
        nodes_above, width = 0, 1
        for k in range(1, shape.depth + 1):
            total += self._interpolate(self.module, int(round(window)) + nodes_above)
            total += self._interpolate(self.head, width)
            branch = shape.top_k if shape.dynamic else shape.branching[k - 1]
            width = shape.top_k if shape.dynamic else width * branch
            nodes_above += width
        return total


def calibrate(host: Any, module: Any, batch: int, device: torch.device) -> Costs:
    """Time the trunk, one MTP module and one head call at ``batch`` rows (a few hundred forwards of small sizes)."""
    trunk, modules, heads = {}, {}, {}
    context = max(1, min(96, host.max_context // 4))  # a typical prefix, within the model's context
    sizes = [size for size in CALIBRATION_TOKENS  # within the context, and short at huge batches (extrapolated)
             if context + size <= host.max_context and batch * (context + size) <= CALIBRATION_MAX_TOKENS] or [1]
    mtp = module.require_mtp_modules()[0]
    dim = module.mtp_output_head().weight.shape[1]
    dtype = module.mtp_output_head().weight.dtype
    with torch.inference_mode():
        for size in sizes:
            state = host.allocate(batch, context + size + 1)
            prefix = torch.zeros(batch, context, dtype=torch.long, device=device)
            host.forward(prefix, torch.arange(context, device=device).expand(batch, -1), state)
            ids = torch.zeros(batch, size, dtype=torch.long, device=device)
            positions = context + torch.arange(size, device=device).expand(batch, -1)

            def trunk_step(state=state, ids=ids, positions=positions):
                host.main_logits(host.forward(ids, positions, state)[:, -1:])
                host.rollback(state, torch.full((batch,), context, device=device))

            trunk[size] = timed(trunk_step, device)
            hidden = torch.zeros(batch, size, dim, device=device, dtype=dtype)
            cos, sin = module.mtp_rope(size)
            modules[size] = timed(lambda h=hidden, c=cos, s=sin: mtp(h, h, c, s), device)
            if size <= 16:
                heads[size] = timed(lambda h=hidden: module.mtp_depth_logits(1, h), device)
    return Costs(trunk, modules, heads)


@dataclass
class AutoMemory:
    """What ``auto`` learned for one model / batch size / device / mode (kept across calls)."""

    costs: Costs
    acceptance: dict[tuple[int, int], float] = field(default_factory=dict)
    """(depth, rank) -> P(candidate of that rank accepted | parent accepted)."""
    correction: dict[str, float] = field(default_factory=dict)
    """option -> measured / predicted step time."""
    measured_tau: dict[str, float] = field(default_factory=dict)
    """option -> measured tokens per row-step (dynamic trees)."""
    window: float = 1.0
    """Running tokens per row-step (the drafting window of the next step)."""


def candidate_options(max_depth: int, mtp_depth: int, cascaded: bool, trees: bool) -> list[Optional[TreeShape]]:
    """Plain, chains 1..max_depth, and (with tree support) static trees widening the first depths."""
    options: list[Optional[TreeShape]] = [None]
    for length in range(1, max_depth + 1):
        options.append(TreeShape.chain(length))
        if trees:
            for head in ((2,), (3,), (4,), (2, 2), (4, 2), (8,)):
                if len(head) <= length:
                    options.append(TreeShape(branching=head + (1,) * (length - len(head))))
    if not cascaded:
        options = [o for o in options if o is None or o.depth <= mtp_depth]
    return options


class AutoPolicy:
    """Chooses each step's draft option (see the module docstring)."""

    def __init__(self, memory: AutoMemory, options: list[Optional[TreeShape]], learn_costs: bool = True) -> None:
        self.memory, self.options, self.learn_costs = memory, options, learn_costs
        self.steps = 0
        self.last_tried: dict[str, int] = {}
        self.keys = ["plain" if o is None else o.describe() for o in options]
        self._rates: Optional[list[float]] = None  # cached until the next update

    def _acceptance(self, depth: int, rank: int) -> float:
        return self.memory.acceptance.get((depth, rank), PRIOR_ACCEPTANCE / (rank + 1) ** 2)

    def expected_tokens(self, option: Optional[TreeShape]) -> float:
        """1 + expected accepted drafts per row. A static tree's nodes at depth d are every combination of ranks,
        so the sum over them of the products along their paths is the product over depths of the sums over ranks."""
        if option is None:
            return 1.0
        if option.dynamic:
            return self.memory.measured_tau.get(option.describe(), 1.0 + option.depth * PRIOR_ACCEPTANCE)
        total, reach = 1.0, 1.0
        for depth, branch in enumerate(option.branching, start=1):
            reach *= min(1.0, sum(self._acceptance(depth, rank) for rank in range(branch)))
            total += reach
        return total

    def seconds(self, option: Optional[TreeShape]) -> float:
        key = "plain" if option is None else option.describe()
        return self.memory.costs.step(option, self.memory.window) * self.memory.correction.get(key, 1.0)

    def rate(self, option: Optional[TreeShape]) -> float:
        return self.expected_tokens(option) / self.seconds(option)

    def next(self) -> Optional[TreeShape]:
        self.steps += 1
        if self._rates is None:
            self._rates = [self.rate(o) for o in self.options]
        rates = self._rates
        best = max(range(len(self.options)), key=rates.__getitem__)
        # refresh a close runner-up now and then, so its acceptance and cost estimates stay current
        for i, key in enumerate(self.keys):
            if i != best and rates[i] >= 0.9 * rates[best] and self.steps - self.last_tried.get(key, 0) > RETRY_EVERY:
                best = i
                break
        self.last_tried[self.keys[best]] = self.steps
        return self.options[best]

    def update(self, option: Optional[TreeShape], seconds: float, tokens_per_row: float,
               accepted_ranks: Optional[list[list[int]]] = None, decay: float = 0.7) -> None:
        """Fold in one step: its wall time, tokens per active row, and (static trees) per depth the counts of
        [rows whose parent was reached, accepted rank-0 children, rank-1 children, ...]."""
        memory = self.memory
        self._rates = None
        key = "plain" if option is None else option.describe()
        if self.learn_costs:
            ratio = seconds / max(memory.costs.step(option, memory.window), 1e-9)
            memory.correction[key] = decay * memory.correction.get(key, ratio) + (1 - decay) * ratio
        memory.window = decay * memory.window + (1 - decay) * tokens_per_row
        if option is None:
            return
        if option.dynamic:
            memory.measured_tau[key] = decay * memory.measured_tau.get(key, tokens_per_row) + (
                1 - decay) * tokens_per_row
            return
        for depth, counts in enumerate(accepted_ranks or [], start=1):
            reached, per_rank = counts[0], counts[1:]
            if reached == 0:
                continue
            for rank, hits in enumerate(per_rank):
                old = self._acceptance(depth, rank)
                memory.acceptance[(depth, rank)] = decay * old + (1 - decay) * hits / reached


def memory_for(module: Any, key: tuple, build: Callable[[], AutoMemory]) -> AutoMemory:
    """The module's :class:`AutoMemory` for ``key`` (model-specific, so it lives on the module)."""
    store = module.__dict__.setdefault("_mtp_auto_memory", {})
    if key not in store:
        store[key] = build()
    return store[key]
