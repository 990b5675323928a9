"""What a shut draft's catch-up costs in Hugging Face ``generate()`` (one stream), to decide whether to price it.

A draft runs only at the steps the policy drafts, so its next draft first reads every token it missed. This runs the
shipped gated policy with the distilled draft (``--draft model``) or the EAGLE-3 head (``--draft head``, bf16 on
oneDNN's linear) on the fp32 SmolLM2 target, 12 held-out prompts x 64 tokens greedy, fits each drafting step's draft
time as a line in its draft tokens and the context tokens its draft caught up on, and prints what the catch-up costs
against all step time. Usage: ``python benchmarks/hf_catch_up.py --draft model|head``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from speckv_policy.hf import attach, load_eagle3, use_onednn_linear
from speckv_policy.prompts import encode_prompt, read_prompts
from speckv_policy.smollm2.models import SMOLLM2, load_model, load_tokenizer

PROMPT_READ = 100  # a draft that catches up on more read (most of) its prompt: the request's first draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", choices=("model", "head"), required=True)
    args = ap.parse_args()
    tok, target = load_tokenizer(SMOLLM2), load_model(SMOLLM2, "fp32")
    if args.draft == "head":
        draft = load_eagle3("datasets/smollm2/eagle3", dtype=torch.bfloat16)
        use_onednn_linear(draft, dtypes=(torch.bfloat16,))
        policy = "exported/smollm2-eagle3-gbt-gated.onnx"
    else:
        draft, policy = load_model("datasets/smollm2/draft", "fp32"), "exported/smollm2-gbt-gated.onnx"
    held = [p for p in read_prompts("datasets/prompts/prompts.jsonl") if p.split == "heldout"]
    rows = []  # drafted, draft ms, caught-up tokens, step ms
    for p in held[:: max(1, len(held) // 12)][:12]:
        with attach(target, policy, compression="fp32") as h:
            target.generate(torch.tensor([encode_prompt(p, tok)]), max_new_tokens=64, assistant_model=draft)
        last = None
        for s in h.stats:
            gap = (s.context_len - last if last is not None else s.context_len) if s.drafted else 0
            last = s.context_len if s.drafted else last
            rows.append((s.drafted, s.draft_ms, gap, s.draft_ms + s.verify_ms))
    a = np.array(rows, float)
    d = a[a[:, 0] > 0]
    coef, *_ = np.linalg.lstsq(np.c_[np.ones(len(d)), d[:, 0], d[:, 2]], d[:, 1], rcond=None)
    later, first = d[d[:, 2] < PROMPT_READ, 2], d[d[:, 2] >= PROMPT_READ, 2]
    total = a[:, 3].sum()
    print(f"{args.draft}: {len(a)} steps, {len(d)} drafted ({len(d) / len(a):.0%})")
    print(f"draft ms = {coef[0]:.2f} + {coef[1]:.3f} x draft tokens + {coef[2]:.4f} x caught-up tokens")
    print(f"caught up per drafting step after the first: mean {later.mean():.2f}, p90 {np.percentile(later, 90):.1f}")
    print(
        f"catch-up after the first draft {coef[2] * later.sum():.0f} ms, first drafts' prompt reads "
        f"{coef[2] * first.sum():.0f} ms, of {total:.0f} ms of steps ({coef[2] * (later.sum() + first.sum()) / total:.2%})"
    )


if __name__ == "__main__":
    main()
