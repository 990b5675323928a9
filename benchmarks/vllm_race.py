"""The race inside vLLM (offline engine): output tokens/s of each arm at each concurrency, side by side in one run.

Arms: no speculation; fixed K with the speckv proposer's draft (vLLM's Dynamic SD picks one K per batch size, so at a
given concurrency its best case is the best fixed K); speckv policies. Every arm runs the same held-out prompts,
greedy, with ``max_num_seqs`` = the concurrency, in arm order rotated per repetition. Writes ``out/vllm_race.json``.

Run with vLLM's environment (``bash .ci/setup-vllm``; the target folder comes from the main environment once)::

    .venv/bin/python -c "from speckv_policy.smollm2.gguf import smollm2_safetensors as s; print(s())"
    .venv-vllm/bin/python benchmarks/vllm_race.py --concurrency 1,4 --prompts 8 --max-tokens 48

Preliminary: no batch-aware costs yet (policies are priced as at batch 1), throughput per run, no per-prompt CIs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(Path.home() / ".cache" / "speckv-policy" / "smollm2-135m-instruct-fp32"))
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    ap.add_argument("--arms", default="none,fixed-1,fixed-2,fixed-3,exported/smollm2-gbt-gated.onnx")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32", help="the target's dtype in vLLM (float16 on a GPU)")
    ap.add_argument("--draft-device", default="cpu", help="where the proposer's draft runs (cuda on a GPU)")
    ap.add_argument("--out", default="out/vllm_race.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from speckv_policy.atomic import atomic_write_text
    from speckv_policy.machine import describe_host
    from speckv_policy.prompts import read_prompts
    from speckv_policy.vllm import speculative_config

    held = [p for p in read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl") if p.split == "heldout"]
    prompts = held[:: max(1, len(held) // args.prompts)][: args.prompts]
    tok = AutoTokenizer.from_pretrained(args.target)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    arms = args.arms.split(",")
    rows = []
    reference: dict[int, list] = {}
    for conc in [int(c) for c in args.concurrency.split(",")]:
        for rep in range(args.repeats):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                kw = {}
                if arm != "none":
                    policy = int(arm.split("-")[1]) if arm.startswith("fixed-") else arm
                    kw["speculative_config"] = speculative_config(
                        args.draft,
                        policy,
                        max_gamma=8,
                        draft_loader="speckv_policy.smollm2.models.load_model",
                        device=args.draft_device,
                    )
                llm = LLM(
                    model=args.target,
                    dtype=args.dtype,
                    max_model_len=1024,
                    enforce_eager=True,
                    kv_cache_memory_bytes=1 << 30,
                    max_num_seqs=conc,
                    disable_log_stats=False,
                    **kw,
                )
                llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
                t0 = time.perf_counter()
                outs = llm.generate(texts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                ids = [list(o.outputs[0].token_ids) for o in outs]
                tokens = sum(len(i) for i in ids)
                if arm == "none":
                    reference[conc] = ids
                counts = {
                    m.name.removeprefix("vllm:spec_decode_"): m.value
                    for m in llm.get_metrics()
                    if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
                }
                row = {
                    "arm": arm,
                    "concurrency": conc,
                    "repeat": rep,
                    "tokens": tokens,
                    "seconds": wall,
                    "tokens_per_s": tokens / wall,
                    "same_as_no_speculation": ids == reference.get(conc, ids),
                    **counts,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                del llm
    out = {"machine": describe_host(), "prompts": [p.id for p in prompts], "max_tokens": args.max_tokens, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    print(f"{'arm':40s} " + " ".join(f"c={c:<8}" for c in args.concurrency.split(",")))
    for arm in arms:
        cells = []
        for c in [int(c) for c in args.concurrency.split(",")]:
            r = [x["tokens_per_s"] for x in rows if x["arm"] == arm and x["concurrency"] == c]
            base = [x["tokens_per_s"] for x in rows if x["arm"] == "none" and x["concurrency"] == c]
            cells.append(f"{sum(r) / len(r) / (sum(base) / len(base)):.2f}x" if r and base else "-")
        print(f"{arm:40s} " + " ".join(f"{x:10s}" for x in cells))


if __name__ == "__main__":
    main()
