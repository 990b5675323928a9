"""Policy adapters for the hook: any policy as a decider that never raises inside generation.

:class:`PolicyDecider` wraps an ONNX export (path or :class:`~speckv_policy.runtime.RuntimePolicy`),
a fitted :class:`~speckv_policy.policies.GammaPolicy` or a callable; :class:`RuleDecider`
wraps a :class:`~speckv_policy.stop.StopRule`. Both count failures, warn once and
stand in the fallback gamma for a failed decision (:mod:`speckv_policy.decisions`
asks them). :func:`apply_costs` re-prices an export for ``attach(..., costs=...)``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..decisions import DEFAULT_MAX_GAMMA, checked_gamma
from ..objective import CostModel, CostModelError
from ..runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from ..schema import FeatureSet, compression_code, get_feature_set
from ..stop import StopRule, StopRuleError, StopState
from .live_costs import LiveCosts

__all__ = ["FallbackCounter", "PolicyDecider", "RuleDecider", "ScheduleDecider", "apply_costs"]


class FallbackCounter:
    """Counts a policy's failures and warns once; the fallback gamma stands in for a failed decision.

    Attributes
    ----------
    fallbacks : int
        Failed decisions so far.
    load_error : Exception or None
        Why the policy could not be loaded (every step then falls back).
    runtime : RuntimePolicy or None
        The export that decides, if any.
    """

    def __init__(self, policy: Any, fallback_gamma: int) -> None:
        self.fallback_gamma = int(fallback_gamma)
        self.warned = False
        self.fallbacks = 0
        self.source = policy
        self.load_error: Exception | None = None
        self.runtime: RuntimePolicy | None = None
        self.max_gamma = DEFAULT_MAX_GAMMA
        self.lists = False

    def fail(self, why: str) -> int:
        """Count a failed decision (warning on the first); returns the fallback gamma."""
        self.fallbacks += 1
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"speckv policy {self.source!r} failed ({why}); using fallback gamma {self.fallback_gamma} "
                "(further failures are counted in handle.summary()['fallbacks'], not warned)",
                PolicyFallbackWarning,
                stacklevel=3,
            )
        return min(self.fallback_gamma, self.max_gamma)


class ScheduleDecider(FallbackCounter):
    """A fixed-gamma schedule ``gamma_fn(step) -> int`` that never raises: a failing call or anything but an int in
    ``0..64`` yields the fallback gamma with one warning, as in every other mode (the mode caps gammas at max_gamma)."""

    def __init__(self, schedule: Any, max_gamma: int, fallback_gamma: int) -> None:
        super().__init__(schedule, fallback_gamma)
        self.schedule = schedule
        self.max_gamma = int(max_gamma)

    def decide_step(self, step: int) -> tuple[int, bool]:
        """``(gamma, fell_back)`` for ``step``."""
        try:
            return checked_gamma(self.schedule(step)), False  # 0..64; the mode caps it at max_gamma
        except Exception as exc:  # a broken schedule must never break generation
            return self.fail(f"{type(exc).__name__}: {exc}"), True


class RuleDecider(FallbackCounter):
    """A :class:`~speckv_policy.stop.StopRule` for ``mode='stop'``; an unreadable one falls back every step.

    Parameters
    ----------
    policy : StopRule, path or dict
        The rule or its JSON.
    max_gamma : int or None
        Cap on draft tokens per step; default: the rule's own.
    fallback_gamma : int
        Gamma drafted where the rule fails.
    costs : None, CostModel, dict, path, 'live' or LiveCosts
        Re-prices the rule as it loads, or prices it live.
    """

    def __init__(self, policy: Any, max_gamma: int | None, fallback_gamma: int, costs: Any) -> None:
        super().__init__(policy, fallback_gamma)
        if not isinstance(policy, (StopRule, str, os.PathLike, dict)):
            raise TypeError(
                "mode='stop' needs a StopRule or the path of its JSON (speckv-export --stop-rule); got "
                f"{type(policy).__name__}"
            )
        self.rule: StopRule | None = None
        #: live costs (``costs='live'`` or a LiveCosts): the prices every step begins with, refreshed after each step
        self.live: LiveCosts | None = None
        self.prices: tuple[list[float], float] | None = None
        try:
            self.rule = StopRule.load(policy)
        except (OSError, StopRuleError) as exc:  # a missing or broken file: every step falls back, one warning
            self.load_error = exc
        if isinstance(costs, str) and costs == "live":
            costs = LiveCosts()
        if isinstance(costs, LiveCosts):
            self.live = costs
        elif costs is not None:
            try:
                cost = CostModel.load(costs)
            except (OSError, CostModelError) as exc:  # a bad cost file falls back like a bad rule file
                self.load_error, self.rule = exc, None
            else:
                if self.rule is not None:
                    self.rule = self.rule.reprice(cost)
        top = self.rule.max_gamma if self.rule is not None else DEFAULT_MAX_GAMMA
        self.max_gamma = int(max_gamma) if max_gamma is not None else top
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")

    @property
    def gates(self) -> bool:
        """Whether the rule has a pre-draft gate."""
        return self.rule is not None and bool(self.rule.gates)

    def opens(self, compression: str, temperature: float, pre: Any) -> bool:
        """Whether the rule's gate lets the step draft."""
        assert self.rule is not None
        return self.rule.opens(compression, temperature, pre)

    def begin(self, compression: str, temperature: float, cap: int, match_len: float) -> StopState:
        """The step's stop state, at the live prices where there are any.

        Raises
        ------
        Exception
            Whatever the rule raises, or why it could not be loaded.
        """
        if self.rule is None:
            raise self.load_error or ValueError("no stop rule")
        return self.rule.begin(compression, temperature, cap, match_len, self.prices)

    def start_live(self, compression: str) -> LiveCosts | None:
        """Start the live estimator (if any) at ``compression`` from the rule's cost model or its own prior."""
        if self.live is None or self.rule is None:
            return None  # no live costs, or an unreadable rule that falls back every step anyway
        try:
            self.live.start(self.rule.cost_model, compression_code(compression))
            self.prices = self.live.stop_prices(self.rule.max_gamma)
        except (OSError, CostModelError) as exc:  # the prior's file is bad: every step falls back, one warning
            self.load_error, self.rule = exc, None
            return None
        except ValueError as exc:
            raise ValueError(f"costs: the live estimator's prior cannot price this rule: {exc}") from None
        return self.live

    def refresh(self, drafted: int, draft_ms: float, verified: int, verify_ms: float) -> None:
        """After a step: let the live estimator see it and price the next step."""
        assert self.live is not None and self.rule is not None
        self.live.observe(drafted, draft_ms, verified, verify_ms)
        self.prices = self.live.stop_prices(self.rule.max_gamma)


class PolicyDecider(FallbackCounter):
    """Wraps any length policy into ``decider(features) -> (gamma, fell_back)`` that never raises.

    Parameters
    ----------
    policy : path, RuntimePolicy, fitted GammaPolicy or callable
        The policy.
    feature_set : FeatureSet or None
        The feature set of a callable policy.
    max_gamma : int or None
        Cap on its choices; default: its largest candidate.
    fallback_gamma : int
        Gamma used where it fails.
    own_runtime : bool, default=False
        Load a private copy of a given RuntimePolicy (to re-price it without changing the caller's).
    """

    def __init__(
        self,
        policy: Any,
        feature_set: FeatureSet | None,
        max_gamma: int | None,
        fallback_gamma: int,
        own_runtime: bool = False,
    ) -> None:
        super().__init__(policy, fallback_gamma)
        self.gate_fn: Callable[[Any], Any] | None = None  # a gated policy's pre-draft gate
        engine = "auto"
        if isinstance(policy, RuntimePolicy) and own_runtime and policy.load_error is None:
            # a private copy to re-price: the caller's object stays as it is (its engine choice carries over)
            engine = "onnxruntime" if policy.engine == "onnxruntime" else "auto"
            policy = policy.path
        if isinstance(policy, (str, os.PathLike)):
            try:  # load strictly: failures must go through this decider's one warning and its count
                policy = RuntimePolicy(policy, engine=engine)
            except Exception as exc:
                self.load_error = exc
        cands = None
        if self.load_error is not None:
            self.feature_set = feature_set
            self.disable(self.load_error)
        elif isinstance(policy, RuntimePolicy):
            self.feature_set = policy.feature_set or feature_set
            cands = policy.candidates
            self.decide_fn = policy.decide
            self.gate_fn = policy.decide_gate if policy.gated else None
            self.runtime = policy
            # the runtime's Python engine reads the features as a list (no numpy on the step's path)
            self.lists = policy.engine == "python"
        elif hasattr(policy, "predict") and hasattr(policy, "candidates_"):
            self.feature_set = get_feature_set(policy.feature_set_) if policy.feature_set_ else feature_set
            cands = policy.candidates_
            if hasattr(policy, "predict_gate"):  # a fitted GatedPolicy: the gate, then its length head
                self.decide_fn = lambda x: policy.predict_length(np.asarray(x, dtype=np.float32).reshape(1, -1))[0]
                self.gate_fn = lambda x: policy.predict_gate(np.asarray(x, dtype=np.float32).reshape(1, -1))[0]
            else:
                self.decide_fn = lambda x: policy.predict(np.asarray(x, dtype=np.float32).reshape(1, -1))[0]
        elif callable(policy):
            self.feature_set = feature_set
            self.decide_fn = policy
            self.gate_fn = getattr(policy, "decide_gate", None)  # e.g. an object with __call__ and decide_gate
        else:
            raise TypeError(
                "policy must be an .onnx path, a RuntimePolicy, a fitted GammaPolicy, a callable, a stop rule's "
                f".json or an int (a fixed gamma); got {type(policy).__name__}"
            )
        top = int(np.max(cands)) if cands is not None and len(cands) else DEFAULT_MAX_GAMMA
        self.max_gamma = int(max_gamma) if max_gamma is not None else max(top, 1)
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")

    def disable(self, error: Exception) -> None:
        """From now on every decision fails with ``error`` (one warning, then counted): a policy or its cost file
        that cannot be used falls back, it never stops generation."""
        self.load_error = error

        def _broken(features: Any) -> int:
            raise error

        self.decide_fn: Callable[[Any], Any] = _broken
        # a policy that never loaded may have had a gate; a loaded one keeps the gate it has
        self.gate_fn = _broken if self.gate_fn is not None or self.runtime is None else None

    @property
    def has_gate(self) -> bool:
        """Whether the policy has a pre-draft gate (a gated policy)."""
        return self.gate_fn is not None

    def gate(self, features: Any) -> tuple[bool, bool]:
        """``(open, fell_back)`` from a gated policy's gate; a failing gate opens (the head or the fallback decides)."""
        try:
            opened = self.gate_fn(features)  # type: ignore[misc]
            if not isinstance(opened, (bool, np.bool_, int, np.integer)) or int(opened) not in (0, 1):
                raise ValueError(f"the gate returned {opened!r}, expected a bool")
            return bool(opened), False
        except Exception as exc:  # a broken gate must never break generation
            self.fail(f"gate: {type(exc).__name__}: {exc}")
            return True, True

    def __call__(self, features: Any) -> tuple[int, bool]:
        try:
            g = self.decide_fn(features)
        except Exception as exc:  # a broken policy must never break generation
            return self.fail(f"{type(exc).__name__}: {exc}"), True
        if type(g) is int and 0 <= g <= self.max_gamma:  # the common case, checked first (it runs cold)
            return g, False
        try:
            ok = float(g) == int(g) and 0 <= int(g) <= self.max_gamma
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            return self.fail(f"returned {g!r}, expected an int in 0..{self.max_gamma}"), True
        return int(g), False


def apply_costs(decider: PolicyDecider, costs: Any, compression: str) -> LiveCosts | None:
    """Apply ``attach(..., costs=...)`` to a length policy: re-price its export now, or return the live estimator.

    A cost file that cannot be read or is not a valid cost model (missing, a
    folder, a field of the wrong type or magnitude) disables the decider: every
    step drafts the fallback gamma, with one warning, as for a broken policy file.

    Raises
    ------
    ValueError
        Where the policy cannot be priced this way, in the terms of ``attach``'s arguments.
    """
    rt = decider.runtime
    if rt is None:
        if decider.load_error is not None:
            return None  # every step falls back anyway
        raise ValueError(
            "costs= needs an ONNX export (a path or a RuntimePolicy): it re-prices the export's "
            "expected tokens per candidate; a fitted policy or a callable has no prices to change"
        )
    if not rt.repriceable:
        raise ValueError(
            f"{rt.path} maximises {rt.metadata.get('speckv.objective')}: costs= cannot change its decisions"
        )
    if isinstance(costs, str) and costs == "live":
        costs = LiveCosts()
    if isinstance(costs, LiveCosts):
        if rt.gated:
            raise ValueError(
                f"costs='live' is not available for a gated export ({rt.path}): its gate and length head are priced "
                "from a whole cost model, not from running step times. Calibrate this machine (speckv-calibrate "
                "--out costs.json) and pass costs='costs.json', or use the stop rule (exported/smollm2-stop.json), "
                "which takes costs='live'"
            )
        if rt.cost_model is None and costs.prior_source is None:
            raise ValueError(
                f"costs='live' starts from the cost model the export carries, and {rt.path} carries none: "
                "pass costs=LiveCosts(prior='costs.json') with a calibration (speckv-calibrate) to start from"
            )
        try:
            costs.start(rt.cost_model, compression_code(compression))  # type: ignore[arg-type]
            rt.set_step_times(costs.table(rt.candidates), unit=costs.prior.unit if costs.prior else "ms")
        except (OSError, CostModelError) as exc:  # the prior's file is bad: every step falls back, one warning
            decider.disable(exc)
            return None
        except ValueError as exc:
            raise ValueError(f"costs: the live estimator's prior cannot price {rt.path}: {exc}") from None
        return costs
    try:
        cost = CostModel.load(costs)
    except (OSError, CostModelError) as exc:  # a bad cost file falls back like a bad policy file: one warning
        decider.disable(exc)
        return None
    try:
        rt.reprice(cost)
    except PolicyLoadError as exc:
        raise ValueError(str(exc)) from None
    return None
