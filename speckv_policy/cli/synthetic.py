"""``python -m speckv_policy.cli.synthetic OUT.parquet``: write a SYNTHETIC step log (known acceptance process)."""

from __future__ import annotations

import argparse

from ..evaluation.synthetic import generate_synthetic_log
from ..logs import write_csv_log, write_log


def main(argv: list[str] | None = None) -> int:
    """Write a SYNTHETIC log; see :mod:`speckv_policy.evaluation.synthetic` for the process."""
    p = argparse.ArgumentParser(
        prog="python -m speckv_policy.cli.synthetic",
        description="Write a SYNTHETIC step log with a known acceptance process.",
    )
    p.add_argument("output", help=".parquet or .csv path (written atomically)")
    p.add_argument("--prompts", type=int, default=80, help="synthetic prompt runs to generate (default 80)")
    p.add_argument("--steps", type=int, default=30, help="steps per prompt and compression level")
    p.add_argument("--seed", type=int, default=1, help="seed of the synthetic acceptance process (default 1)")
    args = p.parse_args(argv)
    log, _ = generate_synthetic_log(n_prompts=args.prompts, steps_per_prompt=args.steps, seed=args.seed)
    if args.output.endswith(".csv"):
        write_csv_log(log, args.output)
    else:
        write_log(
            log,
            args.output,
            metadata={"synthetic": "true", "generator": "speckv_policy.evaluation.synthetic", "seed": str(args.seed)},
        )
    print(f"wrote {len(log)} SYNTHETIC steps ({args.prompts} prompts x 3 compressions x {args.steps}) to {args.output}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
