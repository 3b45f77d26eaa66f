#!/usr/bin/env bash
# The GPU check, in one command (at most 9 minutes on one GPU). Steps, each time-boxed; a failing step is recorded
# and the next one runs:
#
#   env             torch / CUDA / device / package versions
#   install         liger-kernel and cut-cross-entropy with pip where missing (--no-deps: torch and triton stay as
#                   they are); optional: its failure does not fail the check
#   kernel_tests    tests/test_kernels_*.py and tests/test_tree_verify_kernel.py compiled, without Triton's interpreter
#                   (the `gpu` tests included; a GPU test skipped for want of CUDA fails the step)
#   ce_bench        the fused linear cross-entropy: time and peak memory of the Triton kernel, its torch twin,
#                   Liger-Kernel and Cut Cross-Entropy (when installed), and the no-grad gate (benchmarks/triton_kernels.py)
#   verify_bench    the speculative-verification kernels against their twins: chain (verify_drafts) and draft tree
#                   (verify_tree), with "triton == torch" per pass (benchmarks/triton_kernels.py)
#   compile_decode  compile=True decoding on CUDA: plain, speculative and adaptive, each eager and compiled; the
#                   greedy outputs must all equal eager plain decoding
#   zero3_fit       two fit steps of configs/deepspeed_zero3.yaml under the stock deepspeed_stage_3 strategy on one GPU
#                   (bf16-mixed); the losses must be finite
#   fsdp2_fit       three fit steps of configs/quickstart.yaml layered with configs/fsdp.yaml (FSDP2, nccl) with
#                   recompute, bf16 parameters and fp32 reductions, on two GPUs when the machine has two, else one;
#                   the losses must be finite and the consolidated checkpoint must load and decode in one process
#   decode_bench    benchmarks/decode.py, short: trains 20 s on the GPU, then times decoding (on CPU: the benchmark
#                   moves the model there)
#   roofline_check  benchmarks/decode_roofline.py --measure: step times of plain decoding and chains of 1..D of the
#                   benchmark model's shape (random bf16 weights) at batch 1, 8 and 64 on the GPU (by difference: the
#                   prefill excluded), beside the
#                   analytic model's prediction for that GPU (both in plain steps)
#
# Everything is JSON, under the output folder (default outputs/gpu_check/):
#
#   <step>.json     status (passed, failed, timed_out, skipped), exit code, seconds, time limit, command, log, and the
#                   step's own results (benchmark rows, test counts, losses, outputs equal or not) under "result"
#   <step>.log      its output;  <step>/  its files
#   summary.json    every step's status, seconds and result, and "ok": every required step passed
#
# Without a GPU it prints one line saying it skipped and why, and exits 0 (tests/test_gpu_check.py runs it so in CI).
#
# Usage:
#   bash scripts/gpu_check.sh                                  # all steps, into outputs/gpu_check/
#   bash scripts/gpu_check.sh --out DIR --steps kernel_tests,ce_bench
#   PYTHON=/path/to/python bash scripts/gpu_check.sh           # default: .venv/bin/python, else python3
#
# Options: --out DIR; --steps a,b,c (names above); --budget SECONDS for all steps together (default 535; each step
# has its own limit too, LIMIT_S below); --force runs the steps without a GPU too (to debug this script: they fail or
# crawl on CPU). Exit status: 0 when every required step passed or there is no GPU, 1 otherwise.
set -uo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
SCRIPT="scripts/gpu_check.sh"

STEPS=(env install kernel_tests ce_bench verify_bench compile_decode zero3_fit fsdp2_fit decode_bench roofline_check)
OPTIONAL_STEPS=" install "
# Each step's own time limit (535 s in all: the default --budget). A step may also use what earlier steps left unused,
# as long as every later step keeps its own limit.
declare -A LIMIT_S=([env]=15 [install]=20 [kernel_tests]=90 [ce_bench]=75 [verify_bench]=30 [compile_decode]=80
                    [zero3_fit]=60 [fsdp2_fit]=60 [decode_bench]=75 [roofline_check]=30)

if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET LIGHTNING_MTP_KERNELS  # compiled kernels, backend chosen by device

# ---------------------------------------------------------------------------------------------------------- steps
# Each runs as `bash scripts/gpu_check.sh __step NAME DIR` under `timeout` (which ends its whole process group),
# in the repository root, and writes its results to DIR/result.json.

step_env() {
  "$PY" - "$1/result.json" <<'PY'
import importlib.metadata as metadata
import json
import platform
import sys

import torch

info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count()}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                capability=f"{props.major}.{props.minor}")
for package in ("triton", "lightning", "deepspeed", "transformers", "liger-kernel", "cut-cross-entropy"):
    try:
        info[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
        info[package] = None
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
sys.exit(0 if info["cuda_available"] else 1)
PY
}

step_install() {
  local dir=$1 package module failed=0
  for package in liger-kernel:liger_kernel cut-cross-entropy:cut_cross_entropy; do
    module=${package#*:} package=${package%%:*}
    if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
      echo "$package: already installed"
    else
      # --no-deps: never replace the torch and triton this check is about; few retries when offline
      "$PY" -m pip install --no-deps --disable-pip-version-check --retries 1 --timeout 10 "$package" || failed=1
    fi
  done
  "$PY" - "$dir/result.json" <<'PY'
import importlib.metadata as metadata
import json
import sys

versions = {}
for package in ("liger-kernel", "cut-cross-entropy"):
    try:
        versions[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
        versions[package] = None
json.dump(versions, open(sys.argv[1], "w"), indent=1)
print(versions)
PY
  return $failed
}

step_kernel_tests() {
  local dir=$1 rc=0
  # The interpreted suite re-runs these files under TRITON_INTERPRET=1 on CPU: not what this check is for.
  "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_kernels_*.py tests/test_tree_verify_kernel.py \
    -k "not interpreted_suite" \
    --junitxml="$dir/junit.xml" || rc=$?
  "$PY" - "$dir/junit.xml" "$dir/result.json" <<'PY' || { ((rc)) || rc=1; }
import json
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
result = {"tests": len(cases), "passed": 0, "failed": [], "skipped": []}
for case in cases:
    name = f"{case.get('classname')}::{case.get('name')}"
    problem = case.find("failure") if case.find("failure") is not None else case.find("error")
    skipped = case.find("skipped")
    if problem is not None:
        result["failed"].append({"test": name, "message": (problem.get("message") or "")[:500]})
    elif skipped is not None:
        result["skipped"].append({"test": name, "reason": skipped.get("message") or ""})
    else:
        result["passed"] += 1
# A GPU test skipped on the GPU machine means it never ran: that fails the step.
result["gpu_tests_not_run"] = [s["test"] for s in result["skipped"] if "CUDA" in s["reason"]]
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(f"{result['passed']} passed, {len(result['failed'])} failed, {len(result['skipped'])} skipped; "
      f"GPU tests not run: {len(result['gpu_tests_not_run'])}")
sys.exit(1 if result["failed"] or result["gpu_tests_not_run"] or not result["passed"] else 0)
PY
  return $rc
}

step_ce_bench() {
  # 16384 rows (4096 positions x 4 heads) of hidden 4096 against vocab 128256 in bf16 (the script's GPU defaults,
  # a quarter of its default token count to fit the time box).
  "$PY" benchmarks/triton_kernels.py --skip-verify --tokens 4096 --depths 3 --out "$1/result.json"
}

step_verify_bench() {
  "$PY" benchmarks/triton_kernels.py --skip-ce --skip-gate --backends triton,torch --out "$1/result.json"
}

step_compile_decode() {
  "$PY" - "$1/result.json" <<'PY'
import json
import sys
import time

import torch

sys.path.insert(0, "tests")
from test_decoding import draftable_model, ragged_prompts  # noqa: E402  (a model whose drafts are sometimes right)

device = "cuda" if torch.cuda.is_available() else "cpu"
model = draftable_model("cascaded").to(device)
input_ids, mask, _ = ragged_prompts()
input_ids, mask = input_ids.to(device), mask.to(device)
decoders = {"plain": dict(speculative=False), "speculative": dict(draft_tokens=2),
            "adaptive": dict(adaptive_draft_tokens=True)}
rows, outputs = [], {}
for name, kwargs in decoders.items():
    for compiled in (False, True):
        seconds = []
        for _ in range(2):  # the first call compiles
            start = time.perf_counter()
            out = model.generate(input_ids, 24, attention_mask=mask, compile=compiled, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        outputs[name, compiled] = [out.new_tokens[b, : out.num_new_tokens[b]].tolist() for b in range(len(mask))]
        rows.append({"decoder": name, "compile": compiled, "first_call_s": round(seconds[0], 3),
                     "seconds": round(seconds[1], 4), "tau": out.stats.tau,
                     "tokens_per_s": round(out.stats.total_new_tokens / seconds[1], 1),
                     "same_as_eager_plain": outputs[name, compiled] == outputs["plain", False]})
        print(rows[-1])
result = {"device": device, "ok": all(row["same_as_eager_plain"] for row in rows), "rows": rows}
json.dump(result, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if result["ok"] else 1)
PY
}

step_zero3_fit() {
  local dir=$1 hardware=()
  if [[ "${GPU_CHECK_ON_GPU:-1}" == 1 ]]; then
    hardware=(--trainer.accelerator gpu --trainer.strategy deepspeed_stage_3 --trainer.precision bf16-mixed)
  else  # --force without a GPU: the config's own CPU strategy
    hardware=(--trainer.accelerator cpu)
  fi
  "$PY" -m lightning_mtp.cli fit --config configs/deepspeed_zero3.yaml "${hardware[@]}" --trainer.devices 1 \
    --trainer.max_steps 2 --trainer.limit_val_batches 0 --trainer.num_sanity_val_steps 0 \
    --trainer.log_every_n_steps 1 --trainer.enable_checkpointing false --trainer.callbacks '[]' \
    --trainer.default_root_dir "$dir" --trainer.logger lightning.pytorch.loggers.CSVLogger \
    --trainer.logger.save_dir "$dir" --trainer.logger.name zero3 --data.init_args.max_bytes 300000 || return $?
  "$PY" - "$dir" <<'PY'
import csv
import glob
import json
import math
import sys

files = sorted(glob.glob(f"{sys.argv[1]}/zero3/version_*/metrics.csv"))
rows = list(csv.DictReader(open(files[-1]))) if files else []
losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
result = {"steps": len(losses), "train/loss": losses, "finite": all(math.isfinite(x) for x in losses)}
json.dump(result, open(f"{sys.argv[1]}/result.json", "w"), indent=1)
print(result)
sys.exit(0 if losses and result["finite"] else 1)
PY
}

step_fsdp2_fit() {
  local dir=$1 hardware=() devices
  if [[ "${GPU_CHECK_ON_GPU:-1}" == 1 ]]; then
    devices=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")
    hardware=(--trainer.accelerator gpu --trainer.devices "$devices")
  else  # --force without a GPU: two CPU processes (gloo)
    devices=2
    hardware=(--trainer.accelerator cpu --trainer.devices 2)
  fi
  "$PY" -m lightning_mtp.cli fit --config configs/quickstart.yaml --config configs/fsdp.yaml "${hardware[@]}" \
    --trainer.strategy.init_args.param_dtype bfloat16 --trainer.strategy.init_args.reduce_dtype float32 \
    --model.init_args.mtp.recompute true --trainer.max_steps 3 --trainer.limit_val_batches 0 \
    --trainer.num_sanity_val_steps 0 --trainer.log_every_n_steps 1 --trainer.callbacks.init_args.dirpath "$dir/ckpt" \
    --trainer.default_root_dir "$dir" --trainer.logger lightning.pytorch.loggers.CSVLogger \
    --trainer.logger.save_dir "$dir" --trainer.logger.name fsdp2 --data.init_args.max_bytes 300000 || return $?
  "$PY" - "$dir" "$devices" <<'PY'
import csv
import glob
import json
import math
import sys

import torch

from lightning_mtp.models import load_causal_lm

folder, devices = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(f"{folder}/fsdp2/*/metrics.csv"))  # the version: the model config's logger's
rows = list(csv.DictReader(open(files[-1]))) if files else []
losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
model = load_causal_lm(f"{folder}/ckpt/last.ckpt").eval()  # the consolidated checkpoint, in one process
out = model.generate(torch.randint(0, model.model_config.vocab_size, (1, 8)), 8)
result = {"devices": devices, "steps": len(losses), "train/loss": losses,
          "finite": all(math.isfinite(x) for x in losses), "decoded_tokens": int(out.num_new_tokens[0])}
json.dump(result, open(f"{folder}/result.json", "w"), indent=1)
print(result)
sys.exit(0 if losses and result["finite"] and result["decoded_tokens"] == 8 else 1)
PY
}

step_decode_bench() {
  local dir=$1
  "$PY" benchmarks/decode.py --train-seconds 20 --train-arg=--data.init_args.max_bytes=300000 \
    --train-arg=--trainer.limit_val_batches=0 --prompts 2 --max-new-tokens 8 --repeats 1 --no-compile \
    --threads 8 --out "$dir" --save-ckpt "$dir/model.ckpt" || return $?
  "$PY" - "$dir" <<'PY'
import json
import sys

rows = json.load(open(f"{sys.argv[1]}/decode.json"))
summary = json.load(open(f"{sys.argv[1]}/decode_summary.json"))
json.dump({"rows": rows, "summary": summary}, open(f"{sys.argv[1]}/result.json", "w"), indent=1)
PY
}

step_roofline_check() {
  local dir=$1
  "$PY" benchmarks/decode_roofline.py --measure --batch-sizes 1 8 64 --out "$dir/roofline.json" || return $?
  "$PY" - "$dir" <<'PY'
import json
import sys

measured = json.load(open(f"{sys.argv[1]}/roofline.json"))["measured"]
json.dump(measured, open(f"{sys.argv[1]}/result.json", "w"), indent=1)
for row in measured["rows"]:
    print(row["batch_size"], row["option"], "measured", row["step_in_plain_steps"], "predicted",
          row["predicted_step_in_plain_steps"])
PY
}

if [[ "${1:-}" == __step ]]; then
  mkdir -p "$3"
  "step_$2" "$3"
  exit $?
fi

# ---------------------------------------------------------------------------------------------------------- driver
OUT=outputs/gpu_check BUDGET_S=535 FORCE=0 SELECTED=("${STEPS[@]}")
while (($#)); do
  case "$1" in
    --out) OUT=$2; [[ $OUT == /* ]] || OUT=$CALLER_DIR/$OUT; shift 2 ;;
    --steps) IFS=, read -r -a SELECTED <<<"$2"; shift 2 ;;
    --budget) BUDGET_S=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$SCRIPT" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for step in "${SELECTED[@]}"; do
  [[ -n "${LIMIT_S[$step]:-}" ]] || { echo "gpu_check: unknown step $step (steps: ${STEPS[*]})" >&2; exit 2; }
done
[[ $BUDGET_S =~ ^[0-9]+$ ]] || { echo "gpu_check: --budget takes whole seconds, got $BUDGET_S" >&2; exit 2; }

no_gpu_reason() {  # prints why there is no usable GPU; fails (prints nothing) when there is one
  if ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && [[ ! -e /dev/kfd ]] && ! command -v nvidia-smi >/dev/null; then
    echo "no GPU on this machine (no /dev/nvidia* or /dev/kfd device, no nvidia-smi)"
    return 0
  fi
  local available
  available=$("$PY" -c "import torch; print(torch.cuda.is_available())" 2>/dev/null | tail -n 1)
  [[ "$available" == True ]] && return 1
  echo "torch sees no GPU (torch.cuda.is_available() is ${available:-unknown: $PY could not import torch})"
}

GPU_CHECK_ON_GPU=1
if reason=$(no_gpu_reason); then
  if ((!FORCE)); then
    echo "gpu_check: skipped: $reason"
    exit 0
  fi
  GPU_CHECK_ON_GPU=0
fi
export GPU_CHECK_ON_GPU

mkdir -p "$OUT"
rm -f "$OUT/summary.json"
for step in "${STEPS[@]}"; do rm -rf "${OUT:?}/$step" "$OUT/$step.json" "$OUT/$step.log"; done

record() {  # step status rc seconds limit reason: writes OUT/step.json, embedding OUT/step/result.json
  "$PY" - "$OUT" "$@" <<'PY'
import json
import os
import sys

out, step, status, rc, seconds, limit, reason = sys.argv[1:8]
path = os.path.join(out, step, "result.json")
try:
    result = json.load(open(path)) if os.path.exists(path) else None
except ValueError as error:
    result = {"unreadable": f"{path}: {error}"}
record = {"step": step, "status": status, "rc": None if rc == "" else int(rc), "seconds": float(seconds),
          "time_limit_s": int(limit), "command": f"bash scripts/gpu_check.sh __step {step} {os.path.join(out, step)}",
          "log": os.path.join(out, f"{step}.log"), "reason": reason or None, "result": result}
json.dump(record, open(os.path.join(out, f"{step}.json"), "w"), indent=1)
PY
}

start_all=$SECONDS
reserved=0  # the own limits of the steps still to run
for step in "${SELECTED[@]}"; do reserved=$((reserved + LIMIT_S[$step])); done
for step in "${SELECTED[@]}"; do
  reserved=$((reserved - LIMIT_S[$step]))
  left=$((BUDGET_S - (SECONDS - start_all)))
  limit=$((left - reserved > LIMIT_S[$step] ? left - reserved : LIMIT_S[$step]))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    record "$step" skipped "" 0 "$((limit > 0 ? limit : 0))" "out of time: the ${BUDGET_S}s budget is spent"
    echo "gpu_check: $step: skipped (out of time)"
    continue
  fi
  echo "gpu_check: $step (at most ${limit}s) ..."
  started=$(date +%s.%N)
  timeout -k 10 "$limit" bash "$SCRIPT" __step "$step" "$OUT/$step" >"$OUT/$step.log" 2>&1
  rc=$?
  seconds=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  case $rc in
    0) status=passed reason="" ;;
    124|137) status=timed_out reason="ran past ${limit}s" ;;
    *) status=failed reason="exit code $rc; see $OUT/$step.log" ;;
  esac
  record "$step" "$status" "$rc" "$seconds" "$limit" "$reason"
  echo "gpu_check: $step: $status (${seconds}s)${reason:+: $reason}"
done

"$PY" - "$OUT" "$OPTIONAL_STEPS" "$((SECONDS - start_all))" "${SELECTED[@]}" <<'PY'
import json
import os
import sys

out, optional, seconds, steps = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4:]
records = [json.load(open(os.path.join(out, f"{step}.json"))) for step in steps]
failed = [r["step"] for r in records if r["status"] != "passed" and r["step"] not in optional]
summary = {"ok": not failed, "failed": failed, "seconds": seconds, "optional": optional,
           "steps": {r["step"]: r for r in records}}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(f"gpu_check: {'ok' if not failed else 'FAILED: ' + ', '.join(failed)} in {seconds}s; "
      f"{os.path.join(out, 'summary.json')}")
sys.exit(1 if failed else 0)
PY
