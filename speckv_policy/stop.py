"""A cost-aware stop rule: after every draft token, keep drafting only while the next token is worth its price.

Gamma policies choose a draft length once per step. A stop rule decides token
by token, the way AdaEDL and DISCO do, but prices the decision: after draft
token ``i`` it knows, from a logistic model fitted on the step log, the chance
``p_i`` that token ``i`` is accepted given that the ones before it are
(:class:`AcceptanceCurve`, read from the draft's confidence and entropy at that
token and the context's self-repetition at the step's start), so the chance
that the first ``i`` are all accepted, ``S_i = p_1 ... p_i``. Sending the first
``g`` drafted tokens yields ``1 + S_1 + ... + S_g`` tokens in expectation for
``verify(g)`` milliseconds; with a kept token worth ``V`` milliseconds (the time
a plain target step takes, times :attr:`StopRule.token_value`) the step is worth

    ``V * (S_1 + ... + S_g) - verify(g)``

(the drafting already done is spent either way). The rule sends the best
prefix drafted so far, and drafts one more token while some longer draft is
worth more, extrapolating each later token's chance by a second curve fitted on
the next token's acceptance given this token's signals. So a confident draft
runs long where verification is cheap per token, and a first token that is
unlikely to be kept is dropped: the step becomes a plain target step, having
paid one draft token (the probe). ``V`` values a token at what the target alone
would pay for it, which makes the rule maximise tokens per second when
speculation gains little (a Dinkelbach step from the target alone's rate).

Optionally a pre-draft gate (:attr:`StopRule.gates`, :meth:`StopRule.opens`)
decides before the probe whether to draft at all, from the run's acceptance
history and the context's self-repetition: a logistic model of whether the
rule's step beats a plain one, fitted on the log's steps weighted by what each
gains or loses under the rule's prices (``training.fit_stop_gates``).

The rule is data (coefficients and a :class:`~speckv_policy.objective.CostModel`
in JSON, no code) and runs in plain Python: a few multiply-adds per draft
token. ``speckv_policy.training.fit_stop_rule`` fits it; ``attach(..., mode="stop")``
runs it inside Hugging Face generation.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .atomic import NotAFileError, readable_file
from .objective import CostModel
from .schema import COMPRESSION_CODES, PRE

__all__ = [
    "GATE_FEATURES",
    "STOP_FEATURES",
    "STOP_RULE_FORMAT",
    "STOP_RULE_VERSION",
    "AcceptanceCurve",
    "StopRule",
    "StopRuleError",
    "StopState",
    "gate_features",
    "stop_features",
]

STOP_RULE_FORMAT = "speckv-stop-rule"
STOP_RULE_VERSION = 2  # 2 added the optional pre-draft gates
#: The inputs of every :class:`AcceptanceCurve`, in order: the draft token's top-1 probability and entropy (nats)
#: under the processed distribution, ``log(1 - confidence)`` (floored at 1e-6), and ``log(1 + m)`` for ``m`` the
#: longest suffix of the context that occurred earlier in it at the step's start (``features.ContextMatcher``).
STOP_FEATURES = ("draft_confidence", "draft_entropy", "log_one_minus_confidence", "log1p_context_match_len")
#: The inputs of a pre-draft gate, in order, all known before any draft token exists (``features.OnlineFeatureState``
#: and ``features.ContextMatcher``, the ``pre`` feature set's values): the previous drafting step's per-token acceptance,
#: the decayed acceptance rate, its accepted tokens, its draft length, whether it was accepted whole, ``log(1 + context
#: length)`` and ``log(1 + m)`` for ``m`` the context's self-repeating suffix.
GATE_FEATURES = tuple(n for n in PRE.names if n not in ("compression_code", "temperature", "context_match_len")) + (
    "log1p_context_match_len",
)
DECODINGS = ("greedy", "sampling")
_PRE_AT = [PRE.names.index(n) for n in GATE_FEATURES[:-1]]  # where the gate's inputs sit in a 'pre' row
_PRE_MATCH = PRE.names.index("context_match_len")


class StopRuleError(ValueError):
    """A stop-rule file or object that cannot be used (the message names the file and the key)."""


def stop_features(confidence: float, entropy: float, context_match_len: float) -> list[float]:
    """The :data:`STOP_FEATURES` of one draft token, as the rule and its fit compute them."""
    return [
        float(confidence),
        float(entropy),
        math.log(max(1e-6, 1.0 - float(confidence))),
        math.log1p(max(0.0, float(context_match_len))),
    ]


def gate_features(pre: Sequence[float]) -> list[float]:
    """The :data:`GATE_FEATURES` of a step, from its ``pre`` row (``OnlineFeatureState.pre_values``)."""
    return [float(pre[i]) for i in _PRE_AT] + [math.log1p(max(0.0, float(pre[_PRE_MATCH])))]


@dataclass(frozen=True)
class AcceptanceCurve:
    """A logistic model: ``1 / (1 + exp(-(intercept + coef . x)))``.

    An acceptance curve reads ``x`` = :func:`stop_features` of a draft token and
    gives its chance of acceptance; a gate reads :func:`gate_features` of a step
    and gives the chance that drafting pays (``features`` says which). ``rows``
    is how many rows it was fitted on.
    """

    intercept: float
    coef: tuple[float, ...]
    rows: int = 0
    features: tuple[str, ...] = STOP_FEATURES

    def __post_init__(self) -> None:
        if len(self.coef) != len(self.features):
            raise ValueError(f"coef needs {len(self.features)} values ({', '.join(self.features)}), got {self.coef!r}")
        if not all(math.isfinite(v) for v in (self.intercept, *self.coef)):
            raise ValueError(f"intercept and coef must be finite, got {self.intercept!r}, {self.coef!r}")

    def __call__(self, x: Sequence[float]) -> float:
        z = self.intercept + sum(c * v for c, v in zip(self.coef, x))
        if z < -50.0:
            return 0.0
        return 1.0 / (1.0 + math.exp(-z)) if z < 50.0 else 1.0


class StopState:
    """One step's stop decisions (see :meth:`StopRule.begin`).

    Attributes
    ----------
    kept : int
        How many of the tokens drafted so far to send for verification (0: a
        plain target step).
    drafted : int
        Draft tokens seen so far.
    """

    __slots__ = ("_cap", "_cum", "_d", "_match", "_next", "_now", "_s", "_v", "_verify", "best", "drafted", "kept")

    def __init__(
        self,
        now: AcceptanceCurve,
        nxt: AcceptanceCurve,
        verify: Sequence[float],
        draft_per_token: float,
        value: float,
        cap: int,
        context_match_len: float,
    ) -> None:
        self._now, self._next, self._verify = now, nxt, verify
        self._d, self._v, self._cap = draft_per_token, value, cap
        self._match = math.log1p(max(0.0, float(context_match_len)))
        self._s = 1.0  # P(every token so far accepted)
        self._cum = 0.0  # sum of those over the tokens so far
        self.best = -verify[0]  # the value of sending nothing (a plain step)
        self.kept = 0
        self.drafted = 0

    def after_token(self, confidence: float, entropy: float) -> bool:
        """Take draft token ``drafted + 1``'s signals; return True to draft another one.

        Updates :attr:`kept`. Never asks for more than the step's cap.
        """
        conf = float(confidence)
        x = [conf, float(entropy), math.log(max(1e-6, 1.0 - conf)), self._match]
        self.drafted += 1
        i = self.drafted
        self._s *= self._now(x)
        self._cum += self._s
        v = self._v * self._cum - self._verify[i]
        if v > self.best:
            self.best, self.kept = v, i
        if i >= self._cap:
            return False
        pn = self._next(x)  # each later token's chance, extrapolated from this token's signals
        s, cum = self._s, self._cum
        for j in range(i + 1, self._cap + 1):
            s *= pn
            cum += s
            if self._v * cum - self._verify[j] - self._d * (j - i) > self.best:
                return True
        return False


@dataclass(frozen=True)
class StopRule:
    """A cost-aware per-token stop rule (see the module docstring).

    Parameters
    ----------
    curves : mapping
        ``(compression, decoding) -> (now, next)`` acceptance curves; decoding is
        ``'greedy'`` or ``'sampling'``. ``now`` is the token's own chance given the
        tokens before it are accepted; ``next`` the following token's, from this
        token's signals.
    cost_model : CostModel
        Prices drafting (per token) and verification (per gamma).
    token_value : float, default=1.0
        What a kept token is worth, in plain target steps of this cost model.
    max_gamma : int, default=8
        The longest draft.
    trained_on : mapping, default={}
        Provenance (log, split, rows), carried as written.
    gates : mapping, default={}
        ``(compression, decoding) -> gate``: a logistic model over
        :data:`GATE_FEATURES` of the chance that drafting at all pays (the step
        the rule would make is worth more than a plain target step, drafting
        included). Where it says no (< 0.5) the step drafts nothing, so it does
        not pay the probe token. Fitted under ``cost_model``'s prices
        (:func:`~speckv_policy.training.fit_stop_rule`); :meth:`reprice` keeps it.
        A compression and decoding without one always drafts.
    """

    curves: Mapping[tuple[str, str], tuple[AcceptanceCurve, AcceptanceCurve]]
    cost_model: CostModel
    token_value: float = 1.0
    max_gamma: int = 8
    trained_on: Mapping[str, Any] = field(default_factory=dict)
    gates: Mapping[tuple[str, str], AcceptanceCurve] = field(default_factory=dict)
    #: per compression code: verify ms for gamma 0..max_gamma and draft ms per token (priced once, not per step)
    _prices: dict[int, tuple[list[float], float]] = field(init=False, repr=False, compare=False)
    #: per (compression code, decoding): the gate, if any
    _gate_by: dict[tuple[int, str], AcceptanceCurve] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.curves:
            raise ValueError("a stop rule needs at least one (compression, decoding) curve pair")
        for what, keys in (("curve", self.curves), ("gate", self.gates)):
            for comp, dec in keys:
                if comp not in COMPRESSION_CODES or dec not in DECODINGS:
                    raise ValueError(
                        f"{what} key {comp}/{dec}: expected a compression of {', '.join(COMPRESSION_CODES)} "
                        f"and a decoding of {', '.join(DECODINGS)}"
                    )
        for key, pair in self.curves.items():
            if any(c.features != STOP_FEATURES for c in pair):
                raise ValueError(f"curves {key[0]}/{key[1]}: acceptance curves read {list(STOP_FEATURES)}")
        for key, gate in self.gates.items():
            if gate.features != GATE_FEATURES:
                raise ValueError(
                    f"gate {key[0]}/{key[1]}: a gate reads {list(GATE_FEATURES)}, not {list(gate.features)}"
                )
        gate_by = {(COMPRESSION_CODES[c], d): g for (c, d), g in sorted(self.gates.items(), reverse=True)}
        object.__setattr__(self, "_gate_by", gate_by)
        if not (math.isfinite(self.token_value) and self.token_value > 0):
            raise ValueError(f"token_value must be finite and > 0, got {self.token_value!r}")
        if isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int) or not 1 <= self.max_gamma <= 64:
            raise ValueError(f"max_gamma must be an int in 1..64, got {self.max_gamma!r}")
        prices = {
            code: (
                [float(v) for v in self.cost_model.verify_ms(list(range(self.max_gamma + 1)), code)],
                float(self.cost_model.draft_ms_per_token[code]),
            )
            for code in set(COMPRESSION_CODES.values())
        }
        object.__setattr__(self, "_prices", prices)

    def curves_for(self, compression: str, temperature: float) -> tuple[AcceptanceCurve, AcceptanceCurve]:
        """The curves for a compression and decoding (temperature 0: greedy).

        Compressions of the same code share curves (fp16 and bf16 use fp32's), as
        every policy's compression feature does.

        Raises
        ------
        KeyError
            If the rule has no curves for that compression code and decoding.
        """
        code = COMPRESSION_CODES.get(compression)
        if code is None:
            raise KeyError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSION_CODES)}")
        decoding = "greedy" if temperature == 0 else "sampling"
        for (comp, dec), pair in sorted(self.curves.items()):
            if COMPRESSION_CODES[comp] == code and dec == decoding:
                return pair
        have = ", ".join(f"{c}/{d}" for c, d in sorted(self.curves))
        raise KeyError(f"the stop rule has no curves for {compression}/{decoding} (it has {have})")

    def opens(self, compression: str, temperature: float, pre: Sequence[float]) -> bool:
        """Whether to draft at all this step (True where the rule has no gate for this compression and decoding).

        ``pre`` is the step's ``pre`` row (``OnlineFeatureState.pre_values``), read before any draft token.

        Raises
        ------
        KeyError
            If the compression is unknown.
        """
        code = COMPRESSION_CODES.get(compression)
        if code is None:
            raise KeyError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSION_CODES)}")
        gate = self._gate_by.get((code, "greedy" if temperature == 0 else "sampling"))
        return gate is None or gate(gate_features(pre)) >= 0.5

    def begin(
        self,
        compression: str,
        temperature: float,
        cap: int,
        context_match_len: float,
        prices: tuple[Sequence[float], float] | None = None,
    ) -> StopState:
        """A step's state: ``cap`` tokens at most (the hook's budget), the context's self-repetition at its start.

        ``prices`` = (verification ms for gamma ``0..max_gamma``, draft ms per token) replaces the rule's own cost
        model for this step (live costs, :meth:`speckv_policy.hf.live_costs.LiveCosts.stop_prices`).

        Raises
        ------
        KeyError
            See :meth:`curves_for`.
        ValueError
            If ``prices`` has fewer than ``max_gamma + 1`` verification times or a value that is not a finite
            number >= 0.
        """
        now, nxt = self.curves_for(compression, temperature)
        if prices is None:
            verify, per_token = self._prices[COMPRESSION_CODES[compression]]
        else:
            verify, per_token = prices
            if len(verify) < self.max_gamma + 1 or not all(
                math.isfinite(v) and v >= 0 for v in (*verify[: self.max_gamma + 1], per_token)
            ):
                raise ValueError(
                    f"prices need {self.max_gamma + 1} finite verification times >= 0 and a finite draft price "
                    f">= 0, got {list(verify)!r}, {per_token!r}"
                )
        cap = max(0, min(int(cap), self.max_gamma))
        return StopState(now, nxt, verify, per_token, verify[0] * self.token_value, cap, context_match_len)

    def reprice(self, cost: CostModel | str | os.PathLike[str] | dict[str, Any]) -> StopRule:
        """The same curves priced by another cost model (e.g. ``speckv-calibrate``'s JSON for this machine)."""
        return replace(self, cost_model=CostModel.load(cost))

    # -- serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what :meth:`save` writes)."""
        return {
            "format": STOP_RULE_FORMAT,
            "version": STOP_RULE_VERSION,
            "features": list(STOP_FEATURES),
            "curves": {
                f"{c}/{d}": {
                    name: {"intercept": cur.intercept, "coef": list(cur.coef), "rows": cur.rows}
                    for name, cur in zip(("now", "next"), pair)
                }
                for (c, d), pair in sorted(self.curves.items())
            },
            "cost_model": self.cost_model.to_dict(),
            "token_value": self.token_value,
            "max_gamma": self.max_gamma,
            "trained_on": dict(self.trained_on),
            "gate_features": list(GATE_FEATURES),
            "gates": {
                f"{c}/{d}": {"intercept": g.intercept, "coef": list(g.coef), "rows": g.rows}
                for (c, d), g in sorted(self.gates.items())
            },
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the rule as JSON, atomically (a failed write leaves the old file)."""
        from .atomic import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, d: Any, where: str = "stop rule") -> StopRule:
        """Inverse of :meth:`to_dict`; errors name ``where`` and the key at fault.

        Raises
        ------
        StopRuleError
        """
        if not isinstance(d, dict):
            raise StopRuleError(f"{where}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != STOP_RULE_FORMAT:
            raise StopRuleError(f"{where}: 'format' is {d.get('format')!r}, expected {STOP_RULE_FORMAT!r}")
        version = d.get("version")
        if not isinstance(version, int) or version > STOP_RULE_VERSION or version < 1:
            raise StopRuleError(
                f"{where}: 'version' is {version!r}; this speckv-policy reads stop rules up to {STOP_RULE_VERSION}"
            )
        if d.get("features") != list(STOP_FEATURES):
            raise StopRuleError(
                f"{where}: 'features' is {d.get('features')!r}, expected {list(STOP_FEATURES)} (in that order)"
            )
        for key in ("curves", "cost_model"):
            if not isinstance(d.get(key), dict):
                raise StopRuleError(f"{where}: '{key}' must be a JSON object")
        curves = {}
        for key, pair in d["curves"].items():
            try:
                comp, dec = key.split("/")
                if not isinstance(pair, dict) or set(pair) != {"now", "next"}:
                    raise ValueError("expected an object with 'now' and 'next'")
                now, nxt = (_curve(pair[name], name, STOP_FEATURES) for name in ("now", "next"))
                curves[(comp, dec)] = (now, nxt)
            except (ValueError, TypeError) as exc:
                raise StopRuleError(f"{where}: curves[{key!r}]: {exc}") from None
        gates = {}
        if version >= 2:
            if d.get("gate_features") != list(GATE_FEATURES):
                raise StopRuleError(
                    f"{where}: 'gate_features' is {d.get('gate_features')!r}, expected {list(GATE_FEATURES)} "
                    "(in that order)"
                )
            if not isinstance(d.get("gates"), dict):
                raise StopRuleError(f"{where}: 'gates' must be a JSON object")
            for key, gate in d["gates"].items():
                try:
                    comp, dec = key.split("/")
                    gates[(comp, dec)] = _curve(gate, "gate", GATE_FEATURES)
                except (ValueError, TypeError) as exc:
                    raise StopRuleError(f"{where}: gates[{key!r}]: {exc}") from None
        try:
            cost = CostModel.load(d["cost_model"])
        except ValueError as exc:
            raise StopRuleError(f"{where}: 'cost_model': {exc}") from None
        try:
            return cls(
                curves,
                cost,
                token_value=float(d.get("token_value", 1.0)),
                max_gamma=d.get("max_gamma", 8),
                trained_on=dict(d.get("trained_on") or {}),
                gates=gates,
            )
        except (ValueError, TypeError) as exc:
            raise StopRuleError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, source: StopRule | str | os.PathLike[str] | dict[str, Any]) -> StopRule:
        """A rule from a :class:`StopRule`, its :meth:`to_dict`, or a JSON file written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            If the file does not exist.
        StopRuleError
            Naming the file and the key, when it is not a readable stop rule.
        """
        if isinstance(source, StopRule):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source)
        where = os.fspath(source)
        try:
            readable_file(where, "stop rule file")
        except NotAFileError as exc:
            raise StopRuleError(str(exc)) from None
        try:
            with open(where, encoding="utf-8") as fh:
                d = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StopRuleError(f"{where}: not a JSON stop rule ({exc})") from None
        return cls.from_dict(d, where)


def _curve(c: Any, name: str, features: tuple[str, ...]) -> AcceptanceCurve:
    """One curve of a rule's JSON (``{'intercept', 'coef', 'rows'}``); ValueError names what is wrong."""
    if not isinstance(c, dict) or not isinstance(c.get("coef"), list):
        raise ValueError(f"'{name}' needs 'intercept' and a 'coef' list")
    vals = [c.get("intercept"), *c["coef"]]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        raise ValueError(f"'{name}' holds a value that is not a number")
    rows = c.get("rows", 0)
    if isinstance(rows, bool) or not isinstance(rows, int):
        raise ValueError(f"'{name}': 'rows' must be an integer, got {rows!r}")
    return AcceptanceCurve(float(c["intercept"]), tuple(float(v) for v in c["coef"]), rows, features)
