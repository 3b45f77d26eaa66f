#!/usr/bin/env bash
# Create (or reuse) the local virtual environment .venv and install lightning-mtp with everything it needs.
# torch comes first and pinned, so pip takes the CPU build on disk instead of pulling a multi-GB CUDA build;
# DeepSpeed is built without build isolation (against that torch) and with its ops built lazily.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.lightning-mtp-installed
want="$(sha1sum pyproject.toml scripts/setup_env.sh | sha1sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
$PIP install -q --upgrade pip setuptools wheel
$PIP install -q "torch==2.13.0"
DS_BUILD_OPS=0 $PIP install -q --no-build-isolation "deepspeed>=0.15"
$PIP install -q -e ".[test]"
echo "$want" > "$stamp"
