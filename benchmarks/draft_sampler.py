"""What drawing one sampled draft token costs: ``lean_draft.sample_tokens`` against ``torch.multinomial``.

Usage:
    python benchmarks/draft_sampler.py [--n 300]

The distribution is the shipped draft's shape: 49,152 vocabulary entries, probability on 8,192 of them (its pruned
head), the rest 0. Prints the median microseconds per draw of each, back to back on 2 threads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from speckv_policy.hf.lean_draft import sample_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="draws timed per sampler")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.full((1, 49152), -float("inf"))
    logits[0, :8192] = torch.randn(8192, generator=gen) * 3
    probs = torch.softmax(logits, -1)
    for name, draw in (
        ("sample_tokens (inverse CDF)", sample_tokens),
        ("torch.multinomial", lambda p: torch.multinomial(p, 1)),
    ):
        times = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            draw(probs)
            times.append(time.perf_counter() - t0)
        print(f"{name:28s} {np.median(times) * 1e6:7.1f} us per draw (median of {args.n})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
