"""Fuzzing what users point the tools at: logs, feature vectors, export metadata, command lines.

Every case must end in a correct result or a clear error of the documented kind (naming the file where there is
one) - never another exception, and never a changed good file.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speckv_policy.cli import export as export_cli
from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.export import export_onnx
from speckv_policy.logs import COLUMNS, LogValidationError, read_log, validate_log, write_log
from speckv_policy.runtime import REQUIRED_METADATA, PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from speckv_policy.schema import ONLINE

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
ODD_VALUES = [
    None,
    float("nan"),
    float("inf"),
    -1,
    -1e300,
    1e300,
    0,
    "",
    "x",
    "nf5",
    [],
    [1.5],
    [float("nan")],
    True,
    {"a": 1},
    10**30,
]


@pytest.fixture(scope="module")
def small_log():
    log, _ = generate_synthetic_log(n_prompts=6, steps_per_prompt=3, seed=4)
    return validate_log(log)


@FUZZ
@given(data=st.data())
def test_any_mutated_log_validates_or_names_the_problem(small_log, data):
    df = small_log.copy()
    for _ in range(data.draw(st.integers(1, 3))):
        col = data.draw(st.sampled_from(list(COLUMNS)))
        if data.draw(st.booleans()) and col in df:
            df = df.drop(columns=[col])
            continue
        row = data.draw(st.integers(0, len(df) - 1))
        value = data.draw(st.sampled_from(ODD_VALUES))
        df[col] = df[col].astype(object) if col in df else None
        df.at[df.index[row], col] = value
    try:
        out = validate_log(df, source="fuzzed.parquet")
    except LogValidationError as exc:
        assert "fuzzed.parquet" in str(exc)
    else:
        assert len(out) == len(df)


@FUZZ
@given(blob=st.binary(max_size=300), suffix=st.sampled_from([".parquet", ".csv"]))
def test_garbage_files_are_clear_log_errors(blob, suffix, tmp_path_factory):
    path = tmp_path_factory.mktemp("garbage") / f"log{suffix}"
    path.write_bytes(blob)
    with pytest.raises(LogValidationError, match=str(path)):
        read_log(path)


@pytest.fixture(scope="module")
def gbt_export(fitted, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "gbt.onnx"
    export_onnx(fitted["gbt"], path)
    return path


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 2.0, 1e30]))


@FUZZ
@given(row=st.lists(floats, min_size=0, max_size=10))
def test_any_feature_vector_gives_a_candidate_or_the_fallback(gbt_export, row):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyFallbackWarning)
        rt = RuntimePolicy(gbt_export, fallback_gamma=3)
        g = rt.decide(np.asarray(row, dtype=np.float32))
    assert g in set(rt.candidates.tolist()) | {3}
    strict = RuntimePolicy(gbt_export)
    finite = len(row) == ONLINE.n_features and all(math.isfinite(np.float32(v)) for v in row)
    if finite:
        assert strict.decide(np.asarray(row, dtype=np.float32)) in set(strict.candidates.tolist())
    else:
        with pytest.raises((ValueError, PolicyLoadError)):
            strict.decide(np.asarray(row, dtype=np.float32))


META_KEYS = [*REQUIRED_METADATA, "speckv.objective", "speckv.cost_model"]


@FUZZ
@given(
    key=st.sampled_from(META_KEYS),
    value=st.one_of(st.text(max_size=20), st.sampled_from(["[]", "[-1]", "{}", "99", "null", '"online"', "[1e9]"])),
)
def test_any_metadata_edit_loads_or_names_the_file(gbt_export, key, value, tmp_path_factory):
    import warnings

    model = onnx.load(gbt_export)
    for p in model.metadata_props:
        if p.key == key:
            p.value = value
    path = tmp_path_factory.mktemp("meta") / "edited.onnx"
    onnx.save(model, path)
    row = np.zeros(ONLINE.n_features, np.float32)
    try:
        rt = RuntimePolicy(path)
    except PolicyLoadError as exc:
        assert str(path) in str(exc)
    else:
        try:
            assert rt.decide(row) in set(rt.candidates.tolist())
        except (ValueError, PolicyLoadError) as exc:
            assert str(path) in str(exc) or "feature" in str(exc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyFallbackWarning)
        g = RuntimePolicy(path, fallback_gamma=2).decide(row)
    assert isinstance(g, int) and g >= 0


@pytest.fixture(scope="module")
def cli_setup(small_log, fitted, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    write_log(small_log, d / "steps.parquet")
    export_onnx(fitted["table"], d / "good.onnx")
    return d


ARG_POOL = [
    "--policy",
    "gbt",
    "table",
    "fixed",
    "nope",
    "--train",
    "steps.parquet",
    "missing.parquet",
    "--candidates",
    "0,1,2",
    "a,b",
    "",
    "--objective",
    "tokens_per_step",
    "--gamma",
    "-3",
    "7",
    "--cost-model",
    "relative",
    "--decision-draft-tokens",
    "1",
    "5",
    "--feature-set",
    "paper",
    "--reprice",
    "costs.json",
    "--device",
    "gpu",
    "--save-policy",
    "x.joblib",
]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(args=st.lists(st.sampled_from(ARG_POOL), max_size=7))
def test_export_command_lines_end_in_a_result_or_one_error(cli_setup, args, tmp_path_factory, capsys):
    d = tmp_path_factory.mktemp("run")
    shutil.copy(cli_setup / "steps.parquet", d / "steps.parquet")
    out = d / "model.onnx"
    shutil.copy(cli_setup / "good.onnx", out)
    argv = [str(d / a) if a.endswith((".parquet", ".json", ".joblib")) else a for a in args]
    here = os.getcwd()
    os.chdir(d)  # a stray positional (e.g. "0,1,2") names an output file: it must land here, not in the repository
    try:
        code = export_cli.main([str(out), *argv])
    except SystemExit as exc:  # argparse: a usage error
        code = exc.code
    finally:
        os.chdir(here)
    err = capsys.readouterr().err
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2 and "usage:" not in err:
        assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1
    RuntimePolicy(out)  # the good export is still there and still loads (or was replaced by a new good one)
    assert not [p for p in Path(d).iterdir() if p.name.endswith(".tmp")]


# -- second round: cost files, stop rules, dataset markers and parts, calibrate / profile command lines ------------

ROOT = Path(__file__).resolve().parents[1]
GATED_EXPORT = ROOT / "exported" / "smollm2-gbt-gated.onnx"
STOP_RULE = ROOT / "exported" / "smollm2-stop.json"
COST_KEYS = [
    "draft_ms_per_token",
    "verify_base_ms",
    "verify_ms_per_token",
    "draft_base_ms",
    "verify_table_ms",
    "overhead_ms",
    "decision_draft_tokens",
    "unit",
    "device",
    "machine",
    "n_rows",
    "extra",
]
COST_VALUES = [*ODD_VALUES, [1.0, 2.0, 3.0], [[1.0, 2.0]] * 3, [[]] * 3, {"0": 1}, {"9": "x"}, 1e308, -1e4, "ms"]


def _mutated_costs(data) -> dict:
    from speckv_policy.objective import CostModel

    d = CostModel.relative().to_dict()
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(COST_KEYS))
        if data.draw(st.booleans()) and key in d:
            del d[key]
        else:
            d[key] = data.draw(st.sampled_from(COST_VALUES))
    return d


@FUZZ
@given(data=st.data())
def test_any_cost_file_loads_sane_or_is_refused_naming_it_and_never_breaks_a_decision(data, tmp_path_factory):
    import json
    import warnings

    from speckv_policy.objective import MAX_STEP_COST, CostModel, CostModelError

    path = tmp_path_factory.mktemp("costs") / "costs.json"
    path.write_text(json.dumps(_mutated_costs(data)))
    try:
        cm = CostModel.load(path)
    except CostModelError as exc:
        assert str(path) in str(exc)
    except FileNotFoundError:
        raise AssertionError("a file that is there is 'not found'") from None
    else:
        t = cm.time_table(range(9))
        assert np.isfinite(t).all() and (t > 0).all() and (t <= 4 * MAX_STEP_COST).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyFallbackWarning)
        rt = RuntimePolicy(GATED_EXPORT, costs=path, fallback_gamma=2)
        g = rt.decide(np.zeros(11, np.float32))
        opened = rt.decide_gate(np.zeros(11, np.float32))
    assert g in (2, *rt.candidates.tolist()) and opened in (True, False)


@FUZZ
@given(data=st.data())
def test_any_stop_rule_file_loads_or_is_refused_naming_it(data, tmp_path_factory):
    import json

    from speckv_policy.stop import StopRule, StopRuleError

    d = json.loads(STOP_RULE.read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "cost_model"]))
        target = d if where == "top" else d.setdefault("cost_model", {})
        if not isinstance(target, dict):
            continue
        key = data.draw(st.sampled_from([*d.keys(), *COST_KEYS] if where == "top" else COST_KEYS))
        if data.draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = data.draw(st.sampled_from(COST_VALUES))
    path = tmp_path_factory.mktemp("rule") / "rule.json"
    path.write_text(json.dumps(d))
    try:
        rule = StopRule.load(path)
    except StopRuleError as exc:
        assert str(path) in str(exc)
    else:
        assert rule.max_gamma >= 1


@pytest.fixture(scope="module")
def small_dataset(small_log, tmp_path_factory):
    from speckv_policy.logs import write_log_parts

    d = tmp_path_factory.mktemp("ds") / "steps"
    write_log_parts(d, small_log, metadata={"profile_settings": "{}"})
    return d


MARKER_KEYS = ["format", "log_schema_version", "partitioning", "metadata", "extra"]


@FUZZ
@given(data=st.data())
def test_any_dataset_marker_or_part_reads_right_or_is_refused_naming_it(
    small_dataset, small_log, data, tmp_path_factory
):
    import json

    from speckv_policy.logs import DATASET_MARKER, read_log, write_log_parts

    d = tmp_path_factory.mktemp("fuzzds") / "steps"
    shutil.copytree(small_dataset, d)
    good = read_log(small_dataset)
    if data.draw(st.booleans()):  # the marker
        marker = d / DATASET_MARKER
        body = json.loads(marker.read_text())
        for _ in range(data.draw(st.integers(1, 2))):
            key = data.draw(st.sampled_from(MARKER_KEYS))
            if data.draw(st.booleans()) and key in body:
                del body[key]
            else:
                body[key] = data.draw(st.sampled_from([*ODD_VALUES, 2, "speckv-step-log-dataset", {"x": "y"}]))
        marker.write_text(json.dumps(body))
    else:  # a part: truncated, or a few bits flipped
        parts = sorted(d.rglob("part-*.parquet"))
        part = parts[data.draw(st.integers(0, len(parts) - 1))]
        raw = bytearray(part.read_bytes())
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        else:
            for _ in range(data.draw(st.integers(1, 3))):
                raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        part.write_bytes(bytes(raw))
    try:
        back = read_log(d)
    except LogValidationError as exc:
        assert str(d) in str(exc)
    else:
        assert back.equals(good)  # never changed values read back silently
    try:
        write_log_parts(d, small_log.iloc[:3], metadata={"profile_settings": "{}"})
    except LogValidationError as exc:
        assert str(d) in str(exc)


CALIBRATE_POOL = [
    "--compressions",
    "fp32",
    "fp32,int8",
    "",
    "int4",
    "fp32,fp32",
    "--device",
    "cpu",
    "cuda:7",
    "tpu",
    "--seconds",
    "0",
    "inf",
    "nan",
    "-1",
    "2",
    "--gamma-max",
    "0",
    "3",
    "x",
    "--max-new-tokens",
    "1",
    "--draft-precision",
    "fp64",
    "--seed",
    "1.5",
]
PROFILE_POOL = [
    "--compressions",
    "nf4",
    "",
    "fp8",
    "--decodings",
    "greedy",
    "beam",
    "greedy,greedy",
    "--fixed-gammas",
    "2,4",
    "-1",
    "a",
    "--device",
    "cuda",
    "cpu:0",
    "--gamma-max",
    "0",
    "--temperature",
    "0",
    "nan",
    "--calibration-fraction",
    "1.5",
    "--workers",
    "2",
    "--limit",
    "1",
]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(which=st.sampled_from(["calibrate", "profile"]), data=st.data())
def test_calibrate_and_profile_command_lines_end_in_one_error_never_a_traceback(which, data, tmp_path_factory, capsys):
    import importlib

    pool = CALIBRATE_POOL if which == "calibrate" else PROFILE_POOL
    args = data.draw(st.lists(st.sampled_from(pool), max_size=6))
    d = tmp_path_factory.mktemp("cmd")
    good = d / ("costs.json" if which == "calibrate" else "steps.parquet")
    good.write_bytes(b"a good file that must not change")
    out = good if which == "calibrate" else d / "new.parquet"
    head = ["--target", str(d / "no-target"), "--draft", str(d / "no-draft"), "--out", str(out)]
    head += ["--prompts", str(d / "missing.jsonl")]  # a parse that succeeds stops at the prompts: no model runs
    main = importlib.import_module(f"speckv_policy.cli.{which}").main
    try:
        code = main([*head, *args])
    except SystemExit as exc:  # argparse: a usage error
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err
    assert good.read_bytes() == b"a good file that must not change"
