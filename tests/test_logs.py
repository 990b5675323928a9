"""Step-log schema: round trips, clear errors, atomic writes, appends."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from speckv_policy.logs import (
    LOG_SCHEMA_VERSION,
    LogValidationError,
    append_log,
    read_log,
    validate_log,
    write_csv_log,
    write_log,
)


@pytest.fixture()
def small(synthetic):
    return synthetic[0].iloc[:60].copy()


def test_parquet_round_trip_with_version(small, tmp_path):
    path = tmp_path / "log.parquet"
    write_log(small, path, metadata={"profile": "unit"})
    meta = pq.read_schema(path).metadata
    assert meta[b"speckv.log_schema_version"] == str(LOG_SCHEMA_VERSION).encode()
    assert meta[b"speckv.profile"] == b"unit"
    back = read_log(path)
    pd.testing.assert_frame_equal(
        back.drop(columns=["draft_confidence", "draft_entropy", "draft_token_prob"]),
        validate_log(small).drop(columns=["draft_confidence", "draft_entropy", "draft_token_prob"]),
    )
    for a, b in zip(back["draft_entropy"], small["draft_entropy"]):
        np.testing.assert_allclose(a, b)


def test_csv_round_trip(small, tmp_path):
    path = tmp_path / "log.csv"
    write_csv_log(small, path)
    back = read_log(path)
    assert len(back) == len(small)
    np.testing.assert_allclose(back["draft_confidence"].iloc[3], small["draft_confidence"].iloc[3])


def _expect(df, *fragments, source="x.parquet"):
    with pytest.raises(LogValidationError) as err:
        validate_log(df, source=source)
    msg = str(err.value)
    for f in fragments:
        assert f in msg, msg
    return err.value


def test_missing_column(small):
    _expect(small.drop(columns=["verify_ms"]), "x.parquet", "missing column 'verify_ms'")


def test_wrong_dtype(small):
    bad = small.copy()
    bad["gamma"] = bad["gamma"].astype(object)
    bad.loc[bad.index[5], "gamma"] = "eight"
    _expect(bad, "row 5, column 'gamma': expected an integer, got 'eight'")


def test_nan_values(small):
    bad = small.copy()
    bad.loc[bad.index[2], "draft_ms"] = np.nan
    _expect(bad, "row 2, column 'draft_ms': expected a value")
    bad = small.copy()
    bad.at[bad.index[7], "draft_confidence"] = [float("nan")] * int(bad["gamma"].iloc[7])
    _expect(bad, "row 7, column 'draft_confidence': expected a list of finite numbers")


def test_unknown_compression(small):
    bad = small.copy()
    bad.loc[bad.index[4], "compression"] = "int4"
    err = _expect(bad, "row 4, column 'compression': expected one of fp16, bf16, fp32, int8, nf4, got 'int4'")
    assert len(err.problems) == 1


def test_semantic_errors(small):
    bad = small.copy()
    bad.loc[bad.index[1], "accepted"] = int(bad["gamma"].iloc[1]) + 1
    _expect(bad, "row 1, column 'accepted': expected a value in 0..gamma")
    bad = small.copy()
    bad.at[bad.index[3], "draft_entropy"] = [0.1]
    _expect(bad, "row 3, column 'draft_entropy': expected gamma values (one per draft token)")
    bad = small.copy()
    bad.loc[bad.index[9], "step"] = int(bad["step"].iloc[8])
    _expect(bad, "row 9, column 'step': expected a unique step")
    bad = small.copy()
    bad.loc[bad.index[0], "decoding"] = "sampling"
    bad.loc[bad.index[0], "temperature"] = 0.0
    _expect(bad, "row 0, column 'temperature': expected a value > 0 for sampling")


def test_empty_log(small, tmp_path):
    _expect(small.iloc[:0], "log has no rows")
    path = tmp_path / "empty.csv"
    path.write_text(",".join(small.columns) + "\n")
    with pytest.raises(LogValidationError, match="(?s)empty.csv.*log has no rows"):
        read_log(path)


def test_unreadable_files(tmp_path):
    p = tmp_path / "junk.parquet"
    p.write_bytes(b"not parquet at all")
    with pytest.raises(LogValidationError, match="(?s)junk.parquet.*not a readable Parquet file"):
        read_log(p)
    with pytest.raises(FileNotFoundError, match="step log not found"):
        read_log(tmp_path / "nope.parquet")
    q = tmp_path / "plain.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(q)
    with pytest.raises(LogValidationError, match="not a speckv step log"):
        read_log(q)
    c = tmp_path / "bad.csv"
    c.write_text("draft_confidence\nnot-json\n")
    with pytest.raises(LogValidationError, match="row 0, column 'draft_confidence': expected a JSON array"):
        read_log(c)


def test_failed_write_keeps_the_good_file(small, tmp_path, monkeypatch):
    path = tmp_path / "log.parquet"
    write_log(small, path)
    before = path.read_bytes()
    # an invalid frame never reaches the disk
    with pytest.raises(LogValidationError):
        write_log(small.drop(columns=["gamma"]), path)
    # a crash in the middle of writing leaves the old file and no temp file
    import speckv_policy.logs as logs_mod

    def boom(table, where, **kwargs):
        with open(where, "wb") as fh:
            fh.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(logs_mod.pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_log(small, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["log.parquet"]


def test_append(small, tmp_path):
    path = tmp_path / "log.parquet"
    append_log(path, small.iloc[:30])
    append_log(path, small.iloc[30:])
    assert len(read_log(path)) == 60
    before = path.read_bytes()
    with pytest.raises(LogValidationError, match="appended rows"):
        append_log(path, small.iloc[:5].assign(compression="int4"))
    with pytest.raises(LogValidationError, match="unique step"):
        append_log(path, small.iloc[:5])  # duplicates what is there
    assert path.read_bytes() == before
