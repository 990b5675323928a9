"""Decision programs: an export's expected tokens per candidate, evaluated in plain Python.

Inside generation a decision runs right after a forward pass that streamed the
model's weights through the caches; onnxruntime's code is then cold and a call
costs ~230-340 us on a 2-core CPU even for a graph that returns a constant,
against ~15-45 us hot (docs/design.md). The Python interpreter's own code
stays hot, so the same arithmetic written as a few C-level operations on Python
ints, bytes and arrays touches far less cold memory.

An export carries its program as JSON data in the ``speckv.program`` metadata
(numbers only: nothing in it is executed), written by the exporter from the
same fitted model as the graph. :class:`~speckv_policy.runtime.RuntimePolicy`
compiles it at load, checks it against onnxruntime on rows that straddle every
threshold, and decides with it only if they agree.

Kinds of program (one per decision head; a gated export has two):

``gbt``
    A boosted tree ensemble (the ``TreeEnsembleClassifier`` node of the graph,
    binary, logistic) over the features plus the draft position 1..K:
    per-position acceptance probabilities, their clipped cumulative product is
    the survival curve. Evaluated the QuickScorer way (Lucchese et al., SIGIR
    2015) with Python ints as bit vectors: every tree is first specialised per
    class of positions it cannot tell apart, each feature's value selects a
    precomputed mask of the leaves it rules out, one AND per feature, then the
    leftmost surviving leaf of every tree at once (``M & ~(M - ones)``).
``table``
    A lookup table over binned columns (``TablePolicy``): survival curve per cell.
``constant``
    Survival curve independent of the features.
``tokens``
    Expected tokens per candidate per compression code (``FixedGammaPolicy``).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from operator import add
from typing import Any

__all__ = ["ENSEMBLE_KEYS", "PROGRAM_VERSION", "DecisionProgram", "ProgramError", "float32_row"]

#: Version of the ``speckv.program`` format written by the exporter and read here.
PROGRAM_VERSION = 1
#: The per-node arrays of an ONNX tree ensemble a ``gbt`` program holds (all of one length).
NODE_KEYS = (
    "nodes_treeids",
    "nodes_nodeids",
    "nodes_featureids",
    "nodes_values",
    "nodes_modes",
    "nodes_truenodeids",
    "nodes_falsenodeids",
)
#: Every attribute of a ``TreeEnsembleClassifier`` node a ``gbt`` program holds (the rest do not change its scores).
ENSEMBLE_KEYS = (
    *NODE_KEYS,
    "class_treeids",
    "class_nodeids",
    "class_ids",
    "class_weights",
    "base_values",
    "post_transform",
)


class ProgramError(ValueError):
    """A decision program is malformed or of a kind this package cannot evaluate."""


def float32_row(values: Sequence[float]) -> list[float]:
    """``values`` rounded to float32, as Python floats (what the ONNX graph compares)."""
    return array("f", values).tolist()


def _f32(x: float) -> float:
    return array("f", [x])[0]


# bytes.translate table: a byte with one bit set -> that bit's index (0..7); 0 -> 8 (the slot holding 0.0)
_ONEHOT_INDEX = bytes(8 if b == 0 else (b & -b).bit_length() - 1 for b in range(256))


class _Tree:
    """One tree, as nodes: leaf -> ('leaf', weight); branch -> ('leq', feature, threshold, true_node, false_node)."""

    def __init__(self, nodes: dict[int, tuple], root: int) -> None:
        self.nodes, self.root = nodes, root

    def position_classes(self, position_feature: int, K: int) -> list[list[int]]:
        """Positions 1..K grouped by the outcome of every test this tree makes on the position."""
        thr = sorted({n[2] for n in self.nodes.values() if n[0] == "leq" and n[1] == position_feature})
        groups: dict[tuple[bool, ...], list[int]] = {}
        for k in range(1, K + 1):
            groups.setdefault(tuple(k <= t for t in thr), []).append(k)
        return list(groups.values())

    def specialised(self, position_feature: int, k: int) -> tuple[list[float], list[tuple[int, float, int, int]]]:
        """Leaves left to right (true branch first) and branches ``(feature, threshold, first, stop)``.

        The tree with every test on the position resolved for position ``k``;
        a branch's true subtree holds leaves ``first .. stop - 1``.
        """
        leaves: list[float] = []
        branches: list[tuple[int, float, int, int]] = []

        def walk(node_id: int, depth: int) -> None:
            if depth > len(self.nodes):
                raise ProgramError("a tree has a cycle")
            node = self.nodes.get(node_id)
            if node is None:
                raise ProgramError(f"a tree refers to node {node_id}, which it does not have")
            if node[0] == "leaf":
                leaves.append(node[1])
                return
            _, feature, threshold, true_id, false_id = node
            if feature == position_feature:
                walk(true_id if k <= threshold else false_id, depth + 1)
                return
            first = len(leaves)
            walk(true_id, depth + 1)
            branches.append((feature, threshold, first, len(leaves)))
            walk(false_id, depth + 1)

        walk(self.root, 0)
        return leaves, branches


def _ensemble_trees(e: dict[str, Any]) -> tuple[list[_Tree], float]:
    """The trees of an ``ai.onnx.ml.TreeEnsembleClassifier`` (binary, one score column) and its base value."""
    n = len(e["nodes_treeids"])
    if any(len(e[k]) != n for k in NODE_KEYS):
        raise ProgramError("the ensemble's node arrays differ in length")
    if e.get("post_transform", "LOGISTIC") != "LOGISTIC":
        raise ProgramError(f"post_transform {e.get('post_transform')!r}; only LOGISTIC is evaluated")
    if set(e["class_ids"]) - {0} or len(e.get("base_values", [0.0])) > 1:
        raise ProgramError("only a binary ensemble with one score column is evaluated")
    weights: dict[tuple[int, int], float] = {}
    for t, node, w in zip(e["class_treeids"], e["class_nodeids"], e["class_weights"]):
        weights[(t, node)] = weights.get((t, node), 0.0) + float(w)
    by_tree: dict[int, dict[int, tuple]] = {}
    for i in range(n):
        t, node, mode = int(e["nodes_treeids"][i]), int(e["nodes_nodeids"][i]), e["nodes_modes"][i]
        if mode == "LEAF":
            entry: tuple = ("leaf", weights.get((t, node), 0.0))
        elif mode == "BRANCH_LEQ":
            entry = (
                "leq",
                int(e["nodes_featureids"][i]),
                _f32(float(e["nodes_values"][i])),
                int(e["nodes_truenodeids"][i]),
                int(e["nodes_falsenodeids"][i]),
            )
        else:
            raise ProgramError(f"node mode {mode!r}; only BRANCH_LEQ and LEAF are evaluated")
        by_tree.setdefault(t, {})[node] = entry
    numbers = [n[2] for v in by_tree.values() for n in v.values() if n[0] == "leq"] + list(weights.values())
    if not all(map(math.isfinite, numbers)):
        raise ProgramError("the ensemble has a threshold or leaf value that is not finite")
    trees = []
    for t in sorted(by_tree):
        nodes = by_tree[t]
        refs = [c for v in nodes.values() if v[0] == "leq" for c in v[3:]]
        children = set(refs)
        if len(children) != len(refs):  # a node reached twice: a graph, not a tree (and exponential to walk)
            raise ProgramError(f"tree {t} is not a tree: a node has two parents")
        roots = [i for i in nodes if i not in children]
        if len(roots) != 1:
            raise ProgramError(f"tree {t} has {len(roots)} roots")
        trees.append(_Tree(nodes, roots[0]))
    base = e.get("base_values") or [0.0]
    return trees, float(base[0])


class _GBTSurvival:
    """Survival curve over positions 1..K from a binary tree ensemble over ``features + [position]``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.n_features = int(spec["n_features"])
        self.K = int(spec["positions"])
        self.floor = float(spec["hazard_floor"])
        if self.K < 1 or self.n_features < 1:
            raise ProgramError("a gbt program needs n_features >= 1 and positions >= 1")
        trees, self.base = _ensemble_trees(spec["ensemble"])
        self.n_trees = len(trees)
        P = self.n_features  # the position column, appended after the features
        # every tree specialised per class of positions: segments of leaves grouped by the positions they serve
        segments: dict[tuple[int, ...], list[tuple[list[float], list[tuple[int, float, int, int]]]]] = {}
        for tree in trees:
            for ks in tree.position_classes(P, self.K):
                leaves, branches = tree.specialised(P, ks[0])
                if any(not 0 <= f < P for f, *_ in branches):
                    raise ProgramError(f"a tree tests feature {max(f for f, *_ in branches)}; the row has {P}")
                segments.setdefault(tuple(ks), []).append((leaves, branches))
        values = array("f")  # per byte of the leaf vector: 8 leaf slots, then 0.0 for an empty byte (float32, as
        # the graph holds them: half the cache lines of doubles to read right after a forward pass)
        tests: dict[int, dict[float, int]] = {}  # feature -> threshold -> AND of the masks of its false nodes
        # per class of positions lo..hi: the bytes first..stop-1 of the leaf vector hold its trees
        self.groups: list[tuple[int, int, int, int]] = []
        ones = bit = 0
        for ks, segs in segments.items():
            first = bit // 8
            for leaves, branches in segs:
                width = 8 * -(-len(leaves) // 8)  # whole bytes per tree
                ones |= 1 << bit
                for f, thr, a, b in branches:  # false (x > thr): the true subtree's leaves are ruled out
                    cleared = ((1 << (b - a)) - 1) << (bit + a)
                    by_thr = tests.setdefault(f, {})
                    by_thr[thr] = by_thr.get(thr, 0) | cleared
                for j in range(width // 8):
                    chunk = leaves[8 * j : 8 * j + 8]
                    values.extend(chunk + [0.0] * (8 - len(chunk)) + [0.0])
                bit += width
            self.groups.append((ks[0], ks[-1], first, bit // 8))
        self.n_bytes = bit // 8
        self.n_specialised = sum(len(segs) for segs in segments.values())
        self.shape = (
            f"{self.n_trees} trees specialised into {self.n_specialised} over {len(segments)} classes of draft "
            f"positions, {bit} leaf slots, {len(tests)} features tested"
        )
        self.bases = [9 * i for i in range(self.n_bytes)]  # where each byte's 9 value slots start
        self.ones = ones
        self.everything = everything = (1 << bit) - 1
        self.values = values
        # per feature: sorted thresholds, and for each count c of thresholds below x the mask of leaves still alive
        self.features: list[tuple[int, list[float], list[int]]] = []
        for f in sorted(tests):
            thr = sorted(tests[f])
            masks, alive = [everything], everything
            for t in thr:
                alive &= ~tests[f][t]
                masks.append(alive)
            self.features.append((f, thr, masks))
        self.thresholds = {f: thr for f, thr, _ in self.features}

    def survival(self, row: Sequence[float]) -> list[float]:
        alive = self.everything
        for f, thr, masks in self.features:
            alive &= masks[bisect_left(thr, row[f])]
        exits = alive & ~(alive - self.ones)  # the leftmost surviving leaf of every tree
        index = exits.to_bytes(self.n_bytes, "little").translate(_ONEHOT_INDEX)
        # running sum of the exit leaves' values, byte by byte; a class of positions takes its span of it
        run = list(accumulate(map(self.values.__getitem__, map(add, self.bases, index)), initial=0.0))
        step = [0.0] * (self.K + 2)  # per-position sums as differences: + at the class's first, - after its last
        step[1] = self.base
        for lo, hi, first, stop in self.groups:
            s = run[stop] - run[first]
            step[lo] += s
            step[hi + 1] -= s
        logit = list(accumulate(step))
        floor, out, surv = self.floor, [], 1.0
        for k in range(1, self.K + 1):
            z = logit[k]
            p = 1.0 / (1.0 + math.exp(-z)) if z > -700.0 else 0.0
            surv *= min(max(p, floor), 1.0)
            out.append(surv)
        return out


class _TableSurvival:
    """Survival curve per cell of a table over binned columns (a cell's index: strides times edges at or below)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.columns = [int(c) for c in spec["columns"]]
        self.edges = [[_f32(float(e)) for e in edges] for edges in spec["edges"]]
        self.strides = [int(s) for s in spec["strides"]]
        self.table = [[float(v) for v in row] for row in spec["survival"]]
        self.n_features = int(spec["n_features"])
        if not (len(self.columns) == len(self.edges) == len(self.strides)):
            raise ProgramError("a table program needs as many columns, edge lists and strides")
        if any(not 0 <= c < self.n_features for c in self.columns):
            raise ProgramError(f"a table program reads columns {self.columns}; the row has {self.n_features}")
        if not all(math.isfinite(v) for row in (*self.edges, *self.table) for v in row):
            raise ProgramError("a table program has an edge or survival value that is not finite")
        top = sum(s * len(e) for s, e in zip(self.strides, self.edges))
        if top >= len(self.table) or any(e != sorted(e) for e in self.edges):
            raise ProgramError("a table program's strides, edges and table do not fit together")
        self.thresholds = dict(zip(self.columns, self.edges))
        self.shape = f"{len(self.table)} cells over {len(self.columns)} binned columns"
        self._bins = list(zip(self.columns, self.edges, self.strides))

    def cell(self, row: Sequence[float]) -> int:
        cell = 0
        for c, edges, stride in self._bins:
            cell += stride * bisect_right(edges, row[c])
        return cell

    def survival(self, row: Sequence[float]) -> list[float]:
        return self.table[self.cell(row)]


class _ConstantSurvival:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.curve = [float(v) for v in spec["survival"]]
        self.n_features = int(spec["n_features"])
        self.thresholds: dict[int, list[float]] = {}
        self.shape = "one survival curve"

    def cell(self, row: Sequence[float]) -> int:
        return 0

    def survival(self, row: Sequence[float]) -> list[float]:
        return self.curve


_SURVIVAL_KINDS = {"gbt": _GBTSurvival, "table": _TableSurvival, "constant": _ConstantSurvival}


class DecisionProgram:
    """One decision head of an export: expected tokens per candidate gamma from one feature row.

    Parameters
    ----------
    spec : dict
        A head of the ``speckv.program`` metadata: ``kind`` (``gbt``,
        ``table``, ``constant`` or ``tokens``), ``candidates`` and the kind's
        data (see the module docstring).

    Attributes
    ----------
    kind : str
    candidates : list of int
    n_features : int
        Leading columns of the row the head reads.
    thresholds : dict of int to list of float
        Per column, the values at which the head's output may change (the check
        rows of :class:`~speckv_policy.runtime.RuntimePolicy` straddle them).
    shape : str
        What was compiled, in words (e.g. trees and their position classes).
    cell_of : callable or None
        ``cell_of(row) -> int``: the cell of a ``table``, ``constant`` or
        ``tokens`` head that ``row`` falls in. Rows of one cell and one
        compression code get the same expected tokens, so the same decision
        at any prices (:class:`~speckv_policy.runtime.RuntimePolicy` memoises
        decisions by it). ``None`` for a ``gbt`` head.

    Raises
    ------
    ProgramError
        If the spec is malformed or of an unknown kind.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        try:
            self.kind = str(spec["kind"])
            self.candidates = [int(c) for c in spec["candidates"]]
            if self.kind == "tokens":
                self._tokens_by_code = [[float(v) for v in row] for row in spec["tokens"]]
                self._code_column = int(spec["code_column"])
                self.n_features = int(spec["n_features"])
                self.thresholds = {self._code_column: [0.5, 1.5]}
                self.cell_of: Callable[[Sequence[float]], int] | None = self._code_of
                self.shape = f"expected tokens for {len(self._tokens_by_code)} compression codes"
                if any(len(r) != len(self.candidates) for r in self._tokens_by_code):
                    raise ProgramError("a tokens program needs one value per candidate per compression code")
                return
            if self.kind not in _SURVIVAL_KINDS:
                raise ProgramError(f"unknown program kind {self.kind!r}; known: tokens, {', '.join(_SURVIVAL_KINDS)}")
            self._head = _SURVIVAL_KINDS[self.kind](spec)
        except ProgramError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
            raise ProgramError(f"malformed {spec.get('kind', '?')!r} program ({type(exc).__name__}: {exc})") from None
        self.n_features = self._head.n_features
        self.thresholds = self._head.thresholds
        self.shape = self._head.shape
        self.cell_of = getattr(self._head, "cell", None)
        if not self.candidates or min(self.candidates) < 0:
            raise ProgramError(f"a program's candidates must be gammas >= 0, got {self.candidates}")
        K = max(self.candidates)
        probe = self._head.survival([0.0] * self.n_features)
        if len(probe) < K:
            raise ProgramError(f"the survival curve has {len(probe)} positions; candidate {K} needs {K}")

    def _code_of(self, row: Sequence[float]) -> int:
        """A ``tokens`` head's row of expected tokens: the compression code it reads, clipped to the codes it has."""
        return min(max(round(row[self._code_column]), 0), len(self._tokens_by_code) - 1)

    def expected_tokens(self, row: Sequence[float]) -> list[float]:
        """Expected tokens per step for each candidate: ``1 + sum of the survival curve up to gamma``.

        ``row`` holds float32 values (:func:`float32_row`), at least
        :attr:`n_features` of them.
        """
        if self.kind == "tokens":
            return self._tokens_by_code[self._code_of(row)]
        cum = list(accumulate(self._head.survival(row), initial=1.0))
        return [cum[c] for c in self.candidates]
