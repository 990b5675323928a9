"""The hook's per-``attach`` controller: signals, timing, statistics and live costs around a decision mode.

The decisions themselves are :mod:`speckv_policy.decisions`' mode classes (the
same ones the dense replay walks); the controller computes what they read from
the running generation (the feature state, the context's self-repetition, each
draft token's statistics from its logits), times every step and records it as
a :class:`StepStats`.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..decisions import DecisionMode, StopMode
from ..features import (
    ContextMatcher,
    OnlineFeatureState,
    draft_token_confidence_one,
    draft_token_stats_from_logits,
    draft_token_stats_one,
)
from ..runtime import PolicyFallbackWarning
from .adapters import PolicyDecider, RuleDecider, ScheduleDecider
from .live_costs import LiveCosts

__all__ = ["Controller", "StepStats"]


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


def _confidence_and_no_entropy(logits: torch.Tensor) -> tuple[float, float]:
    """A draft token's top-1 probability and 0.0 for its entropy: for a policy whose decisions do not read it."""
    return draft_token_confidence_one(logits), 0.0


def _no_token_stats(logits: torch.Tensor) -> tuple[float, float]:
    """0.0 for a draft token's top-1 probability and entropy: for a policy whose decisions read neither."""
    return 0.0, 0.0


class Controller:
    """Per-``attach`` decision bookkeeping, shared by every generate call.

    Parameters
    ----------
    mode : DecisionMode
        What decides each step's length.
    decider : PolicyDecider, RuleDecider or None
        The policy adapter the mode asks (None: a fixed schedule).
    compression : str
        Compression name the features carry.
    record_tokens : bool
        Record every sent draft token's statistics and the pre-draft signals (the profiler).
    sync_cuda : bool
        Synchronise CUDA around timings.
    live : LiveCosts or None
        Running cost estimates to refresh after each step.
    draft_loop, draft_forward : str
        How the candidate generator drafts (see :func:`speckv_policy.hf.attach`).
    """

    def __init__(
        self,
        mode: DecisionMode,
        decider: PolicyDecider | RuleDecider | ScheduleDecider | None,
        compression: str,
        *,
        record_tokens: bool = False,
        sync_cuda: bool = True,
        live: LiveCosts | None = None,
        draft_loop: str = "lean",
        draft_forward: str = "auto",
    ) -> None:
        self.mode = mode
        self.decider = decider
        self.compression = compression
        self.record_tokens = record_tokens
        self.sync_cuda = sync_cuda
        self.live = live
        self.draft_loop = draft_loop
        self.draft_forward = draft_forward
        self.draft_loop_used = ""
        self.draft_forward_used = ""
        self.max_gamma = mode.max_gamma
        self.stats: list[StepStats] = []
        self.generations = 0
        self.step = 0
        self.state: OnlineFeatureState | None = None
        self.current: StepStats | None = None
        self._t0 = 0.0  # when the current step began
        self._verify_t0 = 0.0  # when its verification began
        self._device: torch.device | None = None
        # the pre-draft signals: computed when the mode reads them or a profile records them
        self.signals = record_tokens or mode.reads_pre
        # the target's confidence and entropy at the last verified position: logged by a profile (log schema v2),
        # read by no feature set since 'pre' v3, so a run that records nothing does not pay for them
        self.target_signals = record_tokens
        self._signal_us = 0.0  # time spent on them after the last verification, charged to the next decision
        self._matcher = ContextMatcher()  # context_match_len, kept incrementally over a generation
        self._warned_draft_kind = False
        runtime = decider.runtime if isinstance(decider, PolicyDecider) else None
        # ... scanned only where it is logged, the stop rule reads it, or the policy's decisions can depend on it
        reads = runtime.read_features if runtime is not None else None
        self._scan_context = self.signals and (
            record_tokens or isinstance(mode, StopMode) or reads is None or "context_match_len" in reads
        )
        self._match_len = 0  # this step's context_match_len where scanned, else 0 (a value the policy ignores)
        # a draft token's statistics, only what the policy reads (its top-1 probability alone: half the work)
        self._token_stats: Callable[[torch.Tensor], tuple[float, float]] = draft_token_stats_one
        if reads is not None and "entropy_first" not in reads:
            self._token_stats = _confidence_and_no_entropy if "conf_first" in reads else _no_token_stats

    def check_draft_kind(self, kind: str) -> None:
        """Warn once if the policy was trained on steps of another kind of draft (``'eagle3'`` or ``'model'``)."""
        runtime = self.decider.runtime if isinstance(self.decider, PolicyDecider) else None
        trained = runtime.metadata.get("speckv.draft_kind", "") if runtime is not None else ""
        if trained in ("eagle3", "model") and trained != kind and not self._warned_draft_kind:
            self._warned_draft_kind = True
            what = {"eagle3": "an EAGLE-3 head", "model": "a draft model"}
            warnings.warn(
                f"speckv-policy: {runtime.path} was trained on steps drafted by {what[trained]}, but this generate "
                f"call drafts with {what[kind]}: its acceptance estimates do not transfer (retrain it on a profile "
                "of this draft)",
                PolicyFallbackWarning,
                stacklevel=4,
            )

    # -- sequence / step bookkeeping --------------------------------------
    def begin(self, generation_config: Any, device: torch.device) -> None:
        """A generate call starts: a fresh feature state and context scan."""
        temp = float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0
        self.state = OnlineFeatureState(self.compression, temp)
        self.mode.start(self.state)
        self._matcher.reset()
        self.generations += 1
        self.step = 0
        self._device = device
        self._signal_us = 0.0

    def clock(self) -> float:
        """``time.perf_counter()``, after a CUDA synchronisation where asked."""
        if self.sync_cuda and self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def start_step(self, input_ids: torch.Tensor, budget: int) -> int:
        """Open the step's stats, compute the signals the mode reads and plan: returns the step's draft cap."""
        self._t0 = self.clock()
        cur = input_ids.shape[-1]
        step = self.current = StepStats(
            generation=self.generations, step=self.step, context_len=cur, gamma=0, drafted=0
        )
        if self.signals:
            assert self.state is not None
            t = time.perf_counter()
            if self._scan_context:
                self._matcher.sync(input_ids)
                self._match_len = self._matcher.match_len()
                step.context_match_len = float(self._match_len)
            if self.target_signals:
                step.target_confidence = self.state.target_confidence
                step.target_entropy = self.state.target_entropy
            step.signals_us = (time.perf_counter() - t) * 1e6 + self._signal_us
            step.decision_us += step.signals_us
            self._signal_us = 0.0
        t = time.perf_counter()
        cap = self.mode.plan(self.step, cur, self._match_len, budget)
        step.decision_us += (time.perf_counter() - t) * 1e6
        step.fallback = self.mode.fell_back
        step.skipped = self.mode.skipped
        return cap

    def on_draft_token(self, k: int, logits: torch.Tensor, context_len: int) -> bool:
        """Called after draft token ``k`` (1-based) in the modes that ask per token; returns True to stop drafting."""
        mode = self.mode
        if not mode.reads_token(k):
            return mode.after_token(k, None, context_len)
        t = time.perf_counter()
        stop = mode.after_token(k, self._token_stats(logits), context_len)
        assert self.current is not None
        self.current.decision_us += (time.perf_counter() - t) * 1e6
        return stop

    def finish_draft(self, ids: torch.Tensor, logits: torch.Tensor, start: int) -> int:
        """The draft is done: how many of its tokens to verify (recorded, with the draft's time)."""
        step = self.current
        assert step is not None
        t = time.perf_counter()
        gamma = self.mode.finish(int(logits.shape[1]), lambda: _numpy_stats(logits))
        step.decision_us += (time.perf_counter() - t) * 1e6
        step.fallback = self.mode.fell_back
        step.drafted = int(logits.shape[1])
        step.gamma = int(gamma)
        if self.record_tokens and gamma > 0:
            self._record_tokens_of(ids, logits[:, :gamma], start)
        return int(gamma)

    def start_verification(self, drafted: bool = True) -> None:
        """The draft goes to the target now: the draft's time ends here (a plain step, ``drafted=False``, has none)."""
        self._verify_t0 = self.clock()
        assert self.current is not None
        if drafted:
            self.current.draft_ms = (self._verify_t0 - self._t0) * 1e3

    def _record_tokens_of(self, ids: torch.Tensor, logits: torch.Tensor, start: int) -> None:
        assert self.current is not None
        lg = logits[0].float()
        conf, ent = draft_token_stats_from_logits(lg)
        probs = lg.softmax(-1)
        tok = ids[0, start : start + lg.shape[0]]
        self.current.draft_confidence = conf.tolist()
        self.current.draft_entropy = ent.tolist()
        self.current.draft_token_prob = probs[torch.arange(lg.shape[0], device=probs.device), tok].tolist()

    def observe_verification(self, scores: torch.Tensor, num_matches: int) -> None:
        """When recording: the target's confidence and entropy at the last verified position, for the next step."""
        if not self.target_signals or self.state is None:
            return
        t = time.perf_counter()
        pos = min(int(num_matches), scores.shape[1] - 1)
        self.state.observe_target(*draft_token_stats_one(scores[0, pos]))
        self._signal_us = (time.perf_counter() - t) * 1e6

    def end_step(self, num_matches: int) -> None:
        """The target verified the step: record it, update the history and the live prices."""
        cur = self.current
        if cur is None:
            return
        cur.verify_ms = (self.clock() - self._verify_t0) * 1e3
        cur.accepted = int(min(num_matches, cur.gamma))
        assert self.state is not None
        self.state.update(cur.gamma, cur.accepted)
        self.mode.end_step(cur.gamma, cur.accepted)
        self.stats.append(cur)
        if self.live is not None and self.decider is not None and cur.step > 0:  # step 0 also ran the prefill
            self._refresh_live(cur)
        self.current = None
        self.step += 1

    def _refresh_live(self, cur: StepStats) -> None:
        assert self.live is not None
        try:
            if isinstance(self.decider, RuleDecider):
                self.decider.refresh(cur.drafted, cur.draft_ms, cur.gamma, cur.verify_ms)
            elif self.decider is not None and self.decider.runtime is not None:
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


def _numpy_stats(logits: torch.Tensor) -> tuple[Any, Any]:
    """Every drafted token's top-1 probability and entropy as numpy arrays."""
    conf, ent = draft_token_stats_from_logits(logits[0])
    return conf.cpu().numpy(), ent.cpu().numpy()
