"""Second hardening round, logs and command lines: settings checked on every append (first writer wins), parts
checked against their partition and versions, page checksums, no open of a special file, one-line CLI errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.logs import (
    DATASET_MARKER,
    LogValidationError,
    append_log,
    part_path,
    read_log,
    read_log_dataset,
    read_log_metadata,
    validate_log,
    write_log,
    write_log_parts,
)

ROOT = Path(__file__).resolve().parents[1]
A = {"profile_settings": json.dumps({"gamma_max": 8, "seed": 0}, sort_keys=True)}
B = {"profile_settings": json.dumps({"gamma_max": 4, "seed": 0}, sort_keys=True)}


@pytest.fixture(scope="module")
def units():
    log, _ = generate_synthetic_log(n_prompts=4, steps_per_prompt=3, seed=5)
    log = validate_log(log)
    return [u for _, u in log.groupby(["run_id", "prompt_id", "compression"], sort=True)]


@pytest.mark.parametrize("kind", ["file", "dataset"])
def test_an_append_with_other_settings_is_refused_and_changes_nothing(units, tmp_path, kind):
    path = tmp_path / ("steps.parquet" if kind == "file" else "steps")
    append_log(path, units[0], metadata=A)
    before = read_log(path)
    with pytest.raises(LogValidationError, match=r"other settings than the log \(profile_settings: .*gamma_max.*8"):
        append_log(path, units[1], metadata=B)
    assert read_log(path).equals(before) and read_log_metadata(path) == A
    append_log(path, units[1], metadata=A)  # the same settings append as before
    assert len(read_log(path)) == len(units[0]) + len(units[1])


CREATOR = r"""
import json, sys, time
from pathlib import Path
from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.logs import LogValidationError, append_log
out, gamma_max, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
log, _ = generate_synthetic_log(n_prompts=2, steps_per_prompt=2, seed=gamma_max)
log["run_id"] = log["run_id"] + f"-g{gamma_max}"
meta = {"profile_settings": json.dumps({"gamma_max": gamma_max}, sort_keys=True)}
while not go.exists():
    time.sleep(0.001)
try:
    for _, unit in log.groupby(["run_id", "prompt_id", "compression"]):
        append_log(out, unit, metadata=meta)
except LogValidationError as exc:
    print("refused", exc)
    sys.exit(3)
"""


@pytest.mark.parametrize("kind", ["file", "dataset"])
def test_two_profiles_started_together_into_one_new_log_first_writer_wins(tmp_path, kind):
    out = tmp_path / ("new.parquet" if kind == "file" else "new")
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", CREATOR, str(out), str(g), str(go)], stdout=subprocess.PIPE, text=True)
        for g in (4, 8)
    ]
    go.touch()
    codes = sorted(p.wait(timeout=300) for p in procs)
    assert codes == [0, 3]  # one wrote, the other was refused
    log = read_log(out)
    winner = json.loads(read_log_metadata(out)["profile_settings"])["gamma_max"]
    assert {r.rsplit("-", 1)[1] for r in log["run_id"]} == {f"g{winner}"}  # nothing of the loser's settings


def _dataset(units, tmp_path, metadata=None) -> Path:
    d = tmp_path / "ds"
    for u in units[:3]:
        write_log_parts(d, u, metadata=metadata)
    return d


def test_a_part_whose_compression_column_contradicts_its_directory_is_refused(units, tmp_path):
    d = _dataset(units, tmp_path)
    unit = units[0]
    part = part_path(d, unit["run_id"].iloc[0], unit["prompt_id"].iloc[0], unit["compression"].iloc[0])
    table = pq.read_table(part)
    other = "nf4" if unit["compression"].iloc[0] != "nf4" else "int8"
    import pyarrow as pa

    table = table.append_column("compression", pa.array([other] * len(table))).replace_schema_metadata(
        table.schema.metadata
    )
    pq.write_table(table, part)
    with pytest.raises(LogValidationError, match=rf"column 'compression' holds \['{other}'\], but the part lies under"):
        read_log(d)


@pytest.mark.parametrize("version", [True, -7, 0, 99, "2", 2.0, None])
def test_marker_versions_other_than_a_known_integer_are_refused(units, tmp_path, version):
    d = _dataset(units, tmp_path)
    marker = d / DATASET_MARKER
    body = json.loads(marker.read_text())
    body["log_schema_version"] = version
    marker.write_text(json.dumps(body))
    with pytest.raises(LogValidationError, match=r"(?s)_speckv_log\.json.*log schema version"):
        read_log(d)
    with pytest.raises(LogValidationError, match="log schema version"):
        write_log_parts(d, units[3])


@pytest.mark.parametrize("version", [b"99", b"0", b"-7", b"true", b"x"])
def test_a_part_or_file_claiming_an_unknown_schema_version_is_refused(units, tmp_path, version):
    d = _dataset(units, tmp_path)
    part = next(d.rglob("part-*.parquet"))
    table = pq.read_table(part)
    pq.write_table(table.replace_schema_metadata({b"speckv.log_schema_version": version}), part)
    with pytest.raises(LogValidationError, match=rf"(?s){part.name}.*log schema version"):
        read_log_dataset(d)
    single = tmp_path / "one.parquet"
    write_log(units[0], single)
    pq.write_table(pq.read_table(single).replace_schema_metadata({b"speckv.log_schema_version": version}), single)
    with pytest.raises(LogValidationError, match=r"(?s)one\.parquet.*log schema version"):
        read_log(single)


def test_marker_metadata_must_be_strings_and_profile_settings_an_object(units, tmp_path, capsys):
    d = _dataset(units, tmp_path, metadata=A)
    marker = d / DATASET_MARKER
    body = json.loads(marker.read_text())
    body["metadata"] = {"profile_settings": {"gamma_max": 8}}
    marker.write_text(json.dumps(body))
    with pytest.raises(LogValidationError, match="'metadata' must be a JSON object of strings"):
        read_log(d)
    body["metadata"] = {"profile_settings": "[1, 2]"}
    marker.write_text(json.dumps(body))
    from speckv_policy.hf.profile_units import ProfileConfig, plan_profile
    from speckv_policy.prompts import read_prompts

    cfg = ProfileConfig(target="t", draft="d", out=str(d))
    with pytest.raises(ValueError, match=r"ds: its recorded profile_settings are not a JSON object"):
        plan_profile(cfg, read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl")[:2])


def test_page_checksums_catch_single_bit_flips(units, tmp_path):
    path = tmp_path / "steps.parquet"
    log = validate_log(__import__("pandas").concat(units, ignore_index=True))
    write_log(log, path)
    good = read_log(path)
    data = path.read_bytes()
    rng = np.random.default_rng(0)
    silent = 0
    for pos, bit in zip(rng.integers(4, len(data) - 8, 60), rng.integers(0, 8, 60)):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(bit)
        bad = tmp_path / "flipped.parquet"
        bad.write_bytes(bytes(flipped))
        try:
            back = read_log(bad)
        except LogValidationError as exc:
            assert "flipped.parquet" in str(exc)
            continue
        silent += not back.equals(good)
    assert silent == 0  # without page checksums most of these flips read back as changed values
    # and the parts of a dataset are checked the same way
    d = tmp_path / "ds"
    write_log_parts(d, units[0])
    part = next(d.rglob("part-*.parquet"))
    assert pq.ParquetFile(part).metadata.num_row_groups >= 1
    raw = bytearray(part.read_bytes())
    raw[200] ^= 0x10  # inside the first data page
    part.write_bytes(bytes(raw))
    with pytest.raises(LogValidationError):
        read_log(d)


# -- special files --------------------------------------------------------------------------------------------------


def _run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False
    )


def test_a_fifo_named_as_a_log_or_marker_is_refused_without_blocking(units, tmp_path):
    fifo = tmp_path / "steps.parquet"
    os.mkfifo(fifo)
    with pytest.raises(LogValidationError, match="not a regular file"):
        read_log(fifo)
    with pytest.raises(LogValidationError, match="not a regular file"):
        read_log_metadata(fifo)
    d = tmp_path / "ds"
    d.mkdir()
    os.mkfifo(d / DATASET_MARKER)
    with pytest.raises(LogValidationError, match=r"(?s)_speckv_log\.json.*not a regular file"):
        read_log(d)
    with pytest.raises(LogValidationError, match="not a regular file"):
        write_log_parts(d, units[0])
    # the commands: resume planning and training on a dataset, within seconds, not forever
    r = _run_cli(
        ["speckv_policy.cli.profile", "--target", "smollm2", "--draft", "datasets/smollm2/draft", "--prompts"]
        + ["datasets/prompts/prompts.jsonl", "--out", str(fifo), "--limit", "1"]
    )
    assert r.returncode == 2 and "not a regular file" in r.stderr and "Traceback" not in r.stderr
    r = _run_cli(["speckv_policy.cli.export", str(tmp_path / "m.onnx"), "--train", str(d), "--policy", "table"])
    assert r.returncode == 2 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


def test_a_part_that_is_a_fifo_is_refused(units, tmp_path):
    d = _dataset(units, tmp_path)
    os.mkfifo(d / "compression=fp16" / "part-fifo.parquet")
    with pytest.raises(LogValidationError, match="(?s)part-fifo.parquet.*not a regular file"):
        read_log(d)


# -- command lines: one line naming the option, exit 2 --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["speckv_policy.cli.calibrate", "--out", "c.json", "--compressions", ""], "--compressions: expected a comma"),
        (["speckv_policy.cli.calibrate", "--out", "c.json", "--compressions", "fp32,q3"], "unknown value(s) 'q3'"),
        (["speckv_policy.cli.calibrate", "--out", "c.json", "--device", "nonsense"], "--device: expected cpu, cuda"),
        (["speckv_policy.cli.calibrate", "--out", "c.json", "--seconds", "inf"], "--seconds: must be a finite"),
        (
            ["speckv_policy.cli.profile", "--target", "t", "--draft", "d", "--prompts", "p", "--out", "o"]
            + ["--decodings", "beam"],
            "--decodings: unknown value(s) 'beam'",
        ),
        (
            ["speckv_policy.cli.profile", "--target", "t", "--draft", "d", "--prompts", "p", "--out", "o"]
            + ["--fixed-gammas", "2,-1"],
            "--fixed-gammas: in '2,-1': must be >= 0",
        ),
        (["speckv_policy.cli.distill", "cost", "--draft", "d", "--tokens", "0"], "--tokens: must be >= 1"),
        (
            ["speckv_policy.cli.distill", "eagle3", "--corpus", "c", "--out", "o", "--work", "w", "--layers", "2,x"],
            "--layers: in '2,x'",
        ),
        (
            ["speckv_policy.cli.distill", "corpus", "--prompts", "p", "--out", "o", "--temperature", "nan"],
            "--temperature: must be in (0.0, 100.0]",
        ),
    ],
)
def test_bad_arguments_end_in_one_line_naming_the_option(args, says, tmp_path):
    r = _run_cli(args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    for cmd in (
        ["speckv_policy.cli.calibrate", "--out", "c.json"],
        ["speckv_policy.cli.profile"] + ["--target", "t", "--draft", "d", "--prompts", "p", "--out", "o"],
        ["speckv_policy.cli.distill", "corpus", "--prompts", "p", "--out", "o"],
        ["speckv_policy.cli.distill", "eagle3", "--corpus", "c", "--out", "o", "--work", "w"],
    ):
        r = _run_cli([*cmd, "--device", "cuda"])
        assert r.returncode == 2 and "no CUDA device here" in r.stderr and "Traceback" not in r.stderr
