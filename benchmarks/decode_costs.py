"""Where a decoding step's time goes, for ``benchmarks/decode.py``: measured costs in units of a plain step.

- :func:`cost_breakdown`: a 1-token main step, a (k+1)-token verify forward and drafting through k modules, timed in
  isolation (warm caches) at a given batch size;
- :func:`in_situ_breakdown`: per step inside real decoding at batch 1 (timers around the host's forward and the
  drafter): main forward, drafting, and the rest (acceptance, bookkeeping, Python);
- :func:`weight_bytes`: the weights a step reads (trunk, and each MTP depth with its output head), which bound a
  bandwidth-bound step from below;
- :func:`explain`: the lines of the benchmark's explanation, each speedup as forwards saved over step cost.
"""

from __future__ import annotations

import statistics
import time

import torch

from lightning_mtp.decoding import GenerationConfig, MTPDrafter
from lightning_mtp.decoding.host import decoding_host
from lightning_mtp.decoding.sampling import SamplingParams


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
    """Wraps a host or drafter and sums the wall time of the named methods (same run, same caches)."""

    def __init__(self, inner, methods: tuple[str, ...]) -> None:
        self._inner, self._methods, self.seconds, self.calls = inner, methods, 0.0, 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._methods:
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def in_situ_breakdown(model, prompts: list[torch.Tensor], depth: int, max_new_tokens: int) -> dict:
    """Per decoding step at batch 1, measured inside real decoding: main-model forward, drafting (draft, observe,
    commit), and the rest (acceptance, bookkeeping, Python), for plain decoding and for k = D drafts."""
    from lightning_mtp.decoding import decode
    from lightning_mtp.decoding.speculative import prepare_prompts

    out = {}
    for name, speculative in (("plain", False), ("speculative", True)):
        forward_s = draft_s = total_s = 0.0
        steps = 0
        for prompt in prompts:
            host = Timed(decoding_host(model), ("forward", "main_logits"))
            drafter = Timed(MTPDrafter(model), ("draft", "observe", "commit")) if speculative else None
            ids, lengths = prepare_prompts(prompt.unsqueeze(0), None, host.vocab_size, torch.device("cpu"))
            result = decode(host, drafter, ids, lengths, GenerationConfig(max_new_tokens=max_new_tokens,
                                                                         draft_tokens=depth))
            forward_s += host.seconds
            draft_s += drafter.seconds if drafter is not None else 0.0
            total_s += result.stats.elapsed_s
            steps += result.stats.main_forwards
        out[name] = {"step_s": total_s / steps, "forward_s": forward_s / steps, "draft_s": draft_s / steps,
                     "rest_s": (total_s - forward_s - draft_s) / steps}
    return out


def explain(rows: list[dict], costs: dict, situ: dict, depth: int, weights: dict) -> list[str]:
    """Where the time per step goes, in units of a plain 1-token step, and the speedup that implies.

    ``costs`` maps a batch size to :func:`cost_breakdown`; ``weights`` is :func:`weight_bytes`."""
    unit = situ["plain"]["step_s"]
    spec = situ["speculative"]
    lines = [
        f"measured inside decoding (batch 1, k={depth}), per step in plain steps: main forward "
        f"{spec['forward_s'] / unit:.2f} + drafting {spec['draft_s'] / unit:.2f} + acceptance/bookkeeping/Python "
        f"{spec['rest_s'] / unit:.2f} = {spec['step_s'] / unit:.2f} (plain: forward "
        f"{situ['plain']['forward_s'] / unit:.2f} + rest {situ['plain']['rest_s'] / unit:.2f}); so speedup ~ "
        f"tau / {spec['step_s'] / unit:.2f}, and tau >= {2.0 * spec['step_s'] / unit:.2f} would be needed for 2x",
        f"weights read per step: trunk {weights['trunk'] / 2**20:.1f} MiB, each MTP depth (module + output head) "
        f"{weights['per_depth'] / 2**20:.1f} MiB = {weights['draft_over_trunk_per_depth']:.2f} of the trunk; a "
        f"bandwidth-bound batch-1 step with k={depth} drafts therefore costs at least "
        f"{1 + depth * weights['draft_over_trunk_per_depth']:.2f} plain steps, whatever the framework overhead",
    ]
    for batch, cost in costs.items():
        micro = cost["step_1_token_s"]
        widths = ", ".join(f"{k + 1} tokens {cost[f'verify_{k + 1}_tokens_s'] / micro:.2f}"
                           for k in range(1, depth + 1))
        drafts = ", ".join(f"{k} modules {cost[f'draft_{k}_s'] / micro:.2f}" for k in range(1, depth + 1))
        lines.append(f"isolated, batch {batch} (warm caches), in 1-token forwards ({micro * 1e3:.2f} ms): verify of "
                     f"{widths} per row; drafting through {drafts}")
    for row in rows:
        if row["decoder"] != "speculative":
            continue
        step = row["seconds_per_step"] / row["plain_seconds_per_step"]
        fewer = row["plain_main_forwards"] / row["main_forwards"]
        batch_note = ""
        if row["batch_size"] > 1:  # a batch steps until its slowest row is done, so it gains less than tau
            batch_note = f", but the batch ran {fewer:.2f}x fewer forwards than plain (rows finish at different steps)"
        lines.append(
            f"{row['mode']} batch {row['batch_size']} k={row['draft_tokens']} ({row['policy']}, "
            f"{row['drafts_per_step']:.1f} drafts/step): tau={row['tau']:.2f}{batch_note}; a step costs {step:.2f} "
            f"plain steps -> speedup {fewer / step:.2f} (measured {row['speedup']:.2f})"
        )
    return lines
