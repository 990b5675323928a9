"""The end-to-end race's logic: its arms, how runs are summarised and reported.

The race (run by :func:`speckv_policy.hf.race.run_race`, command line
``benchmarks/e2e.py``) times every draft-length strategy inside real Hugging
Face generation. This module holds everything about it that needs neither
torch nor transformers: the arm specifications, the AdaEDL-style rule, the
summary (medians of time per token and of paired per-run ratios), the goals,
the Markdown section, the plot, and which greedy differences are explained.

    .venv/bin/python benchmarks/e2e.py                      # real pair, held-out prompts (CPU: ~40 min)
    .venv/bin/python benchmarks/e2e.py --per-task 1 --repeats 1 --max-new-tokens 16   # a quick look

For each compression level and decoding (greedy; sampling at T = 0.7) it runs, on the
held-out prompts, interleaved (every arm on one prompt, then the next prompt; the arm order
rotates from prompt to prompt so no arm always runs first):

* ``target``: the target alone;
* ``fixed-{2,4,6,8}``: a constant draft length, drafted by the same hook and lean draft loop as
  every policy arm (so "x best fixed" measures the policy, not the drafting machinery);
  ``hf-fixed-4``: gamma 4 in HF's own assisted generation (the draft's ``generate()`` every step,
  confidence stop off), to show what the machinery costs;
* ``hf-default``: HF's defaults (up to 20 draft tokens, stop under draft confidence 0.4, the
  threshold re-tuned online by HF), untouched; ``hf-heuristic``: HF's ``heuristic`` schedule
  (+2 after a fully accepted draft, -1 otherwise; confidence stop off). HF keeps both states
  on the draft model between calls; each arm keeps its own across the prompts of a block,
  as a server would;
* ``sglang-adaptive``: SGLang's adaptive steps (an EMA of accepted length picks a tier in {1, 3, 7}, see
  :class:`SGLangStyleSteps`); ``ema-goodput``: a goodput rule over per-position acceptance EMAs (cold start from
  the profile, see :class:`GoodputEMA`), a proposal for vLLM that vLLM does not ship: its Dynamic SD is one K per
  batch size, at batch 1 a fixed K, which the fixed arms stand for (the vLLM race, ``benchmarks/vllm_race.py``,
  runs the table itself); both decide before drafting;
* ``adaedl``: an AdaEDL-style training-free entropy stop (per-token): stop drafting when
  ``1 - sqrt(0.2 * H)`` falls under ``lambda = 0.5 + 0.3 * (0.5 - ema_acceptance)`` (fixed
  constants, not tuned on the prompts here);
* ``mlp16``: the published MLP16 recipe (tokens-per-step objective; draft 8, keep gamma);
* ours: ``{mlp,gbt,table}-upfront``, ``{mlp,gbt,table}-pertoken`` and ``{mlp,gbt,table}-backoff`` (upfront
  with ``probe_backoff=8``: after a probe that ends in gamma 0, skip probing for 1, 2, 4, 8 steps) from ``exported/``,
  priced as shipped; ``{mlp,gbt,table}-repriced``: the same exports re-priced by a calibration of the machine the race
  runs on (``speckv-calibrate``, run first, as a user would); ``{mlp,gbt,table}-live``: re-priced after every step
  from live estimates of draft and verify times (``attach(..., costs="live")``, kept across the prompts of a block);
  ``{mlp,gbt,table}-pre`` where ``exported/`` holds ``*-pre.onnx``: policies on the ``pre`` features that choose
  gamma before drafting (``attach(..., mode="pre")``), no probe; ``{mlp,gbt,table}-gated`` where it holds
  ``*-gated.onnx``: a pre-draft gate, then a length head after the probe (``attach(..., mode="gated")``); both also
  ``*-repriced`` by the calibration when there is one; ``stop`` (and ``stop-repriced``, and ``stop-live``: its
  prices re-estimated after every step, kept across a block's prompts) where it holds ``stop.json``: the
  cost-aware stop rule (``attach(..., mode="stop")``, :mod:`speckv_policy.stop`);
* ``tag:arm`` (``benchmarks/e2e.py --beside-draft``): an arm run with a second draft in the same race, e.g. the
  best arm on the distilled draft beside every arm on an EAGLE-3 head; each block's ``vs_beside`` compares with the
  fastest of them (:func:`beside_arms`).

Every greedy output is compared with the target's own greedy output for the same prompt;
any difference is reported (and makes the exit status 1). Results: medians of time per output
token over the runs, ratios as medians of per-run ratios against runs of the same prompt and
repeat (so drift cancels). Writes JSON, a plot, and the e2e section of docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_text
from ..peers import SGLangStyleSteps
from ..runtime import RuntimePolicy
from ..schema import COMPRESSION_CODES, ONLINE
from ..stop import StopRule
from .report import save_figure

BEGIN, END = "<!-- e2e:begin -->", "<!-- e2e:end -->"
#: The peers' adaptive rules (the bar the issue sets for ours).
PEER_RULES = ("hf-default", "hf-heuristic", "adaedl", "sglang-adaptive")
#: Arms renamed since races were recorded: recorded name -> name now (``vllm-dynamic`` was never vLLM's rule).
RENAMED_ARMS = {"vllm-dynamic": "ema-goodput"}
OURS = ("mlp", "gbt", "table")
#: Name prefixes of our arms: the policy kinds and the cost-aware stop rule (``stop``, ``stop-repriced``, ``stop-live``).
OURS_PREFIXES = (*OURS, "stop")
ADAEDL_GAMMA, ADAEDL_BASE, ADAEDL_GAIN = 0.2, 0.5, 0.3
BACKOFF = 8  # probe back-off cap of the *-backoff arms (attach(..., probe_backoff=8))


def adaedl_policy(features: Any) -> int:
    """AdaEDL-style stop rule in per-token mode: 2 = keep the token and go on, 0 = drop it and stop."""
    x = np.asarray(features, dtype=np.float64).reshape(-1)
    h = x[ONLINE.names.index("entropy_first")]
    ema = x[ONLINE.names.index("ema_accept_rate")]
    lam = ADAEDL_BASE + ADAEDL_GAIN * (0.5 - ema)
    return 2 if 1.0 - np.sqrt(ADAEDL_GAMMA * max(h, 0.0)) >= lam else 0


class GoodputEMA:
    """A goodput rule from acceptance EMAs over a cost model (proposed for vLLM, not shipped); decides before drafting.

    Keeps per-position acceptance probabilities ``p_k`` (token ``k`` accepted
    given ``k - 1`` were), started from a profile (cold start) and updated
    with an EMA from every verified position; each step picks the ``k`` in
    ``0..max_gamma`` that maximises goodput, ``E[tokens | k] / step_ms(k)``
    with ``E = 1 + sum_j prod_{i <= j} p_i``, under the cost model (the export's
    or a calibration). ``beta`` (0.1) is ours, not tuned on the prompts here.
    """

    def __init__(self, prior: Any, step_ms: Any, beta: float = 0.1) -> None:
        self.p = np.clip(np.asarray(prior, dtype=np.float64), 1e-3, 1 - 1e-3)
        self.step_ms = np.asarray(step_ms, dtype=np.float64)  # for k = 0..max_gamma
        if self.step_ms.shape != (len(self.p) + 1,):
            raise ValueError(f"step_ms needs {len(self.p) + 1} values (k = 0..{len(self.p)}), got {self.step_ms.shape}")
        self.beta = beta

    def observe(self, gamma: int, accepted: int) -> None:
        """Positions 1..accepted were accepted; position accepted + 1 (if drafted) was rejected."""
        for k in range(1, min(accepted + 1, gamma) + 1):
            hit = 1.0 if k <= accepted else 0.0
            self.p[k - 1] = (1 - self.beta) * self.p[k - 1] + self.beta * hit

    def gamma(self) -> int:
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.p))])
        return int(np.argmax(expected / self.step_ms))


def conditional_acceptance(log: Any, compression: str, max_gamma: int = 8) -> np.ndarray:
    """Per position ``k = 1..max_gamma``, the logged ``P(token k accepted | k - 1 accepted)`` (vLLM-style cold start).

    From the log's training split at ``compression``, counting a position only
    where the step drafted it.
    """
    rows = log[(log["split"] == "train") & (log["compression"] == compression)]
    acc, drafted = rows["accepted"].to_numpy(), rows["gamma"].to_numpy()
    p = np.empty(max_gamma)
    for k in range(1, max_gamma + 1):
        reached = (acc >= k - 1) & (drafted >= k)
        p[k - 1] = (np.sum(reached & (acc >= k)) + 1) / (np.sum(reached) + 2)
    return p


class HFHeuristicSchedule:
    """Hugging Face's ``heuristic`` schedule as a history rule (for the every-position replay; the race runs HF's code).

    ``num_assistant_tokens_schedule="heuristic"`` in transformers'
    ``AssistedCandidateGenerator``: +2 draft tokens after a step that kept
    every draft token, -1 (at least 1) after any other, from ``start`` (20, as
    the race's ``hf-heuristic`` arm starts it); the state carries over between
    requests, as HF keeps it on the draft's generation config.
    """

    def __init__(self, start: int = 20) -> None:
        self.value = int(start)

    def observe(self, gamma: int, accepted: int) -> None:
        """A step that drafted ``gamma`` and kept ``accepted``; plain steps (gamma 0) do not occur under this rule."""
        if gamma <= 0:
            return
        self.value = self.value + 2 if accepted == gamma else max(1, self.value - 1)

    def gamma(self) -> int:
        return self.value


class ConstantGamma:
    """The fixed-gamma rule: always ``gamma``, whatever was accepted."""

    def __init__(self, gamma: int) -> None:
        self.value = int(gamma)

    def observe(self, gamma: int, accepted: int) -> None:
        """Nothing to learn."""

    def gamma(self) -> int:
        return self.value


@dataclass
class ArmSpec:
    """One strategy: how to configure the draft and (optionally) attach a policy."""

    name: str
    assistant: bool = True
    hf: dict[str, Any] = field(default_factory=dict)  # draft generation_config fields for HF's own code
    policy: Any = None
    mode: str | None = None
    group: str = "baseline"
    backoff: int = 0
    costs: Any = None  # attach(..., costs=): a calibration file or CostModel (re-priced), "live", or None
    rule: Any = None  # a history rule deciding before drafting: callable(compression) -> object with gamma/observe
    beside: bool = False  # drafts with the race's second draft (RaceConfig.beside_draft), named "tag:arm"


#: Separates a draft's tag from an arm's name: ``draft:gbt-gated-repriced`` is that arm run with the second draft a
#: race carries beside its own (the best arm on another draft, raced in the same run for reference).
BESIDE_SEP = ":"


def beside_arms(arms: list[ArmSpec], tag: str) -> list[ArmSpec]:
    """``arms`` (from :func:`make_arms` for a second draft, the target left out) renamed ``tag:name``, run beside.

    Raises
    ------
    ValueError
        If ``tag`` is empty or holds the separator.
    """
    if not tag or BESIDE_SEP in tag:
        raise ValueError(f"a beside draft's tag must be non-empty and hold no {BESIDE_SEP!r}, got {tag!r}")
    return [replace(a, name=f"{tag}{BESIDE_SEP}{a.name}", beside=True) for a in arms if a.name != "target"]


def make_arms(
    policy_dir: Path,
    prefix: str,
    names: list[str] | None,
    costs: Any = None,
    *,
    peer_log: Any = None,
    peer_costs: Any = None,
    eagle3: bool = False,
) -> list[ArmSpec]:
    """Every arm of the race; ``costs`` (a calibration of this machine) adds the ``*-repriced`` arms.

    ``eagle3``: the draft is an EAGLE-3 head, which transformers' own candidate
    generator cannot run; ``hf-heuristic`` then runs HF's rule through the hook
    (:class:`HFHeuristicSchedule`), and ``hf-fixed-4`` and ``hf-default`` are left out.

    ``peer_log`` (a step log, for the cold start) and ``peer_costs`` (a
    :class:`~speckv_policy.objective.CostModel` without probe) add the
    vLLM-style arm.

    Raises
    ------
    SystemExit
        For an unknown arm name or a missing policy file.
    """
    off = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    arms = [ArmSpec("target", assistant=False)]
    arms += [
        ArmSpec(f"fixed-{g}", mode="fixed", rule=lambda compression, g=g: ConstantGamma(g), group="fixed")
        for g in (2, 4, 6, 8)
    ]
    if eagle3:
        arms.append(ArmSpec("hf-heuristic", mode="fixed", rule=lambda compression: HFHeuristicSchedule()))
    else:
        arms.append(ArmSpec("hf-fixed-4", hf={**off, "num_assistant_tokens": 4}))
        arms.append(
            ArmSpec(
                "hf-default",
                hf={
                    "num_assistant_tokens": 20,
                    "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.4,
                },
            )
        )
        arms.append(
            ArmSpec(
                "hf-heuristic",
                hf={
                    "num_assistant_tokens": 20,
                    "num_assistant_tokens_schedule": "heuristic",
                    "assistant_confidence_threshold": 0.0,
                },
            )
        )
    arms.append(ArmSpec("adaedl", policy=adaedl_policy, mode="per-token"))
    arms.append(ArmSpec("sglang-adaptive", mode="fixed", rule=lambda compression: SGLangStyleSteps()))
    if peer_log is not None and peer_costs is not None:
        arms.append(
            ArmSpec(
                "ema-goodput",
                mode="fixed",
                rule=lambda compression: GoodputEMA(
                    conditional_acceptance(peer_log, compression),
                    peer_costs.time_table(np.arange(9))[COMPRESSION_CODES.get(compression, 0)],
                ),
            )
        )
    arms.append(ArmSpec("mlp16", policy=policy_dir / f"{prefix}paper-mlp16.onnx", mode="truncate"))
    for kind in OURS:
        export = policy_dir / f"{prefix}{kind}.onnx"
        variants: list[tuple[str, dict[str, Any]]] = [
            ("upfront", {"mode": "upfront"}),
            ("pertoken", {"mode": "per-token"}),
            ("backoff", {"mode": "upfront", "backoff": BACKOFF}),
        ]
        if costs is not None:  # the shipped export, re-priced by a calibration of this machine
            variants.append(("repriced", {"mode": "upfront", "costs": costs}))
        variants.append(("live", {"mode": "upfront", "costs": "live"}))
        arms += [ArmSpec(f"{kind}-{tag}", policy=export, group="ours", **kw) for tag, kw in variants]
        for mode in ("pre", "gated"):  # decided before drafting; gated: a gate, then a length head after the probe
            export = policy_dir / f"{prefix}{kind}-{mode}.onnx"
            if export.exists():
                arms.append(ArmSpec(f"{kind}-{mode}", policy=export, group="ours", mode=mode))
                if costs is not None:
                    arms.append(ArmSpec(f"{kind}-{mode}-repriced", policy=export, group="ours", mode=mode, costs=costs))
    stop = policy_dir / f"{prefix}stop.json"
    if stop.exists():  # the cost-aware stop rule (attach(..., mode="stop")), as shipped and re-priced
        arms.append(ArmSpec("stop", policy=stop, group="ours", mode="stop"))
        if costs is not None:
            arms.append(ArmSpec("stop-repriced", policy=stop, group="ours", mode="stop", costs=costs))
        arms.append(ArmSpec("stop-live", policy=stop, group="ours", mode="stop", costs="live"))
    if names:
        unknown = sorted(set(names) - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"e2e: unknown arm(s) {', '.join(unknown)}; known: {', '.join(a.name for a in arms)}")
        arms = [a for a in arms if a.name in names or a.name == "target"]
    loaded: dict[Path, RuntimePolicy | StopRule] = {}
    for a in arms:
        if isinstance(a.policy, Path):
            if not a.policy.exists():
                raise SystemExit(f"e2e: policy file for arm {a.name} not found: {a.policy} (run speckv-quickstart)")
            if a.policy not in loaded:  # load once, not per run
                loaded[a.policy] = StopRule.load(a.policy) if a.mode == "stop" else RuntimePolicy(a.policy)
            a.policy = loaded[a.policy]
    return arms


#: Generation-config fields of the draft that HF's own strategies keep between calls.
HF_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
HF_OWN = ("hf-",)


NEAR_TIE = "near tie"


def unexplained(mismatches: list[str]) -> list[str]:
    """Mismatches that are neither on a prompt where HF's own assisted arms differ too, nor a near tie.

    With a target whose k-token verification is not bit-identical to k single steps (bitsandbytes
    INT8 / NF4 on CPU), assisted decoding can depart from plain greedy. Such a difference is
    explained when HF's own assisted arms (hf-*) differ on the same prompt and repeat too,
    or when :func:`chunking_noise` marked it as a near tie; anything else counts as a failure.
    """
    own = {m.split(" arm ")[0] for m in mismatches if m.split(" arm ")[1].startswith(HF_OWN)}
    return [m for m in mismatches if m.split(" arm ")[0] not in own and f"({NEAR_TIE}:" not in m]


def _paired_ratios(
    by: dict[tuple, dict[str, Any]], pairs: list[tuple], med: dict[str, float], arm: str, ref: str | None
) -> np.ndarray | None:
    """Per (prompt, repeat) pair, ``time per token of ref / time per token of arm`` (None without both arms)."""
    if ref is None or arm not in med or ref not in med:
        return None
    return np.array(
        [
            by[p + (ref,)]["seconds"]
            / max(by[p + (ref,)]["tokens"], 1)
            / (by[p + (arm,)]["seconds"] / max(by[p + (arm,)]["tokens"], 1))
            for p in pairs
            if p + (arm,) in by and p + (ref,) in by
        ]
    )


#: Paired bootstrap resamples over prompts for the race's confidence intervals.
RACE_BOOTSTRAP = 2000


def _ratio_and_ci(ratios: np.ndarray | None, rng: np.random.Generator) -> tuple[float | None, list[float] | None]:
    """Median of the paired ratios and its 95% paired-bootstrap CI over prompts (runs resampled whole)."""
    if ratios is None or len(ratios) == 0:
        return None, None
    med = float(np.median(ratios))
    if len(ratios) < 2:
        return med, None
    draws = rng.integers(0, len(ratios), size=(RACE_BOOTSTRAP, len(ratios)))
    boot = np.median(ratios[draws], axis=1)
    return med, np.quantile(boot, [0.025, 0.975]).tolist()


def _pooled(by: dict[tuple, dict[str, Any]], pairs: list[tuple], arms: list[str]) -> dict[str, Any]:
    """Tokens per second pooled over the runs (total tokens / total time) and paired ratios with bootstrap CIs.

    The statistic ``speckv-eval`` reports offline (:func:`~speckv_policy.evaluation.offline.paired_bootstrap`):
    every resample draws the runs (prompt, repeat) with replacement, the same draw for every arm; ``vs_best_fixed``
    and ``vs_best_peer`` compare with the best fixed gamma / peer rule of the full sample for the ratio and of each
    resample for its CI (the reference is never fixed in the arm's favour). Only arms with a run on every pair.
    """
    have = [a for a in arms if all(p + (a,) in by for p in pairs)]
    if "target" not in have or len(pairs) < 1:
        return {}
    tok = np.array([[float(by[p + (a,)]["tokens"]) for a in have] for p in pairs])
    sec = np.array([[float(by[p + (a,)]["seconds"]) for a in have] for p in pairs])
    full = tok.sum(0) / sec.sum(0)
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(pairs), size=(RACE_BOOTSTRAP, len(pairs)))
    weights = np.zeros((RACE_BOOTSTRAP, len(pairs)))
    np.add.at(weights, (np.repeat(np.arange(RACE_BOOTSTRAP), len(pairs)), draws.ravel()), 1.0)
    boot = (weights @ tok) / (weights @ sec)  # (B, arms)
    col = {a: i for i, a in enumerate(have)}
    fixed = [a for a in have if a.startswith("fixed-")]
    peers = [a for a in have if a in PEER_RULES]
    best_fixed = max(fixed, key=lambda a: full[col[a]]) if fixed else None
    best_peer = max(peers, key=lambda a: full[col[a]]) if peers else None
    refs: dict[str, tuple[float, np.ndarray] | None] = {
        "vs_target": (full[col["target"]], boot[:, col["target"]]),
        "vs_best_fixed": (full[col[best_fixed]], boot[:, [col[a] for a in fixed]].max(1)) if best_fixed else None,
        "vs_best_peer": (full[col[best_peer]], boot[:, [col[a] for a in peers]].max(1)) if best_peer else None,
    }
    out: dict[str, Any] = {"best_fixed": best_fixed, "best_peer": best_peer, "arms": {}}
    for a in have:
        entry: dict[str, Any] = {"tokens_per_second": float(full[col[a]])}
        for key, ref in refs.items():
            if ref is None:
                continue
            r = boot[:, col[a]] / ref[1]
            entry[key] = float(full[col[a]] / ref[0])
            entry[key + "_ci"] = np.quantile(r, [0.025, 0.975]).tolist() if len(pairs) >= 2 else None
        out["arms"][a] = entry
    return out


def summarize_runs(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Medians of ms per output token and of paired ratios, per (compression, decoding[, task]).

    Each cell also carries ``pooled`` (:func:`_pooled`): tokens per second over all of its runs and their ratios,
    the statistic the offline evaluator reports. Arms recorded under an old name (:data:`RENAMED_ARMS`) are read
    under their name now.
    """
    runs = [{**r, "arm": RENAMED_ARMS.get(r["arm"], r["arm"])} for r in runs]
    arms = [RENAMED_ARMS.get(a, a) for a in arms]
    cells: dict[tuple, dict[str, Any]] = {}
    keys = sorted({(r["compression"], r["decoding"]) for r in runs})
    tasks = sorted({r["task_type"] for r in runs})
    for comp, dec in keys:
        for task in [None, *tasks]:
            sel = [
                r
                for r in runs
                if r["compression"] == comp and r["decoding"] == dec and (task is None or r["task_type"] == task)
            ]
            if not sel:
                continue
            by = {(r["prompt_id"], r["repeat"], r["arm"]): r for r in sel}
            pairs = sorted({(r["prompt_id"], r["repeat"]) for r in sel})
            ms = {
                a: [1e3 * by[p + (a,)]["seconds"] / max(by[p + (a,)]["tokens"], 1) for p in pairs if p + (a,) in by]
                for a in arms
            }
            med = {a: float(np.median(v)) for a, v in ms.items() if v}
            fixed = [a for a in med if a.startswith("fixed-")]
            best_fixed = min(fixed, key=lambda a: med[a]) if fixed else None
            peers = [a for a in med if a in PEER_RULES]
            best_peer = min(peers, key=lambda a: med[a]) if peers else None
            besides = [a for a in med if BESIDE_SEP in a]
            best_beside = min(besides, key=lambda a: med[a]) if besides else None

            cell = {"runs_per_arm": len(pairs), "best_fixed": best_fixed, "best_peer": best_peer, "arms": {}}
            if best_beside is not None:
                cell["best_beside"] = best_beside
            for a in med:
                dec_s = sum(by[p + (a,)]["decision_s"] for p in pairs if p + (a,) in by)
                tot_s = sum(by[p + (a,)]["seconds"] for p in pairs if p + (a,) in by)
                entry: dict[str, Any] = {"ms_per_token": med[a], "tokens_per_second": 1e3 / med[a]}
                for key, ref in (
                    ("vs_target", "target"),
                    ("vs_fixed4", "fixed-4"),
                    ("vs_best_fixed", best_fixed),
                    ("vs_hf_default", "hf-default"),
                    ("vs_best_peer", best_peer),
                    *((("vs_beside", best_beside),) if best_beside is not None else ()),
                ):
                    rng = np.random.default_rng(0)  # the same resamples for every arm and reference
                    entry[key], entry[key + "_ci"] = _ratio_and_ci(_paired_ratios(by, pairs, med, a, ref), rng)
                entry["decision_share"] = dec_s / tot_s if tot_s > 0 else 0.0
                cell["arms"][a] = entry
            cell["pooled"] = _pooled(by, pairs, [a for a in arms if a in med])
            cells[(comp, dec, task or "all")] = cell
    return {f"{c}/{d}/{t}": v for (c, d, t), v in cells.items()}


def _fmt_ci(v: dict[str, Any], key: str) -> str:
    """``ratio [lo, hi]`` when the bootstrap CI exists (older JSON has none)."""
    ci = v.get(key + "_ci")
    return _fmt(v.get(key)) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    arms = result["arms"]
    ours = [a for a in arms if a.split("-")[0] in OURS_PREFIXES]
    precision = f" in {cfg['draft_precision']}" if cfg.get("draft_precision") else ""  # runs before it did not say
    linear = cfg.get("target_linear", "default")
    target_linear = f" (float32 linear layers on {linear})" if linear != "default" else ""
    if cfg.get("draft_linear", "default") != "default":
        precision += f", linear layers on {cfg['draft_linear']}"
    if cfg.get("draft_forward") == "fast":  # races before the decode step existed do not say
        precision += ", forward steps through the Llama decode step"
    lines = [
        BEGIN,
        "",
        "## End-to-end wall clock (`benchmarks/e2e.py`)",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Machine: {result['machine']}. Target {cfg['target']}{target_linear}, draft {cfg['draft']}{precision}; {cfg['prompts']} held-out "
        f"prompts ({cfg['per_task']} per task type), {cfg['max_new_tokens']} new tokens, {cfg['repeats']} "
        f"repeat(s), arms interleaved per prompt; {result['minutes']:.1f} min in all. Figures are medians over "
        "runs of time per output token; ratios are medians of per-run ratios against the same prompt's run of "
        "the reference (x target = speed-up over the target alone), with 95% paired bootstrap CIs over prompts "
        f"({RACE_BOOTSTRAP} resamples of the runs, whole).",
        "",
    ]
    cal = result.get("calibration")
    if cal and cal.get("describe"):
        lines += [
            f"Cost model of this machine, measured first (`speckv-calibrate`, {cal['seconds']:.0f} s, "
            f"{cal['steps']} steps; `*-repriced` arms decide with it, ms per compression code):",
            "",
        ]
        lines += [f"- {d}" for d in cal["describe"]] + [""]
    elif cal and cal.get("file"):
        lines += [f"`*-repriced` arms decide with the calibration in `{cal['file']}`.", ""]
    for key, cell in result["summary"].items():
        comp, dec, task = key.split("/")
        if task != "all":
            continue
        bf = cell["best_fixed"]
        bp = cell.get("best_peer")
        lines += [
            f"### {comp}, {dec} (best fixed gamma: {bf.split('-')[1] if bf else '-'}; best peer rule: {bp or '-'})",
            "",
            "| arm | tokens/s | ms/token | x target [95% CI] | x fixed 4 | x best fixed [95% CI] | x best peer [95% CI] "
            "| x HF default | decision share |",
            "|---|---:|---:|---|---:|---|---|---:|---:|",
        ]
        for a in arms:
            v = cell["arms"].get(a)
            if v is None:
                continue
            name = f"**{a}**" if a in ours else a
            share = f"{100 * v['decision_share']:.2f}%" if a in ours or a in ("mlp16", "adaedl") else ""
            lines.append(
                f"| {name} | {v['tokens_per_second']:.2f} | {v['ms_per_token']:.1f} | {_fmt_ci(v, 'vs_target')} | "
                f"{_fmt(v['vs_fixed4'])} | {_fmt_ci(v, 'vs_best_fixed')} | {_fmt_ci(v, 'vs_best_peer')} | "
                f"{_fmt(v['vs_hf_default'])} | {share} |"
            )
        lines.append("")
        pooled = cell.get("pooled") or {}
        if pooled.get("arms"):
            pbf, pbp = pooled.get("best_fixed"), pooled.get("best_peer")
            lines += [
                f"Pooled over the runs (total tokens / total time, the statistic `speckv-eval` reports; best fixed "
                f"gamma {pbf.split('-')[1] if pbf else '-'}, best peer rule {pbp or '-'}, each re-chosen in every "
                "resample for the CIs):",
                "",
                "| arm | tokens/s | x target [95% CI] | x best fixed [95% CI] | x best peer [95% CI] |",
                "|---|---:|---|---|---|",
            ]
            for a in arms:
                v = pooled["arms"].get(a)
                if v is None:
                    continue
                name = f"**{a}**" if a in ours else a
                lines.append(
                    f"| {name} | {v['tokens_per_second']:.2f} | {_fmt_ci(v, 'vs_target')} | "
                    f"{_fmt_ci(v, 'vs_best_fixed')} | {_fmt_ci(v, 'vs_best_peer')} |"
                )
            lines.append("")
    for dec in race_decodings(result):  # one table per decoding the race ran
        tasks = sorted({k.split("/")[2] for k in result["summary"] if k.split("/")[1] == dec} - {"all"})
        if not tasks:
            continue
        lines += [
            f"### x target alone by task type ({dec})",
            "",
            "| arm | " + " | ".join(f"{c}/{t}" for c in cfg["compressions"] for t in tasks) + " |",
            "|---|" + "---:|" * (len(cfg["compressions"]) * len(tasks)),
        ]
        for a in arms:
            cells = []
            for c in cfg["compressions"]:
                for t in tasks:
                    v = result["summary"].get(f"{c}/{dec}/{t}", {}).get("arms", {}).get(a)
                    cells.append(_fmt(v["vs_target"]) if v else "")
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    if result.get("goals"):  # what a benchmark judged the race by (benchmarks/e2e.py), if anything
        lines += ["### Goals (printed, not unit tests)", ""] + [f"- {g}" for g in result["goals"]] + [""]
    lines += ["### Greedy outputs", ""]
    if result["mismatches"]:
        bad = unexplained(result["mismatches"])
        lines.append(
            f"{len(result['mismatches'])} greedy run(s) differ from the target's own greedy output; "
            f"{len(bad)} of them unexplained, i.e. neither on a prompt where HF's own assisted arms "
            "(hf-*) differ too nor a near tie (the target's own logit gap there no larger than "
            "the change a multi-token pass makes to its logits): a target whose multi-token verification "
            "is not bit-identical to single steps, see docs/reference/hook.md:"
        )
        lines += [f"- {m}" for m in result["mismatches"][:30]]
    else:
        lines.append("Every greedy run produced exactly the target's own greedy output.")
    lines += ["", f"![speed-up over the target alone]({result['plot']})", "", END]
    return "\n".join(lines)


def race_decodings(result: dict[str, Any]) -> list[str]:
    """The decodings a race ran: its config's, or (an older result) those its summary has, greedy first."""
    if result["config"].get("decodings"):
        return list(result["config"]["decodings"])
    seen = {k.split("/")[1] for k in result["summary"]}
    return [d for d in ("greedy", "sampling") if d in seen]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = result["config"]["compressions"]
    decs = result["config"]["decodings"]
    arms = [a for a in result["arms"] if a != "target"]
    fig, axes = plt.subplots(
        1, len(decs), figsize=(7 * len(decs), 0.3 * len(arms) * len(comps) / 2 + 2.5), squeeze=False, sharey=True
    )
    for ax, dec in zip(axes[0], decs):
        y = np.arange(len(arms))
        h = 0.8 / len(comps)
        for i, comp in enumerate(comps):
            cell = result["summary"].get(f"{comp}/{dec}/all", {"arms": {}})
            vals = [cell["arms"].get(a, {}).get("vs_target") or 0 for a in arms]
            ax.barh(y + (i - (len(comps) - 1) / 2) * h, vals, h, label=comp)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(y, arms)
        ax.invert_yaxis()
        ax.set(title=f"{dec}: speed-up over the target alone (median paired ratio)", xlabel="x target")
        ax.grid(alpha=0.3, axis="x")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def write_section(doc: Path, section: str) -> None:
    """Replace the e2e section of ``doc`` (or append it), atomically."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(doc, text)
