"""One class per decision mode: when and from what a step's draft length is decided.

A speculation step decides its draft length at one of four moments: before
drafting (``fixed``, ``pre``, and the gates of ``gated`` and of a gated stop
rule), after the draft's first token (``upfront``, ``gated``), after every draft
token (``per-token``, ``stop``) or once the draft is complete (``truncate``).
Each mode is a :class:`DecisionMode` driven the same way by every caller:

1. :meth:`DecisionMode.plan` before drafting returns the step's draft budget
   (0: a plain target step, nothing drafted);
2. the caller drafts up to that many tokens; where :attr:`DecisionMode.asks_per_token`
   it calls :meth:`DecisionMode.after_token` after each one (which returns True
   to stop), passing the token's confidence and entropy where
   :meth:`DecisionMode.reads_token` says the mode reads them;
3. :meth:`DecisionMode.finish` returns how many drafted tokens to verify;
4. :meth:`DecisionMode.end_step` hears the outcome.

The Hugging Face hook (:mod:`speckv_policy.hf`) drives these classes inside
``generate()``; the dense replay (:func:`speckv_policy.evaluation.dense.simulate`)
drives the same classes along a recorded text, so replay and generation cannot
decide differently. A mode asks a *decider* (a policy adapter) for its choices:
the hook's adapters count failures and fall back to a safe gamma; the replay's
:class:`PlainDecider` and :class:`PlainStopDecider` let errors propagate.

Standard library, numpy and this package's feature code only: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from .features import OnlineFeatureState, gated_features, gated_values, paper_features
from .stop import StopRule, StopState

__all__ = [
    "DECLARED_MODE",
    "DEFAULT_MAX_GAMMA",
    "MODES",
    "DecisionMode",
    "Decider",
    "FixedMode",
    "GatedMode",
    "PerTokenMode",
    "PlainDecider",
    "PlainSchedule",
    "PlainStopDecider",
    "PreMode",
    "StopDecider",
    "StopMode",
    "TruncateMode",
    "UpfrontMode",
    "make_mode",
]

#: The decision modes, as ``attach(..., mode=...)`` names them.
MODES = ("upfront", "per-token", "truncate", "fixed", "pre", "gated", "stop")
#: The mode a policy runs in by default, by the feature set it reads.
DECLARED_MODE = {"online": "upfront", "paper": "truncate", "pre": "pre", "gated": "gated"}
#: The draft cap of a policy that names no candidates.
DEFAULT_MAX_GAMMA = 8
#: The largest gamma a fixed schedule may ask for.
FIXED_GAMMA_LIMIT = 64

#: A draft token's ``(confidence, entropy)``, or None where the mode does not read it.
Token = tuple[float, float] | None


class Decider(Protocol):
    """What a length-deciding mode asks: a policy adapter."""

    #: Largest gamma the policy may choose.
    max_gamma: int
    #: Whether the policy reads feature rows as lists of floats (else float32 arrays).
    lists: bool

    def __call__(self, features: Any) -> tuple[int, bool]:
        """``(gamma, fell_back)`` for one feature row; never raises in the hook."""
        ...  # pragma: no cover

    def gate(self, features: Any) -> tuple[bool, bool]:
        """``(open, fell_back)`` from a gated policy's gate."""
        ...  # pragma: no cover


class StopDecider(Protocol):
    """What ``stop`` mode asks: a stop rule adapter."""

    max_gamma: int
    fallback_gamma: int
    #: Whether the rule has a pre-draft gate to ask (:meth:`opens`).
    gates: bool

    def opens(self, compression: str, temperature: float, pre: Sequence[float]) -> bool:
        """Whether the step drafts at all."""
        ...  # pragma: no cover

    def begin(self, compression: str, temperature: float, cap: int, match_len: float) -> StopState:
        """The step's stop state."""
        ...  # pragma: no cover

    def fail(self, why: str) -> int:
        """Count (or raise) a failure; returns the fallback gamma."""
        ...  # pragma: no cover


class PlainDecider:
    """A plain callable as a :class:`Decider` (the replay's): its errors propagate, its choices are clipped.

    Parameters
    ----------
    decide : callable
        ``decide(features) -> gamma``.
    gate : callable or None
        ``gate(features) -> bool`` of a gated policy.
    max_gamma : int
        Cap on the choices.
    lists : bool, default=True
        Pass feature rows as lists of floats (else float32 arrays).
    """

    def __init__(
        self,
        decide: Callable[[Any], Any],
        gate: Callable[[Any], Any] | None = None,
        *,
        max_gamma: int = DEFAULT_MAX_GAMMA,
        lists: bool = True,
    ) -> None:
        self.decide = decide
        self.gate_fn = gate
        self.max_gamma = int(max_gamma)
        self.lists = lists

    def __call__(self, features: Any) -> tuple[int, bool]:
        return max(0, min(int(self.decide(features)), self.max_gamma)), False

    def gate(self, features: Any) -> tuple[bool, bool]:
        if self.gate_fn is None:
            raise ValueError("this policy has no gate")
        return bool(self.gate_fn(features)), False


def checked_gamma(g: Any, limit: int = FIXED_GAMMA_LIMIT) -> int:
    """``g`` as an int in ``0..limit``.

    Raises
    ------
    ValueError
        For anything else (a bool, a float, None, a negative or too large number), naming the value.
    """
    if isinstance(g, bool) or not hasattr(g, "__index__") or not 0 <= int(g) <= limit:
        raise ValueError(f"gamma_fn returned {g!r}; expected an int in 0..{limit}")
    return int(g)


class PlainSchedule:
    """A schedule ``gamma_fn(step) -> int`` for ``fixed`` mode (the replay's): a bad gamma raises."""

    def __init__(self, schedule: Callable[[int], Any]) -> None:
        self.schedule = schedule

    def decide_step(self, step: int) -> tuple[int, bool]:
        """``(gamma, fell_back)`` for ``step``."""
        return checked_gamma(self.schedule(step)), False


class PlainStopDecider:
    """A :class:`~speckv_policy.stop.StopRule` as a :class:`StopDecider` (the replay's): errors propagate."""

    fallback_gamma = 0

    def __init__(self, rule: StopRule, max_gamma: int | None = None) -> None:
        self.rule = rule
        self.max_gamma = rule.max_gamma if max_gamma is None else int(max_gamma)
        self.gates = bool(rule.gates)

    def opens(self, compression: str, temperature: float, pre: Sequence[float]) -> bool:
        return self.rule.opens(compression, temperature, pre)

    def begin(self, compression: str, temperature: float, cap: int, match_len: float) -> StopState:
        return self.rule.begin(compression, temperature, cap, match_len)

    def fail(self, why: str) -> int:
        raise RuntimeError(why)


class _Backoff:
    """Probe back-off: after a probe that ends in gamma 0, skip the probe on the next ``b`` steps (b doubling)."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.skip = 0  # plain steps left before the next probe
        self.length = 0  # current back-off length

    def reset(self) -> None:
        self.skip = self.length = 0

    def take_skip(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def after(self, gamma: int) -> None:
        if gamma == 0:
            self.length = min(max(1, 2 * self.length), self.limit)
            self.skip = self.length
        else:
            self.length = 0


class DecisionMode:
    """A decision mode's per-step protocol (see the module docstring).

    Parameters
    ----------
    decider : Decider, StopDecider or callable
        What the mode asks (``fixed``: a schedule ``gamma_fn(step) -> int``).
    compression : str
        Compression name the features carry.
    max_gamma : int
        Cap on draft tokens per step.

    Attributes
    ----------
    kept : int
        Draft tokens to send so far this step.
    fell_back : bool
        Whether a decision of this step fell back.
    skipped : bool
        Whether probe back-off made this step a plain one.
    state : OnlineFeatureState or None
        The generation's feature state (:meth:`start`).
    """

    name: ClassVar[str] = ""
    #: Whether :meth:`after_token` must be called after every draft token.
    asks_per_token: ClassVar[bool] = False
    #: Whether :meth:`plan` reads the pre-draft signals (the context's self-repetition).
    reads_pre: ClassVar[bool] = False

    def __init__(self, decider: Any, compression: str, max_gamma: int) -> None:
        if int(max_gamma) < 1:
            raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
        self.decider = decider
        self.compression = compression
        self.max_gamma = int(max_gamma)
        self.state: OnlineFeatureState | None = None
        self.kept = 0
        self.fell_back = False
        self.skipped = False

    def start(self, state: OnlineFeatureState) -> None:
        """A new generation begins, with this feature state."""
        self.state = state

    def _begin_step(self) -> None:
        self.kept = 0
        self.fell_back = False
        self.skipped = False

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        """The step's draft budget before any draft token (0: a plain target step).

        ``step`` counts the generation's steps from 0, ``context_len`` is the
        tokens so far, ``match_len`` the context's self-repetition
        (:class:`~speckv_policy.features.ContextMatcher`; 0 where not computed),
        ``budget`` the most tokens the generation can still take in a draft.
        """
        self._begin_step()
        return max(0, min(self.max_gamma, budget))

    def reads_token(self, k: int) -> bool:
        """Whether :meth:`after_token` (or :meth:`finish`) reads draft token ``k``'s (1-based) statistics."""
        return False

    def after_token(self, k: int, token: Token, context_len: int) -> bool:
        """After draft token ``k`` (1-based) at position ``context_len``: True to stop drafting."""
        return False

    def finish(self, drafted: int, tokens: Callable[[], tuple[Sequence[float], Sequence[float]]]) -> int:
        """How many of the ``drafted`` tokens to verify; ``tokens()`` gives every drafted token's statistics."""
        return min(self.kept, drafted)

    def end_step(self, gamma: int, accepted: int) -> None:
        """The step verified ``gamma`` tokens and kept ``accepted``."""


class FixedMode(DecisionMode):
    """``fixed``: a schedule chooses before drafting; no features.

    ``decider`` has ``decide_step(step) -> (gamma, fell_back)`` (the hook's falls back on a bad gamma, the replay's
    :class:`PlainSchedule` raises); a plain callable ``gamma_fn(step)`` is taken as a :class:`PlainSchedule`.
    """

    name = "fixed"

    def __init__(self, decider: Any, compression: str, max_gamma: int) -> None:
        if not hasattr(decider, "decide_step"):
            decider = PlainSchedule(decider)
        super().__init__(decider, compression, max_gamma)

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        self._begin_step()
        g, self.fell_back = self.decider.decide_step(step)
        return max(0, min(g, self.max_gamma, budget))

    def finish(self, drafted: int, tokens: Callable[[], tuple[Sequence[float], Sequence[float]]]) -> int:
        return drafted


class PreMode(DecisionMode):
    """``pre``: the policy chooses from the ``pre`` features (history, context) before drafting; no probe."""

    name = "pre"
    reads_pre = True

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        self._begin_step()
        state = self.state
        assert state is not None
        pre = state.pre_values if self.decider.lists else state.pre_features
        g, self.fell_back = self.decider(pre(context_len, match_len))
        return max(0, min(g, self.max_gamma, budget))

    def finish(self, drafted: int, tokens: Callable[[], tuple[Sequence[float], Sequence[float]]]) -> int:
        return drafted


class _ProbeMode(DecisionMode):
    """Modes that read the first draft token (the probe) before choosing; optional probe back-off."""

    def __init__(self, decider: Any, compression: str, max_gamma: int, probe_backoff: int = 0) -> None:
        super().__init__(decider, compression, max_gamma)
        self.backoff = _Backoff(probe_backoff) if probe_backoff else None

    def start(self, state: OnlineFeatureState) -> None:
        super().start(state)
        if self.backoff is not None:
            self.backoff.reset()

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        cap = super().plan(step, context_len, match_len, budget)
        if self.backoff is not None and cap > 0 and self.backoff.take_skip():
            self.skipped = True
            return 0
        return cap

    def finish(self, drafted: int, tokens: Callable[[], tuple[Sequence[float], Sequence[float]]]) -> int:
        g = min(self.kept, drafted)
        if self.backoff is not None:
            self.backoff.after(g)
        return g


class UpfrontMode(_ProbeMode):
    """``upfront``: draft one token, decide from the ``online`` features of its distribution, draft the rest."""

    name = "upfront"
    asks_per_token = True

    def reads_token(self, k: int) -> bool:
        return k == 1

    def after_token(self, k: int, token: Token, context_len: int) -> bool:
        if k == 1:
            assert token is not None and self.state is not None
            g, self.fell_back = self.decider(self.state.features(token[0], token[1], context_len))
            self.kept = min(g, self.max_gamma)
        return k >= max(self.kept, 1)


class PerTokenMode(_ProbeMode):
    """``per-token``: after each draft token, keep it if a step from there would draft, go on if it would draft 2+."""

    name = "per-token"
    asks_per_token = True

    def reads_token(self, k: int) -> bool:
        return True

    def after_token(self, k: int, token: Token, context_len: int) -> bool:
        assert token is not None and self.state is not None
        g, fell_back = self.decider(self.state.features(token[0], token[1], context_len))
        self.fell_back |= fell_back
        if g >= 1:
            self.kept = k
        return g < 2 or k >= self.max_gamma


class GatedMode(DecisionMode):
    """``gated``: a gate on the ``pre`` features decides whether to draft; the length head reads the probe token."""

    name = "gated"
    asks_per_token = True
    reads_pre = True

    def __init__(self, decider: Any, compression: str, max_gamma: int) -> None:
        super().__init__(decider, compression, max_gamma)
        self.pre_row: Any = None

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        self._begin_step()
        state = self.state
        assert state is not None
        lists = self.decider.lists
        self.pre_row = (state.pre_values if lists else state.pre_features)(context_len, match_len)
        opened, self.fell_back = self.decider.gate((gated_values if lists else gated_features)(self.pre_row, 0.0, 0.0))
        return max(0, min(self.max_gamma, budget)) if opened else 0

    def reads_token(self, k: int) -> bool:
        return k == 1

    def after_token(self, k: int, token: Token, context_len: int) -> bool:
        if k == 1:
            assert token is not None
            row = (gated_values if self.decider.lists else gated_features)(self.pre_row, token[0], token[1])
            g, fell_back = self.decider(row)
            self.fell_back |= fell_back
            self.kept = min(g, self.max_gamma)
        return k >= max(self.kept, 1)


class TruncateMode(DecisionMode):
    """``truncate``: the published design: draft ``max_gamma`` tokens, keep the first gamma the ``paper`` features pick."""

    name = "truncate"

    def reads_token(self, k: int) -> bool:
        return True

    def finish(self, drafted: int, tokens: Callable[[], tuple[Sequence[float], Sequence[float]]]) -> int:
        conf, ent = tokens()
        g, self.fell_back = self.decider(paper_features(conf, ent, self.compression))
        return min(g, drafted)


class StopMode(DecisionMode):
    """``stop``: a cost-aware stop rule sends the best prefix so far and drafts on while a longer draft pays."""

    name = "stop"
    asks_per_token = True
    reads_pre = True

    def __init__(self, decider: StopDecider, compression: str, max_gamma: int) -> None:
        super().__init__(decider, compression, max_gamma)
        self.cap = 0
        self.match_len = 0.0
        self.stop: StopState | None = None

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        self._begin_step()
        state = self.state
        assert state is not None
        cap = max(0, min(self.max_gamma, budget))
        if cap > 0 and self.decider.gates:
            try:
                opened = self.decider.opens(
                    self.compression, state.temperature, state.pre_values(context_len, match_len)
                )
            except Exception as exc:  # a broken gate never breaks generation: draft, the rule decides the rest
                self.decider.fail(f"{type(exc).__name__}: {exc}")
                self.fell_back, opened = True, True
            if not opened:
                cap = 0  # a plain step: nothing drafted
        self.cap, self.match_len, self.stop = cap, match_len, None
        return cap

    def reads_token(self, k: int) -> bool:
        return True

    def after_token(self, k: int, token: Token, context_len: int) -> bool:
        assert token is not None and self.state is not None
        dec = self.decider
        if k == 1:
            try:
                self.stop = dec.begin(self.compression, self.state.temperature, self.cap, self.match_len)
            except Exception as exc:  # an unreadable or broken rule: this step drafts the fallback gamma
                dec.fail(f"{type(exc).__name__}: {exc}")
                self.fell_back, self.stop = True, None
        go = False
        if self.stop is not None:
            try:
                go = self.stop.after_token(token[0], token[1])
                self.kept = self.stop.kept
            except Exception as exc:  # a broken rule must never break generation
                dec.fail(f"{type(exc).__name__}: {exc}")
                self.fell_back, self.stop = True, None
        if self.stop is None:  # fall back: the fallback gamma's tokens
            fb = min(dec.fallback_gamma, self.cap)
            self.kept = min(k, fb)
            go = k < fb
        return not go or k >= self.cap


_MODE_CLASSES: dict[str, type[DecisionMode]] = {
    cls.name: cls for cls in (UpfrontMode, PerTokenMode, TruncateMode, FixedMode, PreMode, GatedMode, StopMode)
}


def make_mode(mode: str, decider: Any, compression: str, max_gamma: int, *, probe_backoff: int = 0) -> DecisionMode:
    """The :class:`DecisionMode` named ``mode`` asking ``decider``.

    Raises
    ------
    ValueError
        For an unknown mode, or probe back-off in a mode without a probe.
    """
    cls = _MODE_CLASSES.get(mode)
    if cls is None:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if issubclass(cls, _ProbeMode):
        return cls(decider, compression, max_gamma, probe_backoff)
    if probe_backoff:
        raise ValueError(f"probe_backoff applies to the upfront and per-token modes, not {mode!r}")
    return cls(decider, compression, max_gamma)
