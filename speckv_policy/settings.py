"""The hook's advanced settings, in one object shared by ``attach``, the race and the CLIs.

Most users never touch these: ``attach(target, "policy.onnx")`` reads what it
needs from the policy file. :class:`HookSettings` (or a plain dict of its
fields, e.g. ``settings={"max_gamma": 6}``) collects the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["DRAFT_FORWARDS", "DRAFT_LOOPS", "HookSettings"]

#: How the hook drafts: the draft's own cached forward calls, or transformers' ``generate()``.
DRAFT_LOOPS = ("lean", "generate")
#: How the lean loop runs the draft's forward steps.
DRAFT_FORWARDS = ("auto", "transformers")


def _int_or_none(name: str, value: Any, low: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < low:
        raise ValueError(f"settings: {name} must be an int >= {low} or None, got {value!r}")


@dataclass(frozen=True)
class HookSettings:
    """Advanced knobs of :func:`speckv_policy.hf.attach`.

    Parameters
    ----------
    max_gamma : int or None, default=None
        Cap on draft tokens per step; ``None``: the policy's largest candidate
        (a stop rule's own cap; 64 for a fixed gamma).
    fallback_gamma : int or None, default=None
        Gamma used, with one warning, when the policy fails or returns
        nonsense: 0..max_gamma; ``None`` means 4.
    probe_backoff : int, default=0
        ``upfront`` and ``per-token`` modes read the first draft token before
        deciding, so even a gamma-0 decision pays one draft call. With ``B >
        0``, a probe that ends in gamma 0 makes the next ``b`` steps plain
        target steps without a probe, ``b`` doubling (1, 2, 4, ... up to
        ``B``) while probes keep ending in 0, reset once one drafts.
    draft_loop : {'lean', 'generate'}, default='lean'
        ``'lean'`` drafts with the draft's own cached forward calls (drafts it
        cannot serve use ``'generate'``, transformers' own drafting call).
    draft_forward : {'auto', 'transformers'}, default='auto'
        How the lean loop runs the draft's forward steps: ``'auto'`` runs a
        plain Llama draft through the fused decode step, others through their
        own forward.
    record_tokens : bool, default=False
        Keep every sent draft token's confidence, entropy and probability and
        the pre-draft signals in the handle's stats (the profiler does).
    sync_cuda : bool, default=True
        Synchronise CUDA around timings so draft and verify times are exact.
    """

    max_gamma: int | None = None
    fallback_gamma: int | None = None
    probe_backoff: int = 0
    draft_loop: str = "lean"
    draft_forward: str = "auto"
    record_tokens: bool = False
    sync_cuda: bool = True

    def __post_init__(self) -> None:
        _int_or_none("max_gamma", self.max_gamma, 1)
        _int_or_none("fallback_gamma", self.fallback_gamma, 0)
        _int_or_none("probe_backoff", self.probe_backoff, 0)
        if self.probe_backoff is None:
            raise ValueError("settings: probe_backoff must be an int >= 0, got None")
        if self.draft_loop not in DRAFT_LOOPS:
            raise ValueError(
                f"settings: unknown draft_loop {self.draft_loop!r}; expected one of {', '.join(DRAFT_LOOPS)}"
            )
        if self.draft_forward not in DRAFT_FORWARDS:
            raise ValueError(
                f"settings: unknown draft_forward {self.draft_forward!r}; expected one of {', '.join(DRAFT_FORWARDS)}"
            )
        for name in ("record_tokens", "sync_cuda"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"settings: {name} must be True or False, got {getattr(self, name)!r}")
        if (
            self.max_gamma is not None
            and self.fallback_gamma is not None
            and int(self.fallback_gamma) > int(self.max_gamma)
        ):
            raise ValueError(f"settings: fallback_gamma {self.fallback_gamma} exceeds max_gamma {self.max_gamma}")

    @classmethod
    def of(cls, settings: HookSettings | dict[str, Any] | None, **overrides: Any) -> HookSettings:
        """``settings`` as a :class:`HookSettings` (None: the defaults), with ``overrides`` applied.

        Raises
        ------
        ValueError
            For a key that names no setting, or a value out of range.
        TypeError
            For something that is neither a HookSettings, a dict nor None.
        """
        if settings is None:
            base: dict[str, Any] = {}
        elif isinstance(settings, HookSettings):
            base = asdict(settings)
        elif isinstance(settings, dict):
            base = dict(settings)
        else:
            raise TypeError(f"settings must be a HookSettings, a dict or None, got {type(settings).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise ValueError(
                f"settings: unknown {', '.join(map(repr, unknown))}; expected some of {', '.join(sorted(known))}"
            )
        base.update(overrides)
        return cls(**base)
