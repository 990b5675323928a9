"""What appending one finished unit costs: a log dataset directory vs a single Parquet file.

Usage:
    python benchmarks/log_append.py [--rows 1000000] [--single-rows 100000] [--repeats 5]

Builds a log dataset of ``--rows`` steps (the shipped SmolLM2 profile's rows, tiled, in parts of ~9.5k
rows), then times writing one new 64-step unit (a) into an empty dataset, (b) into the big dataset, and,
for contrast, (c) ``append_log`` onto a single Parquet file of ``--single-rows`` steps (which reads,
validates and rewrites the whole file). Prints medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd

from speckv_policy.logs import append_log, read_log, write_log, write_log_parts


def _chunk(base: pd.DataFrame, run_id: str) -> pd.DataFrame:
    out = base.copy()
    out["run_id"] = run_id
    out["prompt_id"] = "all"
    out["step"] = range(len(out))
    return out


def _time(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--single-rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    base = read_log(args.log)
    unit = base[base["compression"] == "nf4"].head(64).copy()
    unit["prompt_id"] = "new"
    unit["step"] = range(len(unit))

    def new_unit(i: int) -> pd.DataFrame:
        u = unit.copy()
        u["run_id"] = f"appended-{i}"
        return u

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = tmp / "big"
        t = time.perf_counter()
        n, i = 0, 0
        while n < args.rows:
            part = _chunk(base, f"bench-{i}").head(args.rows - n)
            write_log_parts(big, part)
            n, i = n + len(part), i + 1
        print(f"built a {n:,}-row dataset in {i} parts ({time.perf_counter() - t:.0f} s)")
        alone = _time(lambda i: write_log_parts(tmp / f"empty-{i}", new_unit(i)), args.repeats)
        into_big = _time(lambda i: write_log_parts(big, new_unit(i)), args.repeats)
        single = tmp / "single.parquet"
        chunks, n, i = [], 0, 0
        while n < args.single_rows:
            chunks.append(_chunk(base, f"bench-{i}").head(args.single_rows - n))
            n, i = n + len(chunks[-1]), i + 1
        write_log(pd.concat(chunks, ignore_index=True), single)
        into_file = _time(lambda i: append_log(single, new_unit(i)), max(1, min(args.repeats, 3)))
    print(f"| append one {len(unit)}-step unit | ms (median of {args.repeats}) |")
    print("|---|---|")
    print(f"| as a part of an empty dataset (the part alone) | {alone:.1f} |")
    print(f"| as a part of the {args.rows:,}-row dataset | {into_big:.1f} |")
    print(f"| onto a single {args.single_rows:,}-row Parquet file (append_log rewrites it) | {into_file:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
