#!/usr/bin/env bash
# The main job: fit the quickstart (bundled model, standard-library corpus, TensorBoard logs), then decode held-out
# prompts with plain and with speculative decoding from the checkpoint it wrote, and print tau and the speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false
# --ckpt_path last: a second run resumes the first fit (a finished one takes no step) instead of starting over it
.venv/bin/lightning-mtp fit --config configs/quickstart.yaml --ckpt_path last "$@"
ckpt=outputs/quickstart/checkpoints/last.ckpt
# No --data flags: the tokenizer and the held-out split come from the checkpoint.
# Batch 1 (one prompt at a time, the latency case speculative decoding is for); speculative = "auto", the default.
common=(--config configs/predict.yaml --ckpt_path "$ckpt" --data.init_args.batch_size 1
        --data.init_args.num_predict_prompts 8 --model.init_args.generation.max_new_tokens 96)
.venv/bin/lightning-mtp predict "${common[@]}" --model.init_args.generation.speculative false \
  --trainer.callbacks.init_args.output_dir outputs/quickstart/predict_plain
.venv/bin/lightning-mtp predict "${common[@]}" --model.init_args.generation.speculative auto \
  --trainer.callbacks.init_args.output_dir outputs/quickstart/predict_speculative
.venv/bin/python - <<'PY'
import json
plain = json.load(open("outputs/quickstart/predict_plain/stats.json"))
spec = json.load(open("outputs/quickstart/predict_speculative/stats.json"))
same = open("outputs/quickstart/predict_plain/generations.jsonl").read() == open(
    "outputs/quickstart/predict_speculative/generations.jsonl").read()
print(f"speculative decoding (batch 1, speculative=auto): tau = {spec['tau']:.2f} tokens per main-model forward (bonus token counted), "
      f"{spec['tokens_per_s']:.0f} tok/s vs plain {plain['tokens_per_s']:.0f} tok/s: "
      f"speedup {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x; greedy outputs identical: {same}")
PY
