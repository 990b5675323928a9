"""What a verification costs: the target's forward over 1..9 new tokens, torch's linear layers against oneDNN's.

Usage:
    python benchmarks/verify_cost.py [--target smollm2] [--compressions fp32] [--context 120] [--repeats 10]
        [--converted]

A speculative step verifies ``gamma + 1`` tokens in one target forward after
the cached context. This times exactly that forward (the context's prefill is
untimed) for 1..9 new tokens, on two copies of the target in one process: as
loaded (torch's ``nn.Linear``, MKL on x86 CPUs) and with its float32 linear
layers pre-packed for oneDNN (``speckv_policy.hf.onednn.use_onednn_linear``;
at INT8 / NF4 only the layers bitsandbytes leaves in float32, e.g. the LM head,
are converted). Every repeat visits each (tokens, backend) cell once, in a
shuffled order, so drift hits both backends alike. Prints per compression the
median ms per forward, its ratio to the one-token forward of the same backend
(what a longer verification costs extra) and oneDNN's time over the default's,
and how far the two copies' logits are apart (the largest absolute difference
over a 9-token forward and how often their argmax agrees).

``--converted`` adds a third copy whose oneDNN layers convert the activations
to and from oneDNN's layout around every call (``use_onednn_linear(...,
fused=False)``, how they ran before the fused linear), timed in the same
shuffled rounds: what the fused linear saves, and that it computes the same.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--compressions", default="fp32")
    ap.add_argument("--context", type=int, default=120, help="cached context length before the timed forward")
    ap.add_argument("--max-tokens", type=int, default=9, help="time forwards over 1..N new tokens (default 9)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--converted",
        action="store_true",
        help="also time oneDNN layers that convert activations around every call (the way before the fused linear)",
    )
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from transformers import DynamicCache

    from speckv_policy.hf.onednn import use_onednn_linear
    from speckv_policy.smollm2.models import SMOLLM2_MODELS

    rng = np.random.default_rng(args.seed)
    sizes = list(range(1, args.max_tokens + 1))
    print(
        f"target forward over k new tokens after a cached context of {args.context}; median ms of {args.repeats} "
        f"repeats; torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    for comp in [c.strip() for c in args.compressions.split(",") if c.strip()]:
        models = {"default": SMOLLM2_MODELS.load_model(args.target, comp, "cpu")}
        models["onednn"] = SMOLLM2_MODELS.load_model(args.target, comp, "cpu")
        swapped = use_onednn_linear(models["onednn"])
        if args.converted:
            models["converted"] = SMOLLM2_MODELS.load_model(args.target, comp, "cpu")
            use_onednn_linear(models["converted"], fused=False)
        vocab = models["default"].config.vocab_size
        ctx = torch.tensor([rng.integers(100, vocab, size=args.context).tolist()])
        times: dict[tuple[str, int], list[float]] = {(b, k): [] for b in models for k in sizes}
        cells = list(times)
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # the first round warms up, untimed
                for i in rng.permutation(len(cells)):
                    backend, k = cells[i]
                    model = models[backend]
                    cache = model(ctx, past_key_values=DynamicCache(), use_cache=True).past_key_values
                    new = torch.tensor([rng.integers(100, vocab, size=k).tolist()])
                    t0 = time.perf_counter()
                    model(new, past_key_values=cache, use_cache=True)
                    times[cells[i]].append((time.perf_counter() - t0) * 1000)
        med = {c: statistics.median(v[1:]) for c, v in times.items()}
        with torch.inference_mode():
            new = torch.tensor([rng.integers(100, vocab, size=args.max_tokens).tolist()])
            logits = {}
            for b, model in models.items():
                cache = model(ctx, past_key_values=DynamicCache(), use_cache=True).past_key_values
                logits[b] = model(new, past_key_values=cache, use_cache=True).logits[0].float()
        gap = (logits["default"] - logits["onednn"]).abs().max().item()
        agree = (logits["default"].argmax(-1) == logits["onednn"].argmax(-1)).float().mean().item()
        print(f"### {comp} ({swapped} linear layers converted to oneDNN)\n")
        print(
            f"logits over {args.max_tokens} new tokens: largest absolute difference {gap:.2e} "
            f"(logit range {logits['default'].min().item():.1f}..{logits['default'].max().item():.1f}); "
            f"argmax agrees at {agree:.0%} of positions\n"
        )
        conv = "converted" in models
        if conv:
            gap_c = (logits["converted"] - logits["onednn"]).abs().max().item()
            print(f"fused against converted oneDNN layers: largest absolute logit difference {gap_c:.2e}\n")
        extra = " oneDNN converted ms | fused / converted |" if conv else ""
        print(f"| new tokens | default ms | x one token | oneDNN ms | x one token | oneDNN / default |{extra}")
        print("|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if conv else ""))
        for k in sizes:
            d, o = med[("default", k)], med[("onednn", k)]
            row = (
                f"| {k} | {d:.1f} | {d / med[('default', 1)]:.2f} | {o:.1f} | {o / med[('onednn', 1)]:.2f} | "
                f"{o / d:.2f} |"
            )
            if conv:
                c = med[("converted", k)]
                row += f" {c:.1f} | {o / c:.2f} |"
            print(row)
        print()
        del models
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
