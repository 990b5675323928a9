"""Step logs: one row per speculation step, stored as Parquet.

The schema version sits in the Parquet file's key-value metadata under
``speckv.log_schema_version``. :func:`validate_log` names the file, row and
column of every problem. Writes are atomic: data goes to a temporary file in
the destination folder, which is then renamed over the target, so a crash
never leaves a half-written log in place of a good one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .atomic import atomic_write
from .schema import COMPRESSIONS, DECODINGS, TASK_TYPES

LOG_SCHEMA_VERSION = 1
SPLITS: tuple[str, ...] = ("train", "heldout")

#: Column name -> (arrow type, description). Order is the on-disk order.
COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "run_id": (pa.string(), "identifier of one profiler/generation run"),
    "prompt_id": (pa.string(), "identifier of the prompt"),
    "split": (pa.string(), "'train' or 'heldout': held-out prompts never train a policy"),
    "task_type": (pa.string(), "one of " + ", ".join(TASK_TYPES)),
    "compression": (pa.string(), "one of " + ", ".join(COMPRESSIONS)),
    "decoding": (pa.string(), "'greedy' or 'sampling'"),
    "temperature": (pa.float64(), "sampling temperature (>= 0; ignored for greedy)"),
    "top_p": (pa.float64(), "nucleus mass in (0, 1]"),
    "step": (pa.int64(), "0-based step index within (run_id, prompt_id)"),
    "context_len": (pa.int64(), "tokens in the context before the step (>= 1)"),
    "gamma": (pa.int64(), "draft tokens proposed this step (>= 0)"),
    "accepted": (pa.int64(), "accepted prefix length, 0..gamma"),
    "draft_confidence": (pa.list_(pa.float64()), "per draft token top-1 probability, gamma values in [0, 1]"),
    "draft_entropy": (pa.list_(pa.float64()), "per draft token entropy in nats, gamma values >= 0"),
    "draft_token_prob": (
        pa.list_(pa.float64()),
        "per draft token probability of the drafted token, gamma values in [0, 1]",
    ),
    "draft_ms": (pa.float64(), "wall time spent drafting this step (ms, >= 0)"),
    "verify_ms": (pa.float64(), "wall time of the target's verification forward (ms, >= 0)"),
    "device": (pa.string(), "device the step ran on, e.g. 'cpu', 'cuda:0'"),
    "draft_model": (pa.string(), "draft model id"),
    "target_model": (pa.string(), "target model id"),
}
ARROW_SCHEMA = pa.schema([pa.field(name, typ, nullable=False) for name, (typ, _) in COLUMNS.items()])
LIST_COLUMNS = ("draft_confidence", "draft_entropy", "draft_token_prob")
_MAX_REPORTED = 20


class LogValidationError(ValueError):
    """A step log breaks the schema; ``problems`` lists every finding."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        shown = problems[:_MAX_REPORTED]
        more = len(problems) - len(shown)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"{source}: invalid step log:\n  " + "\n  ".join(shown) + tail)


def _row_problems(mask: np.ndarray, df: pd.DataFrame, col: str, expected: str) -> list[str]:
    out = []
    for pos in np.flatnonzero(mask)[:_MAX_REPORTED]:
        out.append(f"row {pos}, column '{col}': expected {expected}, got {df[col].iloc[pos]!r}")
    return out


def validate_log(df: pd.DataFrame, source: str = "<memory>") -> pd.DataFrame:
    """Check a step log against the schema and return it with canonical dtypes.

    Parameters
    ----------
    df : pandas.DataFrame
        Candidate log.
    source : str
        Name used in error messages (usually the file path).

    Returns
    -------
    pandas.DataFrame
        The log, columns in schema order and dtypes coerced.

    Raises
    ------
    LogValidationError
        Listing each problem as ``row R, column 'C': expected ..., got ...``.
    """
    problems: list[str] = []
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise LogValidationError(source, [f"missing column '{c}' ({COLUMNS[c][1]})" for c in missing])
    if len(df) == 0:
        raise LogValidationError(source, ["log has no rows"])
    df = df[list(COLUMNS)].reset_index(drop=True)
    out: dict[str, Any] = {}
    for col, (typ, desc) in COLUMNS.items():
        s = df[col]
        null = (
            s.isna().to_numpy()
            if not pa.types.is_list(typ)
            else np.array([v is None or (isinstance(v, float) and np.isnan(v)) for v in s], dtype=bool)
        )
        if null.any():
            problems += _row_problems(null, df, col, f"a value ({desc})")
            continue
        if pa.types.is_string(typ):
            bad = ~np.array([isinstance(v, str) for v in s], dtype=bool)
            if bad.any():
                problems += _row_problems(bad, df, col, "a string")
                continue
            out[col] = s.astype(str)
        elif pa.types.is_integer(typ):
            num = pd.to_numeric(s, errors="coerce")
            v = num.to_numpy(dtype=np.float64, na_value=np.nan)
            bad = ~np.isfinite(v) | (v != np.round(v))
            if bad.any():
                problems += _row_problems(bad, df, col, "an integer")
                continue
            huge = np.abs(v) >= 2.0**62  # would wrap around when cast to int64
            if huge.any():
                problems += _row_problems(huge, df, col, "an integer (within int64)")
                continue
            out[col] = v.astype(np.int64)
        elif pa.types.is_floating(typ):
            num = pd.to_numeric(s, errors="coerce")
            v = num.to_numpy(dtype=np.float64, na_value=np.nan)
            bad = ~np.isfinite(v)
            if bad.any():
                problems += _row_problems(bad, df, col, "a finite number")
                continue
            out[col] = v
        else:  # list<float64>
            vals = []
            bad_rows = []
            for pos, v in enumerate(s):
                try:
                    arr = np.asarray(v, dtype=np.float64).reshape(-1)
                    if isinstance(v, (str, bytes)) or not np.all(np.isfinite(arr)):
                        raise ValueError
                except (TypeError, ValueError):
                    bad_rows.append(pos)
                    arr = np.empty(0)
                vals.append(arr)
            if bad_rows:
                mask = np.zeros(len(df), bool)
                mask[bad_rows] = True
                problems += _row_problems(mask, df, col, "a list of finite numbers")
                continue
            out[col] = vals
    if problems:
        raise LogValidationError(source, problems)

    def check(mask: np.ndarray, col: str, expected: str) -> None:
        if mask.any():
            problems.extend(_row_problems(mask, df, col, expected))

    for col, allowed in (
        ("task_type", TASK_TYPES),
        ("compression", COMPRESSIONS),
        ("decoding", DECODINGS),
        ("split", SPLITS),
    ):
        check(~out[col].isin(allowed).to_numpy(), col, "one of " + ", ".join(allowed))
    check(out["temperature"] < 0, "temperature", "a value >= 0")
    sampling = (out["decoding"] == "sampling").to_numpy()
    check(sampling & (out["temperature"] <= 0), "temperature", "a value > 0 for sampling")
    check((out["top_p"] <= 0) | (out["top_p"] > 1), "top_p", "a value in (0, 1]")
    check(out["step"] < 0, "step", "a value >= 0")
    check(out["context_len"] < 1, "context_len", "a value >= 1")
    check(out["gamma"] < 0, "gamma", "a value >= 0")
    check((out["accepted"] < 0) | (out["accepted"] > out["gamma"]), "accepted", "a value in 0..gamma")
    check(out["draft_ms"] < 0, "draft_ms", "a value >= 0")
    check(out["verify_ms"] < 0, "verify_ms", "a value >= 0")
    gamma = out["gamma"]
    for col in LIST_COLUMNS:
        lens = np.array([len(a) for a in out[col]])
        check(lens != gamma, col, "gamma values (one per draft token)")
        lo = np.array([a.min() if len(a) else 0.0 for a in out[col]])
        hi = np.array([a.max() if len(a) else 0.0 for a in out[col]])
        if col == "draft_entropy":
            check(lo < 0, col, "entropies >= 0")
        else:
            check((lo < 0) | (hi > 1 + 1e-9), col, "probabilities in [0, 1]")
    keys = pd.DataFrame({"r": out["run_id"], "p": out["prompt_id"], "s": out["step"]})
    dup = keys.duplicated().to_numpy()
    check(dup, "step", "a unique step within (run_id, prompt_id)")
    if problems:
        raise LogValidationError(source, problems)
    return pd.DataFrame(out)


def _to_table(df: pd.DataFrame, extra_metadata: Mapping[str, str] | None) -> pa.Table:
    data = {c: df[c].tolist() if c in LIST_COLUMNS else df[c] for c in COLUMNS}
    data = {c: [list(map(float, v)) for v in data[c]] if c in LIST_COLUMNS else data[c] for c in data}
    table = pa.Table.from_pydict(data, schema=ARROW_SCHEMA)
    meta = {"speckv.log_schema_version": str(LOG_SCHEMA_VERSION)}
    if extra_metadata:
        meta.update({f"speckv.{k}": str(v) for k, v in extra_metadata.items()})
    return table.replace_schema_metadata(meta)


def write_log(
    df: pd.DataFrame,
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Validate ``df`` and write it atomically as Parquet.

    Returns the validated frame.
    """
    valid = validate_log(df, source=str(path))
    table = _to_table(valid, metadata)
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))
    return valid


def append_log(
    path: str | os.PathLike[str],
    rows: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Append rows to the log at ``path`` (created if absent), atomically.

    ``metadata`` (``speckv.``-prefixed in the file) is recorded when the log is
    created; an existing log keeps the metadata it has.

    The new rows are validated together with the existing ones before anything
    is written, so an invalid batch leaves the file exactly as it was.
    """
    new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    path = Path(path)
    with _append_lock(path):  # two processes appending to one log: one at a time, so no unit is lost
        meta: dict[str, str] = dict(metadata or {})
        if path.exists():
            old = read_log(path)
            meta = read_log_metadata(path)
            new = pd.concat([old, validate_log(new, source=f"{path} (appended rows)")], ignore_index=True)
        return write_log(new, path, metadata=meta)


@contextlib.contextmanager
def _append_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path``'s sibling ``.NAME.lock`` (POSIX ``flock``; none elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_log_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata a Parquet log was written with (``speckv.`` prefix and schema version left out)."""
    return {
        k.removeprefix("speckv."): v for k, v in _file_metadata(Path(path)).items() if k != "speckv.log_schema_version"
    }


def _file_metadata(path: Path) -> dict[str, str]:
    raw = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"speckv.")}


def read_log(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read and validate a step log (``.parquet`` or ``.csv``).

    CSV files hold the per-token columns as JSON arrays, e.g. ``[0.91, 0.42]``.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    LogValidationError
        If the file is unreadable or breaks the schema (message names the file).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"step log not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return read_csv_log(path)
    if suffix not in (".parquet", ".pq"):
        raise LogValidationError(str(path), [f"unknown log format '{suffix}': expected .parquet or .csv"])
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise LogValidationError(str(path), [f"not a readable Parquet file ({exc})"]) from exc
    version = (table.schema.metadata or {}).get(b"speckv.log_schema_version")
    if version is None:
        raise LogValidationError(
            str(path), ["no 'speckv.log_schema_version' in the file metadata: not a speckv step log"]
        )
    if int(version) > LOG_SCHEMA_VERSION:
        raise LogValidationError(
            str(path), [f"log schema version {int(version)} is newer than this package's ({LOG_SCHEMA_VERSION})"]
        )
    return validate_log(table.to_pandas(), source=str(path))


def read_csv_log(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Import a CSV step log (per-token lists as JSON arrays) and validate it."""
    path = Path(path)
    try:
        df = pd.read_csv(path, dtype={"run_id": str, "prompt_id": str}, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise LogValidationError(str(path), [f"not a readable CSV file ({exc})"]) from exc
    for col in LIST_COLUMNS:
        if col not in df.columns:
            continue
        parsed = []
        for pos, cell in enumerate(df[col]):
            try:
                val = json.loads(cell) if isinstance(cell, str) else cell
                if not isinstance(val, list):
                    raise ValueError
            except (ValueError, TypeError):
                raise LogValidationError(
                    str(path),
                    [f"row {pos}, column '{col}': expected a JSON array of numbers like [0.9, 0.5], got {cell!r}"],
                ) from None
            parsed.append(val)
        df[col] = parsed
    return validate_log(df, source=str(path))


def write_csv_log(df: pd.DataFrame, path: str | os.PathLike[str]) -> None:
    """Write a validated log as CSV (per-token lists as JSON arrays), atomically."""
    valid = validate_log(df, source=str(path))
    out = valid.copy()
    for col in LIST_COLUMNS:
        out[col] = [json.dumps([float(x) for x in v]) for v in out[col]]
    atomic_write(path, lambda tmp: out.to_csv(tmp, index=False))
