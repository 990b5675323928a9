"""Experiment: teacher-forced greedy chain acceptance of EAGLE-3 heads on the held-out greedy answers.

For each head folder, the tokens a greedy draft of 1..8 keeps on average (the head reads the fp32 target's cached
features; each later token counts only where every earlier one matched the target's greedy token).

    python benchmarks/eagle3_chain.py --features /tmp/speckv-build/eagle3/features-fp32.pt HEAD [HEAD ...]
"""

from __future__ import annotations

import argparse

import torch

from speckv_policy.hf.eagle3 import load_eagle3
from speckv_policy.hf.eagle3_train import _collate, _slots, ttt_forward  # noqa: PLC2701 - experiment
from speckv_policy.smollm2.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", required=True, help="the build's features-fp32.pt")
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--depth", type=int, default=8)
    args = ap.parse_args()
    held = [f for f in torch.load(args.features, weights_only=True) if f["split"] == "heldout"]
    embed = load_model("smollm2", "fp32").get_input_embeddings().weight.detach().float()
    for folder in args.heads:
        head = load_eagle3(folder).eval()
        slots = _slots(head)
        hits = [0] * args.depth
        rows = 0
        with torch.no_grad():
            for k in range(0, len(held), 8):
                _, stats = ttt_forward(head, embed, _collate(held[k : k + 8], slots), args.depth)
                rows += stats[0][1]
                for s, (h, _) in enumerate(stats):
                    hits[s] += h
        kept = [round(sum(hits[:g]) / rows, 3) for g in range(1, args.depth + 1)]
        print(f"{folder}: tokens kept per greedy draft of 1..{args.depth}: {kept}")


if __name__ == "__main__":
    main()
