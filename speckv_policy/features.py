"""Feature computation: ONE module for run time and for offline logs.

At run time a hook calls :func:`draft_token_stats_one` on the draft's processed
next-token scores (numpy array or torch tensor) and keeps an
:class:`OnlineFeatureState` per sequence. Offline, :func:`features_from_log`
replays the logged steps through the very same state class, so a policy sees
identical definitions during training and serving.

Module level imports numpy only; torch and pandas are imported lazily where a
caller hands them in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .schema import (
    ACCEPT_DECAY,
    ACCEPT_PRIOR,
    CONTEXT_MATCH_CAP,
    GATED,
    ONLINE,
    PAPER,
    PRE,
    PRE_SIGNAL_COLUMNS,
    FeatureSet,
    compression_code,
    get_feature_set,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

LN2 = math.log(2.0)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def draft_token_stats(probs: Any) -> tuple[Any, Any]:
    """Top-1 probability and entropy (nats) of next-token distributions.

    Parameters
    ----------
    probs : array-like or torch.Tensor of shape (..., vocab)
        Probabilities (already processed by temperature / top-k / top-p, the
        way the verifier sees them). Rows need not be perfectly normalised;
        they are renormalised.

    Returns
    -------
    confidence, entropy : same type as ``probs``, shape (...)
        Top-1 probability and Shannon entropy in nats.
    """
    if _is_torch(probs):
        p = probs.detach().float()
        p = p / p.sum(-1, keepdim=True)
        conf = p.max(-1).values
        logp = p.clamp_min(1e-30).log()
        ent = (-(p * logp).sum(-1)).clamp_min(0.0)
        return conf, ent
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum(axis=-1, keepdims=True)
    conf = p.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    return conf, np.maximum(ent, 0.0)


def draft_token_stats_from_logits(logits: Any) -> tuple[Any, Any]:
    """Like :func:`draft_token_stats` but from (processed) logits.

    ``-inf`` entries (tokens removed by top-k / top-p) are handled exactly.
    Logits on the CPU (a torch tensor or an array) go through
    :func:`_logit_stats`, the same numpy code :func:`draft_token_stats_one`
    runs per draft token, so logged and run-time values are the same numbers.
    """
    if _is_torch(logits):
        if logits.device.type != "cpu":  # stays on the device: two reductions, no copy to the host
            p = logits.detach().float().softmax(-1)
            return p.amax(-1), (-p.xlogy(p).sum(-1)).clamp_min(0.0)
        f, z = _own_float32(logits)
        conf, ent = _logit_stats(z)
        return f.new_tensor(conf), f.new_tensor(ent)  # float32 tensors, without importing torch here
    return _logit_stats(np.array(logits, dtype=np.float32))


def draft_token_stats_one(logits: Any) -> tuple[float, float]:
    """Top-1 probability and entropy (nats) of ONE next-token distribution, as floats.

    The per-draft-token path of the hook: on the CPU, numpy on a float32
    copy of the scores (one max, one exp, two sums; no softmax, no log per
    entry, no BLAS call), which right after the draft's forward pass is
    cheaper than torch's softmax and ``xlogy`` (the stop rule's decision per
    draft token: -19%, docs/design.md). Equal to the matching row of
    :func:`draft_token_stats_from_logits`.

    Parameters
    ----------
    logits : torch.Tensor or array-like of shape (vocab,)
        Processed logits of one position (``-inf`` for removed tokens).
    """
    if _is_torch(logits):
        if logits.device.type != "cpu":
            conf, ent = draft_token_stats_from_logits(logits)
            return float(conf), float(ent)
        z = _own_float32(logits)[1]
    else:
        z = np.array(logits, dtype=np.float32)
    conf, ent = _logit_stats(z)
    return float(conf), float(ent)


def draft_token_confidence_one(logits: Any) -> float:
    """Top-1 probability of ONE next-token distribution: :func:`draft_token_stats_one`'s first value, bit for bit.

    For a policy that reads no entropy (``RuntimePolicy.read_features``): one max, one subtraction, one exp and one
    sum over the scores, about half the work, without the clamp the entropy needs (``exp`` of a score below the clamp
    is 0 either way, so the sum and its inverse are the same float32 numbers).
    """
    if _is_torch(logits):
        if logits.device.type != "cpu":
            return draft_token_stats_one(logits)[0]
        src = logits.detach().float().numpy()  # only read
    else:
        src = np.asarray(logits, dtype=np.float32)
    return float(1.0 / np.exp(np.subtract(src, src.max(axis=-1, keepdims=True))).sum(axis=-1))


def _own_float32(logits: Any) -> tuple[Any, np.ndarray]:
    """CPU torch scores as float32: the tensor, and a numpy copy :func:`_logit_stats` may overwrite (never the
    caller's scores)."""
    f = logits.detach().float()  # a new tensor unless the scores are float32 already
    z = f.numpy()
    return f, (z.copy() if f.data_ptr() == logits.data_ptr() else z)


#: Scores this far below the top one are exactly 0 after ``exp`` in float32 (it underflows below about -104), so
#: clamping there changes no probability and keeps ``0 * -inf`` out of the entropy.
_FLOOR = -200.0


def _logit_stats(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 probability ``1 / Z`` and entropy ``log Z - sum(e^z z) / Z`` of float32 scores ``z`` (..., vocab),
    ``z`` shifted so its maximum is 0 and ``Z = sum(e^z)``. Works on ``z`` in place (the caller's own copy)."""
    np.subtract(z, z.max(axis=-1, keepdims=True), out=z)
    np.maximum(z, _FLOOR, out=z)
    e = np.exp(z)
    total = e.sum(axis=-1)
    np.multiply(e, z, out=z)
    ent = np.log(total) - z.sum(axis=-1) / total
    return 1.0 / total, np.maximum(ent, 0.0)


def context_match_len(ids: Any, cap: int = CONTEXT_MATCH_CAP) -> int:
    """Longest ``k <= cap`` such that the last ``k`` tokens of ``ids`` also occur earlier in ``ids``.

    The prompt-lookup match length: how much of the context's tail repeats
    something already in the context (code repeats names, summaries repeat the
    passage). Works for any draft; O(len(ids)) per call. One-shot form of
    :class:`ContextMatcher`, which the hook keeps incrementally over a generation.

    Parameters
    ----------
    ids : sequence of int, ndarray or torch.Tensor
        Token ids of one sequence (a leading batch dimension of 1 is allowed).
    cap : int
        Longest match looked for.

    Returns
    -------
    int
        0 when the last token never occurred before.
    """
    if _is_torch(ids):
        ids = ids.detach().cpu().reshape(-1).tolist()
    matcher = ContextMatcher(cap)
    matcher.extend(np.asarray(ids, dtype=np.int64).reshape(-1).tolist())
    return matcher.match_len()


class ContextMatcher:
    """:func:`context_match_len` of one growing sequence, kept incrementally in pure Python.

    The hook asks for the match length once per step, right after the target's
    forward pass, when numpy's code and data are cold (~90 us per call there
    against ~3 us back to back). This keeps the sequence as a list and, per
    token, where it occurred; a step then reads only the new tokens and checks
    the earlier occurrences of the last one. :func:`context_match_len` is its
    one-shot form (tested against a brute force on random sequences).

    Parameters
    ----------
    cap : int
        Longest match looked for.
    """

    def __init__(self, cap: int = CONTEXT_MATCH_CAP) -> None:
        self.cap = int(cap)
        self.seq: list[int] = []
        self.where: dict[int, list[int]] = {}

    def extend(self, tokens: Any) -> None:
        """Append token ids (a list of int) to the sequence."""
        seq, where = self.seq, self.where
        for t in tokens:
            where.setdefault(t, []).append(len(seq))
            seq.append(t)

    def reset(self) -> None:
        """Forget the sequence (a new generation)."""
        self.seq, self.where = [], {}

    def sync(self, ids: Any) -> None:
        """Make the kept sequence equal ``ids`` (a 1 x n tensor or array), reading only what is new.

        ``ids`` must extend the sequence kept since the last :meth:`reset` (a
        generation's context only grows); only its new tokens are read. One that
        is shorter, or whose token at the kept end differs, is read whole.
        """
        two_d = len(ids.shape) == 2
        n, have = int(ids.shape[-1]), len(self.seq)
        if 0 < have <= n:
            # one overlapping token: is the kept sequence still a prefix? (one indexing op: each starts cold here)
            new = (ids[0, have - 1 :] if two_d else ids[have - 1 :]).tolist()
            if new[0] == self.seq[-1]:
                self.extend(new[1:])
                return
        self.reset()
        self.extend((ids[0] if two_d else ids).tolist())

    def match_len(self) -> int:
        """Longest ``k <= cap`` such that the sequence's last ``k`` tokens also occur earlier (0 if none)."""
        seq, cap = self.seq, self.cap
        n = len(seq)
        if n < 2 or cap < 1:
            return 0
        best = 0
        for j in self.where[seq[-1]][:-1]:  # earlier occurrences of the last token (ends of a match)
            m = 1
            while m < cap and m <= j and seq[j - m] == seq[n - 1 - m]:
                m += 1
            if m > best:
                best = m
                if best == cap:
                    break
        return best


class OnlineFeatureState:
    """Per-sequence state behind the ``online`` feature set.

    Parameters
    ----------
    compression : str
        Target compression name (``fp16``, ``bf16``, ``fp32``, ``int8``, ``nf4``).
    temperature : float, default=0.0
        Sampling temperature; 0 for greedy decoding.

    Notes
    -----
    The acceptance features are per-token rates, so they mean the same thing
    whatever gamma produced them: a step that drafted ``g`` tokens and accepted
    ``n`` contributes ``n`` acceptances and ``1`` rejection when ``n < g``.
    Steps that drafted nothing (gamma 0) leave the state unchanged.
    """

    __slots__ = (
        "code",
        "temperature",
        "prev_rate",
        "ema_acc",
        "ema_rej",
        "prev_accepted",
        "prev_gamma",
        "target_confidence",
        "target_entropy",
    )

    def __init__(self, compression: str, temperature: float = 0.0) -> None:
        self.code = compression_code(compression)
        if not (temperature >= 0.0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
        self.temperature = float(temperature)
        self.prev_rate = ACCEPT_PRIOR
        self.ema_acc = 0.0
        self.ema_rej = 0.0
        self.prev_accepted = 0
        self.prev_gamma = 0
        self.target_confidence = 0.0
        self.target_entropy = 0.0

    def observe_target(self, confidence: float, entropy: float) -> None:
        """Record the target's top-1 probability and entropy at the last verified position (after each step)."""
        self.target_confidence = float(confidence)
        self.target_entropy = float(entropy)

    def update(self, drafted: int, accepted: int) -> None:
        """Record the outcome of a step that drafted ``drafted`` tokens."""
        if drafted <= 0:
            return
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in [0, {drafted}], got {accepted}")
        rejected = 1.0 if accepted < drafted else 0.0
        self.prev_rate = accepted / (accepted + rejected)
        self.ema_acc = ACCEPT_DECAY * self.ema_acc + accepted
        self.ema_rej = ACCEPT_DECAY * self.ema_rej + rejected
        self.prev_accepted = int(accepted)
        self.prev_gamma = int(drafted)

    @property
    def ema_rate(self) -> float:
        """Beta(1, 1)-smoothed acceptance rate from the decayed counts."""
        return (self.ema_acc + 1.0) / (self.ema_acc + self.ema_rej + 2.0)

    def features(self, conf_first: float, entropy_first: float, context_len: int) -> np.ndarray:
        """Feature vector (``online`` set, float32) for the step about to be drafted."""
        return np.array(
            [
                conf_first,
                entropy_first,
                self.code,
                self.prev_rate,
                self.ema_rate,
                math.log1p(context_len),
                self.temperature,
            ],
            dtype=np.float32,
        )

    def pre_values(self, context_len: int, match_len: int) -> list[float]:
        """:meth:`pre_features` as a list of Python floats (not yet rounded to float32).

        What the runtime's Python engine reads inside generation, where numpy's
        calls run cold right after a forward pass (docs/design.md).
        """
        accepted, gamma, acc = self.prev_accepted, self.prev_gamma, self.ema_acc
        # (no float() of what is a float already, ema_rate inline: each call and lookup starts cold here)
        return [
            float(self.code),
            self.prev_rate,
            (acc + 1.0) / (acc + self.ema_rej + 2.0),  # ema_rate
            float(accepted),
            float(gamma),
            1.0 if gamma > 0 and accepted == gamma else 0.0,
            math.log1p(context_len),
            self.temperature,
            float(match_len),
        ]

    def pre_features(self, context_len: int, match_len: int) -> np.ndarray:
        """Feature vector (``pre`` set, float32) for the step about to be decided, before any draft token exists.

        ``match_len`` is :func:`context_match_len` of the context.
        """
        return np.array(self.pre_values(context_len, match_len), dtype=np.float32)


def gated_features(pre: np.ndarray, conf_first: float, entropy_first: float) -> np.ndarray:
    """``gated`` feature vector: a step's ``pre`` vector followed by the probe token's confidence and entropy."""
    out = np.empty(GATED.n_features, dtype=np.float32)
    out[: pre.shape[-1]] = pre
    out[-2] = conf_first
    out[-1] = entropy_first
    return out


def gated_values(pre: list[float], conf_first: float, entropy_first: float) -> list[float]:
    """:func:`gated_features` of a :meth:`OnlineFeatureState.pre_values` list, as a list."""
    return [*pre, float(conf_first), float(entropy_first)]


def paper_features(
    confidences: Sequence[float] | np.ndarray,
    entropies_nats: Sequence[float] | np.ndarray,
    compression: str,
) -> np.ndarray:
    """The published MLP16 inputs for one step's draft tokens (``paper`` set).

    Parameters
    ----------
    confidences, entropies_nats : sequence of float
        Per draft token top-1 probability and entropy (nats), at least one.
    compression : str
        Compression name.
    """
    c = np.asarray(confidences, dtype=np.float64)
    h = np.asarray(entropies_nats, dtype=np.float64) / LN2
    if c.size == 0 or c.shape != h.shape:
        raise ValueError("paper features need >= 1 draft token with matching confidence/entropy")
    return np.array([h.mean(), c.mean(), h.max(), c.min(), compression_code(compression)], dtype=np.float32)


def as_feature_matrix(features: Any, feature_set: FeatureSet | str) -> np.ndarray:
    """Order features by ``feature_set`` and return float32 ``(n, F)``.

    Accepts a mapping of name to value (one row), a pandas DataFrame (columns
    selected and ordered by name), or an array whose columns already follow
    the feature set.

    Raises
    ------
    ValueError
        When a named feature is missing or an array has the wrong width.
    """
    fs = get_feature_set(feature_set) if isinstance(feature_set, str) else feature_set
    if isinstance(features, Mapping):
        missing = [n for n in fs.names if n not in features]
        if missing:
            raise ValueError(f"missing features for set {fs.name!r}: {', '.join(missing)}")
        return np.asarray([[features[n] for n in fs.names]], dtype=np.float32)
    if hasattr(features, "columns"):
        missing = [n for n in fs.names if n not in features.columns]
        if missing:
            raise ValueError(
                f"missing feature columns for set {fs.name!r}: {', '.join(missing)} "
                f"(got columns: {', '.join(map(str, features.columns))})"
            )
        return np.asarray(features[list(fs.names)], dtype=np.float32)
    arr = np.asarray(features, dtype=np.float32)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != fs.n_features:
        raise ValueError(
            f"feature array has shape {arr.shape}; feature set {fs.name!r} expects "
            f"(n, {fs.n_features}) with columns {', '.join(fs.names)}"
        )
    return arr


#: the log columns a pass over a log's steps reads (:func:`features_from_log`, the replay): each run's key and its
#: state's settings, each step's signals and outcome; a pass over these alone skips the columns no feature reads
STEP_PASS_COLUMNS = (
    "run_id",
    "prompt_id",
    "compression",
    "decoding",
    "temperature",
    "gamma",
    "accepted",
    "context_len",
    "context_match_len",
    "draft_confidence",
    "draft_entropy",
)


def step_rows(ordered: pd.DataFrame) -> list[tuple[Any, Any]]:
    """``(index, row)`` for each row of ``ordered``, in order, the row holding the :data:`STEP_PASS_COLUMNS` it has
    (attribute access)."""
    cols = [c for c in STEP_PASS_COLUMNS if c in ordered.columns]
    return list(zip(ordered.index, ordered[cols].itertuples(index=False)))


def logged_step_features(state: OnlineFeatureState, step: Any, feature_set: str) -> np.ndarray:
    """The ``online``, ``pre`` or ``gated`` row of one logged drafting step, from the run's ``state`` before it.

    ``step`` is a log row (attribute access: ``context_len``, ``draft_confidence``,
    ``context_match_len``, ...). The caller then records the step's outcome
    with ``state.update``.
    """
    if feature_set == ONLINE.name:
        return state.features(float(step.draft_confidence[0]), float(step.draft_entropy[0]), int(step.context_len))
    if feature_set not in (PRE.name, GATED.name):
        raise ValueError(f"feature set {feature_set!r} has no per-run state to replay")
    pre = state.pre_features(int(step.context_len), int(step.context_match_len))
    if feature_set == GATED.name:
        pre = gated_features(pre, float(step.draft_confidence[0]), float(step.draft_entropy[0]))
    return pre


def features_from_log(log: pd.DataFrame, feature_set: str = "online") -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Compute a feature matrix and censored labels from a validated step log.

    Parameters
    ----------
    log : pandas.DataFrame
        Rows in the step-log schema (see :mod:`speckv_policy.logs`).
    feature_set : {'online', 'paper', 'pre', 'gated'}
        Which feature set to compute.

    Returns
    -------
    X : pandas.DataFrame
        One row per usable step, columns named and ordered by the feature set;
        indexed like ``log`` (steps that drafted nothing are dropped: they have
        no draft distribution to describe).
    accepted : ndarray of int64
        Accepted prefix length per row.
    drafted : ndarray of int64
        Gamma drafted per row (the censoring point of ``accepted``).
    """
    import pandas as pd

    fs = get_feature_set(feature_set)
    if fs is PRE or fs is GATED:
        for col in PRE_SIGNAL_COLUMNS:
            nan = np.isnan(log[col].to_numpy(np.float64)) & (log["gamma"].to_numpy() > 0)
            if nan.any():
                raise ValueError(
                    f"the '{fs.name}' feature set needs column '{col}', which {int(nan.sum())} drafting steps of this log "
                    "lack (NaN: a log written before log schema v2); re-profile with speckv-profile to record it"
                )
    order = log.sort_values(["run_id", "prompt_id", "step"], kind="stable")
    rows: list[np.ndarray] = []
    index: list[Any] = []
    if fs is ONLINE or fs is PRE or fs is GATED:
        state: OnlineFeatureState | None = None
        key = None
        for idx, r in step_rows(order):
            k = (r.run_id, r.prompt_id)
            if k != key:
                temp = float(r.temperature) if r.decoding == "sampling" else 0.0
                state = OnlineFeatureState(r.compression, temp)
                key = k
            assert state is not None
            if r.gamma > 0:
                rows.append(logged_step_features(state, r, fs.name))
                index.append(idx)
            state.update(int(r.gamma), int(r.accepted))
    elif fs is PAPER:
        for idx, r in step_rows(order):
            if r.gamma > 0:
                rows.append(paper_features(r.draft_confidence, r.draft_entropy, r.compression))
                index.append(idx)
    else:  # pragma: no cover - every registered set is handled above
        raise ValueError(f"no log recipe for feature set {fs.name!r}")
    X = pd.DataFrame(
        np.vstack(rows) if rows else np.empty((0, fs.n_features), np.float32),
        columns=list(fs.names),
        index=pd.Index(index),
    )
    used = order.loc[index] if index else order.iloc[:0]
    return (
        X,
        used["accepted"].to_numpy(np.int64),
        used["gamma"].to_numpy(np.int64),
    )


def spanning_rows(feature_set: FeatureSet | str, n: int = 512, seed: int = 0) -> np.ndarray:
    """Synthetic feature rows spanning every feature's plausible range, at every compression code.

    Not a sample of real steps: rows to run a policy on when no log is at
    hand (``speckv-export --reprice`` checks that a re-priced export runs
    and does not collapse to one gamma where the input did not). Rates and
    confidences in [0, 1], entropies in [0, 6] nats (9 bits), contexts of 8
    to 4096 tokens, temperatures 0 / 0.7 / 1, counts in 0..8 with accepted <=
    drafted, and the codes 0, 1, 2 in turn.

    Parameters
    ----------
    feature_set : FeatureSet or str
        Whose columns to fill.
    n : int, default=512
        Rows.
    seed : int, default=0
        Seed of the generator (the rows are reproducible).

    Returns
    -------
    ndarray of float32, shape (n, n_features)
    """
    fs = get_feature_set(feature_set) if isinstance(feature_set, str) else feature_set
    rng = np.random.default_rng(seed)
    cols: dict[str, np.ndarray] = {}
    gamma = rng.integers(0, 9, n)
    for name in fs.names:
        if name == "compression_code":
            v = np.arange(n) % 3
        elif name == "prev_gamma":
            v = gamma
        elif name == "prev_accepted":
            v = np.floor(rng.uniform(0, 1, n) * (gamma + 1))
        elif name == "prev_fully_accepted":
            v = rng.integers(0, 2, n)
        elif name == "context_match_len":
            v = rng.integers(0, CONTEXT_MATCH_CAP + 1, n)
        elif name == "log_context_len":
            v = np.log1p(np.exp(rng.uniform(math.log(8), math.log(4096), n)))
        elif name == "temperature":
            v = rng.choice([0.0, 0.7, 1.0], n)
        elif "entropy" in name:
            v = rng.uniform(0, 9.0 if name.endswith("_bits") else 6.0, n)
        else:  # confidences and acceptance rates
            v = rng.uniform(0, 1, n)
        cols[name] = np.asarray(v, dtype=np.float64)
    return np.column_stack([cols[c] for c in fs.names]).astype(np.float32)
