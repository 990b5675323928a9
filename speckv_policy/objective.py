"""Outcomes of logged steps, censoring, the cost model and the objectives.

A step that drafted ``D`` tokens and accepted the first ``n`` tells what any
``gamma <= D`` would have produced: ``min(n, gamma) + 1`` tokens. For
``gamma > D`` it is known only when a rejection happened (``n < D``); a fully
accepted draft (``n == D``) is *censored*: nothing is known past position D.

Learned policies estimate the survival curve ``S_k(x) = P(accepted >= k | x)``
for ``k = 1..K``; expected tokens per step for ``gamma`` is then
``1 + sum_{k <= gamma} S_k`` and the expected step time comes from a
:class:`CostModel`. The objective picks the candidate gamma with the most
expected tokens per step (``tokens_per_step``, the published recipe) or per
second (``tokens_per_second``, the default).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .schema import N_COMPRESSION_CODES

OBJECTIVES: tuple[str, ...] = ("tokens_per_second", "tokens_per_step")


def check_objective(objective: str) -> str:
    """Return ``objective`` or raise a ``ValueError`` naming the valid ones."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVES)}")
    return objective


def analytic_expected_tokens(alpha: float | np.ndarray, gamma: int | np.ndarray) -> np.ndarray:
    """Expected tokens per step for i.i.d. acceptance ``alpha`` (Leviathan et al.).

    ``E = (1 - alpha**(gamma + 1)) / (1 - alpha)``, and ``gamma + 1`` at alpha = 1.
    """
    a = np.asarray(alpha, dtype=np.float64)
    g = np.asarray(gamma, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = (1.0 - a ** (g + 1.0)) / (1.0 - a)
    return np.where(np.isclose(a, 1.0), g + 1.0, e)


def tokens_if(gamma: int | np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> np.ndarray:
    """Tokens a step would have produced with ``gamma``; NaN where censored.

    Parameters
    ----------
    gamma : int or array
        Counterfactual draft length(s), broadcast against the rows.
    accepted, drafted : array of int
        Logged accepted prefix length and drafted gamma per row.
    """
    g = np.asarray(gamma)
    n = np.asarray(accepted)
    d = np.asarray(drafted)
    known = (g <= d) | (n < d)
    return np.where(known, np.minimum(n, g) + 1.0, np.nan)


def survival_observations(
    accepted: np.ndarray, drafted: np.ndarray, max_gamma: int
) -> tuple[np.ndarray, np.ndarray]:
    """Censored discrete-time labels for ``P(accepted >= k | accepted >= k-1)``.

    Returns
    -------
    events : ndarray of float, shape (n, max_gamma)
        ``events[i, k-1] = 1`` if draft token ``k`` was accepted.
    at_risk : ndarray of bool, shape (n, max_gamma)
        Whether position ``k`` was observed: it was drafted (``k <= D``) and
        every earlier token was accepted (``k <= n + 1``).
    """
    n = np.asarray(accepted, dtype=np.int64)[:, None]
    d = np.asarray(drafted, dtype=np.int64)[:, None]
    k = np.arange(1, max_gamma + 1)[None, :]
    at_risk = (k <= d) & (k <= n + 1)
    events = ((k <= n) & at_risk).astype(np.float64)
    return events, at_risk


def expected_tokens_from_survival(survival: np.ndarray, candidates: Sequence[int]) -> np.ndarray:
    """``1 + sum_{k <= gamma} S_k`` for each candidate gamma; shape (n, G)."""
    s = np.asarray(survival, dtype=np.float64)
    cum = np.concatenate([np.zeros((s.shape[0], 1)), np.cumsum(s, axis=1)], axis=1)
    return 1.0 + cum[:, list(candidates)]


@dataclass(frozen=True)
class CostModel:
    """Wall-clock cost of one speculation step, per compression code.

    ``step_ms(gamma) = overhead_ms + max(gamma, decision_draft_tokens) * draft_ms_per_token
    + verify_base_ms + verify_ms_per_token * gamma``: the target verifies
    ``gamma + 1`` tokens (gamma 0 is a plain target step), and a policy that
    decides after seeing the first draft token pays that token even when it
    then chooses gamma 0 (``decision_draft_tokens=1``).

    Parameters
    ----------
    draft_ms_per_token, verify_base_ms, verify_ms_per_token : tuple of float
        One value per compression code (0 full precision, 1 INT8, 2 NF4).
    decision_draft_tokens : int, default=0
        Draft tokens paid before the decision (0 or 1).
    overhead_ms : float, default=0.0
        Fixed per-step overhead (decision, bookkeeping).
    device : str, default="unspecified"
        Device the timings describe.
    unit : str, default="ms"
        ``"ms"`` for measured costs; ``"target_step"`` for the relative default.
    """

    draft_ms_per_token: tuple[float, ...]
    verify_base_ms: tuple[float, ...]
    verify_ms_per_token: tuple[float, ...]
    decision_draft_tokens: int = 0
    overhead_ms: float = 0.0
    device: str = "unspecified"
    unit: str = "ms"
    n_rows: dict[int, int] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("draft_ms_per_token", "verify_base_ms", "verify_ms_per_token"):
            vals = getattr(self, name)
            if len(vals) != N_COMPRESSION_CODES:
                raise ValueError(f"CostModel.{name} needs {N_COMPRESSION_CODES} values (codes 0, 1, 2), got {vals!r}")
            if not all(math.isfinite(v) and v >= 0 for v in vals):
                raise ValueError(f"CostModel.{name} must be finite and >= 0, got {vals!r}")
        if not all(v > 0 for v in self.verify_base_ms):
            raise ValueError(f"CostModel.verify_base_ms must be > 0, got {self.verify_base_ms!r}")
        if self.decision_draft_tokens not in (0, 1):
            raise ValueError("CostModel.decision_draft_tokens must be 0 or 1")

    @classmethod
    def relative(
        cls, draft_cost: float = 0.1, verify_cost_per_token: float = 0.05, decision_draft_tokens: int = 0
    ) -> "CostModel":
        """Cost in units of one target step, the same at every compression level.

        ``draft_cost`` is ``c`` of Leviathan et al. (draft forward / target forward).
        """
        t = (float(draft_cost),) * 3
        return cls(t, (1.0,) * 3, (float(verify_cost_per_token),) * 3,
                   decision_draft_tokens=decision_draft_tokens, unit="target_step")

    @classmethod
    def fit(cls, log: Any, *, device: str | None = None, decision_draft_tokens: int = 0) -> "CostModel":
        """Fit from a step log's ``draft_ms`` and ``verify_ms`` columns.

        Draft cost per token is ``sum(draft_ms) / sum(gamma)``; the verify cost
        is a least-squares line in the number of draft tokens verified. A level
        whose rows all verified the same number of tokens borrows the pooled
        relative slope of the other levels.

        Raises
        ------
        ValueError
            If the log mixes devices and ``device`` is not given, or if no
            level has two distinct gammas to fit a slope.
        """
        from .schema import COMPRESSION_CODES

        df = log
        devices = sorted(set(df["device"]))
        if device is None:
            if len(devices) > 1:
                raise ValueError(f"log has several devices ({', '.join(devices)}); pass device=...")
            device = devices[0]
        df = df[df["device"] == device]
        if len(df) == 0:
            raise ValueError(f"no rows for device {device!r} (devices in log: {', '.join(devices)})")
        codes = df["compression"].map(COMPRESSION_CODES).to_numpy()
        gamma = df["gamma"].to_numpy(np.float64)
        dms = df["draft_ms"].to_numpy(np.float64)
        vms = df["verify_ms"].to_numpy(np.float64)
        fits: dict[int, tuple[float, float | None, float]] = {}
        counts: dict[int, int] = {}
        for c in range(N_COMPRESSION_CODES):
            m = codes == c
            counts[c] = int(m.sum())
            if not m.any():
                continue
            g, v = gamma[m], vms[m]
            d = float(dms[m].sum() / g.sum()) if g.sum() > 0 else math.nan
            if len(np.unique(g)) >= 2:
                slope, base = np.polyfit(g, v, 1)
                slope = max(float(slope), 0.0)
                base = float(np.mean(v - slope * g))
                fits[c] = (d, slope, base)
            else:
                fits[c] = (d, None, float(v.mean()))
        if not fits:
            raise ValueError("log has no rows to fit a cost model")
        rel = [s / max(b, 1e-9) for d, s, b in fits.values() if s is not None]
        if any(s is None for _, s, _ in fits.values()) and not rel:
            raise ValueError(
                "cannot fit the verify-cost slope: at every compression level all rows verified "
                "the same number of tokens; log steps with at least two different gammas "
                "(gamma 0 plain steps count)"
            )
        pooled = float(np.mean(rel)) if rel else 0.0
        draft_all = float(dms.sum() / gamma.sum()) if gamma.sum() > 0 else 0.0
        resolved: dict[int, tuple[float, float, float]] = {}
        for c, (d, s, b) in fits.items():
            if s is None:  # v = b' + s' * g0 with s' = pooled * b'
                g0 = float(np.mean(gamma[codes == c]))
                b = b / (1.0 + pooled * g0)
                s = pooled * b
            resolved[c] = (draft_all if math.isnan(d) else d, s, b)
        # a level absent from the log borrows the nearest fitted level's costs
        full = [resolved[min(resolved, key=lambda k: (abs(k - c), k))] for c in range(N_COMPRESSION_CODES)]
        dr, vs, vb = zip(*full)
        return cls(tuple(dr), tuple(vb), tuple(vs), decision_draft_tokens=decision_draft_tokens,
                   device=device, unit="ms", n_rows=counts)

    def step_ms(self, gamma: np.ndarray | Sequence[int] | int, code: np.ndarray | int) -> np.ndarray:
        """Expected step time for ``gamma`` at compression ``code`` (broadcast)."""
        g = np.asarray(gamma, dtype=np.float64)
        c = np.asarray(code, dtype=np.int64)
        d = np.asarray(self.draft_ms_per_token)[c]
        vb = np.asarray(self.verify_base_ms)[c]
        vs = np.asarray(self.verify_ms_per_token)[c]
        return self.overhead_ms + np.maximum(g, self.decision_draft_tokens) * d + vb + vs * g

    def time_table(self, candidates: Sequence[int]) -> np.ndarray:
        """Step times, shape (3, G): row = compression code, column = candidate."""
        g = np.asarray(candidates, dtype=np.float64)[None, :]
        return self.step_ms(g, np.arange(N_COMPRESSION_CODES)[:, None])

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (stored in exported models)."""
        d = asdict(self)
        d["n_rows"] = {str(k): v for k, v in self.n_rows.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        for k in ("draft_ms_per_token", "verify_base_ms", "verify_ms_per_token"):
            d[k] = tuple(float(x) for x in d[k])
        d["n_rows"] = {int(k): int(v) for k, v in d.get("n_rows", {}).items()}
        return cls(**d)

    def to_json(self) -> str:
        """JSON string of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), sort_keys=True)


def objective_values(
    expected_tokens: np.ndarray,
    step_time: np.ndarray,
    objective: str,
    unit: str = "ms",
) -> np.ndarray:
    """Objective per row and candidate: tokens per step or tokens per second.

    With a relative cost model (``unit="target_step"``) "per second" means per
    target-step time.
    """
    check_objective(objective)
    if objective == "tokens_per_step":
        return np.asarray(expected_tokens, dtype=np.float64)
    scale = 1000.0 if unit == "ms" else 1.0
    return scale * np.asarray(expected_tokens, dtype=np.float64) / np.asarray(step_time, dtype=np.float64)


def realized_throughput(
    chosen: np.ndarray,
    accepted: np.ndarray,
    drafted: np.ndarray,
    codes: np.ndarray,
    cost_model: CostModel,
    objective: str = "tokens_per_second",
) -> float:
    """Counterfactual throughput of a sequence of choices on logged steps.

    Tokens come from :func:`tokens_if`; a censored outcome (gamma beyond a
    fully accepted draft) is credited with the tokens known for certain,
    ``drafted + 1``, so the estimate never flatters a longer choice. For
    ``tokens_per_second`` this is total tokens over total expected time (a
    throughput, not a mean of ratios); for ``tokens_per_step`` the mean.
    """
    tok = tokens_if(chosen, accepted, drafted)
    tok = np.where(np.isnan(tok), np.asarray(drafted) + 1.0, tok)
    if objective == "tokens_per_step":
        return float(tok.mean())
    check_objective(objective)
    t = cost_model.step_ms(chosen, codes)
    scale = 1000.0 if cost_model.unit == "ms" else 1.0
    return float(scale * tok.sum() / t.sum())
