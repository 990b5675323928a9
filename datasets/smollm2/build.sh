#!/usr/bin/env bash
# Rebuild everything shipped for the real pair, in order (2 CPU cores: ~1.5 hours in all).
# Run from the repository root after `bash .ci/setup`.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${BUILD:-/tmp/speckv-build}
mkdir -p "$B"
PY=.venv/bin/python

# 1. Let the target answer the training prompts (and the held-out ones, greedy, for evaluation only),
#    recording its top-32 next-token log-probabilities at every answer position (~6.6 + 6.0 min, bf16).
$PY -m speckv_policy.draft corpus --prompts datasets/prompts/prompts.jsonl --out "$B/corpus.pt" \
    --samples 4 --max-new-tokens 160 --batch-size 16
$PY -m speckv_policy.draft corpus --prompts datasets/prompts/prompts.jsonl --out "$B/corpus2.pt" \
    --samples 4 --max-new-tokens 160 --batch-size 16 --temperature 1.0 --seed 1 --sampled-only

# 2. Distil the draft (14 min wall-clock budget; best checkpoint by agreement on 10% of the training prompts) -> datasets/smollm2/draft (fp16, only what differs from the target).
$PY -m speckv_policy.draft train --corpus "$B/corpus.pt,$B/corpus2.pt" --out datasets/smollm2/draft --minutes 14

# 3. Profile the pair: greedy on every prompt, sampling (T = 0.7) on every third, at fp32 / INT8 / NF4 (~16 min).
.venv/bin/speckv-profile --target smollm2 --draft datasets/smollm2/draft --prompts datasets/prompts/prompts.jsonl \
    --out datasets/smollm2/steps.parquet --compressions fp32,int8,nf4 --decodings greedy --max-new-tokens 24 --tag smollm2
.venv/bin/speckv-profile --target smollm2 --draft datasets/smollm2/draft --prompts datasets/prompts/prompts.jsonl \
    --out datasets/smollm2/steps.parquet --compressions fp32,int8,nf4 --decodings sampling --max-new-tokens 24 \
    --stride 3 --tag smollm2

# 4. Default policies, trained on the training prompts' steps only -> exported/smollm2-*.onnx
.venv/bin/speckv-quickstart --log datasets/smollm2/steps.parquet --out exported
