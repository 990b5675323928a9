"""ONNX export of a policy's whole decision, through skl2onnx.

Importing this module registers every policy with skl2onnx
(:func:`register_skl2onnx`), so ``skl2onnx.to_onnx(policy, X)`` and a
``Pipeline`` ending in a policy convert; :func:`export_onnx` builds on that.

Graph: input ``features`` float32 ``[N, F]`` -> outputs ``gamma`` int64 ``[N]``,
``values`` float32 ``[N, G]`` (the objective per candidate, what the argmax
runs over) and ``expected_tokens`` float32 ``[N, G]``. The model metadata
(``speckv.*`` keys) carries the feature set, its ordered names and version,
the candidates, the compression codes, the objective, the cost model, the
package version and the training-data fingerprint; the runtime checks them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sklearn.utils.validation import check_is_fitted

from . import __version__
from .atomic import atomic_write
from .objective import CostModel, per_second_scale
from .policies.base import GammaPolicy
from .policies.baselines import FixedGammaPolicy, PaperMLP16Policy
from .policies.gated import GatedPolicy
from .policies.gbt import HAZARD_FLOOR, GBTPolicy
from .policies.mlp import MLPPolicy
from .policies.table import TablePolicy
from .program import ENSEMBLE_KEYS, PROGRAM_VERSION
from .schema import COMPRESSION_CODES, N_COMPRESSION_CODES, get_feature_set

OPSET = 18
EXPORT_FORMAT_VERSION = 1
INPUT_NAME = "features"
OUTPUT_NAMES = ("gamma", "values", "expected_tokens")
#: Extra outputs of a gated export: the gate (int64 [N], 1 = draft) and the gate's expected tokens per candidate.
GATE_OUTPUT_NAMES = ("gate", "gate_expected_tokens")


class _Graph:
    """Minimal ONNX graph builder with unique names."""

    def __init__(self, prefix: str = "") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.opsets: dict[str, int] = {"": OPSET}
        self._n = 0
        self._prefix = prefix

    def fresh_name(self, base: str) -> str:
        self._n += 1
        return f"{self._prefix}{base}_{self._n}"

    def const(self, value: Any, dtype: Any = np.float32, name: str = "c") -> str:
        n = self.fresh_name(name)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), n))
        return n

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        o = out or self.fresh_name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [o], **attrs))
        return o

    def batch_repeats(self, x: str, tail: list[int]) -> str:
        """int64 tensor ``[N, *tail]`` where N is ``x``'s first dimension."""
        n = self.op("Slice", self.op("Shape", x), self.const([0], np.int64), self.const([1], np.int64))
        return self.op("Concat", n, self.const(tail, np.int64), axis=0)

    def sub_estimator(self, model: Any, x: str, n_features: int) -> str:
        """Class probabilities ``[N, 2]`` of a fitted scikit-learn classifier on ``x`` (its own converter)."""
        raise NotImplementedError("only a skl2onnx converter graph can call sub-estimators")


class _ConverterGraph(_Graph):
    """:class:`_Graph` writing into a skl2onnx converter's scope and container."""

    def __init__(self, scope: Any, container: Any) -> None:
        super().__init__()
        self.scope, self.container = scope, container
        target = container.target_opset
        self.opv = target.get("", OPSET) if isinstance(target, dict) else int(target or OPSET)

    def fresh_name(self, base: str) -> str:
        return self.scope.get_unique_variable_name(base)

    def const(self, value: Any, dtype: Any = np.float32, name: str = "c") -> str:
        n = self.fresh_name(name)
        self.container.add_initializer(n, None, None, numpy_helper.from_array(np.asarray(value, dtype=dtype), n))
        return n

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        o = out or self.fresh_name(op_type.lower())
        self.container.add_node(
            op_type, list(inputs), [o], name=self.scope.get_unique_operator_name(op_type), op_version=self.opv, **attrs
        )
        return o

    def sub_estimator(self, model: Any, x: str, n_features: int) -> str:
        from skl2onnx.algebra.onnx_operator import OnnxSubEstimator
        from skl2onnx.algebra.onnx_ops import OnnxIdentity
        from skl2onnx.common.data_types import FloatTensorType

        out = self.fresh_name("probabilities")
        sub = OnnxSubEstimator(
            model, x, op_version=self.opv, options={"zipmap": False}, input_types=[FloatTensorType([None, n_features])]
        )
        OnnxIdentity(sub[1], op_version=self.opv, output_names=[out]).add_to(self.scope, self.container)
        return out


def _tokens_from_survival(g: _Graph, surv: str, candidates: np.ndarray) -> str:
    padded = g.op("Pad", surv, g.const([0, 1, 0, 0], np.int64), g.const(0.0))
    cum = g.op("CumSum", padded, g.const(1, np.int64))
    tokens = g.op("Add", cum, g.const(1.0))
    return g.op("Gather", tokens, g.const(candidates, np.int64), axis=1)


def _survival_from_log_hazard(g: _Graph, log_h: str) -> str:
    return g.op("Exp", g.op("CumSum", log_h, g.const(1, np.int64)))


def _mlp_tokens(g: _Graph, p: MLPPolicy, x: str) -> str:
    a = g.op("Div", g.op("Sub", x, g.const(p.mean_)), g.const(p.scale_))
    for i, (W, b) in enumerate(zip(p.coefs_, p.intercepts_)):
        a = g.op("Gemm", a, g.const(W), g.const(b))
        if i < len(p.coefs_) - 1:
            a = g.op("Relu", a)
    log_h = g.op("Neg", g.op("Softplus", g.op("Neg", a)))  # log(sigmoid(a))
    return _tokens_from_survival(g, _survival_from_log_hazard(g, log_h), p.candidates_)


def _gbt_tokens(g: _Graph, p: GBTPolicy, x: str) -> str:
    K, F = p.max_gamma_, p.n_features_in_
    if p.model_ is None:
        row = np.full((1, K), np.log(max(p.constant_hazard_, HAZARD_FLOOR)))
        log_h = g.op("Tile", g.const(row), g.batch_repeats(x, [1]))
    else:
        rep = g.op("Tile", g.op("Unsqueeze", x, g.const([1], np.int64)), g.const([1, K, 1], np.int64))
        pos = g.op("Tile", g.const(np.arange(1, K + 1).reshape(1, K, 1)), g.batch_repeats(x, [1, 1]))
        flat = g.op("Reshape", g.op("Concat", rep, pos, axis=2), g.const([-1, F + 1], np.int64))
        prob = g.op("Gather", g.sub_estimator(p.model_, flat, F + 1), g.const(1, np.int64), axis=1)
        h = g.op("Clip", g.op("Reshape", prob, g.const([-1, K], np.int64)), g.const(HAZARD_FLOOR), g.const(1.0))
        log_h = g.op("Log", h)
    return _tokens_from_survival(g, _survival_from_log_hazard(g, log_h), p.candidates_)


def _table_tokens(g: _Graph, p: TablePolicy, x: str) -> str:
    flat = None
    for col, edges, stride in zip(p.columns_, p.edges_, p.strides_):
        v = g.op("Gather", x, g.const([int(col)], np.int64), axis=1)  # [N, 1]
        ge = g.op("Cast", g.op("GreaterOrEqual", v, g.const(edges.reshape(1, -1))), to=TensorProto.INT64)
        idx = g.op("Mul", g.op("ReduceSum", ge, g.const([1], np.int64), keepdims=0), g.const(int(stride), np.int64))
        flat = idx if flat is None else g.op("Add", flat, idx)
    surv = g.op("Gather", g.const(p.survival_table_), flat, axis=0)
    return _tokens_from_survival(g, surv, p.candidates_)


def _codes(g: _Graph, p: GammaPolicy, x: str) -> str:
    return _codes_of(g, p.feature_set_, x)


def _codes_of(g: _Graph, feature_set: str, x: str) -> str:
    idx = get_feature_set(feature_set).index("compression_code")
    v = g.op("Gather", x, g.const(idx, np.int64), axis=1)
    v = g.op("Clip", g.op("Round", v), g.const(0.0), g.const(float(N_COMPRESSION_CODES - 1)))
    return g.op("Cast", v, to=TensorProto.INT64)


def _fixed_tokens(g: _Graph, p: FixedGammaPolicy, x: str) -> str:
    return g.op("Gather", g.const(p.tokens_table_), _codes(g, p, x), axis=0)


def _paper_tokens(g: _Graph, p: PaperMLP16Policy, x: str) -> str:
    G, F = len(p.candidates_), p.n_features_in_
    rep = g.op("Tile", g.op("Unsqueeze", x, g.const([1], np.int64)), g.const([1, G, 1], np.int64))
    gam = g.op("Tile", g.const(p.candidates_.reshape(1, G, 1)), g.batch_repeats(x, [1, 1]))
    flat = g.op("Reshape", g.op("Concat", rep, gam, axis=2), g.const([-1, F + 1], np.int64))
    h = g.op("Relu", g.op("Gemm", flat, g.const(p.coefs_[0]), g.const(p.intercepts_[0])))
    r = g.op("Gemm", h, g.const(p.coefs_[1]), g.const(p.intercepts_[1]))
    rate = g.op("Clip", g.op("Reshape", r, g.const([-1, G], np.int64)), g.const(0.0), g.const(1.0))
    return g.op("Add", g.op("Mul", rate, g.const(p.candidates_.reshape(1, G))), g.const(1.0))


_BUILDERS: dict[type, Callable[[_Graph, Any, str], str]] = {
    MLPPolicy: _mlp_tokens,
    GBTPolicy: _gbt_tokens,
    TablePolicy: _table_tokens,
    FixedGammaPolicy: _fixed_tokens,
    PaperMLP16Policy: _paper_tokens,
}


def _decision(
    g: _Graph,
    tokens: str,
    feature_set: str,
    candidates: np.ndarray,
    objective: str,
    cm: CostModel,
    *,
    x: str = INPUT_NAME,
    outputs: tuple[str, str, str] = OUTPUT_NAMES,
) -> None:
    """``gamma``, ``values`` and ``expected_tokens`` outputs from the expected tokens per candidate.

    ``values`` is the objective per candidate (tokens/s under ``cm``, or tokens
    per step), ``gamma`` its argmax. ``outputs`` names the three outputs;
    ``tokens`` may already be the expected-tokens output.
    """
    gamma, values, expected = outputs
    step_time = g.op("Gather", g.const(cm.time_table(candidates)), _codes_of(g, feature_set, x), axis=0)
    if objective == "tokens_per_step":
        val = g.op("Identity", tokens, out=values)
    else:
        scale = per_second_scale(cm.unit)
        val = g.op("Mul", g.op("Div", tokens, step_time), g.const(scale), out=values)
    if tokens != expected:
        g.op("Identity", tokens, out=expected)
    best = g.op("ArgMax", val, axis=1, keepdims=0)
    g.op("Gather", g.const(candidates, np.int64), best, axis=0, out=gamma)


# -- skl2onnx registration: every policy converts with skl2onnx.to_onnx, alone or at the end of a Pipeline --
_REGISTERED = False


def _builder(policy: Any) -> Callable[[_Graph, Any, str], str]:
    if type(policy) is GatedPolicy:  # fitted (callers check first): both heads must convert; the head's builds tokens
        _builder(policy.gate_)
        return _builder(policy.head_)
    builder = next((b for cls, b in _BUILDERS.items() if type(policy) is cls), None)
    if builder is None:
        raise ValueError(
            f"no ONNX converter for {type(policy).__name__}; export supports "
            + ", ".join(c.__name__ for c in _BUILDERS)
        )
    return builder


def _skl2onnx_parser(scope: Any, model: Any, inputs: list, custom_parsers: Any = None) -> list:
    from skl2onnx import get_model_alias
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType

    op = scope.declare_local_operator(get_model_alias(type(model)), model)
    op.inputs = inputs
    G = len(model.candidates_)
    op.outputs.append(scope.declare_local_variable("gamma", Int64TensorType([None])))
    op.outputs.append(scope.declare_local_variable("values", FloatTensorType([None, G])))
    op.outputs.append(scope.declare_local_variable("expected_tokens", FloatTensorType([None, G])))
    if type(model) is GatedPolicy:
        gate, expected = GATE_OUTPUT_NAMES
        op.outputs.append(scope.declare_local_variable(gate, Int64TensorType([None])))
        op.outputs.append(scope.declare_local_variable(expected, FloatTensorType([None, G])))
    return op.outputs


def _skl2onnx_shape(operator: Any) -> None:
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType

    G = len(operator.raw_operator.candidates_)
    gamma, values, expected = operator.outputs[:3]
    gamma.type = Int64TensorType([None])
    values.type = FloatTensorType([None, G])
    expected.type = FloatTensorType([None, G])
    if len(operator.outputs) == 5:
        operator.outputs[3].type = Int64TensorType([None])
        operator.outputs[4].type = FloatTensorType([None, G])


def _skl2onnx_convert(scope: Any, operator: Any, container: Any) -> None:
    from skl2onnx.common.data_types import FloatTensorType

    policy = operator.raw_operator
    check_is_fitted(policy)
    if policy.feature_set_ is None:
        raise ValueError("ONNX conversion needs a policy fitted with a named feature_set ('online' or 'paper')")
    g = _ConverterGraph(scope, container)
    x = operator.inputs[0].full_name
    if not isinstance(operator.inputs[0].type, FloatTensorType):  # decisions are made on float32 features
        x = g.op("Cast", x, to=TensorProto.FLOAT)
    names = [o.full_name for o in operator.outputs]
    head = policy
    if type(policy) is GatedPolicy:
        _gate(g, policy, x, names[3], names[4])
        head = policy.head_
    tokens = _builder(head)(g, head, x)
    _decision(
        g,
        tokens,
        policy.feature_set_,
        head.candidates_,
        head.objective,
        head.cost_model_,
        x=x,
        outputs=(names[0], names[1], names[2]),
    )


def _gate(g: _Graph, policy: GatedPolicy, x: str, gate_out: str, expected_out: str) -> None:
    """The gate of a gated export: its expected tokens from the leading ``pre`` columns, priced without a probe."""
    gate = policy.gate_
    xg = g.op(
        "Slice",
        x,
        g.const([0], np.int64),
        g.const([policy.n_gate_features_], np.int64),
        g.const([1], np.int64),
    )
    g.op("Identity", _builder(gate)(g, gate, xg), out=expected_out)
    _gate_tail(g, expected_out, gate.feature_set_, gate.candidates_, gate.objective, gate.cost_model_, xg, gate_out)


def _gate_tail(
    g: _Graph, tokens: str, feature_set: str, candidates: np.ndarray, objective: str, cm: CostModel, x: str, out: str
) -> None:
    """``out`` = 1 where the best candidate under ``cm`` (no probe) drafts, else 0."""
    names = (g.fresh_name("gate_gamma"), g.fresh_name("gate_values"), tokens)  # tokens already named: no copy
    _decision(g, tokens, feature_set, candidates, objective, replace(cm, decision_draft_tokens=0), x=x, outputs=names)
    g.op("Cast", g.op("Greater", names[0], g.const(0, np.int64)), to=TensorProto.INT64, out=out)


def register_skl2onnx() -> None:
    """Register every speckv policy with skl2onnx (idempotent; importing this module does it).

    Then ``skl2onnx.to_onnx(policy, X)`` converts a fitted policy, and a
    scikit-learn ``Pipeline`` that ends in one converts as a whole: outputs
    ``gamma`` (int64 ``[N]``), ``values`` and ``expected_tokens`` (float32
    ``[N, G]``). Sub-models (the GBT policy's booster) go through their own
    skl2onnx converters. :func:`export_onnx` adds the ``speckv.*`` metadata
    the runtime checks.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from skl2onnx import update_registered_converter

    for cls in (*_BUILDERS, GatedPolicy):
        update_registered_converter(
            cls, f"Speckv{cls.__name__}", _skl2onnx_shape, _skl2onnx_convert, parser=_skl2onnx_parser, overwrite=True
        )
    _REGISTERED = True


def policy_metadata(policy: GammaPolicy) -> dict[str, str]:
    """The ``speckv.*`` metadata written into an export."""
    fs = get_feature_set(policy.feature_set_)
    return {
        "speckv.format_version": str(EXPORT_FORMAT_VERSION),
        "speckv.policy": type(policy).__name__,
        "speckv.feature_set": fs.name,
        "speckv.feature_schema_version": str(fs.version),
        "speckv.feature_names": json.dumps(list(fs.names)),
        "speckv.candidates": json.dumps([int(c) for c in policy.candidates_]),
        "speckv.compression_codes": json.dumps(COMPRESSION_CODES, sort_keys=True),
        "speckv.objective": policy.objective,
        "speckv.cost_model": (policy.head_ if type(policy) is GatedPolicy else policy).cost_model_.to_json(),
        "speckv.package_version": __version__,
        "speckv.training_fingerprint": str(policy.training_fingerprint_),
        "speckv.training_rows": str(getattr(policy, "n_training_rows_", 0)),
        # the logged rows it was trained from, and how many rounds of its own replayed history were added to them
        # (fit_from_log(..., history_rounds=N)); without rounds, the same as the training fingerprint
        "speckv.log_fingerprint": str(getattr(policy, "log_fingerprint_", policy.training_fingerprint_)),
        "speckv.history_rounds": str(int(getattr(policy, "history_rounds_", 0))),
        # what drafted the training steps ('eagle3' heads or draft 'model's); the hook warns on another kind
        "speckv.draft_kind": str(getattr(policy, "draft_kind_", "")),
        "speckv.params": json.dumps({k: repr(v) for k, v in policy.get_params().items()}, sort_keys=True),
        **(
            {
                "speckv.decision": "gated",
                "speckv.gate_policy": type(policy.gate_).__name__,
                "speckv.head_policy": type(policy.head_).__name__,
                "speckv.gate_features": str(policy.n_gate_features_),
            }
            if type(policy) is GatedPolicy
            else {}
        ),
    }


# -- decision programs (speckv_policy.program): the same decision as plain data, for the runtime's Python engine --


def _ensemble_spec(node: onnx.NodeProto) -> dict[str, Any]:
    """The attributes of a ``TreeEnsembleClassifier`` node that decide its scores, as JSON-ready lists."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out: dict[str, Any] = {}
    for key in ENSEMBLE_KEYS:
        v = attrs.get(key, [] if key != "post_transform" else b"NONE")
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode() for x in v]
        out[key] = [float(x) for x in v] if key in ("nodes_values", "class_weights", "base_values") else v
    return out


def _graph_ensemble(model: onnx.ModelProto, estimator: Any, n_inputs: int) -> dict[str, Any]:
    """The tree ensemble the graph runs for ``estimator``: converted on its own, then found in ``model``."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    alone = to_onnx(
        estimator,
        initial_types=[("x", FloatTensorType([None, n_inputs]))],
        options={"zipmap": False},
        target_opset={"": OPSET, "ai.onnx.ml": 3},
    )
    (own,) = [n for n in alone.graph.node if n.op_type == "TreeEnsembleClassifier"]
    spec = _ensemble_spec(own)
    if not any(n.op_type == "TreeEnsembleClassifier" and _ensemble_spec(n) == spec for n in model.graph.node):
        raise ValueError("the graph's tree ensemble differs from the model's own conversion; no program written")
    return spec


def _program_head(p: GammaPolicy, model: onnx.ModelProto) -> dict[str, Any] | None:
    """One head's program spec, or None for a policy the Python engine does not evaluate (MLP, paper MLP16)."""
    base = {"candidates": [int(c) for c in p.candidates_], "n_features": int(p.n_features_in_)}
    f32 = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64).tolist()  # noqa: E731 - as the graph holds it
    if type(p) is GBTPolicy:
        K = int(p.max_gamma_)
        if p.model_ is None:
            log_h = float(np.float32(np.log(max(p.constant_hazard_, HAZARD_FLOOR))))
            return {**base, "kind": "constant", "survival": f32(np.exp(log_h * np.arange(1, K + 1)))}
        ensemble = _graph_ensemble(model, p.model_, p.n_features_in_ + 1)
        return {**base, "kind": "gbt", "positions": K, "hazard_floor": HAZARD_FLOOR, "ensemble": ensemble}
    if type(p) is TablePolicy:
        return {
            **base,
            "kind": "table",
            "columns": [int(c) for c in p.columns_],
            "edges": [f32(e) for e in p.edges_],
            "strides": [int(s) for s in p.strides_],
            "survival": f32(p.survival_table_),
        }
    if type(p) is FixedGammaPolicy:
        code = get_feature_set(p.feature_set_).index("compression_code")
        return {**base, "kind": "tokens", "code_column": code, "tokens": f32(p.tokens_table_)}
    return None


def decision_program(policy: GammaPolicy, model: onnx.ModelProto) -> dict[str, Any] | None:
    """The ``speckv.program`` of an export (see :mod:`speckv_policy.program`), or None where there is none.

    ``model`` is the policy's built graph: a tree ensemble is taken from it, so
    the program holds exactly the thresholds and leaf values the graph runs.
    The runtime checks a program against onnxruntime before deciding with it.
    """
    if type(policy) is GatedPolicy:
        gate, head = _program_head(policy.gate_, model), _program_head(policy.head_, model)
        if gate is None or head is None:
            return None
        return {"version": PROGRAM_VERSION, "decide": head, "gate": gate}
    head = _program_head(policy, model)
    return None if head is None else {"version": PROGRAM_VERSION, "decide": head}


def build_onnx(policy: GammaPolicy) -> onnx.ModelProto:
    """Build (without saving) the ONNX model of a fitted policy's decision.

    The graph comes from the policy's skl2onnx converter
    (:func:`register_skl2onnx`); this adds the input name ``features``, the
    ``speckv.*`` metadata and the full ONNX check.

    Raises
    ------
    ValueError
        If the policy has no named feature set or no converter.
    """
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType

    check_is_fitted(policy)
    if policy.feature_set_ is None:
        raise ValueError("export needs a policy fitted with a named feature_set ('online' or 'paper')")
    _builder(policy)
    register_skl2onnx()
    F, G = policy.n_features_in_, len(policy.candidates_)
    final = [
        ("gamma", Int64TensorType([None])),
        ("values", FloatTensorType([None, G])),
        ("expected_tokens", FloatTensorType([None, G])),
    ]
    if type(policy) is GatedPolicy:
        gate, expected = GATE_OUTPUT_NAMES
        final += [(gate, Int64TensorType([None])), (expected, FloatTensorType([None, G]))]
    model = to_onnx(
        policy,
        initial_types=[(INPUT_NAME, FloatTensorType([None, F]))],
        final_types=final,
        target_opset={"": OPSET, "ai.onnx.ml": 3},
    )
    model.graph.name = f"speckv_{type(policy).__name__}"
    model.producer_name, model.producer_version = "speckv-policy", __version__
    model.ir_version = min(model.ir_version, 10)
    del model.metadata_props[:]
    meta = policy_metadata(policy)
    program = decision_program(policy, model)
    if program is not None:
        meta["speckv.program"] = json.dumps(program, separators=(",", ":"))
    helper.set_model_props(model, meta)
    onnx.checker.check_model(model, full_check=True)
    return model


def export_onnx(policy: GammaPolicy, path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Export a fitted policy to ``path`` atomically (temp file, then rename).

    The model passes ``onnx.checker.check_model(full_check=True)`` and, where
    onnxruntime is installed, loads and decides on a feature row in it, before
    it replaces anything at ``path``: a bad export never replaces a good one.
    """
    model = build_onnx(policy)
    _check_runs(model, policy.n_features_in_)
    write_onnx(model, path)
    return model


def _check_runs(model: onnx.ModelProto, n_features: int) -> None:
    """Load ``model`` in onnxruntime (when installed) and decide on one row; ValueError if it cannot."""
    try:
        import onnxruntime as ort
    except ImportError:  # the training extra without a runtime: the ONNX checker has run
        return
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        sess.run(["gamma"], {INPUT_NAME: np.zeros((1, n_features), np.float32)})
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ValueError(f"the exported model does not run in onnxruntime ({exc}); nothing was written") from None


def reprice_onnx(model: onnx.ModelProto, cost_model: CostModel) -> onnx.ModelProto:
    """A copy of an export that decides under ``cost_model``, with the same acceptance model.

    The graph keeps everything that computes ``expected_tokens`` (the learned
    part: expected tokens per candidate gamma, a property of the model pair and
    the text) and gets a new decision tail: tokens/s per candidate under the
    new step-time table, and its argmax. The metadata records the new cost
    model (``speckv.cost_model``) and the one it replaced
    (``speckv.repriced_from``). ``cost_model`` brings the machine's times; how
    many draft tokens the export's decision mode pays before deciding (the
    upfront probe, ``decision_draft_tokens``) stays the export's own, as with
    live costs (a calibration file records none: it describes a machine, not a mode).

    Raises
    ------
    ValueError
        If the model is not a speckv export, or maximises tokens per step (a
        cost model does not change its decisions).
    """
    meta = {p.key: p.value for p in model.metadata_props}
    need = ("speckv.feature_set", "speckv.candidates", "speckv.objective")
    if any(k not in meta for k in need):
        raise ValueError(
            "not a speckv-policy export: its metadata lacks " + ", ".join(k for k in need if k not in meta)
        )
    if meta["speckv.objective"] != "tokens_per_second":
        raise ValueError(
            f"this export maximises {meta['speckv.objective']}: a cost model does not change its decisions"
        )
    outputs = {o.name for o in model.graph.output}
    if not {"gamma", "values", "expected_tokens"} <= outputs:
        raise ValueError(f"not a speckv-policy export: outputs {sorted(outputs)}")
    # keep the nodes that expected_tokens depends on, drop the old decision tail
    producer = {o: n for n in model.graph.node for o in n.output}
    keep: list[onnx.NodeProto] = []
    seen: set[int] = set()
    gated = GATE_OUTPUT_NAMES[0] in outputs
    stack = ["expected_tokens", GATE_OUTPUT_NAMES[1]] if gated else ["expected_tokens"]
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        stack.extend(node.input)
    kept = [n for n in model.graph.node if id(n) in seen]  # original (topological) order
    used = {i for n in kept for i in n.input}
    g = _Graph(prefix="reprice_")
    candidates = np.asarray(json.loads(meta["speckv.candidates"]), dtype=np.int64)
    fs = meta["speckv.feature_set"]
    if gated:  # the gate never pays the probe, the head always does
        head_cost = replace(cost_model, decision_draft_tokens=1)
        _gate_tail(
            g, GATE_OUTPUT_NAMES[1], fs, candidates, "tokens_per_second", cost_model, INPUT_NAME, GATE_OUTPUT_NAMES[0]
        )
    else:
        recorded = meta.get("speckv.cost_model")
        head_cost = cost_model.priced_like(CostModel.from_dict(json.loads(recorded)) if recorded else None)
    _decision(g, "expected_tokens", fs, candidates, "tokens_per_second", head_cost)
    graph = helper.make_graph(
        kept + g.nodes,
        model.graph.name,
        list(model.graph.input),
        list(model.graph.output),
        initializer=[t for t in model.graph.initializer if t.name in used] + g.inits,
    )
    out = helper.make_model(
        graph, opset_imports=list(model.opset_import), producer_name=model.producer_name, producer_version=__version__
    )
    out.ir_version = model.ir_version
    meta["speckv.repriced_from"] = meta.get("speckv.cost_model", "")
    meta["speckv.cost_model"] = head_cost.to_json()
    helper.set_model_props(out, meta)
    onnx.checker.check_model(out, full_check=True)
    return out


def write_onnx(model: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Write a checked ONNX model to ``path`` atomically."""
    data = model.SerializeToString()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)

    atomic_write(path, write)


register_skl2onnx()
