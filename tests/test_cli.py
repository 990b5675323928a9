"""speckv-export and speckv-quickstart end to end, and the shipped artefacts."""

from __future__ import annotations

import json
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
    assert export_cli.main([str(first), "--train", str(log_path), "--policy", "table", "--candidates", "0,1,2,4",
                            "--objective", "tokens_per_step", "--decision-draft-tokens", "1",
                            "--save-policy", str(saved)]) == 0
    second = tmp_path / "b.onnx"
    assert export_cli.main([str(second), "--policy", str(saved)]) == 0
    meta = RuntimePolicy(second).metadata
    assert json.loads(meta["speckv.candidates"]) == [0, 1, 2, 4]
    assert meta["speckv.objective"] == "tokens_per_step"
    assert json.loads(meta["speckv.cost_model"])["decision_draft_tokens"] == 1
    capsys.readouterr()


def test_export_errors(log_path, tmp_path, capsys):
    out = tmp_path / "x.onnx"
    assert export_cli.main([str(out), "--policy", "gbt"]) == 2
    assert "add --train LOG" in capsys.readouterr().err
    assert export_cli.main([str(out), "--policy", str(tmp_path / "missing.joblib")]) == 2
    junk = tmp_path / "junk.joblib"
    joblib.dump({"not": "a policy"}, junk)
    assert export_cli.main([str(out), "--policy", str(junk)]) == 2
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


def test_quickstart_runs_on_the_shipped_log(tmp_path, capsys):
    assert quickstart.main(["--log", str(SHIPPED_LOG), "--out", str(tmp_path), "--policies", "table,fixed"]) == 0
    text = capsys.readouterr().out
    assert "SYNTHETIC" in text
    assert (tmp_path / "synthetic-table.onnx").exists() and (tmp_path / "synthetic-fixed4.onnx").exists()
    line = next(ln for ln in text.splitlines() if ln.startswith("table"))
    assert float(line.split()[2]) > 1.0  # beats fixed gamma 4 on held-out prompts


def test_shipped_exports_match_the_shipped_log():
    """exported/ was built by `speckv-quickstart --out exported` from the shipped log."""
    log = read_log(SHIPPED_LOG)
    files = sorted((ROOT / "exported").glob("synthetic-*.onnx"))
    assert {f.stem for f in files} == {f"synthetic-{k}" for k in ("mlp", "gbt", "table", "paper-mlp16", "fixed4")}
    for f in files:
        rt = RuntimePolicy(f)
        kind = {"fixed4": "fixed"}.get(f.stem.removeprefix("synthetic-"), f.stem.removeprefix("synthetic-"))
        policy = make_policy(kind)
        X, y = training_data(log, policy.feature_set, split="train")
        assert rt.metadata["speckv.training_fingerprint"] == data_fingerprint(X, y[:, 0], y[:, 1]), f
        Xh, _ = training_data(log, policy.feature_set, split="heldout")
        assert set(np.unique(rt.decide_batch(Xh))) <= set(rt.candidates.tolist())


def test_synthetic_module_cli(tmp_path, capsys):
    from speckv_policy import synthetic

    out = tmp_path / "s.csv"
    assert synthetic.main([str(out), "--prompts", "5", "--steps", "4"]) == 0
    assert len(read_log(out)) == 5 * 3 * 4


def test_docs_cover_the_schemas():
    from speckv_policy.logs import COLUMNS
    from speckv_policy.schema import FEATURE_SETS

    schema_doc = (ROOT / "docs" / "log_schema.md").read_text()
    assert all(f"`{c}`" in schema_doc for c in COLUMNS)
    feature_doc = (ROOT / "docs" / "features.md").read_text()
    assert all(f"`{n}`" in feature_doc for fs in FEATURE_SETS.values() for n in fs.names)
