"""Run a gamma policy inside Hugging Face assisted generation.

    handle = attach(target, "exported/policy.onnx", compression="nf4")
    out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)   # unchanged call
    handle.stats        # per step: gamma, accepted, draft / verify / decision time
    handle.detach()     # or: with attach(...) as handle: ...

``attach`` swaps the candidate generator of that one model instance
(through :mod:`speckv_policy.hf._compat`, the only place that touches
transformers' private internals) so that assisted generation drafts through
:class:`SpeckvCandidateGenerator`, a subclass of transformers'
``AssistedCandidateGenerator``. It drafts with the draft's own cached forward
calls (:class:`~speckv_policy.hf.lean_draft.LeanDraft`) where it can, else
through the draft's ``generate()``. Verification, acceptance (greedy match or
rejection sampling) and the target's cache stay Hugging Face's own code, so the
output is the target's whatever gamma the policy picks.

Decision modes
--------------
``upfront``
    Draft one token, compute the ``online`` features from its processed
    distribution, decide gamma, draft the rest. Gamma 0 drops the probe token
    and makes the step a plain target step.
``per-token``
    After each draft token, ask the policy about a step starting from that
    token's distribution: keep the token if it would draft >= 1, go on drafting
    if it would draft >= 2 (a DISCO / SpecDec++-style stop rule).
``truncate``
    The published design: draft ``max_gamma`` tokens, compute the ``paper``
    features over all of them, keep the first gamma.
``fixed``
    Gamma chosen before drafting by a callable ``gamma_fn(step) -> int`` (the
    profiler's schedules and fixed-gamma baselines); no features.
``pre``
    The policy chooses gamma before drafting from the ``pre`` features
    (acceptance history, the target's confidence and entropy at the last
    verified position, the context's self-repetition, context length,
    compression, temperature): no probe, so gamma 0 costs nothing but the
    target step. Export such a policy with ``--decision-draft-tokens 0``.
``gated``
    A gated policy (``speckv-export --feature-set gated``): its gate decides
    from the ``pre`` features whether to draft at all (closed: a plain target
    step, no probe); when it opens, the draft's first token is the probe and
    the length head picks gamma from the ``gated`` features (every ``pre``
    feature plus the probe token's confidence and entropy).
``stop``
    A cost-aware stop rule (:class:`speckv_policy.stop.StopRule`, ``speckv-export
    --stop-rule``): after every draft token, send the best prefix drafted so far
    and draft one more while a longer draft is worth its price. Gamma 0 (a
    plain step) is still possible after the first token.

This module imports torch and transformers; :mod:`speckv_policy.runtime` does not
import it.
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from ..features import (
    ContextMatcher,
    OnlineFeatureState,
    draft_token_confidence_one,
    draft_token_stats_from_logits,
    draft_token_stats_one,
    gated_features,
    gated_values,
    paper_features,
)
from ..objective import CostModel
from ..runtime import DEFAULT_FALLBACK_GAMMA, PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from ..schema import COMPRESSIONS, GATED, ONLINE, PAPER, PRE, FeatureSet, compression_code, get_feature_set
from ..stop import StopRule, StopRuleError, StopState
from . import _compat
from ._compat import AssistedCandidateGenerator
from .fast_draft import LlamaDecodeStep, decode_step_blocker
from .lean_draft import LeanDraft
from .live_costs import LiveCosts

MODES = ("upfront", "per-token", "truncate", "fixed", "pre", "gated", "stop")
#: the modes whose draft loop asks the controller after every draft token
_ASKS_PER_TOKEN = ("upfront", "per-token", "gated", "stop")
DRAFT_LOOPS = ("lean", "generate")
#: How the lean loop runs the draft's forward steps (``attach(..., draft_forward=...)``).
DRAFT_FORWARDS = ("auto", "transformers")
DEFAULT_MAX_GAMMA = 8


def detect_compression(model: Any) -> str:
    """Compression name of a loaded model: ``int8``/``nf4`` from its
    bitsandbytes config, else its dtype (``fp16``, ``bf16``, ``fp32``).

    Raises
    ------
    ValueError
        For a quantization this package has no code for (e.g. FP4).
    """
    q = getattr(model.config, "quantization_config", None)
    if q is not None:
        get = q.get if isinstance(q, dict) else lambda k, d=None: getattr(q, k, d)
        if get("load_in_8bit", False):
            return "int8"
        if get("load_in_4bit", False):
            kind = get("bnb_4bit_quant_type", "fp4")
            if kind == "nf4":
                return "nf4"
            raise ValueError(f"4-bit quantization {kind!r} has no compression code; pass compression= explicitly")
    dtype = getattr(model, "dtype", torch.float32)
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, "fp32")


@dataclass
class StepStats:
    """What one speculation step did.

    ``gamma`` is the number of draft tokens sent to verification, ``drafted``
    the number the draft produced (more when a probe or truncation dropped
    some), ``accepted`` how many the target kept, ``skipped`` whether probe
    back-off made it a plain step without asking the policy. Times in ms / us;
    ``decision_us`` counts computing the features from the draft's scores and
    the policy call.
    """

    generation: int
    step: int
    context_len: int
    gamma: int
    drafted: int
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decision_us: float = 0.0
    fallback: bool = False
    skipped: bool = False
    draft_confidence: list[float] = field(default_factory=list)
    draft_entropy: list[float] = field(default_factory=list)
    draft_token_prob: list[float] = field(default_factory=list)
    #: the ``pre`` signals as they were before the step (NaN where the hook did not compute them)
    target_confidence: float = math.nan
    target_entropy: float = math.nan
    context_match_len: float = math.nan
    #: the part of ``decision_us`` spent computing those signals (the rest is the policy's calls and their features)
    signals_us: float = 0.0


class _Fallback:
    """Counts a policy's failures and warns once; the fallback gamma stands in for a failed decision."""

    def __init__(self, policy: Any, fallback_gamma: int) -> None:
        self.fallback_gamma = int(fallback_gamma)
        self.warned = False
        self.fallbacks = 0
        self.source = policy
        self.load_error: Exception | None = None
        self.runtime: RuntimePolicy | None = None
        self.max_gamma = DEFAULT_MAX_GAMMA

    def _fail(self, why: str) -> int:
        self.fallbacks += 1
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"speckv policy {self.source!r} failed ({why}); using fallback gamma {self.fallback_gamma} "
                "(further failures are counted in handle.summary()['fallbacks'], not warned)",
                PolicyFallbackWarning,
                stacklevel=2,
            )
        return min(self.fallback_gamma, self.max_gamma)


class _StopDecider(_Fallback):
    """A :class:`~speckv_policy.stop.StopRule` for ``mode='stop'``; an unreadable one falls back every step."""

    def __init__(self, policy: Any, max_gamma: int | None, fallback_gamma: int, costs: Any) -> None:
        super().__init__(policy, fallback_gamma)
        if not isinstance(policy, (StopRule, str, os.PathLike, dict)):
            raise TypeError(
                f"mode='stop' needs a StopRule or the path of its JSON (speckv-export --stop-rule); got {type(policy).__name__}"
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
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None
            if self.rule is not None:
                self.rule = self.rule.reprice(cost)
        top = self.rule.max_gamma if self.rule is not None else DEFAULT_MAX_GAMMA
        self.max_gamma = int(max_gamma) if max_gamma is not None else top
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")

    def start_live(self, compression: str) -> LiveCosts | None:
        """Start the live estimator (if any) at ``compression`` from the rule's cost model or its own prior."""
        if self.live is None or self.rule is None:
            return None  # no live costs, or an unreadable rule that falls back every step anyway
        try:
            self.live.start(self.rule.cost_model, compression_code(compression))
            self.prices = self.live.stop_prices(self.rule.max_gamma)
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"costs=LiveCosts(prior=...): {exc}") from None
        return self.live

    def refresh(self, drafted: int, draft_ms: float, verified: int, verify_ms: float) -> None:
        """After a step: let the live estimator see it and price the next step."""
        assert self.live is not None and self.rule is not None
        self.live.observe(drafted, draft_ms, verified, verify_ms)
        self.prices = self.live.stop_prices(self.rule.max_gamma)

    def begin(self, compression: str, temperature: float, cap: int, match_len: float) -> StopState | None:
        """The step's stop state, or None (after counting the failure) where the rule cannot decide."""
        try:
            if self.rule is None:
                raise self.load_error or ValueError("no stop rule")
            return self.rule.begin(compression, temperature, cap, match_len, self.prices)
        except Exception as exc:  # a broken rule must never break generation
            self._fail(f"{type(exc).__name__}: {exc}")
            return None


class _Decider(_Fallback):
    """Wraps any policy into ``decide(features) -> int`` that never raises."""

    def __init__(
        self,
        policy: Any,
        feature_set: FeatureSet | None,
        max_gamma: int | None,
        fallback_gamma: int,
        own_runtime: bool = False,
    ) -> None:
        super().__init__(policy, fallback_gamma)
        self._gate: Callable[[Any], Any] | None = None  # a gated policy's pre-draft gate
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
        if self.load_error is not None:
            self.feature_set = feature_set
            cands = None
            error = self.load_error

            def _broken(features: Any) -> int:
                raise error

            self._fn = _broken
            self._gate = _broken
        elif isinstance(policy, RuntimePolicy):
            self.feature_set = policy.feature_set or feature_set
            cands = policy.candidates
            self._fn = policy.decide
            self._gate = policy.decide_gate if policy.gated else None
            self.runtime = policy
        elif hasattr(policy, "predict") and hasattr(policy, "candidates_"):
            self.feature_set = get_feature_set(policy.feature_set_) if policy.feature_set_ else feature_set
            cands = policy.candidates_
            if hasattr(policy, "predict_gate"):  # a fitted GatedPolicy: the gate, then its length head
                self._fn = lambda x: policy.predict_length(np.asarray(x, dtype=np.float32).reshape(1, -1))[0]
                self._gate = lambda x: policy.predict_gate(np.asarray(x, dtype=np.float32).reshape(1, -1))[0]
            else:
                self._fn = lambda x: policy.predict(np.asarray(x, dtype=np.float32).reshape(1, -1))[0]
        elif callable(policy):
            self.feature_set = feature_set
            cands = None
            self._fn = policy
            self._gate = getattr(policy, "decide_gate", None)  # e.g. an object with __call__ and decide_gate
        else:
            raise TypeError(
                f"policy must be an .onnx path, a RuntimePolicy, a fitted GammaPolicy or a callable; got {type(policy).__name__}"
            )
        top = int(np.max(cands)) if cands is not None and len(cands) else DEFAULT_MAX_GAMMA
        self.max_gamma = int(max_gamma) if max_gamma is not None else max(top, 1)
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")

    @property
    def has_gate(self) -> bool:
        return self._gate is not None

    def gate(self, features: Any) -> tuple[bool, bool]:
        """``(open, fell_back)`` from a gated policy's gate; a failing gate opens (the head or the fallback decides)."""
        try:
            opened = self._gate(features)  # type: ignore[misc]
            if not isinstance(opened, (bool, np.bool_, int, np.integer)) or int(opened) not in (0, 1):
                raise ValueError(f"the gate returned {opened!r}, expected a bool")
            return bool(opened), False
        except Exception as exc:  # a broken gate must never break generation
            self._fail(f"gate: {type(exc).__name__}: {exc}")
            return True, True

    def __call__(self, features: Any) -> tuple[int, bool]:
        try:
            g = self._fn(features)
        except Exception as exc:  # a broken policy must never break generation
            return self._fail(f"{type(exc).__name__}: {exc}"), True
        if type(g) is int and 0 <= g <= self.max_gamma:  # the common case, checked first (it runs cold)
            return g, False
        try:
            ok = float(g) == int(g) and 0 <= int(g) <= self.max_gamma
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            return self._fail(f"returned {g!r}, expected an int in 0..{self.max_gamma}"), True
        return int(g), False


def _confidence_and_no_entropy(logits: torch.Tensor) -> tuple[float, float]:
    """A draft token's top-1 probability and 0.0 for its entropy: for a policy whose decisions do not read it."""
    return draft_token_confidence_one(logits), 0.0


def _no_token_stats(logits: torch.Tensor) -> tuple[float, float]:
    """0.0 for a draft token's top-1 probability and entropy: for a policy whose decisions read neither."""
    return 0.0, 0.0


class _Controller:
    """Per-``attach`` decision logic and statistics, shared by every generate call."""

    def __init__(
        self,
        decider: _Decider | _StopDecider | None,
        mode: str,
        compression: str,
        gamma_fn: Callable[[int], int] | None,
        record_tokens: bool,
        sync_cuda: bool,
    ) -> None:
        self.decider = decider
        self.mode = mode
        self.compression = compression
        self.gamma_fn = gamma_fn
        self.record_tokens = record_tokens
        self.sync_cuda = sync_cuda
        self.max_gamma = decider.max_gamma if decider is not None else DEFAULT_MAX_GAMMA
        self.stats: list[StepStats] = []
        self.generations = 0
        self.state: OnlineFeatureState | None = None
        self.current: StepStats | None = None
        self._verify_t0 = 0.0
        self._kept = 0
        self._plan = 0
        self._device: torch.device | None = None
        self.probe_backoff = 0
        self.live: LiveCosts | None = None
        self._skip = 0  # plain steps left before the next probe
        self._backoff = 0  # current back-off length
        self.draft_loop = "lean"
        self.draft_loop_used = ""
        self.draft_forward = "auto"
        self.draft_forward_used = ""
        # the pre-draft signals: computed when a pre decision needs them or a profile records them
        self.signals = record_tokens or mode in ("pre", "gated", "stop")
        # the target's confidence and entropy at the last verified position: logged by a profile (log schema v2),
        # read by no feature set since 'pre' v3, so a run that records nothing does not pay for them
        self.target_signals = record_tokens
        self._pre_row: Any = None  # gated mode: the step's pre features, completed by the probe
        self._stop: StopState | None = None  # stop mode: this step's stop decisions
        self._cap = 0  # the step's draft budget
        # the runtime's Python engine reads the features as a list (no numpy on the step's path, see pre_values)
        runtime = getattr(decider, "runtime", None)
        self._lists = runtime is not None and runtime.engine == "python"
        self._gated: Callable[[Any, float, float], Any] = gated_values if self._lists else gated_features
        self._signal_us = 0.0  # time spent on them after the last verification, charged to the next decision
        self._matcher = ContextMatcher()  # context_match_len, kept incrementally over a generation
        # ... scanned only where it is logged, the stop rule reads it, or the policy's decisions can depend on it
        reads = runtime.read_features if runtime is not None else None
        self._scan_context = self.signals and (
            record_tokens or mode == "stop" or reads is None or "context_match_len" in reads
        )
        self._match_len = 0  # this step's context_match_len where scanned, else 0 (a value the policy ignores)
        # a draft token's statistics, only what the policy reads (its top-1 probability alone: half the work)
        self._token_stats: Callable[[torch.Tensor], tuple[float, float]] = draft_token_stats_one
        if reads is not None and "entropy_first" not in reads:
            self._token_stats = _confidence_and_no_entropy if "conf_first" in reads else _no_token_stats

    # -- sequence / step bookkeeping --------------------------------------
    def begin(self, generation_config: Any, device: torch.device) -> None:
        temp = float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0
        self.state = OnlineFeatureState(self.compression, temp)
        self._matcher.reset()
        self.generations += 1
        self.step = 0
        self._device = device
        self._skip = self._backoff = 0
        self._signal_us = 0.0

    def start_step(self, input_ids: torch.Tensor) -> float:
        """Open the step's stats; with signals on, record the pre-draft signals. Returns the step's start time."""
        t0 = self.clock()
        cur = input_ids.shape[-1]
        self.current = StepStats(generation=self.generations, step=self.step, context_len=cur, gamma=0, drafted=0)
        if self.signals:
            assert self.state is not None
            t = time.perf_counter()
            if self._scan_context:
                self._matcher.sync(input_ids)
                self._match_len = self._matcher.match_len()
                self.current.context_match_len = float(self._match_len)
            if self.target_signals:
                self.current.target_confidence = self.state.target_confidence
                self.current.target_entropy = self.state.target_entropy
            self.current.signals_us = (time.perf_counter() - t) * 1e6 + self._signal_us
            self.current.decision_us += self.current.signals_us
            self._signal_us = 0.0
        return t0

    def observe_verification(self, scores: torch.Tensor, num_matches: int) -> None:
        """When recording: the target's confidence and entropy at the last verified position, for the next step."""
        if not self.target_signals or self.state is None:
            return
        t = time.perf_counter()
        pos = min(int(num_matches), scores.shape[1] - 1)
        self.state.observe_target(*draft_token_stats_one(scores[0, pos]))
        self._signal_us = (time.perf_counter() - t) * 1e6

    def skip_probe(self) -> bool:
        """Whether this step is a plain target step by probe back-off (and count it)."""
        if self._skip > 0:
            self._skip -= 1
            return True
        return False

    def after_probe(self, gamma: int) -> None:
        """Back-off bookkeeping after a probed step chose ``gamma``."""
        if not self.probe_backoff:
            return
        if gamma == 0:
            self._backoff = min(max(1, 2 * self._backoff), self.probe_backoff)
            self._skip = self._backoff
        else:
            self._backoff = 0

    def clock(self) -> float:
        if self.sync_cuda and self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _decide(self, features: Any, t: float) -> int:
        """Ask the policy; ``t`` is when computing its features began (a decision's cost includes them)."""
        g, fell_back = self.decider(features)  # type: ignore[misc]
        assert self.current is not None
        self.current.decision_us += (time.perf_counter() - t) * 1e6
        self.current.fallback |= fell_back
        return g

    def _pre_now(self) -> Any:
        """This step's ``pre`` features: a list for the runtime's Python engine, else a float32 array."""
        assert self.state is not None and self.current is not None
        cur = self.current
        pre = self.state.pre_values if self._lists else self.state.pre_features
        return pre(cur.context_len, self._match_len)

    def plan_pre(self) -> int:
        """``pre`` mode: the policy's gamma from the pre-draft signals, before any draft token."""
        assert self.state is not None and self.current is not None
        t = time.perf_counter()
        return min(self._decide(self._pre_now(), t), self.max_gamma)

    def plan_gate(self) -> bool:
        """``gated`` mode: whether the gate opens (draft, probe first) for this step, before any draft token."""
        assert self.state is not None and self.current is not None and self.decider is not None
        t = time.perf_counter()
        cur = self.current
        self._pre_row = self._pre_now()
        opened, fell_back = self.decider.gate(self._gated(self._pre_row, 0.0, 0.0))
        cur.decision_us += (time.perf_counter() - t) * 1e6
        cur.fallback |= fell_back
        return opened

    def plan_stop(self) -> bool:
        """``stop`` mode: whether the rule's pre-draft gate lets this step draft (True without a gate)."""
        dec = self.decider
        if not isinstance(dec, _StopDecider) or dec.rule is None or not dec.rule.gates:
            return True
        assert self.state is not None and self.current is not None
        t = time.perf_counter()
        cur = self.current
        try:
            pre = self.state.pre_values(cur.context_len, self._match_len)
            opened = dec.rule.opens(self.compression, self.state.temperature, pre)
        except Exception as exc:  # a broken gate must never break generation: draft, the rule decides the rest
            dec._fail(f"{type(exc).__name__}: {exc}")
            cur.fallback, opened = True, True
        cur.decision_us += (time.perf_counter() - t) * 1e6
        return opened

    def plan_fixed(self) -> int:
        assert self.gamma_fn is not None
        g = self.gamma_fn(self.step)
        if not (isinstance(g, (int, np.integer)) and 0 <= g <= 64):
            raise ValueError(f"gamma_fn returned {g!r}; expected an int in 0..64")
        return int(g)

    def on_draft_token(self, k: int, logits: torch.Tensor, context_len: int) -> bool:
        """Called after draft token ``k`` (1-based); returns True to stop drafting."""
        assert self.state is not None
        t = time.perf_counter()
        if self.mode == "upfront":
            if k == 1:
                conf, ent = self._token_stats(logits)
                self._plan = self._decide(self.state.features(conf, ent, context_len), t)
                self._kept = min(self._plan, self.max_gamma)
            return k >= max(self._kept, 1)
        if self.mode == "stop":
            return self._stop_after(k, logits, t)
        if self.mode == "gated":  # the gate opened: the length head reads the probe token
            if k == 1:
                assert self._pre_row is not None
                conf, ent = self._token_stats(logits)
                self._plan = self._decide(self._gated(self._pre_row, conf, ent), t)
                self._kept = min(self._plan, self.max_gamma)
            return k >= max(self._kept, 1)
        # per-token: would a step starting from this token's distribution draft?
        conf, ent = self._token_stats(logits)
        g = self._decide(self.state.features(conf, ent, context_len), t)
        if g >= 1:
            self._kept = k
        return g < 2 or k >= self.max_gamma

    def _stop_after(self, k: int, logits: torch.Tensor, t: float) -> bool:
        """``stop`` mode after draft token ``k``: the rule's keep / go on; the fallback gamma where it fails."""
        dec = self.decider
        cur = self.current
        assert isinstance(dec, _StopDecider) and cur is not None and self.state is not None
        if k == 1:
            self._stop = dec.begin(self.compression, self.state.temperature, self._cap, cur.context_match_len)
            cur.fallback |= self._stop is None
        go = False
        if self._stop is not None:
            try:
                conf, ent = draft_token_stats_one(logits)
                go = self._stop.after_token(conf, ent)
                self._kept = self._stop.kept
            except Exception as exc:  # a broken rule must never break generation
                self._stop = None
                cur.fallback = True
                dec._fail(f"{type(exc).__name__}: {exc}")
        if self._stop is None:  # fall back: the fallback gamma's tokens
            fb = min(dec.fallback_gamma, self._cap)
            self._kept = min(k, fb)
            go = k < fb
        cur.decision_us += (time.perf_counter() - t) * 1e6
        return not go or k >= self._cap

    def finish_draft(self, logits: torch.Tensor) -> int:
        """Number of drafted tokens to send for verification."""
        drafted = logits.shape[1]
        if self.mode == "truncate":
            t = time.perf_counter()
            conf, ent = draft_token_stats_from_logits(logits[0])
            g = self._decide(paper_features(conf.cpu().numpy(), ent.cpu().numpy(), self.compression), t)
            return min(g, drafted)
        if self.mode in ("fixed", "pre"):
            return drafted
        return min(self._kept, drafted)

    def record_tokens_of(self, ids: torch.Tensor, logits: torch.Tensor, start: int) -> None:
        assert self.current is not None
        lg = logits[0].float()
        conf, ent = draft_token_stats_from_logits(lg)
        probs = lg.softmax(-1)
        tok = ids[0, start : start + lg.shape[0]]
        self.current.draft_confidence = conf.tolist()
        self.current.draft_entropy = ent.tolist()
        self.current.draft_token_prob = probs[torch.arange(lg.shape[0], device=probs.device), tok].tolist()

    def end_step(self, num_matches: int) -> None:
        cur = self.current
        if cur is None:
            return
        cur.verify_ms = (self.clock() - self._verify_t0) * 1e3
        cur.accepted = int(min(num_matches, cur.gamma))
        assert self.state is not None
        self.state.update(cur.gamma, cur.accepted)
        self.stats.append(cur)
        if self.live is not None and self.decider is not None and cur.step > 0:  # step 0 also ran the prefill
            try:
                if isinstance(self.decider, _StopDecider):
                    self.decider.refresh(cur.drafted, cur.draft_ms, cur.gamma, cur.verify_ms)
                elif self.decider.runtime is not None:
                    self.live.observe(cur.drafted, cur.draft_ms, cur.gamma, cur.verify_ms)
                    rt = self.decider.runtime
                    rt.set_step_times(
                        self.live.table(rt.candidates), unit=self.live.prior.unit if self.live.prior else "ms"
                    )
            except Exception as exc:  # cost estimates must never break generation: keep the last prices
                self.live = None
                warnings.warn(
                    f"speckv live costs failed ({type(exc).__name__}: {exc}); keeping the last prices",
                    PolicyFallbackWarning,
                    stacklevel=2,
                )
        self.current = None
        self.step += 1


def _decode_step(draft: Any, how: str) -> tuple[LlamaDecodeStep | None, str]:
    """The decode step the lean loop runs ``draft`` through (None: its forward), and what ran, for the handle."""
    if how == "transformers":
        return None, "transformers (draft_forward='transformers')"
    why = decode_step_blocker(draft)
    if why is not None:
        return None, f"transformers ({why})"
    return LlamaDecodeStep(draft), "fast"


class _PolicyStop(StoppingCriteria):
    """Stopping criterion that lets the controller end the draft early."""

    def __init__(self, controller: _Controller, start_len: int) -> None:
        self.controller = controller
        self.start_len = start_len

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        k = input_ids.shape[-1] - self.start_len
        stop = self.controller.on_draft_token(k, scores[-1][0], self.start_len + k - 1)
        return torch.full((input_ids.shape[0],), bool(stop), dtype=torch.bool, device=input_ids.device)


class SpeckvCandidateGenerator(AssistedCandidateGenerator):
    """``AssistedCandidateGenerator`` whose draft length comes from a policy.

    Only the choice of how many draft tokens to propose changes; verification
    and acceptance are transformers' own code.
    """

    def __init__(self, *args: Any, controller: _Controller, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.controller = controller
        # switch off transformers' own confidence stop (None would mean 0.4)
        self.assistant_confidence_threshold = 0.0
        self.generation_config.assistant_confidence_threshold = 0.0
        self.assistant_generation_config.num_assistant_tokens_schedule = "constant"
        self.num_assistant_tokens = controller.max_gamma
        controller.begin(self.generation_config, self.assistant_model.device)
        self.lean: LeanDraft | None = None
        why = "draft_loop='generate'"
        if controller.draft_loop == "lean":
            why = _compat.lean_draft_blocker(self.assistant_model, self.assistant_kwargs)
            if why is None:
                gc = self.generation_config
                step, controller.draft_forward_used = _decode_step(self.assistant_model, controller.draft_forward)
                self.lean = LeanDraft(
                    self.assistant_model,
                    self.logits_processor,
                    bool(gc.do_sample),
                    gc.eos_token_id,
                    self.main_model_min_length or 0,
                    decode_step=step,
                )
        controller.draft_loop_used = "lean" if self.lean is not None else f"generate ({why})"
        if self.lean is None:
            controller.draft_forward_used = "transformers (draft_loop 'generate')"

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs: Any
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        c = self.controller
        input_ids = input_ids.to(self.assistant_model.device)
        cur = input_ids.shape[-1]
        t0 = c.start_step(input_ids)
        budget = self.main_model_max_length - cur - 1
        if c.mode == "pre":
            cap = min(c.plan_pre(), budget)
        elif c.mode == "gated":
            cap = min(c.max_gamma, budget) if c.plan_gate() else 0
        elif c.mode == "stop":
            cap = min(c.max_gamma, budget) if c.plan_stop() else 0
        else:
            cap = min(c.plan_fixed() if c.mode == "fixed" else c.max_gamma, budget)
        if c.probe_backoff and cap > 0 and c.skip_probe():
            c.current.skipped = True
            cap = 0
        if cap <= 0:
            c._verify_t0 = c.clock()
            return input_ids, None
        if c.mode in _ASKS_PER_TOKEN:
            c._kept = 0
            c._cap = cap
        if self.lean is not None:
            stop = c.on_draft_token if c.mode in _ASKS_PER_TOKEN else None
            ids, logits = self.lean.draft(input_ids, cap, stop)
        else:
            self.num_assistant_tokens = cap
            min_new, max_new = _compat.calculate_new_tokens(self, input_ids)
            _compat.sync_draft_inputs(self, input_ids)  # also after steps that skipped the draft
            args = _compat.prepare_generation_args(self, input_ids, min(min_new, max_new), max_new)
            if c.mode in _ASKS_PER_TOKEN:
                args["stopping_criteria"] = StoppingCriteriaList([_PolicyStop(c, cur)])
            ids, logits = _compat.generate_candidates(self, args)
        gamma = c.finish_draft(logits)
        c.after_probe(gamma)
        step = c.current
        step.drafted = int(logits.shape[1])
        step.gamma = int(gamma)
        if c.record_tokens and gamma > 0:
            c.record_tokens_of(ids, logits[:, :gamma], cur)
        c._verify_t0 = c.clock()
        step.draft_ms = (c._verify_t0 - t0) * 1e3
        if gamma == 0:
            return input_ids, None
        return ids[:, : cur + gamma], logits[:, :gamma]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        step = self.controller.current
        if self.lean is None and step is not None:  # the generate() path: keep only verified draft positions
            _compat.crop_draft_cache(self, step.context_len + min(int(num_matches), step.gamma))
        self.controller.end_step(int(num_matches))
        self.controller.observe_verification(scores, int(num_matches))


class SpeckvHandle:
    """Returned by :func:`attach`: statistics and :meth:`detach`.

    Attributes
    ----------
    stats : list of StepStats
        Every step of every assisted ``generate`` call since attaching.
    mode : str
        The decision mode.
    compression : str
        Compression name fed to the features.
    """

    def __init__(self, target: Any, controller: _Controller) -> None:
        self.target = target
        self._controller = controller
        self.mode = controller.mode
        self.compression = controller.compression
        self._attached = True

    @property
    def stats(self) -> list[StepStats]:
        return self._controller.stats

    @property
    def draft_loop(self) -> str:
        """How the last assisted ``generate`` drafted: ``'lean'``, or ``'generate (why)'``; empty before one ran."""
        return self._controller.draft_loop_used

    @property
    def draft_forward(self) -> str:
        """How the last assisted ``generate`` ran the draft's forward steps: ``'fast'`` (a
        :class:`~speckv_policy.hf.fast_draft.LlamaDecodeStep`) or ``'transformers (why)'``; empty before one ran."""
        return self._controller.draft_forward_used

    @property
    def live_costs(self) -> LiveCosts | None:
        """The running cost estimates of ``attach(..., costs='live')`` (None otherwise)."""
        return self._controller.live

    @property
    def runtime(self) -> RuntimePolicy | None:
        """The exported policy that decides (a private copy when ``costs=`` re-prices it), if any."""
        dec = self._controller.decider
        return dec.runtime if dec is not None else None

    def reset_stats(self) -> None:
        """Forget the recorded steps."""
        self._controller.stats.clear()

    def summary(self) -> dict[str, float]:
        """Totals over :attr:`stats`: steps, tokens, mean gamma, acceptance, times, fallbacks."""
        s = self.stats
        gam = sum(x.gamma for x in s)
        acc = sum(x.accepted for x in s)
        dec = self._controller.decider
        return {
            "steps": len(s),
            "tokens": acc + len(s),
            "mean_gamma": gam / len(s) if s else 0.0,
            "acceptance": acc / gam if gam else 0.0,
            "draft_ms": sum(x.draft_ms for x in s),
            "verify_ms": sum(x.verify_ms for x in s),
            "decision_us_mean": float(np.mean([x.decision_us for x in s])) if s else 0.0,
            "fallbacks": dec.fallbacks if dec is not None else 0,
            "skipped_probes": sum(x.skipped for x in s),
        }

    def stats_records(self) -> list[dict[str, Any]]:
        """:attr:`stats` as plain dicts (e.g. for ``pandas.DataFrame``)."""
        return [asdict(x) for x in self.stats]

    def detach(self) -> None:
        """Restore the target's own candidate generator."""
        if self._attached:
            _compat.uninstall_candidate_generator(self.target)
            self.target.__dict__.pop("generate", None)
            self._attached = False

    def __enter__(self) -> SpeckvHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


def _price(decider: _Decider | None, costs: Any, compression: str, mode: str) -> LiveCosts | None:
    """Apply ``attach(..., costs=...)``: re-price the decider's export now, or return the live estimator."""
    if decider is None:
        raise ValueError("costs= prices a policy's decisions; mode='fixed' has no policy")
    rt = decider.runtime
    if rt is None:
        if decider.load_error is not None:
            return None  # every step falls back anyway
        raise ValueError(
            "costs= needs an ONNX export (a path or a RuntimePolicy): it re-prices the export's "
            "expected tokens per candidate"
        )
    if not rt.repriceable:
        raise ValueError(
            f"{rt.path} maximises {rt.metadata.get('speckv.objective')}: costs= cannot change its decisions"
        )
    if isinstance(costs, str) and costs == "live":
        costs = LiveCosts()
    if isinstance(costs, LiveCosts):
        if rt.cost_model is None:
            raise ValueError(f"{rt.path} carries no cost model to start live costs from; give LiveCosts(prior=...)")
        try:
            costs.start(rt.cost_model, compression_code(compression))
            rt.set_step_times(costs.table(rt.candidates), unit=costs.prior.unit if costs.prior else "ms")
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"costs=LiveCosts(prior=...): {exc}") from None
        return costs
    try:
        rt.reprice(costs)
    except PolicyLoadError as exc:
        raise ValueError(str(exc)) from None
    return None


def attach(
    target: Any,
    policy: Any = None,
    *,
    compression: str | None = None,
    mode: str = "upfront",
    max_gamma: int | None = None,
    fallback_gamma: int | None = None,
    feature_set: str | None = None,
    gamma_fn: Callable[[int], int] | None = None,
    record_tokens: bool = False,
    sync_cuda: bool = True,
    probe_backoff: int = 0,
    costs: Any = None,
    draft_loop: str = "lean",
    draft_forward: str = "auto",
) -> SpeckvHandle:
    """Make ``target.generate(..., assistant_model=draft)`` consult a gamma policy.

    Parameters
    ----------
    target : transformers PreTrainedModel
        The verifying model (full precision or bitsandbytes INT8 / NF4).
    policy : path, RuntimePolicy, fitted GammaPolicy, callable or StopRule
        Where gamma comes from. A callable receives the feature vector and
        must then be told its ``feature_set``. Not used by ``mode='fixed'``.
        ``mode='stop'`` takes a :class:`~speckv_policy.stop.StopRule` or its
        JSON path (an unreadable file falls back every step, one warning).
    compression : str or None
        ``fp16``, ``bf16``, ``fp32``, ``int8`` or ``nf4``; ``None`` detects it
        from the target (:func:`detect_compression`).
    mode : {'upfront', 'per-token', 'truncate', 'fixed', 'pre', 'gated', 'stop'}
        See the module docstring.
    max_gamma : int or None
        Cap on draft tokens per step; default: the policy's largest candidate.
    fallback_gamma : int or None, default=None
        Gamma used, with one warning, when the policy fails or returns
        nonsense: 0..max_gamma; ``None`` means 4 (or max_gamma if smaller).
    feature_set : str or None
        Feature set of a callable policy (``online``, ``paper``, ``pre`` or ``gated``).
    gamma_fn : callable or None
        ``gamma_fn(step) -> int`` for ``mode='fixed'``.
    record_tokens : bool
        Keep per-draft-token confidence / entropy / token probability in
        :attr:`SpeckvHandle.stats` (the profiler uses this).
    sync_cuda : bool
        Synchronise CUDA around timings so draft and verify times are exact.
    probe_backoff : int, default=0
        ``upfront`` and ``per-token`` modes read the first draft token before
        deciding, so even a gamma-0 decision pays one draft call. With
        ``probe_backoff = B > 0``, a probe that ends in gamma 0 makes the next
        ``b`` steps plain target steps without a probe, ``b`` doubling (1, 2,
        4, ... up to ``B``) while probes keep ending in 0 and resetting once one
        drafts. Lossless like every gamma-0 step; 0 switches it off.
    costs : None, CostModel, dict, path, 'live' or LiveCosts
        How an exported policy prices its decisions. ``None``: the cost model
        it was exported with. A cost model (or the JSON ``speckv-calibrate``
        writes): re-priced for this machine. ``'live'`` (or a
        :class:`~speckv_policy.hf.live_costs.LiveCosts`, e.g. with a
        calibration as its prior): re-priced after every step from running
        estimates of the draft and verification times this generation
        measures. Needs an ONNX export (a path or a RuntimePolicy, which is
        then copied, not changed) that maximises tokens per second.
        ``mode='stop'``: a cost model (the rule is re-priced as it loads) or
        live costs (the rule's prices, verification per gamma and the draft's
        per-token time, re-estimated after every step,
        :meth:`~speckv_policy.hf.live_costs.LiveCosts.stop_prices`).
    draft_loop : {'lean', 'generate'}, default='lean'
        ``'lean'`` drafts with the draft model's own cached forward calls
        (:class:`~speckv_policy.hf.lean_draft.LeanDraft`), skipping the
        ~milliseconds ``assistant_model.generate()`` spends per step on set-up;
        drafts it cannot serve (encoder-decoder, sliding-window or linear
        attention caches, extra draft inputs, padded masks) use
        ``'generate'``, transformers' own drafting call, which is also
        selectable. :attr:`SpeckvHandle.draft_loop` says which one ran.
    draft_forward : {'auto', 'transformers'}, default='auto'
        How the lean loop runs the draft's forward steps. ``'auto'``: a plain
        Llama draft runs through
        :class:`~speckv_policy.hf.fast_draft.LlamaDecodeStep` (the same
        arithmetic without transformers' per-call machinery), any other
        through its own forward; ``'transformers'``: always its own forward.
        :attr:`SpeckvHandle.draft_forward` says which one ran.

    Returns
    -------
    SpeckvHandle

    Raises
    ------
    ValueError
        For an unknown mode or compression, a feature set that does not fit
        the mode, or (at generate time) batch size > 1 or beam search.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if draft_loop not in DRAFT_LOOPS:
        raise ValueError(f"unknown draft_loop {draft_loop!r}; expected one of {', '.join(DRAFT_LOOPS)}")
    if draft_forward not in DRAFT_FORWARDS:
        raise ValueError(f"unknown draft_forward {draft_forward!r}; expected one of {', '.join(DRAFT_FORWARDS)}")
    if fallback_gamma is not None and (
        isinstance(fallback_gamma, bool) or not isinstance(fallback_gamma, (int, np.integer)) or fallback_gamma < 0
    ):
        raise ValueError(f"fallback_gamma must be an int >= 0, got {fallback_gamma!r}")
    if not isinstance(probe_backoff, (int, np.integer)) or probe_backoff < 0:
        raise ValueError(f"probe_backoff must be an int >= 0, got {probe_backoff!r}")
    if probe_backoff and mode not in ("upfront", "per-token"):
        raise ValueError(f"probe_backoff applies to the upfront and per-token modes, not {mode!r}")
    if compression is None:
        compression = detect_compression(target)
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
    decider: _Decider | _StopDecider | None = None
    fallback = DEFAULT_FALLBACK_GAMMA if fallback_gamma is None else fallback_gamma
    if mode == "fixed":
        if gamma_fn is None:
            raise ValueError("mode='fixed' needs gamma_fn(step) -> int")
    elif mode == "stop":
        if policy is None:
            raise ValueError("mode='stop' needs a stop rule (a StopRule or its JSON path)")
        decider = _StopDecider(policy, max_gamma, fallback, costs)
        if fallback > decider.max_gamma:
            raise ValueError(f"fallback_gamma {fallback_gamma} exceeds max_gamma {decider.max_gamma}")
    else:
        if policy is None:
            raise ValueError(f"mode={mode!r} needs a policy")
        fs = get_feature_set(feature_set) if feature_set else None
        decider = _Decider(
            policy,
            fs,
            max_gamma,
            DEFAULT_FALLBACK_GAMMA if fallback_gamma is None else fallback_gamma,
            own_runtime=costs is not None,
        )
        if fallback_gamma is not None and fallback_gamma > decider.max_gamma:
            raise ValueError(f"fallback_gamma {fallback_gamma} exceeds max_gamma {decider.max_gamma}")
        want = {"truncate": PAPER, "pre": PRE, "gated": GATED}.get(mode, ONLINE)
        if decider.feature_set is None and decider.load_error is not None:
            decider.feature_set = want  # unreadable policy file: every step falls back anyway
        if decider.feature_set is None:
            raise ValueError("a callable policy needs feature_set= ('online', 'paper', 'pre' or 'gated')")
        if decider.feature_set.name != want.name:
            raise ValueError(
                f"mode={mode!r} computes the {want.name!r} feature set but the policy expects "
                f"{decider.feature_set.name!r}"
            )
        if mode == "gated" and not decider.has_gate:
            raise ValueError(
                "mode='gated' needs a gated policy: an export of speckv-export --feature-set gated, a fitted "
                "GatedPolicy, or a callable with a decide_gate(features) method"
            )
    if _compat.has_installed_candidate_generator(target):
        raise RuntimeError("a speckv policy is already attached to this model; detach() it first")
    controller = _Controller(decider, mode, compression, gamma_fn, record_tokens, sync_cuda)
    controller.probe_backoff = int(probe_backoff)
    controller.draft_loop = draft_loop
    controller.draft_forward = draft_forward
    if isinstance(decider, _StopDecider):  # a stop rule was re-priced as it loaded; live costs start here
        controller.live = decider.start_live(compression)
    elif costs is not None:
        controller.live = _price(decider, costs, compression, mode)
    original = _compat.default_candidate_generator(target)

    def _get_candidate_generator(
        generation_config: Any,
        input_ids: torch.LongTensor,
        inputs_tensor: Any,
        logits_processor: Any,
        model_kwargs: dict,
        assistant_model: Any = None,
        target_tokenizer: Any = None,
        assistant_tokenizer: Any = None,
    ) -> Any:
        plain_assisted = (
            assistant_model is not None
            and target_tokenizer is None
            and generation_config.prompt_lookup_num_tokens is None
            and getattr(generation_config, "assistant_early_exit", None) is None
        )
        if not plain_assisted:
            return original(
                generation_config,
                input_ids,
                inputs_tensor,
                logits_processor,
                model_kwargs,
                assistant_model,
                target_tokenizer,
                assistant_tokenizer,
            )
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"speckv-policy: Hugging Face assisted decoding runs one sequence at a time; got batch size "
                f"{input_ids.shape[0]}. Call generate once per prompt."
            )
        if (generation_config.num_beams or 1) > 1:
            raise ValueError("speckv-policy: assisted decoding does not support beam search (num_beams > 1)")
        return SpeckvCandidateGenerator(
            input_ids=input_ids,
            assistant_model=assistant_model,
            generation_config=generation_config,
            model_kwargs=model_kwargs,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            controller=controller,
        )

    original_generate = target.generate

    @functools.wraps(original_generate)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("assistant_model") is not None:
            gc = kwargs.get("generation_config") or target.generation_config
            beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1
            if beams > 1:
                # transformers would silently run beam search without the assistant
                raise ValueError("speckv-policy: assisted decoding does not support beam search (num_beams > 1)")
        return original_generate(*args, **kwargs)

    _compat.install_candidate_generator(target, _get_candidate_generator)
    target.generate = generate
    return SpeckvHandle(target, controller)
