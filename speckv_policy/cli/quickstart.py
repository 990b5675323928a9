"""``speckv-quickstart``: the main job, end to end on a shipped log.

Trains every policy kind on the log's training prompts, exports each to ONNX,
loads the exports with the runtime, checks them against Python on the held-out
prompts, and prints a side-by-side table of counterfactual tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_LOG = "datasets/smollm2/steps.parquet"
KINDS = ("mlp", "gbt", "table", "paper-mlp16", "fixed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speckv-quickstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--log", default=DEFAULT_LOG, help=f"step log to train on (default {DEFAULT_LOG})")
    p.add_argument("--out", default="out", help="folder for the .onnx exports (default ./out)")
    p.add_argument("--policies", default=",".join(KINDS), help="comma-separated kinds to train")
    p.add_argument("--decision-draft-tokens", type=int, choices=[0, 1], default=1,
                   help="draft tokens paid before deciding: 1 for the hook's default upfront mode (default)")
    args = p.parse_args(argv)

    from ..export import export_onnx
    from ..logs import LogValidationError
    from ..objective import CostModel
    from ..policies import training_data
    from ..runtime import RuntimePolicy
    from ..logs import read_log
    from ..training import fit_from_log, make_policy, offline_summary

    try:
        log = read_log(args.log)
    except (LogValidationError, FileNotFoundError) as exc:
        print(f"speckv-quickstart: error: {exc}", file=sys.stderr)
        return 2
    synthetic = bool((log["draft_model"] == "synthetic-draft").all())
    targets = set(log["target_model"])
    prefix = "synthetic-" if synthetic else ("smollm2-" if targets == {"SmolLM2-135M-Instruct"} else "")
    cm = CostModel.fit(log, decision_draft_tokens=args.decision_draft_tokens)
    out = Path(args.out)
    n_train = int((log["split"] == "train").sum())
    print(f"log {args.log}: {len(log)} steps ({n_train} train / {len(log) - n_train} held-out)"
          + ("  [SYNTHETIC data: known acceptance process, not a model]" if synthetic else ""))
    print(f"cost model fitted on {cm.device} (ms; per compression code 0 = full precision, 1 = int8, 2 = nf4):")
    for code in range(len(cm.draft_ms_per_token)):
        print(f"  {code}: draft {cm.draft_base_ms[code]:.1f} per call + {cm.draft_ms_per_token[code]:.2f} per token; "
              + (f"verify for gamma 0..{len(cm.verify_table_ms[code]) - 1}: "
                 f"{np.round(cm.verify_table_ms[code], 1).tolist()}" if cm.verify_table_ms else
                 f"verify {cm.verify_base_ms[code]:.1f} + {cm.verify_ms_per_token[code]:.2f} per token"))
    header = (f"{'policy':<12} {'tok/s':>7} {'x fixed4':>9} {'x best fixed':>13} {'x oracle':>9} "
              f"{'mean gamma':>11} {'ONNX=Py':>8} {'p50 us':>7}  file")
    print(header)
    print("-" * len(header))
    status = 0
    for kind in [k.strip() for k in args.policies.split(",") if k.strip()]:
        policy = make_policy(kind, cost_model=cm)
        fit_from_log(policy, log, split="train")
        name = "fixed4" if kind == "fixed" else kind
        path = out / f"{prefix}{name}.onnx"
        export_onnx(policy, path)
        rt = RuntimePolicy(path)
        X, _ = training_data(log, policy.feature_set, split="heldout")
        agree = float(np.mean(rt.decide_batch(X) == policy.predict(X)))
        rows = X.to_numpy(np.float32)
        times = []
        for i in range(min(2000, len(rows))):
            t = time.perf_counter()
            rt.decide(rows[i])
            times.append(time.perf_counter() - t)
        s = offline_summary(policy, log, cm)
        status |= agree < 0.999
        print(f"{name:<12} {s['tokens_per_second']:7.2f} {s['tokens_per_second'] / s['fixed4']:9.3f} "
              f"{s['tokens_per_second'] / s['best_fixed']:13.3f} {s['tokens_per_second'] / s['oracle']:9.3f} "
              f"{s['mean_gamma']:11.2f} {agree:8.2%} {np.median(times) * 1e6:7.1f}  {path}")
    print(f"(held-out prompts only; best fixed gamma in hindsight = {int(s['best_fixed_gamma'])}; "
          "oracle = per-step best gamma knowing the outcome)")
    return int(status)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
