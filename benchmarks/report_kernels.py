"""The sections of ``docs/results.md`` measured on kernels and on a lent GPU: the Triton kernels against their torch
twins (``benchmarks/triton_kernels.py``) and the GPU check (``scripts/gpu_check.sh``'s ``summary.json``, kept as
``benchmarks/results/gpu_check.json``), which runs the same kernel benchmarks compiled on the GPU."""

from __future__ import annotations

from typing import Any

from report_format import (
    Source,
    code,
    documented_commands,
    machine_text,
    machines_text,
    num,
    plural,
    provenance_lines,
    result_link,
    table,
    times,
)


# ----------------------------------------------------------------------------------------------- triton_kernels.py
def shape_text(shape: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in shape.items())


def kernel_tables(rows: list[dict]) -> list[str]:
    """The kernel-against-twin table and the gradient-gate table of ``triton_kernels.py`` rows."""
    versus = [r for r in rows if "time_vs_torch_twin" in r]
    gate = [r for r in rows if "over_forward_only_time" in r]
    other = [r for r in rows if r not in versus and r not in gate]
    lines = []
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


def render_kernels(source: Source) -> list[str]:
    rows = source.data
    lines = [
        "The Triton kernels against their plain-torch twins on the same inputs: the fused linear + cross-entropy of "
        "all depths, speculative verification of chains (`verify_drafts`) and of draft trees (`verify_tree`). Times "
        "in ms and peak memory in MiB (lower is better); **vs torch twin**: the row's time or memory over the twin's. "
        "The gradient-gate rows time the cross-entropy under `no_grad` / `inference_mode` / with grad, **over "
        "forward-only**: against the forward alone (about 1.00 for the no-grad rows: they compute no gradients). "
        "Rows on `cpu (triton interpreter)` are a smoke test: Triton's interpreter times say nothing about GPU "
        "speed, the torch twin's CPU times do; the GPU check's section below has the same benchmarks compiled on a "
        "GPU.", "",
    ]
    devices = ", ".join(sorted({r.get("device", "?") for r in rows}))
    machine = machines_text({code(r["command"]) if r.get("command") else "rows without a recorded command":
                             r.get("machine") for r in rows}, {"device": devices})
    commands = [f"{code(c)} (recorded in the JSON)" for c in sorted({r["command"] for r in rows if r.get("command")})]
    if any(not r.get("command") for r in rows):
        commands.append(("rows without a recorded command: " if commands else "not recorded in the JSON; ")
                        + "the script documents " + "; ".join(map(code, documented_commands("triton_kernels.py"))))
    lines += provenance_lines(source, machine, "; ".join(commands))
    return lines + kernel_tables(rows)


# ----------------------------------------------------------------------------------------------- gpu_check.sh
def step_summary(step: str, result: Any) -> str:
    """One line of what a GPU-check step found."""
    if not isinstance(result, (dict, list)):
        return "–"
    if step == "env":
        return f"{result.get('device')}, torch {result.get('torch')} (CUDA {result.get('cuda')}), " \
               f"triton {result.get('triton')}, lightning {result.get('lightning')}, " \
               f"deepspeed {result.get('deepspeed')}, transformers {result.get('transformers')}"
    if step == "install":
        return ", ".join(f"{k} {v}" for k, v in result.items())
    if step == "kernel_tests":
        return (f"{result['passed']} passed, {len(result['failed'])} failed, {len(result['skipped'])} skipped "
                f"(the interpreter-only cases); GPU tests not run: {len(result['gpu_tests_not_run'])}")
    if step in ("ce_bench", "verify_bench"):
        return f"{len(result)} rows (tables below)"
    if step == "compile_decode":
        return (f"{len(result['rows'])} rows; every greedy output equals eager plain decoding: "
                f"{'yes' if result['ok'] else 'NO'}")
    if step in ("zero3_fit", "fsdp2_fit"):
        losses = result["train/loss"]
        devices = f" on {result['devices']} GPU(s)" if "devices" in result else ""
        decoded = f"; the consolidated checkpoint decoded {result['decoded_tokens']} tokens" \
            if "decoded_tokens" in result else ""
        return (f"{result['steps']} steps{devices}, loss {' → '.join(num(x, 3) for x in losses)}, "
                f"finite: {'yes' if result['finite'] else 'NO'}{decoded}")
    if step == "decode_bench":
        training = result["summary"].get("training", {})
        return (f"trained {training.get('train_steps')} steps in {num(training.get('train_seconds'), 0)} s on the GPU, "
                f"then {len(result['rows'])} decoding rows timed on the CPU (a smoke run: 2 prompts, 8 tokens)")
    if step == "roofline_check":
        rows = result["rows"]
        method = "steps timed by difference" if rows and "one_token_call_ms" in rows[0] else \
            "whole calls over main-model forwards, the prefill counted in each step (the method before timing by " \
            "difference; not comparable with the prediction)"
        return f"{plural(len(rows), 'row')}: {method}"
    return "–"


def render_gpu_check(source: Source) -> list[str]:
    data = source.data
    steps = data["steps"]
    env = (steps.get("env") or {}).get("result") or {}
    machine = machine_text({k: env.get(k) for k in ("platform", "python", "torch", "cuda")}, {"gpu": env.get("device")})
    lines = [
        "`scripts/gpu_check.sh` (every step time-boxed; [kernels.md](kernels.md) says what each does) on a GPU lent "
        "to one session: its `summary.json`, kept as it came back. Kernel rows are compiled, not interpreted.", "",
        f"- **Machine:** {machine}",
        f"- **Command:** {code('bash scripts/gpu_check.sh')}; overall: "
        f"{'ok' if data['ok'] else 'FAILED: ' + ', '.join(data['failed'])} in {data['seconds']} s",
        f"- **Data:** {result_link(source.name)}", "",
    ]
    lines += table(["step", "status", "seconds", "limit (s)", "found"],
                   [[step, record["status"], num(record["seconds"], 1), str(record["time_limit_s"]),
                     step_summary(step, record.get("result"))] for step, record in steps.items()])
    kernel_rows = [row for step in ("ce_bench", "verify_bench") if isinstance((steps.get(step) or {}).get("result"),
                                                                              list) for row in steps[step]["result"]]
    lines += kernel_tables(kernel_rows)
    compiled = ((steps.get("compile_decode") or {}).get("result") or {}).get("rows", [])
    if compiled:
        lines += ["### Decoding on the GPU, eager and compiled", "",
                  *table(["decoder", "compile", "first call (s)", "timed call (s)", "tokens/s", "τ",
                          "same as eager plain"],
                         [[r["decoder"], str(r["compile"]), num(r["first_call_s"], 2), num(r["seconds"], 4),
                           num(r["tokens_per_s"], 0), num(r["tau"]), "yes" if r["same_as_eager_plain"] else "NO"]
                          for r in compiled])]
    return lines
