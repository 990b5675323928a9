"""``speckv-export``: export a policy to ONNX, or re-price an export for another machine.

Examples
--------
speckv-export model.onnx                       # the default: GBT trained on the shipped SmolLM2 profile
speckv-export model.onnx --train datasets/synthetic/steps.parquet --policy gbt
speckv-export model.onnx --policy saved.joblib
speckv-export --reprice costs.json model.onnx model-here.onnx   # costs from speckv-calibrate
speckv-export --stop-rule stop.json            # a cost-aware stop rule (attach(..., mode="stop")), JSON
speckv-export --reprice costs.json stop.json stop-here.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from ..policies import POLICIES
from .common import exit_cleanly_on_sigterm, fail, int_at_least, warn_if_one_gamma

if TYPE_CHECKING:  # pragma: no cover
    from ..objective import CostModel

DEFAULT_LOG = "datasets/smollm2/steps.parquet"
DEFAULT_KIND = "gbt"


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
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="OUTPUT.onnx to write (atomically); with --reprice: INPUT.onnx OUTPUT.onnx",
    )
    p.add_argument(
        "--policy",
        help=f"a joblib file of a fitted policy, or with --train the kind to train: {', '.join(POLICIES)} "
        f"(default: {DEFAULT_KIND} trained on {DEFAULT_LOG})",
    )
    p.add_argument(
        "--train",
        metavar="LOG",
        help=f"step log (.parquet or .csv) to train on, its 'train' split (default with no --policy: {DEFAULT_LOG})",
    )
    p.add_argument(
        "--reprice",
        metavar="COSTS_JSON",
        help="re-price INPUT.onnx with this cost model (from speckv-calibrate) and write OUTPUT.onnx; "
        "the acceptance model is kept, only the step-time prices change",
    )
    p.add_argument(
        "--allow-one-gamma",
        action="store_true",
        help="with --reprice: write the output even when it drafts one gamma on every checked row where the input "
        "did not (refused by default: usually a broken cost file)",
    )
    p.add_argument(
        "--feature-set",
        choices=["online", "paper", "pre", "gated"],
        help="default: online (paper for paper-mlp16); pre: decided before drafting (with --decision-draft-tokens 0); "
        "gated: a pre-draft gate and an after-probe length head of the --policy family in one file "
        "(attach(..., mode='gated'); the gate is priced without the probe, the head with it)",
    )
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
        default=None,
        help="draft tokens paid before the decision: 1 for the hook's upfront mode (the default when training the "
        "default policy), else 0",
    )
    p.add_argument(
        "--history-rounds",
        type=int_at_least(0),
        default=0,
        help="with --train: also train on the history the policy itself writes, replaying the training runs with "
        "its own choices this many times (DAgger-style; default 0: the profile's logged history only)",
    )
    p.add_argument(
        "--stop-rule",
        action="store_true",
        help=f"write a cost-aware stop rule (JSON) for attach(..., mode='stop') instead of an ONNX policy: per-token "
        f"acceptance curves fitted on --train LOG's 'train' split (default {DEFAULT_LOG}), priced by its cost model",
    )
    p.add_argument(
        "--token-value",
        type=float,
        default=1.0,
        help="with --stop-rule: what a kept token is worth, in plain target steps (default 1.0)",
    )
    p.add_argument(
        "--gate",
        action="store_true",
        help="with --stop-rule: also fit a pre-draft gate per compression and decoding, which keeps a step plain "
        "(no probe token) where drafting does not pay in expectation under the rule's prices (docs/design.md: on the "
        "shipped profile it gains at most 1%%, so it is off by default)",
    )
    p.add_argument(
        "--costs",
        metavar="COSTS_JSON",
        help="with --stop-rule: price the rule, and fit its gate, with this cost model (speckv-calibrate's JSON for the "
        "machine it will run on) instead of the one fitted from the log's timings",
    )
    p.add_argument("--device", help="device whose timings to fit when the log has several")
    p.add_argument("--save-policy", metavar="JOBLIB", help="also save the fitted Python policy")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow --policy to load a joblib file: a pickle, which runs any code it carries (only files you trust)",
    )
    return p


def _reprice(args: argparse.Namespace) -> int:
    from ..atomic import readable_file
    from ..objective import CostModel
    from ..stop import StopRule

    if len(args.paths) != 2:
        print(
            "speckv-export: error: --reprice takes INPUT.onnx OUTPUT.onnx (or a stop rule's INPUT.json OUTPUT.json)",
            file=sys.stderr,
        )
        return 2
    src, dst = args.paths
    rule = src.lower().endswith(".json")  # a stop rule: the same curves, new prices
    if rule != dst.lower().endswith(".json") or (not rule and not dst.lower().endswith(".onnx")):
        kind = "a stop rule's JSON: name OUTPUT .json" if rule else "an ONNX export: name OUTPUT .onnx"
        print(f"speckv-export: error: --reprice of {src} writes {kind}, got {dst}", file=sys.stderr)
        return 2
    try:
        cm = CostModel.load(args.reprice)
        readable_file(src, "stop rule" if rule else "export")
        if rule:
            StopRule.load(src).reprice(cm).save(dst)
            summary = ""
        else:
            summary = _reprice_onnx_checked(src, dst, cm, args.allow_one_gamma)
    except (ValueError, OSError) as exc:
        return fail("speckv-export", exc)
    what = "the stop rule " if rule else ""
    on = f", measured on {cm.machine}" if cm.machine else ""
    print(f"re-priced {what}{src} -> {dst} with the cost model in {args.reprice} ({cm.unit}, device {cm.device}{on}):")
    for line in cm.describe():
        print(f"  {line}")
    if summary:
        print(f"  {summary}")
    return 0


def _reprice_onnx_checked(src: str, dst: str, cm: CostModel, allow_one_gamma: bool) -> str:
    """Re-price the export ``src`` into ``dst`` only if the result loads, runs and decides; returns a summary line.

    The input must load in the runtime (a malformed export is refused, not re-priced); the output is written to a
    temporary, loaded and run on :func:`~speckv_policy.features.spanning_rows` under the runtime's contract, and it
    replaces ``dst`` only then. An output that drafts one gamma on every row where the input did not is refused
    unless ``allow_one_gamma``.
    """
    import onnx

    from ..atomic import atomic_write
    from ..export import reprice_onnx
    from ..features import spanning_rows
    from ..runtime import PolicyLoadError, RuntimePolicy

    try:
        before_rt = RuntimePolicy(src)
    except PolicyLoadError as exc:
        raise ValueError(f"cannot re-price: {exc}") from None
    rows = spanning_rows(before_rt.feature_set)  # type: ignore[arg-type]

    def decisions(rt: RuntimePolicy) -> np.ndarray:
        return rt.decide_gated_batch(rows)[0] if rt.gated else rt.decide_batch(rows)

    before = decisions(before_rt)
    try:
        model = onnx.load(src)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ValueError(f"{src}: not a readable ONNX file ({exc})") from None
    data = reprice_onnx(model, cm).SerializeToString()
    after: dict[str, np.ndarray] = {}

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
        try:
            after["gamma"] = decisions(RuntimePolicy(tmp))
        except (PolicyLoadError, ValueError) as exc:
            raise ValueError(f"the re-priced export does not run ({exc}); {dst} was not written") from None
        one = np.unique(after["gamma"])
        if len(one) == 1 and len(np.unique(before)) > 1 and not allow_one_gamma:
            raise ValueError(
                f"re-priced under these costs the export drafts gamma {one[0]} on every one of {len(rows)} spanning "
                f"feature rows (before: gammas {np.unique(before).tolist()}); {dst} was not written. Check the cost "
                "file; if one gamma is what these costs mean, pass --allow-one-gamma"
            )

    atomic_write(dst, write)
    g = after["gamma"]
    shares = ", ".join(f"{int(v)}: {np.mean(g == v):.0%}" for v in np.unique(g))
    return f"checked: loads and decides on {len(rows)} spanning feature rows; gammas {shares}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_cleanly_on_sigterm()
    if (args.gate or args.costs) and not args.stop_rule:
        print("speckv-export: error: --gate and --costs go with --stop-rule", file=sys.stderr)
        return 2
    if args.reprice:
        return _reprice(args)
    if args.stop_rule:
        return _stop_rule(args)
    if len(args.paths) != 1:
        print(
            "speckv-export: error: give one OUTPUT.onnx (or --reprice COSTS_JSON INPUT.onnx OUTPUT.onnx)",
            file=sys.stderr,
        )
        return 2
    args.output = args.paths[0]
    default = args.policy is None
    if default:
        args.policy = DEFAULT_KIND
        args.train = args.train or DEFAULT_LOG
        if args.decision_draft_tokens is None:
            args.decision_draft_tokens = 1  # the hook's default upfront mode reads one draft token first
    if args.decision_draft_tokens is None:
        args.decision_draft_tokens = 0
    if args.history_rounds and not args.train:
        print("speckv-export: error: --history-rounds trains on a log: add --train LOG", file=sys.stderr)
        return 2
    from ..export import export_onnx
    from ..logs import LogValidationError, read_log
    from ..objective import CostModel
    from ..runtime import RuntimePolicy
    from ..training import batch_chooser, fit_from_log, load_saved_policy, make_policy, save_policy

    t0 = time.perf_counter()
    log = None
    try:
        if args.train:
            if default and args.train == DEFAULT_LOG and not os.path.exists(DEFAULT_LOG):
                raise FileNotFoundError(
                    f"the default training log {DEFAULT_LOG} is not here: run from the speckv-policy repository "
                    "or pass --train LOG --policy KIND"
                )
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
            fit_from_log(policy, log, split="train", history_rounds=args.history_rounds)
        else:
            if args.policy in POLICIES:
                print(
                    f"speckv-export: --policy {args.policy} names a policy kind; add --train LOG to train it, "
                    "or pass a joblib file of a fitted policy",
                    file=sys.stderr,
                )
                return 2
            policy = load_saved_policy(args.policy, trusted=args.trust_pickle)
        model = export_onnx(policy, args.output)
        if args.save_policy:
            save_policy(policy, args.save_policy)
    except (LogValidationError, ValueError, OSError) as exc:
        return fail("speckv-export", exc)
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
    if log is not None:
        n_train = int((log["split"] == "train").sum())
        print(
            f"  trained on {args.train}: {n_train} steps of its 'train' split "
            f"({log.loc[log['split'] == 'train', 'prompt_id'].nunique()} prompts)"
        )
    paid = (
        "the gate pays no draft token before deciding, the length head the probe"
        if rt.gated
        else f"{cm.decision_draft_tokens} draft token(s) paid before deciding"
    )
    on = f", measured on {cm.machine}" if cm.machine else ""
    print(f"  priced with the cost model of device {cm.device}{on} ({cm.unit}; per compression code; {paid}):")
    for line in cm.describe():
        print(f"    {line}")
    if log is not None and (log["split"] == "heldout").any():
        try:
            from ..evaluation import evaluate_log
            from ..policies import training_data

            result, _ = evaluate_log(
                log,
                {"policy": (policy.feature_set_, batch_chooser(policy))},
                policy_cost=cm,
                max_gamma=max(8, policy.max_gamma_),
                n_resamples=1,
            )
            ov = result["groups"]["overall"]
            a = ov["arms"]["policy"]
            X, _ = training_data(log, policy.feature_set_, split="heldout")
            chosen = policy.predict(X)
            onnx_chosen = rt.decide_gated_batch(X)[0] if rt.gated else rt.decide_batch(X)
            agree = float(np.mean(onnx_chosen == chosen))
            if len(policy.candidates_) > 1:
                warn_if_one_gamma(type(policy).__name__, chosen, "speckv-export")
            print(
                f"  held-out ({result['rows']} steps): {a['tokens_per_second']:.2f} {result['unit']}, "
                f"{a['vs_target']:.3f}x the target alone, {a['vs_fixed4']:.3f}x fixed-4, {a['vs_best_fixed']:.3f}x "
                f"the best fixed gamma ({ov['best_fixed'].split('-')[1]}), {a['vs_oracle']:.3f}x the oracle in "
                f"hindsight (speckv-eval's pricing); ONNX = Python on {agree:.2%} of rows"
            )
        except ValueError as exc:
            print(f"  held-out evaluation skipped: {exc}")
    if rt.repriceable:
        print(
            "  costs differ from machine to machine: price it for the one that runs it with\n"
            f"    speckv-calibrate --out costs.json && speckv-export --reprice costs.json {args.output} "
            f"{os.path.splitext(args.output)[0]}-here.onnx"
        )
    print(f"  done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())


def _stop_rule(args: argparse.Namespace) -> int:
    """``--stop-rule``: fit, write (atomically) and describe a cost-aware stop rule."""
    from ..logs import LogValidationError, read_log
    from ..objective import CostModel
    from ..training import fit_stop_rule, stop_rule_rows

    if len(args.paths) != 1:
        print("speckv-export: error: --stop-rule writes one OUTPUT.json", file=sys.stderr)
        return 2
    out = args.paths[0]
    if args.policy is not None:
        print("speckv-export: error: --stop-rule trains its own curves; drop --policy", file=sys.stderr)
        return 2
    if not (np.isfinite(args.token_value) and args.token_value > 0):
        print(f"speckv-export: error: --token-value must be > 0, got {args.token_value}", file=sys.stderr)
        return 2
    train = args.train or DEFAULT_LOG
    try:
        if not os.path.exists(train):
            raise FileNotFoundError(f"step log not found: {train}")
        log = read_log(train)
        if args.costs:
            cm = CostModel.load(args.costs)
        else:
            cm = CostModel.fit(log, device=args.device) if args.cost_model == "fit" else CostModel.relative()
        rule = fit_stop_rule(log, cm, token_value=args.token_value, gate=args.gate, source=train)
        rule.save(out)
    except (LogValidationError, ValueError, OSError) as exc:
        return fail("speckv-export", exc)
    print(f"wrote a cost-aware stop rule -> {out} (attach(..., mode='stop'))")
    print(f"  trained on {train}'s 'train' split; a kept token is worth {rule.token_value:g} plain target step(s)")
    held = stop_rule_rows(log, "heldout") if (log["split"] == "heldout").any() else {}
    for (comp, dec), (now, _) in sorted(rule.curves.items()):
        line = f"  {comp}/{dec}: fitted on {now.rows} draft tokens"
        if (comp, dec) in held and len(held[(comp, dec)][1]):
            X, y = held[(comp, dec)][0], held[(comp, dec)][1]
            p = np.array([now(x) for x in X.tolist()])
            line += (
                f"; held-out {len(y)} tokens: accepted {y.mean():.3f}, predicted {p.mean():.3f}, "
                f"log loss {-np.mean(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)):.3f}"
            )
        print(line)
    for (comp, dec), gate in sorted(rule.gates.items()):
        print(f"  {comp}/{dec}: pre-draft gate fitted on {gate.rows} steps")
    where = args.costs or f"the cost model of device {cm.device}"
    print(f"  priced with {where} ({cm.unit}); re-price: speckv-export --reprice COSTS {out} OUT.json")
    if rule.gates:
        print("  (re-pricing keeps the gate as fitted; to fit it for other prices: --stop-rule --costs COSTS)")
    return 0
