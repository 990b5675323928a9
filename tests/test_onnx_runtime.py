"""ONNX export parity, metadata, the runtime policy and its failure modes."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest

from speckv_policy.export import build_onnx, export_onnx, reprice_onnx, write_onnx
from speckv_policy.objective import CostModel
from speckv_policy.runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from speckv_policy.schema import ONLINE, get_feature_set
from speckv_policy.training import with_cost_model

from .conftest import edge_rows

NAMES = ["mlp", "gbt", "table", "fixed", "paper-mlp16"]


@pytest.fixture(scope="module")
def exported(fitted, tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    return {n: (export_onnx(fitted[n], d / f"{n}.onnx"), d / f"{n}.onnx") for n in NAMES}


def _rows(name, heldout):
    fs = get_feature_set("paper" if name == "paper-mlp16" else "online")
    X, _ = heldout[fs.name]
    edges = edge_rows(fs.names, np.random.default_rng(0))
    return np.vstack([X.to_numpy(np.float32), edges]), len(edges)


@pytest.mark.parametrize("name", NAMES)
def test_onnx_matches_python(name, fitted, exported, heldout):
    policy = fitted[name]
    model, path = exported[name]
    onnx.checker.check_model(model, full_check=True)
    X, n_edge = _rows(name, heldout)
    assert X.shape[0] - n_edge >= 1000
    rt = RuntimePolicy(path)
    out = rt.expected_values(X)
    py = policy.expected_values(X)
    np.testing.assert_allclose(out["values"], py["objective"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["expected_tokens"], py["tokens_per_step"], rtol=1e-4, atol=1e-4)
    same = out["gamma"] == policy.predict(X)
    if not same.all():  # only float32-vs-float64 near-ties may differ
        top2 = np.sort(py["objective"], axis=1)[:, -2:]
        gap = (top2[:, 1] - top2[:, 0]) / np.abs(top2[:, 1])
        assert (gap[~same] < 1e-5).all(), "ONNX and Python disagree away from a tie"
    assert same.mean() >= 0.999
    # the single-row path gives the same answers
    for i in range(0, X.shape[0], 97):
        assert rt.decide(X[i]) == out["gamma"][i]


@pytest.mark.parametrize("name", NAMES)
def test_metadata_describes_the_policy(name, fitted, exported):
    model, _ = exported[name]
    meta = {p.key: p.value for p in model.metadata_props}
    p = fitted[name]
    fs = get_feature_set(p.feature_set_)
    assert json.loads(meta["speckv.feature_names"]) == list(fs.names)
    assert meta["speckv.feature_set"] == fs.name
    assert json.loads(meta["speckv.candidates"]) == p.candidates_.tolist()
    assert meta["speckv.objective"] == p.objective
    assert json.loads(meta["speckv.cost_model"])["verify_base_ms"] == list(p.cost_model_.verify_base_ms)
    assert meta["speckv.training_fingerprint"] == p.training_fingerprint_
    assert json.loads(meta["speckv.compression_codes"])["nf4"] == 2
    assert "speckv.package_version" in meta


def test_export_refuses_generic_feature_set():
    from speckv_policy.policies import TablePolicy

    p = TablePolicy(feature_set=None).fit(np.random.default_rng(0).random((50, 3)), np.arange(50) % 5)
    with pytest.raises(ValueError, match="named feature_set"):
        build_onnx(p)


def test_truncated_file(exported, tmp_path):
    _, path = exported["gbt"]
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(PolicyLoadError, match="truncated.onnx: not a loadable ONNX model"):
        RuntimePolicy(bad)
    with pytest.warns(PolicyFallbackWarning, match="fallback gamma 3"):
        rt = RuntimePolicy(bad, fallback_gamma=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        assert rt.decide(np.zeros(7, np.float32)) == 3
        assert rt.decide([0.5] * 7) == 3
    with pytest.raises(PolicyLoadError, match="no such policy file"):
        RuntimePolicy(tmp_path / "missing.onnx")


def _with_meta(model, tmp_path, **changes):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for prop in m.metadata_props:
        if prop.key in changes:
            prop.value = changes[prop.key]
    path = tmp_path / "tampered.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def test_feature_order_mismatch(exported, tmp_path):
    model, _ = exported["mlp"]
    names = list(ONLINE.names)
    names[0], names[1] = names[1], names[0]
    path = _with_meta(model, tmp_path, **{"speckv.feature_names": json.dumps(names)})
    with pytest.raises(PolicyLoadError, match="feature schema mismatch for set 'online'"):
        RuntimePolicy(path)
    path = _with_meta(model, tmp_path, **{"speckv.feature_schema_version": "99"})
    with pytest.raises(PolicyLoadError, match="v99"):
        RuntimePolicy(path)
    path = _with_meta(model, tmp_path, **{"speckv.feature_set": "mystery"})
    with pytest.raises(PolicyLoadError, match="unknown feature set 'mystery'"):
        RuntimePolicy(path)


def test_foreign_onnx_model(tmp_path):
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "foreign.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(PolicyLoadError, match="not a speckv-policy export"):
        RuntimePolicy(path)


def test_nan_features_error_or_single_warning(exported):
    _, path = exported["table"]
    rt = RuntimePolicy(path)
    x = np.full(7, 0.5, np.float32)
    x[3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        rt.decide(x)
    with pytest.raises(ValueError, match="non-finite feature values .* in: prev_accept_rate"):
        rt.decide_batch(x[None, :])
    safe = RuntimePolicy(path, fallback_gamma=1)
    with pytest.warns(PolicyFallbackWarning) as rec:
        assert safe.decide(x) == 1
        assert safe.decide(np.array([np.inf] * 7)) == 1
        assert safe.decide({"conf_first": 0.5}) == 1  # missing features
    assert len(rec) == 1
    assert safe.decide(np.full(7, 0.5, np.float32)) in rt.candidates  # still decides good input


def test_runtime_decide_accepts_mappings(exported, heldout):
    _, path = exported["gbt"]
    rt = RuntimePolicy(path)
    X, _ = heldout["online"]
    row = X.iloc[0]
    assert rt.decide(row.to_dict()) == rt.decide(row.to_numpy(np.float32)) == rt.decide(list(row))
    with pytest.raises(ValueError, match="one step's features"):
        rt.decide(X.to_numpy(np.float32)[:2])


def test_cuda_request_without_provider(exported):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA provider present: covered by benchmarks/gpu_check.sh")
    with pytest.raises(PolicyLoadError, match="CUDA was requested"):
        RuntimePolicy(exported["gbt"][1], providers="cuda")
    assert RuntimePolicy(exported["gbt"][1]).provider == "CPUExecutionProvider"


def test_runtime_imports_neither_sklearn_nor_torch(exported):
    code = (
        "import sys, numpy as np\n"
        "from speckv_policy.runtime import RuntimePolicy\n"
        f"rt = RuntimePolicy({str(exported['mlp'][1])!r})\n"
        "rt.decide(np.array([0.5, 0.5, 0, 0.5, 0.5, 0.5, 0.5], np.float32))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'torch', 'pandas', 'skl2onnx', 'pyarrow'))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# a cost regime unlike the fitted one: verification nearly flat in gamma, a dear draft (GPU-like relative costs)
OTHER_COSTS = CostModel.relative(draft_cost=0.3, verify_cost_per_token=0.01)


def test_repricing_keeps_the_exports_probe(tmp_path):
    """A calibration describes a machine (no probe); an upfront export re-priced with it still pays its probe."""
    from dataclasses import replace
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    calib = CostModel.load(root / "benchmarks" / "runs" / "pre_costs.json")
    assert calib.decision_draft_tokens == 0
    rng = np.random.default_rng(0)
    for name, probe in (("smollm2-gbt", 1), ("smollm2-gbt-pre", 0)):
        path = root / "exported" / f"{name}.onnx"
        rt = RuntimePolicy(path, costs=calib)
        assert rt.cost_model == replace(calib, decision_draft_tokens=probe)
        rows = edge_rows(rt.feature_set.names, rng)
        want = RuntimePolicy(path, costs=replace(calib, decision_draft_tokens=probe)).decide_batch(rows)
        np.testing.assert_array_equal(rt.decide_batch(rows), want)
        write_onnx(reprice_onnx(onnx.load(path), calib), tmp_path / f"{name}.onnx")  # the file keeps it too
        in_file = RuntimePolicy(tmp_path / f"{name}.onnx")
        assert in_file.cost_model.decision_draft_tokens == probe
        np.testing.assert_array_equal(in_file.decide_batch(rows), want)
    # the probe really is priced: gamma 0 of the upfront export costs one draft token more than without it
    up = RuntimePolicy(root / "exported" / "smollm2-gbt.onnx", costs=calib).cost_model
    assert up.step_ms(0, 0) == pytest.approx(calib.step_ms(0, 0) + calib.draft_ms(1, 0))


@pytest.mark.parametrize("name", ["mlp", "gbt", "table", "fixed"])
def test_repricing_at_load_and_in_the_file_match_python(name, fitted, exported, heldout, tmp_path):
    """Re-pricing keeps the acceptance model and changes only the prices, identically in Python, the runtime and ONNX."""
    policy = fitted[name]
    model, path = exported[name]
    X, _ = _rows(name, heldout)
    py = with_cost_model(policy, OTHER_COSTS)
    want = py.predict(X)
    rt = RuntimePolicy(path, costs=OTHER_COSTS)
    assert rt.repriced and rt.repriceable and rt.cost_model == OTHER_COSTS and "repriced" in repr(rt)
    got = rt.decide_batch(X)
    assert (got == want).mean() >= 0.999
    if name != "fixed":
        assert (got != RuntimePolicy(path).decide_batch(X)).mean() > 0.05  # the prices really moved decisions
    for i in range(0, X.shape[0], 97):
        assert rt.decide(X[i]) == got[i]
    np.testing.assert_allclose(rt.expected_values(X)["values"], py.expected_values(X)["objective"], rtol=1e-4)
    # the same decision written into the file
    new = reprice_onnx(model, OTHER_COSTS)
    onnx.checker.check_model(new, full_check=True)
    out = tmp_path / "repriced.onnx"
    write_onnx(new, out)
    rt2 = RuntimePolicy(out)
    np.testing.assert_array_equal(rt2.decide_batch(X), got)
    assert CostModel.from_dict(json.loads(rt2.metadata["speckv.cost_model"])) == OTHER_COSTS
    assert (
        rt2.metadata["speckv.repriced_from"]
        == model.metadata_props[[p.key for p in model.metadata_props].index("speckv.cost_model")].value
    )
    assert len(new.graph.node) <= len(model.graph.node) + 2  # the old decision tail is gone, not kept beside the new
    # re-pricing with the export's own costs changes nothing
    np.testing.assert_array_equal(
        RuntimePolicy(path, costs=policy.cost_model_).decide_batch(X), RuntimePolicy(path).decide_batch(X)
    )


def test_tokens_per_step_exports_cannot_be_repriced(exported, tmp_path):
    model, path = exported["paper-mlp16"]
    assert not RuntimePolicy(path).repriceable
    with pytest.raises(PolicyLoadError, match="maximises tokens_per_step"):
        RuntimePolicy(path, costs=OTHER_COSTS)
    with pytest.raises(ValueError, match="maximises tokens_per_step"):
        reprice_onnx(model, OTHER_COSTS)


def test_cost_model_files(exported, tmp_path):
    _, path = exported["gbt"]
    good = tmp_path / "costs.json"
    OTHER_COSTS.save(good)
    assert RuntimePolicy(path, costs=good).cost_model == OTHER_COSTS
    with pytest.raises(PolicyLoadError, match="cost model file not found"):
        RuntimePolicy(path, costs=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PolicyLoadError, match="bad.json: not a JSON cost model"):
        RuntimePolicy(path, costs=bad)
    bad.write_text('{"draft_ms_per_token": [1, 1, 1], "colour": "blue"}')
    with pytest.raises(PolicyLoadError, match="unknown fields colour; missing fields verify_base_ms"):
        RuntimePolicy(path, costs=bad)
    # with a fallback gamma a bad cost model falls back instead of raising
    with pytest.warns(PolicyFallbackWarning):
        rt = RuntimePolicy(path, costs=bad, fallback_gamma=3)
    assert rt.decide(np.zeros(ONLINE.n_features, np.float32)) == 3
    with pytest.raises(ValueError, match="step times must be"):
        RuntimePolicy(path).set_step_times(np.ones((3, 2)))


@pytest.mark.parametrize("name", NAMES)
def test_skl2onnx_converts_policies_and_pipelines(name, fitted, heldout, online_data, paper_data):
    """`skl2onnx.to_onnx` works on every policy and on a Pipeline ending in one (registered on import)."""
    import onnxruntime as ort
    from skl2onnx import to_onnx
    from sklearn.base import clone
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import make_pipeline

    policy = fitted[name]
    X, n_edge = _rows(name, heldout)
    assert X.shape[0] - n_edge >= 1000

    def decisions(model, rows):
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert [o.name for o in sess.get_outputs()][0] == "gamma"
        return sess.run(None, {sess.get_inputs()[0].name: rows})[0]

    model = to_onnx(policy, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    onnx.checker.check_model(model, full_check=True)
    assert (decisions(model, X) == policy.predict(X)).mean() >= 0.999
    (Xtr, ytr), _ = paper_data if name == "paper-mlp16" else online_data
    pipe = make_pipeline(SimpleImputer(), clone(policy)).fit(Xtr.to_numpy(np.float32), ytr)
    model = to_onnx(pipe, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    assert (decisions(model, X) == pipe.predict(X)).mean() >= 0.999
    # float64 input is cast to the float32 the policy decides on
    model64 = to_onnx(policy, X[:1].astype(np.float64), target_opset={"": 18, "ai.onnx.ml": 3})
    assert (decisions(model64, X.astype(np.float64)) == policy.predict(X)).mean() >= 0.999


@pytest.mark.parametrize("kind", ["mlp", "gbt", "table"])
def test_pre_feature_set_exports_match_python(kind, synthetic, tmp_path):
    """Policies decided before drafting ('pre' features) export and run like the others: parity on held-out and edge rows."""
    from speckv_policy.policies import training_data
    from speckv_policy.training import make_policy

    synthetic_log = synthetic[0]
    cost = CostModel.fit(synthetic_log, decision_draft_tokens=0)
    X, y = training_data(synthetic_log, "pre", split="train")
    policy = make_policy(kind, cost_model=cost, feature_set="pre").fit(X, y)
    model = export_onnx(policy, tmp_path / f"{kind}-pre.onnx")
    onnx.checker.check_model(model, full_check=True)
    rt = RuntimePolicy(tmp_path / f"{kind}-pre.onnx")
    assert rt.feature_set.name == "pre" and rt.metadata["speckv.feature_set"] == "pre"
    Xh, _ = training_data(synthetic_log, "pre", split="heldout")
    rows = np.vstack([Xh.to_numpy(np.float32), edge_rows(get_feature_set("pre").names, np.random.default_rng(1))])
    out = rt.expected_values(rows)
    py = policy.expected_values(rows)
    np.testing.assert_allclose(out["expected_tokens"], py["tokens_per_step"], rtol=1e-4, atol=1e-4)
    assert (out["gamma"] == policy.predict(rows)).mean() >= 0.999
