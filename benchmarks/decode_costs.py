"""Where a decoding step's time goes, for ``benchmarks/decode.py``: measured costs in units of a plain step.

- :func:`cost_breakdown`: a 1-token main step, a (k+1)-token verify forward and drafting through k modules, timed in
  isolation (warm caches) at a given batch size;
- :func:`tree_cost_breakdown`: where trees pay: the verify forward (tree attention mask, logits at every node) over
  1, 2, 4, ..., 64 tokens per row, drafting one tree depth below N nodes, and drafting whole trees, in isolation;
- :func:`in_situ_breakdown`: per step inside real decoding at batch 1 (timers around the host's forwards and the
  drafter): main forward, drafting, and the rest (acceptance, bookkeeping, Python), for the chain of D and for
  given trees;
- :class:`AutoChoices`: which option ``speculative="auto"`` picked at each step (counted around its policy);
- :func:`weight_bytes`: the weights a step reads (trunk, and each MTP depth with its output head), which bound a
  bandwidth-bound step from below;
- :func:`explain`: the lines of the benchmark's explanation, each speedup as forwards saved over step cost.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from typing import Optional

import torch

from lightning_mtp.decoding import GenerationConfig, MTPDrafter
from lightning_mtp.decoding.auto import AutoPolicy
from lightning_mtp.decoding.host import decoding_host
from lightning_mtp.decoding.sampling import SamplingParams
from lightning_mtp.decoding.tree import TreeShape, ancestors, tree_attention_mask
from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter
from lightning_mtp.decoding.tree_policy import AutoSteps, FixedTree

NODE_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Tokens per row of the verify forwards :func:`tree_cost_breakdown` times (the root plus N - 1 draft nodes)."""


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def cost_breakdown(model, prompts: list[torch.Tensor], depth: int, repeats: int = 30) -> dict:
    """Seconds of one 1-token main step, of a (k+1)-token verify forward and of drafting k tokens, for a batch of
    ``len(prompts)`` rows (each cut to the shortest prompt's length)."""
    host = decoding_host(model)
    drafter = MTPDrafter(model)
    batch = len(prompts)
    length = min(len(p) for p in prompts)
    max_len = length + 64
    cache = host.allocate(batch, max_len)
    state = drafter.allocate(batch, max_len)
    tokens = torch.zeros(batch, max_len + depth + 2, dtype=torch.long)
    tokens[:, :length] = torch.stack([p[:length] for p in prompts])
    positions = torch.arange(length).expand(batch, length)
    hidden = host.forward(tokens[:, :length], positions, cache)
    drafter.observe(state, hidden, positions)
    drafter.commit(state, length)
    newest = torch.full((batch,), length - 1)
    drafter.draft(state, tokens, newest, depth, SamplingParams())  # fill the modules' caches
    drafter.commit(state, depth + 1)
    out = {}
    step_positions = newest.view(batch, 1)

    def main_step(k: int):
        pos = step_positions + torch.arange(k + 1)
        logits = host.main_logits(host.forward(tokens.gather(1, pos), pos, cache))
        return logits.argmax(-1)

    out["step_1_token_s"] = median_time(lambda: main_step(0), repeats)
    for k in range(1, depth + 1):
        out[f"verify_{k + 1}_tokens_s"] = median_time(lambda k=k: main_step(k), repeats)

    def draft(k: int):
        state.windows = [depth + 1] * depth  # a step that accepted everything: the widest regular window
        drafter.draft(state, tokens, newest, k, SamplingParams())

    for k in range(1, depth + 1):
        out[f"draft_{k}_s"] = median_time(lambda k=k: draft(k), repeats)
    return out


def interpolate(table: dict[int, float], size: int) -> float:
    """Seconds at ``size`` from a table of measured sizes (linear between them, proportional beyond the last)."""
    keys = sorted(table)
    if size <= keys[0]:
        return table[keys[0]]
    for low, high in zip(keys, keys[1:]):
        if size <= high:
            return table[low] + (table[high] - table[low]) * (size - low) / (high - low)
    return table[keys[-1]] * size / keys[-1]


@torch.inference_mode()
def tree_cost_breakdown(model, prompts: list[torch.Tensor], trees: list[TreeShape], repeats: int = 20) -> dict:
    """Where trees pay, for a batch of ``len(prompts)`` rows (each cut to the shortest prompt), timed in isolation.

    - ``verify_tokens_s[T]``: a tree step's verify forward over T tokens per row (the root and T - 1 draft nodes, for
      T in :data:`NODE_SIZES`), with the tree attention mask (built in the timed call, as a step does) and the main
      logits of every node; the mask's pattern (here: every node a child of the root) does not change the work;
    - ``draft_depth_nodes_s[N]``: drafting one tree depth below N nodes (the MTP module over the linear window and
      the N nodes, the output head on N rows, top-1 under each): tree ``(N, 1)`` minus tree ``(N,)``;
    - ``draft_tree_s[shape]``: drafting each tree of ``trees`` whole (deeper ones than the model allows are skipped);
    - ``in_plain_steps``: the same divided by ``step_1_token_s``, a plain 1-token step (forward and logits).

    Drafting runs in steady state: every depth recomputes a window of D + 1 linear positions (a step that accepted
    every draft). Empty for hosts that cannot verify trees."""
    host = decoding_host(model)
    if not callable(getattr(host, "forward_tree", None)):
        return {}
    num_modules = len(model.require_mtp_modules())
    cascaded = model.mtp_config.architecture == "cascaded"
    max_depth = max([2] + [t.depth for t in trees]) if cascaded else num_modules
    trees = [t for t in trees if t.depth <= max_depth]
    batch = len(prompts)
    length = min(len(p) for p in prompts)
    widest = max([max(NODE_SIZES)] + [t.num_nodes + 1 for t in trees])
    max_len = length + widest + 2
    cache = host.allocate(batch, max_len)
    tokens = torch.zeros(batch, max_len, dtype=torch.long)
    tokens[:, :length] = torch.stack([p[:length] for p in prompts])
    positions = torch.arange(length).expand(batch, length)  # (B, P)
    hidden = host.forward(tokens[:, :length], positions, cache)  # (B, P, H)
    newest = torch.full((batch,), length - 1)

    def plain_step():
        pos = newest.view(batch, 1)
        return host.main_logits(host.forward(tokens.gather(1, pos), pos, cache)).argmax(-1)

    def verify(size: int):
        parents = torch.zeros(batch, size, dtype=torch.long)  # (B, T): node 0 the root, the others its children
        depths = (torch.arange(size) > 0).long().expand(batch, size)  # (B, T)
        slots = newest.unsqueeze(1) + torch.arange(size)  # (B, T)
        mask = tree_attention_mask(newest - 1, newest, ancestors(parents, 1), max_len)  # (B, 1, T, S)
        ids = tokens[:, :size] if size <= length else tokens[:, :1].expand(batch, size)
        out = host.forward_tree(ids, newest.unsqueeze(1) + depths, slots, mask, cache)  # (B, T, H)
        return host.main_logits(out).argmax(-1)

    unit = median_time(plain_step, repeats)
    out = {"step_1_token_s": unit, "verify_tokens_s": {}, "draft_depth_nodes_s": {}, "draft_tree_s": {}}
    for size in NODE_SIZES:
        out["verify_tokens_s"][size] = median_time(lambda size=size: verify(size), repeats)

    drafter = MTPTreeDrafter(model, max_depth)
    state = drafter.allocate(batch, max_len)
    drafter.observe(state, hidden, positions)
    drafter.commit(state, length)
    drafter.draft(state, tokens, newest, TreeShape.chain(max_depth), SamplingParams())  # fill every depth's cache

    def draft(shape: TreeShape):
        state.windows = [num_modules + 1] * max_depth
        return drafter.draft(state, tokens, newest, shape, SamplingParams())

    vocab = int(host.vocab_size)
    for nodes in (n for n in NODE_SIZES[:-1] if n <= vocab and max_depth >= 2):
        one = median_time(lambda n=nodes: draft(TreeShape(branching=(n,))), repeats)
        two = median_time(lambda n=nodes: draft(TreeShape(branching=(n, 1))), repeats)
        out["draft_depth_nodes_s"][nodes] = max(0.0, two - one)
        if nodes == 1:
            out["draft_first_depth_s"] = one
    for shape in trees:
        out["draft_tree_s"][str(list(shape.branching))] = median_time(lambda s=shape: draft(s), repeats)
    out["in_plain_steps"] = {
        "verify_tokens": {size: s / unit for size, s in out["verify_tokens_s"].items()},
        "draft_first_depth": out.get("draft_first_depth_s", 0.0) / unit,
        "draft_depth_nodes": {n: s / unit for n, s in out["draft_depth_nodes_s"].items()},
        "draft_tree": {name: s / unit for name, s in out["draft_tree_s"].items()},
    }
    return out


def weight_bytes(model) -> dict:
    """Bytes of the weights one decoding step reads: the trunk's (blocks, final norm, head) and each MTP depth's
    (its module plus the output head it projects through). At batch 1 a step streams them from memory, so
    ``draft_over_trunk`` bounds drafting's cost from below in units of a plain step."""
    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    head = size(model.mtp_depth_head(1))
    trunk = size(model.layers) + size(model.norm) + size(model.lm_head)
    per_depth = size(model.mtp_modules[0]) + head
    return {"trunk": trunk, "per_depth": per_depth, "draft_over_trunk_per_depth": per_depth / trunk}


class Timed:
    """Sums the wall time of the named methods of a host or drafter (same run, same caches). The methods are wrapped
    on the instance itself, so the decoding loop's type checks (tree drafter or chain drafter) still see it."""

    def __init__(self, inner, methods: tuple[str, ...]) -> None:
        self.seconds, self.calls = 0.0, 0
        for name in methods:
            method = getattr(inner, name, None)
            if callable(method):
                setattr(inner, name, self._wrap(method))

    def _wrap(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


class PlainSteps:
    """Tree-drafter policy that never drafts: the plain steps ``speculative="auto"`` takes when drafting does not pay
    (a tree step without a tree: the drafter still observes the trunk's hidden states, one summary sync per step)."""

    max_nodes = 1

    def next(self) -> None:
        return None

    def observe_step(self, option, extra: list, active_rows: int, seconds: float) -> None:
        """Nothing to learn."""


def in_situ_breakdown(model, prompts: list[torch.Tensor], depth: int, max_new_tokens: int,
                      trees: tuple[TreeShape, ...] = ()) -> dict:
    """Per decoding step at batch 1, measured inside real decoding: main-model forward (tree verify forwards
    included), drafting (draft, observe, commit), and the rest (acceptance, moving the accepted path in the cache,
    bookkeeping, Python), for plain decoding (``plain``), ``auto``'s plain step (``auto_plain_step``:
    :class:`PlainSteps`), the chain of k = D drafts (``speculative``) and each tree shape of ``trees``
    (``trees[shape.describe()]``)."""
    from lightning_mtp.decoding import decode
    from lightning_mtp.decoding.speculative import prepare_prompts

    def measure(make_drafter, make_policy, config: GenerationConfig) -> dict:
        forward_s = draft_s = total_s = 0.0
        steps = 0
        for prompt in prompts:
            host = decoding_host(model)
            host_timer = Timed(host, ("forward", "forward_tree", "main_logits"))
            drafter = make_drafter()
            draft_timer = Timed(drafter, ("draft", "observe", "commit")) if drafter is not None else None
            ids, lengths = prepare_prompts(prompt.unsqueeze(0), None, host.vocab_size, torch.device("cpu"))
            result = decode(host, drafter, ids, lengths, config, policy=make_policy())
            forward_s += host_timer.seconds
            draft_s += draft_timer.seconds if draft_timer is not None else 0.0
            total_s += result.stats.elapsed_s
            steps += result.stats.main_forwards
        return {"step_s": total_s / steps, "forward_s": forward_s / steps, "draft_s": draft_s / steps,
                "rest_s": (total_s - forward_s - draft_s) / steps}

    chain = GenerationConfig(max_new_tokens=max_new_tokens, draft_tokens=depth)
    out = {"plain": measure(lambda: None, lambda: None, chain),
           "auto_plain_step": measure(lambda: MTPTreeDrafter(model, 1), PlainSteps, chain),
           "speculative": measure(lambda: MTPDrafter(model), lambda: None, chain), "trees": {}}
    for shape in trees:
        config = GenerationConfig(max_new_tokens=max_new_tokens, speculative=True)
        out["trees"][shape.describe()] = measure(lambda s=shape: MTPTreeDrafter(model, s.depth),
                                                 lambda s=shape: FixedTree(s), config)
    return out


class AutoChoices:
    """Which option ``speculative="auto"`` picks at each step: while :meth:`counting` is active,
    :meth:`~lightning_mtp.decoding.auto.AutoPolicy.next` is wrapped to count its answers (the library keeps no such
    record; the wrapper adds one counter increment per step).

    Example::

        choices = AutoChoices()
        with choices.counting("greedy batch 1"):
            generate(model, ids, 64, speculative="auto")
        choices.counts["greedy batch 1"]  # Counter({'tree[4, 2, 1, 1]': 20, 'plain': 3, ...})

    Steps after ``auto`` retired drafting (the call finishes in the plain loop) are not counted; the calls that did
    so are (``"calls retired to plain"``).
    """

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}

    @contextlib.contextmanager
    def counting(self, key: str):
        counts = self.counts.setdefault(key, Counter())
        original = AutoPolicy.next

        def counted(policy):
            option = original(policy)
            counts["plain" if option is None else option.describe()] += 1
            return option

        def init(steps, *args, **kwargs):  # a retired call runs plain steps the policy is never asked about
            original_init(steps, *args, **kwargs)
            if steps.retired:
                counts["calls retired to plain"] += 1

        original_init = AutoSteps.__init__
        AutoPolicy.next = counted
        AutoSteps.__init__ = init
        try:
            yield counts
        finally:
            AutoPolicy.next = original
            AutoSteps.__init__ = original_init

    def histogram(self, key: str) -> dict[str, int]:
        """Steps per option, most chosen first."""
        return dict(self.counts.get(key, Counter()).most_common())


def auto_memory(model) -> list[dict]:
    """What ``speculative="auto"`` learned on ``model`` (kept on the module per host, batch size, device, dtype, mode
    and option set): its step-cost model (a drafting step's overhead, a chain's cost per draft depth and a tree's
    per extra node-row, in plain steps; the prior until a plain step is timed), the plain step it measured, and the
    acceptance counts per (depth, the draft's kind: "chain", or a named tree)."""
    out = []
    for key, memory in model.__dict__.get("_mtp_auto_memory", {}).items():
        names = ("host", "batch_size", "device", "dtype", "sampling", "timings")
        entry = dict(zip(names, key)) if isinstance(key, tuple) and len(key) >= len(names) else {"key": str(key)}
        cost = memory.cost
        plain, overhead, per_depth, per_node = cost.parameters()
        unit = plain if cost.plain_timed else 1.0
        entry.update(
            plain_step_s=plain if cost.plain_timed else None, timed_steps=cost.timed,
            cost_in_plain_steps={"drafting_overhead": round(overhead / unit, 4),
                                 "per_draft_depth": round(per_depth / unit, 4),
                                 "per_tree_node_row": round(per_node / unit, 4)},
            acceptance={f"depth {d} {kind}": [round(hits, 2), round(tried, 2)]
                        for (d, kind), (hits, tried) in sorted(memory.acceptance.items())},  # (accepted, tried)
        )
        out.append(entry)
    return out


def row_label(row: dict) -> str:
    """A row's draft in words: ``k=3``, ``tree [4, 2, 1] (20 nodes)``, ``dynamic 16 nodes depth 4``, ``auto``."""
    if row["decoder"] == "tree":
        return f"tree {row['tree']} ({row['nodes']} nodes)"
    if row["decoder"] == "dynamic_tree":
        return f"dynamic tree {row['nodes']} nodes, depth {row['draft_tokens']}"
    if row["decoder"] == "auto":
        return "auto"
    return f"k={row['draft_tokens']} ({row['policy']})"


def explain(rows: list[dict], costs: dict, situ: dict, depth: int, weights: dict,
            tree_costs: Optional[dict] = None) -> list[str]:
    """Where the time per step goes, in units of a plain 1-token step, and the speedup that implies.

    ``costs`` maps a batch size to :func:`cost_breakdown`, ``tree_costs`` to :func:`tree_cost_breakdown`;
    ``weights`` is :func:`weight_bytes`."""
    unit = situ["plain"]["step_s"]
    spec = situ["speculative"]
    lines = [
        f"measured inside decoding (batch 1, k={depth}), per step in plain steps: main forward "
        f"{spec['forward_s'] / unit:.2f} + drafting {spec['draft_s'] / unit:.2f} + acceptance/bookkeeping/Python "
        f"{spec['rest_s'] / unit:.2f} = {spec['step_s'] / unit:.2f} (plain: forward "
        f"{situ['plain']['forward_s'] / unit:.2f} + rest {situ['plain']['rest_s'] / unit:.2f}); so speedup ~ "
        f"tau / {spec['step_s'] / unit:.2f}, and tau >= {2.0 * spec['step_s'] / unit:.2f} would be needed for 2x",
    ]
    if "auto_plain_step" in situ:
        auto_plain = situ["auto_plain_step"]
        lines.append(
            f"measured inside decoding (batch 1): a plain step of speculative='auto' (a tree step without drafts) "
            f"costs {auto_plain['step_s'] / unit:.2f} plain-loop steps (forward {auto_plain['forward_s'] / unit:.2f} "
            f"+ drafter bookkeeping {auto_plain['draft_s'] / unit:.2f} + rest {auto_plain['rest_s'] / unit:.2f}); "
            f"where no draft pays, auto runs at about {unit / auto_plain['step_s']:.2f}x plain")
    for name, tree in situ.get("trees", {}).items():
        lines.append(
            f"measured inside decoding (batch 1, {name}), per step in plain steps: main forward "
            f"{tree['forward_s'] / unit:.2f} + drafting {tree['draft_s'] / unit:.2f} + acceptance/path move/"
            f"bookkeeping/Python {tree['rest_s'] / unit:.2f} = {tree['step_s'] / unit:.2f}; so speedup ~ tau / "
            f"{tree['step_s'] / unit:.2f}, and tau >= {2.0 * tree['step_s'] / unit:.2f} would be needed for 2x")
    lines.append(
        f"weights read per step: trunk {weights['trunk'] / 2**20:.1f} MiB, each MTP depth (module + output head) "
        f"{weights['per_depth'] / 2**20:.1f} MiB = {weights['draft_over_trunk_per_depth']:.2f} of the trunk; a "
        f"bandwidth-bound batch-1 step with k={depth} drafts therefore costs at least "
        f"{1 + depth * weights['draft_over_trunk_per_depth']:.2f} plain steps, whatever the framework overhead")
    for batch, cost in costs.items():
        micro = cost["step_1_token_s"]
        widths = ", ".join(f"{k + 1} tokens {cost[f'verify_{k + 1}_tokens_s'] / micro:.2f}"
                           for k in range(1, depth + 1))
        drafts = ", ".join(f"{k} modules {cost[f'draft_{k}_s'] / micro:.2f}" for k in range(1, depth + 1))
        lines.append(f"isolated, batch {batch} (warm caches), in 1-token forwards ({micro * 1e3:.2f} ms): verify of "
                     f"{widths} per row; drafting through {drafts}")
    for batch, cost in (tree_costs or {}).items():
        if not cost:
            continue
        rel = cost["in_plain_steps"]
        verify = ", ".join(f"{t}: {v:.2f}" for t, v in rel["verify_tokens"].items())
        depth_cost = ", ".join(f"{n}: {v:.2f}" for n, v in rel["draft_depth_nodes"].items())
        lines.append(f"isolated, batch {batch}, in plain steps ({cost['step_1_token_s'] * 1e3:.2f} ms): tree verify "
                     f"forward by tokens per row {{{verify}}}; drafting the first depth "
                     f"{rel['draft_first_depth']:.2f}, each further depth below N nodes {{{depth_cost}}}")
        for name, draft_s in cost["draft_tree_s"].items():
            nodes = TreeShape(branching=tuple(int(b) for b in name.strip("[]").split(","))).num_nodes
            step = (interpolate(cost["verify_tokens_s"], nodes + 1) + draft_s) / cost["step_1_token_s"]
            measured = [r for r in rows if r["decoder"] == "tree" and r["batch_size"] == batch
                        and str(r["tree"]) == name]
            seen = ", ".join(f"{r['mode']}: tau {r['tau']:.2f}, measured {r['speedup']:.2f}x" for r in measured)
            lines.append(f"  batch {batch}, tree {name} ({nodes} nodes): verify + drafting = {step:.2f} plain steps "
                         f"(isolated), so it pays when tau > {step:.2f} and reaches 2x at tau {2 * step:.2f}"
                         + (f" ({seen})" if seen else ""))
    for row in rows:
        if row["decoder"] == "plain":
            continue
        step = row["seconds_per_step"] / row["plain_seconds_per_step"]
        fewer = row["plain_main_forwards"] / row["main_forwards"]
        batch_note = ""
        if row["batch_size"] > 1:  # a batch steps until its slowest row is done, so it gains less than tau
            batch_note = f", but the batch ran {fewer:.2f}x fewer forwards than plain (rows finish at different steps)"
        lines.append(
            f"{row['mode']} batch {row['batch_size']} {row_label(row)}, {row['drafts_per_step']:.1f} draft depths/step:"
            f" tau={row['tau']:.2f}{batch_note}; a step costs {step:.2f} plain steps -> speedup {fewer / step:.2f} "
            f"(measured {row['speedup']:.2f})"
        )
    return lines
