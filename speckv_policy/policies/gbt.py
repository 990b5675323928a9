"""Gradient-boosting policy: HistGradientBoosting on a person-period expansion."""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.ensemble import HistGradientBoostingClassifier

from ..objective import survival_observations
from ._sklearn_compat import Interval
from .base import GammaPolicy, shared_parameters_doc

HAZARD_FLOOR = 1e-6


def expand_positions(X: np.ndarray, K: int) -> np.ndarray:
    """Repeat each row for draft positions 1..K, appending the position column.

    Row ``i * K + (k - 1)`` of the result is ``[X[i], k]``.
    """
    n = X.shape[0]
    rep = np.repeat(X, K, axis=0)
    pos = np.tile(np.arange(1, K + 1, dtype=X.dtype), n)[:, None]
    return np.hstack([rep, pos])


@shared_parameters_doc
class GBTPolicy(GammaPolicy, BaseEstimator):
    """Histogram gradient boosting over (features, draft position).

    Each logged step becomes one training row per observed draft position
    ``k`` (its risk set): label 1 if token ``k`` was accepted. The classifier's
    probability is the conditional acceptance at ``k``; the survival curve is
    their cumulative product.

    Parameters
    ----------
    {shared_parameters}
    max_iter : int, default=100
        Boosting iterations.
    learning_rate : float, default=0.1
        Shrinkage.
    max_leaf_nodes : int, default=8
        Leaves per tree.
    min_samples_leaf : int, default=40
        Minimum expanded rows per leaf.
    l2_regularization : float, default=1.0
        L2 penalty on leaf values.
    random_state : int, RandomState or None, default=0
        Seed passed to the booster.

    Attributes
    ----------
    model_ : HistGradientBoostingClassifier or None
        Fitted booster; ``None`` when every observed position had the same
        label, in which case ``constant_hazard_`` is used.
    constant_hazard_ : float or None
    """

    _parameter_constraints: dict = {
        **GammaPolicy.common_parameter_constraints,
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "max_leaf_nodes": [Interval(Integral, 2, None, closed="left")],
        "min_samples_leaf": [Interval(Integral, 1, None, closed="left")],
        "l2_regularization": [Interval(Real, 0, None, closed="left")],
        "random_state": ["random_state"],
    }

    def __init__(
        self,
        *,
        candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8),
        objective: str = "tokens_per_second",
        cost_model: Any = None,
        feature_set: str | None = "online",
        max_iter: int = 100,
        learning_rate: float = 0.1,
        max_leaf_nodes: int = 8,
        min_samples_leaf: int = 40,
        l2_regularization: float = 1.0,
        random_state: Any = 0,
    ) -> None:
        self._store_shared_params(candidates, objective, cost_model, feature_set)
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.max_leaf_nodes = max_leaf_nodes
        self.min_samples_leaf = min_samples_leaf
        self.l2_regularization = l2_regularization
        self.random_state = random_state

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        K = self.max_gamma_
        if K < 1:
            raise ValueError("GBTPolicy needs a candidate gamma >= 1 (it models acceptance of draft tokens)")
        events, at_risk = survival_observations(accepted, drafted, K)
        Xe = expand_positions(X, K)[at_risk.reshape(-1)]
        ye = events.reshape(-1)[at_risk.reshape(-1)].astype(np.int64)
        self.model_ = None
        self.constant_hazard_ = None
        if len(np.unique(ye)) < 2:
            self.constant_hazard_ = float(ye[0]) if ye.size else 0.5
            return
        self.model_ = HistGradientBoostingClassifier(
            max_iter=self.max_iter,
            learning_rate=self.learning_rate,
            max_leaf_nodes=self.max_leaf_nodes,
            min_samples_leaf=self.min_samples_leaf,
            l2_regularization=self.l2_regularization,
            early_stopping=False,
            random_state=self.random_state,
        ).fit(Xe.astype(np.float32), ye)

    def _hazard(self, X: np.ndarray) -> np.ndarray:
        K = self.max_gamma_
        if self.model_ is None:
            return np.full((X.shape[0], K), self.constant_hazard_, dtype=np.float64)
        p = self.model_.predict_proba(expand_positions(X, K).astype(np.float32))[:, 1]
        return p.reshape(X.shape[0], K)

    def _survival(self, X: np.ndarray) -> np.ndarray:
        return np.cumprod(np.clip(self._hazard(X), HAZARD_FLOOR, 1.0), axis=1)
