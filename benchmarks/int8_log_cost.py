"""What bitsandbytes' per-matmul log record costs an INT8 target forward on CPU.

Usage:
    python benchmarks/int8_log_cost.py [--target smollm2] [--repeats 10] [--target-linear onednn]

bitsandbytes' ``MatMul8bitLt`` casts a float32 input to float16 and logs a
warning saying so on every call: one record per INT8 layer per forward.
``speckv_policy.hf.load_model`` drops that record (``quiet_int8_cast_log``).
This times the INT8 target's forward over 1 and 3 new tokens after a cached
context, in one process, alternately with the records written (by a stream
handler to a temporary file, as logging's default handler writes them to a
redirected stderr) and with them dropped, and prints the median ms of each.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

BNB_LOGGER = "bitsandbytes.autograd._functions"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--context", type=int, default=120, help="cached context length before the timed forward")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    from speckv_policy.cli.common import add_target_linear_argument

    add_target_linear_argument(ap)
    args = ap.parse_args(argv)

    import torch
    from transformers import DynamicCache

    from speckv_policy.hf.onednn import apply_linear_backend
    from speckv_policy.smollm2.models import SMOLLM2_MODELS

    target = SMOLLM2_MODELS.load_model(args.target, "int8", "cpu")  # adds the filter
    apply_linear_backend(target, args.target_linear)
    logger = logging.getLogger(BNB_LOGGER)
    dropping = list(logger.filters)
    torch.manual_seed(args.seed)
    ctx = torch.randint(100, target.config.vocab_size, (1, args.context))
    times: dict[tuple[str, int], list[float]] = {(w, k): [] for w in ("written", "dropped") for k in (1, 3)}
    with tempfile.TemporaryFile("w+") as sink, torch.inference_mode():
        handler = logging.StreamHandler(sink)
        cache = DynamicCache()
        target(ctx, past_key_values=cache, use_cache=True)
        for r in range(args.repeats + 2):  # the first two rounds warm up, untimed
            for way in ("written", "dropped"):
                if way == "written":
                    logger.filters = []
                    logger.addHandler(handler)
                else:
                    logger.filters = list(dropping)
                    logger.removeHandler(handler)
                for k in (1, 3):
                    new = torch.randint(100, target.config.vocab_size, (1, k))
                    t = time.perf_counter()
                    target(new, past_key_values=cache, use_cache=True)
                    dt = (time.perf_counter() - t) * 1e3
                    cache.crop(-k)
                    if r >= 2:
                        times[(way, k)].append(dt)
        logger.removeHandler(handler)
        logger.filters = dropping
        sink.seek(0)
        written = sum(1 for line in sink if "cast from" in line)
    layers = sum(1 for m in target.modules() if type(m).__name__ == "Linear8bitLt")
    print(
        f"INT8 target forward after a cached context of {args.context}; median ms of {args.repeats} repeats; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {layers} INT8 layers; "
        f"{written} records written in all"
    )
    print("| new tokens | records written ms | dropped ms | difference ms |")
    print("|---:|---:|---:|---:|")
    for k in (1, 3):
        w, d = statistics.median(times[("written", k)]), statistics.median(times[("dropped", k)])
        print(f"| {k} | {w:.1f} | {d:.1f} | {w - d:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
