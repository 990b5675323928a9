"""Offline counterfactual evaluation of gamma policies on logged steps.

Every figure is computed on the held-out prompts' steps whose outcome is known for every
candidate gamma (the step drafted at least ``max_gamma`` tokens, so the accepted length
tells what any gamma up to ``max_gamma`` would have yielded). Per step:

* a policy choosing ``g`` gets ``min(accepted, g) + 1`` tokens in ``cost.step_ms(g)``;
* the **oracle in hindsight** chooses ``g = accepted`` (every drafted token accepted,
  nothing wasted);
* **fixed gamma** ``g`` chooses ``g`` everywhere; the **best fixed gamma** is the one with
  the highest tokens/s on the rows being summarised (chosen in hindsight, per group).

Tokens/s is a throughput: total tokens over total modelled time. Confidence intervals
come from a paired bootstrap over prompts (every step of a resampled prompt comes along,
at every compression level, for every policy and reference alike).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from ..features import features_from_log
from ..objective import CostModel, per_second_scale, rate_label, tokens_credited
from ..replay import replay_features
from ..schema import COMPRESSION_CODES

ChooseFn = Callable[[pd.DataFrame], np.ndarray]

#: How a policy's history features are computed: ``policy`` replays the held-out runs with the policy's own choices
#: (what it sees when it runs, :func:`speckv_policy.replay.replay_features`); ``logged`` takes them from the
#: profile's own steps (which nearly always drafted ``gamma_max``).
HISTORIES: tuple[str, ...] = ("policy", "logged")

#: The reference arm that never drafts: every step a plain target step.
TARGET_ALONE = "fixed-0"


#: Feature sets whose policies decide before any draft token exists (the hook's ``pre`` mode): no probe is priced.
DECIDED_BEFORE_DRAFTING: tuple[str, ...] = ("pre",)
#: Feature sets of gated policies: their choose function returns ``(gamma, gate_open)`` and the probe is priced
#: exactly where the gate opened (the hook's ``gated`` mode).
GATED_SETS: tuple[str, ...] = ("gated",)


@dataclass
class EvalSet:
    """Held-out steps with known outcomes, and features per feature set.

    Attributes
    ----------
    rows : pandas.DataFrame
        ``prompt_id``, ``task_type``, ``compression``, ``decoding``, ``accepted``,
        ``drafted``, ``code`` (compression code) and ``conf_first`` per step.
    features : dict of str to pandas.DataFrame
        Feature matrices aligned with ``rows``, keyed by feature-set name.
    max_gamma : int
        Largest gamma whose outcome every row knows.
    runs : pandas.DataFrame or None
        Every step of the split's runs (the log rows an on-policy replay walks through), indexed like the log.
    log_index : pandas.Index or None
        The log index of each row of ``rows``.
    """

    rows: pd.DataFrame
    features: dict[str, pd.DataFrame] = field(default_factory=dict)
    max_gamma: int = 8
    runs: pd.DataFrame | None = None
    log_index: pd.Index | None = None


def evaluation_set(
    log: pd.DataFrame,
    feature_sets: tuple[str, ...] = ("online", "paper"),
    max_gamma: int = 8,
    split: str = "heldout",
) -> EvalSet:
    """Select the ``split`` steps that drafted at least ``max_gamma`` tokens.

    ``feature_sets`` defaults to the sets every log supports; ``pre`` and
    ``gated`` need a log of schema v2 (:func:`evaluate_log` asks for what its
    policies read). Features are computed over the whole log first (the online state of a step
    depends on the steps before it in its run), then restricted to those rows.

    Raises
    ------
    ValueError
        If no step qualifies.
    """
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    feats = {}
    index = None
    for name in feature_sets:
        X, _, _ = features_from_log(log, name)
        feats[name] = X
        index = X.index if index is None else index.intersection(X.index)
    assert index is not None
    sub = log.loc[index]
    keep = (sub["split"] == split).to_numpy() & (sub["gamma"].to_numpy() >= max_gamma)
    if not keep.any():
        raise ValueError(f"no {split} steps drafted >= {max_gamma} tokens; profile with gamma_max >= {max_gamma}")
    sub = sub[keep]
    rows = pd.DataFrame(
        {
            "prompt_id": sub["prompt_id"].to_numpy(),
            "task_type": sub["task_type"].to_numpy(),
            "compression": sub["compression"].to_numpy(),
            "decoding": sub["decoding"].to_numpy(),
            "accepted": sub["accepted"].to_numpy(np.int64),
            "drafted": sub["gamma"].to_numpy(np.int64),
            "code": sub["compression"].map(COMPRESSION_CODES).to_numpy(np.int64),
            "conf_first": np.array([float(c[0]) for c in sub["draft_confidence"]]),
        }
    )
    features = {k: v.loc[sub.index].reset_index(drop=True) for k, v in feats.items()}
    runs = log[(log["split"] == split).to_numpy()]
    return EvalSet(rows, features, max_gamma, runs=runs, log_index=sub.index)


def policy_choices(
    eval_set: EvalSet, feature_set: str, choose: ChooseFn, history: str = "policy"
) -> tuple[Any, pd.DataFrame]:
    """A policy's output on ``eval_set``'s rows, and the feature rows it decided from.

    ``history='logged'`` asks ``choose`` on the precomputed rows; ``'policy'``
    replays the split's runs with the policy's own choices
    (:func:`~speckv_policy.replay.replay_features`) and returns its choices on the
    evaluated rows, in the same form ``choose`` returns them (``(gamma, gate_open)``
    for a gated set).
    """
    if history not in HISTORIES:
        raise ValueError(f"history must be one of {', '.join(HISTORIES)}, got {history!r}")
    if history == "logged":
        X = eval_set.features[feature_set]
        return choose(X), X
    if eval_set.runs is None or eval_set.log_index is None:
        raise ValueError(
            "an on-policy replay needs the log's runs (an EvalSet from evaluation_set); for hand-made rows "
            "pass history='logged'"
        )
    X, chosen, opened = replay_features(eval_set.runs, feature_set, choose)
    at = X.index.get_indexer(eval_set.log_index)
    if (at < 0).any():  # pragma: no cover - evaluation_set takes its rows from the same features
        raise ValueError("evaluated rows missing from the replay")
    Xe = X.iloc[at].reset_index(drop=True)
    if feature_set in GATED_SETS:
        return (chosen[at], opened[at]), Xe
    return chosen[at], Xe


def step_outcomes(chosen: np.ndarray, rows: pd.DataFrame, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and modelled time (ms or target steps) per step for choices ``chosen``.

    A choice beyond the drafted length is credited ``drafted + 1`` tokens, the
    tokens known for certain (never flattering a longer choice).
    """
    chosen = np.asarray(chosen, dtype=np.int64)
    acc, drafted = rows["accepted"].to_numpy(), rows["drafted"].to_numpy()
    tok = tokens_credited(chosen, acc, drafted)
    return tok.astype(np.float64), cost.step_ms(chosen, rows["code"].to_numpy()).astype(np.float64)


def oracle_choices(rows: pd.DataFrame, max_gamma: int) -> np.ndarray:
    """Per step, the best gamma knowing the outcome: the accepted length (capped)."""
    return np.minimum(rows["accepted"].to_numpy(np.int64), max_gamma)


@dataclass
class Arm:
    """Per-step tokens and time of one strategy (a policy or a reference)."""

    name: str
    tokens: np.ndarray
    time: np.ndarray
    chosen: np.ndarray
    kind: str = "policy"  # "policy", "oracle", "fixed" or "peer" (another adaptive rule)


def throughput(tokens: np.ndarray, time: np.ndarray, unit: str) -> float:
    """Total tokens over total time, per second (``ms``) or per target step."""
    scale = per_second_scale(unit)
    t = float(np.sum(time))
    return scale * float(np.sum(tokens)) / t if t > 0 else float("nan")


def reference_arms(rows: pd.DataFrame, cost: CostModel, max_gamma: int) -> list[Arm]:
    """The oracle in hindsight and fixed gamma 0..max_gamma."""
    arms = []
    g = oracle_choices(rows, max_gamma)
    arms.append(Arm("oracle", *step_outcomes(g, rows, cost), g, kind="oracle"))
    for k in range(max_gamma + 1):
        g = np.full(len(rows), k, dtype=np.int64)
        arms.append(Arm(f"fixed-{k}", *step_outcomes(g, rows, cost), g, kind="fixed"))
    return arms


def summarize(arms: list[Arm], mask: np.ndarray, unit: str, fixed4: str = "fixed-4") -> dict[str, Any]:
    """Tokens/step, tokens/s and ratios for the rows in ``mask``.

    Returns a dict with ``rows``, ``best_fixed`` (name of the best fixed arm on
    these rows) and ``arms``: name -> {tokens_per_step, tokens_per_second,
    mean_gamma, vs_oracle, vs_best_fixed, vs_fixed4, vs_target}. ``vs_target``
    compares with ``fixed-0``, the target alone (every step a plain target step).
    """
    per = {}
    for a in arms:
        per[a.name] = {
            "tokens_per_step": float(np.mean(a.tokens[mask])),
            "tokens_per_second": throughput(a.tokens[mask], a.time[mask], unit),
            "mean_gamma": float(np.mean(a.chosen[mask])),
        }
    fixed = [a.name for a in arms if a.kind == "fixed"]
    best = max(fixed, key=lambda n: per[n]["tokens_per_second"])
    refs = {"vs_oracle": "oracle", "vs_best_fixed": best, "vs_fixed4": fixed4, "vs_target": TARGET_ALONE}
    for v in per.values():
        for key, ref in refs.items():
            v[key] = v["tokens_per_second"] / per[ref]["tokens_per_second"]
    return {"rows": int(mask.sum()), "best_fixed": best, "arms": per}


def paired_bootstrap(
    arms: list[Arm],
    clusters: np.ndarray,
    mask: np.ndarray,
    *,
    n_resamples: int = 10_000,
    seed: int = 0,
    unit: str = "ms",
    fixed4: str = "fixed-4",
    level: float = 0.95,
    pairs: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Paired bootstrap over clusters (prompts) of tokens/s and of ratios.

    Each resample draws prompts with replacement; every arm is evaluated on the
    same resample. ``vs_best_fixed`` compares with the best fixed gamma *of that
    resample* (chosen in hindsight each time, so the comparison never favours a
    policy by fixing the reference on the full sample).

    Returns
    -------
    dict
        name -> {``tokens_per_second_ci``: [lo, hi], ``vs_fixed4``,
        ``vs_best_fixed``, ``vs_target`` (and ``vs_best_peer``; ``vs_pair`` for a policy arm named in
        ``pairs``, against the arm it maps to, with its name as ``reference``): {``ratio``, ``ci``, ``p_value``}}
        for policy arms (references get only their tokens/s interval). The p-value is two-sided
        for "ratio = 1": ``2 (1 + min(#ratio <= 1, #ratio >= 1)) / (B + 1)``,
        capped at 1.
    """
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    codes, inverse = np.unique(np.asarray(clusters)[mask], return_inverse=True)
    n_clusters = len(codes)
    if n_clusters < 2:
        raise ValueError(f"a bootstrap over prompts needs >= 2 prompts, got {n_clusters}")
    rng = np.random.default_rng(seed)
    # resample weights: how often each cluster is drawn, (B, C)
    draws = rng.integers(0, n_clusters, size=(n_resamples, n_clusters))
    weights = np.zeros((n_resamples, n_clusters), dtype=np.float64)
    np.add.at(weights, (np.repeat(np.arange(n_resamples), n_clusters), draws.ravel()), 1.0)
    scale = per_second_scale(unit)

    def per_cluster(x: np.ndarray) -> np.ndarray:
        return np.bincount(inverse, weights=x[mask], minlength=n_clusters)

    tps: dict[str, np.ndarray] = {}
    full: dict[str, float] = {}
    for a in arms:
        tk, tm = per_cluster(a.tokens), per_cluster(a.time)
        tps[a.name] = scale * (weights @ tk) / (weights @ tm)
        full[a.name] = scale * tk.sum() / tm.sum()
    fixed = [a.name for a in arms if a.kind == "fixed"]
    best_full = max(fixed, key=lambda n: full[n])
    best_each = np.max(np.column_stack([tps[n] for n in fixed]), axis=1)
    references = [
        ("vs_fixed4", full[fixed4], tps[fixed4]),
        ("vs_best_fixed", full[best_full], best_each),
        ("vs_target", full[TARGET_ALONE], tps[TARGET_ALONE]),
    ]
    peers = [a.name for a in arms if a.kind == "peer"]
    if peers:
        peer_each = np.max(np.column_stack([tps[n] for n in peers]), axis=1)
        references.append(("vs_best_peer", max(full[n] for n in peers), peer_each))
    pairs = dict(pairs or {})
    unknown = [(a, b) for a, b in pairs.items() if a not in tps or b not in tps]
    if unknown:
        raise ValueError(f"pairs name arms that are not evaluated: {unknown}")
    lo_q, hi_q = (1 - level) / 2, 1 - (1 - level) / 2

    def ratio(name: str, ref_full: float, ref_boot: np.ndarray) -> dict[str, Any]:
        r = tps[name] / ref_boot
        n_le, n_ge = int(np.sum(r <= 1.0)), int(np.sum(r >= 1.0))
        return {
            "ratio": full[name] / ref_full,
            "ci": np.quantile(r, [lo_q, hi_q]).tolist(),
            "p_value": min(1.0, 2.0 * (1 + min(n_le, n_ge)) / (n_resamples + 1)),
        }

    out: dict[str, dict[str, Any]] = {}
    for a in arms:
        d: dict[str, Any] = {"tokens_per_second_ci": np.quantile(tps[a.name], [lo_q, hi_q]).tolist()}
        if a.kind == "policy":
            for key, ref_full, ref_boot in references:
                d[key] = ratio(a.name, ref_full, ref_boot)
            if a.name in pairs:
                ref = pairs[a.name]
                d["vs_pair"] = {"reference": ref, **ratio(a.name, full[ref], tps[ref])}
        out[a.name] = d
    return out


def group_masks(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    """Boolean masks: ``overall``, each compression, each task type, each pair."""
    masks = {"overall": np.ones(len(rows), dtype=bool)}
    comps = [c for c in COMPRESSION_CODES if c in set(rows["compression"])]
    tasks = sorted(set(rows["task_type"]))
    for c in comps:
        masks[c] = (rows["compression"] == c).to_numpy()
    for t in tasks:
        masks[t] = (rows["task_type"] == t).to_numpy()
    for c in comps:
        for t in tasks:
            m = masks[c] & masks[t]
            if m.any():
                masks[f"{c}/{t}"] = m
    return masks


def priced_arms(
    eval_set: EvalSet,
    policies: Mapping[str, tuple[str, ChooseFn]],
    *,
    policy_cost: CostModel,
    reference_cost: CostModel | None = None,
    history: str = "policy",
) -> tuple[list[Arm], dict[str, np.ndarray]]:
    """Every step's tokens and modelled time for the references (oracle, fixed gammas) and each policy.

    The pricing :func:`evaluate` summarises (see there for ``policy_cost``,
    ``reference_cost`` and ``history``): upfront policies pay the probe,
    ``pre`` policies none, gated ones where their gate opened.

    Returns
    -------
    arms : list of Arm
        The references, then one per policy, aligned with ``eval_set.rows``.
    gates : dict of str to numpy.ndarray
        Per gated policy, where its gate opened.
    """
    if history not in HISTORIES:
        raise ValueError(f"history must be one of {', '.join(HISTORIES)}, got {history!r}")
    rows = eval_set.rows
    ref_cost = reference_cost or replace(policy_cost, decision_draft_tokens=0)
    if ref_cost.unit != policy_cost.unit:
        raise ValueError("policy_cost and reference_cost must use the same unit")
    arms = reference_arms(rows, ref_cost, eval_set.max_gamma)
    gates: dict[str, np.ndarray] = {}
    for name, (fs, choose) in policies.items():
        if fs not in eval_set.features:
            raise ValueError(f"policy {name!r} needs feature set {fs!r}, not computed for this evaluation")
        out, _ = policy_choices(eval_set, fs, choose, history)
        opened = None
        if fs in GATED_SETS:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(f"policy {name!r} on feature set {fs!r} must return (gamma, gate_open) per row")
            out, opened = out
        g = np.asarray(out, dtype=np.int64).reshape(-1)
        if g.shape[0] != len(rows):
            raise ValueError(f"policy {name!r} returned {g.shape[0]} choices for {len(rows)} rows")
        if (g < 0).any():
            raise ValueError(f"policy {name!r} returned a negative gamma")
        if opened is not None:  # gated: the probe is paid where the gate opened, nowhere else
            opened = np.asarray(opened, dtype=bool).reshape(-1)
            if opened.shape[0] != len(rows) or (g[~opened] != 0).any():
                raise ValueError(f"policy {name!r}: gate_open must have one entry per row, and a closed gate gamma 0")
            tok, t_probe = step_outcomes(g, rows, replace(policy_cost, decision_draft_tokens=1))
            _, t_plain = step_outcomes(g, rows, replace(policy_cost, decision_draft_tokens=0))
            arms.append(Arm(name, tok, np.where(opened, t_probe, t_plain), g, kind="policy"))
            gates[name] = opened
            continue
        # a policy on the 'pre' features decides before any draft token exists: it never pays a probe
        cost = replace(policy_cost, decision_draft_tokens=0) if fs in DECIDED_BEFORE_DRAFTING else policy_cost
        arms.append(Arm(name, *step_outcomes(g, rows, cost), g, kind="policy"))
    return arms, gates


def evaluate(
    eval_set: EvalSet,
    policies: Mapping[str, tuple[str, ChooseFn]],
    *,
    policy_cost: CostModel,
    reference_cost: CostModel | None = None,
    n_resamples: int = 10_000,
    seed: int = 0,
    history: str = "policy",
    pairs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Evaluate ``policies`` (name -> (feature set, choose function)) on ``eval_set``.

    ``policy_cost`` prices the policies' choices (usually with
    ``decision_draft_tokens=1``: a policy that reads the first draft token pays
    it even when it then chooses 0), except policies on a feature set decided
    before drafting (:data:`DECIDED_BEFORE_DRAFTING`), which pay no probe;
    ``reference_cost`` prices the oracle and fixed gammas (default:
    ``policy_cost`` with ``decision_draft_tokens=0``). ``history`` says where a
    policy's history features come from (:data:`HISTORIES`, :func:`policy_choices`):
    by default the policy's own choices, replayed over the held-out runs.

    Returns
    -------
    dict
        ``groups``: group -> :func:`summarize` result; ``bootstrap``: group ->
        :func:`paired_bootstrap` result for ``overall``, each compression level
        and each task type; ``gamma_histogram``: policy -> compression -> counts
        of gamma 0..max; ``gates``: gated policy -> ``overall`` / compression ->
        fractions of steps whose gate opened (``open``) and that then chose 0
        after paying the probe (``open_then_zero``); ``pairs`` (with ``pairs``,
        policy name -> the policy it is compared with): name -> ``reference`` and
        ``same_choice``, the fraction of steps on which both chose the same gamma,
        ``overall`` and per compression (the paired ratio itself is the bootstrap's
        ``vs_pair``); plus ``rows``, ``prompts``, ``max_gamma``, ``history``.
    """
    if history not in HISTORIES:
        raise ValueError(f"history must be one of {', '.join(HISTORIES)}, got {history!r}")
    bad_pairs = [(a, b) for a, b in (pairs or {}).items() if a not in policies or b not in policies]
    if bad_pairs:
        raise ValueError(f"pairs must name two evaluated policies each, got {bad_pairs}")
    rows = eval_set.rows
    arms, gates = priced_arms(
        eval_set, policies, policy_cost=policy_cost, reference_cost=reference_cost, history=history
    )
    masks = group_masks(rows)
    unit = policy_cost.unit
    result: dict[str, Any] = {
        "rows": len(rows),
        "prompts": int(rows["prompt_id"].nunique()),
        "max_gamma": eval_set.max_gamma,
        "history": history,
        "unit": rate_label(unit),
        "groups": {k: summarize(arms, m, unit) for k, m in masks.items()},
        "bootstrap": {},
        "n_resamples": n_resamples,
    }
    for k, m in masks.items():
        if "/" in k or rows.loc[m, "prompt_id"].nunique() < 2:
            continue
        result["bootstrap"][k] = paired_bootstrap(
            arms, rows["prompt_id"].to_numpy(), m, n_resamples=n_resamples, seed=seed, unit=unit, pairs=pairs
        )
    hist: dict[str, dict[str, list[int]]] = {}
    for a in arms:
        if a.kind != "policy":
            continue
        hist[a.name] = {
            c: np.bincount(a.chosen[masks[c]], minlength=eval_set.max_gamma + 1).tolist()
            for c in COMPRESSION_CODES
            if c in masks
        }
    result["gamma_histogram"] = hist
    # gated policies: how often the gate opened, and how often it then paid the probe for a head that chose 0
    result["gates"] = {
        a.name: {
            c: {
                "open": float(np.mean(gates[a.name][masks[c]])),
                "open_then_zero": float(np.mean(gates[a.name][masks[c]] & (a.chosen[masks[c]] == 0))),
            }
            for c in ("overall", *COMPRESSION_CODES)
            if c in masks
        }
        for a in arms
        if a.name in gates
    }
    chosen = {a.name: a.chosen for a in arms if a.kind == "policy"}
    result["pairs"] = {
        a: {
            "reference": b,
            "same_choice": {
                c: float(np.mean(chosen[a][masks[c]] == chosen[b][masks[c]]))
                for c in ("overall", *COMPRESSION_CODES)
                if c in masks
            },
        }
        for a, b in (pairs or {}).items()
        if a in chosen and b in chosen
    }
    return result


def evaluate_log(
    log: pd.DataFrame,
    policies: Mapping[str, tuple[str, ChooseFn]],
    *,
    policy_cost: CostModel,
    max_gamma: int = 8,
    n_resamples: int = 10_000,
    seed: int = 0,
    history: str = "policy",
    pairs: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], EvalSet]:
    """:func:`evaluation_set` of the log's held-out steps, then :func:`evaluate` — the one offline evaluator.

    ``speckv-eval``, ``speckv-quickstart`` and ``speckv-export --train`` all
    report through this function, so the same policy on the same log gets the
    same figures everywhere: policies pay ``policy_cost`` (the probe token of
    the upfront mode when ``decision_draft_tokens=1``); the oracle, the fixed
    gammas and the target alone (``fixed-0``) pay only what they would pay
    when run (``decision_draft_tokens=0``); a policy's history features are
    its own (``history='policy'``, replayed) unless ``history='logged'``;
    ``pairs`` adds paired ratios between policies (:func:`evaluate`).

    Returns
    -------
    result : dict
        See :func:`evaluate`.
    eval_set : EvalSet
        The rows and features evaluated (for plots).
    """
    needed = tuple(sorted({fs for fs, _ in policies.values()} | {"online"}))
    es = evaluation_set(log, needed, max_gamma=max_gamma)
    result = evaluate(
        es, policies, policy_cost=policy_cost, n_resamples=n_resamples, seed=seed, history=history, pairs=pairs
    )
    return result, es
