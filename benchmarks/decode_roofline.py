"""Speculative decoding beyond this machine: step costs from FLOPs and bytes, on GPUs this project has not run on.

A decoding step of a model on a GPU takes about the larger of its bytes over the memory bandwidth and its FLOPs over
the peak throughput, plus a fixed cost per kernel launch. This script writes that model down for one step:

- **verify** ``n`` tokens for each of ``B`` rows (``n = 1``: a plain step): the trunk's and the output head's weights
  read once, the KV cache of the context read once per row, ``2 · params · B · n`` FLOPs in the matrix products and
  ``4 · layers · width · context · B · n`` in attention;
- **one drafting call**: one MTP module (``eh_proj`` 2H → H and one block) and the output head, over the ``B · w``
  positions it recomputes (``w`` = 1 in steady state), its own small KV cache;

and from it predicts, for plain decoding, chains of 1..K drafts and static trees, the step time, the expected tokens
per step (from per-depth acceptance: measured ones from ``benchmarks/results/decode.json`` for the benchmark model,
stated assumptions otherwise) and the speedup over plain decoding; and what ``speculative="auto"`` (plain or a chain
of 1..D) would choose there, by running its step-cost model (:class:`~lightning_mtp.decoding.step_cost.StepCost`)
and policy on the predicted step times (:func:`policy_choice`).

**Assumptions** (stated in the JSON too): weights and KV cache in bf16 (2 bytes); matrix products at ``--mfu`` of
peak when compute-bound and bandwidth at ``--mbu`` of peak when memory-bound; ``--launch-us`` per kernel launch, 8
launches per transformer block; the drafting calls of a step run one after another; a tree's verify costs its
tokens, its drafting the same calls as the chain of its depth (each call over the tree's nodes at that depth); no
CUDA graphs, no overlap of drafting and verification. It is a model, not a measurement: ``scripts/gpu_check.sh``
measures the same rows where a GPU is lent, so the prediction can be checked.

Usage::

    python benchmarks/decode_roofline.py            # writes benchmarks/results/decode_roofline.json
    python benchmarks/decode_roofline.py --measure --out outputs/roofline.json   # on a GPU: measured beside predicted
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import provenance  # noqa: E402

from lightning_mtp.decoding.auto import AutoMemory, AutoPolicy, candidate_options  # noqa: E402
from lightning_mtp.decoding.step_cost import StepCost  # noqa: E402
from lightning_mtp.decoding.tree import TreeShape  # noqa: E402


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    width: int
    mlp: int
    vocab: int
    kv_width: int
    depth: int
    """MTP depth D (cascaded modules)."""

    @property
    def block_params(self) -> int:
        return 2 * self.width * self.width + 2 * self.width * self.kv_width + 3 * self.width * self.mlp

    @property
    def head_params(self) -> int:
        return self.vocab * self.width

    @property
    def module_params(self) -> int:
        return self.block_params + 2 * self.width * self.width  # the block and eh_proj (2H -> H)


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float
    """Bytes per second (HBM)."""
    flops: float
    """Dense bf16 FLOPs per second."""


MODELS = (
    Model("benchmark model (12 layers, width 128, vocab 2048, D = 3)", 12, 128, 352, 2048, 128, 3),
    Model("7B class (32 layers, width 4096, vocab 32000, D = 3)", 32, 4096, 11008, 32000, 4096, 3),
)
HARDWARE = (Hardware("H100 SXM", 3.35e12, 989e12), Hardware("H200", 4.8e12, 989e12))
ASSUMED_ACCEPTANCE = (0.8, 0.75, 0.7, 0.65)
"""Per-depth conditional acceptance of the best candidate where no measurement is given (depth 1, 2, ...)."""
SECOND_CANDIDATE = 0.35
"""Share of the remaining cases where a second candidate at a depth is the accepted one (trees)."""


@dataclass
class Costs:
    bandwidth: float
    flops: float
    launch_s: float
    bytes_per: float = 2.0

    def time(self, bytes_: float, flops: float, launches: int) -> float:
        return max(bytes_ / self.bandwidth, flops / self.flops) + launches * self.launch_s


def verify_seconds(model: Model, costs: Costs, rows: int, tokens: int, context: int) -> float:
    params = model.layers * model.block_params + model.head_params
    kv = 2 * model.layers * model.kv_width * context * rows * costs.bytes_per
    flops = 2 * params * rows * tokens + 4 * model.layers * model.width * context * rows * tokens
    return costs.time(params * costs.bytes_per + kv, flops, 8 * model.layers + 2)


def draft_seconds(model: Model, costs: Costs, rows: int, positions: int, context: int) -> float:
    params = model.module_params + model.head_params
    kv = 2 * model.kv_width * context * rows * costs.bytes_per
    flops = 2 * params * rows * positions + 4 * model.width * context * rows * positions
    return costs.time(params * costs.bytes_per + kv, flops, 8 + 3)


def step_seconds(model: Model, costs: Costs, option: Optional[TreeShape], rows: int, context: int) -> float:
    if option is None:
        return verify_seconds(model, costs, rows, 1, context)
    seconds = verify_seconds(model, costs, rows, option.num_nodes + 1, context)
    width = 1
    for branch in option.branching:  # drafting call k runs over the tree's nodes at depth k - 1
        seconds += draft_seconds(model, costs, rows, width, context)
        width *= branch
    return seconds


def expected_tokens(option: Optional[TreeShape], acceptance: tuple[float, ...]) -> float:
    if option is None:
        return 1.0
    tokens, reach = 1.0, 1.0
    for depth, branch in enumerate(option.branching):
        alpha = acceptance[min(depth, len(acceptance) - 1)]
        hit = alpha + (1 - alpha) * SECOND_CANDIDATE * (1 - SECOND_CANDIDATE ** (branch - 1)) / (1 - SECOND_CANDIDATE)
        reach *= hit if branch > 1 else alpha
        tokens += reach
    return tokens


def options_for(model: Model) -> list[Optional[TreeShape]]:
    """The fixed decoders of the table: plain, chains of 1..D+1 drafts, and static trees of 2 or 3 candidates at
    depth 1 (one under each after) for every chain length."""
    chains = candidate_options(model.depth + 1)
    return chains + [TreeShape(branching=(b,) + (1,) * (k - 1)) for b in (2, 3) for k in range(1, model.depth + 2)]


def policy_choice(model: Model, costs: Costs, rows: int, context: int, acceptance: tuple[float, ...]) -> str:
    """What ``auto``'s cost model and policy settle on when every option's step takes the predicted time and drafts
    are accepted as ``acceptance`` says: its model is fed the predicted times of every option, then asked."""
    options = candidate_options(model.depth)  # what auto chooses among: plain and chains of 1..D
    cost = StepCost(draft_share=0.1)
    for _ in range(20):
        for option in options:
            cost.observe(rows, 1 if option is None else option.num_nodes + 1, 0 if option is None else option.depth,
                         step_seconds(model, costs, option, rows, context))
    policy = AutoPolicy(AutoMemory(cost), options, rows, timings=False)
    for depth in range(1, model.depth + 1):
        alpha = acceptance[min(depth - 1, len(acceptance) - 1)]
        policy.memory.acceptance[(depth, "chain")] = [100 * alpha, 100.0]
    best = max(options, key=policy.rate)
    return "plain" if best is None else best.describe()


def measured_acceptance(path: Path, depth: int) -> Optional[tuple[float, ...]]:
    """Per-depth conditional acceptance of the greedy batch-1 chain of D in a ``decode.py`` result, if any."""
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())
    for row in rows if isinstance(rows, list) else rows.get("rows", []):
        if (row.get("mode"), row.get("decoder"), row.get("batch_size"), row.get("draft_tokens"),
                row.get("policy")) == ("greedy", "chain", 1, depth, "fixed"):
            return tuple(row["conditional_acceptance_per_depth"])
    return None


def table(model: Model, hardware: Hardware, args: argparse.Namespace, acceptance: tuple[float, ...]) -> list[dict]:
    costs = Costs(hardware.bandwidth * args.mbu, hardware.flops * args.mfu, args.launch_us * 1e-6)
    rows = []
    for batch in args.batch_sizes:
        plain = step_seconds(model, costs, None, batch, args.context)
        for option in options_for(model):
            seconds = step_seconds(model, costs, option, batch, args.context)
            tokens = expected_tokens(option, acceptance)
            rows.append({"model": model.name, "hardware": hardware.name, "batch_size": batch,
                         "option": "plain" if option is None else option.describe(),
                         "step_ms": round(seconds * 1e3, 4), "step_in_plain_steps": round(seconds / plain, 3),
                         "tokens_per_step": round(tokens, 3), "speedup": round(tokens * plain / seconds, 3)})
        choice = policy_choice(model, costs, batch, args.context, acceptance)
        for row in rows:
            if row["batch_size"] == batch and row["hardware"] == hardware.name and row["model"] == model.name:
                row["auto_would_choose"] = row["option"] == choice
    return rows


def measure(model: Model, args: argparse.Namespace) -> dict:
    """Step times of plain decoding and of chains of 1..D on this machine's device, for ``model``'s shape with random
    weights (bf16 on a GPU): a step's time does not depend on what its drafts are, only on its shape.

    A step is timed by difference: a ``generate()`` call of ``--measure-tokens`` + 1 new tokens less one of a single
    token (its prefill of ``--context`` tokens, and the call's set-up), over the main-model forwards between them. So
    neither the prefill nor a call's fixed cost is counted as decoding. Options run interleaved within each of
    ``--repeats`` rounds (the median round is kept), after two warm-up calls each, so a device whose clocks drift
    shifts every option alike. Each row stands beside the prediction for the hardware this device is named after
    (``--hardware`` otherwise): in milliseconds, and in plain steps of the same batch size."""
    import time

    import torch

    from lightning_mtp.config import MTPConfig
    from lightning_mtp.models import CausalLM
    from lightning_mtp.models.causal_lm import ModelConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    hardware = next((h for h in HARDWARE if h.name.split()[0] in name), None) or \
        next(h for h in HARDWARE if h.name == args.hardware)
    costs = Costs(hardware.bandwidth * args.mbu, hardware.flops * args.mfu, args.launch_us * 1e-6)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=model.vocab, dim=model.width, n_layers=model.layers, n_heads=4,
                         max_seq_len=args.context + args.measure_tokens + 2 * model.depth + 8)
    lm = CausalLM(model=config, mtp=MTPConfig(depth=model.depth, architecture="cascaded")).to(device).eval()
    if device.type == "cuda":
        lm = lm.to(torch.bfloat16)

    def timed(prompts, new_tokens: int, kwargs: dict) -> tuple[float, int]:  # (seconds, main-model forwards)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = lm.generate(prompts, new_tokens, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out.stats.main_forwards

    rows = []
    for batch in args.batch_sizes:
        prompts = torch.randint(0, model.vocab, (batch, args.context), device=device)
        options = candidate_options(model.depth)
        kwargs = {option: {"speculative": False} if option is None else
                  {"speculative": True, "draft_tokens": option.depth} for option in options}
        for option in options:
            for _ in range(2):
                timed(prompts, 4, kwargs[option])  # warm-up
        steps = {option: [] for option in options}
        short_calls = {option: [] for option in options}
        for _ in range(args.repeats):
            for option in options:  # interleaved
                short, short_forwards = timed(prompts, 1, kwargs[option])
                long, long_forwards = timed(prompts, args.measure_tokens + 1, kwargs[option])
                steps[option].append((long - short) / max(long_forwards - short_forwards, 1))
                short_calls[option].append(short)
        median = {option: sorted(times)[len(times) // 2] for option, times in steps.items()}
        plain = step_seconds(model, costs, None, batch, args.context)
        for option in options:
            predicted = step_seconds(model, costs, option, batch, args.context)
            rows.append({"batch_size": batch, "option": "plain" if option is None else option.describe(),
                         "step_ms": round(median[option] * 1e3, 4),
                         "step_in_plain_steps": round(median[option] / median[None], 3),
                         "predicted_step_ms": round(predicted * 1e3, 4),
                         "predicted_step_in_plain_steps": round(predicted / plain, 3),
                         "one_token_call_ms": round(sorted(short_calls[option])[args.repeats // 2] * 1e3, 3)})
    return {"model": model.name, "device": name, "predicted_for": hardware.name, "context": args.context,
            "measure_tokens": args.measure_tokens, "repeats": args.repeats, "rows": rows}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=1024, help="tokens in the KV cache per row")
    parser.add_argument("--mbu", type=float, default=0.7, help="share of peak bandwidth reached")
    parser.add_argument("--mfu", type=float, default=0.5, help="share of peak FLOPs reached")
    parser.add_argument("--launch-us", type=float, default=5.0, help="microseconds per kernel launch")
    parser.add_argument("--measured", type=Path, default=ROOT / "benchmarks" / "results" / "decode.json",
                        help="decode.py result whose chain acceptance the benchmark model's rows use")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_roofline.json")
    parser.add_argument("--measure", action="store_true",
                        help="also time plain and chain steps of the benchmark model's shape on this device (GPU)")
    parser.add_argument("--measure-tokens", type=int, default=32, help="new tokens per timed --measure call")
    parser.add_argument("--repeats", type=int, default=3, help="timed --measure calls per row (median)")
    parser.add_argument("--hardware", default="H200", help="--measure: the prediction to compare with off a GPU")
    args = parser.parse_args(argv)
    rows, acceptances = [], {}
    for model in MODELS:
        measured = measured_acceptance(args.measured, model.depth) if model.layers == 12 else None
        acceptance = measured or ASSUMED_ACCEPTANCE
        acceptances[model.name] = {"per_depth": [round(a, 3) for a in acceptance],
                                   "source": "measured (decode.json, greedy chain of D)" if measured else "assumed"}
        for hardware in HARDWARE:
            rows += table(model, hardware, args, acceptance)
    result = {"rows": rows, "acceptance": acceptances, "second_candidate": SECOND_CANDIDATE,
              "models": [asdict(m) for m in MODELS], "hardware": [asdict(h) for h in HARDWARE],
              "assumptions": {"bytes_per_value": 2, "mbu": args.mbu, "mfu": args.mfu, "launch_us": args.launch_us,
                              "context": args.context, "launches_per_block": 8},
              **provenance(__file__, argv, device="analytic (no device)")}
    if args.measure:
        result["measured"] = measure(MODELS[0], args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
