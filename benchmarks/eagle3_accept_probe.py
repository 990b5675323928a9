"""Does the head's own hidden state know when its first draft token will be kept? (experiment; removed after)

Teacher-forced on the task prompts' greedy fp32 answers (``speckv-distill corpus --dtype fp32``): at every answer
position the shipped head (with its copy gate) drafts a first token; a hit is that token equal to the target's greedy
one. Probes fitted on the training prompts' positions (answers the head never fitted) predict a hit on the held-out
prompts' positions:

- ``conf``: the copy-mixed first-token probability alone (what the policies read);
- ``gbt-scalars``: gradient boosting on every scalar signal (confidence, entropy, margin, copy match length, whether
  the copy candidate is the draft, the previous position's hit, position in the answer);
- ``lr-state`` / ``mlp-state``: logistic regression / a small MLP on the head's 576-d layer output plus the scalars
  (an acceptance head on the head's state); ``lr-state+target``: the same with the three target states the head
  read at that position (1,728 more inputs);
- the same on positions that follow a head miss (where 64-83% of drafting steps start).

    python benchmarks/eagle3_accept_probe.py --corpus CORPUS.pt [--head datasets/smollm2/eagle3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from torch.nn import functional as F

from speckv_policy.hf.copy_gate import copy_candidates, mix_log_probs
from speckv_policy.hf.eagle3 import load_eagle3
from speckv_policy.hf.eagle3_train import extract_features
from speckv_policy.smollm2.models import load_model


def rows(head, embed, feats):
    """Per text: scalar signals, layer outputs and hits at every answer position (teacher-forced)."""
    gate = head.copy_gate()
    a, b = torch.tensor(gate["a"]), torch.tensor(gate["b"])
    head_ids = head.target_ids()
    vocab = head.eagle.vocab_size
    out_rows = []
    with torch.no_grad():
        for t in feats:
            ids, s = t["ids"], t["start"]
            n = len(ids)
            nxt = torch.zeros_like(ids)
            nxt[:-1] = ids[1:]
            width = n
            out, _, _ = head.layer(
                F.embedding(nxt[None], embed), head.fuse(t["aux"][None].float()), head.rope(torch.arange(width) + 1)
            )
            hl = head.logits(out).float()[0, s - 2 : n - 2]  # drafts tokens s .. n-1
            state = torch.cat([out[0, s - 2 : n - 2].float(), t["aux"][s - 2 : n - 2].float()], -1)
            full = torch.full((len(hl), vocab), float("-inf"))
            full[:, head_ids] = hl
            cand, length = copy_candidates(ids.numpy().astype(np.int64), s - 1, n - s, gate["max_match"])
            cand_t, len_t = torch.from_numpy(cand), torch.from_numpy(length)
            logq = mix_log_probs(full, cand_t, len_t, a, b, support=head_ids)
            lq = logq[:, head_ids]
            top2 = lq.topk(2, -1)
            pred = torch.where(
                (len_t > 0) & (cand_t >= 0) & (logq.gather(1, cand_t.clamp_min(0)[:, None])[:, 0] >= top2.values[:, 0]),
                cand_t,
                head_ids[top2.indices[:, 0]],
            )
            greedy = t["top_ids"][: n - s, 0].long()
            hit = (pred == greedy).numpy()
            p = lq.exp()
            ent = -(p * lq.clamp_min(-1e4)).sum(-1)
            prev = np.concatenate([[1], hit[:-1]])
            scal = np.stack(
                [
                    top2.values[:, 0].exp().numpy(),
                    ent.numpy(),
                    (top2.values[:, 0] - top2.values[:, 1]).numpy(),
                    length.astype(float),
                    (cand_t == pred).numpy().astype(float),
                    prev.astype(float),
                    np.arange(n - s, dtype=float),
                ],
                1,
            )
            out_rows.append((t["split"], scal, state.numpy(), hit.astype(int)))
    return out_rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", required=True)
    p.add_argument("--head", default="datasets/smollm2/eagle3")
    args = p.parse_args()
    t0 = time.time()
    corpus = torch.load(args.corpus, weights_only=True)
    head = load_eagle3(args.head, dtype=torch.float32).eval()
    target = load_model("smollm2", "fp32")
    embed = head.input_embedding(target.get_input_embeddings().weight.detach().float())
    idx = [i for i in range(len(corpus["ids"])) if corpus["greedy"][i]]
    feats = extract_features(corpus, idx, target, head.eagle.aux_layer_ids, tokens_per_batch=2048)
    print(f"features of {len(feats)} answers in {time.time() - t0:.0f} s")
    data = rows(head, embed, feats)
    split = {k: [np.concatenate([r[j] for r in data if r[0] == k]) for j in (1, 2, 3)] for k in ("train", "heldout")}
    (s_tr, h_tr, y_tr), (s_te, h_te, y_te) = split["train"], split["heldout"]
    print(f"positions: train {len(y_tr)} (hit {y_tr.mean():.3f}), held-out {len(y_te)} (hit {y_te.mean():.3f})")
    after_miss = s_te[:, 5] == 0
    x_tr, x_te = np.hstack([h_tr[:, :576], s_tr]), np.hstack([h_te[:, :576], s_te])
    a_tr, a_te = np.hstack([h_tr, s_tr]), np.hstack([h_te, s_te])
    models = {
        "gbt-scalars": (HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=0), s_tr, s_te),
        "lr-state": (make_pipeline(StandardScaler(), LogisticRegression(C=0.05, max_iter=2000)), x_tr, x_te),
        "lr-state+target": (make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=2000)), a_tr, a_te),
        "mlp-state": (
            make_pipeline(
                StandardScaler(),
                MLPClassifier((64,), alpha=1e-2, early_stopping=True, random_state=0, max_iter=200),
            ),
            x_tr,
            x_te,
        ),
    }
    scores = {"conf": s_te[:, 0]}
    for name, (m, xtr, xte) in models.items():
        m.fit(xtr, y_tr)
        scores[name] = m.predict_proba(xte)[:, 1]
    for name, sc in scores.items():
        print(
            f"{name:12s} held-out AUC {roc_auc_score(y_te, sc):.3f}   after a miss {roc_auc_score(y_te[after_miss], sc[after_miss]):.3f}"
            f" ({after_miss.sum()} positions, hit {y_te[after_miss].mean():.3f})"
        )


if __name__ == "__main__":
    main()
