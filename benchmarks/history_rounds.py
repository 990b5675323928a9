"""What training on a policy's own history is worth, offline.

    .venv/bin/python benchmarks/history_rounds.py --policy gbt,mlp,table --feature-set pre,gated --rounds 0,2

Each policy is trained on the log's training prompts with ``fit_from_log(..., history_rounds=R)`` (R rounds of
replaying the training runs with its own choices, the rows added to its training set) for every R, and judged by
``evaluate_log`` on the held-out prompts, on its own replayed history (and, for contrast, on the profile's logged
history). Seconds to a minute per policy on 2 cores.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import replace

from speckv_policy.evaluation import evaluate_log
from speckv_policy.logs import read_log
from speckv_policy.objective import CostModel
from speckv_policy.training import batch_chooser, fit_from_log, make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--policy", default="gbt,mlp,table")
    ap.add_argument("--feature-set", default="pre,gated")
    ap.add_argument("--rounds", default="0,2")
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args()
    log = read_log(args.log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cost fit names the timing outliers it leaves out
        cost = CostModel.fit(log, decision_draft_tokens=1)
    probe = {"pre": 0, "gated": 1, "online": 1}
    policies = {}
    t0 = time.time()
    for kind in args.policy.split(","):
        for fs in args.feature_set.split(","):
            for r in (int(x) for x in args.rounds.split(",")):
                p = make_policy(kind, feature_set=fs, cost_model=replace(cost, decision_draft_tokens=probe[fs]))
                fit_from_log(p, log, "train", history_rounds=r)
                policies[f"{kind}-{fs} rounds={r}"] = (fs, batch_chooser(p))
    print(f"log {args.log}: {len(policies)} policies trained in {time.time() - t0:.0f} s")
    for history in ("policy", "logged"):
        res, _ = evaluate_log(log, policies, policy_cost=cost, n_resamples=args.bootstrap, history=history)
        boot, groups = res["bootstrap"], res["groups"]
        print(
            f"\njudged on {'its own replayed' if history == 'policy' else 'the profile’s logged'} history: "
            f"{res['rows']} held-out steps, {res['prompts']} prompts, {args.bootstrap} paired resamples; x target alone"
        )
        print(f"{'policy':<26}{'overall [95% CI]':>24}{'fp32':>8}{'int8':>8}{'nf4':>8}{'chat':>8}{'x oracle':>10}")
        for name in policies:
            ov = boot["overall"][name]["vs_target"]
            per = "".join(f"{groups[g]['arms'][name]['vs_target']:8.3f}" for g in ("fp32", "int8", "nf4", "chat"))
            print(
                f"{name:<26}{ov['ratio']:8.3f} [{ov['ci'][0]:.3f}, {ov['ci'][1]:.3f}]{per}"
                f"{groups['overall']['arms'][name]['vs_oracle']:10.3f}"
            )


if __name__ == "__main__":
    main()
