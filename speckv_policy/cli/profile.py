"""``speckv-profile``: log step-level outcomes of real speculative decoding (see :mod:`speckv_policy.hf.profiler`)."""

from __future__ import annotations

import argparse

from ..logs import LogValidationError
from ..prompts import PromptFileError, read_prompts
from ..schema import COMPRESSIONS, DECODINGS
from .common import (
    add_draft_linear_argument,
    add_draft_precision_argument,
    add_target_linear_argument,
    comma_list,
    device_name,
    exit_cleanly_on_sigterm,
    fail,
    float_in,
    int_at_least,
    torch_device,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="speckv-profile", description="Log step-level outcomes of real speculative decoding."
    )
    p.add_argument("--target", required=True, help="target model folder, or 'smollm2'")
    p.add_argument("--draft", required=True, help="draft model folder")
    p.add_argument("--prompts", required=True, help="JSON-lines prompt file")
    p.add_argument(
        "--out",
        required=True,
        help="step log to create or resume: a .parquet file, or a log dataset directory (a path without suffix: "
        "one Parquet part per finished prompt run, partitioned by compression)",
    )
    p.add_argument(
        "--compressions",
        type=comma_list(COMPRESSIONS),
        default=("fp32", "int8", "nf4"),
        help="comma-separated target levels to profile (default fp32,int8,nf4)",
    )
    p.add_argument(
        "--decodings",
        type=comma_list(DECODINGS),
        default=("greedy", "sampling"),
        help="comma-separated decodings: greedy, sampling (default both)",
    )
    p.add_argument(
        "--gamma-max",
        type=int_at_least(1),
        default=8,
        help="tokens drafted per profiling step: every gamma up to it can be scored offline (default 8)",
    )
    p.add_argument(
        "--calibration-fraction",
        type=float_in(0.0, 1.0),
        default=0.15,
        help="share of steps that draft a random gamma in 0..gamma-max, so the cost model sees every gamma (default 0.15)",
    )
    p.add_argument(
        "--fixed-gammas",
        type=comma_list(cast=int_at_least(0)),
        default=(),
        help="also run constant gammas, e.g. 2,4,6,8 (the paper's runs)",
    )
    p.add_argument("--max-new-tokens", type=int_at_least(2), default=64, help="new tokens per answer (default 64)")
    p.add_argument(
        "--temperature",
        type=float_in(0.0, 100.0, low_open=True),
        default=0.7,
        help="sampling temperature of the sampling runs (default 0.7)",
    )
    p.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        help="torch device the models run on: cpu (default) or cuda[:N] (with --ray: on the workers)",
    )
    add_draft_precision_argument(p)
    add_target_linear_argument(p)
    add_draft_linear_argument(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling and of the calibration gammas (default 0)")
    p.add_argument("--tag", default="profile", help="prefix of run ids")
    p.add_argument("--limit", type=int_at_least(1), help="profile only the first N prompts")
    p.add_argument("--stride", type=int_at_least(1), default=1, help="profile every N-th prompt (a spread subset)")
    p.add_argument(
        "--force-new",
        action="store_true",
        help="start a new log at --out; an existing one is moved aside (renamed), never deleted",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="shard the work over a Ray cluster (needs the [ray] extra): no ADDRESS starts one on this machine; "
        "'auto' or ray://HEAD:10001 joins one. --out must then be a dataset directory every worker sees",
    )
    p.add_argument("--workers", type=int_at_least(1), help="Ray workers (default: one per GPU, or per CPU core)")
    args = p.parse_args(argv)
    if args.workers is not None and args.ray is None:
        p.error("--workers needs --ray")
    if args.ray is None:  # the models run here: the device must be here too
        try:
            torch_device(args.device)
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --device: {exc}")
    exit_cleanly_on_sigterm()
    # torch and transformers only now: --help and a bad argument answer in a fraction of a second, not ~10 s
    from ..hf.profiler import ProfileConfig, profile
    from ..smollm2.models import SMOLLM2_MODELS

    try:
        prompts = read_prompts(args.prompts)[:: args.stride][: args.limit]
        cfg = ProfileConfig(
            target=args.target,
            draft=args.draft,
            out=args.out,
            compressions=args.compressions,
            decodings=args.decodings,
            gamma_max=args.gamma_max,
            calibration_fraction=args.calibration_fraction,
            fixed_gammas=args.fixed_gammas,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            device=args.device,
            seed=args.seed,
            tag=args.tag,
            draft_precision=args.draft_precision,
            target_linear=args.target_linear,
            draft_linear=args.draft_linear,
        )
        counts = profile(
            cfg, prompts, models=SMOLLM2_MODELS, force_new=args.force_new, ray_address=args.ray, workers=args.workers
        )
    except (PromptFileError, LogValidationError, ValueError, OSError, ModuleNotFoundError) as exc:
        return fail("speckv-profile", exc)
    print(
        f"speckv-profile: {counts['done']} prompt runs profiled, {counts['skipped']} already in {args.out}, "
        f"{counts['rows']} steps written"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
