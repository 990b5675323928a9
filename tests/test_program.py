"""Decision programs: the Python engine decides exactly as the ONNX graph does, and refuses what it cannot."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from speckv_policy.export import build_onnx, export_onnx, reprice_onnx, write_onnx
from speckv_policy.objective import CostModel
from speckv_policy.policies import GBTPolicy, training_data
from speckv_policy.program import DecisionProgram, ProgramError, float32_row
from speckv_policy.runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from speckv_policy.schema import get_feature_set
from speckv_policy.training import make_policy

from .conftest import edge_rows


@pytest.fixture(scope="module")
def exports(fitted, synthetic, tmp_path_factory):
    """Upfront (every kind), pre and gated (GBT and table) exports of policies fitted on the synthetic log."""
    d = tmp_path_factory.mktemp("program")
    log = synthetic[0]
    out = {}
    for name, policy in fitted.items():
        export_onnx(policy, d / f"{name}.onnx")
        out[name] = d / f"{name}.onnx"
    for fs, ddt in (("pre", 0), ("gated", 1)):
        X, y = training_data(log, fs, "train")
        cm = CostModel.fit(log, decision_draft_tokens=ddt)
        for kind in ("gbt", "table"):
            p = make_policy(kind, feature_set=fs, cost_model=cm).fit(X, y)
            export_onnx(p, d / f"{kind}-{fs}.onnx")
            out[f"{kind}-{fs}"] = d / f"{kind}-{fs}.onnx"
    return out


def _rows(synthetic, fs_name: str) -> np.ndarray:
    X, _ = training_data(synthetic[0], fs_name, "heldout")
    fs = get_feature_set(fs_name)
    return np.vstack([X.to_numpy(np.float32), edge_rows(fs.names, np.random.default_rng(0))])


def _same_decisions(a: list, b: list, values: np.ndarray) -> None:
    """Equal, but where the graph's best two values tie within float32 rounding."""
    a, b = np.asarray(a), np.asarray(b)
    differ = a != b
    if differ.any():
        top2 = np.sort(values[differ], axis=1)[:, -2:]
        assert ((top2[:, 1] - top2[:, 0]) <= 1e-5 * np.abs(top2[:, 1])).all(), "engines disagree away from a tie"
    assert differ.mean() <= 0.001


@pytest.mark.parametrize(
    "name, fs",
    [("gbt", "online"), ("table", "online"), ("fixed", "online"), ("gbt-pre", "pre"), ("table-pre", "pre")],
)
def test_python_engine_decides_as_the_graph(name, fs, exports, synthetic):
    X = _rows(synthetic, fs)
    py = RuntimePolicy(exports[name], engine="python")
    ort = RuntimePolicy(exports[name], engine="onnxruntime")
    assert py.engine == "python" and ort.engine == "onnxruntime" and py.program_error is None
    values = ort.expected_values(X)
    _same_decisions([py.decide(r) for r in X], values["gamma"].tolist(), values["values"])
    # expected tokens, not just the argmax
    head = py.program
    mine = np.array([head.expected_tokens(float32_row(r)) for r in X])
    np.testing.assert_allclose(mine, values["expected_tokens"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gbt", "table"])
def test_python_engine_gates_and_sizes_as_the_graph(kind, exports, synthetic):
    X = _rows(synthetic, "gated")
    path = exports[f"{kind}-gated"]
    py, ort = RuntimePolicy(path, engine="python"), RuntimePolicy(path, engine="onnxruntime")
    assert py.gated and py.engine == "python"
    gamma, opened = ort.decide_gated_batch(X)
    assert opened.any()
    gate_py = [py.decide_gate(r) for r in X]
    assert gate_py == opened.tolist()
    values = ort.expected_values(X)
    _same_decisions([py.decide(r) for r in X], values["gamma"].tolist(), values["values"])


def test_python_engine_follows_repricing_and_live_step_times(exports, synthetic):
    X = _rows(synthetic, "pre")
    dear_draft = CostModel.from_dict({**CostModel.fit(synthetic[0]).to_dict(), "draft_ms_per_token": [9.0, 9.0, 9.0]})
    for engine_kw in ({"costs": dear_draft}, {}):
        py = RuntimePolicy(exports["gbt-pre"], engine="python", **engine_kw)
        ort = RuntimePolicy(exports["gbt-pre"], engine="onnxruntime", **engine_kw)
        if not engine_kw:  # live step times, as costs='live' sets them every step
            times = np.full((3, len(py.candidates)), 10.0) + 3.0 * py.candidates
            py.set_step_times(times)
            ort.set_step_times(times)
        values = ort.expected_values(X)
        _same_decisions([py.decide(r) for r in X], ort.decide_batch(X).tolist(), values["values"])
    # a repriced gated export: gate priced without the probe, head with it, as the graph does
    path = exports["gbt-gated"]
    Xg = _rows(synthetic, "gated")
    py = RuntimePolicy(path, engine="python", costs=dear_draft)
    ort = RuntimePolicy(path, engine="onnxruntime", costs=dear_draft)
    opened = ort.decide_gated_batch(Xg)[1]
    assert 0.02 < opened.mean() < 0.98, "the check needs both gate outcomes"
    assert [py.decide_gate(r) for r in Xg] == opened.tolist()


@pytest.mark.parametrize("name, fs", [("table-pre", "pre"), ("table", "online"), ("table-gated", "gated")])
def test_memoised_decisions_follow_every_price_change(name, fs, exports, synthetic):
    """A table's decisions are memoised per cell and code; one object re-priced in turn decides as fresh graphs do."""
    X = _rows(synthetic, fs)
    base = CostModel.fit(synthetic[0], decision_draft_tokens=1 if fs == "gated" else 0)
    dear = CostModel.from_dict({**base.to_dict(), "draft_ms_per_token": [40.0, 40.0, 40.0]})
    py = RuntimePolicy(exports[name], engine="python")
    assert py.program.cell_of is not None, "a table head has cells"

    def decisions(rt):
        decide = rt.decide_gate if fs == "gated" else rt.decide
        mine = [decide(r) for r in X]
        # a list row, as the hook passes one, takes the memo's short path: the same decisions
        assert [decide(r.tolist()) for r in X] == mine
        return mine

    def graph(cost_model=None, times=None):
        ort = RuntimePolicy(exports[name], engine="onnxruntime", costs=cost_model)
        if times is not None:
            ort.set_step_times(times)
        if fs == "gated":
            return ort.decide_gated_batch(X)[1].tolist(), None
        return ort.decide_batch(X).tolist(), ort.expected_values(X)["values"]

    def check(expected):
        mine = decisions(py)
        if expected[1] is None:
            assert mine == expected[0]
        else:
            _same_decisions(mine, expected[0], expected[1])
        return mine

    before = check(graph())
    check(graph())  # again, from the memo
    after = check((py.reprice(dear), graph(dear))[1])
    assert before != after, "a 40 ms draft token must change some decisions, or the test shows nothing"
    if fs != "gated":  # live step times, as costs='live' sets them every step
        times = np.full((3, len(py.candidates)), 50.0) + 0.5 * py.candidates
        py.set_step_times(times)
        assert check(graph(times=times)) != after


@pytest.mark.parametrize("name", ["gbt", "table", "fixed", "mlp", "gbt-pre", "table-pre", "gbt-gated", "table-gated"])
def test_features_a_policy_does_not_read_never_change_its_decisions(name, exports, synthetic):
    """``read_features`` may leave a feature out only if no value of it changes a decision (the graph's included)."""
    rt = RuntimePolicy(exports[name])
    names = rt.feature_set.names
    if rt.engine != "python":
        assert rt.read_features == names, "without a decision program every feature counts as read"
        return
    assert "compression_code" in rt.read_features
    unread = [j for j, n in enumerate(names) if n not in rt.read_features]
    if name in ("fixed", "table", "table-pre"):
        assert unread, "a fixed gamma or a table over a few columns reads less than the whole row"
    X = _rows(synthetic, rt.feature_set.name)
    Y = X.copy()
    Y[:, unread] = np.random.default_rng(1).uniform(-5.0, 60.0, (len(X), len(unread))).astype(np.float32)
    graph = RuntimePolicy(exports[name], engine="onnxruntime")
    assert [rt.decide(r) for r in Y] == [rt.decide(r) for r in X]
    assert graph.decide_batch(Y).tolist() == graph.decide_batch(X).tolist()
    if rt.gated:
        assert [rt.decide_gate(r) for r in Y] == [rt.decide_gate(r) for r in X]
        assert graph.decide_gated_batch(Y)[1].tolist() == graph.decide_gated_batch(X)[1].tolist()


def test_bad_values_in_a_list_row_are_refused_with_a_warm_memo(exports, synthetic):
    py = RuntimePolicy(exports["table-pre"], engine="python")
    X = _rows(synthetic, "pre")
    for r in X:
        py.decide(r.tolist())  # every cell these rows reach is memoised
    for j, name in enumerate(py.feature_set.names):
        for bad in (float("nan"), float("inf")):
            row = X[0].tolist()
            row[j] = bad
            with pytest.raises(ValueError, match=f"non-finite feature values \\(NaN or inf\\) in: {name}$"):
                py.decide(row)
            with pytest.raises(ValueError, match=f"in: {name}$"):  # a float32 array names it too
                py.decide(np.asarray(row, dtype=np.float32))


def test_a_repriced_file_keeps_its_program(exports, synthetic, tmp_path):
    cm = CostModel.from_dict({**CostModel.fit(synthetic[0]).to_dict(), "draft_base_ms": [4.0, 4.0, 4.0]})
    out = tmp_path / "repriced.onnx"
    write_onnx(reprice_onnx(onnx.load(exports["gbt-gated"]), cm), out)
    py, ort = RuntimePolicy(out, engine="python"), RuntimePolicy(out, engine="onnxruntime")
    X = _rows(synthetic, "gated")
    assert [py.decide_gate(r) for r in X] == ort.decide_gated_batch(X)[1].tolist()


def test_auto_uses_the_program_where_there_is_one(exports):
    assert RuntimePolicy(exports["gbt-gated"]).engine == "python"
    mlp = RuntimePolicy(exports["mlp"])
    assert mlp.engine == "onnxruntime" and "no decision program" in mlp.program_error
    with pytest.raises(PolicyLoadError, match="engine='python' needs a usable decision program"):
        RuntimePolicy(exports["mlp"], engine="python")
    with pytest.raises(ValueError, match="engine must be one of"):
        RuntimePolicy(exports["gbt"], engine="numpy")
    assert "engine=python" in repr(RuntimePolicy(exports["gbt"]))


def _with_program(path, tmp_path, edit):
    model = onnx.load(path)
    meta = {p.key: p.value for p in model.metadata_props}
    program = json.loads(meta["speckv.program"])
    edit(program)
    meta["speckv.program"] = json.dumps(program)
    del model.metadata_props[:]
    helper.set_model_props(model, meta)
    out = tmp_path / "edited.onnx"
    write_onnx(model, out)
    return out


def test_a_program_that_disagrees_with_the_graph_is_not_used(exports, tmp_path):
    def nudge(program):  # one leaf of one tree, as a hand edit or a corrupted file would
        w = program["decide"]["ensemble"]["class_weights"]
        w[0] += 5.0

    path = _with_program(exports["gbt"], tmp_path, nudge)
    auto = RuntimePolicy(path)
    assert auto.engine == "onnxruntime" and "differ from the graph's" in auto.program_error
    with pytest.raises(PolicyLoadError, match="differ from the graph's"):
        RuntimePolicy(path, engine="python")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p.update(version=99), "newer than this runtime reads"),
        (lambda p: p["decide"].update(kind="svm"), "unknown program kind 'svm'"),
        (lambda p: p["decide"]["ensemble"].update(nodes_modes=["BRANCH_LT"] * 3), "differ in length"),
        (lambda p: p["decide"]["ensemble"].pop("nodes_values"), "malformed 'gbt' program"),
        (lambda p: p["decide"].update(candidates=[0, 1]), "candidates or heads differ"),
        (lambda p: p["decide"]["ensemble"]["nodes_values"].__setitem__(0, float("nan")), "not finite"),
    ],
)
def test_a_malformed_program_is_named_and_the_graph_decides(edit, message, exports, tmp_path):
    path = _with_program(exports["gbt"], tmp_path, edit)
    auto = RuntimePolicy(path)
    assert auto.engine == "onnxruntime" and message in auto.program_error
    assert auto.decide(np.zeros(len(auto.feature_set.names), np.float32)) in auto.candidates


def test_python_engine_failures_fall_back_like_the_graph(exports):
    rt = RuntimePolicy(exports["gbt-pre"], engine="python", fallback_gamma=2)
    bad = np.zeros(len(rt.feature_set.names), np.float32)
    bad[2] = np.nan
    with pytest.warns(PolicyFallbackWarning, match="non-finite"):
        assert rt.decide(bad) == 2
    strict = RuntimePolicy(exports["gbt-pre"], engine="python")
    with pytest.raises(ValueError, match="non-finite"):
        strict.decide(bad)
    with pytest.raises(ValueError, match="one step's features"):
        strict.decide(np.zeros((2, len(rt.feature_set.names)), np.float32))
    # lists and mappings go through the same checks and give the array's answer
    row = np.linspace(0, 1, len(rt.feature_set.names), dtype=np.float32)
    assert strict.decide(row.tolist()) == strict.decide(row) == strict.decide(dict(zip(rt.feature_set.names, row)))


def test_gbt_program_of_a_constant_hazard_policy(synthetic, tmp_path):
    X, y = training_data(synthetic[0], "online", "train")
    y = y.copy()
    y[:, 0] = y[:, 1]  # every drafted token accepted: no booster, one hazard
    p = GBTPolicy(cost_model=CostModel.fit(synthetic[0])).fit(X, y)
    assert p.model_ is None
    export_onnx(p, tmp_path / "c.onnx")
    rt = RuntimePolicy(tmp_path / "c.onnx", engine="python")
    assert json.loads(rt.metadata["speckv.program"])["decide"]["kind"] == "constant"
    ort = RuntimePolicy(tmp_path / "c.onnx", engine="onnxruntime")
    Xn = X.to_numpy(np.float32)[:50]
    assert [rt.decide(r) for r in Xn] == ort.decide_batch(Xn).tolist()


def test_program_metadata_is_data(fitted):
    """Numbers and names only: the program is JSON, and nothing in it is code."""
    meta = {p.key: p.value for p in build_onnx(fitted["gbt"]).metadata_props}
    program = json.loads(meta["speckv.program"])
    assert program["version"] == 1 and program["decide"]["kind"] == "gbt"
    ens = program["decide"]["ensemble"]
    assert set(ens["nodes_modes"]) <= {"BRANCH_LEQ", "LEAF"} and ens["post_transform"] == "LOGISTIC"
    assert "speckv.program" not in {p.key: p.value for p in build_onnx(fitted["mlp"]).metadata_props}


def test_program_errors_are_specific():
    with pytest.raises(ProgramError, match="unknown program kind"):
        DecisionProgram({"kind": "forest", "candidates": [0, 1]})
    with pytest.raises(ProgramError, match="malformed 'table' program"):
        DecisionProgram({"kind": "table", "candidates": [0, 1]})
    with pytest.raises(ProgramError, match="survival curve has 2 positions"):
        DecisionProgram({"kind": "constant", "candidates": [0, 3], "n_features": 2, "survival": [0.5, 0.25]})
    with pytest.raises(ProgramError, match="do not fit together"):
        DecisionProgram(
            {
                "kind": "table",
                "candidates": [0, 1],
                "n_features": 2,
                "columns": [0],
                "edges": [[0.5, 0.25]],
                "strides": [1],
                "survival": [[0.5]] * 3,
            }
        )


def _tree(ens, branches, true, false):
    """``ens`` with one tree of nodes 0..n-1 on feature 0 (threshold 0.5): ``branches[i]`` says whether node i tests."""
    n = len(branches)
    return {
        **ens,
        "nodes_treeids": [0] * n,
        "nodes_nodeids": list(range(n)),
        "nodes_featureids": [0] * n,
        "nodes_values": [0.5 if b else 0.0 for b in branches],
        "nodes_modes": ["BRANCH_LEQ" if b else "LEAF" for b in branches],
        "nodes_truenodeids": true,
        "nodes_falsenodeids": false,
    }


def test_tree_ensemble_cycle_and_roots_are_refused():
    ens = {
        "nodes_treeids": [0, 0, 0],
        "nodes_nodeids": [0, 1, 2],
        "nodes_featureids": [0, 0, 0],
        "nodes_values": [0.5, 0.0, 0.0],
        "nodes_modes": ["BRANCH_LEQ", "LEAF", "LEAF"],
        "nodes_truenodeids": [1, 0, 0],
        "nodes_falsenodeids": [2, 0, 0],
        "class_treeids": [0, 0],
        "class_nodeids": [1, 2],
        "class_ids": [0, 0],
        "class_weights": [-1.0, 1.0],
        "base_values": [0.0],
        "post_transform": "LOGISTIC",
    }
    spec = {"kind": "gbt", "candidates": [0, 1, 2], "n_features": 1, "positions": 2, "hazard_floor": 1e-6}
    prog = DecisionProgram({**spec, "ensemble": ens})
    lo, hi = prog.expected_tokens([0.0]), prog.expected_tokens([1.0])  # leaf -1 below 0.5, +1 above
    s = 1 / (1 + np.exp(1.0))
    np.testing.assert_allclose(lo, [1.0, 1 + s, 1 + s + s * s])
    np.testing.assert_allclose(hi, [1.0, 1 + (1 - s), 1 + (1 - s) + (1 - s) ** 2])
    assert prog.expected_tokens([0.5]) == lo  # x <= threshold takes the true branch
    looped = _tree(ens, [1, 1, 0, 0], [1, 0, 0, 0], [2, 3, 0, 0])  # 0 -> 1 -> 0: every node a child, no root
    with pytest.raises(ProgramError, match="roots"):
        DecisionProgram({**spec, "ensemble": looped})
    shared = {**ens, "nodes_falsenodeids": [1, 0, 0]}  # both branches to node 1: a graph, exponential to walk
    with pytest.raises(ProgramError, match="two parents"):
        DecisionProgram({**spec, "ensemble": shared})
    dangling = _tree(ens, [1, 0, 1, 0], [1, 0, 3, 0], [2, 0, 7, 0])  # node 2's false branch: node 7, absent
    with pytest.raises(ProgramError, match="node 7"):
        DecisionProgram({**spec, "ensemble": dangling})
    n = 5000  # a chain deeper than Python's recursion limit: refused, not a crash
    chain = {  # branch i -> branch i+1 (the last: leaf n) or its own leaf n+1+i
        **_tree(
            ens,
            [1] * n + [0] * (n + 1),
            list(range(1, n + 1)) + [0] * (n + 1),
            list(range(n + 1, 2 * n + 1)) + [0] * (n + 1),
        ),
        "class_treeids": [0],
        "class_nodeids": [n],
        "class_ids": [0],
        "class_weights": [1.0],
    }
    with pytest.raises(ProgramError, match="malformed 'gbt' program \\(RecursionError"):
        DecisionProgram({**spec, "ensemble": chain})


@pytest.mark.parametrize("mode", ["pre", "gated"])
def test_the_hook_decides_the_same_on_either_engine(mode, exports, monkeypatch):
    """Same gates and gammas per step in generation; the Python engine is handed lists, not numpy arrays."""
    import torch

    from speckv_policy.hf import attach
    from speckv_policy.testing import tiny_llama_pair

    target, draft = tiny_llama_pair(seed=0)
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    seen: list[type] = []

    def spied(method):  # a public decision method that records what type of row the hook hands it
        def call(self, features):
            if self.engine == "python":
                seen.append(type(features))
            return method(self, features)

        return call

    for name in ("decide", "decide_gate"):
        monkeypatch.setattr(RuntimePolicy, name, spied(getattr(RuntimePolicy, name)))
    runs = {}
    for engine in ("python", "onnxruntime"):
        rt = RuntimePolicy(exports[f"gbt-{mode}"], engine=engine)
        with attach(target, rt, compression="nf4", mode=mode) as h:
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref) and h.summary()["fallbacks"] == 0
        runs[engine] = [(s.gamma, s.drafted) for s in h.stats]
    assert runs["python"] == runs["onnxruntime"]
    assert len({g for g, _ in runs["python"]}) > 1, "the check needs varied decisions"
    assert seen and set(seen) == {list}  # the Python engine is handed lists, nothing else
