"""End-to-end wall-clock race: every draft-length strategy inside real Hugging Face generation.

    .venv/bin/python benchmarks/e2e.py                      # real pair, held-out prompts (CPU: ~40 min)
    .venv/bin/python benchmarks/e2e.py --per-task 1 --repeats 1 --max-new-tokens 16   # a quick look

The arms, the summary and the goals are described in :mod:`speckv_policy.evaluation.race`;
the runner is :func:`speckv_policy.hf.race.run_race`. Writes JSON, a plot, and the e2e section
of docs/benchmarks.md; exits 1 when a greedy output differs unexplained.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from speckv_policy.atomic import atomic_write_text
from speckv_policy.cli.common import (
    add_draft_linear_argument,
    add_draft_precision_argument,
    add_target_linear_argument,
    int_at_least,
)
from speckv_policy.evaluation.race import goals, make_arms, markdown, plot, summarize_runs, unexplained, write_section


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    ap.add_argument("--prompts", default="datasets/prompts/prompts.jsonl")
    ap.add_argument("--per-task", type=int_at_least(1), default=3, help="held-out prompts per task type (default 3)")
    ap.add_argument("--compressions", default="fp32,int8,nf4")
    ap.add_argument("--decodings", default="greedy,sampling")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    ap.add_argument("--repeats", type=int_at_least(1), default=1)
    ap.add_argument("--arms", default=None, help="comma-separated subset of arms (target always runs)")
    ap.add_argument("--policy-dir", default="exported")
    ap.add_argument("--policy-prefix", default="smollm2-")
    ap.add_argument("--device", default="cpu")
    add_draft_precision_argument(ap)
    add_target_linear_argument(ap)
    add_draft_linear_argument(ap)
    ap.add_argument("--out", default="docs/e2e.json", help="raw runs and summary (JSON)")
    ap.add_argument("--plot", default="docs/e2e_speedup.png")
    ap.add_argument("--doc", default="docs/benchmarks.md", help="markdown file whose e2e section is rewritten")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--calibrate",
        type=float,
        default=90.0,
        metavar="SECONDS",
        help="first measure this machine's cost model with speckv-calibrate for SECONDS (default 90) "
        "and race the exports re-priced with it (*-repriced arms); 0 skips it",
    )
    ap.add_argument(
        "--costs",
        default=None,
        metavar="JSON",
        help="use this calibration (speckv-calibrate --out) instead of calibrating now",
    )
    ap.add_argument("--costs-out", default="docs/e2e_costs.json", help="where the race's calibration is written")
    ap.add_argument(
        "--peer-log",
        default="datasets/smollm2/steps.parquet",
        help="step log whose training split gives the vLLM-style arm its cold-start acceptance",
    )
    ap.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="no runs: recompute the summary, goals, plot and doc section from a saved --out JSON",
    )
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        result["summary"] = summarize_runs(result["runs"], result["arms"])
        result["goals"] = goals(result)
    else:
        from speckv_policy.hf.race import RaceConfig, run_race
        from speckv_policy.logs import read_log
        from speckv_policy.objective import CostModel
        from speckv_policy.prompts import read_prompts
        from speckv_policy.smollm2.models import SMOLLM2_MODELS

        held = [p for p in read_prompts(args.prompts) if p.split == "heldout"]
        picked = []
        for task in sorted({p.task_type for p in held}):
            picked += [p for p in held if p.task_type == task][: args.per_task]
        costs = args.costs
        calibration = None
        if costs is None and args.calibrate > 0:
            from speckv_policy.hf.calibrate import CalibrationConfig, calibrate

            cal = CalibrationConfig(
                target=args.target,
                draft=args.draft,
                compressions=_csv(args.compressions),
                seconds=args.calibrate,
                device=args.device,
                seed=args.seed,
                draft_precision=args.draft_precision,
                target_linear=args.target_linear,
                draft_linear=args.draft_linear,
            )
            train = [p for p in read_prompts(args.prompts) if p.split == "train"] or held
            cost, steps = calibrate(cal, train, models=SMOLLM2_MODELS)
            cost.save(args.costs_out)
            costs = args.costs_out
            calibration = {
                "file": args.costs_out,
                "seconds": args.calibrate,
                "steps": len(steps),
                "cost_model": cost.to_dict(),
                "describe": cost.describe(),
            }
            print(
                f"calibrated this machine ({len(steps)} steps) -> {args.costs_out}:\n  " + "\n  ".join(cost.describe())
            )
        peer_log = read_log(args.peer_log)
        peer_costs = CostModel.load(costs) if costs else CostModel.fit(peer_log)  # no probe: decided before drafting
        arms = make_arms(
            Path(args.policy_dir),
            args.policy_prefix,
            args.arms.split(",") if args.arms else None,
            costs=costs,
            peer_log=peer_log,
            peer_costs=replace(peer_costs, decision_draft_tokens=0),
        )
        cfg = RaceConfig(
            target=args.target,
            draft=args.draft,
            compressions=_csv(args.compressions),
            decodings=_csv(args.decodings),
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            device=args.device,
            seed=args.seed,
            draft_precision=args.draft_precision,
            target_linear=args.target_linear,
            draft_linear=args.draft_linear,
        )
        result = run_race(cfg, arms, picked, models=SMOLLM2_MODELS)
        result["config"]["per_task"] = args.per_task
        result["calibration"] = calibration or ({"file": costs} if costs else None)
        result["command"] = "python benchmarks/e2e.py " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
        )
        atomic_write_text(args.out, json.dumps(result, indent=1))
    result["plot"] = os.path.relpath(args.plot, Path(args.doc).parent)
    plot(result, Path(args.plot))
    write_section(Path(args.doc), markdown(result))
    if not args.render:
        for key, cell in result["summary"].items():
            if key.endswith("/all"):
                print(key, {a: round(v["tokens_per_second"], 2) for a, v in cell["arms"].items()})
    print("\n".join(result["goals"]))
    if not args.render:
        mismatches = result["mismatches"]
        print(
            f"greedy mismatches: {len(mismatches)}" + ("" if not mismatches else "\n  " + "\n  ".join(mismatches[:20]))
        )
        print(f"wrote {args.out}, {args.plot}, e2e section of {args.doc}")
    return 1 if unexplained(result["mismatches"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
