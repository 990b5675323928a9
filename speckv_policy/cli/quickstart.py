"""``speckv-quickstart``: the main job, end to end on a shipped log.

Trains every policy kind on the log's training prompts, exports each to ONNX,
loads the exports with the runtime, checks them against Python on the held-out
prompts, and prints a side-by-side table of counterfactual tokens/s from the
same offline evaluator as ``speckv-eval`` (same pricing, same figures).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .common import exit_cleanly_on_sigterm, fail, int_at_least, warn_if_one_gamma

DEFAULT_LOG = "datasets/smollm2/steps.parquet"
KINDS = ("mlp", "gbt", "table", "paper-mlp16", "fixed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speckv-quickstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--log", default=DEFAULT_LOG, help=f"step log to train on (default {DEFAULT_LOG})")
    p.add_argument("--out", default="out", help="folder for the .onnx exports (default ./out)")
    p.add_argument("--policies", default=",".join(KINDS), help="comma-separated kinds to train")
    p.add_argument(
        "--decision-draft-tokens",
        type=int,
        choices=[0, 1],
        default=1,
        help="draft tokens paid before deciding: 1 for the hook's default upfront mode (default)",
    )
    p.add_argument(
        "--bootstrap",
        type=int_at_least(1),
        default=2000,
        help="paired bootstrap resamples over prompts for the CIs (default 2000)",
    )
    args = p.parse_args(argv)
    exit_cleanly_on_sigterm()

    from ..evaluation import evaluate_log
    from ..export import export_onnx
    from ..logs import LogValidationError, read_log
    from ..objective import CostModel
    from ..policies import POLICIES, training_data
    from ..runtime import RuntimePolicy
    from ..training import fit_from_log, make_policy

    kinds = [k.strip() for k in args.policies.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in POLICIES]
    if not kinds or unknown:
        print(
            f"speckv-quickstart: error: --policies needs kinds from {', '.join(POLICIES)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else ""),
            file=sys.stderr,
        )
        return 2
    try:
        log = read_log(args.log)
    except (LogValidationError, FileNotFoundError) as exc:
        print(f"speckv-quickstart: error: {exc}", file=sys.stderr)
        return 2
    synthetic = bool((log["draft_model"] == "synthetic-draft").all())
    targets = set(log["target_model"])
    prefix = "synthetic-" if synthetic else ("smollm2-" if targets == {"SmolLM2-135M-Instruct"} else "")
    try:
        cm = CostModel.fit(log, decision_draft_tokens=args.decision_draft_tokens)
    except ValueError as exc:
        print(
            f"speckv-quickstart: error: {args.log}: cannot fit a cost model from its timings ({exc})", file=sys.stderr
        )
        return 2
    out = Path(args.out)
    n_train = int((log["split"] == "train").sum())
    print(
        f"log {args.log}: {len(log)} steps ({n_train} train / {len(log) - n_train} held-out)"
        + ("  [SYNTHETIC data: known acceptance process, not a model]" if synthetic else "")
    )
    print(f"cost model fitted on {cm.device} ({cm.unit}; per compression code):")
    for line in cm.describe():
        print(f"  {line}")
    status = 0
    policies = {}
    checks = {}
    try:
        for kind in kinds:
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
            status |= agree < 0.999
            warn_if_one_gamma(name, policy.predict(X), "speckv-quickstart")
            policies[name] = (policy.feature_set, policy.predict)
            checks[name] = (agree, float(np.median(times)) * 1e6, rt.engine, path)
    except (OSError, ValueError) as exc:  # an --out that is a file, a full disk, a graph that does not run
        return fail("speckv-quickstart", exc)
    result, _ = evaluate_log(log, policies, policy_cost=cm, n_resamples=args.bootstrap)
    ov = result["groups"]["overall"]
    boot = result["bootstrap"].get("overall", {})
    header = (
        f"{'policy':<12} {'tok/s':>7} {'x target':>9} {'95% CI':>13} {'x best fixed':>13} {'95% CI':>13} "
        f"{'x fixed4':>9} {'x oracle':>9} {'mean gamma':>11} {'ONNX=Py':>8} {'p50 us':>7} {'engine':>11}  file"
    )
    print(header)
    print("-" * len(header))

    def ci(name: str, key: str) -> str:
        lo, hi = boot[name][key]["ci"] if name in boot else (float("nan"), float("nan"))
        return f"[{lo:.3f}, {hi:.3f}]"

    for name, (agree, p50, engine, path) in checks.items():
        a = ov["arms"][name]
        print(
            f"{name:<12} {a['tokens_per_second']:7.2f} {a['vs_target']:9.3f} {ci(name, 'vs_target'):>13} "
            f"{a['vs_best_fixed']:13.3f} {ci(name, 'vs_best_fixed'):>13} {a['vs_fixed4']:9.3f} "
            f"{a['vs_oracle']:9.3f} {a['mean_gamma']:11.2f} {agree:8.2%} {p50:7.1f} {engine:>11}  {path}"
        )
    ref = ov["arms"]
    print(
        f"(held-out prompts only: {result['rows']} steps of {result['prompts']} prompts; policies pay "
        f"{args.decision_draft_tokens} probe draft token(s) before deciding, references pay only what they run: "
        f"target alone {ref['fixed-0']['tokens_per_second']:.2f} {result['unit']}, best fixed gamma in hindsight "
        f"= {ov['best_fixed'].split('-')[1]} ({ref[ov['best_fixed']]['tokens_per_second']:.2f}), oracle "
        f"{ref['oracle']['tokens_per_second']:.2f} = per-step best gamma knowing the outcome; CIs: paired "
        f"bootstrap over prompts, {args.bootstrap} resamples; same figures as speckv-eval)"
    )
    return int(status)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
