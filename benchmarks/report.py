"""Write ``docs/results.md`` from the benchmarks' JSON under ``benchmarks/results/``.

Every JSON file there is rendered: the files in :data:`REGISTRY` by their own renderer (one small function per
benchmark, plain Markdown tables), any other JSON by a short generic section that lists its top-level keys, so that a
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
import ast
import difflib
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
COMMAND = "python benchmarks/report.py"
DEV_MACHINE = "the project's 2-core CPU development machine"
"""What is known of the machine behind a JSON that does not record its own."""


# ----------------------------------------------------------------------------------------------- what runs record
def provenance(script: str, argv: Optional[Sequence[str]] = None, device: str = "cpu") -> dict[str, Any]:
    """The command line and the machine of a benchmark run, for its JSON: ``{"command": ..., "machine": {...}}``.

    ``script``: the benchmark's ``__file__``; ``argv``: the arguments its ``main`` parsed (default ``sys.argv[1:]``);
    ``device``: where the measured work ran. Call it after the script has set its torch threads."""
    import torch

    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "device": device}
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name()
    return {"command": shlex.join(["python", f"benchmarks/{Path(script).name}", *args]), "machine": machine}


# ----------------------------------------------------------------------------------------------- formatting
def num(value: Any, digits: int = 2, suffix: str = "") -> str:
    """``value`` with ``digits`` decimals (``–`` for None, yes/no for booleans)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    text = f"{value:.{digits}f}"
    if text.lstrip("-").strip("0.") == "":
        text = text.lstrip("-")
    return text + suffix


def plural(count: Any, noun: str) -> str:
    """``1 torch thread``, ``2 torch threads``."""
    return f"{count} {noun}" + ("" if str(count) == "1" else "s")


def times(value: Any, digits: int = 2) -> str:
    """A ratio: ``1.23×``."""
    return num(value, digits, "×")


def code(text: Any) -> str:
    return f"`{text}`"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table (pipes inside cells escaped)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows), ""]


def per_depth(values: Optional[Sequence[Any]], digits: int = 2) -> str:
    """Per-depth values: ``0.81 / 0.66 / 0.55``."""
    return " / ".join(num(v, digits) for v in values) if values else "–"


def command_from(script: str, arguments: dict[str, Any], skip: Sequence[str] = ("out",)) -> str:
    """The command line that gives ``arguments`` (argparse dests, in recorded order) to ``benchmarks/<script>``."""
    parts = ["python", f"benchmarks/{script}"]
    for key, value in arguments.items():
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def documented_commands(script: str) -> list[str]:
    """The ``python benchmarks/...`` lines of a script's docstring (continuations joined, comments dropped)."""
    doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / script).read_text(encoding="utf-8"))) or ""
    commands, current = [], ""
    for raw in doc.splitlines():
        line = " ".join(raw.split("  #")[0].split())
        if current:
            current += " " + line.rstrip("\\").strip()
        elif line.startswith("python benchmarks/"):
            current = line.rstrip("\\").strip()
        if current and not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


MACHINE_FIELDS: dict[str, Callable[[Any], str]] = {
    "platform": str,
    "processor": lambda v: f"processor {v}",
    "cpus": lambda v: f"{v} CPUs",
    "python": lambda v: f"Python {v}",
    "torch": lambda v: f"torch {v}",
    "transformers": lambda v: f"transformers {v}",
    "torch_threads": lambda v: plural(v, "torch thread"),
    "threads": lambda v: plural(v, "torch thread"),
    "threads_per_run": lambda v: plural(v, "torch thread") + " per run",
    "runs_at_once": lambda v: f"{v} runs at once",
    "device": lambda v: f"device {v}",
    "gpu": lambda v: f"GPU {v}",
}


def machine_text(machine: Any, recorded: Optional[dict[str, Any]] = None) -> str:
    """The machine a JSON records, or what is known when it records none; ``recorded``: other recorded facts
    about it (``{"torch_threads": 2}``), shown either way."""
    facts = dict(machine) if isinstance(machine, dict) else {}
    for key, value in (recorded or {}).items():
        facts.setdefault(key, value)
    words = [MACHINE_FIELDS.get(k, lambda v, k=k: f"{k} {v}")(v) for k, v in facts.items() if v is not None]
    if isinstance(machine, dict):
        return "; ".join(words)
    if isinstance(machine, str):
        words.insert(0, f"processor {machine}")
        return f"only partly recorded in the JSON ({'; '.join(words)}); {DEV_MACHINE}"
    known = f"; recorded: {', '.join(words)}" if words else ""
    return f"not recorded in the JSON ({DEV_MACHINE}){known}"


def machines_text(machines: dict[str, Any], recorded: Optional[dict[str, Any]] = None) -> str:
    """The machine of several runs (label → machine), or each run's where they differ."""
    if len({json.dumps(m, sort_keys=True) for m in machines.values()}) <= 1:
        return machine_text(next(iter(machines.values()), None), recorded)
    return "differs between runs: " + "; ".join(f"{label}: {machine_text(machine, recorded)}"
                                                 for label, machine in sorted(machines.items()))


def command_text(command: Optional[str], reconstructed: Optional[str] = None, note: str = "") -> str:
    """The command as the JSON records it, or rebuilt from the arguments it records."""
    if command:
        return f"{code(command)} (recorded in the JSON)"
    if reconstructed:
        return (f"{code(reconstructed)} (rebuilt from the arguments the JSON records; it does not record the command "
                f"line{note})")
    return "not recorded in the JSON"


def result_link(name: str) -> str:
    """A link from ``docs/`` to ``benchmarks/results/<name>``."""
    return f"[{code('benchmarks/results/' + name)}](../benchmarks/results/{name})"


def provenance_lines(source: Source, machine: str, command: str) -> list[str]:
    lines = [f"- **Machine:** {machine}", f"- **Command:** {command}", f"- **Data:** {result_link(source.name)}"]
    if source.image:
        lines.append(f"- **Plot:** {result_link(source.image)}")
    return lines + [""]


# ----------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Source:
    """One result file as a renderer sees it: ``name`` relative to ``benchmarks/results``, its parsed JSON, the
    parsed companion files beside it (by file name) and the PNG of the same name, if any."""

    name: str
    data: Any
    companions: dict[str, Any] = field(default_factory=dict)
    image: Optional[str] = None


@dataclass(frozen=True)
class Entry:
    """A known result file: its section title, renderer and the files beside it the renderer also reads."""

    title: str
    render: Callable[[Source], list[str]]
    companions: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------- decode.py
DECODERS = ("plain", "chain", "tree", "dynamic_tree", "auto")
DECODE_MODES = ("greedy", "sampling", "greedy-compiled")


def draft_label(row: dict) -> str:
    """A decode row's draft in words: ``chain k = 3``, ``tree [3, 2, 1] (15 nodes)``, ``dynamic 16 nodes``."""
    decoder = row["decoder"]
    if decoder == "chain":
        policy = "" if row["policy"] == "fixed" else f", {row['policy']}"
        return f"chain k = {row['draft_tokens']}{policy}"
    if decoder == "tree":
        return f"tree {row['tree']} ({row['nodes']} nodes)"
    if decoder == "dynamic_tree":
        return f"dynamic tree, {row['nodes']} nodes, depth {row['draft_tokens']}"
    if decoder == "auto":
        return "`auto`"
    return "plain"


def mode_label(mode: str) -> str:
    return {"sampling": "sampling T = 1", "greedy-compiled": "greedy, `compile=True`"}.get(mode, mode)


def decode_groups(rows: list[dict]) -> list[tuple[str, int, list[dict]]]:
    """Rows per (mode, batch size), modes in :data:`DECODE_MODES` order, then batch size."""
    keys = sorted({(r["mode"], r["batch_size"]) for r in rows},
                  key=lambda k: (DECODE_MODES.index(k[0]) if k[0] in DECODE_MODES else len(DECODE_MODES), k))
    return [(mode, batch, [r for r in rows if (r["mode"], r["batch_size"]) == (mode, batch)]) for mode, batch in keys]


def speedup_cell(row: dict) -> str:
    text = times(row["speedup"])
    if row["mode"] == "greedy-compiled" and row.get("speedup_over_eager_plain") is not None:
        text += f" ({times(row['speedup_over_eager_plain'])} over eager plain)"
    return text


def decode_headline(rows: list[dict]) -> list[str]:
    """Per mode and batch: plain tokens/s, the fastest speculative row, and ``auto``."""
    out = []
    for mode, batch, group in decode_groups(rows):
        plain = next((r for r in group if r["decoder"] == "plain"), None)
        drafted = [r for r in group if r["decoder"] != "plain"]
        best = max(drafted, key=lambda r: r["speedup"], default=None)
        auto = next((r for r in group if r["decoder"] == "auto"), None)
        out.append([mode_label(mode), str(batch), num(plain and plain["tokens_per_s"], 1),
                    "–" if best is None else draft_label(best), "–" if best is None else f"**{speedup_cell(best)}**",
                    num(best and best["tau"]), "–" if auto is None else times(auto["speedup"]),
                    num(auto and auto["tau"])])
    return table(["mode", "batch", "plain tokens/s", "fastest speculative row", "its speedup", "its τ",
                  "`auto` speedup", "`auto` τ"], out)


def decode_best_per_decoder(rows: list[dict]) -> list[str]:
    out = []
    for mode, batch, group in decode_groups(rows):
        for decoder in sorted({r["decoder"] for r in group}, key=lambda d: (DECODERS + (d,)).index(d)):
            best = max((r for r in group if r["decoder"] == decoder), key=lambda r: r["speedup"])
            out.append([mode_label(mode), str(batch), draft_label(best), num(best["tau"]),
                        num(best["tokens_per_s"], 1), speedup_cell(best), num(best["lossless"])])
    return table(["mode", "batch", "fastest of its decoder", "τ", "tokens/s", "speedup", "equals plain"], out)


def decode_all_rows(rows: list[dict]) -> list[str]:
    out = [[mode_label(r["mode"]), str(r["batch_size"]), draft_label(r), num(r["tau"]), num(r["tokens_per_s"], 1),
            speedup_cell(r), per_depth(r["acceptance_per_depth"]), num(r["lossless"])]
           for _, _, group in decode_groups(rows) for r in group]
    return table(["mode", "batch", "draft", "τ", "tokens/s", "speedup", "acceptance per depth", "equals plain"], out)


def decode_targets(targets: dict) -> list[str]:
    """Each target at its worst (mode, batch size), then every group's ratio so a reader sees the spread."""
    out = []
    for name in sorted(targets):
        t = targets[name]
        verdict = "met" if t["met"] else "missed"
        groups = "; ".join(f"{mode_label(r['mode'])} batch {r['batch_size']}: {num(r['ratio'])}"
                           + (f" (vs {r['best_fixed']})" if "best_fixed" in r else "") for r in t.get("rows", []))
        out.append([name, f"≥ {num(t['target'])}", num(t["measured"]), verdict, groups or "–"])
    return table(["target", "threshold", "worst", "result", "per mode and batch"], out)


def decode_auto_choices(rows: list[dict]) -> list[str]:
    out = []
    for mode, batch, group in decode_groups(rows):
        for row in (r for r in group if r.get("auto_choices")):
            counts = sorted(row["auto_choices"].items(), key=lambda kv: (-kv[1], kv[0]))
            out.append([mode_label(mode), str(batch), ", ".join(f"{code(k)} {v}" for k, v in counts)])
    return table(["mode", "batch", "steps per option"], out) if out else []


def decode_step_costs(summary: dict) -> list[str]:
    """Inside decoding at batch 1: a step's main forward, drafting and the rest, in plain steps."""
    situ = summary.get("in_situ_costs_s") or {}
    plain = (situ.get("plain") or {}).get("step_s")
    if not plain:
        return []
    kinds = {"plain": "plain", "auto_plain_step": "a plain step of `auto`",
             "speculative": f"chain k = {summary.get('depth')}"}
    entries = [(kinds[k], situ[k]) for k in kinds if k in situ]
    entries += [(code(name), cost) for name, cost in sorted((situ.get("trees") or {}).items())]
    out = [[label, num(c["step_s"] / plain), num(c["forward_s"] / plain), num(c["draft_s"] / plain),
            num(c["rest_s"] / plain)] for label, c in entries]
    return table(["step (batch 1)", "whole step", "main forward", "drafting", "the rest"], out)


def decode_verify_costs(summary: dict) -> list[str]:
    """Isolated: a verify forward over N tokens per row, in plain steps, per batch size."""
    costs = summary.get("tree_costs_s") or {}
    sizes = sorted({int(n) for c in costs.values() for n in c["in_plain_steps"]["verify_tokens"]})
    if not sizes:
        return []
    out = [[key.replace("batch_", ""), *(num(c["in_plain_steps"]["verify_tokens"].get(str(n))) for n in sizes)]
           for key, c in sorted(costs.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    return table(["batch", *(plural(n, "token") for n in sizes)], out)


def decode_command(summary: dict) -> str:
    arguments = {"ckpt": summary.get("checkpoint"), "threads": summary.get("threads"),
                 "prompts": summary.get("prompts"), "max_new_tokens": summary.get("max_new_tokens"),
                 "no_compile": summary.get("compile_seconds") is None}
    return command_text(summary.get("command"), command_from("decode.py", arguments),
                        note=", nor --repeats and --prompt-tokens")


def render_decode(source: Source) -> list[str]:
    rows, summary = source.data, source.companions.get("decode_summary.json", {})
    lines = [
        "Plain decoding against self-speculative decoding of the same checkpoint, on the same held-out prompts, "
        "timed side by side in one run. **speedup** is tokens/s over plain decoding of the same mode and batch size "
        "(above 1× is faster). **τ** is tokens emitted per main-model forward, the bonus token counted (plain: 1.00; "
        "higher means more drafted tokens accepted per verify). **equals plain**: the greedy output is identical to "
        "plain decoding token for token (sampling rows: –).", "",
        f"- **Model:** {code(summary.get('checkpoint', '?'))}, D = {summary.get('depth')} "
        f"{summary.get('architecture')} MTP depths; {summary.get('prompts')} prompts, "
        f"{summary.get('max_new_tokens')} new tokens each",
        *provenance_lines(source, machine_text(summary.get("machine"), {"torch_threads": summary.get("threads")}),
                          decode_command(summary)),
        "### Headline", "", *decode_headline(rows),
    ]
    if source.image:
        lines += [f"![decode speedup and tau](../benchmarks/results/{source.image})", ""]
    lines += ["### Fastest row per decoder", "", *decode_best_per_decoder(rows)]
    if summary.get("targets"):
        lines += ["### Targets", "", *decode_targets(summary["targets"])]
    choices = decode_auto_choices(rows)
    if choices:
        lines += ["### What `auto` chose", "", "Decoding steps per option over the timed repeats.", "", *choices]
    steps = decode_step_costs(summary)
    if steps:
        lines += ["### Where a step's time goes", "",
                  "Measured inside decoding at batch 1, per step, in plain decoding steps (lower is cheaper; a "
                  "speculative step pays off when τ exceeds its whole-step cost).", "", *steps]
    verify = decode_verify_costs(summary)
    if verify:
        lines += ["A verify forward over N tokens per row, timed in isolation, in plain steps of the same batch:", "",
                  *verify]
    lines += ["### Every row", "", *decode_all_rows(rows)]
    if summary.get("explanation"):
        lines += ["<details><summary>The benchmark's own explanation of each figure "
                  "(<code>decode_summary.json</code>)</summary>", "", "```text", *summary["explanation"], "```", "",
                  "</details>", ""]
    return lines


# ----------------------------------------------------------------------------------------------- hf_compare.py
HF_COMPARE_ARGS = ("trunk_seconds", "heads_seconds", "depth", "prompts", "prompt_tokens", "max_new_tokens",
                   "prompt_lookup", "repeats", "max_bytes", "threads", "model_dir")


def hf_decoder_label(name: str, setup: dict) -> str:
    return {
        "transformers_greedy": "`transformers` greedy `generate`",
        "transformers_prompt_lookup": f"`transformers` prompt lookup "
                                      f"(`prompt_lookup_num_tokens={setup.get('prompt_lookup')}`)",
        "lightning_mtp_plain": "lightning-mtp plain, same HF cache",
        "lightning_mtp_speculative": f"lightning-mtp chain of {setup.get('depth')} (`speculative=True`)",
        "lightning_mtp_auto": 'lightning-mtp `speculative="auto"`',
    }.get(name, code(name))


def paired_cell(row: dict) -> str:
    paired = row.get("paired_speedups_per_repeat")
    if not paired:
        return "–"
    return f"{times(row['paired_speedup_vs_lightning_mtp_plain'])} ({num(min(paired))}-{num(max(paired))})"


def render_hf_compare(source: Source) -> list[str]:
    data = source.data
    setup, model = data["setup"], data["setup"].get("model", {})
    rows = [[hf_decoder_label(r["decoder"], setup), num(r["tokens_per_s"], 1),
             times(r["speedup_vs_transformers_greedy"]), times(r.get("speedup_vs_lightning_mtp_plain")),
             paired_cell(r), num(r.get("tau")), num(r["equals_transformers_greedy"])] for r in data["rows"]]
    lines = [
        "A tiny `transformers` Llama, trained on next-token loss, then retrofitted with MTP heads on its frozen trunk, "
        "decoded greedily at batch 1 by `transformers`' own `generate` and by lightning-mtp over the same HF KV "
        "cache. **vs HF greedy**: tokens/s over `transformers` greedy `generate`; **vs our plain**: over lightning-mtp "
        "plain decoding on the same cache (above 1× is faster); **paired**: that ratio within each repeat, median "
        "(range) over repeats, which cancels the machine's drift between repeats. τ counts the bonus token.", "",
        f"- **Model:** Llama, hidden {model.get('hidden_size')}, {model.get('num_hidden_layers')} layers, vocabulary "
        f"{model.get('vocab_size')} (bytes); trunk trained {data['trunk_training']['steps']} steps "
        f"({num(data['trunk_training']['seconds'], 0)} s), {setup.get('depth')} heads "
        f"{data['heads_training']['steps']} steps ({num(data['heads_training']['seconds'], 0)} s)",
        f"- **Decoding:** {setup.get('prompts')} prompts of {setup.get('prompt_tokens')} tokens, "
        f"{setup.get('max_new_tokens')} new tokens each, batch {setup.get('batch_size', 1)}, median of "
        f"{setup.get('repeats')} interleaved repeats",
        *provenance_lines(source, machine_text(data.get("machine"), {"torch_threads": setup.get("torch_threads")}),
                          command_text(data.get("command"), command_from(
                              "hf_compare.py", {k: setup.get(k) for k in HF_COMPARE_ARGS}))),
        *table(["decoder", "tokens/s", "vs HF greedy", "vs our plain", "paired vs our plain", "τ",
                "equals HF greedy"], rows),
    ]
    if data.get("targets"):
        out = [[name, f"≥ {num(t['target'])}", times(t["measured"]), "met" if t["met"] else "missed"]
               for name, t in sorted(data["targets"].items())]
        lines += ["Targets:", "", *table(["target", "threshold", "measured", "result"], out)]
    auto = next((r for r in data["rows"] if r.get("auto_choices")), None)
    if auto:
        counts = sorted(auto["auto_choices"].items(), key=lambda kv: (-kv[1], kv[0]))
        lines += ["`auto` chose (steps per option; retired calls decode plainly): "
                  + ", ".join(f"{code(k)} {v}" for k, v in counts) + ".", ""]
    return lines


# ----------------------------------------------------------------------------------------------- hf_mtp_compare.py
def render_hf_mtp_compare(source: Source) -> list[str]:
    data = source.data
    setup = data["setup"]
    training = setup.get("training") or {}
    rows = [[r["system"], r["mode"], str(r["batch_size"]), num(r["tokens_per_s"], 1),
             times(r["speedup_vs_transformers_plain"]), times(r.get("speedup_vs_own_plain")), num(r["tau"]),
             per_depth(r.get("acceptance_per_depth")), num(r["equals_transformers_plain"])] for r in data["rows"]]
    model = setup.get("model", {})
    phases = {"joint_training": "trunk and MTP layers jointly", "heads_training": "MTP layers alone"}
    trained = ", ".join(f"{phases.get(name, name)} {part['steps']} steps ({num(part['seconds'], 0)} s)"
                        for name, part in training.items() if isinstance(part, dict) and "steps" in part)
    lines = [
        "A model with native MTP layers (DeepSeek-V3 / GLM-4.5 layout) decoded greedily by `transformers`' "
        "`generate` (plain and `use_mtp=True`) and by lightning-mtp (plain, a chain of D drafts, `auto`) on the same "
        "prompts. **vs `transformers` plain**: tokens/s over `transformers` plain greedy at batch 1 (at larger "
        "batches a throughput ratio); **vs own plain**: over lightning-mtp plain decoding at the same batch size "
        "(above 1× is faster). τ counts the bonus token; acceptance per depth is accepted / drafted at that depth.",
        "",
        f"- **Model:** {code(setup.get('model_type'))}, hidden {model.get('hidden_size')}, "
        f"{model.get('num_hidden_layers')} layers, {setup.get('parameters'):,} parameters of which "
        f"{setup.get('mtp_parameters'):,} in {setup.get('depth')} MTP layers; tokenizer: {setup.get('tokenizer')}"
        + (f"; trained: {trained}" if trained else ""),
        f"- **Decoding:** {len(setup.get('prompt_lengths', []))} prompts ({setup.get('prompts_from')}), "
        f"{setup.get('max_new_tokens')} new tokens each; {setup.get('timing')}",
        *provenance_lines(source, machine_text(data.get("machine"), {**setup.get("versions", {}),
                                                                      "torch_threads": setup.get("torch_threads")}),
                          command_text(data.get("command"), command_from("hf_mtp_compare.py",
                                                                         setup.get("arguments", {})))),
        *table(["system", "mode", "batch", "tokens/s", "vs `transformers` plain", "vs own plain", "τ",
                "acceptance per depth", "equals `transformers` plain"], rows),
    ]
    if data.get("notes"):
        lines += ["Notes recorded with the results:", "", *(f"- {note}" for note in data["notes"]), ""]
    return lines


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


# ----------------------------------------------------------------------------------------------- decode_ablation.py
def render_decode_ablation(source: Source) -> list[str]:
    data = source.data
    out = [
        "`speculative=\"auto\"` with each of its mechanisms turned off in turn (`lightning_mtp.decoding.auto."
        "SWITCHES`), against the whole policy, plain decoding and every fixed chain, greedy, on the same held-out "
        "prompts; each row learns in its own memory during an untimed warm-up call, then is timed in interleaved "
        "repeats (median). **vs auto**: tokens/s over the whole policy's (below 1×: the mechanism paid); a "
        "mechanism stays only if turning it off costs at least 2% on some row.", "",
    ]
    for run in data.get("runs", []):
        out.append(f"- **{run['label']}:** machine {machine_text(run.get('machine'))}; command "
                   f"{command_text(run.get('command'))}")
    out.append(f"- **Data:** {result_link(source.name)}")
    out.append("")
    verdicts = data.get("verdicts", {})
    if verdicts:
        out += table(["mechanism", "most its removal cost on a row", "verdict"],
                     [[m, f"{100 * v:.1f}%", "kept" if v >= 0.02 else "below 2%"] for m, v in verdicts.items()])
    for label in dict.fromkeys(r["model"] for r in data["rows"]):
        for batch in sorted({r["batch_size"] for r in data["rows"] if r["model"] == label}):
            rows = [r for r in data["rows"] if r["model"] == label and r["batch_size"] == batch]
            out.append(f"**{label}, batch {batch}**")
            out.append("")
            out += table(["row", "tokens/s", "τ", "vs plain", "vs auto"],
                         [[r["row"], num(r["tokens_per_s"], 1), num(r["tau"]), f"{num(r['vs_plain'])}×",
                           f"{num(r['vs_auto'])}×"] for r in rows])
    return out


# ----------------------------------------------------------------------------------------------- decode_roofline.py
def render_decode_roofline(source: Source) -> list[str]:
    data = source.data
    assumed = data["assumptions"]
    out = [
        "Predicted, not measured: step times of plain and speculative decoding on GPUs from an analytic model of "
        "FLOPs and bytes (the larger of bytes over bandwidth and FLOPs over throughput, plus kernel launches), "
        "expected tokens per step from per-depth acceptance, and what `auto`'s step-cost model and policy would "
        "choose given those step times (`benchmarks/decode_roofline.py` states every assumption). "
        "`scripts/gpu_check.sh` measures the same rows where a GPU is lent.", "",
        f"- **Assumptions:** bf16 weights and cache; {num(100 * assumed['mbu'], 0)}% of peak bandwidth, "
        f"{num(100 * assumed['mfu'], 0)}% of peak FLOPs; {num(assumed['launch_us'], 1)} µs per kernel launch, "
        f"{assumed['launches_per_block']} per block; {assumed['context']} tokens of context per row; a second "
        f"candidate accepted in {num(100 * data['second_candidate'], 0)}% of the remaining cases",
        *(f"- **Acceptance, {name}:** {' / '.join(num(a, 2) for a in acc['per_depth'])} ({acc['source']})"
          for name, acc in data["acceptance"].items()),
        f"- **Command:** {command_text(data.get('command'))}",
        f"- **Data:** {result_link(source.name)}", "",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        groups.setdefault((row["model"], row["hardware"], row["batch_size"]), []).append(row)
    rows = []
    for (model, hardware, batch), group in groups.items():
        plain = next(r for r in group if r["option"] == "plain")
        best = max(group, key=lambda r: r["speedup"])
        chosen = next((r for r in group if r.get("auto_would_choose")), plain)
        depth = max(int(r["option"][5:]) for r in group if r["option"].startswith("chain")) - 1
        chain = next(r for r in group if r["option"] == f"chain{depth}")
        rows.append([model, hardware, str(batch), num(plain["step_ms"], 3), f"{num(chain['speedup'])}×",
                     f"{best['option']} {num(best['speedup'])}×", f"{chosen['option']} {num(chosen['speedup'])}×"])
    out += table(["model", "GPU", "batch", "plain step (ms)", "chain of D", "best option", "auto would choose"],
                 rows)
    return out


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


# ----------------------------------------------------------------------------------------------- triton_kernels.py
def shape_text(shape: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in shape.items())


def render_kernels(source: Source) -> list[str]:
    rows = source.data
    versus = [r for r in rows if "time_vs_torch_twin" in r]
    gate = [r for r in rows if "over_forward_only_time" in r]
    other = [r for r in rows if r not in versus and r not in gate]
    lines = [
        "The Triton kernels against their plain-torch twins on the same inputs: the fused linear + cross-entropy of "
        "all depths, speculative verification of chains (`verify_drafts`) and of draft trees (`verify_tree`). Times "
        "in ms and peak memory in MiB (lower is better); **vs torch twin**: the row's time or memory over the twin's. "
        "The gradient-gate rows time the cross-entropy under `no_grad` / `inference_mode` / with grad, **over "
        "forward-only**: against the forward alone (about 1.00 for the no-grad rows: they compute no gradients). "
        "Rows on `cpu (triton interpreter)` are a smoke test: Triton's interpreter times say nothing about GPU "
        "speed, the torch twin's CPU times do.", "",
    ]
    devices = ", ".join(sorted({r.get("device", "?") for r in rows}))
    machine = machines_text({code(r["command"]) if r.get("command") else "rows without a recorded command":
                             r.get("machine") for r in rows}, {"device": devices})
    commands = [f"{code(c)} (recorded in the JSON)" for c in sorted({r["command"] for r in rows if r.get("command")})]
    if any(not r.get("command") for r in rows):
        commands.append(("rows without a recorded command: " if commands else "not recorded in the JSON; ")
                        + "the script documents " + "; ".join(map(code, documented_commands("triton_kernels.py"))))
    command = "; ".join(commands)
    lines += provenance_lines(source, machine, command)
    if versus:
        out = [[r["op"], r["pass"], r["backend"], shape_text(r["shape"]), num(r["time_ms"], 3),
                num(r["peak_mem_mib"]), times(r["time_vs_torch_twin"], 3), times(r["mem_vs_torch_twin"], 3)]
               for r in versus]
        lines += ["### Kernel against twin", "", *table(["op", "pass", "backend", "shape", "time ms", "peak MiB",
                                                          "time vs torch twin", "memory vs torch twin"], out)]
    if gate:
        out = [[r["backend"], r["pass"], shape_text({k: v for k, v in r["shape"].items()
                                                     if k not in ("weight", "hidden_requires_grad")}),
                num(r["time_ms"], 3), num(r["peak_mem_mib"]), times(r["over_forward_only_time"], 3),
                times(r["over_forward_only_mem"], 3)] for r in gate]
        lines += ["### Gradient gate of the fused cross-entropy (head weight a Parameter)", "",
                  *table(["backend", "pass", "shape", "time ms", "peak MiB", "time over forward-only",
                          "memory over forward-only"], out)]
    if other:
        lines += [f"{len(other)} further rows not tabulated (keys: "
                  f"{', '.join(sorted({k for r in other for k in r}))}).", ""]
    return lines


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
    "decode_roofline.json": Entry("Speculative decoding on GPUs, predicted", render_decode_roofline),
    "kernels.json": Entry("Kernels against their torch twins", render_kernels),
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
