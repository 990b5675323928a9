"""Where the speckv proposer's time goes inside vLLM's server: its own time per engine step, split into steps where
it drafted for some request and steps where it drafted for none, against the rest of the step.

    .venv-vllm/bin/python benchmarks/vllm_proposer_time.py --costs out/vllm_race-costs.json --concurrency 16

Serves the shipped gated policy priced per batch size (the vLLM race's ``gbt-gated-batch`` arm) with the proposer's
per-call timings on, runs the held-out prompts at one concurrency twice, and prints tokens/s and the split. Steps
at batch sizes below ``--concurrency`` * 3/4 (the ramp up and down) are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", required=True, help="batch cost file (speckv-calibrate --engine vllm)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if not 1 <= args.concurrency <= args.prompts:
        ap.error(
            f"--concurrency {args.concurrency}: must be 1..--prompts ({args.prompts}), or no step runs a full batch"
        )

    import vllm_race
    from transformers import AutoTokenizer

    from speckv_policy.batch_costs import BatchCosts
    from speckv_policy.smollm2.gguf import smollm2_safetensors
    from speckv_policy.vllm import VLLMServer, engine_args, speculative_config

    BatchCosts.load(args.costs)  # a bad file is refused here, not inside the engine
    target = str(smollm2_safetensors())
    tok = AutoTokenizer.from_pretrained(target)
    texts, _ = vllm_race.pick_prompts(tok, "heldout", args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "timings.jsonl"
        spec = speculative_config(
            str(ROOT / vllm_race.DRAFT), str(ROOT / vllm_race.POLICY), costs=args.costs, timings=str(timings),
            max_gamma=vllm_race.MAX_GAMMA, draft_loader=vllm_race.LOADER, device="cpu",
        )  # fmt: skip
        with VLLMServer(engine_args(target, device="cpu", max_num_seqs=args.concurrency), speculative=spec) as server:
            server.complete(texts[0], 4)  # warm-up
            for _ in range(2):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    replies = list(pool.map(lambda t: server.complete(t, args.max_tokens), texts))
                wall = time.perf_counter() - t0
                print(f"c = {args.concurrency}: {sum(r['tokens'] for r in replies) / wall:.1f} output tok/s")
        rows = [json.loads(line) for line in timings.read_text().splitlines()]
    full = args.concurrency * 3 / 4
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["batch"] >= full and b["batch"] >= full]
    rest = sum(b["t_in"] - a["t_out"] for a, b in pairs) / len(pairs)
    print(f"rest of an engine step (the target's pass and vLLM's own work): {1000 * rest:.1f} ms")
    for name, keep in (("drafted for no request", False), ("drafted for some request", True)):
        calls = [r for r in rows if r["batch"] >= full and (r["draft_tokens"] > 0) == keep]
        if not calls:
            continue
        ms = 1000 * sum(r["t_out"] - r["t_in"] for r in calls) / len(calls)
        tokens = sum(r["draft_tokens"] for r in calls)
        print(f"steps that {name}: {len(calls)}, proposer {ms:.1f} ms each ({ms / (1000 * rest):.1%} of the rest), "
              f"{tokens} draft tokens, {sum(r['decoding'] for r in calls) / len(calls):.1f} requests decoding")  # fmt: skip


if __name__ == "__main__":
    main()
