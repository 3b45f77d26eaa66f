"""The decoding sections of ``docs/results.md``: ``decode.py`` (the benchmark and quickstart models),
``hf_compare.py``, ``hf_mtp_compare.py``, ``decode_ablation.py``, ``decode_replay.py``, ``auto_overhead.py`` and
``decode_roofline.py`` (see ``benchmarks/report.py``)."""

from __future__ import annotations

from typing import Callable, Optional

from report_format import (
    Source,
    code,
    command_from,
    command_text,
    machine_text,
    num,
    per_depth,
    plural,
    provenance_lines,
    result_link,
    table,
    times,
)

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
HF_COMPARE_ARGS = ("trunk_steps", "heads_steps", "depth", "prompts", "prompt_tokens", "max_new_tokens",
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


# ----------------------------------------------------------------------------------------------- decode_ablation.py
def runs_and_verdicts(source: Source, kept: str) -> list[str]:
    """An ablation's runs (machine, command), its data link and the table of verdicts (``kept``: the word for a
    mechanism whose removal cost at least 2% on some row)."""
    data = source.data
    out = [f"- **{run['label']}:** machine {machine_text(run.get('machine'))}; command "
           f"{command_text(run.get('command'))}" for run in data.get("runs", [])]
    out += [f"- **Data:** {result_link(source.name)}", ""]
    verdicts = data.get("verdicts", {})
    if verdicts:
        out += table(["mechanism", "most its removal cost on a row", "verdict"],
                     [[m, f"{100 * v:.1f}%", kept if v >= 0.02 else "below 2%"] for m, v in verdicts.items()])
    return out


def by_model_and_batch(rows: list[dict]) -> list[tuple[str, int, list[dict]]]:
    """An ablation's rows grouped by model (in their order) and batch size."""
    return [(label, batch, [r for r in rows if r["model"] == label and r["batch_size"] == batch])
            for label in dict.fromkeys(r["model"] for r in rows)
            for batch in sorted({r["batch_size"] for r in rows if r["model"] == label})]


def render_decode_ablation(source: Source) -> list[str]:
    data = source.data
    out = [
        "`speculative=\"auto\"` with each of its mechanisms turned off in turn (`lightning_mtp.decoding.auto."
        "SWITCHES`), against the whole policy, plain decoding and every fixed chain, greedy, on the same held-out "
        "prompts; each row learns in its own memory during an untimed warm-up call, then is timed in repeats "
        "(median), the rows interleaved batch by batch of prompts. **vs auto**: tokens/s over the whole policy's "
        "(below 1×: the mechanism paid); a mechanism stays only if turning it off costs at least 2% on some row.", "",
    ]
    out += runs_and_verdicts(source, "kept")
    for label, batch, rows in by_model_and_batch(data["rows"]):
        out += [f"**{label}, batch {batch}**", ""]
        out += table(["row", "tokens/s", "τ", "vs plain", "vs auto"],
                     [[r["row"], num(r["tokens_per_s"], 1), num(r["tau"]), f"{num(r['vs_plain'])}×",
                       f"{num(r['vs_auto'])}×"] for r in rows])
    return out


# ----------------------------------------------------------------------------------------------- decode_replay.py
def render_decode_replay(source: Source) -> list[str]:
    data = source.data
    out = [
        "`speculative=\"auto\"` and its mechanisms judged without timing noise (`benchmarks/decode_replay.py`): "
        "each option's step (plain, a chain of k drafts) is timed first, alone, in `auto`'s own loop (median per "
        "batch size); then every row decodes the held-out prompts for real while the policy is told the measured "
        "cost of each step it ran times a seeded log-normal noise, and the row's time is the sum of those costs "
        "(a draft's catching up its modules charged per position behind, where measured). "
        "Ratios are of modeled times: they compare decisions, not this machine's noise. **vs auto** below 1×: the "
        "mechanism paid.", "",
    ]
    out += runs_and_verdicts(source, "pays")
    for label, batch, rows in by_model_and_batch(data["rows"]):
        costs = data.get("step_costs", {}).get(label, {}).get(str(batch), {})
        catch_up = f"; catching up {costs['catch_up']:.4f} per position" if "catch_up" in costs else ""
        relative = costs.get("relative", {})
        out += [f"**{label}, batch {batch}** (step cost in plain steps: "
                + ", ".join(f"{'plain' if k == '0' else f'k={k}'} {num(v)}" for k, v in relative.items())
                + f"{catch_up})", ""]
        out += table(["row", "τ", "vs plain", "vs best fixed", "vs auto"],
                     [[r["row"], num(r["tau"]), f"{num(r['vs_plain'])}×", f"{num(r['vs_best_fixed'])}×",
                       f"{num(r['vs_auto'])}×"] for r in rows])
    return out


def run_lines(source: Source, describe: Callable[[dict], str]) -> list[str]:
    """A line per run of a JSON that holds several (``{"runs": {label: run}}``; ``describe``: what follows the
    label), then the link to the data."""
    return [*(f"- **{label}:** {describe(run)}" for label, run in source.data["runs"].items()),
            f"- **Data:** {result_link(source.name)}", ""]


# ----------------------------------------------------------------------------------------------- replay_draws.sh
def render_replay_draws(source: Source) -> list[str]:
    runs = source.data["runs"]
    out = [
        "`speculative=\"auto\"` replayed (`benchmarks/decode_replay.py --costs-from`) on three fixed sets of step "
        "costs: **a** and **b** measured on a 2-core CPU, **c** GPU-like (a drafting step 1.05 + 0.12·k plain "
        "steps), on three models at batch 1 and 8. Each cell: `auto` over plain decoding / over the best fixed "
        "chain, on modeled times (deterministic: the same on a busy machine); `*` below the targets (0.97× plain, "
        "0.95× the best fixed chain).", "",
        *run_lines(source, lambda run: f"command {command_text(run.get('command'))}, code "
                                       f"{run.get('commit') or 'unrecorded'}"),
    ]
    keys = [(r["draw"], r["model"], r["batch_size"]) for r in next(iter(runs.values()))["rows"]]
    cells = {label: {(r["draw"], r["model"], r["batch_size"]): r for r in run["rows"]} for label, run in runs.items()}

    def cell(row: Optional[dict]) -> str:
        if row is None:
            return "–"
        return f"{num(row['vs_plain'])}× / {num(row['vs_best_fixed'])}×{'' if row['met'] else ' *'}"

    out += table(["draw", "model", "batch", *runs], [[draw, model, str(batch), *(cell(cells[label].get(
        (draw, model, batch))) for label in runs)] for draw, model, batch in keys])
    return out


# ----------------------------------------------------------------------------------------------- auto_overhead.py
AUTO_OVERHEAD = (
    "What `speculative=\"auto\"`'s own work costs a call (`benchmarks/auto_overhead.py`), against the fixed chain it "
    "would choose, call by call interleaved: **bare** is its loop with a policy that always answers that chain and "
    "learns nothing; **policy** its policy rating, learning and measuring as usual but drafting that chain; **auto** "
    "as it is. Each cell: the median over calls of the call's time over the fixed chain's (1.03×: 3% slower). "
    "**Policy**: its Python per step (`next` and `observe_step`), of a whole step.")


def render_auto_overhead(source: Source) -> list[str]:
    rows = [[label, r["model"], str(r["batch_size"]), f"k={r['chain']}", *(f"{num(r[key], 3)}×" for key in (
        "bare", "policy", "auto")), f"{r['policy_us_per_step']:.0f} µs of {num(r['step_ms'])} ms"]
            for label, run in source.data["runs"].items() for r in run["rows"]]
    return [AUTO_OVERHEAD, "", *run_lines(source, lambda run: f"code {run.get('code', 'unrecorded')}, "
                                                             f"{machine_text(run.get('machine'))}"),
            *table(["code", "model", "batch", "fixed chain", "bare", "policy", "auto", "policy per step"], rows)]


# ----------------------------------------------------------------------------------------------- decode_roofline.py
def render_decode_roofline(source: Source) -> list[str]:
    data = source.data
    assumed = data["assumptions"]
    out = [
        "Predicted, not measured: step times of plain and speculative decoding on GPUs from an analytic model of "
        "FLOPs and bytes (the larger of bytes over bandwidth and FLOPs over throughput, plus kernel launches), "
        "expected tokens per step from per-depth acceptance, and what `auto`'s step-cost model and policy would "
        "choose given those step times (`benchmarks/decode_roofline.py` states every assumption). "
        "`scripts/gpu_check.sh` measures the same rows where a GPU is lent (the last table, where the JSON has "
        "them).", "",
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
    return out + roofline_measured(data.get("measured"))


def roofline_measured(measured: Optional[dict]) -> list[str]:
    """The rows ``decode_roofline.py --measure`` timed on a device, beside their prediction."""
    if not measured:
        return []
    by_difference = all("one_token_call_ms" in r for r in measured["rows"])
    how = (f"each step timed by difference (a call of {measured['measure_tokens']} + 1 new tokens less a call of "
           f"one, over the main-model forwards between them; median of {measured['repeats']} interleaved rounds), "
           f"at {measured['context']} tokens of context" if by_difference else
           "each step timed as a whole call over its main-model forwards, the prefill included")
    return [
        f"**Measured on {measured['device']}**, {measured['model']} with random bf16 weights: {how}; beside the "
        f"prediction for {measured['predicted_for']}. **1-token call**: the call that the difference takes off "
        "(the prefill and the call's set-up).", "",
        *table(["batch", "option", "step (ms)", "predicted (ms)", "in plain steps", "predicted in plain steps",
                "1-token call (ms)"],
               [[str(r["batch_size"]), r["option"], num(r["step_ms"], 2), num(r.get("predicted_step_ms"), 3),
                 num(r["step_in_plain_steps"]), num(r["predicted_step_in_plain_steps"]),
                 num(r.get("one_token_call_ms"), 1)] for r in measured["rows"]]),
    ]
