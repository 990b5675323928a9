"""Offline evaluator: oracle, best fixed gamma, paired bootstrap, speckv-eval end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from speckv_policy.cli import evaluate as eval_cli
from speckv_policy.evaluation import (
    Arm,
    EvalSet,
    evaluate,
    evaluation_set,
    oracle_choices,
    paired_bootstrap,
    reference_arms,
    step_outcomes,
    summarize,
)
from speckv_policy.logs import write_log
from speckv_policy.objective import CostModel

ROOT = Path(__file__).resolve().parents[1]
# relative cost: a step drafting g tokens costs 1 + 0.1 g (draft) + 0.05 g (verify) target steps
COST = CostModel.relative(draft_cost=0.1, verify_cost_per_token=0.05)


def hand_rows(accepted=(0, 3, 8, 1), prompts=("a", "a", "b", "b"), compression="fp16") -> pd.DataFrame:
    n = len(accepted)
    return pd.DataFrame(
        {
            "prompt_id": list(prompts),
            "task_type": ["code"] * n,
            "compression": [compression] * n,
            "decoding": ["greedy"] * n,
            "accepted": np.array(accepted, dtype=np.int64),
            "drafted": np.full(n, 8, dtype=np.int64),
            "code": np.zeros(n, dtype=np.int64),
            "conf_first": np.linspace(0.1, 0.9, n),
        }
    )


def test_oracle_and_fixed_gammas_by_hand():
    rows = hand_rows()
    assert oracle_choices(rows, 8).tolist() == [0, 3, 8, 1]
    tokens, time = step_outcomes(np.array([0, 3, 8, 1]), rows, COST)
    assert tokens.tolist() == [1, 4, 9, 2]
    assert time == pytest.approx([1.0, 1.45, 2.2, 1.15])
    s = summarize(reference_arms(rows, COST, 8), np.ones(4, bool), COST.unit)
    arms = s["arms"]
    assert arms["oracle"]["tokens_per_second"] == pytest.approx(16 / 5.8)
    # fixed g: tokens sum(min(acc, g) + 1) over 4 * (1 + 0.15 g)
    expect = {0: 4 / 4.0, 1: 7 / 4.6, 2: 9 / 5.2, 3: 11 / 5.8, 4: 12 / 6.4, 8: 16 / 8.8}
    for g, v in expect.items():
        assert arms[f"fixed-{g}"]["tokens_per_second"] == pytest.approx(v)
    assert s["best_fixed"] == "fixed-3"
    assert arms["fixed-4"]["vs_best_fixed"] == pytest.approx((12 / 6.4) / (11 / 5.8))
    assert arms["oracle"]["vs_fixed4"] == pytest.approx((16 / 5.8) / (12 / 6.4))
    assert arms["fixed-2"]["tokens_per_step"] == pytest.approx(9 / 4)


def test_censored_choice_is_credited_only_known_tokens():
    rows = hand_rows(accepted=(2,), prompts=("a",))
    rows["drafted"] = 2  # fully accepted draft of 2: gamma 5 would have given >= 3 tokens, credit 3
    tokens, _ = step_outcomes(np.array([5]), rows, COST)
    assert tokens.tolist() == [3.0]


def _eval(rows, choose, **kw):
    es = EvalSet(rows, {"online": pd.DataFrame({"i": np.arange(len(rows))})}, max_gamma=8)
    return evaluate(es, {"p": ("online", choose)}, policy_cost=COST, history="logged", **kw)  # hand-made rows


def test_policy_equal_to_fixed4_has_ratio_one_and_p_one():
    rows = hand_rows(accepted=(0, 3, 8, 1, 2, 5), prompts=("a", "a", "b", "b", "c", "c"))
    res = _eval(rows, lambda X: np.full(len(X), 4), n_resamples=500)
    b = res["bootstrap"]["overall"]["p"]["vs_fixed4"]
    assert b["ratio"] == pytest.approx(1.0) and b["ci"] == pytest.approx([1.0, 1.0]) and b["p_value"] == 1.0


def test_policy_better_on_every_prompt_has_smallest_p():
    rows = hand_rows(accepted=(0, 3, 8, 1, 2, 5), prompts=("a", "a", "b", "b", "c", "c"))
    oracle = oracle_choices(rows, 8)
    res = _eval(rows, lambda X: oracle, n_resamples=999)
    b = res["bootstrap"]["overall"]["p"]
    assert b["vs_fixed4"]["ci"][0] > 1.0 and b["vs_fixed4"]["p_value"] == pytest.approx(2 / 1000)
    assert b["vs_best_fixed"]["ci"][0] > 1.0
    assert res["groups"]["overall"]["arms"]["p"]["vs_oracle"] == pytest.approx(1.0)


def test_bootstrap_resamples_whole_prompts():
    # prompt a: every strategy 1 token per step; prompt b: long accepted runs. With all weight on
    # one prompt a resample's ratio is that prompt's ratio, so the CI spans exactly the two extremes.
    rows = hand_rows(accepted=(0, 0, 8, 8), prompts=("a", "a", "b", "b"))
    arms = reference_arms(rows, COST, 8)
    out = paired_bootstrap(arms, rows["prompt_id"].to_numpy(), np.ones(4, bool), n_resamples=2000, unit=COST.unit)
    lo, hi = out["fixed-4"]["tokens_per_second_ci"]
    assert lo == pytest.approx(1 / 1.6) and hi == pytest.approx(5 / 1.6)
    with pytest.raises(ValueError, match=">= 2 prompts"):
        paired_bootstrap(arms, np.array(["a"] * 4), np.ones(4, bool), n_resamples=10)


def test_best_fixed_in_bootstrap_is_rechosen_per_resample():
    # prompt a favours gamma 0, prompt b favours gamma 8: the per-resample best fixed gamma beats any
    # single fixed gamma, so a policy equal to fixed-8 never has a ratio above 1 against it.
    rows = hand_rows(accepted=(0, 0, 8, 8), prompts=("a", "a", "b", "b"))
    res = _eval(rows, lambda X: np.full(len(X), 8), n_resamples=2000)
    b = res["bootstrap"]["overall"]["p"]["vs_best_fixed"]
    assert b["ci"][1] <= 1.0 + 1e-12


def test_best_peer_in_bootstrap_is_rechosen_per_resample():
    # two peer rules: fixed-0 on prompt a's terms, fixed-8 on b's; a policy equal to fixed-8 is 1.0x the best
    # peer on the full sample only if fixed-8 is the best peer there, and never above 1 in any resample
    rows = hand_rows(accepted=(0, 0, 8, 8), prompts=("a", "a", "b", "b"))
    refs = reference_arms(rows, COST, 8)
    by = {a.name: a for a in refs}
    peers = [Arm("peer-0", by["fixed-0"].tokens, by["fixed-0"].time, by["fixed-0"].chosen, kind="peer")]
    peers.append(Arm("peer-8", by["fixed-8"].tokens, by["fixed-8"].time, by["fixed-8"].chosen, kind="peer"))
    mine = Arm("p", by["fixed-8"].tokens, by["fixed-8"].time, by["fixed-8"].chosen)
    out = paired_bootstrap([*refs, *peers, mine], rows["prompt_id"].to_numpy(), np.ones(4, bool), n_resamples=2000)
    b = out["p"]["vs_best_peer"]
    full = {a.name: a.tokens.sum() / a.time.sum() for a in peers}
    assert b["ratio"] == pytest.approx(mine.tokens.sum() / mine.time.sum() / max(full.values()))
    assert b["ci"][1] <= 1.0 + 1e-12 and "vs_best_peer" not in out["peer-0"]
    no_peers = paired_bootstrap([*refs, mine], rows["prompt_id"].to_numpy(), np.ones(4, bool), n_resamples=10)
    assert "vs_best_peer" not in no_peers["p"]


def test_groups_and_histogram():
    rows = pd.concat([hand_rows(), hand_rows(prompts=("c", "c", "d", "d"), compression="nf4")], ignore_index=True)
    rows.loc[4:, "code"] = 2
    res = _eval(rows, lambda X: np.array([1, 2, 2, 8, 0, 0, 1, 1]), n_resamples=100)
    assert {"overall", "fp16", "nf4", "code", "fp16/code", "nf4/code"} <= set(res["groups"])
    assert res["gamma_histogram"]["p"]["fp16"][:3] == [0, 1, 2] and res["gamma_histogram"]["p"]["nf4"][:2] == [2, 2]
    assert res["groups"]["nf4"]["rows"] == 4 and res["prompts"] == 4


def test_evaluation_set_uses_heldout_fully_drafted_steps(synthetic):
    log = synthetic[0]
    es = evaluation_set(log, ("online", "paper"), max_gamma=8)
    held = set(log.loc[log["split"] == "heldout", "prompt_id"])
    assert set(es.rows["prompt_id"]) <= held and (es.rows["drafted"] >= 8).all()
    expected = int(((log["split"] == "heldout") & (log["gamma"] >= 8)).sum())
    assert len(es.rows) == expected == len(es.features["online"]) == len(es.features["paper"])
    with pytest.raises(ValueError, match="drafted >= 99"):
        evaluation_set(log, ("online",), max_gamma=99)


def test_speckv_eval_cli_end_to_end(synthetic, tmp_path, capsys):
    log_path = tmp_path / "steps.parquet"
    write_log(synthetic[0], log_path)
    out = tmp_path / "eval"
    policies = sorted(str(p) for p in (ROOT / "exported").glob("synthetic-*.onnx"))
    assert eval_cli.main(["--log", str(log_path), "--policy", *policies, "--out", str(out), "--bootstrap", "300"]) == 0
    text = capsys.readouterr().out
    assert "synthetic-gbt" in text and "x best fixed" in text
    res = json.loads((out / "eval.json").read_text())
    assert set(res["policies"]) == {Path(p).stem for p in policies}
    ov = res["groups"]["overall"]["arms"]
    assert ov["oracle"]["vs_oracle"] == pytest.approx(1.0)
    assert all(ov[n]["tokens_per_second"] <= ov["oracle"]["tokens_per_second"] + 1e-9 for n in ov)
    md = (out / "eval.md").read_text()
    assert "| **synthetic-gbt** |" in md and "95% CI" in md
    for png in ("acceptance_vs_confidence.png", "gamma_histogram.png", "tokens_per_second.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_speckv_eval_clear_errors(synthetic, tmp_path, capsys):
    log_path = tmp_path / "steps.parquet"
    write_log(synthetic[0], log_path)
    assert eval_cli.main(["--log", str(log_path), "--policy", str(tmp_path / "none.onnx")]) == 2
    assert "policy not found" in capsys.readouterr().err
    assert (
        eval_cli.main(
            ["--log", str(tmp_path / "missing.parquet"), "--policy", str(ROOT / "exported" / "synthetic-gbt.onnx")]
        )
        == 2
    )
    assert "missing.parquet" in capsys.readouterr().err


def test_speckv_eval_takes_joblib_policies_and_matches_onnx(synthetic, tmp_path, capsys):
    from speckv_policy.export import export_onnx
    from speckv_policy.training import fit_from_log, make_policy, save_policy

    log = synthetic[0]
    log_path = tmp_path / "steps.parquet"
    write_log(log, log_path)
    policy = fit_from_log(make_policy("table", cost_model=CostModel.fit(log, decision_draft_tokens=1)), log)
    save_policy(policy, tmp_path / "table.joblib")
    export_onnx(policy, tmp_path / "table_onnx.onnx")
    out = tmp_path / "eval"
    assert (
        eval_cli.main(
            [
                "--log",
                str(log_path),
                "--policy",
                str(tmp_path / "table.joblib"),
                str(tmp_path / "table_onnx.onnx"),
                "--out",
                str(out),
                "--bootstrap",
                "50",
                "--no-plots",
                "--trust-pickle",
            ]
        )
        == 0
    )
    res = json.loads((out / "eval.json").read_text())
    a, b = res["groups"]["overall"]["arms"]["table"], res["groups"]["overall"]["arms"]["table_onnx"]
    assert a["tokens_per_second"] == pytest.approx(b["tokens_per_second"])  # same decisions from Python and ONNX
    assert not (out / "gamma_histogram.png").exists()


@pytest.mark.parametrize(
    "report, costs, decide",
    [
        ("eval.json", None, None),
        ("eval_onednn.json", "benchmarks/runs/onednn_costs.json", None),
    ],
)
def test_shipped_eval_report_matches_the_shipped_log_and_policies(tmp_path, report, costs, decide):
    """benchmarks/runs/offline/*.json must be what `speckv-eval` computes from what ships (point estimates)."""
    shipped = json.loads((ROOT / "benchmarks" / "runs" / "offline" / report).read_text())
    out = tmp_path / "eval"
    policies = [str(ROOT / p) for p in shipped["policies"].values()]
    priced = ["--costs", str(ROOT / costs)] if costs else []
    priced += ["--decide-costs", str(ROOT / decide)] if decide else []
    for key, value in shipped.get("selected", {}).items():
        priced += [f"--{key}", value]
    assert (
        eval_cli.main(
            [
                "--log",
                str(ROOT / shipped["log"]),
                "--policy",
                *policies,
                "--out",
                str(out),
                "--bootstrap",
                "20",
                "--no-plots",
                *priced,
            ]
        )
        == 0
    )
    now = json.loads((out / "eval.json").read_text())
    assert now["rows"] == shipped["rows"] and now["prompts"] == shipped["prompts"]
    for group, s in shipped["groups"].items():
        assert now["groups"][group]["best_fixed"] == s["best_fixed"], group
        for name, arm in s["arms"].items():
            assert now["groups"][group]["arms"][name]["tokens_per_second"] == pytest.approx(
                arm["tokens_per_second"], rel=1e-9
            ), (group, name)
    for name, pair in shipped.get("pairs", {}).items():
        assert now["pairs"][name]["same_choice"] == pytest.approx(pair["same_choice"], rel=1e-12), name


def test_references_pay_only_what_they_run():
    """A policy that reads the first draft token pays it; the target alone (fixed-0) and the oracle never do."""
    rows = hand_rows(accepted=(0, 3, 8, 1, 2, 0), prompts=("a", "a", "b", "b", "c", "c"))
    zeros = pd.DataFrame({"x": np.zeros(len(rows))})
    es = EvalSet(rows, {"online": zeros, "pre": zeros}, max_gamma=8)
    probe = CostModel.relative(draft_cost=0.1, verify_cost_per_token=0.05, decision_draft_tokens=1)
    always0 = ("online", lambda X: np.zeros(len(X), dtype=np.int64))
    before_drafting = ("pre", lambda X: np.zeros(len(X), dtype=np.int64))
    res = evaluate(
        es, {"always0": always0, "pre0": before_drafting}, policy_cost=probe, n_resamples=50, history="logged"
    )
    arms = res["groups"]["overall"]["arms"]
    # a policy on the 'pre' features decides before drafting: gamma 0 is exactly the target alone, no probe
    assert arms["pre0"]["tokens_per_second"] == pytest.approx(1.0)
    # every step: 1 token; the policy pays the probe (1.1 target steps), the target alone does not (1.0)
    assert arms["fixed-0"]["tokens_per_second"] == pytest.approx(1.0)
    assert arms["always0"]["tokens_per_second"] == pytest.approx(1 / 1.1)
    assert arms["always0"]["vs_target"] == pytest.approx(1 / 1.1)
    assert res["bootstrap"]["overall"]["always0"]["vs_target"]["ratio"] == pytest.approx(1 / 1.1)
    # the oracle drafts exactly the accepted length, without a probe: (acc + 1) tokens in 1 + 0.15 acc
    acc = rows["accepted"].to_numpy()
    assert arms["oracle"]["tokens_per_second"] == pytest.approx((acc + 1).sum() / (1 + 0.15 * acc).sum())


def test_speckv_eval_decide_costs_pairs_each_export_with_itself(synthetic, cost_model, tmp_path, capsys):
    """``--decide-costs``: every export also runs re-priced with other prices, judged by the same ones, paired with
    itself. Deciding with the judge's own prices is the identity (ratio 1, every gamma alike); with drafting priced
    10x dearer the export drafts less where drafting pays, and that costs it tokens/s under the judge's prices."""
    from dataclasses import replace

    log_path = tmp_path / "steps.parquet"
    write_log(synthetic[0], log_path)
    fresh, dear = tmp_path / "fresh.json", tmp_path / "dear.json"
    cost_model.save(fresh)
    dearer = tuple(10 * v for v in cost_model.draft_ms_per_token)
    replace(cost_model, draft_ms_per_token=dearer, n_rows={0: 0, 1: 0, 2: 40}).save(dear)  # timed at NF4 only
    gbt = str(ROOT / "exported" / "synthetic-gbt.onnx")
    common = ["--log", str(log_path), "--policy", gbt, "--bootstrap", "200", "--no-plots", "--costs", str(fresh)]

    assert eval_cli.main([*common, "--out", str(tmp_path / "same"), "--decide-costs", str(fresh)]) == 0
    res = json.loads((tmp_path / "same" / "eval.json").read_text())
    pair = res["pairs"]["synthetic-gbt@fresh"]
    assert pair["reference"] == "synthetic-gbt" and set(pair["same_choice"].values()) == {1.0}
    v = res["bootstrap"]["overall"]["synthetic-gbt@fresh"]["vs_pair"]
    assert v["ratio"] == pytest.approx(1.0) and v["ci"] == pytest.approx([1.0, 1.0])
    assert res["decide_costs"] == str(fresh)

    assert eval_cli.main([*common, "--out", str(tmp_path / "dear"), "--decide-costs", str(dear)]) == 0
    printed = capsys.readouterr().out
    res = json.loads((tmp_path / "dear" / "eval.json").read_text())
    arms = res["groups"]["overall"]["arms"]
    v = res["bootstrap"]["overall"]["synthetic-gbt@dear"]["vs_pair"]
    assert v["ratio"] == pytest.approx(
        arms["synthetic-gbt@dear"]["tokens_per_second"] / arms["synthetic-gbt"]["tokens_per_second"]
    )
    assert v["ratio"] < 1.0 and v["ci"][0] <= v["ratio"] <= v["ci"][1]
    assert arms["synthetic-gbt@dear"]["mean_gamma"] < arms["synthetic-gbt"]["mean_gamma"]
    assert res["pairs"]["synthetic-gbt@dear"]["same_choice"]["overall"] < 1.0
    assert "synthetic-gbt@dear (decides with" in printed and "same gamma on" in printed
    assert f"note: {dear} timed no step at fp16/bf16/fp32, int8" in printed and f"note: {fresh}" not in printed
    assert res["unmeasured_levels"] == {str(dear): ["fp16/bf16/fp32", "int8"]}
    md = (tmp_path / "dear" / "eval.md").read_text()
    assert "timed no step at fp16/bf16/fp32, int8" in md
    assert "## Deciding with other prices" in md and "| synthetic-gbt@dear | synthetic-gbt | overall |" in md

    mlp16 = str(ROOT / "exported" / "synthetic-paper-mlp16.onnx")  # tokens per step: no prices to decide with
    capsys.readouterr()
    out = tmp_path / "mlp16"
    both = [*common, "--policy", gbt, mlp16]  # the last --policy wins
    assert eval_cli.main([*both, "--out", str(out), "--decide-costs", str(dear)]) == 0
    assert "leaves synthetic-paper-mlp16 alone: it maximises tokens_per_step" in capsys.readouterr().err
    assert set(json.loads((out / "eval.json").read_text())["pairs"]) == {"synthetic-gbt@dear"}
    assert eval_cli.main([*common, "--out", str(tmp_path / "x"), "--decide-costs", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_pairs_must_name_evaluated_policies(synthetic, cost_model):
    es = evaluation_set(synthetic[0], ("online",))
    with pytest.raises(ValueError, match="pairs must name two evaluated policies"):
        evaluate(es, {"p": ("online", lambda X: np.ones(len(X), np.int64))}, policy_cost=cost_model, pairs={"p": "q"})


def test_speckv_eval_selects_rows_by_compression_and_decoding(synthetic, tmp_path, capsys):
    log = synthetic[0]
    log_path = tmp_path / "steps.parquet"
    write_log(log, log_path)
    gbt = str(ROOT / "exported" / "synthetic-gbt.onnx")
    common = ["--log", str(log_path), "--policy", gbt, "--bootstrap", "50", "--no-plots"]
    assert eval_cli.main([*common, "--out", str(tmp_path / "a"), "--compressions", "nf4,int8"]) == 0
    res = json.loads((tmp_path / "a" / "eval.json").read_text())
    chosen = log[log["compression"].isin(["nf4", "int8"])]
    assert res["rows"] == len(evaluation_set(chosen, ("online",)).rows) < len(evaluation_set(log, ("online",)).rows)
    assert res["selected"] == {"compressions": "nf4,int8"}
    assert set(res["groups"]) & {"fp16", "fp32"} == set() and {"nf4", "int8"} <= set(res["groups"])
    assert "(only compressions nf4,int8)" in (tmp_path / "a" / "eval.md").read_text()
    capsys.readouterr()
    assert eval_cli.main([*common, "--out", str(tmp_path / "b"), "--decodings", "beam"]) == 2
    err = capsys.readouterr().err
    assert str(log_path) in err and "no decoding beam in the log (it has greedy, sampling)" in err
