"""Does a race agree with the offline evaluator? The same prompts, policy against a fixed gamma, both ways.

Usage:
    python benchmarks/online_offline.py [--race docs/onednn_quant_rerun.json] [--costs docs/onednn_quant_costs.json]

For every block (compression, decoding) of a saved ``benchmarks/e2e.py`` race and every policy arm named in
``--pairs``, this prices the export's choices offline on the step log's held-out steps of the race's own prompts
(``speckv_policy.evaluation.priced_arms``: the policy replayed on its own history, re-priced with ``--costs``, the
way ``speckv-eval --costs`` does) and sets them beside the race's wall-clock runs, each against the same fixed gamma.
Per policy it prints the ratio pooled over the prompts (total tokens / total time, what ``speckv-eval`` reports), the
median of the per-prompt ratios (what the race's tables report) and how well the per-prompt ratios of the two agree
(Pearson correlation over the prompts). Offline figures are model-priced; online ones are measured.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace

import numpy as np

DEFAULT_PAIRS = (
    "exported/smollm2-gbt.onnx=gbt-repriced,exported/smollm2-gbt-pre.onnx=gbt-pre-repriced,"
    "exported/smollm2-gbt-gated.onnx=gbt-gated-repriced,exported/smollm2-mlp-gated.onnx=mlp-gated-repriced"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--race", default="docs/onednn_quant_rerun.json", help="a benchmarks/e2e.py --out JSON")
    ap.add_argument(
        "--costs", default="docs/onednn_quant_costs.json", help="calibration the exports are re-priced with"
    )
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma-separated EXPORT=RACE_ARM")
    ap.add_argument("--reference", default="fixed-2", help="a fixed-gamma arm both sides have (default fixed-2)")
    args = ap.parse_args(argv)

    from speckv_policy.cli.evaluate import load_for_eval
    from speckv_policy.evaluation import evaluation_set, priced_arms
    from speckv_policy.logs import read_log
    from speckv_policy.objective import CostModel

    with open(args.race, encoding="utf-8") as fh:
        race = json.load(fh)
    pairs = dict(item.split("=", 1) for item in args.pairs.split(","))
    cost = replace(CostModel.load(args.costs), decision_draft_tokens=1)
    policies = {arm: load_for_eval(path, cost_model=cost) for path, arm in pairs.items()}
    log = read_log(args.log)
    es = evaluation_set(log, tuple(sorted({fs for fs, _ in policies.values()} | {"online"})))
    arms = {a.name: a for a in priced_arms(es, policies, policy_cost=cost)[0]}
    if args.reference not in arms:
        raise SystemExit(f"--reference {args.reference!r} is not an offline reference arm ({', '.join(arms)})")
    rows = es.rows
    online: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in race["runs"]:
        online[(r["compression"], r["decoding"], r["prompt_id"])][r["arm"]].append(r["tokens"] / r["seconds"])
    print(
        f"race {args.race} ({race['config']['prompts']} prompts); offline: {args.log} held-out steps of those "
        f"prompts, re-priced with {args.costs}; every ratio against {args.reference}\n"
    )
    print(
        "| block | policy | prompts | offline pooled | offline median | online pooled | online median | "
        "per-prompt correlation |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    blocks = sorted({(c, d) for c, d, _ in online})
    for comp, dec in blocks:
        prompts = sorted(p for c, d, p in online if (c, d) == (comp, dec))
        in_block = (rows["compression"] == comp).to_numpy() & (rows["decoding"] == dec).to_numpy()
        for arm in policies:
            off_r: list[float] = []
            on_r: list[float] = []
            ref, a = arms[args.reference], arms[arm]
            for p in prompts:
                m = in_block & (rows["prompt_id"] == p).to_numpy()
                runs = online[(comp, dec, p)]
                if not m.any() or arm not in runs or args.reference not in runs:
                    continue
                off_r.append((a.tokens[m].sum() / a.time[m].sum()) / (ref.tokens[m].sum() / ref.time[m].sum()))
                on_r.append(float(np.mean(runs[arm]) / np.mean(runs[args.reference])))
            if len(off_r) < 2:
                continue
            msk = in_block & rows["prompt_id"].isin(prompts).to_numpy()
            off_pooled = (a.tokens[msk].sum() / a.time[msk].sum()) / (ref.tokens[msk].sum() / ref.time[msk].sum())
            sel = [r for r in race["runs"] if r["compression"] == comp and r["decoding"] == dec]
            tok = {x: sum(r["tokens"] for r in sel if r["arm"] == x) for x in (arm, args.reference)}
            sec = {x: sum(r["seconds"] for r in sel if r["arm"] == x) for x in (arm, args.reference)}
            on_pooled = (tok[arm] / sec[arm]) / (tok[args.reference] / sec[args.reference])
            corr = float(np.corrcoef(off_r, on_r)[0, 1])
            print(
                f"| {comp}/{dec} | {arm} | {len(off_r)} | {off_pooled:.3f} | {np.median(off_r):.3f} | "
                f"{on_pooled:.3f} | {np.median(on_r):.3f} | {corr:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
