"""Step logs: one row per speculation step, stored as Parquet.

A log is a single Parquet file or a **log dataset**: a directory of Parquet
part files, one per unit of work (a run x prompt), partitioned Hive-style by
compression (``DIR/compression=nf4/part-<hash>.parquet``) beside a
``_speckv_log.json`` marker with the schema version and the log's metadata.
pandas, ``pyarrow.dataset``, Spark and Ray Data read such a directory as it is;
appending a part costs the part, not the log.

The schema version sits in the Parquet file's key-value metadata under
``speckv.log_schema_version``. :func:`validate_log` names the file, row and
column of every problem. Writes are atomic: data goes to a temporary file in
the destination folder (named with a leading dot, which dataset readers skip),
which is then renamed over the target, so a crash never leaves a half-written
log or part in place of a good one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from .atomic import NotAFileError, atomic_write, create_text_exclusive, readable_file
from .schema import COMPRESSIONS, CONTEXT_MATCH_CAP, DECODINGS, SIGNAL_COLUMNS, TASK_TYPES

LOG_SCHEMA_VERSION = 2  # v2 added SIGNAL_COLUMNS; v1 logs still read (those columns NaN)
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
    # log schema v2: the pre-draft signals of the 'pre' feature set, as they were before the step
    "target_confidence": (
        pa.float64(),
        "top-1 probability of the target's processed distribution at the last verified position before the step "
        "(0 before the first verification; NaN: not recorded, a v1 log)",
    ),
    "target_entropy": (pa.float64(), "entropy in nats of that distribution (0 before the first; NaN: not recorded)"),
    "context_match_len": (
        pa.float64(),
        "longest self-repeating suffix of the context before the step, 0..8 tokens (NaN: not recorded)",
    ),
}
ARROW_SCHEMA = pa.schema([pa.field(name, typ, nullable=name in SIGNAL_COLUMNS) for name, (typ, _) in COLUMNS.items()])
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


#: ``draft_model`` values of steps drafted by an EAGLE-3 head start with this (``speckv_policy.hf.models.model_id``)
EAGLE3_PREFIX = "eagle3:"


def draft_kind(df: pd.DataFrame) -> str:
    """What drafted a log's steps: ``'eagle3'`` (heads reading the target), ``'model'`` (draft models) or ``'mixed'``."""
    names = df["draft_model"].astype(str)
    heads = names.str.startswith(EAGLE3_PREFIX)
    return "eagle3" if bool(heads.all()) else "model" if not bool(heads.any()) else "mixed"


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
    missing = [c for c in COLUMNS if c not in df.columns and c not in SIGNAL_COLUMNS]
    if missing:
        raise LogValidationError(source, [f"missing column '{c}' ({COLUMNS[c][1]})" for c in missing])
    if len(df) == 0:
        raise LogValidationError(source, ["log has no rows"])
    df = df.reindex(columns=list(COLUMNS)).reset_index(drop=True)  # absent signal columns: NaN, not recorded
    out: dict[str, Any] = {}
    for col, (typ, desc) in COLUMNS.items():
        s = df[col]
        if col in SIGNAL_COLUMNS:
            num = pd.to_numeric(s, errors="coerce")
            v = num.to_numpy(dtype=np.float64, na_value=np.nan)
            bad = np.isinf(v) | (num.isna().to_numpy() & s.notna().to_numpy())  # NaN allowed, text and inf not
            if bad.any():
                problems += _row_problems(bad, df, col, "a finite number or NaN (not recorded)")
                continue
            out[col] = v
            continue
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
    tc, te, cm = out["target_confidence"], out["target_entropy"], out["context_match_len"]
    check((tc < 0) | (tc > 1 + 1e-9), "target_confidence", "a probability in [0, 1] or NaN")
    check(te < 0, "target_entropy", "a value >= 0 or NaN")
    check(
        (cm < 0) | (cm > CONTEXT_MATCH_CAP) | (np.isfinite(cm) & (cm != np.round(cm))),
        "context_match_len",
        f"an integer in 0..{CONTEXT_MATCH_CAP} or NaN",
    )
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
    atomic_write(path, lambda tmp: _write_parquet(table, tmp))
    return valid


def _write_parquet(table: pa.Table, path: str) -> None:
    """Write ``table`` with a CRC-32 checksum on every page (verified on every read: a flipped bit is an error)."""
    pq.write_table(table, path, write_page_checksum=True)


def _version_problem(version: Any) -> str | None:
    """Why ``version`` is not a log schema version this package reads (None if it is one)."""
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= LOG_SCHEMA_VERSION:
        return f"log schema version {version!r}: expected an integer from 1 to {LOG_SCHEMA_VERSION}"
    return None


def _parse_version(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return raw.decode(errors="replace")


def _check_metadata_agrees(where: Path, recorded: Mapping[str, str], given: Mapping[str, str] | None) -> None:
    """Refuse rows whose metadata (e.g. ``profile_settings``) differs from what the log recorded when created."""
    differ = [k for k, v in (given or {}).items() if k in recorded and recorded[k] != str(v)]
    if differ:
        detail = "; ".join(f"{k}: {recorded[k]} in the log, {given[k]} for these rows" for k in differ)  # type: ignore[index]
        raise LogValidationError(
            str(where),
            [
                f"these rows were made with other settings than the log ({detail}); refusing to mix them "
                "(write them to another log)"
            ],
        )


def append_log(
    path: str | os.PathLike[str],
    rows: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Append rows to the log at ``path`` (created if absent), atomically.

    ``path`` may be a log dataset directory (see :func:`is_dataset_path`): the
    rows are then written as part files (:func:`write_log_parts`), O(new rows).
    A single file is rewritten whole, O(log).

    ``metadata`` (``speckv.``-prefixed in the file) is recorded when the log is
    created; an existing log keeps the metadata it has, and rows whose
    metadata differs from it on a key both have (two profiles with different
    settings into one log) are refused: the first writer wins.

    The new rows are validated together with the existing ones before anything
    is written, so an invalid batch leaves the file exactly as it was.
    """
    new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    path = Path(path)
    if is_dataset_path(path):
        return write_log_parts(path, new, metadata=metadata)
    with _append_lock(path):  # two processes appending to one log: one at a time, so no unit is lost
        meta: dict[str, str] = dict(metadata or {})
        if path.exists():
            old = read_log(path)
            meta = read_log_metadata(path)
            _check_metadata_agrees(path, meta, metadata)
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
    """The metadata a Parquet log or log dataset was written with (``speckv.`` prefix and schema version left out)."""
    if Path(path).is_dir():
        return dict(_read_marker(Path(path))["metadata"])
    return {
        k.removeprefix("speckv."): v for k, v in _file_metadata(Path(path)).items() if k != "speckv.log_schema_version"
    }


def _file_metadata(path: Path) -> dict[str, str]:
    try:
        readable_file(path, "step log")
    except NotAFileError as exc:
        raise LogValidationError(str(path), [str(exc)]) from None
    try:
        raw = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as exc:
        raise LogValidationError(str(path), [f"not a readable Parquet file ({exc})"]) from exc
    return {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"speckv.")}


def read_log(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read and validate a step log (``.parquet``, ``.csv`` or a log dataset directory).

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
    if path.is_dir():
        return read_log_dataset(path)
    try:
        readable_file(path, "step log")
    except NotAFileError as exc:
        raise LogValidationError(str(path), [str(exc)]) from None
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return read_csv_log(path)
    if suffix not in (".parquet", ".pq"):
        raise LogValidationError(str(path), [f"unknown log format '{suffix}': expected .parquet or .csv"])
    try:
        table = pq.read_table(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as exc:
        raise LogValidationError(str(path), [f"not a readable Parquet file ({exc})"]) from exc
    raw = (table.schema.metadata or {}).get(b"speckv.log_schema_version")
    if raw is None:
        raise LogValidationError(
            str(path), ["no 'speckv.log_schema_version' in the file metadata: not a speckv step log"]
        )
    version = _parse_version(raw)
    if isinstance(version, int) and version > LOG_SCHEMA_VERSION:
        raise LogValidationError(
            str(path), [f"log schema version {version} is newer than this package's ({LOG_SCHEMA_VERSION})"]
        )
    problem = _version_problem(version)
    if problem:
        raise LogValidationError(str(path), [problem])
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


# -- log datasets: a directory of part files ---------------------------------------------------
DATASET_MARKER = "_speckv_log.json"
DATASET_FORMAT = "speckv-step-log-dataset"
PARTITION_COLUMN = "compression"
_PART_SCHEMA = pa.schema([f for f in ARROW_SCHEMA if f.name != PARTITION_COLUMN])
_PARTITIONING = pads.partitioning(pa.schema([(PARTITION_COLUMN, pa.string())]), flavor="hive")


def is_dataset_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a log dataset: an existing directory, or a path without a file suffix."""
    p = Path(path)
    return p.is_dir() or (not p.exists() and p.suffix == "")


def part_path(directory: str | os.PathLike[str], run_id: str, prompt_id: str, compression: str) -> Path:
    """Where the part of one (run, prompt) unit lives: the name depends only on the unit, so a retry replaces it."""
    digest = hashlib.sha1(f"{run_id}\0{prompt_id}".encode()).hexdigest()[:20]
    return Path(directory) / f"{PARTITION_COLUMN}={compression}" / f"part-{digest}.parquet"


def _read_marker(directory: Path) -> dict[str, Any]:
    marker = directory / DATASET_MARKER
    try:
        readable_file(marker, "dataset marker")
        data = json.loads(marker.read_text())
    except NotAFileError as exc:
        raise LogValidationError(str(marker), [str(exc)]) from None
    except FileNotFoundError:
        raise LogValidationError(
            str(directory), [f"no {DATASET_MARKER}: not a speckv log dataset (a directory written by speckv-profile)"]
        ) from None
    except (OSError, ValueError) as exc:
        raise LogValidationError(str(marker), [f"unreadable dataset marker ({exc})"]) from None
    if not isinstance(data, dict) or data.get("format") != DATASET_FORMAT:
        raise LogValidationError(str(marker), [f"expected a JSON object with format {DATASET_FORMAT!r}"])
    problem = _version_problem(data.get("log_schema_version"))
    if problem:
        raise LogValidationError(str(marker), [problem])
    meta = data.setdefault("metadata", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise LogValidationError(str(marker), ["'metadata' must be a JSON object of strings"])
    return data


def _ensure_marker(directory: Path, metadata: Mapping[str, str] | None) -> None:
    """Create the dataset marker if absent (exclusively: of two writers creating it at once, the first wins), then
    check the rows' metadata against the dataset's: parts made with other settings are refused."""
    marker = directory / DATASET_MARKER
    if not os.path.lexists(marker):
        directory.mkdir(parents=True, exist_ok=True)
        body = {
            "format": DATASET_FORMAT,
            "log_schema_version": LOG_SCHEMA_VERSION,
            "partitioning": [PARTITION_COLUMN],
            "metadata": {k: str(v) for k, v in (metadata or {}).items()},
        }
        create_text_exclusive(marker, json.dumps(body, indent=1, sort_keys=True) + "\n")  # False: another was first
    recorded = _read_marker(directory)  # refuse to add parts to something that is not a compatible dataset
    _check_metadata_agrees(marker, recorded["metadata"], metadata)


def write_log_parts(
    directory: str | os.PathLike[str],
    rows: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Validate ``rows`` and write them into the log dataset ``directory``, one part file per (run, prompt).

    Each part is written atomically under a name fixed by its unit
    (:func:`part_path`): writing a unit again (a retried worker) replaces its
    part, so no step is ever stored twice, and nothing else is read or
    rewritten. ``metadata`` is recorded when the dataset is created.

    Returns the validated rows.
    """
    directory = Path(directory)
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    valid = validate_log(df, source=f"{directory} (new part)")
    _ensure_marker(directory, metadata)
    for (run_id, prompt_id, compression), unit in valid.groupby(["run_id", "prompt_id", PARTITION_COLUMN], sort=False):
        table = _to_table(unit, None).drop_columns([PARTITION_COLUMN])
        target = part_path(directory, run_id, prompt_id, compression)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, lambda tmp, table=table: _write_parquet(table, tmp))
    return valid


def _dataset(directory: Path) -> pads.Dataset:
    """The dataset's parts, each checked: a regular file, a known schema version, and no column contradicting its
    partition directory (pyarrow would read the directory's value); page checksums are verified as it reads."""
    fmt = pads.ParquetFileFormat(
        default_fragment_scan_options=pads.ParquetFragmentScanOptions(page_checksum_verification=True)
    )
    try:
        ds = pads.dataset(directory, format=fmt, partitioning=_PARTITIONING, schema=_dataset_schema())
    except (pa.ArrowException, OSError) as exc:
        raise LogValidationError(str(directory), [f"not a readable Parquet dataset ({exc})"]) from exc
    for sub in directory.glob(f"{PARTITION_COLUMN}=*/*.parquet"):  # pyarrow skips special files: refuse them
        try:
            readable_file(sub, "part file")
        except NotAFileError as exc:
            raise LogValidationError(str(sub), [str(exc)]) from None
    for part in ds.files:
        _check_part(Path(part))
    return ds


def _check_part(part: Path) -> None:
    try:
        readable_file(part, "part file")
        schema = pq.read_schema(part)
    except NotAFileError as exc:
        raise LogValidationError(str(part), [str(exc)]) from None
    except (pa.ArrowException, OSError) as exc:
        raise LogValidationError(str(part), [f"not a readable Parquet file ({exc})"]) from exc
    problem = _version_problem(_parse_version((schema.metadata or {}).get(b"speckv.log_schema_version")))
    if problem:
        raise LogValidationError(str(part), [problem])
    if PARTITION_COLUMN in schema.names:
        where = part.parent.name.partition("=")[2]
        values = set(pq.read_table(part, columns=[PARTITION_COLUMN]).column(0).to_pylist())
        if values != {where}:
            raise LogValidationError(
                str(part),
                [f"column {PARTITION_COLUMN!r} holds {sorted(map(str, values))}, but the part lies under {where!r}"],
            )


def _dataset_schema() -> pa.Schema:
    return _PART_SCHEMA.append(pa.field(PARTITION_COLUMN, pa.string()))


def read_log_dataset(directory: str | os.PathLike[str]) -> pd.DataFrame:
    """Read and validate a log dataset directory (every part, every partition), sorted by run, prompt and step."""
    directory = Path(directory)
    _read_marker(directory)
    try:
        table = _dataset(directory).to_table()
    except (pa.ArrowException, OSError) as exc:
        raise LogValidationError(str(directory), [f"a part file is unreadable ({exc})"]) from exc
    # rows in a canonical order, whatever order the parts were written or listed in
    table = table.sort_by([("run_id", "ascending"), ("prompt_id", "ascending"), ("step", "ascending")])
    return validate_log(table.to_pandas(), source=str(directory))


def logged_units(path: str | os.PathLike[str]) -> set[tuple[str, str]]:
    """The (run_id, prompt_id) pairs a log already holds, reading only those two columns."""
    path = Path(path)
    if not path.exists():
        return set()
    if path.is_dir():
        _read_marker(path)
        try:
            table = _dataset(path).to_table(columns=["run_id", "prompt_id"])
        except (pa.ArrowException, OSError) as exc:
            raise LogValidationError(str(path), [f"a part file is unreadable ({exc})"]) from exc
    else:
        table = pq.read_table(path, columns=["run_id", "prompt_id"])
    return set(zip(table.column("run_id").to_pylist(), table.column("prompt_id").to_pylist()))
