"""``speckv-calibrate``: measure the cost model of a target/draft pair on this machine (see :mod:`speckv_policy.hf.calibrate`).

speckv-calibrate --out costs.json                    # SmolLM2 + the shipped draft, fp32/INT8/NF4, ~2 minutes
speckv-export --reprice costs.json exported/smollm2-gbt.onnx gbt-here.onnx

In vLLM's environment, one request's costs at each batch size, measured inside the engine (see
:mod:`speckv_policy.vllm.calibrate`), for the vLLM proposer's ``costs=``:

.venv-vllm/bin/speckv-calibrate --engine vllm --out batch-costs.json    # batches 1..16, ~3 minutes on a laptop CPU
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from ..atomic import writable_file
from ..objective import COMPRESSION_NAMES_BY_CODE
from ..schema import COMPRESSIONS
from .common import (
    add_draft_linear_argument,
    add_draft_precision_argument,
    add_target_linear_argument,
    comma_list,
    exit_cleanly_on_sigterm,
    fail,
    int_at_least,
    torch_device,
)


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    if not math.isfinite(v):  # an infinite budget would time forever
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="speckv-calibrate", description="Measure draft and verification costs of a model pair on this machine."
    )
    p.add_argument("--out", required=True, help="JSON file for the cost model (written atomically)")
    p.add_argument("--target", default="smollm2", help="target model folder, or 'smollm2' (default)")
    p.add_argument("--draft", default="datasets/smollm2/draft", help="draft model folder (default: the shipped one)")
    p.add_argument("--prompts", default="datasets/prompts/prompts.jsonl", help="JSON-lines prompt file")
    p.add_argument(
        "--compressions",
        type=comma_list(COMPRESSIONS),
        default=("fp32", "int8", "nf4"),
        help="comma-separated target levels to time (default fp32,int8,nf4)",
    )
    p.add_argument(
        "--seconds",
        type=_positive,
        default=90.0,
        help="timing budget over all levels (default 90: about 2 minutes with model loading)",
    )
    p.add_argument(
        "--gamma-max", type=int_at_least(1), default=8, help="time verifications of 0..N draft tokens (default 8)"
    )
    p.add_argument(
        "--max-new-tokens", type=int_at_least(4), default=48, help="new tokens per timed generation (default 48)"
    )
    p.add_argument(
        "--device", type=torch_device, default="cpu", help="torch device the models run on: cpu (default) or cuda[:N]"
    )
    add_draft_precision_argument(p)
    add_target_linear_argument(p)
    add_draft_linear_argument(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the order the gammas are timed in (default 0)")
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf (default): one request in Hugging Face generation, per compression level; vllm: per batch size "
        "inside vLLM (run with vLLM's environment; fp32 target; writes batch costs for the vLLM proposer)",
    )
    p.add_argument(
        "--batch-sizes",
        type=comma_list(cast=int_at_least(1)),
        default=(1, 2, 4, 8, 16),
        help="with --engine vllm: batch sizes to time (default 1,2,4,8,16)",
    )
    args = p.parse_args(argv)
    exit_cleanly_on_sigterm()
    if args.engine == "vllm":
        return _calibrate_vllm(args)

    from ..hf.calibrate import CalibrationConfig, calibrate
    from ..prompts import PromptFileError, read_prompts
    from ..smollm2.models import SMOLLM2_MODELS

    comps = args.compressions
    t0 = time.perf_counter()

    def progress(comp: str, steps: int, seconds: float) -> None:
        print(f"\r  {comp}: {steps} steps timed in {seconds:.0f} s", end="", file=sys.stderr, flush=True)

    try:
        writable_file(args.out)  # refused now, not after minutes of timing
        prompts = [q for q in read_prompts(args.prompts) if q.split == "train"] or read_prompts(args.prompts)
        cfg = CalibrationConfig(
            target=args.target,
            draft=args.draft,
            compressions=comps,
            gamma_max=args.gamma_max,
            seconds=args.seconds,
            max_new_tokens=args.max_new_tokens,
            device=args.device,
            seed=args.seed,
            draft_precision=args.draft_precision,
            target_linear=args.target_linear,
            draft_linear=args.draft_linear,
        )
        cost, steps = calibrate(cfg, prompts, models=SMOLLM2_MODELS, progress=progress)
        print(file=sys.stderr)
        cost.save(args.out)
    except (PromptFileError, ValueError, OSError, ModuleNotFoundError) as exc:
        print(file=sys.stderr)
        return fail("speckv-calibrate", exc)
    print(
        f"cost model of {args.target} + {args.draft} on {args.device} ({cost.machine}), {len(steps)} steps timed "
        f"({time.perf_counter() - t0:.0f} s in all) -> {args.out}"
    )
    for line in cost.describe():
        code = int(line.split(" ", 1)[0])
        name = COMPRESSION_NAMES_BY_CODE[code]
        measured = name in comps or (name == "full precision" and set(comps) & {"fp32", "fp16", "bf16"})
        print(f"  {line}" + ("" if measured else "   [not timed: borrowed from the nearest level timed]"))
    return 0


def _calibrate_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: batch costs measured inside vLLM's engine."""
    import importlib.util

    from ..prompts import PromptFileError, read_prompts

    if importlib.util.find_spec("vllm") is None:
        return fail(
            "speckv-calibrate",
            "--engine vllm needs vLLM, which this environment lacks: make vLLM's own environment with "
            "bash .ci/setup-vllm and run .venv-vllm/bin/speckv-calibrate --engine vllm ...",
        )
    t0 = time.perf_counter()
    try:
        writable_file(args.out)
        from transformers import AutoTokenizer

        from ..smollm2.gguf import smollm2_safetensors
        from ..vllm.calibrate import calibrate_vllm

        target = str(smollm2_safetensors()) if args.target == "smollm2" else args.target
        tok = AutoTokenizer.from_pretrained(target)
        prompts = [q for q in read_prompts(args.prompts) if q.split == "train"] or read_prompts(args.prompts)
        texts = [
            tok.apply_chat_template([{"role": "user", "content": q.text}], tokenize=False, add_generation_prompt=True)
            for q in prompts
        ]

        def progress(batch: int, steps: int) -> None:
            print(f"\r  batch {batch}: {steps} steps timed", end="", file=sys.stderr, flush=True)

        loader = "speckv_policy.smollm2.models.load_model" if args.draft.startswith("datasets/smollm2") else None
        costs, steps = calibrate_vllm(
            target,
            args.draft,
            texts,
            batch_sizes=args.batch_sizes,
            max_tokens=args.max_new_tokens,
            device="cuda" if args.device.startswith("cuda") else "cpu",
            **({"draft_loader": loader} if loader else {}),
            progress=progress,
        )
        print(file=sys.stderr)
        costs.save(args.out)
    except (PromptFileError, ValueError, OSError, ModuleNotFoundError) as exc:
        print(file=sys.stderr)
        return fail("speckv-calibrate", exc)
    print(
        f"batch costs of {args.target} + {args.draft} inside vLLM ({costs.machine}), {len(steps['batch'])} engine "
        f"steps timed ({time.perf_counter() - t0:.0f} s in all) -> {args.out}"
    )
    for line in costs.describe():
        print(f"  {line}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
