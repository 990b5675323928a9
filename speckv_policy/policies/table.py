"""Lookup-table policy: survival curves per bin of a few features."""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator

from ..objective import survival_observations
from ..schema import get_feature_set
from ._sklearn_compat import Interval
from .base import GammaPolicy, shared_parameters_doc

DEFAULT_BINNED = {
    "online": ("conf_first", "compression_code", "ema_accept_rate"),
    "paper": ("mean_confidence", "compression_code", "max_entropy_bits"),
    "pre": ("ema_accept_rate", "compression_code", "prev_fully_accepted"),
    "gated": ("conf_first", "compression_code", "ema_accept_rate"),
}


def bin_edges(values: np.ndarray, n_bins: int) -> np.ndarray:
    """Edges for one feature: midpoints for few distinct values, else quantiles.

    Edges are rounded to float32 so that bins agree exactly with the ONNX
    export, which compares float32 inputs.
    """
    uniq = np.unique(values)
    if len(uniq) <= n_bins:
        edges = (uniq[:-1] + uniq[1:]) / 2.0
    else:
        edges = np.unique(np.quantile(values, np.arange(1, n_bins) / n_bins))
        edges = edges[edges > uniq[0]]
    return np.unique(edges.astype(np.float32)).astype(np.float64)


def bin_index(X: np.ndarray, columns: np.ndarray, edges: list[np.ndarray], strides: np.ndarray) -> np.ndarray:
    """Flat bin index of each row: ``sum_j (#edges_j <= x_j) * stride_j``."""
    flat = np.zeros(X.shape[0], dtype=np.int64)
    for col, e, s in zip(columns, edges, strides):
        flat += (X[:, col][:, None] >= e[None, :]).sum(axis=1) * s
    return flat


@shared_parameters_doc
class TablePolicy(GammaPolicy, BaseEstimator):
    """Binned lookup table of acceptance survival curves.

    Each binned feature is cut at training quantiles (or between its distinct
    values when it has few, e.g. the compression code). In every cell the
    conditional acceptance at position ``k`` is estimated from the censored
    counts and shrunk towards the global estimate:
    ``(accepted_k + m * h_k) / (at_risk_k + m)`` with ``m = smoothing``, so
    sparse cells fall back to the pooled curve.

    Parameters
    ----------
    {shared_parameters}
    binned_features : tuple of str or int, or None, default=None
        Features to bin (names need a feature set; ints are column indices).
        ``None``: a default per feature set (first three columns without one).
    n_bins : int, default=6
        Maximum bins per feature.
    smoothing : float, default=10.0
        Pseudo-count of the pooled curve in every cell.

    Attributes
    ----------
    columns_ : ndarray of int
        Binned column indices.
    edges_ : list of ndarray
        Bin edges per binned column.
    survival_table_ : ndarray of shape (n_cells, max_gamma)
        Survival curve per cell.
    """

    _parameter_constraints: dict = {
        **GammaPolicy.common_parameter_constraints,
        "binned_features": ["array-like", None],
        "n_bins": [Interval(Integral, 1, None, closed="left")],
        "smoothing": [Interval(Real, 0, None, closed="left")],
    }

    def __init__(
        self,
        *,
        candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8),
        objective: str = "tokens_per_second",
        cost_model: Any = None,
        feature_set: str | None = "online",
        binned_features: tuple[str | int, ...] | None = None,
        n_bins: int = 6,
        smoothing: float = 10.0,
    ) -> None:
        self._store_shared_params(candidates, objective, cost_model, feature_set)
        self.binned_features = binned_features
        self.n_bins = n_bins
        self.smoothing = smoothing

    def _resolve_columns(self, n_features: int) -> np.ndarray:
        spec = self.binned_features
        if spec is None:
            if self.feature_set is not None:
                spec = DEFAULT_BINNED[self.feature_set]
            else:
                spec = tuple(range(min(3, n_features)))
        cols = []
        for f in spec:
            if isinstance(f, str):
                if self.feature_set is None:
                    raise ValueError(f"binned feature {f!r} is a name but feature_set is None; use column indices")
                cols.append(get_feature_set(self.feature_set).index(f))
            elif isinstance(f, (int, np.integer)) and 0 <= f < n_features:
                cols.append(int(f))
            else:
                raise ValueError(f"binned feature {f!r} is not a column of X (0..{n_features - 1})")
        if len(set(cols)) != len(cols):
            raise ValueError(f"binned_features repeats a column: {spec!r}")
        return np.asarray(cols, dtype=np.int64)

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        K = self.max_gamma_
        if K < 1:
            raise ValueError("TablePolicy needs a candidate gamma >= 1 (it models acceptance of draft tokens)")
        self.columns_ = self._resolve_columns(X.shape[1])
        self.edges_ = [bin_edges(X[:, c], self.n_bins) for c in self.columns_]
        sizes = np.array([len(e) + 1 for e in self.edges_], dtype=np.int64)
        self.strides_ = np.concatenate([np.cumprod(sizes[::-1])[::-1][1:], [1]]).astype(np.int64)
        n_cells = int(np.prod(sizes))
        events, at_risk = survival_observations(accepted, drafted, K)
        cell = bin_index(X, self.columns_, self.edges_, self.strides_)
        acc = np.zeros((n_cells, K))
        risk = np.zeros((n_cells, K))
        np.add.at(acc, cell, events)
        np.add.at(risk, cell, at_risk.astype(np.float64))
        pooled = (acc.sum(0) + 1.0) / (risk.sum(0) + 2.0)
        m = float(self.smoothing)
        hazard = (acc + m * pooled) / np.maximum(risk + m, 1e-12)
        self.cell_counts_ = risk[:, 0].astype(np.int64)
        self.survival_table_ = np.cumprod(np.clip(hazard, 0.0, 1.0), axis=1)

    def _survival(self, X: np.ndarray) -> np.ndarray:
        return self.survival_table_[bin_index(X, self.columns_, self.edges_, self.strides_)]
