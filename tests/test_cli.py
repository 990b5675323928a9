"""speckv-export and speckv-quickstart end to end, and the shipped artefacts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import joblib
import numpy as np
import onnx
import pytest

from speckv_policy.cli import export as export_cli
from speckv_policy.cli import quickstart
from speckv_policy.logs import read_log, write_log
from speckv_policy.policies import training_data
from speckv_policy.policies.base import data_fingerprint
from speckv_policy.runtime import RuntimePolicy
from speckv_policy.training import make_policy

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_LOG = ROOT / "datasets" / "synthetic" / "steps.parquet"


@pytest.fixture(scope="module")
def log_path(synthetic, tmp_path_factory):
    path = tmp_path_factory.mktemp("logs") / "steps.parquet"
    write_log(synthetic[0], path)
    return path


@pytest.mark.parametrize("kind", ["mlp", "gbt", "table", "paper-mlp16", "fixed"])
def test_train_then_export(kind, log_path, tmp_path, capsys):
    out = tmp_path / f"{kind}.onnx"
    saved = tmp_path / f"{kind}.joblib"
    assert export_cli.main([str(out), "--train", str(log_path), "--policy", kind, "--save-policy", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "exported" in text and "held-out" in text and "ONNX = Python on 100.00% of rows" in text
    onnx.checker.check_model(onnx.load(out), full_check=True)
    rt = RuntimePolicy(out)
    policy = joblib.load(saved)
    X, _ = training_data(read_log(log_path), policy.feature_set_, split="heldout")
    np.testing.assert_array_equal(rt.decide_batch(X), policy.predict(X))


def test_export_saved_policy_and_options(log_path, tmp_path, capsys):
    saved = tmp_path / "t.joblib"
    first = tmp_path / "a.onnx"
    assert (
        export_cli.main(
            [
                str(first),
                "--train",
                str(log_path),
                "--policy",
                "table",
                "--candidates",
                "0,1,2,4",
                "--objective",
                "tokens_per_step",
                "--decision-draft-tokens",
                "1",
                "--save-policy",
                str(saved),
            ]
        )
        == 0
    )
    second = tmp_path / "b.onnx"
    assert export_cli.main([str(second), "--policy", str(saved), "--trust-pickle"]) == 0
    meta = RuntimePolicy(second).metadata
    assert json.loads(meta["speckv.candidates"]) == [0, 1, 2, 4]
    assert meta["speckv.objective"] == "tokens_per_step"
    assert json.loads(meta["speckv.cost_model"])["decision_draft_tokens"] == 1
    capsys.readouterr()


def test_export_trained_on_its_own_history(log_path, tmp_path, capsys):
    """--history-rounds: the training runs replayed with the policy's own choices join its training rows."""
    plain, dagger = tmp_path / "plain.onnx", tmp_path / "dagger.onnx"
    base = ["--train", str(log_path), "--policy", "table", "--feature-set", "pre"]
    assert export_cli.main([str(plain), *base]) == 0
    assert export_cli.main([str(dagger), *base, "--history-rounds", "1"]) == 0
    capsys.readouterr()
    X, _ = training_data(read_log(log_path), "pre", split="heldout")
    assert (RuntimePolicy(plain).decide_batch(X) != RuntimePolicy(dagger).decide_batch(X)).any()
    bad = [str(tmp_path / "x.onnx"), "--policy", str(tmp_path / "p.joblib"), "--history-rounds", "1"]
    assert export_cli.main(bad) == 2 and not (tmp_path / "x.onnx").exists()
    assert "--history-rounds trains on a log" in capsys.readouterr().err


def test_export_errors(log_path, tmp_path, capsys):
    out = tmp_path / "x.onnx"
    assert export_cli.main([str(out), "--policy", "gbt"]) == 2
    assert "add --train LOG" in capsys.readouterr().err
    assert export_cli.main([str(out), "--policy", str(tmp_path / "missing.joblib")]) == 2
    junk = tmp_path / "junk.joblib"
    joblib.dump({"not": "a policy"}, junk)
    assert export_cli.main([str(out), "--policy", str(junk), "--trust-pickle"]) == 2
    assert "not a speckv gamma policy" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("run_id\nr\n")
    assert export_cli.main([str(out), "--train", str(bad), "--policy", "gbt"]) == 2
    assert "missing column 'prompt_id'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_cli.main([str(out), "--train", str(log_path), "--policy", "gbt", "--candidates", "a,b"])
    assert not out.exists()


def test_failed_export_keeps_previous_file(log_path, tmp_path, monkeypatch):
    out = tmp_path / "m.onnx"
    assert export_cli.main([str(out), "--train", str(log_path), "--policy", "table"]) == 0
    before = out.read_bytes()
    import speckv_policy.export as exp

    def broken(model, full_check=False):
        raise onnx.checker.ValidationError("simulated invalid graph")

    monkeypatch.setattr(exp.onnx.checker, "check_model", broken)
    with pytest.raises(onnx.checker.ValidationError):
        export_cli.main([str(out), "--train", str(log_path), "--policy", "gbt"])
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def _quickstart_rows(text: str) -> dict[str, list[float]]:
    """Policy name -> the numbers of its row in speckv-quickstart's table."""
    rows = {}
    for ln in text.splitlines():
        name = ln.split(" ", 1)[0]
        if name in ("mlp", "gbt", "table", "paper-mlp16", "fixed4"):
            rows[name] = [float(x) for x in re.findall(r"-?\d+\.\d+", ln.split("  /")[0])]
    return rows


def test_quickstart_runs_on_the_shipped_log(tmp_path, capsys):
    assert (
        quickstart.main(
            ["--log", str(SHIPPED_LOG), "--out", str(tmp_path), "--policies", "table,fixed", "--bootstrap", "200"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "SYNTHETIC" in text
    assert (tmp_path / "synthetic-table.onnx").exists() and (tmp_path / "synthetic-fixed4.onnx").exists()
    # tok/s, x target [CI], x best fixed [CI], x fixed4, x oracle, mean gamma, ONNX=Py %, p50 us (then the engine)
    table = _quickstart_rows(text)["table"]
    assert table[7] > 1.0  # beats fixed gamma 4 on held-out prompts
    assert [ln.split()[-2] for ln in text.splitlines() if ln.startswith("table ")] == ["python"]


def test_quickstart_prints_what_speckv_eval_prints(tmp_path, capsys):
    """One offline evaluator: the main job's figures equal speckv-eval's for the same policies and log."""
    from speckv_policy.cli import evaluate as eval_cli

    assert (
        quickstart.main(
            ["--log", str(SHIPPED_LOG), "--out", str(tmp_path), "--policies", "gbt,table,fixed", "--bootstrap", "200"]
        )
        == 0
    )
    rows = _quickstart_rows(capsys.readouterr().out)
    assert set(rows) == {"gbt", "table", "fixed4"}
    assert (
        eval_cli.main(
            [
                "--log",
                str(SHIPPED_LOG),
                "--policy",
                str(tmp_path / "*.onnx"),
                "--out",
                str(tmp_path / "eval"),
                "--bootstrap",
                "200",
                "--no-plots",
            ]
        )
        == 0
    )
    capsys.readouterr()
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    arms = result["groups"]["overall"]["arms"]
    for name, nums in rows.items():
        a = arms[f"synthetic-{name}"]
        assert nums[0] == pytest.approx(round(a["tokens_per_second"], 2), abs=0.006), name
        for i, key in ((1, "vs_target"), (4, "vs_best_fixed"), (7, "vs_fixed4"), (8, "vs_oracle")):
            assert nums[i] == pytest.approx(round(a[key], 3), abs=0.0006), (name, key)
        assert nums[9] == pytest.approx(round(a["mean_gamma"], 2), abs=0.006), name
    # the references pay only what they run: the target alone is fixed-0 without a probe
    ref = result["groups"]["overall"]["arms"]["fixed-0"]
    assert ref["vs_target"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "prefix, log_path", [("synthetic", SHIPPED_LOG), ("smollm2", ROOT / "datasets" / "smollm2" / "steps.parquet")]
)
def test_shipped_exports_match_the_shipped_log(prefix, log_path):
    """exported/ was built by `speckv-quickstart --out exported` from the shipped logs (real and SYNTHETIC)."""
    log = read_log(log_path)
    files = sorted(f for f in (ROOT / "exported").glob(f"{prefix}-*.onnx") if "-eagle3-" not in f.name)
    kinds = {f"{prefix}-{k}" for k in ("mlp", "gbt", "table", "paper-mlp16", "fixed4")}
    if prefix == "smollm2":  # decided before drafting: --feature-set pre / gated (datasets/smollm2/build.sh)
        kinds |= {f"{prefix}-{k}-{m}" for k in ("mlp", "gbt", "table") for m in ("pre", "gated")}
    assert {f.stem for f in files} == kinds
    for f in files:
        rt = RuntimePolicy(f)
        name = f.stem.removeprefix(f"{prefix}-")
        base, _, mode = name.partition("-")
        kind = {"fixed4": "fixed"}.get(base, base if mode in ("pre", "gated") else name)
        policy = make_policy(kind, feature_set=mode if mode in ("pre", "gated") else None)
        assert rt.gated == (mode == "gated"), f
        X, y = training_data(log, policy.feature_set, split="train")
        assert rt.metadata["speckv.log_fingerprint"] == data_fingerprint(X, y[:, 0], y[:, 1]), f
        rounds = int(rt.metadata["speckv.history_rounds"])
        assert rounds == (2 if mode in ("pre", "gated") else 0), f  # datasets/smollm2/build.sh
        if rounds == 0:  # fitted on the logged rows alone
            assert rt.metadata["speckv.training_fingerprint"] == rt.metadata["speckv.log_fingerprint"], f
        else:  # fitted on them plus its replayed history: (1 + rounds) times as many rows
            assert int(rt.metadata["speckv.training_rows"]) == (1 + rounds) * len(X), f
        Xh, _ = training_data(log, policy.feature_set, split="heldout")
        assert set(np.unique(rt.decide_batch(Xh))) <= set(rt.candidates.tolist())


def test_synthetic_module_cli(tmp_path, capsys):
    from speckv_policy.cli import synthetic

    out = tmp_path / "s.csv"
    assert synthetic.main([str(out), "--prompts", "5", "--steps", "4"]) == 0
    assert len(read_log(out)) == 5 * 3 * 4


def test_docs_cover_the_schemas():
    from speckv_policy.logs import COLUMNS
    from speckv_policy.schema import FEATURE_SETS

    schema_doc = (ROOT / "docs" / "reference" / "log_schema.md").read_text()
    assert all(f"`{c}`" in schema_doc for c in COLUMNS)
    feature_doc = (ROOT / "docs" / "reference" / "features.md").read_text()
    assert all(f"`{n}`" in feature_doc for fs in FEATURE_SETS.values() for n in fs.names)


def test_export_one_liner_and_reprice(tmp_path, capsys, monkeypatch):
    """`speckv-export model.onnx` as a user first types it, then re-priced for another machine."""
    from dataclasses import replace

    from speckv_policy.objective import CostModel

    monkeypatch.chdir(ROOT)
    out = tmp_path / "model.onnx"
    assert export_cli.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "trained on datasets/smollm2/steps.parquet" in text and "priced with the cost model" in text
    assert f"speckv-export --reprice costs.json {out}" in text
    assert out.read_bytes() == (ROOT / "exported" / "smollm2-gbt.onnx").read_bytes()  # the shipped default
    costs = tmp_path / "costs.json"
    replace(CostModel.relative(draft_cost=0.3, verify_cost_per_token=0.01), machine="Example CPU").save(costs)
    here = tmp_path / "model-here.onnx"
    assert export_cli.main(["--reprice", str(costs), str(out), str(here)]) == 0
    text = capsys.readouterr().out
    assert "re-priced" in text and "measured on Example CPU" in text  # which machine the new prices describe
    # the machine's times; the upfront probe stays the export's (the calibration describes a machine, not a mode)
    assert RuntimePolicy(here).cost_model == replace(CostModel.load(costs), decision_draft_tokens=1)
    log = read_log(ROOT / "datasets" / "smollm2" / "steps.parquet")
    X, _ = training_data(log, "online", split="heldout")
    np.testing.assert_array_equal(RuntimePolicy(here).decide_batch(X), RuntimePolicy(out, costs=costs).decide_batch(X))
    # clear errors, nothing written
    bad = tmp_path / "bad.onnx"
    assert export_cli.main(["--reprice", str(costs), str(out)]) == 2
    assert "--reprice takes INPUT.onnx OUTPUT.onnx" in capsys.readouterr().err
    assert export_cli.main(["--reprice", str(tmp_path / "none.json"), str(out), str(bad)]) == 2
    assert "cost model file not found" in capsys.readouterr().err
    assert (
        export_cli.main(["--reprice", str(costs), str(ROOT / "exported" / "smollm2-paper-mlp16.onnx"), str(bad)]) == 2
    )
    assert "maximises tokens_per_step" in capsys.readouterr().err
    assert not bad.exists()
    monkeypatch.chdir(tmp_path)
    assert export_cli.main([str(tmp_path / "x.onnx")]) == 2
    assert "run from the speckv-policy repository" in capsys.readouterr().err


def test_speckv_eval_with_one_held_out_prompt_reports_without_cis(tmp_path, capsys):
    from speckv_policy.cli import evaluate as eval_cli

    log = read_log(SHIPPED_LOG)
    held = sorted(set(log.loc[log["split"] == "heldout", "prompt_id"]))
    small = log[(log["split"] == "train") | (log["prompt_id"] == held[0])]
    write_log(small, tmp_path / "one.parquet")
    args = ["--log", str(tmp_path / "one.parquet"), "--policy", "exported/synthetic-table.onnx", "--out", str(tmp_path)]
    assert eval_cli.main([*args, "--bootstrap", "100", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "1 prompts" in out and "[no CI: < 2 prompts]" in out


def test_speckv_eval_prices_everything_with_a_calibration(tmp_path, capsys):
    """--costs: the exports are re-priced and the references priced with the given calibration, not the log's times."""
    from speckv_policy.cli import evaluate as eval_cli
    from speckv_policy.objective import CostModel

    dear = tmp_path / "dear.json"  # drafting costs 5 target steps per token: no draft can pay
    CostModel.relative(draft_cost=5.0, verify_cost_per_token=0.5).save(dear)
    policies = ["exported/synthetic-gbt.onnx", "exported/synthetic-paper-mlp16.onnx"]
    common = ["--log", str(SHIPPED_LOG), "--policy", *policies, "--bootstrap", "50", "--no-plots"]
    assert eval_cli.main([*common, "--out", str(tmp_path / "own")]) == 0
    assert eval_cli.main([*common, "--out", str(tmp_path / "dear"), "--costs", str(dear)]) == 0
    own = json.loads((tmp_path / "own" / "eval.json").read_text())["groups"]["overall"]["arms"]
    res = json.loads((tmp_path / "dear" / "eval.json").read_text())
    arms = res["groups"]["overall"]["arms"]
    # re-priced: drafting got dearer, so the GBT drafts far less (its upfront probe, paid anyway, still buys a little)
    assert arms["synthetic-gbt"]["mean_gamma"] < 0.5 * own["synthetic-gbt"]["mean_gamma"]
    assert arms["synthetic-paper-mlp16"]["mean_gamma"] == own["synthetic-paper-mlp16"]["mean_gamma"]  # tokens/step
    assert res["groups"]["overall"]["best_fixed"] == "fixed-0"  # the references pay the calibration's prices too
    assert CostModel.from_dict(res["cost_model"]).draft_ms_per_token == (5.0, 5.0, 5.0)
    assert f"the calibration `{dear}`" in (tmp_path / "dear" / "eval.md").read_text()
    capsys.readouterr()
    # a bad calibration is named, and nothing is written
    (tmp_path / "bad.json").write_text('{"draft_ms_per_token": [1, 2]}')
    for bad, msg in (
        (tmp_path / "none.json", "cost model file not found"),
        (tmp_path / "bad.json", "not a cost model"),
    ):
        assert eval_cli.main([*common, "--out", str(tmp_path / "never"), "--costs", str(bad)]) == 2
        err = capsys.readouterr().err
        assert msg in err and str(bad) in err
    assert not (tmp_path / "never").exists()


def test_export_a_stop_rule_reprice_it_and_the_shipped_one_is_what_the_command_writes(
    log_path, tmp_path, capsys, monkeypatch
):
    from speckv_policy.objective import CostModel
    from speckv_policy.stop import StopRule

    out = tmp_path / "stop.json"
    assert export_cli.main(["--stop-rule", str(out), "--train", str(log_path), "--token-value", "1.2"]) == 0
    text = capsys.readouterr().out
    assert "mode='stop'" in text and "held-out" in text
    rule = StopRule.load(out)
    assert rule.token_value == 1.2 and rule.trained_on["log"] == str(log_path)
    costs = tmp_path / "costs.json"
    cheap = CostModel((1.0,) * 3, (5.0,) * 3, (0.5,) * 3)
    cheap.save(costs)
    assert export_cli.main(["--reprice", str(costs), str(out), str(tmp_path / "here.json")]) == 0
    here = StopRule.load(tmp_path / "here.json")
    assert here.cost_model == cheap and here.curves == rule.curves
    # --gate: a pre-draft gate per compression and decoding; --costs: priced (and the gate fitted) with a calibration
    gated = tmp_path / "gated.json"
    assert export_cli.main(["--stop-rule", str(gated), "--train", str(log_path), "--gate", "--costs", str(costs)]) == 0
    assert "pre-draft gate fitted on" in capsys.readouterr().out
    made = StopRule.load(gated)
    assert made.gates and set(made.gates) <= set(made.curves) and made.cost_model == cheap and not rule.gates
    assert export_cli.main([str(tmp_path / "p.onnx"), "--gate"]) == 2
    assert "go with --stop-rule" in capsys.readouterr().err
    # errors: a policy kind with --stop-rule, a bad token value, a missing log; a failed write keeps the old file
    before = out.read_bytes()
    assert export_cli.main(["--stop-rule", str(out), "--policy", "gbt"]) == 2
    assert export_cli.main(["--stop-rule", str(out), "--token-value", "0"]) == 2
    assert export_cli.main(["--stop-rule", str(out), "--train", str(tmp_path / "none.parquet")]) == 2
    assert "step log not found" in capsys.readouterr().err and out.read_bytes() == before
    # the shipped rule is what datasets/smollm2/build.sh's command writes (curves to float rounding across machines)
    monkeypatch.chdir(ROOT)
    again = tmp_path / "again.json"
    assert export_cli.main(["--stop-rule", str(again), "--train", "datasets/smollm2/steps.parquet"]) == 0
    shipped, made = StopRule.load(ROOT / "exported" / "smollm2-stop.json"), StopRule.load(again)
    assert shipped.cost_model == made.cost_model and shipped.trained_on == made.trained_on
    assert (
        set(shipped.curves)
        == set(made.curves)
        == {(c, d) for c in ("fp32", "int8", "nf4") for d in ("greedy", "sampling")}
    )
    for key, pair in shipped.curves.items():
        for a, b in zip(pair, made.curves[key]):
            assert a.rows == b.rows and np.allclose(
                [a.intercept, *a.coef], [b.intercept, *b.coef], rtol=1e-4, atol=1e-6
            )


def test_every_option_of_every_command_has_a_help_line_and_the_reference_is_current():
    from speckv_policy.cli import reference

    missing = [
        f"{parser.prog} {action.option_strings or action.dest}"
        for _, module, _ in reference.COMMANDS
        for parser in reference.parsers(module)
        for action in reference.actions(parser)
        if not action.help
    ]
    assert not missing, missing
    shipped = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert shipped == reference.render(), "run python -m speckv_policy.cli.reference"
