"""The head's training step in fp32 and under bf16 autocast: time per step and agreement after the same steps.
(experiment; removed after)

Both runs start from the same target-initialised head and fit the task prompts' training answers for the same
optimizer steps (same batches, same schedule) with ``train_head``, as ``speckv-distill eagle3`` trains; agreement is
measured on the held-out prompts' answers (fp32, without the copy gate).

    python benchmarks/eagle3_train_precision.py --corpus CORPUS.pt [--steps 300]

``CORPUS.pt``: ``speckv-distill corpus --prompts datasets/prompts/prompts.jsonl --dtype fp32 --batch-size 64``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch

from speckv_policy.hf.eagle3 import Eagle3Config
from speckv_policy.hf.eagle3_train import agreement, choose_vocabulary, extract_features, init_head, train_head
from speckv_policy.machine import cpu_model
from speckv_policy.smollm2.models import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--precisions", default="fp32,bf16")
    args = p.parse_args()
    corpus = torch.load(args.corpus, weights_only=True)
    target = load_model("smollm2", "fp32")
    cfg = Eagle3Config.for_target(target.config, 8192, None, verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    feats = extract_features(corpus, list(range(len(corpus["ids"]))), target, cfg.aux_layer_ids, progress=False)
    fit = [f for f in feats if f["split"] == "train"]
    held = [f for f in feats if f["split"] == "heldout"]
    vocab, _ = choose_vocabulary(fit, 8192)
    embed = target.get_input_embeddings().weight.detach().float()
    init = init_head(target, cfg, vocab)
    print(f"{cpu_model()}; {len(fit)} answers fitted, {len(held)} held out; {args.steps} steps each")
    for precision in args.precisions.split(","):
        head = copy.deepcopy(init)
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            info = train_head(
                head,
                embed,
                fit,
                held[:1],
                minutes=600.0,
                max_steps=args.steps,
                checkpoint=f"{tmp}/ck.pt",
                eval_minutes=600.0,
                progress=False,
                precision=precision,
            )
        acc = agreement(head, embed, held, copy=False)["overall"]
        sec = info["train_minutes"] * 60 / info["steps"]
        print(f"{precision}: {sec:.2f} s a step, held-out agreement {acc:.3f} after {info['steps']} steps")


if __name__ == "__main__":
    main()
