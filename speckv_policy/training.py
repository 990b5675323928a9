"""Train policies from a step log: shared by the CLIs and notebooks."""

from __future__ import annotations

import os
from typing import Any

import joblib
import numpy as np
import pandas as pd

from .logs import atomic_write_bytes
from .objective import CostModel, realized_throughput
from .policies import POLICIES, GammaPolicy, training_data
from .policies.base import _check_candidates

DEFAULT_FEATURE_SET = {"mlp": "online", "gbt": "online", "table": "online", "fixed": "online", "paper-mlp16": "paper"}


def make_policy(
    kind: str,
    *,
    objective: str | None = None,
    candidates: tuple[int, ...] | None = None,
    cost_model: CostModel | None = None,
    feature_set: str | None = None,
    gamma: int = 4,
) -> GammaPolicy:
    """A policy of ``kind`` (``mlp``, ``gbt``, ``table``, ``fixed``, ``paper-mlp16``).

    Options left ``None`` keep each policy's own default (the paper recipe
    keeps its tokens-per-step objective and {2, 4, 6, 8}).
    """
    if kind not in POLICIES:
        raise ValueError(f"unknown policy {kind!r}; expected one of {', '.join(POLICIES)}")
    params: dict[str, Any] = {"cost_model": cost_model, "feature_set": feature_set or DEFAULT_FEATURE_SET[kind]}
    if objective is not None:
        params["objective"] = objective
    if kind == "fixed":
        params["gamma"] = gamma
    elif candidates is not None:
        params["candidates"] = tuple(int(c) for c in _check_candidates(candidates))
    return POLICIES[kind](**params)


def fit_from_log(policy: GammaPolicy, log: pd.DataFrame, split: str | None = "train") -> GammaPolicy:
    """Fit ``policy`` on the log's ``split`` steps with its feature set."""
    X, y = training_data(log, policy.feature_set, split=split)
    return policy.fit(X, y)


def evaluation_rows(log: pd.DataFrame, feature_set: str, max_gamma: int) -> tuple[pd.DataFrame, np.ndarray]:
    """Held-out steps that drafted at least ``max_gamma`` (every outcome known)."""
    X, y = training_data(log, feature_set, split="heldout")
    keep = y[:, 1] >= max_gamma
    if not keep.any():
        raise ValueError(f"no held-out steps drafted >= {max_gamma} tokens")
    return X[keep], y[keep]


def offline_summary(
    policy: GammaPolicy, log: pd.DataFrame, cost_model: CostModel, max_gamma: int = 8
) -> dict[str, float]:
    """Counterfactual tokens/s of ``policy`` on held-out steps, with references.

    Returns the policy's tokens/s, fixed gamma 4's, the best fixed gamma in
    hindsight (and which), the per-step oracle in hindsight, and mean tokens
    per step — all over the same held-out steps under ``cost_model``.
    """
    X, y = evaluation_rows(log, policy.feature_set, max_gamma)
    acc, drafted = y[:, 0], y[:, 1]
    codes = policy._codes(policy._prepare_X(X, reset=False))
    chosen = policy.predict(X)
    tps = realized_throughput(chosen, acc, drafted, codes, cost_model)
    fixed = {g: realized_throughput(np.full(len(acc), g), acc, drafted, codes, cost_model) for g in range(max_gamma + 1)}
    best_g = max(fixed, key=fixed.get)  # type: ignore[arg-type]
    # oracle in hindsight: knowing n, gamma = n (all accepted, no waste) is best per step
    g_star = np.minimum(acc, max_gamma)
    oracle = realized_throughput(g_star, acc, drafted, codes, cost_model)
    return {
        "rows": float(len(acc)),
        "tokens_per_second": tps,
        "tokens_per_step": realized_throughput(chosen, acc, drafted, codes, cost_model, "tokens_per_step"),
        "fixed4": fixed[4],
        "best_fixed": fixed[best_g],
        "best_fixed_gamma": float(best_g),
        "oracle": oracle,
        "mean_gamma": float(np.mean(chosen)),
    }


def save_policy(policy: GammaPolicy, path: str | os.PathLike[str]) -> None:
    """joblib-dump a fitted policy atomically."""
    atomic_write_bytes(path, lambda tmp: joblib.dump(policy, tmp))


def load_saved_policy(path: str | os.PathLike[str]) -> GammaPolicy:
    """Load a joblib-saved policy, checking that it is a fitted GammaPolicy."""
    from sklearn.utils.validation import check_is_fitted

    if not os.path.exists(path):
        raise FileNotFoundError(f"saved policy not found: {path}")
    try:
        obj = joblib.load(path)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable joblib file ({exc})") from exc
    if not isinstance(obj, GammaPolicy):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a speckv gamma policy")
    check_is_fitted(obj)
    return obj
