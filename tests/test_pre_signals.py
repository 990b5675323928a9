"""Pre-draft signals (log schema v2, 'pre' v2) and gated policies: features, logs, training, ONNX, pricing."""

from __future__ import annotations

import numpy as np
import onnx
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.base import clone

from speckv_policy.evaluation import evaluate_log
from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.export import export_onnx, reprice_onnx, write_onnx
from speckv_policy.features import ContextMatcher, context_match_len, features_from_log
from speckv_policy.logs import read_log, validate_log, write_log
from speckv_policy.objective import CostModel
from speckv_policy.policies import GatedPolicy, GBTPolicy, MLPPolicy, training_data
from speckv_policy.runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from speckv_policy.schema import GATED, PRE, PRE_SIGNAL_COLUMNS, SIGNAL_COLUMNS, get_feature_set
from speckv_policy.training import batch_chooser, make_policy

from .conftest import edge_rows


def _brute_match(ids, cap=8):
    n = len(ids)
    best = 0
    for k in range(1, min(cap, n - 1) + 1):
        suffix = ids[n - k :]
        if any(ids[j - k + 1 : j + 1] == suffix for j in range(k - 1, n - 1)):
            best = k
        else:
            break
    return best


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 4), min_size=0, max_size=40), cap=st.integers(1, 10))
def test_context_match_len_is_the_longest_repeated_suffix(ids, cap):
    assert context_match_len(ids, cap) == _brute_match(ids, cap)
    assert context_match_len(np.asarray([ids], dtype=np.int64), cap) == _brute_match(ids, cap)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    other=st.lists(st.integers(0, 4), min_size=1, max_size=20),
    cap=st.integers(1, 10),
)
def test_the_incremental_matcher_equals_context_match_len(ids, cuts, other, cap):
    matcher = ContextMatcher(cap)
    for end in sorted(min(c, len(ids)) for c in cuts) + [len(ids)]:  # a sequence growing by steps, as in generation
        prefix = torch.tensor([ids[:end]])
        matcher.sync(prefix)
        assert matcher.seq == ids[:end]
        assert matcher.match_len() == context_match_len(ids[:end], cap) == _brute_match(ids[:end], cap)
    matcher.sync(torch.tensor([ids + other]))  # grown by a whole chunk at once
    assert matcher.seq == ids + other and matcher.match_len() == _brute_match(ids + other, cap)
    matcher.reset()  # a new generation
    matcher.sync(torch.tensor([other]))
    assert matcher.seq == other and matcher.match_len() == _brute_match(other, cap)
    bad = other[:-1] + [9, 9]  # longer, but not an extension: its token at the kept end differs
    matcher.sync(torch.tensor([bad]))
    assert matcher.seq == bad and matcher.match_len() == _brute_match(bad, cap)
    matcher.sync(np.asarray(ids[:1]))  # shorter than the kept one, 1-D
    assert matcher.seq == ids[:1] and matcher.match_len() == 0


def test_context_match_len_examples():
    assert context_match_len([1, 2, 3, 1, 2, 3]) == 3
    assert context_match_len([1, 2, 3, 4]) == 0
    assert context_match_len([5] * 20) == 8  # capped
    assert context_match_len([7]) == 0 and context_match_len([]) == 0


def test_feature_sets_are_versioned_and_gated_extends_pre():
    # v3: of the logged signals only the context match is a feature (the target's two are logged, not read)
    assert PRE.version == 3 and PRE.names[-1:] == PRE_SIGNAL_COLUMNS == ("context_match_len",)
    assert not {"target_confidence", "target_entropy"} & set(PRE.names) and set(PRE_SIGNAL_COLUMNS) < set(
        SIGNAL_COLUMNS
    )
    assert (
        GATED.version == 2
        and GATED.names[: PRE.n_features] == PRE.names
        and GATED.names[-2:] == ("conf_first", "entropy_first")
    )
    assert get_feature_set("gated") is GATED


def test_a_v1_log_still_reads_and_pre_features_name_what_is_missing(synthetic, tmp_path):
    old = synthetic[0].drop(columns=list(SIGNAL_COLUMNS)).head(300)
    log = validate_log(old, source="old.parquet")
    assert all(np.isnan(log[c]).all() for c in SIGNAL_COLUMNS)
    features_from_log(log, "online")  # what a v1 log has is all the other sets need
    with pytest.raises(ValueError, match="needs column 'context_match_len'.*re-profile"):
        features_from_log(log, "pre")
    with pytest.raises(ValueError, match="'gated' feature set needs column"):
        features_from_log(log, "gated")
    write_log(log, tmp_path / "v1.parquet")
    assert np.isnan(read_log(tmp_path / "v1.parquet")["context_match_len"]).all()


@pytest.mark.parametrize(
    "column, value, expected",
    [
        ("target_confidence", 1.5, "a probability in"),
        ("target_entropy", -0.1, "a value >= 0 or NaN"),
        ("context_match_len", 2.5, "an integer in 0..8"),
        ("context_match_len", 9.0, "an integer in 0..8"),
        ("target_confidence", np.inf, "a finite number or NaN"),
        ("target_entropy", "high", "a finite number or NaN"),
    ],
)
def test_signal_columns_are_validated(synthetic, column, value, expected):
    bad = synthetic[0].head(20).copy()
    bad[column] = bad[column].astype(object)
    bad.loc[3, column] = value
    with pytest.raises(ValueError, match=f"row 3, column '{column}': expected {expected}"):
        validate_log(bad, source="bad.parquet")


@pytest.fixture(scope="module")
def gated_data(synthetic):
    log = synthetic[0]
    return training_data(log, "gated", "train"), training_data(log, "gated", "heldout")


@pytest.fixture(scope="module")
def gated_gbt(gated_data, synthetic):
    (X, y), _ = gated_data
    cm = CostModel.fit(synthetic[0], decision_draft_tokens=1)
    return make_policy("gbt", feature_set="gated", cost_model=cm).fit(X, y)


def test_gated_policy_composes_its_gate_and_head(gated_gbt, gated_data):
    _, (Xh, _) = gated_data
    p = gated_gbt
    assert isinstance(p, GatedPolicy) and isinstance(p.gate_, GBTPolicy) and isinstance(p.head_, GBTPolicy)
    assert p.gate_.feature_set_ == "pre" and p.gate_.cost_model_.decision_draft_tokens == 0
    assert p.head_.feature_set_ == "gated" and p.head_.cost_model_.decision_draft_tokens == 1
    opened = p.predict_gate(Xh)
    np.testing.assert_array_equal(opened, p.gate_.predict(Xh.to_numpy()[:, : PRE.n_features]) > 0)
    np.testing.assert_array_equal(p.predict(Xh), np.where(opened, p.predict_length(Xh), 0))
    gamma, gate = p.predict_with_gate(Xh)
    np.testing.assert_array_equal(gamma, p.predict(Xh))
    np.testing.assert_array_equal(gate, opened)
    assert 0.05 < opened.mean() < 1.0  # the synthetic process has steps on both sides of the gate
    # the gate reads only the pre columns: changing the probe token's columns never moves it
    X2 = Xh.copy()
    X2["conf_first"], X2["entropy_first"] = 0.0, 9.0
    np.testing.assert_array_equal(p.predict_gate(X2), opened)


def test_gated_policy_rejects_what_it_cannot_be():
    X = np.random.default_rng(0).random((50, 3))
    y = np.column_stack([np.zeros(50, int), np.full(50, 8)])
    with pytest.raises(ValueError, match="needs gamma 0"):
        GatedPolicy(feature_set=None, candidates=(1, 2)).fit(X, y)
    with pytest.raises(ValueError, match="reads feature_set='gated'"):
        GatedPolicy(feature_set="online").fit(np.random.default_rng(0).random((50, 7)), y)
    with pytest.raises(ValueError, match="composes two learned policies"):
        make_policy("fixed", feature_set="gated")
    c = clone(GatedPolicy(gate=MLPPolicy(max_iter=5)))  # scikit-learn's clone keeps the nested estimators
    assert isinstance(c.gate, MLPPolicy) and c.gate.max_iter == 5 and c.get_params()["gate__max_iter"] == 5


@pytest.mark.parametrize("kind", ["gbt", "mlp", "table"])
def test_gated_export_matches_python_and_reprices_both_heads(kind, gated_data, synthetic, tmp_path):
    (X, y), (Xh, _) = gated_data
    cm = CostModel.fit(synthetic[0], decision_draft_tokens=1)
    policy = make_policy(kind, feature_set="gated", cost_model=cm).fit(X, y)
    path = tmp_path / f"{kind}-gated.onnx"
    model = export_onnx(policy, path)
    onnx.checker.check_model(model, full_check=True)
    rt = RuntimePolicy(path)
    assert rt.gated and rt.feature_set is GATED and rt.metadata["speckv.decision"] == "gated"
    rows = np.vstack([Xh.to_numpy(np.float32), edge_rows(GATED.names, np.random.default_rng(2))])
    gamma, opened = rt.decide_gated_batch(rows)
    assert (opened == policy.predict_gate(rows)).mean() >= 0.999
    assert (gamma == policy.predict(rows)).mean() >= 0.999
    assert (rt.decide_batch(rows) == policy.predict_length(rows)).mean() >= 0.999
    assert rt.decide_gate(rows[0]) == bool(opened[0]) and rt.decide(rows[0]) == rt.decide_batch(rows[:1])[0]
    assert rt.decide_gate(dict(zip(GATED.names, rows[1].tolist()))) == bool(opened[1])  # a name -> value row
    with pytest.raises(ValueError, match=r"decide_gate\(\) takes one step's features, got 2 rows"):
        rt.decide_gate(rows[:2])
    # re-priced: the file re-priced by speckv-export --reprice and the runtime re-pricing agree, both heads
    other = CostModel.relative(draft_cost=0.02)
    write_onnx(reprice_onnx(model, other), tmp_path / "re.onnx")
    a = RuntimePolicy(tmp_path / "re.onnx").decide_gated_batch(rows)
    b = RuntimePolicy(path, costs=other).decide_gated_batch(rows)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="gated export is re-priced with a cost model"):
        rt.set_step_times(np.ones((3, len(rt.candidates))))


def test_a_plain_export_is_not_gated(fitted, tmp_path):
    export_onnx(fitted["gbt"], tmp_path / "p.onnx")
    rt = RuntimePolicy(tmp_path / "p.onnx")
    assert not rt.gated
    with pytest.raises(PolicyLoadError, match="not a gated export"):
        rt.decide_gate(np.zeros(7, np.float32))
    with pytest.warns(PolicyFallbackWarning):
        assert RuntimePolicy(tmp_path / "p.onnx", fallback_gamma=2).decide_gate(np.zeros(7, np.float32)) is True


def test_the_evaluator_charges_the_probe_exactly_where_the_gate_opens(synthetic):
    log = synthetic[0]
    cm = CostModel.fit(log, decision_draft_tokens=1)
    n_closed = lambda X: (np.zeros(len(X), np.int64), np.zeros(len(X), bool))  # noqa: E731
    probe_then_zero = lambda X: (np.zeros(len(X), np.int64), np.ones(len(X), bool))  # noqa: E731
    probe_then_four = lambda X: (np.full(len(X), 4), np.ones(len(X), bool))  # noqa: E731
    res, _ = evaluate_log(
        log,
        {"closed": ("gated", n_closed), "probe0": ("gated", probe_then_zero), "probe4": ("gated", probe_then_four)},
        policy_cost=cm,
        n_resamples=20,
    )
    arms = res["groups"]["overall"]["arms"]
    assert arms["closed"]["vs_target"] == pytest.approx(1.0, abs=1e-12)  # a closed gate is the target alone
    assert arms["probe0"]["vs_target"] < 1.0  # an open gate pays its probe even when the head then says 0
    assert arms["probe4"]["tokens_per_second"] == pytest.approx(arms["fixed-4"]["tokens_per_second"])
    gates = res["gates"]
    assert gates["closed"]["overall"] == {"open": 0.0, "open_then_zero": 0.0}
    assert gates["probe0"]["overall"] == {"open": 1.0, "open_then_zero": 1.0}
    assert gates["probe4"]["int8"] == {"open": 1.0, "open_then_zero": 0.0}
    with pytest.raises(ValueError, match=r"must return \(gamma, gate_open\)"):
        evaluate_log(log, {"bad": ("gated", lambda X: np.zeros(len(X), np.int64))}, policy_cost=cm, n_resamples=2)
    with pytest.raises(ValueError, match="a closed gate gamma 0"):
        evaluate_log(
            log,
            {"bad": ("gated", lambda X: (np.ones(len(X), np.int64), np.zeros(len(X), bool)))},
            policy_cost=cm,
            n_resamples=2,
        )


def test_gated_policy_offline_uses_batch_chooser(gated_gbt, synthetic):
    res, _ = evaluate_log(
        synthetic[0], {"gated": ("gated", batch_chooser(gated_gbt))}, policy_cost=gated_gbt.cost_model_, n_resamples=50
    )
    hist = res["gamma_histogram"]["gated"]
    assert sum(sum(v) for v in hist.values()) == res["rows"]


def test_synthetic_signals_start_at_zero_before_the_first_verification():
    """SYNTHETIC signal columns: last in the log, 0 before the first verification, a float match length."""
    log, _ = generate_synthetic_log(n_prompts=6, steps_per_prompt=5, seed=4)
    assert list(log.columns)[-3:] == list(SIGNAL_COLUMNS)
    first = log.groupby(["run_id", "prompt_id"]).head(1)
    assert (first["target_confidence"] == 0).all() and (first["target_entropy"] == 0).all()
    assert pd.api.types.is_float_dtype(log["context_match_len"])


def test_a_gated_export_runs_in_the_hook_losslessly(gated_gbt, tmp_path):
    import torch

    from speckv_policy.hf import attach
    from speckv_policy.testing import tiny_llama_pair

    path = tmp_path / "gated.onnx"
    export_onnx(gated_gbt, path)
    target, draft = tiny_llama_pair(seed=0)
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    with attach(target, str(path), compression="nf4", mode="gated") as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert h.summary()["fallbacks"] == 0 and h.stats
    # the pre-draft signals' share of each step's decision time is reported on its own
    assert all(0 < s.signals_us < s.decision_us for s in h.stats)
    # a run that records nothing computes the context match only (the target's stats are a profile's, 'pre' v3)
    assert all(np.isnan(s.target_confidence) and s.context_match_len >= 0 for s in h.stats)

    class Recording:  # the same export, its gate and head calls recorded
        def __init__(self):
            self.rt, self.gates, self.heads = RuntimePolicy(path), [], 0

        def decide_gate(self, x):
            self.gates.append(self.rt.decide_gate(x))
            return self.gates[-1]

        def __call__(self, x):
            self.heads += 1
            return self.rt.decide(x)

    rec = Recording()
    with attach(target, rec, compression="nf4", mode="gated", feature_set="gated", settings={"max_gamma": 8}) as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    # one gate call per step; a closed gate drafts nothing and asks no head; the head reads every probe
    # (an open gate drafts nothing only when the token budget is spent)
    assert len(rec.gates) == len(h.stats) and rec.heads == sum(s.drafted > 0 for s in h.stats)
    assert all(opened or s.drafted == 0 for s, opened in zip(h.stats, rec.gates))
    assert all(opened for s, opened in zip(h.stats, rec.gates) if s.drafted > 0)
    assert 0 < sum(rec.gates) < len(rec.gates)  # this export's gate both opens and closes on this prompt
    with pytest.raises(ValueError, match="costs='live' is not available for a gated export"):
        attach(target, str(path), compression="fp32", mode="gated", costs="live")
    with pytest.raises(ValueError, match="mode='gated' needs a gated policy"):
        attach(target, lambda x: 1, compression="fp32", mode="gated", feature_set="gated")


def test_the_hook_scans_the_context_only_for_a_policy_that_reads_it(synthetic, tmp_path):
    """``context_match_len`` is computed per step where the policy's decisions can depend on it, else skipped."""
    from speckv_policy.hf import attach
    from speckv_policy.testing import tiny_llama_pair

    X, y = training_data(synthetic[0], "pre", "train")
    cm = CostModel.fit(synthetic[0])
    target, draft = tiny_llama_pair(seed=0)
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    scanned = {}
    for kind in ("gbt", "fixed"):
        export_onnx(make_policy(kind, feature_set="pre", cost_model=cm).fit(X, y), tmp_path / f"{kind}.onnx")
        rt = RuntimePolicy(tmp_path / f"{kind}.onnx")
        with attach(target, rt, compression="fp32", mode="pre") as h:
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref) and h.summary()["fallbacks"] == 0
        scanned[kind] = "context_match_len" in rt.read_features
        assert all(np.isnan(s.context_match_len) != scanned[kind] for s in h.stats)
    # a callable says nothing about what it reads: scanned; a profile records it whatever the policy
    with attach(target, lambda x: 1, compression="fp32", mode="pre", feature_set="pre") as h:
        target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert all(s.context_match_len >= 0 for s in h.stats)
    assert scanned == {"gbt": True, "fixed": False}, "the check needs a policy of each kind"


def test_a_v1_log_dataset_still_reads(tmp_path):
    """A dataset directory written before log schema v2 (parts without the signal columns) reads, signals NaN."""
    import json

    import pyarrow.parquet as pq

    from speckv_policy.logs import DATASET_MARKER, write_log_parts

    log, _ = generate_synthetic_log(n_prompts=4, steps_per_prompt=5, seed=2)
    d = tmp_path / "ds"
    write_log_parts(d, log)
    for part in d.rglob("part-*.parquet"):
        pq.write_table(pq.read_table(part).drop_columns(list(SIGNAL_COLUMNS)), part)
    marker = json.loads((d / DATASET_MARKER).read_text())
    (d / DATASET_MARKER).write_text(json.dumps({**marker, "log_schema_version": 1}))
    back = read_log(d)
    assert len(back) == len(log) and all(np.isnan(back[c]).all() for c in SIGNAL_COLUMNS)
    features_from_log(back, "online")
