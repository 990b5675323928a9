"""On-policy history: replaying a log with a policy's own choices (speckv_policy.replay) and training on it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from speckv_policy.evaluation import evaluate_log
from speckv_policy.evaluation.offline import evaluation_set, policy_choices
from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.features import OnlineFeatureState, features_from_log, gated_features
from speckv_policy.logs import validate_log
from speckv_policy.objective import CostModel
from speckv_policy.policies import training_data
from speckv_policy.replay import replay_features, replayed_outcome
from speckv_policy.schema import ACCEPT_PRIOR, get_feature_set
from speckv_policy.training import batch_chooser, fit_from_log, make_policy

HISTORY_COLUMNS = {
    "online": ["prev_accept_rate", "ema_accept_rate"],
    "pre": ["prev_accept_rate", "ema_accept_rate", "prev_accepted", "prev_gamma", "prev_fully_accepted"],
}
HISTORY_COLUMNS["gated"] = HISTORY_COLUMNS["pre"]


@pytest.fixture(scope="module")
def mixed_log():
    """SYNTHETIC log (ground truth known): most steps draft 8, 15% a uniform gamma in 0..8."""
    log, _ = generate_synthetic_log(n_prompts=16, steps_per_prompt=12, seed=5)
    return validate_log(log)


@pytest.fixture(scope="module")
def all8_log():
    """SYNTHETIC log in which every step drafted 8 tokens (as a profile with no calibration steps would)."""
    log, _ = generate_synthetic_log(n_prompts=12, steps_per_prompt=10, calibration_fraction=0.0, seed=6)
    return validate_log(log)


def _const(g):
    return lambda X: np.full(len(X), g, dtype=np.int64)


@pytest.mark.parametrize("fs", ["online", "pre", "gated"])
def test_replaying_the_logged_choice_gives_the_logged_features(all8_log, fs):
    logged, _, _ = features_from_log(all8_log, fs)
    choose = _const(8)
    if fs == "gated":
        base = choose
        choose = lambda X: (base(X), np.ones(len(X), bool))  # noqa: E731
    X, chosen, opened = replay_features(all8_log, fs, choose)
    pd.testing.assert_frame_equal(X, logged)
    assert (chosen == 8).all() and opened.all()


@pytest.mark.parametrize("fs", ["online", "pre"])
def test_a_policy_that_never_drafts_leaves_the_history_at_its_prior(mixed_log, fs):
    X, chosen, opened = replay_features(mixed_log, fs, _const(0))
    logged, _, _ = features_from_log(mixed_log, fs)
    assert X.index.equals(logged.index) and (chosen == 0).all() and not opened.any()
    assert np.allclose(X["prev_accept_rate"], ACCEPT_PRIOR) and np.allclose(X["ema_accept_rate"], 0.5)
    if fs == "pre":
        assert (X["prev_gamma"] == 0).all() and (X["prev_fully_accepted"] == 0).all()
    # what the history does not hold is the logged row's
    rest = [c for c in X.columns if c not in HISTORY_COLUMNS[fs]]
    pd.testing.assert_frame_equal(X[rest], logged[rest])
    # ... while the logged history (every step drafting) is not the prior
    assert not np.allclose(logged["ema_accept_rate"], 0.5)


def _sequential_reference(log, fs, rule):
    """One run at a time, one row at a time: what the lockstep replay must reproduce."""
    out, chosen = {}, {}
    order = log.sort_values(["run_id", "prompt_id", "step"], kind="stable")
    for _, run in order.groupby(["run_id", "prompt_id"], sort=False):
        r0 = run.iloc[0]
        st = OnlineFeatureState(r0.compression, float(r0.temperature) if r0.decoding == "sampling" else 0.0)
        for idx, r in zip(run.index, run.itertuples(index=False)):
            if r.gamma <= 0:
                continue
            if fs == "online":
                x = st.features(float(r.draft_confidence[0]), float(r.draft_entropy[0]), int(r.context_len))
            else:
                st.observe_target(float(r.target_confidence), float(r.target_entropy))
                x = st.pre_features(int(r.context_len), int(r.context_match_len))
                if fs == "gated":
                    x = gated_features(x, float(r.draft_confidence[0]), float(r.draft_entropy[0]))
            g = rule(x[None, :])[0]
            out[idx], chosen[idx] = x, g
            st.update(*replayed_outcome(int(g), int(r.gamma), int(r.accepted)))
    return out, chosen


@pytest.mark.parametrize("fs", ["online", "pre", "gated"])
def test_lockstep_replay_equals_a_sequential_replay(mixed_log, fs):
    names = get_feature_set(fs).names
    col = names.index("ema_accept_rate")

    def rule(x):  # history-dependent: drafts more after acceptance, sometimes 0
        return np.floor(np.asarray(x, dtype=np.float64)[:, col] * 10).astype(np.int64) % 9

    ref, ref_g = _sequential_reference(mixed_log, fs, rule)
    if fs == "gated":
        choose = lambda X: (rule(X.to_numpy()), rule(X.to_numpy()) > 0)  # noqa: E731
    else:
        choose = lambda X: rule(X.to_numpy())  # noqa: E731
    X, chosen, _ = replay_features(mixed_log, fs, choose)
    assert set(X.index) == set(ref)
    np.testing.assert_array_equal(X.to_numpy(), np.vstack([ref[i] for i in X.index]))
    np.testing.assert_array_equal(chosen, [ref_g[i] for i in X.index])
    assert len(set(chosen.tolist())) > 3  # the rule really varied


@pytest.mark.parametrize(
    ("chosen", "drafted", "accepted", "expected"),
    [
        (0, 8, 5, (0, 0)),  # no draft: the state does not move
        (3, 8, 5, (3, 3)),  # fully accepted within the log
        (6, 8, 5, (6, 5)),  # rejected at 6
        (8, 4, 2, (8, 2)),  # rejected within the logged 4: a longer draft ends the same way
        (8, 4, 4, (4, 4)),  # censored: nothing is known beyond the logged 4
    ],
)
def test_replayed_outcome(chosen, drafted, accepted, expected):
    assert replayed_outcome(chosen, drafted, accepted) == expected


def test_bad_choices_are_refused(mixed_log):
    with pytest.raises(ValueError, match="choices for"):
        replay_features(mixed_log, "pre", lambda X: np.zeros(len(X) + 1, np.int64))
    with pytest.raises(ValueError, match="negative"):
        replay_features(mixed_log, "pre", lambda X: -np.ones(len(X), np.int64))
    with pytest.raises(ValueError, match=r"\(gamma, gate_open\)"):
        replay_features(mixed_log, "gated", _const(2))
    with pytest.raises(ValueError, match="integer"):
        replay_features(mixed_log, "pre", lambda X: np.full(len(X), 1.5))


def test_evaluator_uses_the_policys_own_history(mixed_log):
    cost = CostModel.fit(mixed_log, decision_draft_tokens=0)
    es = evaluation_set(mixed_log, ("online", "pre"))
    col = get_feature_set("pre").names.index("prev_gamma")

    def after_gamma(X):  # draft 2 unless the previous step drafted 8: the logged history says 8 nearly always
        return np.where(X.to_numpy()[:, col] == 8, 8, 2).astype(np.int64)

    g_logged, _ = policy_choices(es, "pre", after_gamma, "logged")
    g_policy, X_policy = policy_choices(es, "pre", after_gamma, "policy")
    assert (g_logged == 8).mean() > 0.7  # off-policy: the profile's gamma 8
    assert (g_policy == 2).all() and (X_policy["prev_gamma"] <= 2).all()  # its own history never holds an 8
    res = {
        h: evaluate_log(mixed_log, {"p": ("pre", after_gamma)}, policy_cost=cost, n_resamples=50, history=h)[0]
        for h in ("policy", "logged")
    }
    assert res["policy"]["history"] == "policy"
    assert res["policy"]["gamma_histogram"]["p"] != res["logged"]["gamma_histogram"]["p"]
    with pytest.raises(ValueError, match="history must be one of"):
        evaluate_log(mixed_log, {"p": ("pre", after_gamma)}, policy_cost=cost, history="future")


def test_history_rounds_add_the_replayed_rows(mixed_log, monkeypatch):
    cost = CostModel.fit(mixed_log, decision_draft_tokens=0)
    policy = make_policy("table", feature_set="pre", cost_model=cost)
    sizes = []
    fit = type(policy).fit

    def recording_fit(self, X, y):
        sizes.append(len(X))
        return fit(self, X, y)

    monkeypatch.setattr(type(policy), "fit", recording_fit)
    fit_from_log(policy, mixed_log, "train", history_rounds=2)
    n = sizes[0]
    assert sizes == [n, 2 * n, 3 * n]
    replayed, _, _ = replay_features(mixed_log[mixed_log["split"] == "train"], "pre", batch_chooser(policy))
    assert len(replayed) == n
    # the export records the logged rows it came from, and the rounds; a plain refit forgets both
    from speckv_policy.export import policy_metadata
    from speckv_policy.policies.base import data_fingerprint

    X, y = training_data(mixed_log, "pre", split="train")
    meta = policy_metadata(policy)
    assert (
        meta["speckv.log_fingerprint"] == data_fingerprint(X, y[:, 0], y[:, 1]) != meta["speckv.training_fingerprint"]
    )
    assert meta["speckv.history_rounds"] == "2" and meta["speckv.training_rows"] == str(3 * n)
    fit(policy, X, y)
    meta = policy_metadata(policy)
    assert (
        meta["speckv.log_fingerprint"] == meta["speckv.training_fingerprint"] and meta["speckv.history_rounds"] == "0"
    )
    with pytest.raises(ValueError, match="history_rounds"):
        fit_from_log(policy, mixed_log, history_rounds=-1)


def test_gated_policy_trains_on_its_own_history(mixed_log):
    cost = CostModel.fit(mixed_log, decision_draft_tokens=1)
    p = fit_from_log(make_policy("table", feature_set="gated", cost_model=cost), mixed_log, history_rounds=1)
    g, opened = batch_chooser(p)(features_from_log(mixed_log, "gated")[0])
    assert ((g == 0) | opened).all()


def test_on_policy_evaluation_needs_the_runs():
    from speckv_policy.evaluation.offline import EvalSet, evaluate

    rows = pd.DataFrame(
        {
            "prompt_id": ["a", "b"],
            "task_type": ["chat", "code"],
            "compression": ["fp16", "fp16"],
            "decoding": ["greedy", "greedy"],
            "accepted": [1, 2],
            "drafted": [8, 8],
            "code": [0, 0],
            "conf_first": [0.5, 0.5],
        }
    )
    es = EvalSet(rows, {"pre": pd.DataFrame({"x": [0.0, 0.0]})})
    cost = CostModel.relative()
    with pytest.raises(ValueError, match="history='logged'"):
        evaluate(es, {"p": ("pre", _const(0))}, policy_cost=cost, n_resamples=10)
    assert evaluate(es, {"p": ("pre", _const(0))}, policy_cost=cost, n_resamples=10, history="logged")["rows"] == 2
