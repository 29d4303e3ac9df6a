#!/usr/bin/env bash
# GPU check of the static-cache, compiled path (issue 13): random-init Qwen2.5-0.5B / 7B shapes,
# eager vs static ms per token, the draft/target cost ratio c, K=0 vs K=4 end to end.
# One command with a total timeout (GPU_CHECK_TIMEOUT_S, default 570 s); exits 2 without a GPU.
# Arguments go to scripts/gpu_check.py (--help; --dry-run: the CPU smoke test with tiny shapes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! "$PY" -c "import torch, transformers, numpy" 2>/dev/null; then
  echo "gpu_check: $PY lacks torch, transformers or numpy (install the project: pip install -e .)" >&2
  exit 3
fi
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT_S:-570}" "$PY" "$ROOT/scripts/gpu_check.py" "$@"
