"""The shared base of every gamma policy.

Targets ``y`` are accepted prefix lengths. Pass either

* a 1-D array of accepted lengths: every row is taken to have drafted at least
  the largest candidate gamma (what ``speckv-profile`` does), so outcomes are
  uncensored up to that gamma; or
* an ``(n, 2)`` array whose columns are ``(accepted, gamma_drafted)``: rows
  that accepted their whole draft are treated as censored there. This form
  travels through ``GridSearchCV`` splits and scoring unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sklearn.utils.validation import check_is_fitted, validate_data

from ..objective import (
    OBJECTIVES,
    CostModel,
    expected_tokens_from_survival,
    objective_values,
    realized_throughput,
)
from ..schema import FEATURE_SETS, N_COMPRESSION_CODES, get_feature_set
from ._sklearn_compat import StrOptions

MAX_CANDIDATE_GAMMA = 32


def check_candidates(candidates: Sequence[int]) -> np.ndarray:
    try:
        c = np.asarray(list(candidates))
    except TypeError:
        raise ValueError(f"candidates must be a sequence of ints, got {candidates!r}") from None
    if (
        c.ndim != 1
        or c.size == 0
        or not np.issubdtype(c.dtype, np.integer)
        or c.min() < 0
        or c.max() > MAX_CANDIDATE_GAMMA
        or len(np.unique(c)) != c.size
    ):
        raise ValueError(f"candidates must be distinct ints in 0..{MAX_CANDIDATE_GAMMA}, got {candidates!r}")
    return np.sort(c).astype(np.int64)


def data_fingerprint(X: Any, accepted: Any, drafted: Any) -> str:
    """Short SHA-256 of training data (float32 features, int64 outcomes).

    Written into every export so a model can be traced to the rows it saw.
    """
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.asarray(X, dtype=np.float32)).tobytes())
    for a in (accepted, drafted):
        h.update(np.ascontiguousarray(np.asarray(a, dtype=np.int64)).tobytes())
    return h.hexdigest()[:16]


#: The parameters every learned policy shares, as they appear in its docstring
#: (substituted for ``{shared_parameters}`` by :func:`shared_parameters_doc`).
SHARED_PARAMETERS_DOC = """\
    candidates : sequence of int, default=(0, 1, ..., 8)
        Gammas the policy may choose (0 = plain target step).
    objective : {'tokens_per_second', 'tokens_per_step'}, default='tokens_per_second'
        What the decision maximises.
    cost_model : CostModel or None, default=None
        Step-time model; ``None`` means :meth:`CostModel.relative`.
    feature_set : {'online', 'paper', 'pre', 'gated'} or None, default='online'
        Feature schema of ``X``.
"""


def shared_parameters_doc(cls: type) -> type:
    """Class decorator: put :data:`SHARED_PARAMETERS_DOC` where the docstring says ``{shared_parameters}``."""
    marker = "    {shared_parameters}\n"
    if cls.__doc__ is None:  # python -OO strips docstrings
        return cls
    if marker not in cls.__doc__:
        raise TypeError(f"{cls.__name__}'s docstring lacks the line '{marker.strip()}'")
    cls.__doc__ = cls.__doc__.replace(marker, SHARED_PARAMETERS_DOC)
    return cls


class GammaPolicy:
    """Base class: choose gamma per step by an objective over candidates.

    Subclasses are used as ``class MyPolicy(GammaPolicy, BaseEstimator)`` and
    implement ``_fit(X, accepted, drafted)`` plus either ``_survival(X)``
    (``P(accepted >= k | x)`` for ``k = 1..max_gamma_``) or
    ``_expected_tokens(X)``.

    Common parameters (every policy takes them as keywords):

    candidates : sequence of int
        Gammas the policy may choose; 0 means a plain target step.
    objective : {'tokens_per_second', 'tokens_per_step'}
        What the decision maximises.
    cost_model : CostModel or None
        Step-time model; ``None`` uses :meth:`CostModel.relative` (draft cost
        0.1 of a target step, +0.05 per verified draft token).
    feature_set : {'online', 'paper', 'pre', 'gated'} or None
        Feature schema of ``X``. DataFrames are reordered by name; arrays must
        follow the schema's order. ``None`` accepts any columns and treats
        every row as full precision.
    """

    common_parameter_constraints: dict[str, list[Any]] = {
        "candidates": ["array-like"],
        "objective": [StrOptions(set(OBJECTIVES))],
        "cost_model": [CostModel, None],
        "feature_set": [StrOptions(set(FEATURE_SETS)), None],
    }

    def _store_shared_params(self, candidates: Any, objective: str, cost_model: Any, feature_set: str | None) -> None:
        """Store the shared constructor arguments unchanged (scikit-learn's rule for ``__init__``)."""
        self.candidates = candidates
        self.objective = objective
        self.cost_model = cost_model
        self.feature_set = feature_set

    # -- helpers -----------------------------------------------------------
    def _candidate_list(self) -> np.ndarray:
        return check_candidates(self.candidates)

    def _prepare_X(self, X: Any, *, reset: bool) -> np.ndarray:
        fs = get_feature_set(self.feature_set) if self.feature_set is not None else None
        if fs is not None and hasattr(X, "columns"):
            missing = [n for n in fs.names if n not in X.columns]
            if missing:
                raise ValueError(
                    f"X lacks feature columns of set {fs.name!r}: {', '.join(missing)}; "
                    f"expected columns {', '.join(fs.names)}"
                )
            # the schema, not sklearn's name check, governs column order
            X = X[list(fs.names)].to_numpy()
        X = validate_data(self, X, reset=reset, dtype=np.float64, ensure_all_finite=True)
        if fs is not None and X.shape[1] != fs.n_features:
            raise ValueError(
                f"X has {X.shape[1]} features but feature set {fs.name!r} has {fs.n_features}: {', '.join(fs.names)}"
            )
        # decisions are made on float32 inputs (what the ONNX export sees)
        return X.astype(np.float32).astype(np.float64)

    def _codes(self, X: np.ndarray) -> np.ndarray:
        if self.feature_set is None:
            return np.zeros(X.shape[0], dtype=np.int64)
        idx = get_feature_set(self.feature_set).index("compression_code")
        return np.clip(np.rint(X[:, idx]), 0, N_COMPRESSION_CODES - 1).astype(np.int64)

    @staticmethod
    def _split_targets(y: Any, n_rows: int, max_gamma: int) -> tuple[np.ndarray, np.ndarray]:
        if y is None:
            raise ValueError(
                "a gamma policy requires y to be passed, but the target y is None (y holds accepted prefix lengths)"
            )
        y = np.asarray(y)
        if y.dtype.kind not in "iuf":
            raise ValueError(f"Unknown label type: y must be numeric accepted lengths, got dtype {y.dtype}")
        y = y.astype(np.float64)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim == 1:
            acc, drafted = y, np.maximum(y, max_gamma)
        elif y.ndim == 2 and y.shape[1] == 2:
            acc, drafted = y[:, 0], y[:, 1]
        else:
            raise ValueError(
                f"y must have shape (n,) of accepted lengths or (n, 2) of (accepted, gamma_drafted); got {y.shape}"
            )
        if acc.shape[0] != n_rows:
            raise ValueError(f"y has {acc.shape[0]} rows, X has {n_rows}")
        for name, v in (("accepted length", acc), ("gamma_drafted", drafted)):
            if not np.all(np.isfinite(v)) or np.any(v < 0) or np.any(v != np.round(v)):
                bad = int(np.flatnonzero(~np.isfinite(v) | (v < 0) | (v != np.round(v)))[0])
                raise ValueError(f"y row {bad}: {name} must be a non-negative integer, got {v[bad]!r}")
        if np.any(acc > drafted):
            bad = int(np.flatnonzero(acc > drafted)[0])
            raise ValueError(f"y row {bad}: accepted {acc[bad]:g} exceeds gamma_drafted {drafted[bad]:g}")
        return acc.astype(np.int64), drafted.astype(np.int64)

    # -- estimator API -------------------------------------------------------
    def fit(self, X: Any, y: Any) -> GammaPolicy:
        """Fit the policy on step features and (censored) accepted lengths.

        Parameters
        ----------
        X : array-like or DataFrame of shape (n_steps, n_features)
            Step features (see ``feature_set``).
        y : array-like of shape (n_steps,) or (n_steps, 2)
            Accepted prefix lengths, optionally with the drafted gamma as a
            second column (see the module docstring).

        Returns
        -------
        self
        """
        self._validate_params()
        candidates = self._candidate_list()
        Xv = self._prepare_X(X, reset=True)
        accepted, drafted = self._split_targets(y, Xv.shape[0], int(candidates.max()))
        self.candidates_ = candidates
        self.max_gamma_ = int(candidates.max())
        self.cost_model_ = self.cost_model if self.cost_model is not None else CostModel.relative()
        self.feature_set_ = self.feature_set
        self.feature_names_ = (
            get_feature_set(self.feature_set).names
            if self.feature_set is not None
            else tuple(getattr(self, "feature_names_in_", [f"x{i}" for i in range(Xv.shape[1])]))
        )
        self.training_fingerprint_ = data_fingerprint(Xv, accepted, drafted)
        self.n_training_rows_ = int(Xv.shape[0])
        for stale in ("log_fingerprint_", "history_rounds_"):  # set by training.fit_from_log after its last fit
            self.__dict__.pop(stale, None)
        self._fit(Xv, accepted, drafted)
        return self

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        raise NotImplementedError

    def _survival(self, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _expected_tokens(self, X: np.ndarray) -> np.ndarray:
        return expected_tokens_from_survival(self._survival(X), self.candidates_)

    def survival(self, X: Any) -> np.ndarray:
        """``P(accepted >= k)`` for ``k = 1..max_gamma_`` per row of ``X``, as the fitted model estimates it.

        Returns
        -------
        ndarray of shape (n_rows, max_gamma_)
        """
        check_is_fitted(self)
        return self._survival(self._prepare_X(X, reset=False))

    def expected_values(self, X: Any) -> dict[str, np.ndarray]:
        """Expected outcome of every candidate gamma for each row.

        Returns
        -------
        dict
            ``candidates`` (G,), and arrays of shape (n, G):
            ``tokens_per_step``, ``step_time`` (in the cost model's unit) and
            ``tokens_per_second`` (per target-step time for a relative model),
            plus ``objective``: the values the decision maximises.
        """
        check_is_fitted(self)
        Xv = self._prepare_X(X, reset=False)
        return self._values(Xv)

    def _values(self, Xv: np.ndarray) -> dict[str, np.ndarray]:
        tokens = self._expected_tokens(Xv)
        table = self.cost_model_.time_table(self.candidates_)
        step_time = table[self._codes(Xv)]
        tps = objective_values(tokens, step_time, "tokens_per_second", self.cost_model_.unit)
        obj = tokens if self.objective == "tokens_per_step" else tps
        return {
            "candidates": self.candidates_.copy(),
            "tokens_per_step": tokens,
            "step_time": step_time,
            "tokens_per_second": tps,
            "objective": obj,
        }

    def decision_values(self, X: Any) -> np.ndarray:
        """Objective value per candidate, shape (n, G): what ``predict`` maximises."""
        return self.expected_values(X)["objective"]

    def predict(self, X: Any) -> np.ndarray:
        """Chosen gamma per row (ties go to the smallest gamma).

        Returns
        -------
        ndarray of int64, shape (n,)
        """
        check_is_fitted(self)
        Xv = self._prepare_X(X, reset=False)
        obj = self._values(Xv)["objective"]
        return self.candidates_[np.argmax(obj, axis=1)]

    def score(self, X: Any, y: Any) -> float:
        """Counterfactual objective of ``predict(X)`` on logged outcomes ``y``.

        Tokens per second (total tokens over total modelled time) or mean
        tokens per step, by ``objective``; higher is better, so it can drive
        ``GridSearchCV`` directly.
        """
        return self.realized_objective(X, y)

    def realized_objective(self, X: Any, y: Any, objective: str | None = None, cost_model: Any = None) -> float:
        """Counterfactual ``objective`` (default: the policy's own) of ``predict(X)`` on logged outcomes ``y``.

        ``cost_model`` prices it (default: the policy's own). See :meth:`score`.
        """
        check_is_fitted(self)
        Xv = self._prepare_X(X, reset=False)
        acc, drafted = self._split_targets(y, Xv.shape[0], self.max_gamma_)
        chosen = self.candidates_[np.argmax(self._values(Xv)["objective"], axis=1)]
        cm = cost_model if cost_model is not None else self.cost_model_
        return realized_throughput(chosen, acc, drafted, self._codes(Xv), cm, objective or self.objective)

    def __sklearn_tags__(self):  # type: ignore[no-untyped-def]
        tags = super().__sklearn_tags__()  # type: ignore[misc]
        tags.target_tags.required = True
        tags.input_tags.allow_nan = False
        return tags


def objective_scorer(
    objective: str = "tokens_per_second", cost_model: CostModel | None = None
) -> Callable[[GammaPolicy, Any, Any], float]:
    """A scorer ``(policy, X, y) -> float`` for ``GridSearchCV(scoring=...)``.

    Parameters
    ----------
    objective : {'tokens_per_second', 'tokens_per_step'}
        Quantity to report (higher is better).
    cost_model : CostModel or None
        Cost model for tokens per second; ``None`` uses the policy's own.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVES)}")

    def scorer(policy: GammaPolicy, X: Any, y: Any) -> float:
        return policy.realized_objective(X, y, objective, cost_model)

    return scorer


def training_data(log: Any, feature_set: str = "online", split: str | None = "train") -> tuple[Any, np.ndarray]:
    """Features and ``(accepted, gamma_drafted)`` targets from a step log.

    Parameters
    ----------
    log : pandas.DataFrame
        A validated step log (:func:`speckv_policy.logs.read_log`).
    feature_set : str
        Feature set to compute.
    split : {'train', 'heldout'} or None
        Keep only steps of prompts in this split; ``None`` keeps all.

    Returns
    -------
    X : pandas.DataFrame
    y : ndarray of int64, shape (n, 2)
    """
    from ..features import features_from_log

    X, accepted, drafted = features_from_log(log, feature_set)
    if split is not None:
        keep = (log.loc[X.index, "split"] == split).to_numpy()
        X, accepted, drafted = X[keep], accepted[keep], drafted[keep]
    if len(X) == 0:
        raise ValueError(f"no usable steps in the log for split={split!r}")
    return X, np.column_stack([accepted, drafted]).astype(np.int64)
