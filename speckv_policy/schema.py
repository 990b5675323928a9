"""Named, ordered, versioned feature sets and the shared vocabularies.

This module is the single source of truth for what a feature vector means.
Exported ONNX models carry the feature set name, its version and the ordered
names; :mod:`speckv_policy.runtime` refuses a model whose schema differs from
the one installed here. Pure Python: no numpy, torch or scikit-learn.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bumped whenever a feature's definition, order or meaning changes.
FEATURE_SCHEMA_VERSION = 1

TASK_TYPES: tuple[str, ...] = ("code", "math", "chat", "summarization", "other")
COMPRESSIONS: tuple[str, ...] = ("fp16", "bf16", "fp32", "int8", "nf4")
DECODINGS: tuple[str, ...] = ("greedy", "sampling")

#: Compression code used as a feature and by the cost model: 0 = full
#: precision (fp16, bf16, fp32), 1 = INT8, 2 = NF4 (the published coding).
COMPRESSION_CODES: dict[str, int] = {"fp16": 0, "bf16": 0, "fp32": 0, "int8": 1, "nf4": 2}
N_COMPRESSION_CODES = 3

#: Acceptance-rate prior used before a sequence has drafted anything.
ACCEPT_PRIOR = 0.5
#: Decay of the exponentially weighted acceptance counts (per drafting step).
ACCEPT_DECAY = 0.8


@dataclass(frozen=True)
class FeatureSet:
    """An ordered list of named features with a version.

    Parameters
    ----------
    name : str
        Identifier written into exported models.
    names : tuple of str
        Ordered feature names; column ``i`` of a feature matrix is ``names[i]``.
    version : int
        Schema version of the definitions.
    description : dict of str to str
        One line per feature.
    """

    name: str
    names: tuple[str, ...]
    version: int
    description: dict[str, str]

    @property
    def n_features(self) -> int:
        """Number of features."""
        return len(self.names)

    def index(self, feature: str) -> int:
        """Column index of ``feature``.

        Raises
        ------
        KeyError
            If the feature is not part of this set.
        """
        try:
            return self.names.index(feature)
        except ValueError:
            raise KeyError(
                f"feature {feature!r} is not in feature set {self.name!r} (features: {', '.join(self.names)})"
            ) from None


ONLINE = FeatureSet(
    name="online",
    version=FEATURE_SCHEMA_VERSION,
    names=(
        "conf_first",
        "entropy_first",
        "compression_code",
        "prev_accept_rate",
        "ema_accept_rate",
        "log_context_len",
        "temperature",
    ),
    description={
        "conf_first": "top-1 probability of the first draft token's (processed) distribution",
        "entropy_first": "entropy in nats of the first draft token's distribution",
        "compression_code": "target compression: 0 full precision, 1 INT8, 2 NF4",
        "prev_accept_rate": "per-token acceptance of the previous drafting step: "
        "accepted / (accepted + rejections); the prior 0.5 before any",
        "ema_accept_rate": "Beta(1,1)-smoothed acceptance from counts decayed by 0.8 per drafting step",
        "log_context_len": "natural log of (1 + tokens in the context)",
        "temperature": "sampling temperature; 0 for greedy decoding",
    },
)

PAPER = FeatureSet(
    name="paper",
    version=FEATURE_SCHEMA_VERSION,
    names=(
        "mean_entropy_bits",
        "mean_confidence",
        "max_entropy_bits",
        "min_confidence",
        "compression_code",
    ),
    description={
        "mean_entropy_bits": "mean draft entropy in bits over the step's draft tokens",
        "mean_confidence": "mean draft top-1 probability over the step's draft tokens",
        "max_entropy_bits": "max draft entropy in bits over the step's draft tokens",
        "min_confidence": "min draft top-1 probability over the step's draft tokens",
        "compression_code": "target compression: 0 full precision, 1 INT8, 2 NF4",
    },
)

#: Longest self-repeating context suffix the ``pre`` features look for (tokens).
CONTEXT_MATCH_CAP = 8
#: Step-log columns (log schema v2) holding the pre-draft signals as they were before each step; a v1 log
#: lacks them (read as NaN, "not recorded"); only the ``pre`` and ``gated`` feature sets need them.
SIGNAL_COLUMNS: tuple[str, ...] = ("target_confidence", "target_entropy", "context_match_len")

#: Signal columns a ``pre`` / ``gated`` row reads (the target's confidence and entropy are logged, not used: v3).
PRE_SIGNAL_COLUMNS: tuple[str, ...] = ("context_match_len",)

PRE = FeatureSet(
    name="pre",
    # v2 added the target's confidence/entropy at the last verified position and the context match; v3 dropped the
    # target's two (worth nothing measurable, together or alone, in benchmarks/ablation.py at commit 730b4b6, and half of the per-step
    # decision time inside generation: two passes over the vocabulary, cold after the verification pass)
    version=3,
    names=(
        "compression_code",
        "prev_accept_rate",
        "ema_accept_rate",
        "prev_accepted",
        "prev_gamma",
        "prev_fully_accepted",
        "log_context_len",
        "temperature",
        "context_match_len",
    ),
    description={
        "compression_code": "target compression: 0 full precision, 1 INT8, 2 NF4",
        "prev_accept_rate": "per-token acceptance of the previous drafting step (as in 'online'); 0.5 before any",
        "ema_accept_rate": "Beta(1,1)-smoothed acceptance from counts decayed by 0.8 per drafting step (as in 'online')",
        "prev_accepted": "draft tokens the previous drafting step had accepted; 0 before any",
        "prev_gamma": "draft tokens the previous drafting step sent for verification; 0 before any",
        "prev_fully_accepted": "1 if the previous drafting step had every draft token accepted, else 0",
        "log_context_len": "natural log of (1 + tokens in the context)",
        "temperature": "sampling temperature; 0 for greedy decoding",
        "context_match_len": f"longest k <= {CONTEXT_MATCH_CAP} such that the context's last k tokens also occur "
        "earlier in the context (prompt-lookup match length; any draft)",
    },
)

GATED = FeatureSet(
    name="gated",
    version=2,  # follows 'pre' v3
    names=(*PRE.names, "conf_first", "entropy_first"),
    description={
        **{k: f"as in 'pre': {v}" for k, v in PRE.description.items()},
        "conf_first": "as in 'online': top-1 probability of the first draft token's distribution (the probe)",
        "entropy_first": "as in 'online': entropy in nats of the first draft token's distribution",
    },
)
"""Input of a gated policy: the gate reads the leading ``pre`` columns before drafting, the length head every
column after the probe token."""

FEATURE_SETS: dict[str, FeatureSet] = {fs.name: fs for fs in (ONLINE, PAPER, PRE, GATED)}


def get_feature_set(name: str) -> FeatureSet:
    """Return the feature set called ``name``.

    Raises
    ------
    ValueError
        If no such feature set exists.
    """
    try:
        return FEATURE_SETS[name]
    except KeyError:
        raise ValueError(f"unknown feature set {name!r}; known: {', '.join(FEATURE_SETS)}") from None


def compression_code(compression: str) -> int:
    """Map a compression name (``fp16``, ``int8``, ``nf4``, ...) to its code.

    Raises
    ------
    ValueError
        For an unknown compression name.
    """
    try:
        return COMPRESSION_CODES[compression]
    except KeyError:
        raise ValueError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}") from None
