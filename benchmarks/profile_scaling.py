"""Profiling throughput: one process vs a local Ray cluster with 1 and 2 workers (``speckv-profile --ray``).

Usage:
    python benchmarks/profile_scaling.py [--prompts 24] [--max-new-tokens 48] [--hidden 256] [--layers 4]

A tiny random Llama pair built in code (``speckv_policy.testing``; mechanics, not model quality) profiles the same
prompts at fp32, greedy and sampling, into a fresh log dataset each time; prints wall time, units per second and
whether the logs hold the same steps. On a 2-core machine two CPU workers share the two cores that one process's
torch already uses, so expect little gain here: the point of ``--ray`` is a cluster of GPU nodes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import os

    import ray  # noqa: F401  (the [ray] extra)

    from speckv_policy.hf.profiler import ProfileConfig, profile
    from speckv_policy.logs import read_log
    from speckv_policy.prompts import read_prompts
    from speckv_policy.testing import save_tiny_pair

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target, draft = save_tiny_pair(tmp, hidden_size=args.hidden, layers=args.layers, vocab_size=512)
        rng = np.random.default_rng(0)
        lines = [
            json.dumps(
                {
                    "id": f"p{i}",
                    "task_type": "code",
                    "split": "train",
                    "input_ids": rng.integers(1, 512, size=16).tolist(),
                }
            )
            for i in range(args.prompts)
        ]
        (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
        prompts = read_prompts(tmp / "prompts.jsonl")
        results = {}
        for name, ray_address, workers in (
            ("one process", None, None),
            ("Ray, 1 worker", "local", 1),
            ("Ray, 2 workers", "local", 2),
        ):
            out = tmp / name.replace(" ", "-").replace(",", "")
            cfg = ProfileConfig(
                target=str(target),
                draft=str(draft),
                out=str(out),
                compressions=("fp32",),
                max_new_tokens=args.max_new_tokens,
            )
            t = time.perf_counter()
            counts = profile(cfg, prompts, progress=False, ray_address=ray_address, workers=workers)
            results[name] = (time.perf_counter() - t, counts["done"], read_log(out))
        ref = results["one process"][2]
        key = ["run_id", "prompt_id", "step", "gamma", "accepted"]
        print(f"machine: {os.cpu_count()} CPU threads; tiny pair hidden {args.hidden}, {args.layers} layers")
        print(
            "| profile | units | wall s (Ray start-up and model loading included) | units/s | same steps as one process |"
        )
        print("|---|---|---|---|---|")
        for name, (secs, done, log) in results.items():
            same = log[key].reset_index(drop=True).equals(ref[key].reset_index(drop=True))
            print(f"| {name} | {done} | {secs:.1f} | {done / secs:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
