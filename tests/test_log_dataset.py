"""Step logs as a partitioned Parquet dataset; profiling into one, resumed after kills, sharded over Ray."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow.dataset as pads
import pytest

from speckv_policy.hf import profiler
from speckv_policy.hf.profiler import ProfileConfig
from speckv_policy.logs import (
    DATASET_MARKER,
    LogValidationError,
    append_log,
    logged_units,
    part_path,
    read_log,
    read_log_metadata,
    write_log_parts,
)
from speckv_policy.prompts import read_prompts
from speckv_policy.testing import save_tiny_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
KEY = ["run_id", "prompt_id", "step"]
SAME = ["run_id", "prompt_id", "step", "compression", "decoding", "context_len", "gamma", "accepted"]
FEATURES = ["draft_confidence", "draft_entropy", "draft_token_prob"]


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(KEY).reset_index(drop=True)


def _same_steps(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Same keys, outcomes and features; timings may differ."""
    a, b = _sorted(a), _sorted(b)
    assert len(a) == len(b)
    assert a[SAME].equals(b[SAME])
    for col in FEATURES:
        for x, y in zip(a[col], b[col]):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def shipped_units():
    log = read_log("datasets/smollm2/steps.parquet")
    first = log[log["run_id"].isin(sorted(set(log["run_id"]))[:3])]
    return [g for _, g in first.groupby(["run_id", "prompt_id"])][:12]


def test_parts_round_trip_and_every_reader_sees_the_same_rows(tmp_path, shipped_units):
    d = tmp_path / "steps"
    for unit in shipped_units:
        append_log(d, unit, metadata={"profile_settings": "{}"})
    want = pd.concat(shipped_units, ignore_index=True)
    parts = sorted(p.relative_to(d).as_posix() for p in d.rglob("*.parquet"))
    assert len(parts) == len(shipped_units) and all(p.startswith("compression=") for p in parts)
    assert (d / DATASET_MARKER).is_file() and read_log_metadata(d) == {"profile_settings": "{}"}
    back = read_log(d)
    pd.testing.assert_frame_equal(_sorted(back), _sorted(want))
    # pyarrow.dataset and pandas read the directory as it is (Hive partitioning, marker skipped)
    table = pads.dataset(d, format="parquet", partitioning="hive").to_table()
    assert table.num_rows == len(want) and set(table.column("compression").to_pylist()) == set(want["compression"])
    assert len(pd.read_parquet(d)) == len(want)
    assert logged_units(d) == set(zip(want["run_id"], want["prompt_id"]))


def test_writing_a_unit_again_replaces_its_part(tmp_path, shipped_units):
    d = tmp_path / "steps"
    unit = shipped_units[0]
    write_log_parts(d, unit)
    changed = unit.copy()
    changed["draft_ms"] = changed["draft_ms"] + 1.0
    write_log_parts(d, changed)  # a retried worker
    back = read_log(d)
    assert len(back) == len(unit) and np.allclose(_sorted(back)["draft_ms"], _sorted(changed)["draft_ms"])
    r = unit.iloc[0]
    assert part_path(d, r["run_id"], r["prompt_id"], r["compression"]).is_file()


def test_a_failed_or_invalid_write_leaves_the_dataset_as_it_was(tmp_path, shipped_units, monkeypatch):
    d = tmp_path / "steps"
    write_log_parts(d, shipped_units[0])
    before = sorted(p.name for p in d.rglob("*"))
    bad = shipped_units[1].copy()
    bad.loc[bad.index[0], "accepted"] = 99
    with pytest.raises(LogValidationError, match=r"(?s)steps \(new part\).*column 'accepted'"):
        write_log_parts(d, bad)

    import pyarrow.parquet as pq

    def half_write(table, where, **kw):
        with open(where, "wb") as fh:
            fh.write(b"PAR1 half")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(OSError, match="disk full"):
        write_log_parts(d, shipped_units[1])
    monkeypatch.undo()
    assert sorted(p.name for p in d.rglob("*")) == before  # no partial part, no temporary left behind
    pd.testing.assert_frame_equal(read_log(d), read_log(d))
    assert len(read_log(d)) == len(shipped_units[0])


def test_dataset_errors_name_the_directory(tmp_path, shipped_units):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(LogValidationError, match=r"(?s)plain.*no _speckv_log.json"):
        read_log(plain)
    d = tmp_path / "steps"
    write_log_parts(d, shipped_units[0])
    marker = json.loads((d / DATASET_MARKER).read_text())
    (d / DATASET_MARKER).write_text(json.dumps({**marker, "log_schema_version": 99}))
    with pytest.raises(LogValidationError, match="schema version 99"):
        read_log(d)
    with pytest.raises(LogValidationError, match="schema version 99"):
        write_log_parts(d, shipped_units[1])  # parts are never added to an incompatible dataset


# -- profiling into a dataset -------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    target, draft = save_tiny_pair(d)
    rng = np.random.default_rng(1)
    lines = [
        json.dumps(
            {
                "id": f"p{i}",
                "task_type": ["code", "math", "chat", "summarization"][i % 4],
                "split": "heldout" if i == 3 else "train",
                "input_ids": rng.integers(1, 64, size=int(rng.integers(2, 8))).tolist(),
            }
        )
        for i in range(5)
    ]
    (d / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return d, str(target), str(draft)


def _cfg(setup, out, **kw):
    d, target, draft = setup
    base = dict(target=target, draft=draft, out=str(out), compressions=("fp32", "nf4"), max_new_tokens=24, seed=5)
    return ProfileConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def single_file(setup):
    d = setup[0]
    out = d / "single.parquet"
    profiler.profile(_cfg(setup, out), read_prompts(d / "prompts.jsonl"), progress=False)
    return read_log(out)


def test_profile_into_a_dataset_equals_a_single_file(setup, single_file):
    d = setup[0]
    out = d / "as_dataset"
    counts = profiler.profile(_cfg(setup, out), read_prompts(d / "prompts.jsonl"), progress=False)
    assert counts["done"] == 2 * 2 * 5
    _same_steps(read_log(out), single_file)
    assert len(list(out.rglob("part-*.parquet"))) == counts["done"]
    assert profiler.profile(_cfg(setup, out), read_prompts(d / "prompts.jsonl"), progress=False)["done"] == 0
    with pytest.raises(ValueError, match="profiled with other settings"):
        profiler.profile(_cfg(setup, out, gamma_max=4), read_prompts(d / "prompts.jsonl"), progress=False)


def test_a_killed_profile_resumes_with_no_missing_and_no_duplicated_steps(setup, single_file):
    d, target, draft = setup
    out = d / "killed"
    cmd = [
        sys.executable,
        "-m",
        "speckv_policy.cli.profile",
        "--target",
        target,
        "--draft",
        draft,
        "--prompts",
        str(d / "prompts.jsonl"),
        "--out",
        str(out),
        "--compressions",
        "fp32,nf4",
        "--max-new-tokens",
        "24",
        "--seed",
        "5",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and len(list(out.rglob("part-*.parquet"))) < 3 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no clean-up at all
    proc.wait()
    written = len(list(out.rglob("part-*.parquet")))
    assert 3 <= written < 20, written
    assert read_log(out)["prompt_id"].nunique() >= 1  # what is there is whole and valid
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    _same_steps(read_log(out), single_file)
    assert len(list(out.rglob("part-*.parquet"))) == 20


# -- Ray -------------------------------------------------------------------------------------------
def test_ray_with_two_workers_profiles_the_same_steps(setup, single_file):
    ray = pytest.importorskip("ray")
    from speckv_policy.hf import profile_ray

    d = setup[0]
    out = d / "on_ray"
    killed = []

    def kill_a_worker_once(done, total):
        if done == 2 and not killed:  # a worker dies mid-run: Ray restarts it and retries its unit
            actor = ray.get_actor(f"{profile_ray.ACTOR_PREFIX}0", namespace=profile_ray.NAMESPACE)
            ray.kill(actor, no_restart=False)
            killed.append(done)

    counts = profiler.profile(
        _cfg(setup, out),
        read_prompts(d / "prompts.jsonl"),
        progress=False,
        ray_address="local",
        workers=2,
        on_unit_done=kill_a_worker_once,
    )
    assert killed and counts["done"] == 20
    _same_steps(read_log(out), single_file)
    assert len(list(out.rglob("part-*.parquet"))) == 20
    assert not ray.is_initialized()  # the local instance it started is shut down


def test_ray_needs_a_dataset_directory(setup):
    pytest.importorskip("ray")
    d = setup[0]
    with pytest.raises(ValueError, match="dataset directory"):
        profiler.profile(
            _cfg(setup, d / "x.parquet"), read_prompts(d / "prompts.jsonl"), progress=False, ray_address="local"
        )


def test_without_ray_the_error_says_what_to_install(setup, monkeypatch):
    d = setup[0]
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ModuleNotFoundError, match=r"speckv-policy\[ray\]"):
        profiler.profile(
            _cfg(setup, d / "no_ray"), read_prompts(d / "prompts.jsonl"), progress=False, ray_address="local"
        )


def test_nothing_imports_ray_unless_asked():
    code = (
        "import sys, speckv_policy.hf, speckv_policy.hf.profiler, speckv_policy.cli.profile, speckv_policy.logs; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_ray_options(setup, tmp_path, capsys):
    from speckv_policy.cli import profile as profile_cli

    prompts = str(setup[0] / "prompts.jsonl")
    base = ["--target", "t", "--draft", "d", "--prompts", prompts, "--out", str(tmp_path / "ds")]
    with pytest.raises(SystemExit):
        profile_cli.main([*base, "--workers", "2"])
    assert "--workers needs --ray" in capsys.readouterr().err
    assert profile_cli.main([*base[:-1], str(tmp_path / "x.txt")]) == 2
    assert "log dataset directory" in capsys.readouterr().err


def test_the_tools_take_a_dataset_directory_like_a_file(tmp_path, capsys):
    """speckv-export --train, speckv-eval and speckv-quickstart read a log dataset exactly like the file it came from."""
    from speckv_policy.cli import evaluate as eval_cli
    from speckv_policy.cli import export as export_cli
    from speckv_policy.cli import quickstart
    from speckv_policy.policies import training_data
    from speckv_policy.runtime import RuntimePolicy

    shipped = "datasets/synthetic/steps.parquet"
    rows, _ = training_data(read_log(shipped), "online", split="heldout")
    d = tmp_path / "steps"
    for _, unit in read_log(shipped).groupby(["run_id", "prompt_id"]):
        write_log_parts(d, unit)
    outs = {}
    for name, log in (("file", shipped), ("dataset", str(d))):
        onnx_path = tmp_path / f"{name}.onnx"
        assert export_cli.main([str(onnx_path), "--train", log, "--policy", "table"]) == 0
        assert (
            eval_cli.main(
                [
                    "--log",
                    log,
                    "--policy",
                    str(onnx_path),
                    "--out",
                    str(tmp_path / name),
                    "--bootstrap",
                    "100",
                    "--no-plots",
                ]
            )
            == 0
        )
        assert (
            quickstart.main(
                ["--log", log, "--out", str(tmp_path / f"qs-{name}"), "--policies", "fixed", "--bootstrap", "100"]
            )
            == 0
        )
        capsys.readouterr()
        arms = json.loads((tmp_path / name / "eval.json").read_text())["groups"]["overall"]["arms"]
        rt = RuntimePolicy(onnx_path)
        outs[name] = (
            rt.metadata["speckv.training_fingerprint"],
            arms[name]["tokens_per_second"],
            rt.decide_batch(rows),
        )
    # the same rows (row order only moves the cost fit in the 15th digit): same fingerprint, figures, decisions
    assert outs["file"][:2] == outs["dataset"][:2]
    assert np.array_equal(outs["file"][2], outs["dataset"][2])
