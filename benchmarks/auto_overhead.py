"""What ``speculative="auto"``'s own work costs a decoding call, against the fixed chain it would choose.

Four decoders run the same held-out prompts, interleaved call by call (a machine's drift reaches each alike):

* ``fixed``: the fixed chain of ``--chain`` drafts (``speculative=True, draft_tokens=K``), the reference;
* ``bare``: ``auto``'s decoding loop with a policy that answers the chain of K at every step and learns nothing: what
  the loop itself adds (its drafter for every option, the per-row summary of a batch);
* ``policy``: ``auto``'s policy rating, learning and measuring as usual, but the chain of K drafted at every step:
  what its Python adds;
* ``auto``: ``auto`` as it is (its choices and the options it measures included).

Each cell is the median over calls of the call's time over ``fixed``'s (1.03: 3% slower). A last, untimed pass
of ``auto`` times its policy (``next`` and ``observe_step``) and its whole step. One invocation is one model and
batch size; invocations of other code (``--run``, e.g. the script copied into a worktree of an earlier commit) go
beside it in the JSON, so two designs are compared on the same machine in one sitting.

Usage::

    python benchmarks/auto_overhead.py --ckpt .cache/lightning_mtp/benchmarks/decode_model.ckpt --label benchmark \\
        --batch-size 1 --chain 3 --run "this design"
    python benchmarks/auto_overhead.py --ckpt outputs/quickstart/checkpoints/last.ckpt --label quickstart \\
        --batch-size 8 --chain 1 --run "this design"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import chunks, held_out_prompts, load, run_chunk  # noqa: E402
from report import provenance  # noqa: E402

import lightning_mtp  # noqa: E402
from lightning_mtp.decoding.auto import AutoPolicy  # noqa: E402
from lightning_mtp.decoding.tree import TreeShape  # noqa: E402
from lightning_mtp.decoding.tree_policy import AutoSteps  # noqa: E402

DECODERS = ("fixed", "bare", "policy", "auto")


def policies(chain: TreeShape) -> dict[str, Optional[tuple]]:
    """(``AutoPolicy.next``, ``AutoPolicy.observe``) of each decoder (``None``: the fixed chain, no policy)."""
    choose, learn = AutoPolicy.next, AutoPolicy.observe

    def always(self: AutoPolicy) -> TreeShape:
        self.steps += 1
        self.measuring = False
        return chain

    def rated_but_chain(self: AutoPolicy) -> TreeShape:
        choose(self)  # rates, measures, keeps its books ...
        self.measure = []
        return self._took(chain, measuring=False)  # ... but drafts the chain

    return {"fixed": None, "bare": (always, lambda *args, **kwargs: None), "policy": (rated_but_chain, learn),
            "auto": (choose, learn)}


def decode_with(model, chunk, tokens: int, chain_drafts: int, patch: Optional[tuple]) -> float:
    """Seconds of one call (``patch``: the policy's methods for it, restored after)."""
    saved = AutoPolicy.next, AutoPolicy.observe
    kwargs = dict(speculative=True, draft_tokens=chain_drafts) if patch is None else dict(speculative="auto")
    if patch is not None:
        AutoPolicy.next, AutoPolicy.observe = patch
    try:
        start = time.perf_counter()
        run_chunk(model, chunk, tokens, None, **kwargs)
        return time.perf_counter() - start
    finally:
        AutoPolicy.next, AutoPolicy.observe = saved


def policy_seconds_per_step(model, batches, tokens: int) -> tuple[float, float]:
    """Seconds of ``auto``'s policy per step (``next`` + ``observe_step``) and of a whole step, over one pass of
    ``auto``."""
    spent = [0.0]
    choose, observe = AutoSteps.next, AutoSteps.observe_step

    def timed_next(self, *args):
        start = time.perf_counter()
        option = choose(self, *args)
        spent[0] += time.perf_counter() - start
        return option

    def timed_observe(self, *args, **kwargs):
        start = time.perf_counter()
        observe(self, *args, **kwargs)
        spent[0] += time.perf_counter() - start

    AutoSteps.next, AutoSteps.observe_step = timed_next, timed_observe
    start, forwards = time.perf_counter(), 0
    try:
        for chunk in batches:  # (a call retired to the plain loop asks its policy nothing)
            forwards += run_chunk(model, chunk, tokens, None, speculative="auto")[1].main_forwards
    finally:
        AutoSteps.next, AutoSteps.observe_step = choose, observe
    return spent[0] / forwards, (time.perf_counter() - start) / forwards


def code_version() -> str:
    """The commit of the ``lightning_mtp`` imported (``+`` when its package differs from that commit)."""
    repo = Path(lightning_mtp.__file__).resolve().parents[1]
    git = ["git", "-C", str(repo)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "lightning_mtp"], capture_output=True, text=True).stdout
    return (commit or "unknown") + ("+" if dirty.strip() else "")


def measure(model, prompts: list[torch.Tensor], batch_size: int, chain_drafts: int, tokens: int,
            repeats: int) -> dict:
    batches = chunks(prompts, batch_size)
    chain = TreeShape.chain(chain_drafts)
    patches = policies(chain)
    for chunk in batches:  # auto learns what a user's earlier calls would have taught it; shapes get measured
        run_chunk(model, chunk, tokens, None, speculative="auto")
        decode_with(model, chunk, min(tokens, 8), chain_drafts, None)
    ratios: dict[str, list[float]] = {name: [] for name in DECODERS[1:]}
    for _ in range(repeats):
        for chunk in batches:
            seconds = {name: decode_with(model, chunk, tokens, chain_drafts, patches[name]) for name in DECODERS}
            for name in ratios:
                ratios[name].append(seconds[name] / seconds["fixed"])
    policy, step = policy_seconds_per_step(model, batches, tokens)
    return {**{name: statistics.median(values) for name, values in ratios.items()}, "calls": len(ratios["auto"]),
            "policy_us_per_step": 1e6 * policy, "step_ms": 1e3 * step}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--ckpt", type=Path, required=True, help="a trained CausalLM checkpoint")
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "decode_model.yaml")
    parser.add_argument("--label", required=True, help="the model's name in the table")
    parser.add_argument("--run", required=True, help="the code's name in the table (runs of other code go beside)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--chain", type=int, default=1, help="drafts of the fixed chain auto is compared with")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=4, help="passes over the prompts (calls interleaved)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "auto_overhead.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model, datamodule = load(args.ckpt, args.config)
    model = model.to("cpu", torch.float32).eval()
    prompts = held_out_prompts(datamodule, args.prompts, args.prompt_tokens)
    how = provenance(__file__, argv)
    row = {"model": args.label, "batch_size": args.batch_size, "chain": args.chain, "command": how["command"],
           **measure(model, prompts, args.batch_size, args.chain, args.max_new_tokens, args.repeats)}
    print(f"{args.run}: {args.label} batch {args.batch_size} vs the fixed chain of {args.chain}: "
          + ", ".join(f"{name} {row[name]:.3f}" for name in DECODERS[1:])
          + f"; policy {row['policy_us_per_step']:.0f} us per step of {row['step_ms']:.2f} ms", flush=True)
    result = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": {}}
    run = result["runs"].setdefault(args.run, {"rows": []})
    run.update(code=code_version(), machine=how["machine"])
    run["rows"] = [r for r in run["rows"] if (r["model"], r["batch_size"]) != (args.label, args.batch_size)] + [row]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
