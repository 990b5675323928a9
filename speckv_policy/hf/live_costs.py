"""Live step costs: running estimates of draft and verification time from the steps generation just timed.

``attach(target, policy, costs="live")`` (or ``costs=LiveCosts(prior="costs.json")``)
re-prices an exported policy as it runs. Each finished step reports how many
tokens the draft produced and how long that took, and how many draft tokens
the target verified and how long that took. Per count, the estimate is the
median of the last ``window`` observations, shrunk with ``prior_weight``
pseudo-observations towards the prior (the export's cost model, or a
calibration) rescaled by the median ratio observed/prior over the counts seen;
counts not seen yet take that rescaled prior. The prior thus keeps its shape
(how cost grows with gamma) while its level follows this machine. Medians keep one slow step (a page fault, another
process) from moving a price; the shrinkage keeps three lucky steps from
moving it much.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import numpy as np

from ..objective import CostModel

__all__ = ["LiveCosts"]


class LiveCosts:
    """Running estimates of one compression level's step costs.

    Parameters
    ----------
    prior : CostModel, dict, path or None, default=None
        Where the estimates start; ``None`` uses the export's own cost model
        (filled in by :func:`speckv_policy.hf.attach`).
    window : int, default=64
        Observations kept per count (draft tokens, verified tokens).
    prior_weight : float, default=4.0
        How many observations the prior counts for.
    """

    def __init__(self, prior: Any = None, *, window: int = 64, prior_weight: float = 4.0) -> None:
        if not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if not prior_weight >= 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight!r}")
        self.prior_source = prior
        self.window = int(window)
        self.prior_weight = float(prior_weight)
        self.prior: CostModel | None = None
        self.code = 0
        self._draft: dict[int, deque[float]] = {}
        self._verify: dict[int, deque[float]] = {}
        self._draft_median: dict[int, float] = {}  # median of each deque, updated when it changes
        self._verify_median: dict[int, float] = {}
        self.observations = 0

    def start(self, prior: CostModel, code: int) -> None:
        """Begin estimating the costs of compression ``code`` from ``prior``."""
        self.prior = CostModel.load(self.prior_source) if self.prior_source is not None else prior
        self.code = int(code)
        self._prior_draft: dict[int, float] = {}  # memos: this runs after every step, keep it to dict lookups
        self._prior_verify: dict[int, float] = {}
        self._tables: dict[tuple[int, ...], np.ndarray] = {}

    def observe(self, drafted: int, draft_ms: float, verified: int, verify_ms: float) -> None:
        """One finished step: ``drafted`` tokens drafted in ``draft_ms``, ``verified`` draft tokens checked."""
        if drafted > 0 and math.isfinite(draft_ms) and draft_ms > 0:
            obs = self._draft.setdefault(int(drafted), deque(maxlen=self.window))
            obs.append(float(draft_ms))
            self._draft_median[int(drafted)] = statistics.median(obs)
        if verified >= 0 and math.isfinite(verify_ms) and verify_ms > 0:
            obs = self._verify.setdefault(int(verified), deque(maxlen=self.window))
            obs.append(float(verify_ms))
            self._verify_median[int(verified)] = statistics.median(obs)
        self.observations += 1

    def _prior(self, memo: dict[int, float], fn: Any, k: int) -> float:
        if k not in memo:
            memo[k] = float(fn(k, self.code))
        return memo[k]

    def _blend(
        self,
        seen: dict[int, deque[float]],
        medians: dict[int, float],
        memo: dict[int, float],
        fn: Any,
        wanted: list[int],
    ) -> dict[int, float]:
        ratios = [m / p for k, m in medians.items() if (p := self._prior(memo, fn, k)) > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        out = {}
        for k in wanted:
            base = self._prior(memo, fn, k) * scale
            n = len(seen[k]) if k in seen else 0
            out[k] = (n * medians[k] + self.prior_weight * base) / (n + self.prior_weight) if n else base
        return out

    def step_ms(self, candidates: np.ndarray) -> np.ndarray:
        """Estimated step time of each candidate gamma at this level (the prior's probe rule included)."""
        if self.prior is None:
            raise RuntimeError("LiveCosts.start() was not called")
        cm = self.prior
        cands = [int(g) for g in candidates]
        ks = sorted({max(g, cm.decision_draft_tokens) for g in cands} - {0})
        draft = self._blend(self._draft, self._draft_median, self._prior_draft, cm.draft_ms, ks)
        verify = self._blend(self._verify, self._verify_median, self._prior_verify, cm.verify_ms, sorted(set(cands)))
        return np.array([cm.overhead_ms + draft.get(max(g, cm.decision_draft_tokens), 0.0) + verify[g] for g in cands])

    def stop_prices(self, max_gamma: int) -> tuple[list[float], float]:
        """A stop rule's prices at this level, live: verification ms for gamma ``0..max_gamma`` and the draft's ms per
        token (:meth:`speckv_policy.stop.StopRule.begin`'s ``prices``).

        The per-token price is the least-squares slope, over ``1..max_gamma`` draft tokens, of the estimated time of
        a drafting call (a call's fixed part is paid once the probe is, so only the slope prices one more token).
        """
        if self.prior is None:
            raise RuntimeError("LiveCosts.start() was not called")
        if max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
        cm = self.prior
        gammas = list(range(max_gamma + 1))
        verify = self._blend(self._verify, self._verify_median, self._prior_verify, cm.verify_ms, gammas)
        if max_gamma == 1:  # a one-token cap never prices a second token
            return [float(verify[g]) for g in gammas], float(cm.draft_ms_per_token[self.code])
        ks = gammas[1:]
        draft = self._blend(self._draft, self._draft_median, self._prior_draft, cm.draft_ms, ks)
        x = np.asarray(ks, dtype=np.float64) - np.mean(ks)
        per_token = float(np.dot(x, [draft[k] for k in ks]) / np.dot(x, x))
        return [float(verify[g]) for g in gammas], max(0.0, per_token)

    def table(self, candidates: np.ndarray) -> np.ndarray:
        """``(3, G)`` step times for :meth:`RuntimePolicy.set_step_times`: the prior's, with this level live."""
        if self.prior is None:
            raise RuntimeError("LiveCosts.start() was not called")
        key = tuple(int(g) for g in candidates)
        if key not in self._tables:
            self._tables[key] = self.prior.time_table(candidates).astype(np.float64)
        t = self._tables[key].copy()
        t[self.code] = self.step_ms(candidates)
        return t
