"""oneDNN's fused linear end to end: the same generations on two copies of the target (or of the draft).

Usage:
    python benchmarks/fused_linear_e2e.py [--per-task 6] [--max-new-tokens 48] [--costs costs.json]
    python benchmarks/fused_linear_e2e.py --compare draft [--per-task 6] [--costs costs.json]
    python benchmarks/fused_linear_e2e.py --compare draft-forward [--per-task 6] [--costs costs.json]

Loads SmolLM2-135M in fp32 twice in one process, its linear layers on oneDNN
both times: fused (``use_onednn_linear(target)``, the default) and converted
(``use_onednn_linear(target, fused=False)``: activations converted to and from
oneDNN's layout around every layer, the way before). Then, per held-out prompt
(``--per-task`` per task type), greedy, the target alone, fixed gamma 2 and the
cost-aware stop rule (``exported/smollm2-stop.json``; re-priced with
``--costs``, else ``costs="live"``) through the hook with the distilled draft,
each on both copies, the order of the copies alternating from prompt to prompt.
Prints per arm the median ms per output token on each copy and the median of
the per-prompt ratios fused / converted with a 95% bootstrap CI over prompts,
how many greedy outputs the two copies disagree on (near ties: the layers'
one-row calls may round differently) and on how many prompts the hooked arms'
steps (gamma, drafted, accepted) differ (the draft proposed something else; with
live prices, no ``--costs``, the stop rule's steps also follow the timings).

``--compare draft`` keeps one target (fp32, fused oneDNN layers) and loads the
distilled draft twice instead: in bf16 on torch's layers (as the race runs it
by default) and on oneDNN's fused linear (``--draft-linear onednn``). Fixed
gamma 2 and the stop rule on both drafts; greedy outputs must be the same (the
target's own, whatever the draft proposes).

``--compare draft-forward`` keeps one target (fp32, fused oneDNN layers) and one draft (bf16, torch's layers) and
runs the lean loop's draft forward steps two ways: through the Llama decode step
(``attach(..., draft_forward='auto')``, the default, :class:`~speckv_policy.hf.fast_draft.LlamaDecodeStep`) and
through the draft's own transformers forward (``draft_forward='transformers'``); fixed gamma 2 and the stop rule.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="datasets/prompts/prompts.jsonl")
    ap.add_argument("--per-task", type=int, default=6, help="held-out prompts per task type (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--stop-rule", default="exported/smollm2-stop.json")
    ap.add_argument("--costs", default=None, help="a calibration (speckv-calibrate) to price the stop rule with")
    ap.add_argument(
        "--compare",
        choices=("target", "draft", "draft-forward"),
        default="target",
        help="which model's layers to compare",
    )
    args = ap.parse_args(argv)

    import torch

    from speckv_policy.hf import attach
    from speckv_policy.hf.models import draft_precision
    from speckv_policy.hf.onednn import ONEDNN_DTYPES, apply_linear_backend, use_onednn_linear
    from speckv_policy.prompts import encode_prompt, read_prompts
    from speckv_policy.smollm2.models import load_model, load_tokenizer

    warnings.filterwarnings("ignore")
    tok = load_tokenizer("smollm2")
    pairs = {}  # way -> (target, draft, attach keywords)
    if args.compare == "target":
        draft = load_model("datasets/smollm2/draft", draft_precision("cpu"))
        for way, fused in (("fused", True), ("converted", False)):
            target = load_model("smollm2", "fp32")
            use_onednn_linear(target, fused=fused)
            pairs[way] = (target, draft, {})
    elif args.compare == "draft":
        target = load_model("smollm2", "fp32")
        use_onednn_linear(target)
        for way in ("onednn", "torch"):
            draft = load_model("datasets/smollm2/draft", draft_precision("cpu"))
            apply_linear_backend(draft, way.replace("torch", "default"), dtypes=ONEDNN_DTYPES)
            pairs[way] = (target, draft, {})
    else:
        target = load_model("smollm2", "fp32")
        use_onednn_linear(target)
        draft = load_model("datasets/smollm2/draft", draft_precision("cpu"))
        pairs = {"fast": (target, draft, {"draft_forward": "auto"})}
        pairs["transformers"] = (target, draft, {"draft_forward": "transformers"})
    a_way, b_way = pairs
    held = [p for p in read_prompts(args.prompts) if p.split == "heldout"]
    picked = []
    for task in sorted({p.task_type for p in held}):
        picked += [p for p in held if p.task_type == task][: args.per_task]
    costs = args.costs or "live"
    arms = ("target", "fixed-2", "stop") if args.compare == "target" else ("fixed-2", "stop")

    used = {}  # way -> how the hook ran the draft's forward steps

    def run(arm: str, target, draft, how: dict, ids, way: str) -> tuple[float, list[int], list[tuple[int, ...]]]:
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        handle = None
        if arm == "fixed-2":
            handle = attach(target, None, compression="fp32", mode="fixed", gamma_fn=lambda step: 2, **how)
        elif arm == "stop":
            handle = attach(target, args.stop_rule, compression="fp32", mode="stop", costs=costs, **how)
        if handle is not None:
            kw["assistant_model"] = draft
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = target.generate(ids, **kw)
            seconds = time.perf_counter() - t0
        finally:
            steps = []
            if handle is not None:
                used[way] = handle.draft_forward
                steps = [(s.gamma, s.drafted, s.accepted) for s in handle.stats]
                handle.detach()
        new = out[0, ids.shape[1] :].tolist()
        return seconds * 1000 / max(len(new), 1), new, steps

    ms = {(arm, way): [] for arm in arms for way in pairs}
    differ = {arm: 0 for arm in arms}
    differ_steps = {arm: 0 for arm in arms}  # runs whose steps (gamma, drafted, accepted) differ between the copies
    t_start = time.perf_counter()
    for i, prompt in enumerate(picked):
        ids = torch.tensor([encode_prompt(prompt, tok)])
        order = list(pairs) if i % 2 == 0 else list(pairs)[::-1]
        for arm in arms:
            outs, steps = {}, {}
            for way in order:
                ms[(arm, way)].append(0.0)
                ms[(arm, way)][-1], outs[way], steps[way] = run(arm, *pairs[way], ids, way)
            differ[arm] += outs[a_way] != outs[b_way]
            differ_steps[arm] += steps[a_way] != steps[b_way]
    minutes = (time.perf_counter() - t_start) / 60
    what = {
        "target": "SmolLM2-135M fp32 on oneDNN, fused vs converted layers",
        "draft": "SmolLM2-135M fp32 (fused oneDNN layers) with the bf16 draft on oneDNN's fused linear vs torch's layers",
        "draft-forward": "SmolLM2-135M fp32 (fused oneDNN layers) with the bf16 draft, its forward steps through the "
        f"Llama decode step vs its transformers forward (the hook ran: {used.get('fast')!r} vs "
        f"{used.get('transformers')!r})",
    }[args.compare]
    print(
        f"{what}, one process; {len(picked)} held-out prompts, "
        f"{args.max_new_tokens} new tokens, greedy, the copies' order alternating; stop rule priced "
        f"{'with ' + args.costs if args.costs else 'live'}; {minutes:.1f} min\n"
    )
    print(
        f"| arm | {a_way} ms/token | {b_way} ms/token | {a_way} / {b_way} [95% CI] | outputs that differ | "
        "step sequences that differ |"
    )
    print("|---|---:|---:|---|---:|---:|")
    rng = np.random.default_rng(0)
    for arm in arms:
        f, c = np.asarray(ms[(arm, a_way)]), np.asarray(ms[(arm, b_way)])
        r = f / c
        boot = [np.median(rng.choice(r, r.size)) for _ in range(2000)]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        print(
            f"| {arm} | {np.median(f):.1f} | {np.median(c):.1f} | {np.median(r):.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{differ[arm]} of {len(picked)} | {differ_steps[arm]} of {len(picked)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
