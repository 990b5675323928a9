"""Does a race agree with the offline evaluator? The same prompts, policy against a fixed gamma, both ways.

Usage:
    python benchmarks/online_offline.py [--race docs/onednn_quant_rerun.json] [--costs docs/onednn_quant_costs.json]

For every block (compression, decoding) of a saved ``benchmarks/e2e.py`` race and every policy arm named in
``--pairs``, this prices the export's choices offline on the step log's held-out steps of the race's own prompts
(``speckv_policy.evaluation.priced_arms``: the policy replayed on its own history, re-priced with ``--costs``, the
way ``speckv-eval --costs`` does) and sets them beside the race's wall-clock runs, each against the same fixed gamma.
Per policy it prints the ratio pooled over the prompts (total tokens / total time, what ``speckv-eval`` reports), the
median of the per-prompt ratios (what the race's tables report) and how well the per-prompt ratios of the two agree
(Pearson correlation over the prompts). Offline figures are model-priced; online ones are measured. For a race that
saved its steps it then prints, per arm through the hook, where the wall clock went against what the cost model
prices for the same steps (:func:`accounting`).
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
    from speckv_policy.cli.common import export_arm_pairs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--race", default="docs/onednn_quant_rerun.json", help="a benchmarks/e2e.py --out JSON")
    ap.add_argument(
        "--costs", default="docs/onednn_quant_costs.json", help="calibration the exports are re-priced with"
    )
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--pairs", type=export_arm_pairs, default=DEFAULT_PAIRS, help="comma-separated EXPORT=RACE_ARM")
    ap.add_argument("--reference", default="fixed-2", help="a fixed-gamma arm both sides have (default fixed-2)")
    args = ap.parse_args(argv)
    import os

    for f in (args.race, args.costs, args.log):
        if not os.path.isfile(f):
            ap.error(f"{f}: no such file")

    from speckv_policy.cli.evaluate import load_for_eval
    from speckv_policy.evaluation import evaluation_set, priced_arms
    from speckv_policy.logs import read_log
    from speckv_policy.objective import CostModel

    with open(args.race, encoding="utf-8") as fh:
        race = json.load(fh)
    pairs = args.pairs
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
    choices(race, arms, rows, pairs)
    accounting(race, cost)
    return 0


def choices(race: dict, arms: dict, rows: object, pairs: dict) -> None:
    """Per policy arm and block: what it chose offline (replayed on its own history) and online, on the race's prompts.

    Online figures need a race that saved its steps; a run's first step (the prefill) is left out. A plain stretch
    is a maximal run of consecutive gamma-0 steps (offline: in the profile's step order within a prompt's run). "Text
    per offline plain step" is how many tokens the profile's logged step advanced where the policy chose 0 there
    (online a plain step advances one): the replay charges a plain region fewer steps than generation pays for it.
    """
    import numpy as np

    runs = [r for r in race["runs"] if r.get("step_gamma")]
    if not runs:
        return
    print("\nWhat the policies chose on the race's prompts, offline against online (steps after each run's first)\n")
    print(
        "| block | policy | offline mean gamma | online mean gamma | offline gamma-0 share | online gamma-0 share "
        "| offline plain stretch | online plain stretch | text per offline plain step | offline tokens/step "
        "| online tokens/step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for comp, dec in sorted({(r["compression"], r["decoding"]) for r in runs}):
        ids = sorted({r["prompt_id"] for r in runs if (r["compression"], r["decoding"]) == (comp, dec)})
        m = (
            (rows["compression"] == comp).to_numpy()  # type: ignore[index]
            & (rows["decoding"] == dec).to_numpy()  # type: ignore[index]
            & rows["prompt_id"].isin(ids).to_numpy()  # type: ignore[index]
        )
        for arm in pairs.values():
            sel = [r for r in runs if (r["compression"], r["decoding"], r["arm"]) == (comp, dec, arm)]
            if not sel or not m.any():
                continue
            g_on = np.concatenate([r["step_gamma"][1:] for r in sel])
            acc_on = np.concatenate([r["step_accepted"][1:] for r in sel])
            g_off, tok_off = arms[arm].chosen[m], arms[arm].tokens[m]
            runs_off = [arms[arm].chosen[m & (rows["prompt_id"] == p).to_numpy()] for p in ids]  # type: ignore[index]
            stretch_off = _plain_stretches(runs_off)
            stretch_on = _plain_stretches([np.asarray(r["step_gamma"][1:]) for r in sel])
            logged = rows["accepted"].to_numpy()[m] + 1  # type: ignore[index]  # text a logged step covered
            text_plain = float(logged[g_off == 0].mean()) if (g_off == 0).any() else float("nan")
            print(
                f"| {comp}/{dec} | {arm} | {g_off.mean():.2f} | {g_on.mean():.2f} | {np.mean(g_off == 0):.2f} | "
                f"{np.mean(g_on == 0):.2f} | {stretch_off:.2f} | {stretch_on:.2f} | {text_plain:.2f} | "
                f"{tok_off.mean():.2f} | {1 + acc_on.mean():.2f} |"
            )


def _plain_stretches(runs: list) -> float:
    """Mean length, in steps, of the maximal runs of consecutive gamma-0 steps in each run's step sequence."""
    lengths = []
    for g in runs:
        n = 0
        for x in list(g) + [1]:
            if x == 0:
                n += 1
            elif n:
                lengths.append(n)
                n = 0
    return float(sum(lengths) / len(lengths)) if lengths else 0.0


def accounting(race: dict, cost: object) -> None:
    """Where each hook arm's wall clock went, against what the cost model prices for the same steps.

    Needs a race that saved its steps (``step_*`` lists in every run, benchmarks/e2e.py after commit f5532a0). A
    run's first step carries the prompt's prefill (draft and target), which no per-step price covers, so measured
    and modelled are compared over the later steps; "outside" is the wall clock no step measured (the prefill is
    in a step; this is transformers' loop around the steps: cache updates, stopping criteria, the hook's own calls).
    """
    import numpy as np

    from speckv_policy.schema import COMPRESSION_CODES

    runs = [r for r in race["runs"] if r.get("step_gamma")]
    if not runs:
        print("\n(no per-step data in this race: rerun benchmarks/e2e.py to get the accounting)")
        return
    print(
        "\nWhere the wall clock went (sums over the block's runs; steps after each run's first; ms per step): "
        "measured by the hook against priced by the cost model\n"
    )
    print(
        "| block | arm | steps | tokens/step | draft measured | draft priced | verify measured | verify priced | "
        "decision | outside the steps | wall / priced |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    blocks = sorted({(r["compression"], r["decoding"]) for r in runs})
    for comp, dec in blocks:
        code = COMPRESSION_CODES[comp]
        for arm in [a for a in race["arms"] if any(r["arm"] == a for r in runs)]:
            sel = [r for r in runs if (r["compression"], r["decoding"], r["arm"]) == (comp, dec, arm)]
            drafted = np.concatenate([r["step_drafted"][1:] for r in sel])
            gamma = np.concatenate([r["step_gamma"][1:] for r in sel])
            d_ms = np.concatenate([r["step_draft_ms"][1:] for r in sel])
            v_ms = np.concatenate([r["step_verify_ms"][1:] for r in sel])
            n = len(gamma)
            if n == 0:
                continue
            d_model = cost.draft_ms(drafted, code)  # type: ignore[attr-defined]
            v_model = cost.verify_ms(gamma, code)  # type: ignore[attr-defined]
            wall = sum(r["seconds"] for r in sel) * 1e3
            measured = sum(sum(r["step_draft_ms"]) + sum(r["step_verify_ms"]) for r in sel)
            decision = sum(r["decision_s"] for r in sel) * 1e3
            steps_all = sum(len(r["step_gamma"]) for r in sel)
            outside = (wall - measured - decision) / steps_all
            first = sum(r["step_draft_ms"][0] + r["step_verify_ms"][0] for r in sel)
            priced = first + d_model.sum() + v_model.sum() + decision
            tokens = sum(r["tokens"] for r in sel)
            print(
                f"| {comp}/{dec} | {arm} | {n} | {tokens / steps_all:.2f} | {d_ms.mean():.2f} | {d_model.mean():.2f} | "
                f"{v_ms.mean():.2f} | {v_model.mean():.2f} | {decision / steps_all:.2f} | {outside:.2f} | "
                f"{wall / priced:.3f} |"
            )


if __name__ == "__main__":
    raise SystemExit(main())
