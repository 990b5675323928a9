#!/usr/bin/env bash
# Run on a GPU machine from the repo root. Installs onnxruntime-gpu instead of onnxruntime
# (never both), then runs the CUDA checks. Expect a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -e ".[train,hf,test]"
$PY -m pip uninstall -q -y onnxruntime || true
$PY -m pip install -q onnxruntime-gpu
PYTHONUNBUFFERED=1 $PY benchmarks/gpu_check.py
