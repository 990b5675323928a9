"""Train policies from a step log: shared by the CLIs and notebooks."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import joblib
import numpy as np
import pandas as pd
from sklearn.base import clone

from .atomic import atomic_write
from .logs import draft_kind
from .objective import CostModel
from .policies import POLICIES, GammaPolicy, GatedPolicy, check_candidates, training_data
from .policies.gated import GATED_FEATURE_SET
from .schema import COMPRESSION_CODES

DEFAULT_FEATURE_SET = {"mlp": "online", "gbt": "online", "table": "online", "fixed": "online", "paper-mlp16": "paper"}


def make_policy(
    kind: str,
    *,
    objective: str | None = None,
    candidates: tuple[int, ...] | None = None,
    cost_model: CostModel | None = None,
    feature_set: str | None = None,
    gamma: int = 4,
) -> GammaPolicy:
    """A policy of ``kind`` (``mlp``, ``gbt``, ``table``, ``fixed``, ``paper-mlp16``).

    ``feature_set='gated'`` makes a :class:`GatedPolicy` whose gate and length
    head are both of ``kind``.

    Options left ``None`` keep each policy's own default (the paper recipe
    keeps its tokens-per-step objective and {2, 4, 6, 8}).
    """
    if kind not in POLICIES:
        raise ValueError(f"unknown policy {kind!r}; expected one of {', '.join(POLICIES)}")
    if feature_set == GATED_FEATURE_SET:  # a gate and a length head, both of this family
        if kind in ("fixed", "paper-mlp16"):
            raise ValueError(f"feature_set='gated' composes two learned policies; {kind!r} is not one")
        part = make_policy(kind, objective=objective, candidates=candidates, cost_model=cost_model)
        gated: dict[str, Any] = {"gate": part, "head": clone(part), "cost_model": cost_model}
        if objective is not None:
            gated["objective"] = objective
        if candidates is not None:
            gated["candidates"] = tuple(int(c) for c in check_candidates(candidates))
        return GatedPolicy(**gated)
    params: dict[str, Any] = {"cost_model": cost_model, "feature_set": feature_set or DEFAULT_FEATURE_SET[kind]}
    if objective is not None:
        params["objective"] = objective
    if kind == "fixed":
        params["gamma"] = gamma
    elif candidates is not None:
        params["candidates"] = tuple(int(c) for c in check_candidates(candidates))
    return POLICIES[kind](**params)


def batch_chooser(policy: GammaPolicy) -> Any:
    """The batch choose function :func:`speckv_policy.evaluation.evaluate` takes for a fitted policy.

    ``policy.predict``, except for a :class:`GatedPolicy`, whose function
    returns ``(gamma, gate_open)`` so that the probe is priced where the gate opens.
    """
    if isinstance(policy, GatedPolicy):
        return policy.predict_with_gate
    return policy.predict


def fit_from_log(
    policy: GammaPolicy, log: pd.DataFrame, split: str | None = "train", *, history_rounds: int = 0
) -> GammaPolicy:
    """Fit ``policy`` on the log's ``split`` steps with its feature set.

    ``history_rounds > 0`` trains on the history the policy itself writes
    (DAgger-style data aggregation): after the first fit, the split's runs are
    replayed with the policy's own choices (:func:`speckv_policy.replay.replay_features`),
    those rows, with the same outcomes, join the training set, and the policy
    is fitted again; once per round. A profile drafts ``gamma_max`` on most
    steps, so its logged history (previous gamma 8, rarely "fully accepted",
    never frozen by a gamma-0 step) is not the history the policy meets when it runs.
    The policy then also carries ``log_fingerprint_`` (of the logged training
    rows; ``training_fingerprint_`` is that of the aggregated rows) and
    ``history_rounds_``, which its export records.
    """
    if history_rounds < 0:
        raise ValueError(f"history_rounds must be >= 0, got {history_rounds}")
    X, y = training_data(log, policy.feature_set, split=split)
    policy.fit(X, y)
    log_fingerprint = policy.training_fingerprint_
    kind = draft_kind(log)  # recorded in the export; the hook warns when the policy runs with another kind of draft
    policy.draft_kind_ = kind
    if history_rounds == 0:
        return policy
    from .replay import HISTORY_SETS, replay_features

    if policy.feature_set not in HISTORY_SETS:
        return policy  # no history features: a replay would give the same rows
    runs = log if split is None else log[(log["split"] == split).to_numpy()]
    labels = pd.DataFrame(y, index=X.index)
    Xs, ys = [X], [y]
    for _ in range(history_rounds):
        Xr, _, _ = replay_features(runs, policy.feature_set, batch_chooser(policy))
        Xs.append(Xr)
        ys.append(labels.loc[Xr.index].to_numpy())
        policy.fit(pd.concat(Xs, ignore_index=True), np.vstack(ys))
    # what an export records besides the fingerprint of the rows it was fitted on: the logged rows they came from
    policy.log_fingerprint_ = log_fingerprint
    policy.history_rounds_ = history_rounds
    policy.draft_kind_ = kind
    return policy


def with_cost_model(policy: GammaPolicy, cost_model: CostModel) -> GammaPolicy:
    """A copy of a fitted policy that decides under ``cost_model`` (its acceptance model unchanged).

    What :class:`~speckv_policy.runtime.RuntimePolicy` does with ``cost_model=``
    and ``speckv-export --reprice`` do to an export, in Python. Tokens-per-step
    policies are returned as copies too (their decisions ignore the cost model).
    ``cost_model`` brings the times; the draft tokens the policy pays before
    deciding (``decision_draft_tokens``: the upfront probe) stay the policy's own.
    """
    import copy

    from sklearn.utils.validation import check_is_fitted

    check_is_fitted(policy)
    cost_model = cost_model.priced_like(getattr(policy, "cost_model_", None))
    out = copy.deepcopy(policy)
    out.cost_model = cost_model
    out.cost_model_ = cost_model
    return out


def save_policy(policy: GammaPolicy, path: str | os.PathLike[str]) -> None:
    """joblib-dump a fitted policy atomically."""
    atomic_write(path, lambda tmp: joblib.dump(policy, tmp))


class UntrustedFileError(ValueError):
    """Loading this file could run code it carries; the caller did not say it trusts it."""


def load_saved_policy(path: str | os.PathLike[str], *, trusted: bool = False) -> GammaPolicy:
    """Load a joblib-saved policy, checking that it is a fitted GammaPolicy.

    A joblib file is a pickle: loading one runs whatever code it carries. So
    this refuses unless ``trusted=True`` (``--trust-pickle`` on the command
    line): load only files you made or trust. To hand a policy to someone,
    give them its ONNX export, which is data.

    Raises
    ------
    UntrustedFileError
        Without ``trusted=True`` (nothing is read).
    FileNotFoundError, ValueError
        A missing file, or one that does not hold a fitted speckv policy.
    """
    from sklearn.utils.validation import check_is_fitted

    if not os.path.exists(path):
        raise FileNotFoundError(f"saved policy not found: {path}")
    if not trusted:
        raise UntrustedFileError(
            f"{path}: a joblib file is a pickle, and loading one runs any code it carries; load only a file you "
            "made or trust (--trust-pickle, or trusted=True), or hand policies over as ONNX exports"
        )
    try:
        obj = joblib.load(path)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable joblib file ({exc})") from exc
    if not isinstance(obj, GammaPolicy):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a speckv gamma policy")
    check_is_fitted(obj)
    return obj


def stop_rule_rows(log: pd.DataFrame, split: str | None = "train") -> dict[tuple[str, str], tuple[Any, ...]]:
    """Per-token training rows of a stop rule, per ``(compression, decoding)``: ``(X_now, y_now, X_next, y_next)``.

    A logged step that drafted ``D`` tokens and accepted the first ``n`` says, of
    each token ``i <= n`` (0-based, ``i < D``) whose predecessors were all
    accepted, whether it was accepted (``i < n``): the ``now`` curve's rows, with
    that token's :func:`~speckv_policy.stop.stop_features`. Of each accepted token
    ``i < n`` with a successor drafted, whether the successor was accepted, from
    token ``i``'s features: the ``next`` curve's rows.

    Raises
    ------
    ValueError
        If the log lacks a column the rows need (named), or a step's per-token arrays
        do not match its ``gamma``.
    """
    from .stop import stop_features

    need = ("compression", "decoding", "accepted", "gamma", "draft_confidence", "draft_entropy", "context_match_len")
    missing = [c for c in need if c not in log.columns]
    if missing:
        raise ValueError(f"a stop rule trains on the per-token columns of a step log; missing: {', '.join(missing)}")
    rows = log if split is None else log[(log["split"] == split).to_numpy()]
    out: dict[tuple[str, str], tuple[Any, ...]] = {}
    for (comp, dec), part in rows.groupby(["compression", "decoding"], sort=True):
        xn, yn, xx, yx = [], [], [], []
        for idx, conf, ent, acc, gam, m in zip(
            part.index,
            part["draft_confidence"],
            part["draft_entropy"],
            part["accepted"],
            part["gamma"],
            part["context_match_len"],
        ):
            conf = [] if conf is None else np.asarray(conf, dtype=np.float64).reshape(-1).tolist()
            ent = [] if ent is None else np.asarray(ent, dtype=np.float64).reshape(-1).tolist()
            if len(conf) != int(gam) or len(ent) != int(gam):
                raise ValueError(
                    f"step log row {idx}: {len(conf)} draft_confidence and {len(ent)} draft_entropy values for "
                    f"gamma {int(gam)} (a stop rule needs the per-token values of every drafted token)"
                )
            n = int(acc)
            for i in range(min(n + 1, len(conf))):
                x = stop_features(conf[i], ent[i], m)
                xn.append(x)
                yn.append(int(i < n))
                if i < n and i + 1 < len(conf):
                    xx.append(x)
                    yx.append(int(i + 1 < n))
        out[(str(comp), str(dec))] = (np.asarray(xn), np.asarray(yn), np.asarray(xx), np.asarray(yx))
    return out


def stop_gate_rows(log: pd.DataFrame, rule: Any, split: str | None = "train") -> dict[tuple[str, str], tuple[Any, Any]]:
    """Training rows of a stop rule's pre-draft gates, per ``(compression, decoding)``: ``(X, gain)``.

    For every logged step that drafted, ``X`` is its :data:`~speckv_policy.stop.GATE_FEATURES`
    (from the run's history before it, as :func:`~speckv_policy.features.features_from_log`
    computes the ``pre`` set) and ``gain`` what the step ``rule`` makes there is worth
    over a plain target step, in the rule's milliseconds: it reads the step's logged
    draft tokens (at most the logged gamma of them) as generation would, sends its
    best prefix, and keeps ``min(sent, accepted)`` tokens, each worth a plain step's
    time times the rule's ``token_value``, less the longer verification and the
    drafting (per call and per token). Steps of a compression and decoding the
    rule has no curves for are left out.

    Raises
    ------
    ValueError
        If the log lacks a column the rows need (named).
    """
    from .features import features_from_log
    from .stop import gate_features

    need = ("run_id", "prompt_id", "step", "split", "compression", "decoding", "temperature", "context_len")
    need += ("gamma", "accepted", "draft_confidence", "draft_entropy", "context_match_len")
    missing = [c for c in need if c not in log.columns]
    if missing:
        raise ValueError(
            f"a stop rule's gate trains on a step log's history (per run, step by step); missing: {', '.join(missing)}"
        )
    X, accepted, drafted = features_from_log(log, "pre")
    steps = log.loc[X.index]
    keep = np.ones(len(steps), dtype=bool) if split is None else (steps["split"] == split).to_numpy()
    walked: dict[tuple[str, str], tuple[list[list[float]], list[tuple[int, int, int]]]] = {}
    has_curves: dict[tuple[str, str], bool] = {}
    for pre, r, acc, gam in zip(
        X.to_numpy(np.float64)[keep].tolist(), steps[keep].itertuples(), accepted[keep], drafted[keep]
    ):
        key = (str(r.compression), str(r.decoding))
        temp = float(r.temperature) if r.decoding == "sampling" else 0.0
        if key not in has_curves:
            try:
                rule.curves_for(key[0], temp)
                has_curves[key] = True
            except KeyError:  # the rule cannot decide there, so a gate has nothing to learn
                has_curves[key] = False
        if not has_curves[key]:
            continue
        st = rule.begin(key[0], temp, int(gam), float(r.context_match_len))
        for conf, ent in zip(r.draft_confidence, r.draft_entropy):
            if not st.after_token(conf, ent):
                break
        xs, outcomes = walked.setdefault(key, ([], []))
        xs.append(gate_features(pre))
        outcomes.append((st.kept, st.drafted, min(st.kept, int(acc))))
    cost = rule.cost_model
    out = {}
    for key, (xs, outcomes) in walked.items():
        sent, drafted_now, kept = np.asarray(outcomes, dtype=np.int64).T
        code = COMPRESSION_CODES[key[0]]
        plain = float(cost.verify_ms(0, code))
        gain = plain * (rule.token_value * kept + 1.0) - cost.verify_ms(sent, code) - cost.draft_ms(drafted_now, code)
        out[key] = (np.asarray(xs, dtype=np.float64), np.asarray(gain, dtype=np.float64))
    return out


def fit_stop_rule(
    log: pd.DataFrame,
    cost_model: CostModel,
    *,
    split: str | None = "train",
    token_value: float = 1.0,
    max_gamma: int = 8,
    C: float = 10.0,
    gate: bool = False,
    source: str = "",
) -> Any:
    """Fit a :class:`~speckv_policy.stop.StopRule` on a step log (logistic regressions).

    One pair of acceptance curves per compression level and decoding the split
    holds with both outcomes among its tokens (see :func:`stop_rule_rows`).
    With ``gate``, then also a pre-draft gate for each of them (see
    :func:`stop_gate_rows`): a logistic regression of whether the rule's step
    beats a plain one, each step weighted by how much it gains or loses, so the
    gate opens where drafting pays in expectation under ``cost_model``'s prices.

    Raises
    ------
    ValueError
        If no (compression, decoding) has rows with both outcomes, or see :func:`stop_rule_rows`.
    """
    from sklearn.linear_model import LogisticRegression

    from .stop import AcceptanceCurve, StopRule

    curves = {}
    rows = {}
    for key, (xn, yn, xx, yx) in stop_rule_rows(log, split).items():
        if len(set(yn.tolist())) < 2 or len(set(yx.tolist())) < 2:
            continue  # one outcome only: nothing to fit
        pair = []
        for X, y in ((xn, yn), (xx, yx)):
            m = LogisticRegression(C=C, max_iter=2000).fit(X, y)
            pair.append(AcceptanceCurve(float(m.intercept_[0]), tuple(float(v) for v in m.coef_[0]), len(y)))
        curves[key] = (pair[0], pair[1])
        rows[f"{key[0]}/{key[1]}"] = len(yn)
    if not curves:
        raise ValueError(
            f"no compression/decoding in the log's {split or 'whole'} split has tokens both accepted and rejected"
        )
    trained_on: dict[str, Any] = {"log": source, "split": split or "all", "tokens": rows}
    rule = StopRule(curves, cost_model, token_value=token_value, max_gamma=max_gamma, trained_on=trained_on)
    return fit_stop_gates(log, rule, split=split, C=C) if gate else rule


def fit_stop_gates(log: pd.DataFrame, rule: Any, *, split: str | None = "train", C: float = 10.0) -> Any:
    """``rule`` with a pre-draft gate per compression and decoding, fitted under its own prices.

    A logistic regression of whether the rule's step beats a plain one (see
    :func:`stop_gate_rows`), each step weighted by how much it gains or loses:
    the gate opens where drafting pays in expectation. A compression and
    decoding the rule has no curves for, or whose steps all gain (or all
    lose), gets no gate (it always drafts).
    """
    from sklearn.linear_model import LogisticRegression

    from .stop import GATE_FEATURES, AcceptanceCurve

    gates = {}
    steps = {}
    for key, (X, gain) in stop_gate_rows(log, rule, split).items():
        if key not in rule.curves or len(set((gain > 0).tolist())) < 2:
            continue
        m = LogisticRegression(C=C, max_iter=5000).fit(X, (gain > 0).astype(int), sample_weight=np.abs(gain) + 1e-9)
        gates[key] = AcceptanceCurve(
            float(m.intercept_[0]), tuple(float(v) for v in m.coef_[0]), len(gain), GATE_FEATURES
        )
        steps[f"{key[0]}/{key[1]}"] = len(gain)
    return replace(rule, gates=gates, trained_on={**rule.trained_on, "gate_steps": steps})
