"""Experiment: is an EAGLE-3 head short of data or of capacity? Its agreement on texts it fitted against new ones.

A build's work folder keeps every text's features in the build's order (the fitted texts, then the validation texts,
then the held-out ones). This scores each head given, teacher-forced with and without its copy gate, on a seeded
sample of the fitted *greedy* answers (the same kind of answer as the validation and held-out texts) and on all the
validation texts. A head far better on what it fitted is short of data; one no better is short of capacity or steps.

    python benchmarks/eagle3_fit_gap.py --corpus A.pt,B.pt,... --features WORK/features-fp32[.pt] \
        --head HEAD [--head HEAD2 ...] [--sample 300]

``--corpus`` is the build's own comma-separated corpus list, in its order (it says which fitted texts are greedy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speckv_policy.hf.eagle3 import load_eagle3  # noqa: E402
from speckv_policy.hf.eagle3_train import agreement  # noqa: E402
from speckv_policy.smollm2.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--features", required=True, help="a build's features-fp32 folder of shards, or its .pt file")
    ap.add_argument("--head", action="append", required=True)
    ap.add_argument("--fit-prefix", default="gen-")
    ap.add_argument("--sample", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    split, pid, greedy = [], [], []
    for path in args.corpus.split(","):
        c = torch.load(path, weights_only=True)
        split += c["split"]
        pid += c["prompt_id"]
        greedy += [bool(g) for g in c["greedy"]]
    fit = [i for i in range(len(split)) if split[i] == "train" and pid[i].startswith(args.fit_prefix)]
    val = [i for i in range(len(split)) if split[i] == "train" and not pid[i].startswith(args.fit_prefix) and greedy[i]]
    path = Path(args.features)
    parts = sorted(path.glob("part-*.pt")) if path.is_dir() else [path]
    feats: list = []
    for p in parts:
        feats += torch.load(p, weights_only=True, mmap=True)
    f_fit, f_val = feats[: len(fit)], feats[len(fit) : len(fit) + len(val)]
    assert all(f["split"] == "train" and f["prompt_id"].startswith(args.fit_prefix) for f in f_fit)
    assert all(not f["prompt_id"].startswith(args.fit_prefix) for f in f_val)
    fit_greedy = [k for k, i in enumerate(fit) if greedy[i]]
    rng = np.random.default_rng(args.seed)
    pick = sorted(rng.choice(fit_greedy, size=min(args.sample, len(fit_greedy)), replace=False).tolist())
    sample = [f_fit[k] for k in pick]
    n_tok = sum(len(f["ids"]) - f["start"] for f in sample)
    print(
        f"fitted texts {len(fit)} ({len(fit_greedy)} greedy), sample {len(sample)} ({n_tok} answer tokens); "
        f"validation {len(f_val)}",
        file=sys.stderr,
    )
    embed = load_model("smollm2", "fp32", "cpu").get_input_embeddings().weight.detach().float()
    for folder in args.head:
        head = load_eagle3(folder)
        row = {"head": folder}
        for name, f in (("fitted", sample), ("validation", f_val)):
            row[name] = agreement(head, embed, f)["overall"]
            row[name + "_without_copy"] = agreement(head, embed, f, copy=False)["overall"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
