"""Runtime policy: load an exported ONNX policy and decide gamma per step.

Imports only numpy, onnxruntime and the package's pure-Python schema and
feature modules: no scikit-learn, no torch.

Errors are explicit by default. Pass ``fallback_gamma`` to get the
documented safe behaviour instead: any failure (unreadable or corrupt file,
schema mismatch, NaN/inf features, an inference error) makes :meth:`decide`
return ``fallback_gamma`` and emits ONE :class:`PolicyFallbackWarning` per
policy object; generation goes on, and since any gamma is lossless its output
does not change.
"""

from __future__ import annotations

import json
import os
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .features import as_feature_matrix
from .objective import CostModel, per_second_scale
from .program import PROGRAM_VERSION, DecisionProgram, ProgramError, float32_row
from .schema import COMPRESSION_CODES, FEATURE_SETS, N_COMPRESSION_CODES, FeatureSet

#: What a caller who wants fallbacks is advised to use: HF's classic fixed length.
DEFAULT_FALLBACK_GAMMA = 4
MAX_FALLBACK_GAMMA = 32
#: The ``speckv.*`` metadata keys every export must carry (the runtime checks each).
REQUIRED_METADATA = (
    "speckv.format_version",
    "speckv.feature_set",
    "speckv.feature_names",
    "speckv.feature_schema_version",
    "speckv.candidates",
    "speckv.compression_codes",
)
SUPPORTED_FORMAT_VERSION = 1
#: Decision engines: ``auto`` = the export's Python program where it has one that agrees with onnxruntime.
ENGINES = ("auto", "python", "onnxruntime")
#: Rows the Python program is checked on against onnxruntime at load.
PROGRAM_CHECK_ROWS = 512
#: The compression codes a feature row may carry (any other value is refused, never clipped to a known one).
_KNOWN_CODES = tuple(float(c) for c in range(N_COMPRESSION_CODES))


def _first_best(candidates: list[int], values: list[float]) -> int:
    """The candidate of the largest value, the first of equals (as ONNX ArgMax)."""
    return candidates[max(range(len(values)), key=values.__getitem__)]


class PolicyLoadError(RuntimeError):
    """An exported policy file is unreadable, corrupt or of another schema."""


class PolicyFallbackWarning(RuntimeWarning):
    """A runtime policy failed and returned its fallback gamma."""


def _import_ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "speckv_policy.runtime needs onnxruntime: pip install 'speckv-policy[cpu]' "
            "(or 'speckv-policy[cuda]' for onnxruntime-gpu)"
        ) from exc
    return ort


def _resolve_providers(providers: str | Sequence[str], available: Sequence[str]) -> list[str]:
    if isinstance(providers, str):
        key = providers.lower()
        if key == "cpu":
            return ["CPUExecutionProvider"]
        if key == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise PolicyLoadError(
                    "CUDA was requested but onnxruntime offers only "
                    f"{', '.join(available)}; install onnxruntime-gpu (speckv-policy[cuda])"
                )
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        raise ValueError(f"providers must be 'cpu', 'cuda' or a list of provider names, got {providers!r}")
    return list(providers)


class RuntimePolicy:
    """An exported gamma policy, ready to decide.

    Parameters
    ----------
    path : str or PathLike
        The ``.onnx`` file written by ``speckv-export``.
    providers : {'cpu', 'cuda'} or list of str, default='cpu'
        onnxruntime execution providers. ``'cuda'`` raises if the CUDA
        provider is not installed; :attr:`provider` tells which one runs the
        graph (batch calls, and single decisions unless :attr:`engine` is
        ``'python'``).
    fallback_gamma : int or None, default=None
        ``None``: failures raise. An int: failures return it, with one warning.
    intra_op_num_threads : int, default=1
        onnxruntime threads; one is fastest for a per-step decision.
    costs : CostModel, dict, path or None, default=None
        Re-price the export for the machine it runs on: decide the argmax of
        expected tokens over step time under this cost model (e.g. the JSON
        ``speckv-calibrate`` writes) instead of the one the export was priced
        with. The acceptance model (expected tokens per candidate) is the
        export's own; only the prices change. Needs an export that maximises
        tokens per second (:attr:`repriceable`).
    engine : {'auto', 'python', 'onnxruntime'}, default='auto'
        What runs a single decision (:meth:`decide`, :meth:`decide_gate`).
        ``'python'``: the export's decision program (``speckv.program``
        metadata, :mod:`speckv_policy.program`) in plain Python, which stays
        fast right after a model's forward pass, where onnxruntime's code runs
        cold; raises if the export has none or it disagrees with the graph.
        ``'onnxruntime'``: always the graph. ``'auto'``: the program where the
        export has one that agrees with the graph on check rows straddling
        every threshold (GBT, table and fixed policies), else the graph.
        Batch methods always run the graph.
    cost_model : CostModel, dict, path or None, default=None
        Deprecated spelling of ``costs`` (one name for costs everywhere); still
        honoured this release, with a ``DeprecationWarning``.

    Attributes
    ----------
    feature_set : FeatureSet
        The schema the model was trained on (checked against this package's).
    candidates : ndarray of int64
        Gammas the model can return.
    metadata : dict of str to str
        The model's ``speckv.*`` metadata.
    cost_model : CostModel or None
        The cost model decisions are priced with: the one given, else the
        export's own (None for an export without one).
    repriced : bool
        Whether decisions use a cost model other than the export's own.
    repriceable : bool
        Whether the export can be re-priced: it maximises tokens per second and
        outputs ``expected_tokens`` (every speckv export except tokens-per-step
        ones, e.g. the published MLP16 recipe).
    gated : bool
        Whether the export is a gated policy (feature set ``gated``): then
        :meth:`decide_gate` says whether to draft at all before the probe, from
        the leading ``pre`` columns, and :meth:`decide` is the length head.
    engine : {'python', 'onnxruntime', 'none'}
        What runs :meth:`decide` and :meth:`decide_gate` ('none' if not loaded).
    program_error : str or None
        Why an export's program is not used (``engine='auto'``), e.g. none
        written (MLP policies) or a disagreement with the graph.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        providers: str | Sequence[str] = "cpu",
        fallback_gamma: int | None = None,
        intra_op_num_threads: int = 1,
        costs: Any = None,
        engine: str = "auto",
        cost_model: Any = None,
    ) -> None:
        if cost_model is not None:
            if costs is not None:
                raise ValueError("give costs= only (cost_model= is its deprecated spelling)")
            warnings.warn(
                "RuntimePolicy(cost_model=...) is deprecated and will be removed in the next release; pass costs=...",
                DeprecationWarning,
                stacklevel=2,
            )
            costs = cost_model
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if fallback_gamma is not None and (
            isinstance(fallback_gamma, bool)
            or not isinstance(fallback_gamma, (int, np.integer))
            or not 0 <= fallback_gamma <= MAX_FALLBACK_GAMMA
        ):
            raise ValueError(
                f"fallback_gamma must be an int in 0..{MAX_FALLBACK_GAMMA} or None, got {fallback_gamma!r}"
            )
        self.path = os.fspath(path)
        self.fallback_gamma = None if fallback_gamma is None else int(fallback_gamma)
        self._warned = False
        self.load_error: Exception | None = None
        self._session: Any = None
        self.metadata: dict[str, str] = {}
        self.candidates = np.empty(0, np.int64)
        self.feature_set: FeatureSet | None = None
        self.provider = "none"
        self._x: np.ndarray | None = None
        self.cost_model: CostModel | None = None
        self.repriced = False
        self._times: np.ndarray | None = None  # float32 (3, G) step times when re-priced
        self._gate_times: np.ndarray | None = None  # the same without the probe, for a gated export's gate
        self.gated = False
        self._scale = np.float32(1.0)
        self._code_index = 0
        self._candidate_set: frozenset[int] = frozenset()
        self.engine = "none"
        self.program_error: str | None = None
        self._program: DecisionProgram | None = None  # the length head's (or only) program
        self._gate_program: DecisionProgram | None = None
        self._prices: list[list[float]] | None = None  # step times per code x candidate for the program, or None
        self._gate_prices: list[list[float]] | None = None
        # the programs' decisions per (cell, compression code) under the current prices (cleared when they change)
        self._memo: dict[int, int] = {}
        self._gate_memo: dict[int, int] = {}
        self._width = -1  # features per row
        try:
            self._load(providers, intra_op_num_threads)
            self.engine = "onnxruntime"
            if engine != "onnxruntime":
                self._load_program(required=engine == "python")
            if costs is not None:
                self.reprice(costs)
        except (PolicyLoadError, OSError) as exc:
            if self.fallback_gamma is None:
                raise
            self.load_error = exc
            self._session = self._x = self._program = self._gate_program = (
                None  # a half-configured policy never decides
            )
            self.engine = "none"
            self._fallback(exc)

    # -- pricing -----------------------------------------------------------
    @property
    def repriceable(self) -> bool:
        return self.metadata.get("speckv.objective", "tokens_per_second") == "tokens_per_second"

    def reprice(self, cost_model: Any) -> None:
        """Decide under ``cost_model`` from now on (a :class:`CostModel`, its dict, or a JSON file).

        ``cost_model`` brings the machine's times; the draft tokens the export's
        decision mode pays before deciding (``decision_draft_tokens``: the upfront
        probe) stay the export's own, as :func:`speckv_policy.export.reprice_onnx` keeps them.

        Raises
        ------
        PolicyLoadError
            If the export maximises tokens per step, or the cost model cannot be read.
        """
        if not self.repriceable:
            raise PolicyLoadError(
                f"{self.path}: this export maximises {self.metadata.get('speckv.objective')}; "
                "a cost model does not change its decisions"
            )
        try:
            cm = CostModel.load(cost_model)
        except (ValueError, FileNotFoundError) as exc:
            raise PolicyLoadError(f"{self.path}: cannot re-price: {exc}") from exc
        if self.gated:  # the gate is priced without the probe, the length head with it
            head = replace(cm, decision_draft_tokens=1)
            self._set_times(head.time_table(self.candidates), cm.unit)
            self._gate_times = self._times_table(replace(cm, decision_draft_tokens=0).time_table(self.candidates))
            cm = head
        else:
            cm = cm.priced_like(self.cost_model)  # the probe is the export's decision mode, not the machine's
            self.set_step_times(cm.time_table(self.candidates), unit=cm.unit)
        self.cost_model = cm
        self.repriced = True
        self._set_program_prices()

    def set_step_times(self, times: Any, unit: str = "ms") -> None:
        """Decide with these step times: shape ``(3, G)``, row = compression code, column = candidate.

        The fast path for live cost estimates (:func:`speckv_policy.hf.attach` with
        ``costs="live"``): no cost model object, just the table. Not for a gated
        export, whose gate and head are priced differently: use :meth:`reprice`.
        """
        if self.gated:
            raise ValueError(f"{self.path}: a gated export is re-priced with a cost model (reprice), not one table")
        self._set_times(times, unit)

    def _times_table(self, times: Any) -> np.ndarray:
        t = np.asarray(times, dtype=np.float32)
        if t.shape != (N_COMPRESSION_CODES, len(self.candidates)) or not np.all(np.isfinite(t)) or (t <= 0).any():
            raise ValueError(
                f"step times must be a finite, positive ({N_COMPRESSION_CODES}, {len(self.candidates)}) table "
                f"(compression code x candidate {self.candidates.tolist()}), got shape {t.shape}"
            )
        return t

    def _set_times(self, times: Any, unit: str) -> None:
        self._times = self._times_table(times)
        self._scale = np.float32(per_second_scale(unit))
        self.repriced = True
        if self._program is not None:
            self._prices = self._times.tolist()
            self._memo.clear()

    def _priced(
        self, expected_tokens: np.ndarray, x: np.ndarray, times: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(gamma, values) under the re-priced step times (``times``, default the head's), in float32 like the graph."""
        table = self._times if times is None else times
        bad = ~(np.isfinite(expected_tokens) & (expected_tokens >= 0))
        if bad.any():
            i, j = (int(v[0]) for v in np.nonzero(bad))
            raise PolicyLoadError(
                f"{self.path}: the model's expected tokens for gamma {self.candidates[j]} (row {i}) is "
                f"{float(expected_tokens[i, j])!r}, expected a finite number >= 0"
            )
        codes = np.clip(np.rint(x[:, self._code_index]), 0, N_COMPRESSION_CODES - 1).astype(np.int64)
        values = (expected_tokens / table[codes]) * self._scale  # type: ignore[index]
        return self.candidates[np.argmax(values, axis=1)], values

    # -- loading ---------------------------------------------------------
    def _load(self, providers: str | Sequence[str], threads: int) -> None:
        ort = _import_ort()
        if not os.path.exists(self.path):
            raise PolicyLoadError(f"{self.path}: no such policy file")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        wanted = _resolve_providers(providers, ort.get_available_providers())
        try:
            sess = ort.InferenceSession(self.path, sess_options=opts, providers=wanted)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise PolicyLoadError(f"{self.path}: not a loadable ONNX model ({exc})") from exc
        meta = dict(sess.get_modelmeta().custom_metadata_map)
        self.metadata = {k: v for k, v in meta.items() if k.startswith("speckv.")}
        self._check_metadata()
        names = {i.name for i in sess.get_inputs()}
        outs = {o.name for o in sess.get_outputs()}
        if names != {"features"} or not {"gamma", "values", "expected_tokens"} <= outs:
            raise PolicyLoadError(
                f"{self.path}: expected input 'features' and outputs gamma, values, expected_tokens; "
                f"got inputs {sorted(names)} outputs {sorted(outs)}"
            )
        self.gated = "gate" in outs
        if self.gated != (self.feature_set is not None and self.feature_set.name == "gated") or (
            self.gated and "gate_expected_tokens" not in outs
        ):
            raise PolicyLoadError(
                f"{self.path}: a gated export has feature set 'gated' and outputs gate and gate_expected_tokens; "
                f"got feature set {self.metadata.get('speckv.feature_set')!r} and outputs {sorted(outs)}"
            )
        self._session = sess
        self.provider = sess.get_providers()[0]
        if isinstance(providers, str) and providers.lower() == "cuda" and self.provider != "CUDAExecutionProvider":
            raise PolicyLoadError(f"{self.path}: CUDA was requested but onnxruntime runs it on {self.provider}")
        self._x = np.zeros((1, self.feature_set.n_features), dtype=np.float32)  # type: ignore[union-attr]
        self._width = self.feature_set.n_features  # type: ignore[union-attr]
        try:  # the first run allocates and plans; pay it at load, not on a decoding step
            sess.run(["gamma"], {"features": self._x})
            # one decision = one call on buffers bound once: no per-call allocation of inputs or outputs
            # (measured ~50 us less right after a model forward, see docs/design.md)
            self._gamma_out = np.zeros(1, dtype=np.int64)
            self._io = sess.io_binding()
            self._io.bind_ortvalue_input("features", ort.OrtValue.ortvalue_from_numpy(self._x))
            self._io.bind_ortvalue_output("gamma", ort.OrtValue.ortvalue_from_numpy(self._gamma_out))
            sess.run_with_iobinding(self._io)
            if self.gated:
                self._gate_out = np.zeros(1, dtype=np.int64)
                self._io_gate = sess.io_binding()
                self._io_gate.bind_ortvalue_input("features", ort.OrtValue.ortvalue_from_numpy(self._x))
                self._io_gate.bind_ortvalue_output("gate", ort.OrtValue.ortvalue_from_numpy(self._gate_out))
                sess.run_with_iobinding(self._io_gate)
        except Exception as exc:
            raise PolicyLoadError(f"{self.path}: the model does not run on a feature row ({exc})") from exc

    # -- the Python engine -------------------------------------------------
    @property
    def read_features(self) -> tuple[str, ...]:
        """Names of the features a single decision can depend on, in feature-set order.

        On the Python engine: the columns its decision programs test (checked
        against the graph at load), plus the compression code (the prices depend
        on it). Otherwise every feature of the set (an MLP reads them all), and
        none for a policy that did not load. A caller may skip computing a
        feature not named here and pass any finite value in its place: the hook
        does so for ``context_match_len`` (a context scan per step).
        """
        if self.feature_set is None:
            return ()
        names = self.feature_set.names
        if self._program is None:
            return tuple(names)
        cols = {self._code_index}
        for program in (self._program, self._gate_program):
            if program is not None:
                cols.update(program.thresholds)
        return tuple(n for j, n in enumerate(names) if j in cols)

    @property
    def program(self) -> DecisionProgram | None:
        """The length head's (or only) decision program the Python engine runs; None on onnxruntime."""
        return self._program

    @property
    def gate_program(self) -> DecisionProgram | None:
        """A gated export's gate program on the Python engine; None otherwise."""
        return self._gate_program

    def _load_program(self, required: bool) -> None:
        """Compile the export's decision program and check it against the graph; use it if they agree."""
        why = None
        raw = self.metadata.get("speckv.program")
        if raw is None:
            why = "the export has no decision program (MLP and paper-MLP16 exports have none)"
        else:
            try:
                spec = json.loads(raw)
                if int(spec["version"]) > PROGRAM_VERSION:
                    raise ProgramError(f"program version {spec['version']} is newer than this runtime reads")
                head = DecisionProgram(spec["decide"])
                gate = DecisionProgram(spec["gate"]) if "gate" in spec else None
                if head.candidates != self.candidates.tolist() or (gate is not None) != self.gated:
                    raise ProgramError("its candidates or heads differ from the graph's")
                if max(head.n_features, gate.n_features if gate else 0) > self._x.shape[1]:  # type: ignore[union-attr]
                    raise ProgramError("it reads more columns than the feature set has")
                if self.repriceable and self.cost_model is None:
                    raise ProgramError("the export has no cost model to price it with")
                self._program, self._gate_program = head, gate
                self._set_program_prices()
                self._check_program()
            except (ProgramError, ValueError, KeyError, TypeError, AttributeError) as exc:
                self._program = self._gate_program = self._prices = self._gate_prices = None
                why = f"its decision program is not usable ({exc})"
        if why is not None:
            if required:
                raise PolicyLoadError(f"{self.path}: engine='python' needs a usable decision program; {why}")
            self.program_error = why
            return
        self.engine = "python"

    def _set_program_prices(self) -> None:
        """Step times per compression code x candidate, as lists, for the programs (None: tokens per step)."""
        self._memo.clear()
        self._gate_memo.clear()
        if self._program is None:
            return
        if not self.repriceable:
            self._prices = self._gate_prices = None
            return
        self._prices = (self._times if self._times is not None else self._own_times(gate=False)).tolist()
        if self.gated:
            self._gate_prices = (
                self._gate_times if self._gate_times is not None else self._own_times(gate=True)
            ).tolist()

    def _own_times(self, *, gate: bool) -> np.ndarray:
        """The export's own step times (not re-priced), float32 (3, G): the gate's without the probe."""
        cm: Any = self.cost_model
        return np.float32((replace(cm, decision_draft_tokens=0) if gate else cm).time_table(self.candidates))

    def _program_values(self, program: DecisionProgram, prices: list[list[float]] | None, row: list[float]) -> list:
        tokens = program.expected_tokens(row)
        total = sum(tokens)
        if total - total != 0.0 or min(tokens) < 0:  # NaN, inf or negative: the runtime's contract refuses them
            raise PolicyLoadError(
                f"{self.path}: the model's expected tokens {list(tokens)} are not all finite numbers >= 0"
            )
        if prices is None:
            return tokens
        times = prices[int(row[self._code_index])]  # a known code (_row_list checks)
        return [e / t for e, t in zip(tokens, times)]

    def _program_gamma(
        self,
        program: DecisionProgram,
        prices: list[list[float]] | None,
        row: list[float],
        memo: dict[int, int] | None = None,
    ) -> int:
        """The program's decision; memoised in ``memo`` by cell and compression code where the head has cells.

        Inside generation every line a decision runs starts cold (docs/design.md), so a table head's decision
        is worked out once per cell and code at the current prices and then looked up.
        """
        cell_of = program.cell_of
        if memo is None or cell_of is None:
            return _first_best(program.candidates, self._program_values(program, prices, row))
        key = cell_of(row) * N_COMPRESSION_CODES + int(row[self._code_index])  # a known code (_row_list checks)
        g = memo.get(key)
        if g is None:
            g = memo[key] = _first_best(program.candidates, self._program_values(program, prices, row))
        return g

    def _memo_hit(self, program: DecisionProgram, memo: dict[int, int], features: Any) -> int | None:
        """The memoised decision for a list row of finite values, else None (then the full path runs and checks).

        The short path inside generation, where every line runs cold (docs/design.md): one step's list from
        :meth:`~speckv_policy.features.OnlineFeatureState.pre_values` goes straight to its cell's decision.
        """
        cell_of = program.cell_of
        if cell_of is None or type(features) is not list or len(features) != self._width:
            return None
        row = array("f", features).tolist()  # float32, as the graph reads it
        total = sum(row)
        code = row[self._code_index]
        if total - total != 0.0 or code not in _KNOWN_CODES:  # NaN, inf or an unknown code: the full path raises
            return None
        return memo.get(cell_of(row) * N_COMPRESSION_CODES + int(code))

    def _check_rows(self) -> np.ndarray:
        """Rows straddling every threshold the programs test (each value and the next float32 above it)."""
        F = self._x.shape[1]  # type: ignore[union-attr]
        choices: list[list[float]] = []
        for j in range(F):
            if j == self._code_index:
                choices.append([0.0, 1.0, 2.0])
                continue
            thr = [t for p in (self._program, self._gate_program) if p is not None for t in p.thresholds.get(j, [])]
            up = np.nextafter(np.float32(thr), np.float32(np.inf)).tolist() if thr else []
            choices.append(sorted({0.0, 1.0, *thr, *up}))
        rng = np.random.default_rng(0)
        cols = [rng.choice(np.asarray(c, dtype=np.float32), PROGRAM_CHECK_ROWS) for c in choices]
        return np.stack(cols, axis=1).astype(np.float32)

    def _check_program(self) -> None:
        """Raise ProgramError unless the programs give the graph's expected tokens and decisions on check rows."""
        X = self._check_rows()
        heads = [("gamma", "expected_tokens", self._program, self._prices)]
        if self._gate_program is not None:
            heads.append(("gate", "gate_expected_tokens", self._gate_program, self._gate_prices))
        for decision, tokens, program, prices in heads:
            d, e = self._session.run([decision, tokens], {"features": X})
            for i, row in enumerate(X.tolist()):
                mine = program.expected_tokens(row)  # type: ignore[union-attr]
                if max(abs(a - b) for a, b in zip(mine, e[i].tolist())) > 1e-4 * max(1.0, max(mine)):
                    raise ProgramError(f"expected tokens differ from the graph's on check row {i}")
                values = self._program_values(program, prices, row)  # type: ignore[arg-type]
                top = sorted(values, reverse=True)
                if len(top) > 1 and top[0] - top[1] <= 1e-5 * abs(top[0]):
                    continue  # a tie within float32 rounding: either answer is the graph's up to rounding
                g = _first_best(program.candidates, values)  # type: ignore[union-attr]
                if (g > 0 if decision == "gate" else g) != (bool(d[i]) if decision == "gate" else int(d[i])):
                    raise ProgramError(f"its {decision} differs from the graph's on check row {i}")

    def _row_list(self, features: Any, caller: str) -> list[float]:
        """One step's features as float32 values in a Python list, checked (the Python engine's input)."""
        if type(features) is list and len(features) == self._width:
            row = float32_row(features)  # rounded as the graph's float32 input would be
        elif type(features) is np.ndarray and features.dtype == np.float32 and features.shape == (self._width,):
            row = features.tolist()
        else:
            row = self._one_row(features, caller)[0].tolist()
        total = sum(row)
        if total - total != 0.0:  # NaN or inf somewhere (float32 values cannot sum to inf)
            raise self._non_finite(row)
        if row[self._code_index] not in _KNOWN_CODES:
            raise self._unknown_code(row[self._code_index])
        return row

    def _non_finite(self, row: Sequence[float]) -> ValueError:
        """The error for a row with NaN or inf values, naming their features."""
        names = self.feature_set.names if self.feature_set is not None else ()
        bad = [names[j] if j < len(names) else str(j) for j, v in enumerate(row) if v - v != 0.0]
        return ValueError(f"non-finite feature values (NaN or inf) in: {', '.join(bad)}")

    def _check_metadata(self) -> None:
        try:
            self._parse_metadata()
        except PolicyLoadError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise PolicyLoadError(f"{self.path}: malformed speckv metadata ({type(exc).__name__}: {exc})") from None

    def _parse_metadata(self) -> None:
        m = self.metadata
        missing = [k for k in REQUIRED_METADATA if k not in m]
        if missing:
            raise PolicyLoadError(f"{self.path}: not a speckv-policy export (metadata lacks {', '.join(missing)})")
        fmt = int(m["speckv.format_version"])  # malformed values: _check_metadata names the file
        if fmt > SUPPORTED_FORMAT_VERSION:
            raise PolicyLoadError(
                f"{self.path}: export format {m['speckv.format_version']} is newer than this runtime "
                f"supports ({SUPPORTED_FORMAT_VERSION}); upgrade speckv-policy"
            )
        name = m["speckv.feature_set"]
        fs = FEATURE_SETS.get(name)
        if fs is None:
            raise PolicyLoadError(
                f"{self.path}: unknown feature set {name!r}; this package knows {', '.join(FEATURE_SETS)}"
            )
        names = tuple(json.loads(m["speckv.feature_names"]))
        version = int(m["speckv.feature_schema_version"])
        if names != fs.names or version != fs.version:
            raise PolicyLoadError(
                f"{self.path}: feature schema mismatch for set {name!r}: the model expects "
                f"v{version} {list(names)}, this package computes v{fs.version} {list(fs.names)}"
            )
        codes = json.loads(m["speckv.compression_codes"])
        if codes != COMPRESSION_CODES:
            raise PolicyLoadError(
                f"{self.path}: compression codes {codes} differ from this package's {COMPRESSION_CODES}"
            )
        self.feature_set = fs
        self.candidates = np.asarray(json.loads(m["speckv.candidates"]), dtype=np.int64).reshape(-1)
        if self.candidates.size == 0 or (self.candidates < 0).any():
            raise PolicyLoadError(f"{self.path}: speckv.candidates must be gammas >= 0, got {m['speckv.candidates']}")
        self._code_index = fs.index("compression_code")
        self._candidate_set = frozenset(int(c) for c in self.candidates)
        if "speckv.cost_model" in m:
            try:
                self.cost_model = CostModel.from_dict(json.loads(m["speckv.cost_model"]))
            except (TypeError, ValueError) as exc:
                raise PolicyLoadError(f"{self.path}: unreadable speckv.cost_model metadata ({exc})") from exc

    # -- deciding ----------------------------------------------------------
    def _fallback(self, exc: Exception) -> int:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"speckv policy {self.path} failed ({exc}); using fallback gamma {self.fallback_gamma} "
                "(further failures of this policy are silent)",
                PolicyFallbackWarning,
                stacklevel=3,
            )
        return int(self.fallback_gamma)  # type: ignore[arg-type]

    def _matrix(self, features: Any) -> np.ndarray:
        if self._session is None:
            raise PolicyLoadError(f"{self.path}: policy is not loaded ({self.load_error})")
        X = as_feature_matrix(features, self.feature_set)  # type: ignore[arg-type]
        if not np.all(np.isfinite(X)):
            bad = [self.feature_set.names[j] for j in np.flatnonzero(~np.isfinite(X).all(axis=0))]  # type: ignore[union-attr]
            raise ValueError(f"non-finite feature values (NaN or inf) in: {', '.join(bad)}")
        codes = X[:, self._code_index]
        unknown = ~np.isin(codes, _KNOWN_CODES)
        if unknown.any():
            raise self._unknown_code(codes[unknown][0], int(np.flatnonzero(unknown)[0]))
        return X

    def _unknown_code(self, value: float, row: int = 0) -> ValueError:
        return ValueError(
            f"compression_code {value:g} (row {row}) is not a known compression code "
            f"({', '.join(f'{c} {n}' for n, c in COMPRESSION_CODES.items())})"
        )

    def _checked_gammas(self, gamma: np.ndarray) -> np.ndarray:
        """``gamma`` if every value is one of the candidates; PolicyLoadError naming the first that is not."""
        gamma = np.asarray(gamma).astype(np.int64).reshape(-1)
        bad = ~np.isin(gamma, self.candidates)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PolicyLoadError(
                f"{self.path}: the model returned gamma {gamma[i]} (row {i}), not one of its candidates "
                f"{self.candidates.tolist()}"
            )
        return gamma

    def _checked_gate(self, opened: np.ndarray) -> np.ndarray:
        """Gate outputs as bools if every value is 0 or 1; PolicyLoadError naming the first that is not."""
        opened = np.asarray(opened).reshape(-1)
        bad = (opened != 0) & (opened != 1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PolicyLoadError(
                f"{self.path}: the model's gate returned {opened[i].item()!r} (row {i}), expected 0 or 1"
            )
        return opened.astype(bool)

    def _one_row(self, features: Any, caller: str) -> np.ndarray:
        """One step's features, checked and copied into the input buffer bound at load: ``(1, F)`` float32."""
        if self._x is None:
            raise PolicyLoadError(f"{self.path}: policy is not loaded ({self.load_error})")
        if type(features) is np.ndarray and features.dtype == np.float32 and features.shape == self._x.shape[1:]:
            if not np.isfinite(features).all():
                raise self._non_finite(features.tolist())
            if float(features[self._code_index]) not in _KNOWN_CODES:
                raise self._unknown_code(float(features[self._code_index]))
            self._x[0] = features
        else:
            x = self._matrix(features)
            if x.shape[0] != 1:
                raise ValueError(f"{caller}() takes one step's features, got {x.shape[0]} rows; use decide_batch")
            self._x[...] = x
        return self._x

    def decide(self, features: Any, drafting_overhead: float = 0.0) -> int:
        """Gamma for one step.

        Parameters
        ----------
        features : sequence of float, ndarray (F,) or mapping name -> value
            One step's features, in the model's feature set.
        drafting_overhead : float, default=0.0
            A cost this step pays on top of its priced time wherever its draft runs (every candidate but 0, and 0
            too where the policy decides after a probe token), in the cost model's unit: a vLLM request's draft
            catching up on the context it missed while shut. An export that maximises tokens per step ignores it.

        Returns
        -------
        int
            A gamma from :attr:`candidates` (or the fallback gamma).
        """
        try:
            if drafting_overhead and self._overhead_applies(drafting_overhead):
                return self._decide_with_overhead(features, drafting_overhead, gate=False)
            if self._program is not None:
                g = self._memo_hit(self._program, self._memo, features)
                if g is not None:
                    return g
                return self._program_gamma(self._program, self._prices, self._row_list(features, "decide"), self._memo)
            x = self._one_row(features, "decide")
            if self._times is not None:
                e = self._session.run(["expected_tokens"], {"features": x})[0]
                return int(self._priced(e, x)[0][0])
            self._session.run_with_iobinding(self._io)
            g = int(self._gamma_out[0])
            if g not in self._candidate_set:
                raise PolicyLoadError(
                    f"{self.path}: the model returned gamma {g}, not one of its candidates {self.candidates.tolist()}"
                )
            return g
        except Exception as exc:
            if self.fallback_gamma is None:
                raise
            return self._fallback(exc)

    def decide_gate(self, features: Any, drafting_overhead: float = 0.0) -> bool:
        """A gated export's gate: whether to draft this step (before any draft token exists).

        ``features`` is a ``gated`` row; the gate reads only its leading
        ``pre`` columns, so the probe token's columns may hold anything (0).
        With ``fallback_gamma`` set, a failure opens the gate (the length
        head, or the fallback, then decides), with the one warning.
        ``drafting_overhead`` is as in :meth:`decide`.

        Raises
        ------
        PolicyLoadError
            If this export is not gated (and no fallback is set).
        """
        try:
            if self._x is not None and not self.gated:
                raise PolicyLoadError(f"{self.path}: not a gated export (feature set {self.feature_set.name})")  # type: ignore[union-attr]
            if drafting_overhead and self._overhead_applies(drafting_overhead):
                return self._decide_with_overhead(features, drafting_overhead, gate=True) > 0
            if self._gate_program is not None:
                g = self._memo_hit(self._gate_program, self._gate_memo, features)
                if g is not None:
                    return g > 0
                row = self._row_list(features, "decide_gate")
                return self._program_gamma(self._gate_program, self._gate_prices, row, self._gate_memo) > 0
            x = self._one_row(features, "decide_gate")
            if self._gate_times is not None:
                return bool(self._gate_batch(x)[0])
            self._session.run_with_iobinding(self._io_gate)
            return bool(self._checked_gate(self._gate_out)[0])
        except Exception as exc:
            if self.fallback_gamma is None:
                raise
            self._fallback(exc)
            return True

    def _overhead_applies(self, overhead: float) -> bool:
        """Whether a drafting overhead moves this export's decisions (not for one that maximises tokens per step)."""
        if not (overhead >= 0 and np.isfinite(overhead)):
            raise ValueError(f"drafting_overhead must be a finite cost >= 0 in the cost model's unit, got {overhead!r}")
        return self.repriceable

    def _decide_with_overhead(self, features: Any, overhead: float, *, gate: bool) -> int:
        """The gate's (``gate``) or the length head's gamma with ``overhead`` added to the step time of every
        candidate for which the draft runs (all of them for a length head that decides after a probe token, whose
        draft has run by then); no memo, since the overhead differs from request to request."""
        caller = "decide_gate" if gate else "decide"
        probe = 0 if gate else self.cost_model.decision_draft_tokens  # type: ignore[union-attr]
        program = self._gate_program if gate else self._program
        if program is not None:
            row = self._row_list(features, caller)
            tokens = self._program_values(program, None, row)
            times = (self._gate_prices if gate else self._prices)[int(row[self._code_index])]  # type: ignore[index]
            values = [
                e / (t + overhead if max(c, probe) > 0 else t) for e, t, c in zip(tokens, times, program.candidates)
            ]
            return _first_best(program.candidates, values)
        x = self._one_row(features, caller)
        e = self._session.run(["gate_expected_tokens" if gate else "expected_tokens"], {"features": x})[0]
        table = self._gate_times if gate else self._times
        if table is None:  # not re-priced: the export's own costs, as its graph prices them
            table = self._own_times(gate=gate)
        drafts = np.maximum(self.candidates, probe) > 0
        return int(self._priced(e, x, table + np.float32(overhead) * drafts)[0][0])

    def _gate_batch(self, x: np.ndarray) -> np.ndarray:
        if self._gate_times is None:
            return self._checked_gate(self._session.run(["gate"], {"features": x})[0])
        e = self._session.run(["gate_expected_tokens"], {"features": x})[0]
        return self._priced(e, x, self._gate_times)[0] > 0

    def decide_gated_batch(self, features: Any) -> tuple[np.ndarray, np.ndarray]:
        """A gated export's decisions per row: ``(gamma, gate_open)``; gamma is 0 where the gate is closed."""
        if not self.gated:
            raise PolicyLoadError(f"{self.path}: not a gated export (feature set {self.feature_set.name})")  # type: ignore[union-attr]
        x = self._matrix(features)
        opened = self._gate_batch(x)
        return np.where(opened, self.decide_batch(x), 0).astype(np.int64), opened

    def decide_batch(self, features: Any) -> np.ndarray:
        """Gamma per row of an ``(n, F)`` matrix or DataFrame (no fallback; a gated export: the length head's)."""
        x = self._matrix(features)
        if self._times is not None:
            return self._priced(self._session.run(["expected_tokens"], {"features": x})[0], x)[0]
        return self._checked_gammas(self._session.run(["gamma"], {"features": x})[0])

    def expected_values(self, features: Any) -> dict[str, np.ndarray]:
        """``gamma``, ``values`` (objective per candidate) and ``expected_tokens``."""
        x = self._matrix(features)
        g, v, e = self._session.run(["gamma", "values", "expected_tokens"], {"features": x})
        if self._times is not None:
            g, v = self._priced(e, x)
        return {"gamma": g, "candidates": self.candidates.copy(), "values": v, "expected_tokens": e}

    def __repr__(self) -> str:
        fs = self.feature_set.name if self.feature_set else "?"
        return (
            f"RuntimePolicy({self.path!r}, policy={self.metadata.get('speckv.policy', '?')}, "
            f"feature_set={fs}, candidates={self.candidates.tolist()}, provider={self.provider}, engine={self.engine}"
            + (", repriced" if self.repriced else "")
            + ")"
        )
