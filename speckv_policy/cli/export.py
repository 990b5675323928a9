"""``speckv-export``: export a saved policy, or train one from a log and export it.

Examples
--------
speckv-export model.onnx --policy saved.joblib
speckv-export model.onnx --train datasets/synthetic/steps.parquet --policy gbt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ..policies import POLICIES


def _candidates(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"candidates must be comma-separated ints like 0,1,2,4,8; got {text!r}"
        ) from None
    if not vals:
        raise argparse.ArgumentTypeError("candidates must not be empty")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="speckv-export",
        description="Export a gamma policy to ONNX (optionally training it from a step log first).",
    )
    p.add_argument("output", help="path of the .onnx file to write (written atomically)")
    p.add_argument(
        "--policy",
        required=True,
        help="a joblib file of a fitted policy; with --train, the kind to train: " + ", ".join(POLICIES),
    )
    p.add_argument("--train", metavar="LOG", help="step log (.parquet or .csv) to train on (its 'train' split)")
    p.add_argument("--feature-set", choices=["online", "paper"], help="default: online (paper for paper-mlp16)")
    p.add_argument(
        "--objective",
        choices=["tokens_per_second", "tokens_per_step"],
        help="default: tokens_per_second (tokens_per_step for paper-mlp16)",
    )
    p.add_argument("--candidates", type=_candidates, help="candidate gammas, e.g. 0,1,2,3,4,5,6,7,8")
    p.add_argument("--gamma", type=int, default=4, help="gamma of the 'fixed' policy (default 4)")
    p.add_argument(
        "--cost-model",
        choices=["fit", "relative"],
        default="fit",
        help="fit draft/verify costs from the log's timings (default) or use the relative default",
    )
    p.add_argument(
        "--decision-draft-tokens",
        type=int,
        choices=[0, 1],
        default=0,
        help="draft tokens paid before the decision (1 for the hook's upfront mode)",
    )
    p.add_argument("--device", help="device whose timings to fit when the log has several")
    p.add_argument("--save-policy", metavar="JOBLIB", help="also save the fitted Python policy")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..export import export_onnx
    from ..logs import LogValidationError, read_log
    from ..objective import CostModel
    from ..runtime import RuntimePolicy
    from ..training import fit_from_log, load_saved_policy, make_policy, save_policy

    t0 = time.perf_counter()
    log = None
    try:
        if args.train:
            log = read_log(args.train)
            cm = (
                CostModel.fit(log, device=args.device, decision_draft_tokens=args.decision_draft_tokens)
                if args.cost_model == "fit"
                else CostModel.relative(decision_draft_tokens=args.decision_draft_tokens)
            )
            policy = make_policy(
                args.policy,
                objective=args.objective,
                candidates=args.candidates,
                cost_model=cm,
                feature_set=args.feature_set,
                gamma=args.gamma,
            )
            fit_from_log(policy, log, split="train")
        else:
            if args.policy in POLICIES:
                print(
                    f"speckv-export: --policy {args.policy} names a policy kind; add --train LOG to train it, "
                    "or pass a joblib file of a fitted policy",
                    file=sys.stderr,
                )
                return 2
            policy = load_saved_policy(args.policy)
        model = export_onnx(policy, args.output)
        if args.save_policy:
            save_policy(policy, args.save_policy)
    except (LogValidationError, ValueError, FileNotFoundError) as exc:
        print(f"speckv-export: error: {exc}", file=sys.stderr)
        return 2
    rt = RuntimePolicy(args.output)
    cm = policy.cost_model_
    print(
        f"exported {type(policy).__name__} -> {args.output} ({os.path.getsize(args.output) / 1024:.1f} KiB, "
        f"{len(model.graph.node)} ONNX nodes)"
    )
    print(f"  feature set {policy.feature_set_} ({', '.join(rt.feature_set.names)})")
    print(
        f"  candidates {policy.candidates_.tolist()}, objective {policy.objective}, "
        f"training rows {policy.n_training_rows_}, fingerprint {policy.training_fingerprint_}"
    )
    print(
        f"  cost model ({cm.unit}, device {cm.device}): draft/token {np.round(cm.draft_ms_per_token, 2).tolist()}, "
        f"verify base {np.round(cm.verify_base_ms, 2).tolist()}, verify/token {np.round(cm.verify_ms_per_token, 2).tolist()}"
    )
    if log is not None and (log["split"] == "heldout").any():
        try:
            from ..evaluation import evaluate_log
            from ..policies import training_data

            result, _ = evaluate_log(
                log,
                {"policy": (policy.feature_set_, policy.predict)},
                policy_cost=cm,
                max_gamma=max(8, policy.max_gamma_),
                n_resamples=1,
            )
            ov = result["groups"]["overall"]
            a = ov["arms"]["policy"]
            X, _ = training_data(log, policy.feature_set_, split="heldout")
            agree = float(np.mean(rt.decide_batch(X) == policy.predict(X)))
            print(
                f"  held-out ({result['rows']} steps): {a['tokens_per_second']:.2f} {result['unit']}, "
                f"{a['vs_target']:.3f}x the target alone, {a['vs_fixed4']:.3f}x fixed-4, {a['vs_best_fixed']:.3f}x "
                f"the best fixed gamma ({ov['best_fixed'].split('-')[1]}), {a['vs_oracle']:.3f}x the oracle in "
                f"hindsight (speckv-eval's pricing); ONNX = Python on {agree:.2%} of rows"
            )
        except ValueError as exc:
            print(f"  held-out evaluation skipped: {exc}")
    print(f"  done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
