"""Offline: does re-pricing an export carry a policy to another machine? (no model runs; ~1 minute)

    .venv/bin/python benchmarks/reprice.py

On the shipped SmolLM2 profile's held-out steps, with the one offline evaluator
(``speckv_policy.evaluation.evaluate``, paired bootstrap over prompts):

1. Two cost regimes that genuinely differ: A, the cost model fitted from the profile
   (this repo's profiling machine), and B, the same with the full-precision and NF4 rows
   swapped (one-token steps ~41 vs ~23 ms, verification tables exchanged). A GBT
   policy trained under A and re-priced for B (``with_cost_model``, what
   ``RuntimePolicy(path, cost_model=B)`` and ``speckv-export --reprice`` do) against a
   GBT policy trained under B, both judged under B.
2. A SIMULATED GPU regime (labelled as such: nothing here ran on a GPU): a target step
   whose verification is nearly flat in gamma (+2% per draft token over a one-token
   step, the memory-bound regime of small batches on a GPU; Leviathan et al. 2023 model
   verification as free) and a draft at 1/10 of a target step plus a small fixed call
   cost. How the shipped GBT export's choices change when re-priced for it: gamma
   histogram and tokens/s, against the export as shipped, the best fixed gamma and the
   target alone, all priced under the simulated regime.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np

from speckv_policy.evaluation import evaluate, evaluation_set
from speckv_policy.logs import read_log
from speckv_policy.objective import CostModel
from speckv_policy.runtime import RuntimePolicy
from speckv_policy.training import fit_from_log, make_policy, with_cost_model

ROOT = Path(__file__).resolve().parents[1]


def swapped(cm: CostModel, a: int = 0, b: int = 2) -> CostModel:
    """``cm`` with compression codes ``a`` and ``b`` exchanged (every per-code field)."""

    def swap(t: tuple) -> tuple:
        t = list(t)
        t[a], t[b] = t[b], t[a]
        return tuple(t)

    return replace(
        cm,
        draft_ms_per_token=swap(cm.draft_ms_per_token),
        verify_base_ms=swap(cm.verify_base_ms),
        verify_ms_per_token=swap(cm.verify_ms_per_token),
        draft_base_ms=swap(cm.draft_base_ms),
        verify_table_ms=swap(cm.verify_table_ms) if cm.verify_table_ms else None,
        device="swapped",
    )


def simulated_gpu(cm: CostModel) -> CostModel:
    """SIMULATED: one-token step as measured, verification +2% per draft token, draft 1/10 step + 0.2 ms per call."""
    step = np.asarray(cm.verify_table_ms)[:, 0] if cm.verify_table_ms else np.asarray(cm.verify_base_ms)
    return CostModel(
        draft_ms_per_token=tuple(0.1 * step),
        verify_base_ms=tuple(step),
        verify_ms_per_token=tuple(0.02 * step),
        draft_base_ms=tuple(0.0 * step + 0.2),
        decision_draft_tokens=cm.decision_draft_tokens,
        device="SIMULATED-gpu",
        unit="ms",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default=str(ROOT / "datasets" / "smollm2" / "steps.parquet"))
    ap.add_argument("--export", default=str(ROOT / "exported" / "smollm2-gbt.onnx"))
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args(argv)
    log = read_log(args.log)
    es = evaluation_set(log, ("online",))
    A = CostModel.fit(log, decision_draft_tokens=1)
    B = swapped(A)
    trained_a = fit_from_log(make_policy("gbt", cost_model=A), log)
    trained_b = fit_from_log(make_policy("gbt", cost_model=B), log)
    repriced = with_cost_model(trained_a, B)
    X = es.features["online"]
    same = float(np.mean(repriced.predict(X) == trained_b.predict(X)))
    pols = {
        "A re-priced for B": ("online", repriced.predict),
        "trained under B": ("online", trained_b.predict),
        "A as priced (under B)": ("online", trained_a.predict),
    }
    res = evaluate(es, pols, policy_cost=B, n_resamples=args.bootstrap)
    ov, boot = res["groups"]["overall"]["arms"], res["bootstrap"]["overall"]
    print(
        f"1. regimes A (fitted, {A.device}) and B (fp32 and NF4 costs swapped); {res['rows']} held-out steps, "
        f"{res['prompts']} prompts, judged under B, {args.bootstrap} paired resamples"
    )
    print(f"   decisions of A re-priced for B equal those of a policy trained under B on {same:.2%} of steps")
    for name in pols:
        b = boot[name]["vs_target"]
        print(
            f"   {name:<22} {ov[name]['tokens_per_second']:7.2f} tok/s  x target alone {b['ratio']:.3f} "
            f"[{b['ci'][0]:.3f}, {b['ci'][1]:.3f}]  x best fixed {ov[name]['vs_best_fixed']:.3f}"
        )
    ratio = ov["A re-priced for B"]["tokens_per_second"] / ov["trained under B"]["tokens_per_second"]
    print(f"   re-priced / trained under B: {ratio:.4f} (goal: within 3%)")

    G = simulated_gpu(A)
    rt = RuntimePolicy(args.export)
    rt_gpu = RuntimePolicy(args.export, cost_model=G)
    res = evaluate(
        es,
        {"as shipped": ("online", rt.decide_batch), "re-priced for the GPU": ("online", rt_gpu.decide_batch)},
        policy_cost=G,
        n_resamples=args.bootstrap,
    )
    ov, boot = res["groups"]["overall"]["arms"], res["bootstrap"]["overall"]
    shown = Path(args.export).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    print(f"\n2. SIMULATED GPU regime (not measured): {shown} under")
    for line in G.describe():
        print(f"     {line}")
    print(
        f"   best fixed gamma in hindsight: {res['groups']['overall']['best_fixed']}; target alone "
        f"{ov['fixed-0']['tokens_per_second']:.2f} tok/s"
    )
    for name in ("as shipped", "re-priced for the GPU"):
        b = boot[name]["vs_target"]
        hist = np.sum([res["gamma_histogram"][name][c] for c in res["gamma_histogram"][name]], axis=0)
        print(
            f"   {name:<22} {ov[name]['tokens_per_second']:7.2f} tok/s  x target alone {b['ratio']:.3f} "
            f"[{b['ci'][0]:.3f}, {b['ci'][1]:.3f}]  x best fixed {ov[name]['vs_best_fixed']:.3f}  "
            f"mean gamma {ov[name]['mean_gamma']:.2f}  gamma 0..8: {hist.tolist()}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
