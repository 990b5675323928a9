"""Step costs by batch size: what one request's draft length costs when an engine runs several requests per step.

In a serving engine (vLLM) one engine step verifies every running request's draft in one target pass, and the
speckv proposer drafts for them one after the other. Measured inside the engine (``speckv-calibrate --engine vllm``),
a step at batch size ``B`` whose requests draft ``g_1..g_B`` tokens costs about

    step_ms = verify_ms(B) + (verify_ms_per_token + draft_ms_per_token) * sum(g_i) + draft_base_ms * #(g_i > 0)
              + catch_up_ms_per_token * sum(m_i over the requests that draft)

where ``m_i`` is the context the draft reads before its first draft token: the tokens the request gained since its
draft last ran (one or a few after a draft, many after the policy kept the draft shut, the whole prompt at a
request's first draft). One request's share is ``verify_ms(B) / B + (draft_base_ms + catch_up_ms_per_token * m) *
(g > 0) + (verify_ms_per_token + draft_ms_per_token) * g``: a :class:`~speckv_policy.objective.CostModel` per batch
size, with which a policy's expected tokens are priced for the batch the request runs in, plus the catch-up, which
the proposer adds per request (it knows ``m``). The fixed part shrinks per request as the batch grows while drafting
does not, so the best draft length falls with load because the measured costs say so. (Maximising the batch's tokens per second
exactly would price every request with the same multiplier; with requests alike, the per-request ratio is that
optimum.)
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .atomic import NotAFileError, atomic_write_text, readable_file
from .objective import MAX_STEP_COST, CostModel, CostModelError

__all__ = ["CATCH_UP_COLUMN", "FORMAT", "BatchCosts", "is_batch_costs_file"]

#: The ``format`` field of a batch cost file.
FORMAT = "speckv-batch-costs"
#: A step slower than this many times the median of its batch size is an outlier (another process, a page fault).
OUTLIER_FACTOR = 5.0
#: Columns :meth:`BatchCosts.fit` reads: one value per measured engine step.
STEP_COLUMNS = ("batch", "draft_ms", "verify_ms", "draft_tokens", "drafting")
#: A column :meth:`BatchCosts.fit` reads where given: the context tokens the drafting requests' drafts caught up on.
CATCH_UP_COLUMN = "caught_up"
MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class BatchCosts:
    """Per-request step costs at each measured batch size.

    Parameters
    ----------
    batch_sizes : tuple of int
        Measured batch sizes, increasing, each >= 1.
    costs : tuple of CostModel
        One request's share of a step at each batch size (see the module docstring).
    engine : str, default="vllm"
        The engine the costs were measured in.
    machine : str, default=""
        The machine that measured them (descriptive only).
    n_steps : tuple of int, default=()
        Engine steps the fit at each batch size used.
    catch_up_ms_per_token : tuple of float, default=()
        What a drafting request pays per context token its draft reads before the first draft token, at each batch
        size (empty: not measured, nothing charged).
    """

    batch_sizes: tuple[int, ...]
    costs: tuple[CostModel, ...]
    engine: str = "vllm"
    machine: str = ""
    n_steps: tuple[int, ...] = field(default=(), compare=False)
    catch_up_ms_per_token: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        b = self.batch_sizes
        if not isinstance(b, tuple) or not b or not all(isinstance(x, int) and not isinstance(x, bool) for x in b):
            raise CostModelError(f"batch_sizes must be a non-empty list of ints, got {b!r}")
        if not all(1 <= x <= MAX_BATCH for x in b) or list(b) != sorted(set(b)):
            raise CostModelError(f"batch_sizes must be increasing, distinct and in 1..{MAX_BATCH}, got {list(b)}")
        if len(self.costs) != len(b) or not all(isinstance(c, CostModel) for c in self.costs):
            raise CostModelError(f"costs needs one cost model per batch size ({len(b)}), got {len(self.costs)}")
        if any(c.unit != "ms" for c in self.costs):
            raise CostModelError("batch costs are measured times: every cost model's unit must be 'ms'")
        c = self.catch_up_ms_per_token
        if not isinstance(c, tuple) or (c and len(c) != len(b)):
            raise CostModelError(f"catch_up_ms_per_token needs one cost per batch size ({len(b)}) or none, got {c!r}")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_STEP_COST for x in c):
            raise CostModelError(f"catch_up_ms_per_token must hold costs in 0..{MAX_STEP_COST:g} ms, got {list(c)}")
        for name in ("engine", "machine"):
            if not isinstance(getattr(self, name), str):
                raise CostModelError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")

    def at(self, batch_size: int) -> CostModel:
        """One request's step costs in a batch of ``batch_size``.

        The largest measured batch size not above it (vLLM's Dynamic SD carries its table forward the same way);
        below the smallest measured size, the smallest.
        """
        return self.costs[self._index(batch_size)]

    def catch_up_at(self, batch_size: int) -> float:
        """What a drafting request pays per context token its draft catches up on, in a batch of ``batch_size``
        (looked up as :meth:`at`; 0 where the file measured none)."""
        return float(self.catch_up_ms_per_token[self._index(batch_size)]) if self.catch_up_ms_per_token else 0.0

    def _index(self, batch_size: int) -> int:
        return max(bisect_right(self.batch_sizes, int(batch_size)) - 1, 0)

    # -- fitting -------------------------------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        steps: Mapping[str, Any],
        *,
        device: str = "unspecified",
        machine: str = "",
        engine: str = "vllm",
        min_steps: int = 8,
    ) -> BatchCosts:
        """Fit from measured engine steps.

        Parameters
        ----------
        steps : mapping of str to array
            One value per step in each of :data:`STEP_COLUMNS`: ``batch`` (requests in the step), ``draft_ms``
            (time drafting for all of them), ``verify_ms`` (the rest of the step: the target's pass over every
            request's draft, sampling, the engine's own work), ``draft_tokens`` (tokens drafted in all) and
            ``drafting`` (requests that drafted at least one); optionally :data:`CATCH_UP_COLUMN` (context tokens the
            drafting requests' drafts read before their first draft token), whose cost is then fitted too.
        min_steps : int, default=8
            Batch sizes with fewer usable steps are left out.

        Raises
        ------
        ValueError
            If a column is missing or malformed, or no batch size has ``min_steps`` steps with at least two
            different draft totals.
        """
        cols = {}
        for name in STEP_COLUMNS:
            if name not in steps:
                raise ValueError(f"steps: missing column {name!r} (expected {', '.join(STEP_COLUMNS)})")
            cols[name] = np.asarray(steps[name], dtype=np.float64).reshape(-1)
        fits_catch_up = CATCH_UP_COLUMN in steps
        if fits_catch_up:
            cols[CATCH_UP_COLUMN] = np.asarray(steps[CATCH_UP_COLUMN], dtype=np.float64).reshape(-1)
        n = {len(v) for v in cols.values()}
        if len(n) != 1:
            raise ValueError(f"steps: columns of different lengths {sorted(n)}")
        finite = np.all([np.isfinite(v) for v in cols.values()], axis=0)
        ok = finite & (cols["batch"] >= 1) & (cols["verify_ms"] > 0) & (cols["draft_ms"] >= 0)
        sizes, models, counts, catch_up = [], [], [], []
        for b in sorted({int(x) for x in cols["batch"][ok]}):
            m = ok & (cols["batch"] == b)
            v, tok = cols["verify_ms"][m], cols["draft_tokens"][m]
            d, drafting = cols["draft_ms"][m], cols["drafting"][m]
            fed = cols[CATCH_UP_COLUMN][m] if fits_catch_up else np.zeros_like(d)
            # a step whose drafts caught up on a long context (a new request's prompt) is slow for a known reason
            typical = OUTLIER_FACTOR * max(np.median(d), 1e-3)
            keep = (v <= OUTLIER_FACTOR * np.median(v)) & (
                (d <= typical) | (fed > OUTLIER_FACTOR * max(np.median(fed), 1.0))
            )
            v, tok, d, drafting, fed = v[keep], tok[keep], d[keep], drafting[keep], fed[keep]
            if len(v) < min_steps or len(np.unique(tok)) < 2:
                continue
            slope, base = np.polyfit(tok, v, 1)
            slope = max(float(slope), 0.0)
            base = float(np.mean(v - slope * tok))
            if base <= 0:
                slope, base = 0.0, float(np.mean(v))
            per_call, per_token, per_fed, fixed = _draft_fit(d, drafting, tok, fed)
            share = CostModel(
                draft_ms_per_token=(per_token,) * 3,
                verify_base_ms=((base + fixed) / b,) * 3,
                verify_ms_per_token=(slope,) * 3,
                draft_base_ms=(per_call,) * 3,
                device=device,
                unit="ms",
                n_rows={0: len(v)},
                machine=machine,
            )
            sizes.append(b)
            models.append(share)
            counts.append(len(v))
            catch_up.append(per_fed)
        if not sizes:
            raise ValueError(
                f"no batch size has {min_steps} timed steps with at least two different draft totals: "
                "time more steps, drafting varied lengths"
            )
        return cls(
            tuple(sizes),
            tuple(models),
            engine=engine,
            machine=machine,
            n_steps=tuple(counts),
            catch_up_ms_per_token=tuple(catch_up) if fits_catch_up else (),
        )

    # -- files -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what :meth:`save` writes)."""
        return {
            "format": FORMAT,
            "engine": self.engine,
            "machine": self.machine,
            "batch_sizes": list(self.batch_sizes),
            "n_steps": list(self.n_steps),
            "costs": [c.to_dict() for c in self.costs],
            "catch_up_ms_per_token": list(self.catch_up_ms_per_token),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON to ``path``, atomically."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "batch costs") -> BatchCosts:
        """Inverse of :meth:`to_dict`; :class:`CostModelError` naming ``where`` and the entry when invalid."""
        if d.get("format") != FORMAT:
            raise CostModelError(f"{where}: not a batch cost file (format {d.get('format')!r}, expected {FORMAT!r})")
        known = {"format", "engine", "machine", "batch_sizes", "n_steps", "costs", "catch_up_ms_per_token"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CostModelError(f"{where}: unknown fields {', '.join(unknown)}")
        sizes, costs = d.get("batch_sizes"), d.get("costs")
        if not isinstance(sizes, list) or not isinstance(costs, list):
            raise CostModelError(f"{where}: batch_sizes and costs must be lists")
        models = []
        for i, c in enumerate(costs):
            if not isinstance(c, dict):
                raise CostModelError(f"{where}: costs[{i}] must be a cost model (an object), got {type(c).__name__}")
            try:
                models.append(CostModel.load(c))
            except (CostModelError, TypeError) as exc:
                raise CostModelError(f"{where}: costs[{i}]: {exc}") from None
        steps, catch_up = d.get("n_steps", []), d.get("catch_up_ms_per_token", [])  # files before it: none
        if not isinstance(catch_up, list):
            raise CostModelError(f"{where}: catch_up_ms_per_token must be a list, got {type(catch_up).__name__}")
        try:
            return cls(
                tuple(sizes),
                tuple(models),
                engine=d.get("engine", "vllm"),
                machine=d.get("machine", ""),
                n_steps=tuple(steps) if isinstance(steps, list) else (),
                catch_up_ms_per_token=tuple(catch_up),
            )
        except CostModelError as exc:
            raise CostModelError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, source: BatchCosts | Mapping[str, Any] | str | os.PathLike[str]) -> BatchCosts:
        """From a :class:`BatchCosts`, its dict, or a file written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            If the file does not exist.
        CostModelError
            Naming the file and the entry, when it is not a regular file, not JSON, or not valid batch costs.
        """
        if isinstance(source, BatchCosts):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        where = os.fspath(source)
        d = _read_json(where)
        if not isinstance(d, dict):
            raise CostModelError(f"{where}: expected a JSON object, got {type(d).__name__}")
        return cls.from_dict(d, where)

    def describe(self) -> list[str]:
        """One line per batch size (for printing)."""
        lines = []
        for b, c, n in zip(self.batch_sizes, self.costs, self.n_steps or (0,) * len(self.batch_sizes)):
            catch_up = (
                f" + {self.catch_up_at(b):.3f} ms per token it catches up on" if self.catch_up_ms_per_token else ""
            )
            lines.append(
                f"batch {b:3d}: per request {c.verify_base_ms[0]:.1f} ms + "
                f"{c.draft_ms_per_token[0] + c.verify_ms_per_token[0]:.1f} ms per draft token "
                f"(draft {c.draft_ms_per_token[0]:.1f} + verify {c.verify_ms_per_token[0]:.1f}) + "
                f"{c.draft_base_ms[0]:.1f} ms per drafting request{catch_up}; {n} steps"
            )
        return lines


def _draft_fit(
    draft_ms: np.ndarray, drafting: np.ndarray, tokens: np.ndarray, fed: np.ndarray
) -> tuple[float, float, float, float]:
    """Non-negative least squares ``draft_ms = per_call * drafting + per_token * tokens + per_fed * fed + fixed``.

    Every subset of the four unknowns is fitted and the best fit with no negative coefficient kept.
    """
    a = np.column_stack([drafting, tokens, fed, np.ones_like(tokens)])
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 16):
        use = [j for j in range(4) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(a[:, use], draft_ms, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(4)
        full[use] = coef
        err = float(np.sum((a @ full - draft_ms) ** 2))
        if best is None or err < best[0]:
            best = (err, full)
    if best is None:  # no non-negative fit (cannot happen with a non-negative target; kept for safety)
        return 0.0, float(draft_ms.sum() / max(tokens.sum(), 1.0)), 0.0, 0.0
    per_call, per_token, per_fed, fixed = (min(float(x), MAX_STEP_COST) for x in best[1])
    return per_call, per_token, per_fed, fixed


def _read_json(where: str) -> Any:
    try:
        readable_file(where, "cost file")
    except NotAFileError as exc:
        raise CostModelError(str(exc)) from None
    try:
        with open(where, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CostModelError(f"{where}: not a JSON cost file ({exc})") from None


def is_batch_costs_file(source: Any) -> bool:
    """Whether ``source`` (a path, a dict, or costs) holds batch costs rather than one :class:`CostModel`.

    A path that cannot be read as a JSON object is not (the single-cost loader then names the problem).
    """
    if isinstance(source, BatchCosts):
        return True
    if isinstance(source, Mapping):
        return source.get("format") == FORMAT
    if isinstance(source, (str, os.PathLike)):
        try:
            d = _read_json(os.fspath(source))
        except (CostModelError, FileNotFoundError):
            return False
        return isinstance(d, dict) and d.get("format") == FORMAT
    return False
