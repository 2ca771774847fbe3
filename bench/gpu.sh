#!/usr/bin/env bash
# The prepared GPU check: step costs with random-weight Llama-3-8B / 3.2-1B-shaped models (bench/gpu.py).
# Runs in a few minutes on one H200 with no network. Results: $OUT/gpu.json, else bench/results/gpu.json.
#   bash bench/gpu.sh            # on a GPU machine
#   bash bench/gpu.sh --smoke    # tiny models on CPU, to check the script
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PYTHON" -c "import torch, transformers" 2>/dev/null; then
  echo "bench/gpu.sh: $PYTHON lacks torch or transformers; run 'make install' or set PYTHON" >&2
  exit 2
fi
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
exec timeout 480 "$PYTHON" bench/gpu.py "$@"
