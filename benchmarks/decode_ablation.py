"""Which of ``speculative="auto"``'s mechanisms pay: each turned off in turn, timed against the whole policy.

The policy (:mod:`lightning_mtp.decoding.auto`) has six mechanisms, each a field of
:data:`lightning_mtp.decoding.auto.SWITCHES`:

- ``fit``: the step-cost model fitted online to timed steps (off: the prior from the weights' bytes alone);
- ``speed``: each timed step learned over the machine's current speed (the median of measured over predicted time of
  the last steps), so options measured while the machine was slower are not priced dear after (off: as measured);
- ``memory``: costs and acceptance kept across calls (off: every call starts from the prior);
- ``explore``: once every option is measured, the options not chosen measured in turn within ``EXPLORE_SHARE`` of
  the decoded time (off: each only until it is measured);
- ``rows``: a batch rated by each row's own acceptance and by the row with the most steps left (off: by the
  acceptance pooled over its rows, as tokens per second);
- ``last_row``: a batch's drafts scaled by what its last row realized over what it was rated at in earlier drafting
  steps (off: as rated).

This is the timed ablation: on a shared 2-core CPU its rows move 10-20% between runs, more than most mechanisms are
worth, so the ablation of record is ``benchmarks/decode_replay.py`` (the same rows without timing noise); run this one
on a quiet machine or a GPU.

On one checkpoint and the same held-out prompts, greedy at batch 1 and 8: plain decoding, every fixed chain of
1..D drafts, the whole policy and the policy without each mechanism, each row run once untimed (its warm-up call),
then timed in ``--repeats`` repeats (median), the rows interleaved batch by batch of prompts. A mechanism stays only
if turning it off costs at least 2% on some row (``benchmarks/results/decode_ablation.json``; the results page shows
the table).

Usage::

    python benchmarks/decode_ablation.py --ckpt .cache/lightning_mtp/benchmarks/decode_model.ckpt
    python benchmarks/decode_ablation.py --ckpt outputs/quickstart/checkpoints/last.ckpt --label quickstart --append
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import chunks, combined, held_out_prompts, load, run_chunk  # noqa: E402
from report import provenance  # noqa: E402

from lightning_mtp.decoding.auto import SWITCHES  # noqa: E402

MECHANISMS = ("fit", "speed", "memory", "explore", "rows", "last_row")


def variants(depth: int) -> list[tuple[str, dict, dict]]:
    """(name, generate kwargs, switches) of every row."""
    rows = [("plain", {"speculative": False}, {})]
    rows += [(f"chain k={k}", {"speculative": True, "draft_tokens": k}, {}) for k in range(1, depth + 1)]
    rows.append(("auto", {"speculative": "auto"}, {}))
    rows += [(f"auto without {m}", {"speculative": "auto"}, {m: False}) for m in MECHANISMS]
    return rows


def timed(model, chunk, tokens: int, kwargs: dict, switches: dict, memory: dict) -> tuple[float, tuple]:
    """(seconds, the :func:`run_chunk` result) of decoding one batch of prompts with ``switches`` set (restored
    after) and ``memory`` as what ``auto`` learned on the model (each row learns in its own)."""
    saved = dict(vars(SWITCHES))
    vars(SWITCHES).update(switches)
    model.__dict__["_mtp_auto_memory"] = memory
    try:
        start = time.perf_counter()
        result = run_chunk(model, chunk, tokens, torch.Generator().manual_seed(0), **kwargs)
        return time.perf_counter() - start, result
    finally:
        vars(SWITCHES).update(saved)


def run(args: argparse.Namespace, argv: Optional[list[str]] = None) -> dict:
    torch.set_num_threads(args.threads)
    model, data = load(args.ckpt, ROOT / "benchmarks" / "decode_model.yaml")
    model.eval()
    prompts = held_out_prompts(data, args.prompts, args.prompt_tokens)
    depth = model.mtp_config.depth
    rows = []
    for batch in args.batch_sizes:
        plan = variants(depth)
        memories: dict[str, dict] = {name: {} for name, _, _ in plan}
        batches = chunks(prompts, batch)
        for name, kwargs, switches in plan:  # warm-up: every row once, untimed (auto learns its first call here)
            for chunk in batches:
                timed(model, chunk, args.max_new_tokens, kwargs, switches, memories[name])
        seconds: dict[str, list[float]] = {name: [] for name, _, _ in plan}
        taus: dict[str, float] = {}
        for _ in range(args.repeats):
            spent: dict[str, float] = dict.fromkeys(seconds, 0.0)
            results: dict[str, list] = {name: [] for name in seconds}
            for chunk in batches:  # the rows interleaved batch by batch: the machine's drift reaches each alike
                for name, kwargs, switches in plan:
                    s, result = timed(model, chunk, args.max_new_tokens, kwargs, switches, memories[name])
                    spent[name] += s
                    results[name].append(result)
            for name in seconds:
                seconds[name].append(spent[name])
                taus[name] = combined(results[name])[1]["tau"]
        median = {name: statistics.median(v) for name, v in seconds.items()}
        tokens = len(prompts) * args.max_new_tokens
        for name, _, _ in plan:
            rows.append({"model": args.label, "batch_size": batch, "row": name, "tau": taus[name],
                         "tokens_per_s": tokens / median[name], "vs_plain": median["plain"] / median[name],
                         "vs_auto": median["auto"] / median[name]})
        print(json.dumps([r for r in rows if r["batch_size"] == batch], indent=1), flush=True)
    return {"rows": rows, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **provenance(__file__, argv)}


def verdicts(rows: list[dict]) -> dict[str, float]:
    """Per mechanism, the most its removal cost on any row (``1 - vs_auto`` at its worst; below 0.02: drop it)."""
    return {m: max(1.0 - r["vs_auto"] for r in rows if r["row"] == f"auto without {m}") for m in MECHANISMS
            if any(r["row"] == f"auto without {m}" for r in rows)}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--label", default="benchmark model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--append", action="store_true", help="add this model's rows to an existing --out")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_ablation.json")
    args = parser.parse_args(argv)
    return save(run(args, argv), args.out, args.label, args.append)


def save(result: dict, out: Path, label: str, append: bool) -> dict:
    """Write ``result`` (one model's rows) to ``out``; with ``append``, beside the other models' rows there (this
    model's earlier rows replaced; so are its entries of every other per-model dict, such as ``step_costs``)."""
    if append and out.is_file():
        earlier = json.loads(out.read_text())
        result["rows"] = [r for r in earlier["rows"] if r["model"] != label] + result["rows"]
        result["runs"] = [r for r in earlier.get("runs", []) if r.get("label") != label]
        for key, value in result.items():
            if isinstance(value, dict) and label in value and isinstance(earlier.get(key), dict):
                result[key] = {**{k: v for k, v in earlier[key].items() if k != label}, **value}
    result.setdefault("runs", []).append({"label": label, "command": result.pop("command"),
                                          "machine": result.pop("machine"), "settings": result.pop("settings")})
    result["verdicts"] = verdicts(result["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: {result['verdicts']}")
    return result


if __name__ == "__main__":
    main()
