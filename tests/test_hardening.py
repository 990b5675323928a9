"""Hostile and careless inputs: no code runs from a data file, nothing good is replaced, concurrent appends keep all."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from speckv_policy.cli import evaluate as eval_cli
from speckv_policy.cli import export as export_cli
from speckv_policy.export import export_onnx
from speckv_policy.logs import read_log, write_log
from speckv_policy.runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from speckv_policy.schema import ONLINE
from speckv_policy.training import UntrustedFileError, load_saved_policy, save_policy

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this writes a marker file: what an attacker's file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


@pytest.fixture()
def log_path(synthetic, tmp_path):
    path = tmp_path / "steps.parquet"
    write_log(synthetic[0], path)
    return path


def test_a_crafted_pickle_never_runs_through_a_cli(tmp_path, log_path, capsys):
    import joblib
    import torch

    marker = tmp_path / "marker"
    evil = tmp_path / "evil.joblib"
    joblib.dump(_Payload(marker), evil)
    assert export_cli.main([str(tmp_path / "o.onnx"), "--policy", str(evil)]) == 2
    assert "is a pickle" in capsys.readouterr().err
    assert (
        eval_cli.main(["--log", str(log_path), "--policy", str(evil), "--out", str(tmp_path / "e"), "--no-plots"]) == 2
    )
    assert "is a pickle" in capsys.readouterr().err
    corpus = tmp_path / "corpus.pt"
    torch.save({"ids": [_Payload(marker)]}, corpus)
    from speckv_policy.cli import distill

    assert distill.main(["train", "--corpus", str(corpus), "--out", str(tmp_path / "d")]) == 2
    assert "not a speckv-distill corpus" in capsys.readouterr().err
    assert not marker.exists()  # nothing ran
    with pytest.raises(UntrustedFileError):
        load_saved_policy(evil)


def test_trusted_joblib_still_loads(fitted, tmp_path):
    save_policy(fitted["table"], tmp_path / "t.joblib")
    assert type(load_saved_policy(tmp_path / "t.joblib", trusted=True)).__name__ == "TablePolicy"


def test_special_files_and_folders_are_never_replaced(fitted, tmp_path, log_path, capsys):
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.onnx"
    folder.mkdir()
    for target in (fifo, folder):
        with pytest.raises(ValueError, match="is not a regular file; refusing to replace it"):
            export_onnx(fitted["table"], target)
        assert export_cli.main([str(target), "--train", str(log_path), "--policy", "table"]) == 2
        assert "refusing to replace it" in capsys.readouterr().err
    assert fifo.is_fifo() and folder.is_dir() and not any(folder.iterdir())
    with pytest.raises(ValueError, match="refusing to replace it"):
        write_log(read_log(log_path), fifo)


def test_an_export_that_does_not_run_never_replaces_a_good_one(fitted, tmp_path, monkeypatch):
    import onnxruntime

    out = tmp_path / "m.onnx"
    export_onnx(fitted["table"], out)
    good = out.read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated: onnxruntime cannot load this graph")

    monkeypatch.setattr(onnxruntime, "InferenceSession", broken)
    with pytest.raises(ValueError, match="does not run in onnxruntime.*nothing was written"):
        export_onnx(fitted["gbt"], out)
    assert out.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def _edit_metadata(src: Path, dst: Path, **changes: str) -> Path:
    model = onnx.load(src)
    for p in model.metadata_props:
        if p.key in changes:
            p.value = changes[p.key]
    onnx.save(model, dst)
    return dst


def test_runtime_returns_a_candidate_or_the_fallback(fitted, tmp_path):
    export_onnx(fitted["fixed"], tmp_path / "f.onnx")  # the graph always says 4
    lying = _edit_metadata(tmp_path / "f.onnx", tmp_path / "lying.onnx", **{"speckv.candidates": "[0, 1]"})
    row = np.zeros(ONLINE.n_features, np.float32)
    with pytest.raises(PolicyLoadError, match="returned gamma 4, not one of its candidates"):
        RuntimePolicy(lying).decide(row)
    with pytest.warns(PolicyFallbackWarning):
        assert RuntimePolicy(lying, fallback_gamma=1).decide(row) == 1
    bad = _edit_metadata(tmp_path / "f.onnx", tmp_path / "bad.onnx", **{"speckv.format_version": "one"})
    with pytest.raises(PolicyLoadError, match=r"bad.onnx: malformed speckv metadata"):
        RuntimePolicy(bad)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert RuntimePolicy(bad, fallback_gamma=2).decide(row) == 2
    assert any("bad.onnx" in str(r.message) for r in rec)
    for wrong in (-1, 99, 2.5, True):
        with pytest.raises(ValueError, match="fallback_gamma must be an int in 0..32"):
            RuntimePolicy(tmp_path / "f.onnx", fallback_gamma=wrong)


def test_attach_validates_fallback_gamma(fitted, tmp_path):
    from speckv_policy.hf import attach
    from speckv_policy.testing import tiny_llama_pair

    target, _ = tiny_llama_pair(seed=0)
    export_onnx(fitted["table"], tmp_path / "t.onnx")
    with pytest.raises(ValueError, match="fallback_gamma must be an int >= 0"):
        attach(target, str(tmp_path / "t.onnx"), compression="fp32", settings={"fallback_gamma": -1})
    with pytest.raises(ValueError, match="fallback_gamma 9 exceeds max_gamma 8"):
        attach(target, str(tmp_path / "t.onnx"), compression="fp32", settings={"fallback_gamma": 9})
    assert "_get_candidate_generator" not in target.__dict__


APPENDER = """
import sys
import pandas as pd
from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.logs import append_log
log, _ = generate_synthetic_log(n_prompts=10, steps_per_prompt=2, seed=int(sys.argv[2]))
for i, (pid, rows) in enumerate(log.groupby("prompt_id", sort=True)):
    rows = rows.copy()
    rows["run_id"] = f"writer{sys.argv[2]}-unit{i}-" + rows["compression"]
    append_log(sys.argv[1], rows)
"""


def test_two_processes_appending_to_one_log_keep_every_unit(tmp_path):
    path = tmp_path / "shared.parquet"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), str(seed)]) for seed in (1, 2)]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    log = read_log(path)
    units = {r.rsplit("-", 1)[0] for r in log["run_id"]}
    assert units == {f"writer{s}-unit{i}" for s in (1, 2) for i in range(10)}  # 20 units, none lost
    assert len(log) == 2 * 10 * 3 * 2  # 10 prompts x 3 compressions x 2 steps per writer


def test_one_outlier_row_is_left_out_of_the_cost_model_with_a_warning(synthetic):
    from speckv_policy.objective import CostModel, CostModelWarning

    log = synthetic[0].copy()
    clean = CostModel.fit(log)
    row = log.index[(log["step"] > 0) & (log["gamma"] > 0)][7]
    log.loc[row, "draft_ms"] = 1e12
    with pytest.warns(CostModelWarning, match=rf"left out 1 step\(s\).*row {row} \(draft 1e\+12 ms"):
        robust = CostModel.fit(log)
    np.testing.assert_allclose(robust.draft_ms_per_token, clean.draft_ms_per_token, rtol=0.02)


def test_a_degenerate_policy_is_flagged(synthetic, tmp_path, capsys):
    log = synthetic[0].copy()
    log["draft_ms"] = log["draft_ms"] * 1000.0  # drafting priced out: every decision becomes gamma 0
    path = tmp_path / "slow_draft.parquet"
    write_log(log, path)
    assert export_cli.main([str(tmp_path / "m.onnx"), "--train", str(path), "--policy", "table"]) == 0
    assert "chose gamma 0 on every held-out step" in capsys.readouterr().err
    from speckv_policy.cli import quickstart

    assert (
        quickstart.main(["--log", str(path), "--out", str(tmp_path), "--policies", "table,fixed", "--bootstrap", "20"])
        == 0
    )
    err = capsys.readouterr().err
    # (there the probe is paid whatever is chosen, so the degenerate choice is gamma 1)
    assert "table chose gamma 1 on every held-out step" in err and "fixed4 chose" not in err


def test_quickstart_names_a_log_without_usable_timings(synthetic, tmp_path, capsys):
    from speckv_policy.cli import quickstart

    log = synthetic[0].copy()
    log["draft_ms"] = 0.0
    log["verify_ms"] = 0.0
    path = tmp_path / "zero.parquet"
    write_log(log, path)
    assert quickstart.main(["--log", str(path), "--out", str(tmp_path)]) == 2
    assert f"{path}: cannot fit a cost model from its timings" in capsys.readouterr().err


def test_noisy_timings_never_fit_a_negative_verify_cost():
    import pandas as pd

    from speckv_policy.objective import CostModel

    rows = [
        {"device": "cpu", "step": s, "compression": "fp32", "gamma": g, "draft_ms": 0.5 * g, "verify_ms": v}
        for s, (g, v) in enumerate([(1, 1.0), (8, 100.0)] * 3, start=1)
    ]
    cm = CostModel.fit(pd.DataFrame(rows), verify="line")  # the line through them would cross zero at gamma 0
    assert min(cm.verify_base_ms) > 0 and min(cm.verify_ms_per_token) >= 0


def test_disk_full_ends_every_writer_with_one_line(fitted, log_path, tmp_path, monkeypatch, capsys):
    import errno

    from speckv_policy import atomic
    from speckv_policy.cli import quickstart

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", full)
    out = tmp_path / "o"
    runs = [
        lambda: export_cli.main([str(out / "m.onnx"), "--train", str(log_path), "--policy", "table"]),
        lambda: quickstart.main(["--log", str(log_path), "--out", str(out), "--policies", "table", "--bootstrap", "5"]),
        lambda: eval_cli.main(
            [
                "--log",
                str(log_path),
                "--policy",
                str(ROOT / "exported" / "synthetic-table.onnx"),
                "--out",
                str(out / "e"),
                "--bootstrap",
                "5",
                "--no-plots",
            ]
        ),
    ]
    for run in runs:
        assert run() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot write" in err[0] and "No space left on device" in err[0], err
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_paths_of_the_wrong_kind_get_one_line(log_path, tmp_path, capsys):
    from speckv_policy.cli import calibrate, profile, quickstart

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert (
        eval_cli.main(
            [
                "--log",
                str(log_path),
                "--policy",
                str(ROOT / "exported" / "synthetic-table.onnx"),
                "--out",
                str(a_file),
                "--bootstrap",
                "5",
                "--no-plots",
            ]
        )
        == 2
    )
    assert "is a file; give a folder" in capsys.readouterr().err
    assert (
        quickstart.main(["--log", str(log_path), "--out", str(a_file), "--policies", "table", "--bootstrap", "5"]) == 2
    )
    assert "cannot write" in capsys.readouterr().err
    folder = tmp_path / "prompts"
    folder.mkdir()
    for main in (profile.main, calibrate.main):
        assert (
            main(["--target", "t", "--draft", "d", "--prompts", str(folder), "--out", str(tmp_path / "x.parquet")]) == 2
        )
        assert "not a prompt file (a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--calibration-fraction", "5"],
        ["--gamma-max", "0"],
        ["--stride", "0"],
        ["--max-new-tokens", "-3"],
        ["--temperature", "0"],
    ],
)
def test_bad_numbers_are_refused_by_the_parser(args, tmp_path, capsys):
    from speckv_policy.cli import profile

    with pytest.raises(SystemExit) as exc:
        profile.main(["--target", "t", "--draft", "d", "--prompts", "p", "--out", str(tmp_path / "x.parquet"), *args])
    assert exc.value.code == 2 and "error: argument" in capsys.readouterr().err


def test_e2e_refuses_a_negative_prompt_count(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--per-task", "-1", "--out", str(tmp_path / "e.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr and not (tmp_path / "e.json").exists()


SLOW_WRITER = """
import sys, time
from speckv_policy.atomic import atomic_write
from speckv_policy.cli.common import exit_cleanly_on_sigterm

exit_cleanly_on_sigterm()

def slow(tmp):
    with open(tmp, "w") as fh:
        fh.write("half")
    print("ready", flush=True)
    time.sleep(60)

atomic_write(sys.argv[1], slow)
"""


def test_sigterm_leaves_no_temporary_file(tmp_path):
    import signal

    target = tmp_path / "out.parquet"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # mid-write
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # no temporary, no half-written file


def test_an_integer_beyond_int64_is_a_clear_error(synthetic):
    from speckv_policy.logs import LogValidationError, validate_log

    log = synthetic[0].copy()
    log["accepted"] = log["accepted"].astype(object)
    log.at[log.index[3], "accepted"] = 10**30  # would wrap around silently when cast to int64
    with pytest.raises(LogValidationError, match=r"row 3, column 'accepted': expected an integer \(within int64\)"):
        validate_log(log, source="big.parquet")
