#!/usr/bin/env bash
# Rebuild everything shipped for the real pair, in order (2 CPU cores with AMX or AVX-512 BF16: ~6 hours in all,
#   4 of them the EAGLE-3 head of step 2b).
# Run from the repository root after `bash .ci/setup`.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${BUILD:-/tmp/speckv-build}
mkdir -p "$B"
PY=.venv/bin/python

# 1. Distillation prompts: 875 template prompts (code / math / chat; summarization of passages the target writes),
#    training only, never repeating a held-out prompt (~1.5 min) -> datasets/prompts/distill.jsonl (shipped).
$PY -m speckv_policy.cli.distill prompts --out datasets/prompts/distill.jsonl
#    Let the target answer them (1 greedy + 1 sampled at T = 0.8, up to 160 tokens), recording its top-32 next-token
#    log-probabilities at every answer position (~17 min, bf16) ...
$PY -m speckv_policy.cli.distill corpus --prompts datasets/prompts/distill.jsonl --out "$B/corpus3.pt" \
    --samples 2 --max-new-tokens 160 --batch-size 16 --seed 2
#    ... and answer the 219 task prompts greedily: the training prompts' answers select the checkpoint, the held-out
#    prompts' answers measure agreement once at the end (~3 min).
$PY -m speckv_policy.cli.distill corpus --prompts datasets/prompts/prompts.jsonl --out "$B/corpus.pt" \
    --samples 1 --max-new-tokens 160 --batch-size 16

# 2. Distil the draft on the template prompts only (24 min wall-clock budget; best checkpoint by agreement on the
#    task prompts' training split, which the draft never fits, so the policies later train on prompts as unseen by
#    the draft as the held-out ones) -> datasets/smollm2/draft (fp16, only what differs from the target).
$PY -m speckv_policy.cli.distill train --corpus "$B/corpus.pt,$B/corpus3.pt" --fit-prefix gen- \
    --out datasets/smollm2/draft --minutes 24
#    Fit the draft's context-copy gate (a mixture with n-gram lookup of the context, 16 numbers) on the same
#    validation answers (~20 s) -> datasets/smollm2/draft/draft.json.
$PY -m speckv_policy.cli.distill copy --corpus "$B/corpus.pt" --draft datasets/smollm2/draft

# 2b. The EAGLE-3 head (datasets/smollm2/eagle3, the speculators eagle3 format; docs/reference/draft.md): the target
#     answers the template prompts once more, greedily in fp32 (batches of similar length, ~30 min), and twice
#     sampled at T = 0.8 in bf16 (~27 min); a second draw of the templates three times (1 greedy, 2 sampled; ~23 min);
#     and 3,000 requests it writes itself (Magpie-style, none of the task held-out prompts; ~18 min), once sampled
#     (~29 min). The shipped head's build also kept the design note's 256 varied evaluation requests out of the 3,000.
#     Then `speckv-distill eagle3` reads every answer once teacher-forced in fp32 (the states entering target layers 2,
#     15, 27 and the top-16 next-token log-probabilities, ~34 min), picks the 8,192-token vocabulary, trains with
#     training-time test (2 steps) under bf16 autocast for 75 minutes and measures held-out agreement at fp32 / INT8 /
#     NF4 (~10 GB peak resident; 5.4 GB of features on disk). Features (shards of 512 texts, read memory-mapped) and
#     checkpoints live in $B/eagle3, so an interrupted build resumes. --train-precision bf16 wants a CPU that multiplies
#     bf16 natively (AMX or AVX-512 BF16; elsewhere leave it out and expect fewer steps in the budget).
$PY -m speckv_policy.cli.distill corpus --prompts datasets/prompts/distill.jsonl --out "$B/corpus-fp32.pt" \
    --samples 1 --max-new-tokens 128 --batch-size 64 --dtype fp32
$PY -m speckv_policy.cli.distill corpus --prompts datasets/prompts/distill.jsonl --out "$B/corpus-sampled.pt" \
    --samples 2 --sampled-only --max-new-tokens 160 --batch-size 16 --seed 3
$PY -m speckv_policy.cli.distill prompts --per-task 260 --seed 1 --out "$B/distill-2.jsonl"
$PY -m speckv_policy.cli.distill corpus --prompts "$B/distill-2.jsonl" --out "$B/corpus-s1.pt" \
    --samples 3 --batch-size 64 --dtype bf16
$PY -m speckv_policy.cli.distill self-prompts --count 3000 --seed 1 --heldout datasets/prompts/prompts.jsonl \
    --out "$B/self-prompts.jsonl"
$PY -m speckv_policy.cli.distill corpus --prompts "$B/self-prompts.jsonl" --out "$B/corpus-self.pt" \
    --samples 1 --sampled-only --batch-size 64 --dtype bf16
$PY -m speckv_policy.cli.distill corpus --prompts datasets/prompts/prompts.jsonl --out "$B/corpus-task-fp32.pt" \
    --samples 1 --max-new-tokens 160 --batch-size 64 --dtype fp32
$PY -m speckv_policy.cli.distill eagle3 \
    --corpus "$B/corpus-task-fp32.pt,$B/corpus-fp32.pt,$B/corpus-sampled.pt,$B/corpus-s1.pt,$B/corpus-self.pt" \
    --out datasets/smollm2/eagle3 --work "$B/eagle3" --minutes 75 --lr 2e-3 --ttt-steps 2 --train-precision bf16

# 3. Profile the pair: greedy on every prompt, sampling (T = 0.7) on every third, at fp32 / INT8 / NF4, 48 new
#    tokens each (the race's length: a shorter profile only knows the answers' first, easier positions) (~33 min).
#    The draft runs in bf16 (half the bytes per draft token: 2.1 vs 3.6 ms per token on the 2-core AMD EPYC with
#    AVX-512 BF16 it was built on; pinned, so another machine reproduces the same draft numerics).
rm -f datasets/smollm2/steps.parquet  # a new draft needs a fresh profile (speckv-profile resumes an existing file)
.venv/bin/speckv-profile --target smollm2 --draft datasets/smollm2/draft --prompts datasets/prompts/prompts.jsonl \
    --out datasets/smollm2/steps.parquet --compressions fp32,int8,nf4 --decodings greedy --max-new-tokens 48 --tag smollm2 \
    --draft-precision bf16
.venv/bin/speckv-profile --target smollm2 --draft datasets/smollm2/draft --prompts datasets/prompts/prompts.jsonl \
    --out datasets/smollm2/steps.parquet --compressions fp32,int8,nf4 --decodings sampling --max-new-tokens 48 \
    --stride 3 --tag smollm2 --draft-precision bf16

# 4. Default policies, trained on the training prompts' steps only -> exported/smollm2-*.onnx
.venv/bin/speckv-quickstart --log datasets/smollm2/steps.parquet --out exported
#    ... the policies that decide before drafting ('pre' features, no probe) -> exported/smollm2-*-pre.onnx
#    ... and the gated ones (a pre-draft gate + a length head after the probe) -> exported/smollm2-*-gated.onnx
#    Both also train on the history they write themselves: 2 rounds of replaying the training runs with their own
#    choices (--history-rounds, docs/design.md), since the profile's history is that of gamma 8.
for k in gbt mlp table; do
    .venv/bin/speckv-export "exported/smollm2-$k-pre.onnx" --train datasets/smollm2/steps.parquet --policy "$k" \
        --feature-set pre --decision-draft-tokens 0 --history-rounds 2
    .venv/bin/speckv-export "exported/smollm2-$k-gated.onnx" --train datasets/smollm2/steps.parquet --policy "$k" \
        --feature-set gated --decision-draft-tokens 1 --history-rounds 2
done
#    ... and the cost-aware stop rule (per-token acceptance curves, JSON; attach(..., mode="stop")) -> exported/smollm2-stop.json
.venv/bin/speckv-export --stop-rule exported/smollm2-stop.json --train datasets/smollm2/steps.parquet

# 4b. The same with the EAGLE-3 head: its own profile (greedy on every third prompt, sampling on every 24th; ~9 min)
#     and the policies trained on it -> exported/smollm2-eagle3-* (their exports record speckv.draft_kind = eagle3;
#     the hook warns if one runs with a draft model). The head drafts in bf16, pinned like the draft's in step 3
#     (1.8 vs 3.8 ms per draft token in fp32 on the AVX-512 BF16 EPYC it was profiled on, same acceptance).
E=datasets/smollm2/steps-eagle3.parquet
rm -f "$E"
for dec in "greedy --stride 3" "sampling --stride 24"; do
    # shellcheck disable=SC2086
    .venv/bin/speckv-profile --target smollm2 --draft datasets/smollm2/eagle3 --prompts datasets/prompts/prompts.jsonl \
        --out "$E" --compressions fp32,int8,nf4 --decodings $dec --max-new-tokens 48 --tag smollm2-eagle3 \
        --draft-precision bf16
done
for k in gbt table; do
    .venv/bin/speckv-export "exported/smollm2-eagle3-$k.onnx" --train "$E" --policy "$k"
    .venv/bin/speckv-export "exported/smollm2-eagle3-$k-gated.onnx" --train "$E" --policy "$k" \
        --feature-set gated --decision-draft-tokens 1 --history-rounds 2
done
.venv/bin/speckv-export exported/smollm2-eagle3-gbt-pre.onnx --train "$E" --policy gbt \
    --feature-set pre --decision-draft-tokens 0 --history-rounds 2
.venv/bin/speckv-export --stop-rule exported/smollm2-eagle3-stop.json --train "$E"

# 5. Offline evaluation on the held-out prompts (paired bootstrap, seconds) -> docs/eval/
.venv/bin/speckv-eval

# The end-to-end wall-clock race is a separate command (tens of minutes): .venv/bin/python benchmarks/e2e.py
