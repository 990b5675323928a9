"""Which signal carries the decision: a per-feature ablation of a policy family, offline.

Usage:
    python benchmarks/ablation.py [--log datasets/smollm2/steps.parquet] [--feature-set pre|gated]
        [--policy gbt] [--bootstrap 2000]

Trains the family on the log's training prompts with every feature, then once per
feature with that column held constant (its training mean, in training and at
decision time alike, so the model cannot use it), and evaluates every variant with
``speckv-eval``'s evaluator on the held-out prompts in one call (the same rows, the
same bootstrap resamples): tokens/s against the target alone with a paired
bootstrap 95% CI over prompts, and the fraction of the oracle in hindsight. The
cost model is fitted from the log (``CostModel.fit``), as ``speckv-export`` does.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--feature-set", default="pre", choices=["pre", "gated", "online"])
    ap.add_argument("--policy", default="gbt", choices=["gbt", "mlp", "table"])
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument(
        "--together",
        action="append",
        default=[],
        metavar="A,B",
        help="also a variant without these columns at once (repeatable), e.g. target_confidence,target_entropy",
    )
    args = ap.parse_args(argv)

    from speckv_policy.evaluation import evaluate_log
    from speckv_policy.logs import read_log
    from speckv_policy.objective import CostModel
    from speckv_policy.policies import training_data
    from speckv_policy.schema import get_feature_set
    from speckv_policy.training import batch_chooser, make_policy

    t0 = time.perf_counter()
    log = read_log(args.log)
    fs = get_feature_set(args.feature_set)
    probe = 0 if fs.name == "pre" else 1
    cm = CostModel.fit(log, decision_draft_tokens=probe)
    X, y = training_data(log, fs.name, split="train")
    variants: dict[str, list[str]] = {"all features": [], **{f"without {n}": [n] for n in fs.names}}
    for group in args.together:
        cols = [c.strip() for c in group.split(",") if c.strip()]
        unknown = [c for c in cols if c not in fs.names]
        if unknown:
            ap.error(f"--together: {', '.join(unknown)} not in the '{fs.name}' features ({', '.join(fs.names)})")
        variants[f"without {' + '.join(cols)}"] = cols
    policies = {}
    for label, dropped in variants.items():
        Xt = X.copy()
        values = {c: float(X[c].mean()) for c in dropped}
        for c, v in values.items():
            Xt[c] = v
        policy = make_policy(args.policy, feature_set=fs.name, cost_model=cm).fit(Xt, y)
        choose = batch_chooser(policy)

        def blanked(Xe, choose=choose, values=values):
            if values:
                Xe = Xe.copy()
                for c, v in values.items():
                    Xe[c] = v
            return choose(Xe)

        policies[label] = (fs.name, blanked)
        print(f"trained {label} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    res, es = evaluate_log(log, policies, policy_cost=cm, n_resamples=args.bootstrap)
    ov, boot = res["groups"]["overall"], res["bootstrap"]["overall"]
    full = ov["arms"]["all features"]["tokens_per_second"]
    print(
        f"{args.policy} on the '{fs.name}' features, {res['rows']} held-out steps of {res['prompts']} prompts "
        f"({args.log}); cost model fitted from the log; {args.bootstrap} paired bootstrap resamples over prompts; "
        f"{time.perf_counter() - t0:.0f} s\n"
    )
    print("| variant | tokens/s | x target alone [95% CI] | x oracle | vs all features |")
    print("|---|---:|---:|---:|---:|")
    for label in variants:
        a = ov["arms"][label]
        ci = boot[label]["vs_target"]["ci"]
        print(
            f"| {label} | {a['tokens_per_second']:.2f} | {a['vs_target']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | "
            f"{a['vs_oracle']:.3f} | {a['tokens_per_second'] / full:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
