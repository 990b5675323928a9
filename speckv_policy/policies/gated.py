"""Gated policy: a gate decides before drafting whether to draft at all, a length head picks gamma after the probe.

The hook's ``gated`` mode (``attach(..., mode="gated")``) runs it: before the
draft runs, the gate sees the ``pre`` features (acceptance history, the
target's confidence at the last verified position, the context's
self-repetition, ...). A closed gate makes the step a plain target step that
costs nothing else. An open gate drafts one token (the probe) and the length
head picks gamma from every ``pre`` feature plus that token's confidence and
entropy (the ``gated`` feature set).

Both heads are ordinary policies of any family, fitted on the same rows:

* the gate prices candidates as the ``pre`` mode does (no probe: gamma ``g``
  costs ``g`` draft tokens), and opens when its best candidate drafts;
* the head prices them as the ``upfront`` mode does (the probe token is paid
  even when it then chooses 0).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.utils.validation import check_is_fitted

from ..schema import PRE
from .base import GammaPolicy, shared_parameters_doc
from .gbt import GBTPolicy

#: Feature set of a gated policy's input: the ``pre`` features first, then the probe token's.
GATED_FEATURE_SET = "gated"


@shared_parameters_doc
class GatedPolicy(GammaPolicy, BaseEstimator):
    """A pre-draft gate and an after-probe length head in one policy.

    Parameters
    ----------
    {shared_parameters}
    gate : GammaPolicy or None, default=None
        Unfitted policy cloned for the gate (``None``: :class:`GBTPolicy`).
        It is fitted on the ``pre`` columns with this policy's candidates,
        objective and cost model, priced without a probe.
    head : GammaPolicy or None, default=None
        Unfitted policy cloned for the length head (``None``:
        :class:`GBTPolicy`), fitted on every column, priced with the probe.

    Attributes
    ----------
    gate_, head_ : GammaPolicy
        The fitted heads.
    n_gate_features_ : int
        Leading columns of ``X`` the gate reads.

    Notes
    -----
    :meth:`predict` returns the gamma the hook ends up with: 0 where the gate
    is closed, the head's choice where it is open (``feature_set='gated'``
    needs the probe token's columns for every row; offline they come from the
    log). The gate's expected value of opening ignores that the head may still
    choose 0 after paying the probe; :func:`speckv_policy.evaluation.evaluate`
    charges that probe wherever it happens.
    """

    _parameter_constraints: dict = {
        **GammaPolicy.common_parameter_constraints,
        "gate": [GammaPolicy, None],
        "head": [GammaPolicy, None],
    }

    def __init__(
        self,
        *,
        candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8),
        objective: str = "tokens_per_second",
        cost_model: Any = None,
        feature_set: str | None = GATED_FEATURE_SET,
        gate: GammaPolicy | None = None,
        head: GammaPolicy | None = None,
    ) -> None:
        self._store_shared_params(candidates, objective, cost_model, feature_set)
        self.gate = gate
        self.head = head

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        if self.feature_set not in (GATED_FEATURE_SET, None):
            raise ValueError(f"GatedPolicy reads feature_set='{GATED_FEATURE_SET}' (or None), got {self.feature_set!r}")
        if 0 not in self.candidates_:
            raise ValueError("GatedPolicy needs gamma 0 among its candidates: a closed gate is a plain target step")
        named = self.feature_set is not None
        self.n_gate_features_ = PRE.n_features if named else X.shape[1]
        y = np.column_stack([accepted, drafted])
        shared = {"candidates": tuple(int(c) for c in self.candidates_), "objective": self.objective}
        cm = self.cost_model_
        self.gate_ = clone(self.gate if self.gate is not None else GBTPolicy()).set_params(
            **shared, cost_model=replace(cm, decision_draft_tokens=0), feature_set=PRE.name if named else None
        )
        self.gate_.fit(X[:, : self.n_gate_features_], y)
        self.head_ = clone(self.head if self.head is not None else GBTPolicy()).set_params(
            **shared, cost_model=replace(cm, decision_draft_tokens=1), feature_set=self.feature_set
        )
        self.head_.fit(X, y)

    def _gate_open(self, Xv: np.ndarray) -> np.ndarray:
        return self.gate_.predict(Xv[:, : self.n_gate_features_]) > 0

    def _values(self, Xv: np.ndarray) -> dict[str, np.ndarray]:
        out = self.head_.expected_values(Xv)
        closed = ~self._gate_open(Xv)
        obj = out["objective"].copy()
        # a closed gate leaves only gamma 0: its value stays, every drafting candidate scores 0 (values are > 0)
        obj[np.ix_(closed, self.candidates_ != 0)] = 0.0
        out["objective"] = obj
        out["gate_open"] = ~closed
        return out

    def predict_with_gate(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(gamma, gate_open)`` per row, the gate evaluated once: :meth:`predict` and :meth:`predict_gate` together."""
        check_is_fitted(self)
        Xv = self._prepare_X(X, reset=False)
        opened = self._gate_open(Xv)
        return np.where(opened, self.head_.predict(Xv), 0).astype(np.int64), opened

    def predict_gate(self, X: Any) -> np.ndarray:
        """Whether the gate opens (drafts) for each row; it reads only the ``pre`` columns."""
        check_is_fitted(self)
        return self._gate_open(self._prepare_X(X, reset=False))

    def predict_length(self, X: Any) -> np.ndarray:
        """The length head's gamma per row, as if the gate had opened."""
        check_is_fitted(self)
        return self.head_.predict(self._prepare_X(X, reset=False))
