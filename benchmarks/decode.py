"""Self-speculative decoding against plain decoding of the same model, in one run.

Rows (``benchmarks/results/decode.json``), all on the same model and prompts (held-out files of the corpus), timed
side by side:

- greedy, batch 1: plain; chains of 1..D drafts, the dynamic draft-length policies (confidence, adaptive) and chains
  of D+1..D+3 drafts (cascaded modules: the last one re-applied); a sweep of static trees (:func:`static_trees`, one
  level deeper than D when cascaded); dynamic EAGLE-2 trees of 8, 16 and 32 nodes of depth D+1; ``speculative="auto"``;
- greedy, batch 8: plain, chains of 1..D, the draft-length policies, the two smallest static trees, ``auto``;
- sampling at T = 1, batch 1: plain, chains of 1..D, a static tree (candidates drawn without replacement), a dynamic
  tree and ``auto``; batch 8: plain, chains of 1..D and ``auto``;
- ``compile=True`` (``greedy-compiled``), batch 1: plain and the chain of D (``--no-compile`` skips them).

Each row has ``mode``, ``decoder`` (``plain``, ``chain``, ``tree``, ``dynamic_tree`` or ``auto``), ``policy`` (chains:
``fixed``, ``confidence`` or ``adaptive``), ``tree`` (a static tree's branching, else null), ``nodes`` (draft tokens
verified per row and step: k for a chain, null for ``auto``), ``batch_size``, ``draft_tokens`` (the draft depth;
``auto``: the deepest it may choose), ``tau`` (tokens per main-model forward, bonus token counted),
``acceptance_per_depth`` (share of row-steps whose accepted path reached depth d), ``tokens_per_s`` and ``speedup``
(over plain decoding of the same mode and batch size); greedy rows say whether the output equals plain decoding
token for token (``lossless``; null for sampling). ``auto`` rows also count the options the policy chose
(``auto_choices``). The timing is the median over ``--repeats`` repeats, each interleaving the rows of a batch size
batch by batch of prompts (so the machine's drift reaches every row alike); every row is run once before
(a warm-up over the same prompts and batches: 8 new tokens, ``auto`` rows the whole budget), so what ``auto`` learns
in its first call per batch size (its step costs and acceptance) is learned before the timed calls, as in any
longer-running use (see :func:`measure`).

The summary (``decode_summary.json``) explains the speedup from measurement, in units of a plain decoding step
(``benchmarks/decode_costs.py``): inside real decoding at batch 1, a speculative step's main forward, drafting and
the rest (acceptance, bookkeeping, Python), for the chain of D and the fastest trees; in isolation at batch 1 and 8, a
(k+1)-token verify forward, drafting through k modules, the tree verify forward over 1..64 tokens per row and the
drafting of a tree depth below N nodes; and the weight bytes a step reads. It also holds what ``auto`` chose and
learned, the best row per decoder, and the targets of the default decoder (``auto`` against the fastest fixed
decoder and against plain decoding, per mode and batch size), each met or missed.

Usage::

    python benchmarks/decode.py --ckpt model.ckpt                  # a trained checkpoint (any CausalLM)
    python benchmarks/decode.py --train-seconds 1200               # train with benchmarks/decode_model.yaml first
    python benchmarks/decode.py --ckpt outputs/quickstart/checkpoints/last.ckpt --max-new-tokens 32 --prompts 4 \
        --repeats 1 --no-compile --out /tmp/decode_smoke       # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_costs import (  # noqa: E402
    AutoChoices,
    auto_memory,
    cost_breakdown,
    explain,
    in_situ_breakdown,
    tree_cost_breakdown,
    weight_bytes,
)
from decode_report import TARGETS, best_per_decoder, check_targets, plot  # noqa: E402, F401 (TARGETS: tests)
from report import provenance  # noqa: E402

from lightning_mtp.decoding import GenerationConfig, generate  # noqa: E402
from lightning_mtp.decoding.stats import DecodeStats  # noqa: E402
from lightning_mtp.decoding.tree import TreeShape  # noqa: E402

DYNAMIC_TREE_NODES = (8, 16, 32)
"""Node budgets of the batch-1 greedy dynamic trees (EAGLE-2: ``draft_tree_nodes``, top-4 expansion)."""


# ----------------------------------------------------------------------------------------------- model and data
def train(config: Path, seconds: float, ckpt: Path, extra: list[str], resume: Optional[Path] = None):
    """Fit CausalLM on TextDataModule with the project's CLI config for ``seconds`` and save it to ``ckpt``.

    ``resume``: a checkpoint this script saved, to continue exactly where it stopped (optimizer, schedule, data
    order; ``seconds`` then counts the earlier sittings' time too, as Lightning's ``max_time`` does).
    Returns (model, datamodule, training info)."""
    import lightning as L

    from lightning_mtp.cli import MTPLightningCLI

    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    args = ["--config", str(config), "--trainer.max_time", f"00:{hours:02d}:{minutes:02d}:{secs:02d}",
            "--trainer.default_root_dir", str(ckpt.parent / "train"), *extra]
    cli = MTPLightningCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                          subclass_mode_data=True, run=False, args=args, auto_configure_optimizers=False,
                          save_config_kwargs={"overwrite": True})
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=None if resume is None else str(resume))
    info = {"train_seconds": time.perf_counter() - start, "train_steps": cli.trainer.global_step,
            "train_args": extra, "resumed_from": None if resume is None else str(resume)}
    print(f"trained for {info['train_seconds']:.0f}s, {info['train_steps']} steps", flush=True)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    cli.trainer.save_checkpoint(ckpt)
    print(f"saved {ckpt}", flush=True)
    return cli.model, cli.datamodule, info


def load(ckpt: Path, config: Path):
    """The checkpoint's model, and a datamodule from its saved hyperparameters (else from the config)."""
    import yaml

    from lightning_mtp.data import TextDataModule
    from lightning_mtp.models import load_causal_lm

    model = load_causal_lm(str(ckpt))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True).get("datamodule_hyper_parameters")
    if saved is None:
        saved = yaml.safe_load(config.read_text())["data"].get("init_args", {})
    return model, TextDataModule(**{k: v for k, v in saved.items() if not k.startswith("_")})


def held_out_prompts(datamodule, count: int, length: int) -> list[torch.Tensor]:
    """The first ``length`` tokens of ``count`` windows spread over the held-out files."""
    datamodule.setup("predict")
    windows = datamodule.val_dataset
    stride = max(1, len(windows) // count)
    return [windows[i * stride]["input_ids"][:length].clone() for i in range(min(count, len(windows)))]


# ----------------------------------------------------------------------------------------------- runs
def chunks(prompts: list[torch.Tensor], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prompts in batches of ``batch_size``: (input ids, attention mask), right-padded with 0."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, prompt in enumerate(chunk):
            input_ids[row, : len(prompt)] = prompt
            mask[row, : len(prompt)] = 1
        out.append((input_ids, mask))
    return out


def run_chunk(model, chunk: tuple[torch.Tensor, torch.Tensor], max_new_tokens: int, generator: torch.Generator,
              **kwargs) -> tuple[list[list[int]], DecodeStats]:
    """Decode one batch of :func:`chunks`; returns (new tokens per prompt, stats)."""
    input_ids, mask = chunk
    out = generate(model, input_ids, max_new_tokens, attention_mask=mask, generator=generator, **kwargs)
    return [out.new_tokens[b, : out.num_new_tokens[b]].tolist() for b in range(len(input_ids))], out.stats


def run_mode(model, prompts: list[torch.Tensor], batch_size: int, max_new_tokens: int, seed: int, **kwargs):
    """Decode every prompt (in batches); returns (new tokens per prompt, combined stats dict)."""
    generator = torch.Generator().manual_seed(seed)
    return combined([run_chunk(model, chunk, max_new_tokens, generator, **kwargs)
                     for chunk in chunks(prompts, batch_size)])


def combined(results: list[tuple[list[list[int]], DecodeStats]]) -> tuple[list[list[int]], dict]:
    """(every prompt's new tokens, the combined stats dict) of :func:`run_chunk` results, in order."""
    return [tokens for outputs, _ in results for tokens in outputs], DecodeStats.combine([s for _, s in results])


def static_trees(depth: int, cascaded: bool) -> list[list[int]]:
    """The static tree sweep for D = ``depth``: the chain of D widened at its first one or two depths (2, 3x2, 4x2 or
    8x2 candidates), then (cascaded modules) two trees one level deeper than D; duplicates and trees deeper than the
    drafter allows are dropped. D = 3: [2,1,1], [3,2,1], [4,2,1], [8,2,1], [4,2,1,1], [4,2,2,1]."""
    def tail(n: int) -> list[int]:
        return [1] * max(0, n)

    shapes = [[2] + tail(depth - 1), [3, 2] + tail(depth - 2), [4, 2] + tail(depth - 2), [8, 2] + tail(depth - 2),
              [4, 2] + tail(depth - 1), [4, 2, 2] + tail(depth - 2)]
    deepest = depth + 1 if cascaded else depth
    out: list[list[int]] = []
    for shape in shapes:
        if len(shape) <= deepest and shape not in out:
            out.append(shape)
    return out


def plan_row(mode: str, decoder: str, batch: int, depth: int, policy: str = "fixed",
             tree: Optional[list[int]] = None, nodes: Optional[int] = None, **kwargs) -> dict:
    """One row of the plan, drafting to ``depth`` (the row's ``draft_tokens``); ``kwargs`` go to :func:`generate`."""
    return dict(mode=mode, decoder=decoder, policy=policy, tree=tree, nodes=nodes, batch_size=batch,
                draft_tokens=depth, kwargs=kwargs)


def modes(depth: int, batch_sizes: list[int], compiled: bool = True, cascaded: bool = True) -> list[dict]:
    """The benchmark's rows (see the module docstring) for a model of MTP depth ``depth``."""
    trees = static_trees(depth, cascaded)
    deepest = depth + 1 if cascaded else depth  # what the dynamic trees draft to
    rows = []
    for batch in batch_sizes:
        rows.append(plan_row("greedy", "plain", batch, 0, "-", nodes=0, speculative=False))
        for k in range(1, depth + 1):
            rows.append(plan_row("greedy", "chain", batch, k, nodes=k, speculative=True, draft_tokens=k))
        for name, extra in (("confidence", dict(draft_confidence_threshold=0.3)),
                            ("adaptive", dict(adaptive_draft_tokens=True))):
            rows.append(plan_row("greedy", "chain", batch, depth, name, nodes=depth, speculative=True,
                                 draft_tokens=depth, **extra))
        if batch == 1:
            if cascaded:  # drafts beyond D: the last module applied again on its own output
                for k in range(depth + 1, depth + 4):
                    rows.append(plan_row("greedy", "chain", batch, k, nodes=k, speculative=True, draft_tokens=k))
            for tree in trees:
                rows.append(plan_row("greedy", "tree", batch, len(tree), tree=tree,
                                     nodes=TreeShape(branching=tuple(tree)).num_nodes, speculative=True,
                                     draft_tree=tree))
            for nodes in DYNAMIC_TREE_NODES:
                rows.append(plan_row("greedy", "dynamic_tree", batch, deepest, nodes=nodes, speculative=True,
                                     draft_tree_nodes=nodes, draft_tokens=deepest))
        else:  # larger batches pay for every verified node in every row: the two smallest trees
            for tree in trees[:2]:
                rows.append(plan_row("greedy", "tree", batch, len(tree), tree=tree,
                                     nodes=TreeShape(branching=tuple(tree)).num_nodes, speculative=True,
                                     draft_tree=tree))
        rows.append(plan_row("greedy", "auto", batch, depth, "auto", speculative="auto"))
    sampled_tree = trees[1] if len(trees) > 1 else trees[0]  # [3, 2, 1] at D = 3
    for batch in batch_sizes:
        rows.append(plan_row("sampling", "plain", batch, 0, "-", nodes=0, speculative=False, temperature=1.0))
        for k in range(1, depth + 1):
            rows.append(plan_row("sampling", "chain", batch, k, nodes=k, speculative=True, draft_tokens=k,
                                 temperature=1.0))
        if batch == 1:
            rows.append(plan_row("sampling", "tree", batch, len(sampled_tree), tree=sampled_tree,
                                 nodes=TreeShape(branching=tuple(sampled_tree)).num_nodes, speculative=True,
                                 draft_tree=sampled_tree, temperature=1.0))
            rows.append(plan_row("sampling", "dynamic_tree", batch, deepest, nodes=16, speculative=True,
                                 draft_tree_nodes=16, draft_tokens=deepest, temperature=1.0))
        rows.append(plan_row("sampling", "auto", batch, depth, "auto", speculative="auto", temperature=1.0))
    if compiled:  # torch.compile'd step forwards (GenerationConfig.compile): plain and speculative, batch 1
        rows.append(plan_row("greedy-compiled", "plain", 1, 0, "-", nodes=0, speculative=False, compile=True))
        rows.append(plan_row("greedy-compiled", "chain", 1, depth, nodes=depth, speculative=True, draft_tokens=depth,
                             compile=True))
    return rows


def label(row: dict) -> str:
    """The row's decoder in a few characters: ``plain``, ``k=3 fixed``, ``[4, 2, 1]``, ``dyn 16``, ``auto``."""
    if row["decoder"] == "tree":
        return str(row["tree"])
    if row["decoder"] == "dynamic_tree":
        return f"dyn {row['nodes']}"
    if row["decoder"] == "chain":
        return f"k={row['draft_tokens']} {row['policy']}"
    return row["decoder"]


def measure(model, prompts: list[torch.Tensor], plan: list[dict], max_new: int, repeats: int,
            choices: AutoChoices, warmup_tokens: int = 8) -> list[dict]:
    """Run every row of ``plan`` once as a warm-up (same prompts and batches; ``warmup_tokens`` new tokens, ``auto``
    rows the whole budget), then ``repeats`` timed repeats, the rows of one batch size interleaved batch by batch of
    prompts; returns one record per row (median time).

    Greedy ``auto`` keeps what it learned across calls (its step costs and acceptance), as a user's later calls
    would, so its whole-budget warm-up keeps that first exploration out of the timed repeats. Sampling ``auto`` with
    a seed (every row here passes a generator) decides from its prior cost model and the call's own acceptance
    (reproducible samples), so what it explores is timed."""
    for row in plan:
        if not row["kwargs"].get("compile"):  # compiled rows are warmed up (compiled) by main
            tokens = max_new if row["decoder"] == "auto" else min(warmup_tokens, max_new)
            run_mode(model, prompts, row["batch_size"], tokens, seed=0, **row["kwargs"])
    times = {i: [] for i in range(len(plan))}
    results = {}
    for repeat in range(repeats):  # interleaved batch by batch: a machine's drift reaches every row alike
        done: dict[int, list] = {i: [] for i in range(len(plan))}
        generators = {i: torch.Generator().manual_seed(repeat) for i in range(len(plan))}
        for batch_size in sorted({row["batch_size"] for row in plan}):
            group = [i for i, row in enumerate(plan) if row["batch_size"] == batch_size]
            for chunk in chunks(prompts, batch_size):
                for i in group:
                    row = plan[i]
                    key = f"{row['mode']} batch {row['batch_size']}"
                    counting = choices.counting(key) if row["decoder"] == "auto" else contextlib.nullcontext()
                    with counting:
                        done[i].append(run_chunk(model, chunk, max_new, generators[i], **row["kwargs"]))
        for i in range(len(plan)):
            outputs, stats = combined(done[i])
            times[i].append(stats["elapsed_s"])
            results.setdefault(i, (outputs, stats))
    records = []
    for i, row in enumerate(plan):
        outputs, stats = results[i]
        elapsed = statistics.median(times[i])
        record = {key: row[key] for key in ("mode", "decoder", "policy", "tree", "nodes", "batch_size",
                                            "draft_tokens")}
        accepted, drafted = stats["accepted_per_depth"], stats["drafted_per_depth"]
        record.update(
            tau=stats["tau"],
            acceptance_per_depth=stats["acceptance_per_depth"],
            # P(depth d accepted | depth d-1 accepted): exact for a fixed shape, approximate for auto (mixed depths)
            conditional_acceptance_per_depth=[a / (accepted[d - 1] if d else drafted[0]) if (
                accepted[d - 1] if d else drafted[0]) else 0.0 for d, a in enumerate(accepted)],
            accepted_length_histogram=stats["accepted_length_histogram"],
            tokens_per_s=stats["total_new_tokens"] / elapsed,
            new_tokens=stats["total_new_tokens"],
            main_forwards=stats["main_forwards"],
            seconds=elapsed,
            seconds_per_step=elapsed / max(1, stats["main_forwards"]),
            drafts_per_step=sum(drafted) / max(1, sum(stats["accepted_length_histogram"])),
            outputs=outputs,
        )
        if row["decoder"] == "auto":
            record["auto_choices"] = choices.histogram(f"{row['mode']} batch {row['batch_size']}")
        records.append(record)
    for row in records:
        plain = next(r for r in records if r["mode"] == row["mode"] and r["batch_size"] == row["batch_size"]
                     and r["decoder"] == "plain")
        row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"]
        row["plain_seconds_per_step"] = plain["seconds_per_step"]
        row["plain_main_forwards"] = plain["main_forwards"]
        row["lossless"] = None
        if row["mode"].startswith("greedy"):
            eager_plain = next(r for r in records if r["mode"] == "greedy" and r["batch_size"] == row["batch_size"]
                               and r["decoder"] == "plain")
            row["lossless"] = row["outputs"] == eager_plain["outputs"]
            row["speedup_over_eager_plain"] = row["tokens_per_s"] / eager_plain["tokens_per_s"]
    return records


# ----------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="trained CausalLM checkpoint (else train one first)")
    parser.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "decode_model.yaml",
                        help="LightningCLI fit config of the benchmark model")
    parser.add_argument("--train-seconds", type=float, default=1200.0, help="training budget without --ckpt")
    parser.add_argument("--train-arg", action="append", default=[],
                        help="extra LightningCLI training argument (repeatable): --train-arg=--trainer.max_steps=500")
    parser.add_argument("--resume", type=Path, help="continue training a checkpoint this script saved (same config)")
    parser.add_argument("--train-only", action="store_true", help="stop after training and saving the checkpoint")
    parser.add_argument("--save-ckpt", type=Path, default=ROOT / ".cache" / "lightning_mtp" / "benchmarks" /
                        "decode_model.ckpt", help="where the trained checkpoint goes (reuse it with --ckpt)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (batch 8 uses 8 of them)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median time is reported")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: batch-1 decoding of a small model gains little from more, "
                             "and an oversubscribed shared machine makes multi-threaded timings meaningless)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip the torch.compile rows (mode greedy-compiled)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.ckpt is None:
        model, datamodule, training = train(args.config, args.train_seconds, args.save_ckpt, args.train_arg,
                                            args.resume)
        ckpt = args.save_ckpt
        if args.train_only:
            return []
    else:
        model, datamodule = load(args.ckpt, args.config)
        ckpt, training = args.ckpt, None
    model = model.to("cpu", torch.float32).eval()
    depth = model.mtp_config.depth
    cascaded = model.mtp_config.architecture == "cascaded"
    prompts = held_out_prompts(datamodule, args.prompts, args.prompt_tokens)
    if len(prompts) < args.prompts:
        print(f"only {len(prompts)} held-out windows for prompts", flush=True)
    batch_sizes = [1, 8]
    plan = modes(depth, batch_sizes, args.compile, cascaded)
    trees = static_trees(depth, cascaded)
    # Generation must fit: shorten the budget on small-context models rather than fail.
    max_new = min(args.max_new_tokens, model.max_context - max(len(p) for p in prompts))
    print(f"{len(prompts)} prompts of {args.prompt_tokens} tokens, {max_new} new tokens, D={depth} "
          f"({model.mtp_config.architecture}), {torch.get_num_threads()} threads, {len(plan)} rows", flush=True)

    run_mode(model, prompts[:1], 1, 8, 0, speculative=False)  # warm-up
    compile_seconds = None
    if args.compile:  # compile every shape the compiled rows meet before timing them (reported separately)
        start = time.perf_counter()
        for row in plan:
            if row["kwargs"].get("compile"):
                run_mode(model, prompts, row["batch_size"], max_new, seed=0, **row["kwargs"])
        compile_seconds = time.perf_counter() - start
    choices = AutoChoices()
    rows = measure(model, prompts, plan, max_new, args.repeats, choices)

    costs = {batch: cost_breakdown(model, prompts[:batch], depth) for batch in batch_sizes}
    shapes = [TreeShape(branching=tuple(tree)) for tree in trees]
    tree_costs = {batch: tree_cost_breakdown(model, prompts[:batch], shapes) for batch in batch_sizes}
    weights = weight_bytes(model)
    fastest_trees = []  # inside decoding: the fastest static and dynamic tree of batch-1 greedy decoding
    for decoder in ("tree", "dynamic_tree"):
        top = max((r for r in rows if r["mode"] == "greedy" and r["batch_size"] == 1 and r["decoder"] == decoder),
                  key=lambda r: r["speedup"], default=None)
        if top is not None:
            fastest_trees.append(TreeShape(branching=tuple(top["tree"])) if decoder == "tree" else TreeShape(
                nodes=top["nodes"], top_k=GenerationConfig().draft_tree_top_k, max_depth=top["draft_tokens"]))
    situ = in_situ_breakdown(model, prompts, depth, max_new, tuple(fastest_trees))
    notes = explain(rows, costs, situ, depth, weights, tree_costs)
    for row in rows:
        row.pop("outputs")
    targets = check_targets(rows)

    best = {}
    for batch in batch_sizes:
        candidates = [r for r in rows if r["mode"] == "greedy" and r["batch_size"] == batch
                      and r["decoder"] != "plain"]
        top = max(candidates, key=lambda r: r["tokens_per_s"])
        best[f"batch {batch}"] = {k: top[k] for k in ("decoder", "policy", "tree", "nodes", "draft_tokens",
                                                      "speedup")}
    summary = {
        **provenance(__file__, argv),  # the command line and the machine
        "checkpoint": str(ckpt),
        "training": training,
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "max_new_tokens": max_new,
        "depth": depth,
        "architecture": model.mtp_config.architecture,
        "static_trees": trees,
        "costs_s": {f"batch_{batch}": cost for batch, cost in costs.items()},
        "tree_costs_s": {f"batch_{batch}": cost for batch, cost in tree_costs.items()},
        "weight_bytes": weights,
        "in_situ_costs_s": situ,
        "explanation": notes,
        "targets": targets,
        "best_per_decoder": best_per_decoder(rows),
        "fastest_greedy_policy": best,
        "auto_choices": {key: dict(counts.most_common()) for key, counts in choices.counts.items()},
        "auto_memory": auto_memory(model),
        "default_policy": GenerationConfig().to_kwargs(),
        "compile_seconds": compile_seconds,
    }
    (args.out / "decode.json").write_text(json.dumps(rows, indent=1))
    (args.out / "decode_summary.json").write_text(json.dumps(summary, indent=1))
    plot(rows, args.out / "decode.png", depth)

    print(f"{'mode':15} {'decoder':12} {'draft':16} {'B':>2} {'k':>2} {'nodes':>5} {'tau':>5} {'tok/s':>8} "
          f"{'speedup':>7}  accept/depth")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"])
        flag = "  NOT LOSSLESS" if r["lossless"] is False else ""
        nodes = "-" if r["nodes"] is None else r["nodes"]
        print(f"{r['mode']:15} {r['decoder']:12} {label(r):16} {r['batch_size']:>2} {r['draft_tokens']:>2} "
              f"{nodes:>5} {r['tau']:5.2f} {r['tokens_per_s']:8.1f} {r['speedup']:7.2f}  {acc}{flag}")
    for key, counts in summary["auto_choices"].items():
        print(f"auto, {key}: " + ", ".join(f"{option} x{n}" for option, n in counts.items()))
    for batch, cost in costs.items():
        print(f"\ncost of one step (batch {batch}, seconds):", json.dumps({k: round(v, 5) for k, v in cost.items()}))
    for line in notes:
        print(line)
    print()
    for name, result in targets.items():
        value = "n/a" if result["measured"] is None else f"{result['measured']:.2f}"
        print(f"{'MET   ' if result['met'] else 'MISSED'} {name}: worst {value} (target >= {result['target']})")
        for row in result["rows"]:
            versus = f" vs {row['best_fixed']}" if "best_fixed" in row else ""
            print(f"    {row['mode']:9} batch {row['batch_size']:>2}: {row['ratio']:.3f}{versus}")
    print(f"\nwrote {args.out / 'decode.json'}, {args.out / 'decode_summary.json'}, {args.out / 'decode.png'}")
    return rows


if __name__ == "__main__":
    main()
