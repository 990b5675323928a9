"""``speckv-eval``: offline counterfactual evaluation of policies on a step log's held-out prompts.

Writes ``eval.md`` (tables with paired-bootstrap CIs), ``eval.json`` (every figure) and three
PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .common import exit_cleanly_on_sigterm, fail, int_at_least

DEFAULT_LOG = "datasets/smollm2/steps.parquet"
DEFAULT_POLICIES = "exported/smollm2-*.onnx"


def load_for_eval(
    path: str, *, trust_pickle: bool = False, cost_model: Any = None
) -> tuple[str, Callable[[Any], np.ndarray]]:
    """(feature set name, batch choose function) of an ONNX export or a joblib-saved policy (if trusted).

    ``cost_model`` re-prices it (tokens-per-second policies; others decide as they are).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"policy not found: {path}")
    if p.suffix == ".onnx":
        from ..runtime import RuntimePolicy

        rt = RuntimePolicy(p)
        if cost_model is not None and rt.repriceable:
            rt.reprice(cost_model)
        return rt.feature_set.name, rt.decide_gated_batch if rt.gated else rt.decide_batch  # type: ignore[union-attr]
    from ..training import batch_chooser, load_saved_policy, with_cost_model

    pol = load_saved_policy(p, trusted=trust_pickle)
    if cost_model is not None and pol.objective == "tokens_per_second":
        pol = with_cost_model(pol, cost_model)
    return pol.feature_set, batch_chooser(pol)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speckv-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default=DEFAULT_LOG, help=f"step log (default {DEFAULT_LOG})")
    ap.add_argument(
        "--policy",
        nargs="+",
        default=None,
        help=f".onnx exports or joblib-saved policies (default {DEFAULT_POLICIES}); globs allowed",
    )
    ap.add_argument("--out", default="docs/eval", help="output folder (default docs/eval)")
    ap.add_argument("--bootstrap", type=int_at_least(1), default=10_000, help="bootstrap resamples (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-gamma", type=int_at_least(1), default=8, help="outcomes known up to this gamma (default 8)")
    ap.add_argument(
        "--decision-draft-tokens",
        type=int,
        choices=[0, 1],
        default=1,
        help="draft tokens a policy pays before deciding (1: the hook's upfront mode, default)",
    )
    ap.add_argument(
        "--history",
        choices=["policy", "logged"],
        default="policy",
        help="history features: each policy's own, replayed over the held-out runs (default), or the profile's "
        "logged ones",
    )
    ap.add_argument(
        "--costs",
        default=None,
        metavar="JSON",
        help="price every strategy with this calibration (speckv-calibrate --out) instead of the log's own timings; "
        "exports are re-priced with it",
    )
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow joblib-saved policies: pickles, which run any code they carry (only files you trust)",
    )
    args = ap.parse_args(argv)
    exit_cleanly_on_sigterm()

    from ..atomic import atomic_write_text
    from ..evaluation import evaluate_log
    from ..evaluation.report import markdown, plots
    from ..logs import LogValidationError, read_log
    from ..objective import CostModel

    specs = args.policy or [DEFAULT_POLICIES]
    paths: list[str] = []
    for s in specs:
        hits = sorted(glob.glob(s)) if any(ch in s for ch in "*?[") else [s]
        if not hits:
            print(f"speckv-eval: error: no policy matches {s!r}", file=sys.stderr)
            return 2
        paths += hits
    try:
        log = read_log(args.log)
        policies = {}
        if args.costs:
            cost = replace(CostModel.load(args.costs), decision_draft_tokens=args.decision_draft_tokens)
        else:
            cost = CostModel.fit(log, decision_draft_tokens=args.decision_draft_tokens)
        for path in paths:
            name = Path(path).stem
            if name in policies:
                raise ValueError(f"two policies are named {name!r}; rename one file")
            policies[name] = load_for_eval(
                path, trust_pickle=args.trust_pickle, cost_model=cost if args.costs else None
            )
        result, es = evaluate_log(
            log,
            policies,
            policy_cost=cost,
            max_gamma=args.max_gamma,
            n_resamples=args.bootstrap,
            seed=args.seed,
            history=args.history,
        )
    except (LogValidationError, FileNotFoundError, ValueError) as exc:
        print(f"speckv-eval: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a policy that cannot be loaded (PolicyLoadError) or run
        print(f"speckv-eval: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    result["log"] = args.log
    result["policies"] = {Path(p).stem: p for p in paths}
    result["cost_model"] = cost.to_dict()
    if args.costs:
        result["costs_note"] = f"the calibration `{args.costs}` (exports re-priced with it)"
    out = Path(args.out)
    command = "speckv-eval " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    md = markdown(result, command=command.strip(), log=args.log)
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--out {out} is a file; give a folder for the report")
        out.mkdir(parents=True, exist_ok=True)
        if not args.no_plots:
            written = plots(result, es, out)
            md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in written) + "\n"
        atomic_write_text(out / "eval.json", json.dumps(result, indent=1))
        atomic_write_text(out / "eval.md", md)
    except (OSError, ValueError) as exc:
        return fail("speckv-eval", exc)
    ov = result["groups"]["overall"]
    print(
        f"{result['rows']} held-out steps, {result['prompts']} prompts; best fixed gamma "
        f"{ov['best_fixed'].split('-')[1]}"
    )
    boot = result.get("bootstrap", {}).get("overall", {})

    def ci(name: str, key: str) -> str:
        b = boot.get(name, {}).get(key)
        return f"[{b['ci'][0]:.3f}, {b['ci'][1]:.3f}]" if b else "[no CI: < 2 prompts]"

    for name in policies:
        a = ov["arms"][name]
        print(
            f"{name:<22} {a['tokens_per_second']:8.2f} {result['unit']}  x target {a['vs_target']:.3f} "
            f"{ci(name, 'vs_target')}  x best fixed {a['vs_best_fixed']:.3f} {ci(name, 'vs_best_fixed')}  "
            f"x fixed4 {a['vs_fixed4']:.3f} {ci(name, 'vs_fixed4')}  x oracle {a['vs_oracle']:.3f}"
        )
    print(f"wrote {out / 'eval.md'}, {out / 'eval.json'}" + ("" if args.no_plots else " and 3 plots"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
