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
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from .atomic import NotAFileError, readable_file
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


def tokens_credited(gamma: int | np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> np.ndarray:
    """:func:`tokens_if`, with a censored outcome credited ``drafted + 1`` tokens.

    Those are the tokens known for certain, so a choice longer than the logged
    draft is never flattered.
    """
    tok = tokens_if(gamma, accepted, drafted)
    return np.where(np.isnan(tok), np.asarray(drafted) + 1.0, tok)


def survival_observations(accepted: np.ndarray, drafted: np.ndarray, max_gamma: int) -> tuple[np.ndarray, np.ndarray]:
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

    ``step_ms(gamma) = overhead_ms + draft(k) + verify(gamma)`` with
    ``k = max(gamma, decision_draft_tokens)`` draft tokens,
    ``draft(k) = draft_base_ms + k * draft_ms_per_token`` for ``k >= 1`` (0 for
    ``k = 0``), and ``verify(gamma) = verify_table_ms[gamma]`` where the table
    has a value, else ``verify_base_ms + verify_ms_per_token * gamma``. The
    target verifies ``gamma + 1`` tokens (gamma 0 is a plain target step), and a
    policy that decides after seeing the first draft token pays that token even
    when it then chooses gamma 0 (``decision_draft_tokens=1``).

    The table matters on CPUs: a one-token forward (gamma 0) is much cheaper
    than any multi-token forward, which a line through all gammas misses.

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
    draft_base_ms : tuple of float, default=(0, 0, 0)
        Fixed cost of a drafting call (paid once per step that drafts >= 1 token).
    verify_table_ms : tuple of tuple of float, optional
        Per compression code, the verify time for gamma = 0, 1, ...; gammas past
        the end of a row use the line.
    unit : str, default="ms"
        ``"ms"`` for measured costs; ``"target_step"`` for the relative default.
    machine : str, default=""
        The machine that measured the costs (``speckv-calibrate`` writes
        :func:`speckv_policy.machine.describe_host`); descriptive only, not
        compared, and empty for costs of unknown origin.
    """

    draft_ms_per_token: tuple[float, ...]
    verify_base_ms: tuple[float, ...]
    verify_ms_per_token: tuple[float, ...]
    decision_draft_tokens: int = 0
    overhead_ms: float = 0.0
    device: str = "unspecified"
    unit: str = "ms"
    n_rows: dict[int, int] = field(default_factory=dict, compare=False)
    draft_base_ms: tuple[float, ...] = (0.0, 0.0, 0.0)
    verify_table_ms: tuple[tuple[float, ...], ...] | None = None
    machine: str = field(default="", compare=False, repr=False)  # repr: params in exports read as before

    def __post_init__(self) -> None:
        _check_cost_fields(self)

    @classmethod
    def relative(
        cls, draft_cost: float = 0.1, verify_cost_per_token: float = 0.05, decision_draft_tokens: int = 0
    ) -> CostModel:
        """Cost in units of one target step, the same at every compression level.

        ``draft_cost`` is ``c`` of Leviathan et al. (draft forward / target forward).
        """
        t = (float(draft_cost),) * 3
        return cls(
            t,
            (1.0,) * 3,
            (float(verify_cost_per_token),) * 3,
            decision_draft_tokens=decision_draft_tokens,
            unit="target_step",
        )

    @classmethod
    def fit(
        cls,
        log: Any,
        *,
        device: str | None = None,
        decision_draft_tokens: int = 0,
        verify: str = "table",
        min_rows: int = 5,
    ) -> CostModel:
        """Fit from a step log's ``draft_ms`` and ``verify_ms`` columns.

        Drafting: a least-squares line in gamma over steps that drafted (fixed
        cost per call + cost per token); with one distinct gamma, the cost per
        token is ``sum(draft_ms) / sum(gamma)``. Verifying: a least-squares line in
        the number of draft tokens (fitted on steps with gamma >= 1 when there
        are two such gammas), and with ``verify="table"`` (default) the mean
        verify time of every gamma logged at least ``min_rows`` times at that
        level, which then overrides the line there. First steps (``step == 0``)
        are left out when they are at most half the rows: they also pay the
        prompt's prefill. A level whose rows all
        verified the same number of tokens borrows the pooled relative slope of
        the other levels for its line. Timing outliers (over
        :data:`OUTLIER_FACTOR` times the median of their level and gamma, or of
        what nearby gammas bound them to in a group of fewer than three rows;
        not finite; over :data:`MAX_STEP_COST`) are left out with a
        :class:`CostModelWarning` naming them.

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
        if "step" in df and (df["step"] > 0).sum() >= max(len(df) // 2, 1):
            df = df[df["step"] > 0]  # a first step also pays the prompt's prefill, whatever gamma it chose
        df = _drop_timing_outliers(df)
        codes = df["compression"].map(COMPRESSION_CODES).to_numpy()
        gamma = df["gamma"].to_numpy(np.float64)
        dms = df["draft_ms"].to_numpy(np.float64)
        vms = df["verify_ms"].to_numpy(np.float64)
        fits: dict[int, tuple[float, float | None, float]] = {}
        counts: dict[int, int] = {}
        if verify not in ("table", "line"):
            raise ValueError(f"verify must be 'table' or 'line', got {verify!r}")
        draft_base: dict[int, float] = {}
        tables: dict[int, dict[int, float]] = {}
        for c in range(N_COMPRESSION_CODES):
            m = codes == c
            counts[c] = int(m.sum())
            if not m.any():
                continue
            g, v = gamma[m], vms[m]
            d = float(dms[m].sum() / g.sum()) if g.sum() > 0 else math.nan
            drafted = g > 0
            draft_base[c] = 0.0
            if len(np.unique(g[drafted])) >= 2:
                d_slope, d_base = np.polyfit(g[drafted], dms[m][drafted], 1)
                if d_slope > 0 and d_base >= 0:
                    d, draft_base[c] = float(d_slope), float(d_base)
            on = g >= 1 if len(np.unique(g[g >= 1])) >= 2 else np.ones_like(g, dtype=bool)
            if len(np.unique(g[on])) >= 2:
                slope, base = np.polyfit(g[on], v[on], 1)
                slope = max(float(slope), 0.0)
                base = float(np.mean(v[on] - slope * g[on]))
                if base <= 0:  # noisy timings tilted the line past zero: a flat line through the mean instead
                    slope, base = 0.0, float(np.mean(v[on]))
                fits[c] = (d, slope, base)
            else:
                fits[c] = (d, None, float(v.mean()))
            if verify == "table":
                tables[c] = {int(k): float(v[g == k].mean()) for k in np.unique(g) if (g == k).sum() >= min_rows}
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
        near = {c: min(resolved, key=lambda k: (abs(k - c), k)) for c in range(N_COMPRESSION_CODES)}
        full = [resolved[near[c]] for c in range(N_COMPRESSION_CODES)]
        dr, vs, vb = zip(*full)
        table = None
        if tables and any(tables.values()):
            width = max(max(t) for t in tables.values() if t) + 1
            table = tuple(
                tuple(tables.get(near[c], {}).get(k, vb[c] + vs[c] * k) for k in range(width))
                for c in range(N_COMPRESSION_CODES)
            )
        return cls(
            tuple(dr),
            tuple(vb),
            tuple(vs),
            decision_draft_tokens=decision_draft_tokens,
            device=device,
            unit="ms",
            n_rows=counts,
            draft_base_ms=tuple(draft_base.get(near[c], 0.0) for c in range(N_COMPRESSION_CODES)),
            verify_table_ms=table,
        )

    def draft_ms(self, tokens: np.ndarray | Sequence[int] | int, code: np.ndarray | int) -> np.ndarray:
        """Time of one drafting call producing ``tokens`` tokens (0 for none), broadcast."""
        k = np.asarray(tokens, dtype=np.float64)
        c = np.asarray(code, dtype=np.int64)
        d = np.asarray(self.draft_ms_per_token)[c]
        db = np.asarray(self.draft_base_ms)[c]
        return np.where(k > 0, db + k * d, 0.0)

    def verify_ms(self, gamma: np.ndarray | Sequence[int] | int, code: np.ndarray | int) -> np.ndarray:
        """Time of the target pass verifying ``gamma`` draft tokens (``gamma + 1`` positions), broadcast."""
        g = np.asarray(gamma, dtype=np.float64)
        c = np.asarray(code, dtype=np.int64)
        verify = np.asarray(self.verify_base_ms)[c] + np.asarray(self.verify_ms_per_token)[c] * g
        if self.verify_table_ms is not None:
            table = np.asarray(self.verify_table_ms, dtype=np.float64)
            gi = np.clip(g, 0, table.shape[1] - 1).astype(np.int64)
            verify = np.where(g < table.shape[1], table[c, gi], verify)
        return verify

    def step_ms(self, gamma: np.ndarray | Sequence[int] | int, code: np.ndarray | int) -> np.ndarray:
        """Expected step time for ``gamma`` at compression ``code`` (broadcast)."""
        g = np.asarray(gamma, dtype=np.float64)
        k = np.maximum(g, self.decision_draft_tokens)
        return self.overhead_ms + self.draft_ms(k, code) + self.verify_ms(g, code)

    def time_table(self, candidates: Sequence[int]) -> np.ndarray:
        """Step times, shape (3, G): row = compression code, column = candidate."""
        g = np.asarray(candidates, dtype=np.float64)[None, :]
        return self.step_ms(g, np.arange(N_COMPRESSION_CODES)[:, None])

    def priced_like(self, own: CostModel | None) -> CostModel:
        """These times with ``own``'s ``decision_draft_tokens`` (``self`` if ``own`` is None).

        A calibration describes a machine, not a decision mode: re-pricing a
        policy or export takes the calibration's times and keeps the draft
        tokens its mode pays before deciding (the upfront probe).
        """
        return self if own is None else replace(self, decision_draft_tokens=own.decision_draft_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (stored in exported models)."""
        d = asdict(self)
        d["n_rows"] = {str(k): v for k, v in self.n_rows.items()}
        if not d["machine"]:  # unknown origin: left out, so files and exports of such costs read as they always did
            del d["machine"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        CostModelError
            Naming the field, when a value has the wrong type, shape or magnitude.
        """
        d = dict(d)
        for k in ("draft_ms_per_token", "verify_base_ms", "verify_ms_per_token", "draft_base_ms"):
            if k in d:
                d[k] = _numbers(k, d[k])
        if d.get("verify_table_ms") is not None:
            t = d["verify_table_ms"]
            if not isinstance(t, (list, tuple)):
                raise CostModelError(f"verify_table_ms must be a list of rows, got {type(t).__name__}")
            d["verify_table_ms"] = tuple(_numbers(f"verify_table_ms[{i}]", row) for i, row in enumerate(t))
        rows = d.get("n_rows", {})
        if not isinstance(rows, dict):
            raise CostModelError(
                f"n_rows must be an object of compression code -> row count, got {type(rows).__name__}"
            )
        try:
            d["n_rows"] = {int(k): v for k, v in rows.items()}
        except ValueError:
            raise CostModelError(f"n_rows keys must be compression codes 0, 1, 2, got {sorted(rows)!r}") from None
        return cls(**d)

    def to_json(self) -> str:
        """JSON string of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self) -> list[str]:
        """One line per compression code: draft per call and per token, verify per gamma (for printing)."""
        names = COMPRESSION_NAMES_BY_CODE
        lines = []
        for c in range(N_COMPRESSION_CODES):
            if self.verify_table_ms:
                verify = (
                    f"verify for gamma 0..{len(self.verify_table_ms[c]) - 1}: "
                    f"{np.round(self.verify_table_ms[c], 1).tolist()}"
                )
            else:
                verify = f"verify {self.verify_base_ms[c]:.2f} + {self.verify_ms_per_token[c]:.2f} per token"
            lines.append(
                f"{c} ({names[c]}): draft {self.draft_base_ms[c]:.1f} per call + "
                f"{self.draft_ms_per_token[c]:.2f} per token; {verify}"
            )
        return lines

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON to ``path``, atomically (what ``speckv-calibrate`` writes)."""
        from .atomic import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, source: CostModel | dict[str, Any] | str | os.PathLike[str]) -> CostModel:
        """A cost model from a :class:`CostModel`, its :meth:`to_dict`, or a JSON file written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            If the file does not exist.
        CostModelError
            A ValueError naming the file (and the field), when it is not a regular file, not JSON, or not a valid
            cost model (see :class:`CostModel`: every field is checked for type, shape, sign and magnitude).
        """
        if isinstance(source, CostModel):
            return source
        if isinstance(source, dict):
            where, d = "cost model", source
        else:
            where = os.fspath(source)
            try:
                readable_file(where, "cost model file")
            except NotAFileError as exc:
                raise CostModelError(str(exc)) from None
            try:
                with open(where, encoding="utf-8") as fh:
                    d = json.load(fh)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CostModelError(f"{where}: not a JSON cost model ({exc})") from None
        if not isinstance(d, dict):
            raise CostModelError(f"{where}: expected a JSON object with the CostModel fields, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        missing = sorted(k for k in ("draft_ms_per_token", "verify_base_ms", "verify_ms_per_token") if k not in d)
        if unknown or missing:
            raise CostModelError(
                f"{where}: not a cost model"
                + (f"; unknown fields {', '.join(unknown)}" if unknown else "")
                + (f"; missing fields {', '.join(missing)}" if missing else "")
            )
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as exc:
            raise CostModelError(f"{where}: invalid cost model ({exc})") from None


class CostModelError(ValueError):
    """A cost model that cannot be used: a field of the wrong type, shape, sign or magnitude (named)."""


#: The largest time, in ms (or target steps), any part of one step may cost: one hour. A larger figure is a broken
#: calibration (a clock jump, a unit mix-up), not a machine.
MAX_STEP_COST = 3.6e6

_UNITS = ("ms", "target_step")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _numbers(name: str, values: Any) -> tuple[float, ...]:
    """``values`` as a tuple of floats; CostModelError naming ``name`` unless it is a list of numbers."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, np.ndarray)):
        raise CostModelError(f"{name} must be a list of numbers, got {type(values).__name__}")
    if not all(_is_number(v) for v in values):
        raise CostModelError(f"{name} must hold numbers only, got {list(values)!r}")
    return tuple(float(v) for v in values)


def _check_cost_fields(cm: CostModel) -> None:
    """Every field of ``cm``: type, shape, finite, sign and magnitude (at most :data:`MAX_STEP_COST`)."""
    n = N_COMPRESSION_CODES

    def times(name: str, vals: Any, positive: bool = False) -> None:
        vals = _numbers(name, vals)
        if len(vals) != n:
            raise CostModelError(f"{name} needs {n} values (codes 0, 1, 2), got {list(vals)!r}")
        low = "> 0" if positive else ">= 0"
        if not all(math.isfinite(v) and (v > 0 if positive else v >= 0) and v <= MAX_STEP_COST for v in vals):
            raise CostModelError(f"{name} must be finite, {low} and <= {MAX_STEP_COST:g}, got {list(vals)!r}")

    times("draft_ms_per_token", cm.draft_ms_per_token)
    times("verify_base_ms", cm.verify_base_ms, positive=True)
    times("verify_ms_per_token", cm.verify_ms_per_token)
    times("draft_base_ms", cm.draft_base_ms)
    if not _is_number(cm.decision_draft_tokens) or cm.decision_draft_tokens not in (0, 1):
        raise CostModelError(f"decision_draft_tokens must be 0 or 1, got {cm.decision_draft_tokens!r}")
    o = cm.overhead_ms
    if not _is_number(o) or not (math.isfinite(o) and 0 <= o <= MAX_STEP_COST):
        raise CostModelError(f"overhead_ms must be a finite number in [0, {MAX_STEP_COST:g}], got {o!r}")
    if cm.unit not in _UNITS:
        raise CostModelError(f"unit must be one of {', '.join(_UNITS)}, got {cm.unit!r}")
    for name in ("device", "machine"):
        if not isinstance(getattr(cm, name), str):
            raise CostModelError(f"{name} must be a string, got {type(getattr(cm, name)).__name__}")
    if not isinstance(cm.n_rows, dict) or not all(
        _is_number(k) and int(k) in range(n) and _is_number(v) and int(v) == v and v >= 0 for k, v in cm.n_rows.items()
    ):
        raise CostModelError(f"n_rows must map compression codes 0..{n - 1} to row counts >= 0, got {cm.n_rows!r}")
    t = cm.verify_table_ms
    if t is not None:
        if not isinstance(t, (list, tuple)) or len(t) != n:
            raise CostModelError(f"verify_table_ms needs {n} rows (codes 0, 1, 2), got {t!r}")
        rows = [_numbers(f"verify_table_ms[{i}]", r) for i, r in enumerate(t)]
        if len({len(r) for r in rows}) != 1 or not rows[0]:
            raise CostModelError(
                f"verify_table_ms needs {n} non-empty rows of equal length, got lengths {[len(r) for r in rows]}"
            )
        if not all(math.isfinite(v) and 0 < v <= MAX_STEP_COST for r in rows for v in r):
            raise CostModelError(f"verify_table_ms values must be finite, > 0 and <= {MAX_STEP_COST:g}")


class CostModelWarning(UserWarning):
    """Rows left out of a cost-model fit (timing outliers), named in the message."""


#: A step whose draft or verify time is over this many times the median of its compression level and gamma is an
#: outlier (a page fault, another process, a clock jump) and is left out of the cost model, with a warning.
OUTLIER_FACTOR = 5.0


def _small_group_reference(t: np.ndarray, g: np.ndarray, same: np.ndarray, i: int, col: str) -> float:
    """The most row ``i`` could plausibly cost, from the other rows of its level (``same``): each bounds it.

    Time does not fall as gamma grows, and grows at most in proportion to the tokens processed (``gamma + 1``
    verified, ``gamma`` drafted), so a row at ``g'`` bounds one at ``g`` by ``t' * max(1, (g + 1) / (g' + 1))``
    for verify times (``max(g, 1) / max(g', 1)`` for draft times). The median of those bounds is the reference.
    """
    others = same.copy()
    others[i] = False
    if not others.any():
        return math.nan
    gi, gj, tj = g[i], g[others], t[others]
    ratio = (gi + 1.0) / (gj + 1.0) if col == "verify_ms" else max(gi, 1.0) / np.maximum(gj, 1.0)
    return float(np.median(tj * np.maximum(1.0, ratio)))


def _drop_timing_outliers(df: Any) -> Any:
    """``df`` without timing outliers (see :data:`OUTLIER_FACTOR`), warning with the rows dropped.

    A row is an outlier if its draft or verify time is not finite, over :data:`MAX_STEP_COST`, or over
    :data:`OUTLIER_FACTOR` times a reference: the median of its (compression, gamma) group where that group has
    three rows or more; else the median of the bounds the other rows of its level put on it
    (:func:`_small_group_reference`), or of all rows when its level has fewer than three (then ``4 x`` the factor:
    levels may differ that much).
    """
    import warnings

    groups = [df["compression"], df["gamma"]]
    bad = np.zeros(len(df), dtype=bool)
    comp = df["compression"].to_numpy()
    gam = df["gamma"].to_numpy(np.float64)
    for col in ("draft_ms", "verify_ms"):
        x = df[col].astype(np.float64)
        med = x.groupby(groups).transform("median")
        size = x.groupby(groups).transform("size").to_numpy()
        t = x.to_numpy()
        bad |= ((size >= 3) & (med > 0) & (x > OUTLIER_FACTOR * med)).to_numpy()
        bad |= ~np.isfinite(t) | (t > MAX_STEP_COST)
        usable = np.isfinite(t) & (t <= MAX_STEP_COST)
        for i in np.flatnonzero((size < 3) & usable):
            same = (comp == comp[i]) & usable
            factor = OUTLIER_FACTOR
            if same.sum() < 3:
                same, factor = usable, 4 * OUTLIER_FACTOR
            ref = _small_group_reference(t, gam, same, i, col)
            if ref > 0 and t[i] > factor * ref:
                bad[i] = True
    if not bad.any():
        return df
    rows = df.index[bad]
    shown = ", ".join(
        f"{i} (draft {df.at[i, 'draft_ms']:.4g} ms, verify {df.at[i, 'verify_ms']:.4g} ms)" for i in rows[:5]
    )
    warnings.warn(
        f"cost model: left out {len(rows)} step(s) whose draft or verify time is not finite or over "
        f"{OUTLIER_FACTOR:g}x what the other steps of their compression level and gamma (or nearby gammas) took: "
        f"row {shown}" + (" ..." if len(rows) > 5 else ""),
        CostModelWarning,
        stacklevel=3,
    )
    return df[~bad]


#: What each compression code stands for, as :meth:`CostModel.describe` prints it.
COMPRESSION_NAMES_BY_CODE = ("full precision", "int8", "nf4")


def per_second_scale(unit: str) -> float:
    """Factor turning tokens per unit of cost into the reported rate.

    Measured costs (``unit="ms"``) give tokens per second (x 1000); a relative
    cost model (``unit="target_step"``) gives tokens per target-step time (x 1).
    """
    return 1000.0 if unit == "ms" else 1.0


def rate_label(unit: str) -> str:
    """What :func:`per_second_scale` rates are called: ``tokens/s`` or ``tokens per target step``."""
    return "tokens/s" if unit == "ms" else "tokens per target step"


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
    scale = per_second_scale(unit)
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
    tok = tokens_credited(chosen, accepted, drafted)
    if objective == "tokens_per_step":
        return float(tok.mean())
    check_objective(objective)
    t = cost_model.step_ms(chosen, codes)
    return float(per_second_scale(cost_model.unit) * tok.sum() / t.sum())
