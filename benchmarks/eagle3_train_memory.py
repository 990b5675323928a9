"""Resident and anonymous memory over EAGLE-3 head training steps, with batch widths padded or exact.

An experiment of the build's memory (design note, "The build's memory was bf16 kernels and features on the heap"):
``python benchmarks/eagle3_train_memory.py --features $B/eagle3/features-fp32.pt [--round 16] [--precision fp32]``
(the single features file of a build before 7f219f7). Prints the process's memory every 25 steps and the number of
distinct batch shapes so far.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import numpy as np
import torch

from speckv_policy.hf import eagle3_train as train
from speckv_policy.hf.eagle3 import Eagle3Config
from speckv_policy.smollm2.models import load_model


def memory_mb() -> tuple[int, int]:
    """(VmRSS, RssAnon) of this process in MB, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["RssAnon"].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", required=True, help="a build's features file (a list of texts)")
    ap.add_argument("--texts", type=int, default=2000, help="first N texts (default 2000)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--round", type=int, default=1, help="pad batch widths to a multiple of this (default 1: exact)")
    ap.add_argument("--trim-every", type=int, default=0, help="glibc malloc_trim every N steps (default 0: never)")
    a = ap.parse_args()

    feats = torch.load(a.features, weights_only=True)[: a.texts]
    target = load_model("smollm2", "fp32", "cpu")
    cfg = Eagle3Config.for_target(target.config, 8192, None, verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    vocab, _ = train.choose_vocabulary(feats, 8192)
    head = train.init_head(target, cfg, vocab)
    embed = target.get_input_embeddings().weight.detach().float()
    del target
    slots = train._slots(head)  # noqa: SLF001 - the loop's own helpers, as train_head uses them
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    rng = np.random.default_rng(0)
    trim = ctypes.CDLL(None).malloc_trim
    base = memory_mb()
    print(f"start: resident {base[0]} MB, anonymous {base[1]} MB", flush=True)
    shapes: set[tuple[int, ...]] = set()
    t0, step = time.time(), 0
    while step < a.steps:
        for idx in train._batches(feats, 2048, rng):  # noqa: SLF001
            if step >= a.steps:
                break
            batch = train._collate([feats[i] for i in idx], slots, a.round)  # noqa: SLF001
            shapes.add(tuple(batch["ids"].shape))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
                loss, _ = train.ttt_forward(head, embed, batch, 2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if a.trim_every and step % a.trim_every == 0:
                trim(0)
            if step % 25 == 0:
                rss, anon = memory_mb()
                print(
                    f"step {step}: resident {rss} MB (+{rss - base[0]}), anonymous {anon} MB (+{anon - base[1]}), "
                    f"{len(shapes)} shapes, {time.time() - t0:.0f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
