"""ONNX export of a policy's whole decision.

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
from .policies.gbt import HAZARD_FLOOR, GBTPolicy
from .policies.mlp import MLPPolicy
from .policies.table import TablePolicy
from .schema import COMPRESSION_CODES, N_COMPRESSION_CODES, get_feature_set

OPSET = 18
EXPORT_FORMAT_VERSION = 1
INPUT_NAME = "features"
OUTPUT_NAMES = ("gamma", "values", "expected_tokens")


class _Graph:
    """Minimal ONNX graph builder with unique names."""

    def __init__(self, prefix: str = "") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.opsets: dict[str, int] = {"": OPSET}
        self._n = 0
        self._prefix = prefix

    def _name(self, base: str) -> str:
        self._n += 1
        return f"{self._prefix}{base}_{self._n}"

    def const(self, value: Any, dtype: Any = np.float32, name: str = "c") -> str:
        n = self._name(name)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), n))
        return n

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        o = out or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [o], **attrs))
        return o

    def batch_repeats(self, x: str, tail: list[int]) -> str:
        """int64 tensor ``[N, *tail]`` where N is ``x``'s first dimension."""
        n = self.op("Slice", self.op("Shape", x), self.const([0], np.int64), self.const([1], np.int64))
        return self.op("Concat", n, self.const(tail, np.int64), axis=0)

    def inline(self, sub: onnx.ModelProto, inputs: dict[str, str], prefix: str) -> dict[str, str]:
        """Copy ``sub``'s nodes in, wiring its inputs; returns its outputs' new names."""
        sub = onnx.compose.add_prefix(sub, prefix)
        rename = {prefix + k: v for k, v in inputs.items()}
        for node in sub.graph.node:
            node.input[:] = [rename.get(i, i) for i in node.input]
            self.nodes.append(node)
        self.inits.extend(sub.graph.initializer)
        for imp in sub.opset_import:
            if imp.domain not in ("", "ai.onnx"):
                self.opsets[imp.domain] = max(self.opsets.get(imp.domain, 0), imp.version)
        return {o.name[len(prefix) :]: o.name for o in sub.graph.output}


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
        from skl2onnx import to_onnx

        sub = to_onnx(
            p.model_,
            np.zeros((1, F + 1), np.float32),
            target_opset={"": OPSET, "ai.onnx.ml": 3},
            options={"zipmap": False},
        )
        rep = g.op("Tile", g.op("Unsqueeze", x, g.const([1], np.int64)), g.const([1, K, 1], np.int64))
        pos = g.op("Tile", g.const(np.arange(1, K + 1).reshape(1, K, 1)), g.batch_repeats(x, [1, 1]))
        flat = g.op("Reshape", g.op("Concat", rep, pos, axis=2), g.const([-1, F + 1], np.int64))
        outs = g.inline(sub, {sub.graph.input[0].name: flat}, prefix="hgb_")
        prob = g.op("Gather", outs["probabilities"], g.const(1, np.int64), axis=1)
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


def _decision(g: _Graph, tokens: str, feature_set: str, candidates: np.ndarray, objective: str, cm: CostModel) -> None:
    """``values`` and ``gamma`` from the expected tokens per candidate: the objective and its argmax.

    ``tokens`` names the expected-tokens tensor; unless it is the graph output
    ``expected_tokens`` already, that output is added here.
    """
    step_time = g.op("Gather", g.const(cm.time_table(candidates)), _codes_of(g, feature_set, INPUT_NAME), axis=0)
    if objective == "tokens_per_step":
        values = g.op("Identity", tokens, out="values")
    else:
        scale = per_second_scale(cm.unit)
        values = g.op("Mul", g.op("Div", tokens, step_time), g.const(scale), out="values")
    if tokens != "expected_tokens":
        g.op("Identity", tokens, out="expected_tokens")
    best = g.op("ArgMax", values, axis=1, keepdims=0)
    g.op("Gather", g.const(candidates, np.int64), best, axis=0, out="gamma")


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
        "speckv.cost_model": policy.cost_model_.to_json(),
        "speckv.package_version": __version__,
        "speckv.training_fingerprint": str(policy.training_fingerprint_),
        "speckv.training_rows": str(getattr(policy, "n_training_rows_", 0)),
        "speckv.params": json.dumps({k: repr(v) for k, v in policy.get_params().items()}, sort_keys=True),
    }


def build_onnx(policy: GammaPolicy) -> onnx.ModelProto:
    """Build (without saving) the ONNX model of a fitted policy's decision.

    Raises
    ------
    ValueError
        If the policy has no named feature set or no registered builder.
    """
    check_is_fitted(policy)
    if policy.feature_set_ is None:
        raise ValueError("export needs a policy fitted with a named feature_set ('online' or 'paper')")
    builder = next((b for cls, b in _BUILDERS.items() if type(policy) is cls), None)
    if builder is None:
        raise ValueError(
            f"no ONNX builder for {type(policy).__name__}; export supports MLPPolicy, GBTPolicy, TablePolicy, FixedGammaPolicy and PaperMLP16Policy"
        )
    g = _Graph()
    F = policy.n_features_in_
    x = INPUT_NAME
    tokens = builder(g, policy, x)
    _decision(g, tokens, policy.feature_set_, policy.candidates_, policy.objective, policy.cost_model_)
    G = len(policy.candidates_)
    graph = helper.make_graph(
        g.nodes,
        f"speckv_{type(policy).__name__}",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", F])],
        [
            helper.make_tensor_value_info("gamma", TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info("values", TensorProto.FLOAT, ["N", G]),
            helper.make_tensor_value_info("expected_tokens", TensorProto.FLOAT, ["N", G]),
        ],
        initializer=g.inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in g.opsets.items()],
        producer_name="speckv-policy",
        producer_version=__version__,
    )
    model.ir_version = min(model.ir_version, 10)
    helper.set_model_props(model, policy_metadata(policy))
    onnx.checker.check_model(model, full_check=True)
    return model


def export_onnx(policy: GammaPolicy, path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Export a fitted policy to ``path`` atomically (temp file, then rename).

    The model passes ``onnx.checker.check_model(full_check=True)`` before it
    replaces anything at ``path``.
    """
    model = build_onnx(policy)
    write_onnx(model, path)
    return model


def reprice_onnx(model: onnx.ModelProto, cost_model: CostModel) -> onnx.ModelProto:
    """A copy of an export that decides under ``cost_model``, with the same acceptance model.

    The graph keeps everything that computes ``expected_tokens`` (the learned
    part: expected tokens per candidate gamma, a property of the model pair and
    the text) and gets a new decision tail: tokens/s per candidate under the
    new step-time table, and its argmax. The metadata records the new cost
    model (``speckv.cost_model``) and the one it replaced
    (``speckv.repriced_from``).

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
    stack = ["expected_tokens"]
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
    _decision(g, "expected_tokens", meta["speckv.feature_set"], candidates, "tokens_per_second", cost_model)
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
    meta["speckv.cost_model"] = cost_model.to_json()
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
