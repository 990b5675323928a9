"""Acceptance by position in the answer: does a profile's answer length matter?

    .venv/bin/python benchmarks/profile_positions.py --log datasets/smollm2/steps.parquet --edges 0,8,16,24,32,48

For every step that drafted at least 8 tokens (its accepted length is known up to 8), the tokens a fixed gamma 8
would produce there (accepted + 1), averaged per compression level, decoding and bucket of the step's position in
the answer (context length minus the run's first context length). A profile that stops after N new tokens trains
and evaluates policies on the first N positions only; if later positions accept less, its figures flatter
longer generations.
"""

from __future__ import annotations

import argparse

import numpy as np

from speckv_policy.logs import read_log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--edges", default="0,8,16,24,32,48", help="bucket edges in new tokens (last one open-ended)")
    args = ap.parse_args()
    edges = [int(e) for e in args.edges.split(",")]
    log = read_log(args.log)
    start = log.groupby(["run_id", "prompt_id"])["context_len"].transform("min")
    log = log.assign(position=log["context_len"] - start)
    full = log[log["gamma"] >= 8]
    labels = [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
    bucket = np.searchsorted(edges, full["position"].to_numpy(), side="right") - 1
    full = full.assign(bucket=bucket, tokens=np.minimum(full["accepted"], 8) + 1)
    print(f"log {args.log}: {len(full)} steps that drafted >= 8; tokens per step of fixed gamma 8 (steps)")
    print(f"{'block':<16}" + "".join(f"{lab:>14}" for lab in labels))
    for (comp, dec), g in full.groupby(["compression", "decoding"], sort=False):
        cells = []
        for b in range(len(labels)):
            t = g.loc[g["bucket"] == b, "tokens"]
            cells.append(f"{t.mean():.2f} ({len(t)})" if len(t) else "-")
        print(f"{comp + ' ' + dec:<16}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
