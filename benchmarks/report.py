"""Write ``docs/results.md`` from the benchmarks' JSON under ``benchmarks/results/``.

Every JSON file there is rendered: the files in :data:`REGISTRY` by their own renderer (one small function per
benchmark, plain Markdown tables; the decoding ones in ``report_decoding.py``, the shared formatting in
``report_format.py``), any other JSON by a short generic section that lists its top-level keys, so that a
new benchmark shows up on the page instead of being dropped. A PNG named like a JSON file is linked in that file's
section; other figures go to the last section. The output depends on the JSON alone (sorted, fixed float formats, no
timestamps), so ``--check`` can compare it with the committed page.

Each benchmark records how it ran: :func:`provenance` (the command line and the machine) is what the scripts in
``benchmarks/`` write into their JSON, and what the renderers here read back. Where a JSON predates that, the page
says what the JSON does record (the arguments, from which the command is rebuilt; the torch threads).

Usage::

    python benchmarks/report.py            # rewrite docs/results.md
    python benchmarks/report.py --check    # exit 1 and print a unified diff when docs/results.md is stale
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_decoding import (  # noqa: E402
    render_auto_overhead,
    render_decode,
    render_decode_ablation,
    render_decode_replay,
    render_decode_roofline,
    render_hf_compare,
    render_hf_mtp_compare,
    render_replay_draws,
)
from report_format import (  # noqa: E402,F401  (provenance: what the benchmark scripts import from here)
    DEV_MACHINE,
    ROOT,
    Entry,
    Source,
    code,
    command_from,
    command_text,
    documented_commands,
    machine_text,
    machines_text,
    num,
    provenance,
    provenance_lines,
    result_link,
    table,
    times,
)
from report_kernels import render_gpu_check, render_kernels  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
COMMAND = "python benchmarks/report.py"


# ----------------------------------------------------------------------------------------------- train_overhead.py
def render_train_overhead(source: Source) -> list[str]:
    data = source.data
    settings, base, target = data["settings"], data["baseline"], data["target"]
    rows = sorted(data["rows"], key=lambda r: (r["architecture"], r["recompute"], r["depth"]))
    out = [[r["architecture"], str(r["depth"]), "on" if r["recompute"] else "off", num(r["peak_memory_ratio"], 3),
            num(r["step_time_ratio"], 3), num(r["analytic_flops_ratio"], 3),
            num(r["time_per_analytic_flop_ratio"], 3)] for r in rows]
    worst = target["worst_row"]
    arguments = {k: v for k, v in settings.items() if k != "attention_model"}
    return [
        "One training step (forward, backward, AdamW) of the bundled `CausalLM` with D MTP depths, against the same "
        "model trained on next-token loss alone, timed alternately in one run. Every figure is a ratio over that "
        "baseline (lower is better). **Peak memory**: peak tensor memory allocated during the step (parameters and "
        "optimizer state excluded). **Time / analytic FLOPs**: the step-time ratio over the FLOPs ratio the "
        "architecture predicts; 1.00 means the extra time is exactly the extra arithmetic.", "",
        f"- **Model:** vocabulary {settings['vocab']}, dim {settings['dim']}, {settings['layers']} layers, "
        f"{settings['heads']} heads; batch {settings['batch_size']} × {settings['seq_len']} tokens; fastest of "
        f"{settings['repeats']} steps",
        f"- **Baseline (next-token only):** peak {num(base['peak_mb'], 1)} MiB, "
        f"{num(base['analytic_flops'] / 1e9, 1)} GFLOP per step, {base['params']:,} parameters",
        f"- **Target:** every row's time / analytic FLOPs ≤ {num(target['limit'])}: "
        f"**{'met' if target['met'] else 'missed'}** (largest {num(target['time_per_analytic_flop_ratio_max'], 3)}, "
        f"{worst['architecture']} D = {worst['depth']}, recompute {'on' if worst['recompute'] else 'off'})",
        *provenance_lines(source, machine_text(data.get("machine"), {"torch_threads": settings.get("threads")}),
                          command_text(data.get("command"), command_from("train_overhead.py", arguments))),
        *table(["architecture", "D", "recompute", "peak memory ratio", "step time ratio", "analytic FLOPs ratio",
                "time / analytic FLOPs"], out),
    ]


def render_train_overhead_fsdp2(source: Source) -> list[str]:
    data = source.data
    settings, base, target = data["settings"], data["baseline"], data["target"]
    out = [[r["architecture"], str(r["depth"]), "on" if r["recompute"] else "off",
            " / ".join(num(mb, 1) for mb in r["peak_mb_per_rank"]), num(r["peak_memory_ratio"], 3),
            num(r["one_process_peak_memory_ratio"], 3)] for r in data["rows"]]
    arguments = {k: v for k, v in settings.items() if k != "processes"}
    return [
        "One training step of the bundled `CausalLM` under FSDP2 on 2 CPU processes (gloo, one thread each; "
        "`lightning_mtp.fsdp.fully_shard_mtp`: the trunk's blocks, every MTP module and the root are units), against "
        "the same model trained on next-token loss alone under FSDP2. **Peak memory per rank**: the peak tensor "
        "memory a rank allocates during the step, gathered weights included, its shards and optimizer state held "
        "between steps excluded; the ratio takes each configuration's larger rank. The last column is the same "
        "ratio on one process, measured in the same run.", "",
        f"- **Model:** vocabulary {settings['vocab']}, dim {settings['dim']}, {settings['layers']} layers, "
        f"{settings['heads']} heads; batch {settings['batch_size']} × {settings['seq_len']} tokens per process",
        f"- **Baseline (next-token only):** peak {' / '.join(num(mb, 1) for mb in base['peak_mb_per_rank'])} MiB "
        f"per rank ({num(base['one_process_peak_mb'], 1)} MiB on one process)",
        f"- **Goal:** with recompute, peak per rank ≤ {num(target['limit'])} × next-token training's: "
        f"**{'met' if target['met'] else 'missed'}** (largest {num(target['peak_memory_ratio_max'], 3)}, "
        f"{target['worst_row']})",
        *provenance_lines(source, machine_text(data.get("machine")),
                          command_text(data.get("command"), command_from("train_overhead.py",
                                                                         {**arguments, "fsdp2": True}))),
        *table(["architecture", "D", "recompute", "peak per rank (MiB)", "peak memory ratio",
                "one process"], out),
    ]


# ----------------------------------------------------------------------------------------------- validation_overhead.py
VALIDATION_ARGS = ("tokenizer", "vocab_size", "seq_len", "batch_size", "val_batches", "active_depth", "max_bytes",
                   "repeats", "threads", "cache_dir")


def validation_command(label: str, run: dict) -> str:
    settings = run["settings"]
    arguments = {k: settings.get(k) for k in VALIDATION_ARGS}
    return run.get("command") or command_from("validation_overhead.py", {**arguments, "label": label})


def render_validation_overhead(source: Source) -> list[str]:
    runs = source.data["runs"]
    out = []
    for label in sorted(runs):
        run, v = runs[label], runs[label]["variants"]
        out.append([code(label), f"{run['settings']['tokenizer']} ({run['settings']['vocab']})",
                    num(run["shares_forward"]), times(v["shared"]["cpu_ratio_to_none"]),
                    times(v["rerun"]["cpu_ratio_to_none"]), times(v["shared"]["ratio_to_none"]),
                    times(v["rerun"]["ratio_to_none"]),
                    " / ".join(num(v[k]["trunk_forwards_per_batch"], 1) for k in ("shared", "rerun"))])
    threads = sorted({r["settings"].get("threads") for r in runs.values()})
    machine = machines_text({code(label): run.get("machine") for label, run in runs.items()},
                            {"torch_threads": ", ".join(map(str, threads))})
    first = runs[sorted(runs)[0]]["settings"]
    commands = [f"- {code(label)}: {code(validation_command(label, runs[label]))}" for label in sorted(runs)]
    how = ("recorded in the JSON" if all(r.get("command") for r in runs.values()) else
           "rebuilt from the arguments each run records, with its label; the JSON does not record the command lines")
    return [
        "`Trainer.validate` with every callback of `configs/mtp.yaml` against validation without callbacks, timed "
        "alternately in one run; each figure is the fastest epoch with callbacks ÷ without (1.00× = free, lower is "
        "better). **shared**: the monitoring callbacks read the forward the validation loss computed; **rerun**: "
        "each re-runs the trunk and every depth. CPU time is the steadier figure on a shared machine. A run whose code "
        "does not share the forward (`shares forward`: no) measured both variants re-running it.", "",
        f"- **Model:** as in `configs/mtp.yaml` ({first['model'].get('dim')} wide, {first['model'].get('n_layers')} "
        f"layers, D = {first['mtp'].get('depth')} {first['mtp'].get('architecture')}); "
        f"{first.get('val_batches')} batches of {first.get('batch_size')} × {first.get('seq_len')} tokens",
        f"- **Machine:** {machine}",
        f"- **Commands** ({how}):",
        *(f"  {c}" for c in commands),
        f"- **Data:** {result_link(source.name)}", "",
        *table(["run", "tokenizer (vocabulary)", "shares forward", "CPU time, shared", "CPU time, rerun",
                "wall time, shared", "wall time, rerun", "trunk forwards per batch, shared / rerun"], out),
    ]


# ----------------------------------------------------------------------------------------------- quality.py
def mean_std(stat: Optional[dict], digits: int = 3, signed: bool = False) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    mean = f"{stat['mean']:+.{digits}f}" if signed else num(stat["mean"], digits)
    return mean if stat.get("std") is None else f"{mean} ± {num(stat['std'], digits)}"


def delta_cell(stat: Optional[dict]) -> str:
    if not stat:
        return "–"
    text = mean_std(stat, signed=True)
    return f"**{text}**" if stat.get("beyond_seed_noise") else f"{text} (within noise)"


def render_quality(source: Source) -> list[str]:
    data = source.data
    config, summary = data["config"], data.get("summary", {})
    third = (data.get("data") or {}).get("thirdparty") or {}
    out = [[code(name), mean_std(s["val_loss_stdlib"]), delta_cell(s.get("delta_val_loss_stdlib")),
            mean_std(s["val_loss_thirdparty"]), delta_cell(s.get("delta_val_loss_thirdparty")),
            mean_std(s["tau"], 2)] for name, s in summary.items()]
    runs = [[code(r["objective"]), str(r["seed"]), num(r["val_loss_stdlib"], 4), num(r["val_loss_thirdparty"], 4),
             num(r["tau"]), num(r["train_seconds"], 0)]
            for r in sorted(data["rows"], key=lambda r: (config["objectives"].index(r["objective"]), r["seed"]))]
    return [
        "The bundled `CausalLM` trained at equal steps and tokens with next-token loss only and with MTP objectives, "
        "several seeds each, scored by the main head's next-token cross-entropy (nats per token, lower is better) on "
        f"held-out standard-library files and on the sources of `{third.get('package')}` {third.get('version')} "
        "(never trained on). **Δ**: each seed's difference to `next_token` with the same seed, mean ± std over seeds "
        "(negative: MTP helped the main model); bold where it exceeds the seed noise and every seed moves the same "
        "way. **τ**: teacher-forced tokens per main-model forward with D drafts, bonus token counted.", "",
        f"- **Objectives:** `next_token` (no MTP loss); `mtp_d1` (D = 1, λ = 0.1); `mtp_d3` (D = 3, λ = 0.3, depth "
        f"warmup and weight schedule); `*_distill`: the same plus self-distillation (weight "
        f"{config.get('distill_weight')})",
        f"- **Model and training:** width {config['dim']}, {config['layers']} layers, {config['heads']} heads, "
        f"{config['tokenizer']} {config['vocab']}; {config['steps']} steps of {config['batch_size']} × "
        f"{config['seq_len']} tokens, lr {config['lr']}; seeds {', '.join(map(str, config['seeds']))}",
        *provenance_lines(source, machine_text(data.get("machine")), command_text(data.get("command"))),
        *table(["objective", "val loss, stdlib", "Δ vs next-token", f"val loss, {third.get('package')} (unseen)",
                "Δ vs next-token", "τ"], out),
        "<details><summary>Every run</summary>", "",
        *table(["objective", "seed", "val loss, stdlib", "val loss, unseen", "τ", "train s"], runs),
        "</details>", "",
    ]


# ----------------------------------------------------------------------------------------------- distill_acceptance.py
def render_distill_acceptance(source: Source) -> list[str]:
    data = source.data
    config = data["config"]
    depth = config["depth"]
    runs = [("without self-distillation", data["before"]), ("with self-distillation", data["after"])]

    def cells(metrics: dict, name: str) -> str:
        return " / ".join(num(metrics.get(name.format(k=k)), 3) for k in range(1, depth + 1))

    out = [[f"{label} (weight {num(run['distill_weight'], 1)})", cells(run["metrics"], "val/mtp/accept_depth{k}"),
            cells(run["metrics"], "val/mtp/accept_chained_depth{k}"),
            num(run["metrics"].get(f"val/mtp/tau_walk_draft{depth}"), 3), num(run["metrics"].get("val/main/loss"), 3),
            cells(run["metrics"], "val/mtp/loss_depth{k}")] for label, run in runs]
    ks = " / ".join(str(k) for k in range(1, depth + 1))
    return [
        "The same short training run of the bundled `CausalLM` without and with the self-distillation term "
        "(`MTPConfig.distill_weight`), same seed, initial weights and batch order; then `MTPCouplingMonitor`'s "
        "teacher-forced acceptance on held-out data. **accept depth k**: share of positions where depth k's argmax "
        "equals the main model's (higher means drafts are accepted more often); **chained**: depths 1..k all "
        f"matched; **τ walk**: tokens per main-model forward with {depth} drafts. The losses (lower is better) show "
        "what the distillation costs.", "",
        f"- **Model and training:** dim {config['dim']}, {config['layers']} layers, {config['heads']} heads, D = "
        f"{depth}, BPE {config['vocab']}; {config['steps']} steps of {config['batch_size']} × {config['seq_len']} "
        f"tokens; {config['val_batches']} validation batches",
        *provenance_lines(source, machine_text(data.get("machine")), command_text(data.get("command"))),
        *table(["run", f"accept depth {ks}", f"chained {ks}", f"τ walk, {depth} drafts", "val main loss",
                f"val MTP loss, depth {ks}"], out),
    ]


# ----------------------------------------------------------------------------------------------- finetune_acceptance.py
FINETUNES = {
    "base": "base model, before fine-tuning (trained on plain text)",
    "mtp_frozen": "fine-tuned, MTP layers frozen",
    "joint": "fine-tuned, trunk and MTP layers together (λ 0.1)",
    "frozen_then_heads": "MTP frozen, then the MTP layers re-trained on the fine-tuned trunk",
}


def render_finetune_acceptance(source: Source) -> list[str]:
    data = source.data
    settings = data["settings"]
    rows = [[FINETUNES.get(name, name), num(row["held_out_main_loss"], 3), num(row["accept_depth1"], 3),
             num(row["tau"]), f"{num(row['speedup'])}×", num(row["equals_plain"]), str(row["training"]["steps"])]
            for name, row in data["rows"].items()]
    return [
        "A glm4_moe with native MTP layers (the DeepSeek-V3 / GLM-4.5 layout) trained on plain text, then fine-tuned "
        "on chat data (the standard library's documented functions: the user gives a signature and docstring, the "
        "assistant answers with the source) three ways, assistant tokens only. **held-out main loss**: next-token "
        "cross-entropy on held-out chats (lower is better); **accept depth 1**: the share of depth-1 drafts accepted "
        "when decoding held-out prompts greedily; **τ**: tokens per main-model forward, the bonus token counted; "
        "**speedup**: speculative (a chain of D drafts) over plain decoding of the same model, one prompt at a time "
        "(above 1× is faster); **equals plain**: identical greedy output.", "",
        f"- **Model and data:** D = {settings['depth']} native MTP layers, BPE {settings['vocab']}; base "
        f"{settings['base_steps']} steps of {settings['batch']} × {settings['base_seq_len']} tokens on "
        f"{settings['base_files']} standard-library files; {data['chats']} "
        f"training chats, {settings['sft_steps']} fine-tuning steps (heads re-trained {settings['heads_steps']} "
        f"steps), {settings['batch']} × {settings['seq_len']} tokens a step; {data['prompts']} held-out prompts, "
        f"{settings['max_new_tokens']} new tokens each",
        *provenance_lines(source, machine_text(data.get("machine")), command_text(data.get("command"))),
        *table(["model", "held-out main loss", "accept depth 1", "τ", "speedup", "equals plain", "steps"], rows),
    ]


# ----------------------------------------------------------------------------------------------- thin_linear.py
def render_thin_linear(source: Source) -> list[str]:
    data = source.data
    out = [[str(r["rows"]), num(r["f_linear_ms"]), num(r["thin_ms"]), num(r["auto_ms"]), times(r["thin_speedup"]),
            num(r["auto_vs_best"])] for r in sorted(data["rows"], key=lambda r: r["rows"])]
    arguments = {"threads": data.get("threads"), "dim": data.get("dim"), "layers": data.get("layers"),
                 "vocab": data.get("vocab"), "rows": [r["rows"] for r in data["rows"]]}
    return [
        "The matrix products of one decoding step (every weight of the model, at M rows: batch × tokens per row), "
        "computed three ways side by side: `F.linear` (`x @ W.T`), the thin path `(W @ x.T).T`, and "
        "`lightning_mtp.layers.Linear`, which picks one of the two per shape from a one-time measurement. Times in "
        "ms per step (lower is better). **thin speedup**: `F.linear` ÷ thin (above 1×: the thin path is faster); "
        "**Linear ÷ best**: `Linear`'s time over the faster fixed path (1.00: it picked the best).", "",
        f"- **Model:** the decode benchmark's shapes: dim {data.get('dim')}, {data.get('layers')} layers, vocabulary "
        f"{data.get('vocab')}",
        *provenance_lines(source, machine_text(data.get("machine"), {"torch_threads": data.get("threads")}),
                          command_text(data.get("command"), command_from("thin_linear.py", arguments),
                                       note=", nor --repeats")),
        *table(["rows M", "`F.linear` ms", "`(W @ x.T).T` ms", "`Linear` ms", "thin speedup", "`Linear` ÷ best"],
               out),
    ]


# ----------------------------------------------------------------------------------------------- anything else
def render_generic(source: Source) -> list[str]:
    """A JSON file without a renderer: its top-level structure, so a new benchmark is noticed."""
    data = source.data

    def kind(value: Any) -> str:
        if isinstance(value, dict):
            return f"object of {len(value)} keys"
        if isinstance(value, list):
            return f"list of {len(value)}"
        return type(value).__name__

    lines = [f"No renderer in `benchmarks/report.py` knows this file yet (add one to its `REGISTRY`); its top-level "
             f"structure ({kind(data)}):", ""]
    if isinstance(data, dict):
        lines += [f"- {code(k)}: {kind(v)}" for k, v in sorted(data.items())]
    elif isinstance(data, list) and data and isinstance(data[0], dict):
        lines += [f"- keys of its first item: {', '.join(code(k) for k in sorted(data[0]))}"]
    return lines + ["", f"- **Data:** {result_link(source.name)}", ""]


REGISTRY: dict[str, Entry] = {
    "decode.json": Entry("Self-speculative decoding: the benchmark model", render_decode, ("decode_summary.json",)),
    "quickstart_model/decode.json": Entry("Self-speculative decoding: the quickstart checkpoint", render_decode,
                                          ("decode_summary.json",)),
    "hf_compare.json": Entry("Hugging Face host: transformers generate against lightning-mtp", render_hf_compare),
    "hf_mtp_compare.json": Entry("Native MTP layers: transformers use_mtp against lightning-mtp",
                                 render_hf_mtp_compare),
    "thin_linear.json": Entry("Small matrix products on CPU", render_thin_linear),
    "train_overhead.json": Entry("Training overhead: memory and time", render_train_overhead),
    "train_overhead_fsdp2.json": Entry("Training overhead under FSDP2: peak memory per rank",
                                       render_train_overhead_fsdp2),
    "validation_overhead.json": Entry("Validation cost of the monitoring callbacks", render_validation_overhead),
    "quality.json": Entry("Does MTP improve the main model?", render_quality),
    "distill_acceptance.json": Entry("Self-distillation and acceptance", render_distill_acceptance),
    "finetune_acceptance.json": Entry("Fine-tuning on chat data: does acceptance survive?",
                                      render_finetune_acceptance),
    "decode_ablation.json": Entry("What each mechanism of auto is worth", render_decode_ablation),
    "decode_replay.json": Entry("What each mechanism of auto is worth, without timing noise", render_decode_replay),
    "replay_draws.json": Entry("auto on fixed step costs", render_replay_draws),
    "auto_overhead.json": Entry("What auto's own work costs a call", render_auto_overhead),
    "decode_roofline.json": Entry("Speculative decoding on GPUs, predicted", render_decode_roofline),
    "kernels.json": Entry("Kernels against their torch twins", render_kernels),
    "gpu_check.json": Entry("The GPU check on a lent GPU", render_gpu_check),
}
"""Result file (relative to ``benchmarks/results``) → its section; sections appear in this order."""

FIGURES = {
    "docs/mtp_curves.png": (
        "Per-depth loss, acceptance and τ over a training run with every callback of `configs/mtp.yaml` (shrunk to "
        "1.5 minutes on 2 CPU cores: depth 1 alone, depth 2 joining at step 500), from TensorBoard logs",
        "python benchmarks/plot_tensorboard.py outputs/curves --out docs/mtp_curves.png"),
}
"""Figures outside ``benchmarks/results`` (path from the repository root → caption, the command that draws it)."""


# ----------------------------------------------------------------------------------------------- the page
def slug(title: str) -> str:
    """GitHub's anchor of a heading."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def load_sources(results: Path) -> tuple[list[tuple[str, Entry, Source]], list[Source], list[str]]:
    """(known sections in registry order, unknown JSON files sorted, images no section links)."""
    names = sorted(p.relative_to(results).as_posix() for p in results.rglob("*.json"))
    images = sorted(p.relative_to(results).as_posix() for p in results.rglob("*.png"))
    used: set[str] = set()

    def read(name: str) -> Any:
        used.add(name)
        return json.loads((results / name).read_text(encoding="utf-8"))

    def image_of(name: str) -> Optional[str]:
        png = name[: -len(".json")] + ".png"
        if png in images:
            used.add(png)
            return png
        return None

    known = []
    for name, entry in REGISTRY.items():
        if name not in names:
            continue
        folder = name.rpartition("/")[0]
        companions = {c: read(f"{folder}/{c}" if folder else c) for c in entry.companions
                      if (f"{folder}/{c}" if folder else c) in names}
        known.append((name, entry, Source(name, read(name), companions, image_of(name))))
    unknown = [Source(name, read(name), image=image_of(name)) for name in names if name not in used]
    return known, unknown, [png for png in images if png not in used]


def figures_section(images: list[str], root: Path) -> list[str]:
    lines = []
    for path, (caption, command) in FIGURES.items():
        if (root / path).exists():
            lines += [f"{caption}; drawn by {code(command)}.", "", f"![{Path(path).stem}](../{path})", ""]
    for png in images:
        lines += [f"{result_link(png)} (no JSON of the same name).", ""]
    return lines


def render_page(results: Path = RESULTS, root: Path = ROOT) -> str:
    """The whole of ``docs/results.md`` for the result files under ``results``."""
    known, unknown, images = load_sources(results)
    sections: list[tuple[str, list[str]]] = []
    for name, entry, source in known:
        try:
            sections.append((entry.title, entry.render(source)))
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise RuntimeError(f"benchmarks/results/{name}: its renderer failed ({error!r})") from error
    sections += [(f"Not rendered: {source.name}", render_generic(source)) for source in unknown]
    figures = figures_section(images, root)
    if figures:
        sections.append(("Other figures", figures))
    lines = [
        f"<!-- Generated by `{COMMAND}` from benchmarks/results/*.json. Do not edit by hand. -->",
        "",
        "# Measured results",
        "",
        f"This page is generated: `{COMMAND}` rewrites it from the JSON files under `benchmarks/results/`, which the "
        "scripts in `benchmarks/` write. Do not edit it by hand; rerun the benchmark, then the command. "
        f"`{COMMAND} --check` (run by `tests/test_results_page.py`) fails when the page and the JSON disagree.",
        "",
        "Each section says what is measured, on which machine, with which command, then the numbers. Ratios are "
        "within one run of one benchmark: compare rows of the same table, not across tables or machines.",
        "",
        *(f"- [{title}](#{slug(title)})" for title, _ in sections),
        "",
    ]
    for title, body in sections:
        lines += [f"## {title}", "", *body]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a unified diff when the page differs from what it would be")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page (default: %(default)s)")
    args = parser.parse_args(argv)
    page = render_page(args.results)
    current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    if args.check:
        if current == page:
            return 0
        diff = difflib.unified_diff(current.splitlines(keepends=True), page.splitlines(keepends=True),
                                    f"{args.out} (committed)", f"{args.out} (from the JSON)")
        sys.stdout.writelines(diff)
        print(f"\n{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1
    if current != page:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        print(f"{args.out} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
