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


def _decide_with(path: str, cost: Any) -> tuple[str, Callable[[Any], np.ndarray]] | str:
    """An export's (feature set, batch choose function) re-priced with ``cost`` for ``--decide-costs``, loaded once;
    or why it cannot be paired with itself under other prices."""
    if Path(path).suffix != ".onnx":
        return "it is not an ONNX export (pairs are exports re-priced at load)"
    from ..runtime import RuntimePolicy

    rt = RuntimePolicy(path)
    if not rt.repriceable:
        return f"it maximises {rt.metadata.get('speckv.objective')}, so prices do not change its decisions"
    rt.reprice(cost)
    return rt.feature_set.name, rt.decide_gated_batch if rt.gated else rt.decide_batch  # type: ignore[union-attr]


def select_rows(log: Any, where: str, **columns: str | None) -> Any:
    """The rows of ``log`` whose ``column`` is one of the comma-separated values given for it (None: every row).

    Raises ValueError naming the log, the column and the values it holds when a value matches no row.
    """
    for column, wanted in columns.items():
        if wanted is None:
            continue
        values = [v.strip() for v in wanted.split(",") if v.strip()]
        held = sorted(set(log[column].astype(str)))
        missing = [v for v in values if v not in held]
        if missing or not values:
            raise ValueError(
                f"{where}: no {column} {', '.join(missing) or repr(wanted)} in the log (it has {', '.join(held)})"
            )
        log = log[log[column].astype(str).isin(values)]
    return log


def unmeasured_levels(cost: Any, levels: set[str]) -> list[str]:
    """Which of ``levels`` (compression names) a calibration timed no step of (``n_rows`` 0): its prices there are
    another level's copies. Named by code, aliases joined (``fp16/bf16/fp32``)."""
    from ..schema import COMPRESSION_CODES

    names: dict[int, list[str]] = {}
    for name, code in COMPRESSION_CODES.items():
        names.setdefault(code, []).append(name)
    return [
        "/".join(n)
        for code, n in sorted(names.items())
        if cost.n_rows and not cost.n_rows.get(code, 0) and levels & set(n)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="speckv-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default=DEFAULT_LOG, help=f"step log (default {DEFAULT_LOG})")
    ap.add_argument(
        "--policy",
        nargs="+",
        default=None,
        help=f".onnx exports or joblib-saved policies (default {DEFAULT_POLICIES}); globs allowed",
    )
    ap.add_argument("--out", default="out/eval", help="output folder (default out/eval)")
    ap.add_argument("--bootstrap", type=int_at_least(1), default=10_000, help="bootstrap resamples (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples (default 0)")
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
    ap.add_argument(
        "--decide-costs",
        default=None,
        metavar="JSON",
        help="also run every export re-priced with this calibration (e.g. the one it shipped with) as NAME@STEM, "
        "priced like the rest: what deciding with stale prices costs against deciding with --costs (or the "
        "log's own timings), as a paired ratio with its CI and the share of steps decided alike",
    )
    ap.add_argument(
        "--compressions",
        default=None,
        metavar="LEVELS",
        help="evaluate only these compression levels of the log (comma-separated, e.g. nf4; default all)",
    )
    ap.add_argument(
        "--decodings",
        default=None,
        metavar="DECODINGS",
        help="evaluate only these decodings of the log (comma-separated: greedy, sampling; default both)",
    )
    ap.add_argument("--no-plots", action="store_true", help="write eval.md and eval.json only, no PNG plots")
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
        log = select_rows(read_log(args.log), args.log, compression=args.compressions, decoding=args.decodings)
        policies = {}
        if args.costs:
            cost = replace(CostModel.load(args.costs), decision_draft_tokens=args.decision_draft_tokens)
        else:
            cost = CostModel.fit(log, decision_draft_tokens=args.decision_draft_tokens)
        stale = CostModel.load(args.decide_costs) if args.decide_costs else None
        pairs: dict[str, str] = {}
        for path in paths:
            name = Path(path).stem
            if name in policies:
                raise ValueError(f"two policies are named {name!r}; rename one file")
            policies[name] = load_for_eval(
                path, trust_pickle=args.trust_pickle, cost_model=cost if args.costs else None
            )
            if stale is not None:
                stale_policy = _decide_with(path, stale)
                if isinstance(stale_policy, str):
                    print(f"note: --decide-costs leaves {name} alone: {stale_policy}", file=sys.stderr)
                    continue
                pairs[f"{name}@{Path(args.decide_costs).stem}"] = name
                policies[f"{name}@{Path(args.decide_costs).stem}"] = stale_policy
        result, es = evaluate_log(
            log,
            policies,
            policy_cost=cost,
            max_gamma=args.max_gamma,
            n_resamples=args.bootstrap,
            seed=args.seed,
            history=args.history,
            pairs=pairs,
        )
    except (LogValidationError, FileNotFoundError, ValueError) as exc:
        print(f"speckv-eval: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a policy that cannot be loaded (PolicyLoadError) or run
        print(f"speckv-eval: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    result["log"] = args.log
    selected = {k: v for k, v in (("compressions", args.compressions), ("decodings", args.decodings)) if v}
    if selected:
        result["selected"] = selected
    result["policies"] = {Path(p).stem: p for p in paths}
    result["cost_model"] = cost.to_dict()
    if args.costs:
        result["costs_note"] = f"the calibration `{args.costs}` (exports re-priced with it)"
    if args.decide_costs:
        result["decide_costs"] = args.decide_costs
        result["unmeasured_levels"] = {
            path: levels
            for path, cm in ((args.costs, cost if args.costs else None), (args.decide_costs, stale))
            if cm is not None and (levels := unmeasured_levels(cm, set(log["compression"])))
        }
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
    for path, levels in result.get("unmeasured_levels", {}).items():
        print(f"note: {path} timed no step at {', '.join(levels)}: its prices there are copies of another level's")
    for name, pair in result["pairs"].items():
        v = boot.get(name, {}).get("vs_pair")
        same = pair["same_choice"]["overall"]
        rel = f"x {v['ratio']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]" if v else "(no CI: < 2 prompts)"
        print(
            f"{name} (decides with {args.decide_costs}): {rel} {pair['reference']}; same gamma on {same:.1%} of steps"
        )
    print(f"wrote {out / 'eval.md'}, {out / 'eval.json'}" + ("" if args.no_plots else " and 3 plots"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
