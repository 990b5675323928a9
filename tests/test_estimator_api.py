"""scikit-learn conventions: estimator checks, clone, params, joblib, GridSearchCV."""

from __future__ import annotations

import joblib
import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold
from sklearn.utils.estimator_checks import parametrize_with_checks

from speckv_policy.objective import CostModel
from speckv_policy.policies import (
    FixedGammaPolicy,
    GatedPolicy,
    GBTPolicy,
    MLPPolicy,
    PaperMLP16Policy,
    TablePolicy,
    objective_scorer,
)

# The checks feed random matrices of arbitrary width, so the policies run with
# feature_set=None (any columns, every row treated as full precision); the named
# feature sets are exercised by every other test module.
CHECKED = [
    MLPPolicy(feature_set=None, max_iter=30),
    GBTPolicy(feature_set=None, max_iter=10),
    TablePolicy(feature_set=None),
    FixedGammaPolicy(feature_set=None),
    PaperMLP16Policy(feature_set=None, max_iter=50),
    # a gate and a length head (feature_set=None: both read every column)
    GatedPolicy(feature_set=None, gate=GBTPolicy(max_iter=10), head=TablePolicy()),
]
# No check is expected to fail: every policy passes all of them as they are.
EXPECTED_FAILED: dict = {}


@parametrize_with_checks(CHECKED, expected_failed_checks=lambda est: EXPECTED_FAILED)
def test_sklearn_compatible(estimator, check):
    check(estimator)


@pytest.mark.parametrize("name", ["mlp", "gbt", "table", "fixed", "paper-mlp16"])
def test_joblib_round_trip_predicts_identically(name, fitted, heldout, tmp_path):
    policy = fitted[name]
    X, _ = heldout["paper" if name == "paper-mlp16" else "online"]
    path = tmp_path / "p.joblib"
    joblib.dump(policy, path)
    loaded = joblib.load(path)
    np.testing.assert_array_equal(loaded.predict(X), policy.predict(X))
    np.testing.assert_allclose(loaded.decision_values(X), policy.decision_values(X))
    assert loaded.get_params().keys() == policy.get_params().keys()


@pytest.mark.parametrize("name", ["mlp", "gbt", "table", "fixed", "paper-mlp16"])
def test_clone_and_set_params(name, fitted):
    policy = fitted[name]
    c = clone(policy)
    assert not hasattr(c, "candidates_")
    assert c.get_params()["objective"] == policy.get_params()["objective"]
    c.set_params(objective="tokens_per_step")
    assert c.objective == "tokens_per_step"
    with pytest.raises(ValueError, match="objective"):
        clone(policy).set_params(objective="bogus").fit(np.zeros((3, 7)), [0, 1, 2])


def test_fit_rejects_feature_set_mismatch(online_data):
    (X, y), _ = online_data
    with pytest.raises(ValueError, match="feature set 'online' has 7"):
        TablePolicy().fit(X.to_numpy()[:, :5], y)
    with pytest.raises(ValueError, match="lacks feature columns.*ema_accept_rate"):
        TablePolicy().fit(X.drop(columns=["ema_accept_rate"]), y)


def test_dataframe_columns_are_reordered_by_name(online_data, cost_model):
    (X, y), (Xte, _) = online_data
    p = TablePolicy(cost_model=cost_model).fit(X, y)
    shuffled = Xte[list(reversed(Xte.columns))]
    np.testing.assert_array_equal(p.predict(shuffled), p.predict(Xte))


def test_targets_validation_messages():
    X = np.zeros((3, 2))
    with pytest.raises(ValueError, match="row 1: accepted 5 exceeds gamma_drafted 4"):
        TablePolicy(feature_set=None).fit(X, np.array([[0, 4], [5, 4], [1, 4]]))
    with pytest.raises(ValueError, match="non-negative integer"):
        TablePolicy(feature_set=None).fit(X, [0.5, 1, 2])
    with pytest.raises(ValueError, match=r"shape \(n,\).*\(n, 2\)"):
        TablePolicy(feature_set=None).fit(X, np.zeros((3, 3)))
    with pytest.raises(ValueError, match="candidates must be distinct ints"):
        TablePolicy(feature_set=None, candidates=(0, 2, 2)).fit(X, [0, 1, 2])


def test_gridsearch_with_objective_scorer(online_data, cost_model):
    (X, y), _ = online_data
    X, y = X.iloc[:1500], y[:1500]
    groups = np.arange(len(X)) // 30  # keep each prompt's steps together
    search = GridSearchCV(
        TablePolicy(cost_model=cost_model),
        {"n_bins": [2, 6], "smoothing": [1.0, 50.0]},
        scoring=objective_scorer("tokens_per_second", cost_model),
        cv=GroupKFold(n_splits=3),
    ).fit(X, y, groups=groups)
    assert set(search.cv_results_["param_n_bins"]) == {2, 6}
    assert np.all(np.isfinite(search.cv_results_["mean_test_score"]))
    # more bins carry more signal on this log: the search must prefer them
    assert search.best_params_["n_bins"] == 6
    fixed = FixedGammaPolicy(cost_model=cost_model).fit(X, y)
    assert search.best_estimator_.score(X, y) > fixed.score(X, y)


def test_score_defaults_to_objective(online_data, cost_model):
    (X, y), (Xte, yte) = online_data
    p = FixedGammaPolicy(gamma=0, cost_model=cost_model).fit(X, y)
    # gamma 0 every step: exactly one token per target step
    codes = Xte["compression_code"].to_numpy().astype(int)
    expected = 1000.0 * len(codes) / cost_model.step_ms(0, codes).sum()
    assert p.score(Xte, yte) == pytest.approx(expected)
    p.set_params(objective="tokens_per_step")
    assert p.score(Xte, yte) == pytest.approx(1.0)


def test_relative_cost_model_is_the_default(online_data):
    (X, y), _ = online_data
    p = MLPPolicy(max_iter=5).fit(X.iloc[:200], y[:200])
    assert p.cost_model_ == CostModel.relative()
