"""Baselines: fixed gamma, and the published MLP16 recipe."""

from __future__ import annotations

import os
from numbers import Integral
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.neural_network import MLPRegressor
from sklearn.utils.validation import check_is_fitted

from ..objective import survival_observations
from ..schema import N_COMPRESSION_CODES, get_feature_set
from ._sklearn_compat import Interval
from .base import GammaPolicy


class FixedGammaPolicy(GammaPolicy, BaseEstimator):
    """Always choose the same gamma (the usual deployment: gamma = 4).

    ``fit`` only estimates the pooled acceptance curve per compression code so
    that :meth:`expected_values` can report what the fixed choice yields.

    Parameters
    ----------
    gamma : int, default=4
        The draft length, 0..32.
    objective : {'tokens_per_second', 'tokens_per_step'}, default='tokens_per_second'
        Used only for :meth:`score`.
    cost_model : CostModel or None, default=None
        Step-time model; ``None`` means :meth:`CostModel.relative`.
    feature_set : {'online', 'paper', 'pre'} or None, default='online'
        Feature schema of ``X``.

    Attributes
    ----------
    tokens_table_ : ndarray of shape (3, 1)
        Expected tokens per step per compression code.
    """

    _parameter_constraints: dict = {
        "gamma": [Interval(Integral, 0, 32, closed="both")],
        "objective": GammaPolicy.common_parameter_constraints["objective"],
        "cost_model": GammaPolicy.common_parameter_constraints["cost_model"],
        "feature_set": GammaPolicy.common_parameter_constraints["feature_set"],
    }

    def __init__(
        self,
        *,
        gamma: int = 4,
        objective: str = "tokens_per_second",
        cost_model: Any = None,
        feature_set: str | None = "online",
    ) -> None:
        self.gamma = gamma
        self.objective = objective
        self.cost_model = cost_model
        self.feature_set = feature_set

    def _candidate_list(self) -> np.ndarray:
        return np.array([int(self.gamma)], dtype=np.int64)

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        g = int(self.gamma)
        codes = self._codes(X)
        table = np.ones((N_COMPRESSION_CODES, 1))
        if g > 0:
            events, at_risk = survival_observations(accepted, drafted, g)
            pooled = (events.sum(0) + 1.0) / (at_risk.sum(0) + 2.0)
            for c in range(N_COMPRESSION_CODES):
                m = codes == c
                h = (events[m].sum(0) + 1.0) / (at_risk[m].sum(0) + 2.0) if m.any() else pooled
                table[c, 0] = 1.0 + np.cumprod(h).sum()
        self.tokens_table_ = table

    def _expected_tokens(self, X: np.ndarray) -> np.ndarray:
        return self.tokens_table_[self._codes(X)]


class PaperMLP16Policy(GammaPolicy, BaseEstimator):
    """The published SpecKV MLP16 recipe, as a baseline.

    An ``MLPRegressor`` with one hidden layer of 16 ReLU units (seed 42) maps
    the ``paper`` features plus a candidate gamma to the step's acceptance
    rate (accepted / gamma, clipped to [0, 1]); expected tokens per step are
    ``rate * gamma + 1``. With the default objective ``tokens_per_step`` and
    candidates {2, 4, 6, 8} this is the paper's decision rule.

    Training expands every logged step into one row per candidate gamma that
    the step observed (``gamma <= gamma_drafted``), with rate
    ``min(accepted, gamma) / gamma``.

    Parameters
    ----------
    candidates : sequence of int, default=(2, 4, 6, 8)
        Candidate gammas (>= 1).
    objective : {'tokens_per_step', 'tokens_per_second'}, default='tokens_per_step'
        The paper maximises tokens per step.
    cost_model : CostModel or None, default=None
        Used only with ``objective='tokens_per_second'`` and for reports.
    feature_set : {'paper', 'online'} or None, default='paper'
        Feature schema of ``X``.
    max_iter : int, default=500
        ``MLPRegressor`` iterations.
    random_state : int, default=42
        Seed (the paper's).

    Attributes
    ----------
    coefs_, intercepts_ : list of ndarray
        ``[W1 (F+1, 16), W2 (16, 1)]`` and ``[b1 (16,), b2 (1,)]``; the last
        input is the candidate gamma.
    """

    _parameter_constraints: dict = {
        **GammaPolicy.common_parameter_constraints,
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "random_state": ["random_state"],
    }

    def __init__(
        self,
        *,
        candidates: tuple[int, ...] = (2, 4, 6, 8),
        objective: str = "tokens_per_step",
        cost_model: Any = None,
        feature_set: str | None = "paper",
        max_iter: int = 500,
        random_state: Any = 42,
    ) -> None:
        self._store_shared_params(candidates, objective, cost_model, feature_set)
        self.max_iter = max_iter
        self.random_state = random_state

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        cands = self.candidates_
        if cands.min() < 1:
            raise ValueError("PaperMLP16Policy candidates must be >= 1 (the rate is accepted / gamma)")
        rows, rates = [], []
        for g in cands:
            m = drafted >= g
            if m.any():
                rows.append(np.hstack([X[m], np.full((int(m.sum()), 1), float(g))]))
                rates.append(np.minimum(accepted[m], g) / g)
        if not rows:
            raise ValueError(f"no logged step drafted at least {int(cands.min())} tokens: nothing to train the rate on")
        Xe, ye = np.vstack(rows), np.concatenate(rates)
        import warnings

        from sklearn.exceptions import ConvergenceWarning

        reg = MLPRegressor(
            hidden_layer_sizes=(16,), activation="relu", max_iter=self.max_iter, random_state=self.random_state
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            reg.fit(Xe, ye)
        self.regressor_ = reg  # the scikit-learn model itself, as the paper ran it
        self.coefs_ = [w.copy() for w in reg.coefs_]
        self.intercepts_ = [b.copy() for b in reg.intercepts_]

    def acceptance_rates(self, X: Any) -> np.ndarray:
        """The network's predicted acceptance rate per row of ``X`` and candidate gamma (in [0, 1]).

        The published recipe feeds the candidate gamma to the network as an extra input and picks the gamma with
        the highest ``rate * gamma + 1``.

        Returns
        -------
        ndarray of shape (n_rows, n_candidates)
        """
        check_is_fitted(self)
        return self._rates(self._prepare_X(X, reset=False))

    def _rates(self, X: np.ndarray) -> np.ndarray:
        n, G = X.shape[0], len(self.candidates_)
        Xe = np.hstack([np.repeat(X, G, axis=0), np.tile(self.candidates_.astype(np.float64), n)[:, None]])
        h = np.maximum(Xe @ self.coefs_[0] + self.intercepts_[0], 0.0)
        out = h @ self.coefs_[1] + self.intercepts_[1]
        return np.clip(out.reshape(n, G), 0.0, 1.0)

    def _expected_tokens(self, X: np.ndarray) -> np.ndarray:
        return self._rates(X) * self.candidates_[None, :] + 1.0

    @classmethod
    def from_npz(cls, path: str | os.PathLike[str], **params: Any) -> PaperMLP16Policy:
        """Load released weights (``W1`` (F+1, 16), ``b1``, ``W2`` (16, 1), ``b2``).

        The returned policy is fitted; ``params`` set its constructor
        arguments (candidates, objective, cost_model, feature_set).

        Raises
        ------
        ValueError
            If an array is missing or has the wrong shape for the feature set.
        """
        from ..objective import CostModel
        from .base import check_candidates

        policy = cls(**params)
        policy._validate_params()
        with np.load(path) as z:
            missing = [k for k in ("W1", "b1", "W2", "b2") if k not in z.files]
            if missing:
                raise ValueError(f"{path}: npz lacks array {missing[0]!r}; expected W1, b1, W2, b2")
            arrays = {k: np.asarray(z[k], dtype=np.float64) for k in ("W1", "b1", "W2", "b2")}
        W1, b1, W2, b2 = (arrays[k] for k in ("W1", "b1", "W2", "b2"))
        n_in = get_feature_set(policy.feature_set).n_features + 1 if policy.feature_set else W1.shape[0]
        H = W1.shape[1] if W1.ndim == 2 else -1
        expected = {"W1": (n_in, H), "b1": (H,), "W2": (H, 1), "b2": (1,)}
        for k, shape in expected.items():
            if arrays[k].shape != shape:
                raise ValueError(f"{path}: array {k} has shape {arrays[k].shape}, expected {shape}")
        policy.coefs_ = [W1, W2]
        policy.intercepts_ = [b1, b2]
        policy.candidates_ = check_candidates(policy.candidates)
        policy.max_gamma_ = int(policy.candidates_.max())
        policy.cost_model_ = policy.cost_model if policy.cost_model is not None else CostModel.relative()
        policy.feature_set_ = policy.feature_set
        policy.n_features_in_ = n_in - 1
        policy.feature_names_ = (
            get_feature_set(policy.feature_set).names
            if policy.feature_set is not None
            else tuple(f"x{i}" for i in range(n_in - 1))
        )
        policy.training_fingerprint_ = "npz:" + os.path.basename(str(path))
        policy.n_training_rows_ = 0
        return policy

    def to_npz(self, path: str | os.PathLike[str]) -> None:
        """Save the weights in the released npz layout."""
        np.savez(path, W1=self.coefs_[0], b1=self.intercepts_[0], W2=self.coefs_[1], b2=self.intercepts_[1])
