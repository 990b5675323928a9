"""Run a gamma policy inside Hugging Face assisted generation: :func:`attach` and its handle.

    handle = attach(target, "exported/smollm2-gbt-gated.onnx")
    out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)   # unchanged call
    handle.summary()    # steps, acceptance, draft / verify / decision time
    handle.detach()     # or: with attach(...) as handle: ...

``attach`` swaps the candidate generator of that one model instance (through
:mod:`speckv_policy.hf._compat`, the only place that touches transformers'
private internals) for :class:`~speckv_policy.hf.candidates.SpeckvCandidateGenerator`.
Verification, acceptance (greedy match or rejection sampling) and the target's
cache stay Hugging Face's own code, so the output is the target's whatever
gamma the policy picks.

What decides each step is the policy file's own decision mode
(:mod:`speckv_policy.decisions`): an export knows its feature set (``pre``: decide
before drafting; ``gated``: a gate before drafting and a length head after the
probe token; ``online``: decide after the probe token, ``upfront``, or token by
token with ``mode="per-token"``; ``paper``: ``truncate``), a stop rule's JSON
is ``stop``, an int is a fixed gamma. The hook is split by responsibility:
:mod:`.adapters` (policies as deciders that never raise), :mod:`.controller`
(signals, timing, statistics, live costs), :mod:`.candidates` (the draft loop)
and this module.

This module imports torch and transformers; :mod:`speckv_policy.runtime` does not
import it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from ..decisions import DECLARED_MODE, FIXED_GAMMA_LIMIT, MODES, make_mode
from ..runtime import DEFAULT_FALLBACK_GAMMA, RuntimePolicy
from ..schema import COMPRESSIONS, GATED, ONLINE, PAPER, PRE, get_feature_set
from ..settings import HookSettings
from ..stop import StopRule
from . import _compat
from .adapters import PolicyDecider, RuleDecider, ScheduleDecider, apply_costs
from .candidates import install
from .controller import Controller, StepStats
from .live_costs import LiveCosts

__all__ = ["MODES", "SpeckvHandle", "StepStats", "attach", "detect_compression"]

#: The decision mode each feature set runs in (``online`` also runs ``per-token``, on request).
_MODE_FEATURES = {"upfront": ONLINE, "per-token": ONLINE, "truncate": PAPER, "pre": PRE, "gated": GATED}
#: ``attach`` keywords that moved into :class:`~speckv_policy.settings.HookSettings` (kept for one release).
_LEGACY_SETTINGS = (
    "max_gamma",
    "fallback_gamma",
    "probe_backoff",
    "draft_loop",
    "draft_forward",
    "record_tokens",
    "sync_cuda",
)


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


class SpeckvHandle:
    """Returned by :func:`attach`: statistics and :meth:`detach`.

    Attributes
    ----------
    stats : list of StepStats
        Every step of every assisted ``generate`` call since attaching.
    mode : str
        The decision mode (the one the policy file declares unless ``mode=`` overrode it).
    compression : str
        Compression name fed to the features.
    """

    def __init__(self, target: Any, controller: Controller) -> None:
        self.target = target
        self._controller = controller
        self.mode = controller.mode.name
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
        return dec.runtime if isinstance(dec, PolicyDecider) else None

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


def _is_stop_rule(policy: Any) -> bool:
    """A stop rule or its JSON (a ``.json`` path or a dict)."""
    if isinstance(policy, (StopRule, dict)):
        return True
    return isinstance(policy, (str, os.PathLike)) and os.fspath(policy).lower().endswith(".json")


def _legacy(settings: Any, policy: Any, legacy: dict[str, Any]) -> tuple[HookSettings, Any]:
    """Fold the keywords that moved into ``settings`` (and ``gamma_fn``) in, with one deprecation warning each."""
    unknown = sorted(set(legacy) - {*_LEGACY_SETTINGS, "gamma_fn"})
    if unknown:
        raise TypeError(f"attach() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    moved = {k: v for k, v in legacy.items() if k in _LEGACY_SETTINGS}
    for key in moved:
        warnings.warn(
            f"attach({key}=...) is deprecated and will be removed in the next release; pass "
            f"settings={{{key!r}: ...}} (or a speckv_policy.HookSettings) instead",
            DeprecationWarning,
            stacklevel=3,
        )
    if isinstance(settings, HookSettings):
        settings = asdict(settings)
    clash = sorted(set(moved) & set(settings or {}))
    if clash:
        raise ValueError(f"{', '.join(clash)} given both as a keyword and in settings=; give it once, in settings=")
    if "gamma_fn" in legacy:
        warnings.warn(
            "attach(gamma_fn=...) is deprecated and will be removed in the next release; pass the schedule as the "
            "policy with mode='fixed' (attach(target, gamma_fn, mode='fixed')), or an int for a fixed gamma",
            DeprecationWarning,
            stacklevel=3,
        )
        policy = legacy["gamma_fn"]  # as before: with gamma_fn, the schedule decides
    return HookSettings.of(settings, **moved), policy


def _fixed_schedule(policy: Any, mode: str | None) -> Callable[[int], int] | None:
    """The schedule of a fixed-gamma attach (an int, or a callable with ``mode='fixed'``), else None."""
    if isinstance(policy, (bool, np.bool_)):
        raise TypeError("policy=True/False is not a gamma; pass an int for a fixed gamma")
    if isinstance(policy, (int, np.integer)):
        if mode not in (None, "fixed"):
            raise ValueError(
                f"policy={int(policy)} is a fixed gamma, which decides nothing: it cannot run mode={mode!r}"
            )
        gamma = int(policy)
        if not 0 <= gamma <= FIXED_GAMMA_LIMIT:
            raise ValueError(f"a fixed gamma must be in 0..{FIXED_GAMMA_LIMIT}, got {gamma}")
        return lambda step: gamma
    if mode == "fixed":
        if not callable(policy):
            raise ValueError("mode='fixed' needs an int (a fixed gamma) or a schedule gamma_fn(step) -> int as policy")
        return policy
    return None


def _length_decider(
    policy: Any, mode: str | None, feature_set: str | None, s: HookSettings, fallback: int, repriced: bool
) -> tuple[PolicyDecider, str]:
    """The adapter of a length policy and the mode it runs in (its file's own, unless ``mode`` overrides it)."""
    fs = get_feature_set(feature_set) if feature_set else None
    decider = PolicyDecider(policy, fs, s.max_gamma, fallback, own_runtime=repriced)
    if s.fallback_gamma is not None and s.fallback_gamma > decider.max_gamma:
        raise ValueError(f"fallback_gamma {s.fallback_gamma} exceeds max_gamma {decider.max_gamma}")
    if decider.feature_set is None and decider.load_error is not None:
        # an unreadable policy file: every step falls back anyway (no probe where the mode is not given)
        decider.feature_set = _MODE_FEATURES.get(mode or "pre", ONLINE)
    if decider.feature_set is None:
        raise ValueError(
            "a callable policy needs feature_set= ('online', 'paper', 'pre' or 'gated'): it says what the "
            "callable reads and so when it decides"
        )
    declared = DECLARED_MODE[decider.feature_set.name]
    if mode is None:
        mode = declared
    want = _MODE_FEATURES[mode]
    if decider.feature_set.name != want.name:
        raise ValueError(
            f"this policy reads the {decider.feature_set.name!r} features and runs in mode {declared!r}; "
            f"mode={mode!r} would compute the {want.name!r} features (leave mode= out to run the policy's own)"
        )
    if mode == "gated" and not decider.has_gate:
        raise ValueError(
            "mode='gated' needs a gated policy: an export of speckv-export --feature-set gated, a fitted "
            "GatedPolicy, or a callable with a decide_gate(features) method"
        )
    return decider, mode


def attach(
    target: Any,
    policy: Any = None,
    *,
    mode: str | None = None,
    compression: str | None = None,
    costs: Any = None,
    settings: HookSettings | dict[str, Any] | None = None,
    feature_set: str | None = None,
    **legacy: Any,
) -> SpeckvHandle:
    """Make ``target.generate(..., assistant_model=draft)`` consult a gamma policy.

    Parameters
    ----------
    target : transformers PreTrainedModel
        The verifying model (full precision or bitsandbytes INT8 / NF4).
    policy : path, RuntimePolicy, StopRule, fitted GammaPolicy, callable or int
        Where gamma comes from. An ONNX export (``.onnx`` path or
        :class:`~speckv_policy.runtime.RuntimePolicy`) runs in the mode its
        feature set declares; a stop rule (its ``.json`` path, a dict or a
        :class:`~speckv_policy.stop.StopRule`) runs in ``stop`` mode; an int is
        a fixed gamma. A fitted policy runs in its feature set's mode; a
        callable receives the feature vector and must be told its
        ``feature_set`` (or, with ``mode='fixed'``, is a schedule
        ``gamma_fn(step) -> int``). An unreadable file falls back to the
        fallback gamma on every step, with one warning.
    mode : str or None, default=None
        Override the policy's own decision mode: ``'per-token'`` runs an
        ``online`` policy token by token instead of ``'upfront'``, ``'fixed'``
        makes a callable a schedule. Any other value must match the policy's
        own (see :data:`MODES` and :mod:`speckv_policy.decisions`).
    compression : str or None
        ``fp16``, ``bf16``, ``fp32``, ``int8`` or ``nf4``; ``None`` detects it
        from the target (:func:`detect_compression`).
    costs : None, CostModel, dict, path, 'live' or LiveCosts
        How the policy prices its decisions. ``None``: the cost model it was
        exported with. A cost model (or the JSON ``speckv-calibrate`` writes):
        re-priced for this machine. ``'live'`` (or a
        :class:`~speckv_policy.hf.live_costs.LiveCosts`, e.g. with a
        calibration as its prior): re-priced after every step from the draft
        and verification times this generation measures. Works for ONNX
        exports that maximise tokens per second (a given RuntimePolicy is
        copied, not changed) and for stop rules.
    settings : HookSettings, dict or None
        Advanced knobs (cap and fallback gamma, probe back-off, draft loop and
        forward, recording, CUDA synchronisation): see
        :class:`~speckv_policy.settings.HookSettings`.
    feature_set : str or None
        Feature set of a callable policy (``online``, ``paper``, ``pre`` or ``gated``).
    **legacy
        ``max_gamma``, ``fallback_gamma``, ``probe_backoff``, ``draft_loop``,
        ``draft_forward``, ``record_tokens``, ``sync_cuda`` and ``gamma_fn`` as
        keywords: deprecated (a ``DeprecationWarning``), still honoured for
        one release.

    Returns
    -------
    SpeckvHandle

    Raises
    ------
    ValueError
        For an unknown mode or compression, a mode the policy cannot run, costs
        it cannot take, or (at generate time) batch size > 1 or beam search.
    """
    s, policy = _legacy(settings, policy, legacy) if legacy else (HookSettings.of(settings), policy)
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if compression is None:
        compression = detect_compression(target)
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
    if policy is None:
        raise ValueError(
            "attach needs a policy: an export (.onnx), a stop rule (.json), an int for a fixed gamma, a fitted "
            "policy or a callable"
        )
    fallback = DEFAULT_FALLBACK_GAMMA if s.fallback_gamma is None else int(s.fallback_gamma)
    decider: PolicyDecider | RuleDecider | ScheduleDecider | None = None
    live: LiveCosts | None = None
    schedule = _fixed_schedule(policy, mode)
    if schedule is not None:
        if costs is not None:
            raise ValueError("costs= prices a policy's decisions; a fixed gamma (mode='fixed') decides nothing")
        max_gamma = s.max_gamma or FIXED_GAMMA_LIMIT
        if s.fallback_gamma is not None and fallback > max_gamma:
            raise ValueError(f"fallback_gamma {fallback} exceeds max_gamma {max_gamma}")
        mode = "fixed"
        decider = ScheduleDecider(schedule, max_gamma, fallback)
    elif _is_stop_rule(policy) or mode == "stop":
        if mode not in (None, "stop"):
            raise ValueError(f"a stop rule runs in mode 'stop', not {mode!r} (leave mode= out)")
        mode = "stop"
        decider = RuleDecider(policy, s.max_gamma, fallback, costs)
        if fallback > decider.max_gamma:
            raise ValueError(f"fallback_gamma {s.fallback_gamma} exceeds max_gamma {decider.max_gamma}")
        max_gamma = decider.max_gamma
        live = decider.start_live(compression)  # a stop rule was re-priced as it loaded; live costs start here
    else:
        decider, mode = _length_decider(policy, mode, feature_set, s, fallback, costs is not None)
        max_gamma = decider.max_gamma
        if costs is not None:
            live = apply_costs(decider, costs, compression)
    step_mode = make_mode(mode, decider, compression, max_gamma, probe_backoff=int(s.probe_backoff))
    if _compat.has_installed_candidate_generator(target):
        raise RuntimeError("a speckv policy is already attached to this model; detach() it first")
    controller = Controller(
        step_mode,
        decider,
        compression,
        record_tokens=s.record_tokens,
        sync_cuda=s.sync_cuda,
        live=live,
        draft_loop=s.draft_loop,
        draft_forward=s.draft_forward,
    )
    install(target, controller)
    return SpeckvHandle(target, controller)
