#!/usr/bin/env bash
# Check and time the cuda device module on this machine's GPU (see bench/gpu_check.py); installs nothing.
# Needs torch and triton importable by $PYTHON (default python3). Extra arguments go to the script (--dry-run,
# --out PATH). The report lands in $OUT/gpu_check.json when $OUT is set, else bench/out/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="libs${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c "import torch, triton" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import torch and triton" >&2
    exit 2
fi
"$PYTHON" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__},',
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" >&2

# the script keeps its benchmarks inside a 240 s budget; this is the backstop for a hung compile or launch
exec timeout --signal=INT --kill-after=10 290 "$PYTHON" bench/gpu_check.py "$@"
