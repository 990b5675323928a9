"""Do two step logs (files or dataset directories) hold the same steps? Timings aside.

Usage:
    python benchmarks/compare_logs.py LOG_A LOG_B

Prints the row counts, whether keys, context lengths, gammas and accepted counts are identical, and the largest
difference in the per-token features (confidence, entropy, token probability). Exit status 1 when the steps differ.
"""

from __future__ import annotations

import sys

import numpy as np

from speckv_policy.logs import read_log

KEY = ["run_id", "prompt_id", "step"]
SAME = [*KEY, "compression", "decoding", "context_len", "gamma", "accepted"]
FEATURES = ["draft_confidence", "draft_entropy", "draft_token_prob"]


def main(argv: list[str] | None = None) -> int:
    a_path, b_path = (argv if argv is not None else sys.argv[1:])[:2]
    a = read_log(a_path).sort_values(KEY).reset_index(drop=True)
    b = read_log(b_path).sort_values(KEY).reset_index(drop=True)
    same = len(a) == len(b) and a[SAME].equals(b[SAME])
    print(f"rows: {len(a)} vs {len(b)}; keys, context lengths, gammas, accepted identical: {same}")
    if same:
        for col in FEATURES:
            diff = max((float(np.max(np.abs(x - y))) for x, y in zip(a[col], b[col]) if len(x)), default=0.0)
            print(f"  {col}: max |difference| {diff:.2g}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
