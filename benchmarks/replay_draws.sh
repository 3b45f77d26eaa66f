#!/bin/bash
# speculative="auto" judged on fixed step costs, without timing noise: benchmarks/decode_replay.py --costs-from on
# three cost draws (benchmarks/cost_draws/: a and b measured on a 2-core CPU; c GPU-like, a drafting step
# 1.05 + 0.12 k plain steps) x three models (quickstart, hf_compare, the benchmark model) x batch 1 and 8. Prints
# auto over plain (p) and over the best fixed chain (b) per row ('*': below the targets, 0.97 plain and 0.95 best
# fixed) and writes them to benchmarks/results/replay_draws.json (or $OUT). The replay is deterministic: a busy
# machine gives the same numbers. About 4 minutes on 2 cores. Needs the three models:
#   outputs/quickstart/checkpoints/last.ckpt        (bash scripts/run_quickstart.sh)
#   .cache/lightning_mtp/hf_compare                  (python benchmarks/hf_compare.py --model-dir ...)
#   .cache/lightning_mtp/benchmarks/decode_model.ckpt (python benchmarks/decode.py --train-only)
# usage: bash benchmarks/replay_draws.sh [LABEL]
set -euo pipefail
label=${1:-auto}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
out=${OUT:-$root/benchmarks/results/replay_draws.json}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
one() {
  local draw=$1 model=$2 source
  case $model in
    quickstart) source="--ckpt outputs/quickstart/checkpoints/last.ckpt" ;;
    benchmark) source="--ckpt .cache/lightning_mtp/benchmarks/decode_model.ckpt" ;;
    hf_compare) source="--hf-compare .cache/lightning_mtp/hf_compare --prompts 8 --prompt-tokens 48 --max-new-tokens 64" ;;
  esac
  # shellcheck disable=SC2086  # $source is several arguments
  (cd "$root" && OMP_NUM_THREADS=1 "$py" benchmarks/decode_replay.py $source --label "$model" --threads 1 \
      --costs-from "$root/benchmarks/cost_draws/costs_$draw.json" --no-ablation --out "$work/${draw}_$model.json" \
      > "$work/${draw}_$model.log" 2>&1) || { echo "replay $draw $model failed:"; tail -5 "$work/${draw}_$model.log"; }
}
export -f one; export root py work
for draw in a b c; do for model in quickstart hf_compare benchmark; do echo "$draw $model"; done; done \
  | xargs -P 2 -n 2 bash -c 'one "$0" "$1"'
cd "$root"
"$py" - "$label" "$work" "$out" <<'PY'
import json, sys
from pathlib import Path
label, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
rows, worst = [], None
for draw in "abc":
    for model in ("quickstart", "hf_compare", "benchmark"):
        path = work / f"{draw}_{model}.json"
        if not path.is_file():
            sys.exit(f"replay_draws: no result for draw {draw}, model {model}")
        result = json.loads(path.read_text())
        for batch in (1, 8):
            batch_rows = [r for r in result["rows"] if r["batch_size"] == batch]
            auto = next(r["seconds"] for r in batch_rows if r["row"] == "auto")
            plain = next(r["seconds"] for r in batch_rows if r["row"] == "plain")
            best = min(r["seconds"] for r in batch_rows if r["row"].startswith("chain"))
            row = {"draw": draw, "model": model, "batch_size": batch, "vs_plain": plain / auto,
                   "vs_best_fixed": best / auto}
            row["met"] = row["vs_plain"] >= 0.97 and row["vs_best_fixed"] >= 0.95
            rows.append(row)
for r in rows:
    print(f"{r['draw']} {r['model']:10s} b{r['batch_size']}  {r['vs_plain']:.3f}p  {r['vs_best_fixed']:.3f}b"
          f"{'' if r['met'] else '  *'}")
import subprocess
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "lightning_mtp"], capture_output=True, text=True).stdout
commit = f"{commit} with uncommitted changes" if commit and dirty.strip() else commit
runs = json.loads(out.read_text())["runs"] if out.is_file() else {}
runs[label] = {"command": f"bash benchmarks/replay_draws.sh {label}", "commit": commit or None, "rows": rows}
out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
missed = sum(not r["met"] for r in rows)
print(f"{label}: worst {min(min(r['vs_plain'] / 0.97, r['vs_best_fixed'] / 0.95) for r in rows):.3f} of the targets, "
      f"{missed} of {len(rows)} rows below them; wrote {out}")
PY
