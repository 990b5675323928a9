"""Experiment: does the target's greedy token as a hard label, beside its top-k distribution, lift agreement?

The build fits the head to the target's top-k next-token distribution (soft labels, as EAGLE-3's trainer does), while
agreement counts whether the head's argmax is the target's greedy token. This screen adds ``--greedy-weight 1.0`` (the
greedy token's cross-entropy, weighted as the soft loss) and compares it with the shipped recipe (arm A) trained for the
same wall-clock budget on the whole template corpus (as commit 979fc36's weight-decay screen did), paired on the
held-out task answers (per-text hits, bootstrap over texts), with the copy gate and without. An arm whose head folder
already holds ``speckv.json`` is not built again; ``--seed-features F`` hard-links an existing features folder of the
same corpora into each arm's work folder.

    speckv-distill corpus --prompts datasets/prompts/prompts.jsonl --out W/corpus-task-fp32.pt \\
        --samples 1 --max-new-tokens 160 --batch-size 64 --dtype fp32
    speckv-distill corpus --prompts datasets/prompts/distill.jsonl --out W/corpus-fp32.pt \\
        --samples 1 --max-new-tokens 128 --batch-size 64 --dtype fp32
    python benchmarks/eagle3_greedy_weight.py --task-corpus W/corpus-task-fp32.pt --corpus W/corpus-fp32.pt \\
        --work W --minutes 14 --precision fp32 [--seed-features W/wA/features-fp32]

Writes ``W/greedy-weight-paired.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speckv_policy.hf.eagle3 import load_eagle3  # noqa: E402
from speckv_policy.hf.eagle3_train import extract_features, first_draft_hits  # noqa: E402
from speckv_policy.smollm2.models import load_model  # noqa: E402

ARMS = {"A": [], "G": ["--greedy-weight", "1.0"]}  # A: the shipped recipe


def build(name: str, args: argparse.Namespace, corpus: Path) -> None:
    if (args.work / f"headf{name}" / "speckv.json").exists():
        return
    cmd = [sys.executable, "-m", "speckv_policy.cli.distill", "eagle3", "--corpus", f"{args.task_corpus},{corpus}"]
    cmd += ["--out", str(args.work / f"headf{name}"), "--work", str(args.work / f"wf{name}")]
    cmd += ["--minutes", str(args.minutes), "--lr", "2e-3", "--ttt-steps", "2", *ARMS[name]]
    cmd += ["--train-precision", args.precision, "--compressions", "fp32"]
    with open(args.work / f"runf{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def paired(args: argparse.Namespace) -> dict:
    c = torch.load(args.task_corpus, weights_only=True)
    held = [i for i, s in enumerate(c["split"]) if s == "heldout" and c["greedy"][i]]
    target = load_model("smollm2", "fp32", "cpu")
    embed = target.get_input_embeddings().weight.detach().float()
    heads = {n: load_eagle3(args.work / f"headf{n}") for n in ARMS}
    feats = {
        n: extract_features(c, held, target, tuple(h.eagle.aux_layer_ids), progress=False) for n, h in heads.items()
    }
    out: dict = {"arms": {n: " ".join(a) for n, a in ARMS.items()}}
    for copy in (True, False):
        kind = "gate" if copy else "plain"
        hits = {n: [h.numpy() for h in first_draft_hits(hd, embed, feats[n], copy=copy)] for n, hd in heads.items()}
        tok = {n: np.array([x.sum() for x in v]) for n, v in hits.items()}
        cnt = np.array([len(x) for x in hits["A"]])
        boot = np.random.default_rng(0).integers(0, len(cnt), (5000, len(cnt)))
        for n in list(ARMS)[1:]:
            d = (tok[n][boot].sum(1) - tok["A"][boot].sum(1)) / cnt[boot].sum(1)
            point = (tok[n].sum() - tok["A"].sum()) / cnt.sum()
            out[f"{n}-A {kind}"] = [round(float(x), 4) for x in (point, np.quantile(d, 0.025), np.quantile(d, 0.975))]
        out[f"agreement {kind}"] = {n: round(float(tok[n].sum() / cnt.sum()), 4) for n in ARMS}
    out["tokens"], out["texts"] = int(cnt.sum()), len(cnt)
    for n in ARMS:
        meta = json.loads((args.work / f"headf{n}" / "speckv.json").read_text())
        out[f"build {n}"] = {k: meta[k] for k in ("steps", "epochs", "validation_agreement")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task-corpus", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=14.0)
    p.add_argument("--arms", default=",".join(ARMS), help="arms to build and compare (A first)")
    p.add_argument("--seed-features", type=Path, help="a features-fp32 folder of the same corpora to hard-link")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for name in list(ARMS):
        if name not in args.arms.split(","):
            del ARMS[name]
    for name in ARMS:
        if args.seed_features and not (args.work / f"wf{name}" / "features-fp32").exists():
            (args.work / f"wf{name}").mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["cp", "-al", str(args.seed_features), str(args.work / f"wf{name}" / "features-fp32")], check=True
            )
        build(name, args, args.corpus)
    out = paired(args)
    (args.work / "greedy-weight-paired.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
