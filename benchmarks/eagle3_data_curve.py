"""The EAGLE-3 recipe on a random fraction of the fit answers, same step count (run: python THIS FRACTION STEPS).

A one-off experiment: the build corpora must exist in /tmp/speckv-build (datasets/smollm2/build.sh step 2b).
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from speckv_policy.cli.distill import _load_corpora  # noqa: PLC2701 (one-off experiment, the build's own loader)
from speckv_policy.hf.eagle3 import Eagle3Config
from speckv_policy.hf.eagle3_train import agreement, choose_vocabulary, init_head, train_head
from speckv_policy.smollm2.eagle3 import _cached_features  # noqa: PLC2701 (the build's features cache)
from speckv_policy.smollm2.models import load_model

frac, max_steps = float(sys.argv[1]), int(sys.argv[2])
B = Path("/tmp/speckv-build")
work = B / "lc"
work.mkdir(exist_ok=True)
corpus = _load_corpora(f"{B}/corpus-task-fp32.pt,{B}/corpus-fp32.pt")
split, pid = corpus["split"], corpus["prompt_id"]
fit = [i for i in range(len(split)) if split[i] == "train" and pid[i].startswith("gen-")]
val = [i for i in range(len(split)) if split[i] == "train" and not pid[i].startswith("gen-") and corpus["greedy"][i]]
held = [i for i in range(len(split)) if split[i] == "heldout" and corpus["greedy"][i]]
target = load_model("smollm2", "fp32")
cfg = Eagle3Config.for_target(target.config, 8192, None, verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
feats = _cached_features(
    work / "features-fp32.pt", corpus, fit + val + held, target, cfg.aux_layer_ids, "features", True
)
f_fit, f_val, f_held = feats[: len(fit)], feats[len(fit) : len(fit) + len(val)], feats[len(fit) + len(val) :]
rng = np.random.default_rng(0)
keep = sorted(rng.permutation(len(f_fit))[: int(round(frac * len(f_fit)))].tolist())
sub = [f_fit[i] for i in keep]
vocab, cov = choose_vocabulary(
    f_fit, 8192
)  # the shipped vocabulary (all fit answers), so only the training data differs
head = init_head(target, cfg, vocab)
embed = target.get_input_embeddings().weight.detach().float()
torch.manual_seed(0)
ck = work / f"ck-{frac}-{max_steps}.pt"
t0 = time.time()
info = train_head(head, embed, sub, f_val, minutes=600, checkpoint=ck, steps=2, lr=2e-3, max_steps=max_steps)
res = {
    "fraction": frac,
    "texts": len(sub),
    "positions": int(sum(len(t["ids"]) for t in sub)),
    **info,
    "heldout_fp32": agreement(head, embed, f_held),
    "minutes": round((time.time() - t0) / 60, 1),
}
print(json.dumps(res))
with open(work / "results.jsonl", "a") as f:
    f.write(json.dumps(res) + "\n")
