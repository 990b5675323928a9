"""On-policy history: replay a step log with the gammas a policy itself chooses.

A profile drafts ``gamma_max`` tokens on most steps, so the history features it
logs (previous step's acceptance, gamma, whether it was fully accepted, the
acceptance EMAs) describe a run that always drafts long. At run time a policy's
own choices write that history: after a gamma-0 step it does not move, after a
short draft it says "fully accepted" far more often. :func:`replay_features`
computes the features a policy would see under its own choices, step by step,
with the same :class:`~speckv_policy.features.OnlineFeatureState` the hook uses.

What it replays and what it cannot: decisions happen at the logged steps'
positions (a policy that drafts less would step through other positions; the
per-position signals, context length and context match, are the logged
ones). A step's outcome under the policy's gamma ``g`` is known from
the log when ``g`` does not exceed what the step drafted, or when the step's
draft was rejected within it; a step that drafted ``d < g`` tokens and accepted
them all is replayed as drafting ``d`` and accepting ``d`` (its outcome beyond
``d`` is unknown).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .features import OnlineFeatureState, features_from_log, logged_step_features, step_rows
from .schema import GATED, ONLINE, PRE, get_feature_set

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

#: ``choose(X) -> gamma`` or, for gated policies, ``-> (gamma, gate_open)``; ``X`` a named feature DataFrame.
ReplayChooser = Callable[[Any], Any]

#: Feature sets whose rows carry history features (the ones a replay changes).
HISTORY_SETS = (ONLINE.name, PRE.name, GATED.name)


def replayed_outcome(chosen: int, drafted: int, accepted: int) -> tuple[int, int]:
    """``(drafted, accepted)`` the state records when a policy chose ``chosen`` at a logged step.

    ``(0, 0)`` for a gamma-0 choice (the state does not move); otherwise the
    choice capped at what the log can tell (see the module notes).
    """
    if chosen <= 0:
        return 0, 0
    if chosen <= drafted:
        return chosen, min(accepted, chosen)
    if accepted < drafted:  # rejected within the logged draft: a longer choice ends the same way
        return chosen, accepted
    return drafted, drafted  # censored: known to accept everything logged, nothing beyond


def _as_choices(out: Any, n: int, gated: bool) -> tuple[np.ndarray, np.ndarray]:
    opened = None
    if gated:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError("a gated policy's choose function must return (gamma, gate_open) per row")
        out, opened = out
    g = np.asarray(out).reshape(-1)
    if g.shape[0] != n:
        raise ValueError(f"choose returned {g.shape[0]} choices for {n} rows")
    if not np.issubdtype(g.dtype, np.integer):
        if not np.all(np.isfinite(g)) or np.any(g != np.round(g)):
            raise ValueError(f"choose must return integer gammas, got {g[:5]!r}...")
    g = g.astype(np.int64)
    if (g < 0).any():
        raise ValueError("choose returned a negative gamma")
    op = (g > 0) if opened is None else np.asarray(opened, dtype=bool).reshape(-1)
    if op.shape[0] != n:
        raise ValueError(f"choose returned {op.shape[0]} gate entries for {n} rows")
    return g, op


def replay_features(
    log: pd.DataFrame, feature_set: str, choose: ReplayChooser
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Features of every drafting step of ``log`` under the history ``choose`` writes.

    The log's runs (``run_id``, ``prompt_id``) are replayed in lockstep: the
    k-th drafting step of every run is decided in one batch call, then each
    run's state records the outcome of its choice (:func:`replayed_outcome`).

    Parameters
    ----------
    log : pandas.DataFrame
        A validated step log (schema v2 for the ``pre`` and ``gated`` sets).
    feature_set : {'online', 'pre', 'gated', 'paper'}
        The policy's feature set; ``paper`` has no history, so its rows are
        the logged ones.
    choose : callable
        ``choose(X) -> gamma`` per row (``X`` a DataFrame named and ordered by
        the feature set); for ``gated``, ``-> (gamma, gate_open)``.

    Returns
    -------
    X : pandas.DataFrame
        Rows and index exactly as :func:`~speckv_policy.features.features_from_log`
        returns them, with on-policy history.
    chosen : ndarray of int64
        The policy's gamma per row.
    opened : ndarray of bool
        Whether the gate opened (gated) or the policy drafted (others).
    """
    import pandas as pd

    fs = get_feature_set(feature_set)
    logged, _, _ = features_from_log(log, fs.name)  # validates the signal columns; the rows and their order
    if fs.name not in HISTORY_SETS:
        out = choose(logged)
        g, op = _as_choices(out, len(logged), gated=False)
        return logged, g, op
    gated = fs.name == GATED.name
    steps = log.loc[logged.index]
    order = steps.sort_values(["run_id", "prompt_id", "step"], kind="stable")
    # each run's rows are contiguous in that order: one pass over the rows, cut at the runs' ends (a pass per run
    # costs pandas a column lookup per column and run, most of this function's time on a large log)
    rows_in_order = step_rows(order)
    ends = np.cumsum(order.groupby(["run_id", "prompt_id"], sort=False).size().to_numpy())
    records = [rows_in_order[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    states = []
    for rec in records:
        r0 = rec[0][1]
        temp = float(r0.temperature) if r0.decoding == "sampling" else 0.0
        states.append(OnlineFeatureState(r0.compression, temp))
    X = np.empty((len(logged), fs.n_features), dtype=np.float32)
    chosen = np.empty(len(logged), dtype=np.int64)
    opened = np.empty(len(logged), dtype=bool)
    pos = pd.Series(np.arange(len(logged)), index=logged.index)
    for k in range(max((len(r) for r in records), default=0)):
        live = [i for i, r in enumerate(records) if k < len(r)]
        rows = np.vstack([logged_step_features(states[i], records[i][k][1], fs.name) for i in live])
        out = choose(pd.DataFrame(rows, columns=list(fs.names)))
        g, op = _as_choices(out, len(live), gated)
        where = pos.loc[[records[i][k][0] for i in live]].to_numpy()
        X[where], chosen[where], opened[where] = rows, g, op
        for i, gi in zip(live, g):
            r = records[i][k][1]
            states[i].update(*replayed_outcome(int(gi), int(r.gamma), int(r.accepted)))
    return pd.DataFrame(X, columns=list(fs.names), index=logged.index), chosen, opened
