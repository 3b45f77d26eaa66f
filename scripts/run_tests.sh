#!/usr/bin/env bash
# The test suite (default run: everything but tests marked slow). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest -m "not slow" "$@"
