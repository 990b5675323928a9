"""How much a gate could add over fixed gamma with the EAGLE-3 head, and how well the head knows when to draft.

From the head's profile (every outcome up to gamma 8 known at its gamma-8 steps), priced with a calibration of this
machine: what fixed gamma G earns against a perfect gate (draft G exactly where the first draft token will be kept,
a rule no policy can run) and the best threshold on the head's first-token confidence, and how well the signals a policy has separate that event on held-out steps (ROC AUC of
the head's first-token confidence; gradient-boosted classifiers fitted on the training steps, with and without the
target's own confidence and entropy at the last verified position). Usage: ``python benchmarks/eagle3_gate_bound.py
--log datasets/smollm2/steps-eagle3.parquet --costs COSTS.json`` (``speckv-calibrate --draft datasets/smollm2/eagle3
--draft-precision bf16 --draft-linear onednn --target-linear onednn --compressions fp32 --out COSTS.json``).
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

from speckv_policy.logs import read_log
from speckv_policy.objective import CostModel
from speckv_policy.schema import COMPRESSION_CODES

DRAFT_SIGNALS = ["conf_first", "entropy_first", "compression_code", "log_context_len", "temperature"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", required=True)
    ap.add_argument("--costs", required=True)
    ap.add_argument("--compression", default="fp32")
    args = ap.parse_args()
    log, cost = read_log(args.log), CostModel.load(args.costs)
    code = COMPRESSION_CODES[args.compression]
    verify = [float(cost.verify_ms(g, code)) for g in range(9)]
    draft = [float(cost.draft_ms(g, code)) for g in range(9)]
    full = log[(log.gamma == 8) & (log.compression == args.compression)]
    for (split, decoding), s in full.groupby(["split", "decoding"]):
        a = s.accepted.to_numpy()
        for g in (2, 3):
            tokens = (1 + np.minimum(a, g)).sum()
            fixed = tokens / (len(a) * (draft[g] + verify[g]))
            gate = tokens / np.where(a >= 1, draft[g] + verify[g], verify[0]).sum()
            print(f"{split:8s} {decoding:8s} {len(a):4d} steps: a perfect gate on fixed {g} is {gate / fixed:.3f}x it")
        # the best a threshold on the head's first-token confidence does on fixed 2: the probe token paid (upfront),
        # or as if that signal cost nothing (a bound)
        conf, g = np.array([c[0] for c in s.draft_confidence]), 2
        tokens = 1 + np.minimum(a, g)
        fixed = tokens.sum() / (len(a) * (draft[g] + verify[g]))
        best = {"upfront": (0.0, 0.0), "free": (0.0, 0.0)}
        for t in np.linspace(0, 1, 41):
            go = conf > t
            for name, shut in (("upfront", draft[1] + verify[0]), ("free", verify[0])):
                ratio = np.where(go, tokens, 1).sum() / np.where(go, draft[g] + verify[g], shut).sum() / fixed
                best[name] = max(best[name], (float(ratio), float(t)))
        print(
            f"{'':17s} {len(a):4d} steps: the best confidence threshold on fixed 2 is {best['upfront'][0]:.3f}x it "
            f"(> {best['upfront'][1]:.3f}; {best['free'][0]:.3f}x if the probe cost nothing)"
        )
    steps = log[log.gamma >= 1].copy()
    kept = (steps.accepted > 0).to_numpy()
    steps["conf_first"] = [c[0] for c in steps.draft_confidence]
    steps["entropy_first"] = [e[0] for e in steps.draft_entropy]
    steps["compression_code"] = steps.compression.map(COMPRESSION_CODES)
    steps["log_context_len"] = np.log1p(steps.context_len)
    train, held = (steps.split == "train").to_numpy(), (steps.split == "heldout").to_numpy()
    print(f"first draft token kept on {kept.mean():.3f} of {len(steps)} drafting steps")
    print(
        f"held-out AUC, the head's first-token confidence alone: {roc_auc_score(kept[held], steps.conf_first[held]):.3f}"
    )
    for name, cols in (
        ("draft signals + context match", [*DRAFT_SIGNALS, "context_match_len"]),
        (
            "... + the target's confidence and entropy",
            [*DRAFT_SIGNALS, "context_match_len", "target_confidence", "target_entropy"],
        ),
    ):
        clf = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, max_leaf_nodes=15, random_state=0)
        clf.fit(steps[cols].to_numpy()[train], kept[train])
        auc = roc_auc_score(kept[held], clf.predict_proba(steps[cols].to_numpy()[held])[:, 1])
        print(f"held-out AUC, boosted on {name}: {auc:.3f}")


if __name__ == "__main__":
    main()
