"""How much agreement is left for the EAGLE-3 head's drafting rule to find, without retraining it (an experiment).

On the build's held-out greedy answers, teacher-forced as ``agreement()`` measures: the head's top-k coverage, the
context-copy candidate's hit rate, the oracle that picks the right one of the head's argmax and the copy candidate,
the shipped gate, the best chooser a gradient-boosted classifier learns from the same inputs and more (fitted on the
checkpoint-selection answers), the share of target tokens outside the head's vocabulary, what the target's own output
rows (scaled, offset) add for the tokens outside it, and what a 1-4-gram table of the fitted answers adds as a third
candidate (oracle).

    python benchmarks/eagle3_ceiling.py --features /tmp/speckv-build/eagle3/features-fp32.pt
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier
from torch.nn import functional as F

from speckv_policy.hf.copy_gate import copy_argmax
from speckv_policy.hf.eagle3 import _rms_norm, load_eagle3  # noqa: PLC2701 (an experiment)
from speckv_policy.hf.eagle3_train import _collate, _copy_inputs, _first_draft_rows, _slots  # noqa: PLC2701
from speckv_policy.smollm2.models import load_model


def rows(head, embed, texts, ngram):
    ids, slots, gate = head.target_ids(), _slots(head), head.copy_gate()
    a, b = torch.tensor(gate["a"]), torch.tensor(gate["b"])
    cols = {k: [] for k in ("x", "head", "copy", "gate", "top5", "oov", "ngram")}
    for tx, logits, targets in _first_draft_rows(head, embed, texts):
        g = targets[:, 0]
        lq = torch.log_softmax(logits, -1)
        cand, length = _copy_inputs(tx, gate["max_match"])
        top2 = lq.topk(2, -1).values
        s = slots[cand.clamp_min(0)]
        qc = torch.where((cand >= 0) & (s >= 0), lq.gather(1, s.clamp_min(0)[:, None]).squeeze(1), torch.tensor(-30.0))
        argmax = ids[lq.argmax(-1)]
        cols["x"].append(torch.stack([length.float(), top2[:, 0], qc, top2[:, 1], (cand == argmax).float()], -1))
        cols["head"].append(argmax == g)
        cols["copy"].append((cand == g) & (length > 0))
        cols["gate"].append(copy_argmax(logits, ids, slots, cand, length, a, b) == g)
        cols["top5"].append((ids[lq.topk(5, -1).indices] == g[:, None]).cumsum(-1).clamp(max=1))
        cols["oov"].append(~torch.isin(g, ids))
        x, st = tx["ids"].tolist(), tx["start"]
        pred = []
        for i in range(st, st + len(g)):
            p = -1
            for n in range(4, 0, -1):
                c = ngram[n].get(tuple(x[i - n : i]))
                if c and sum(c.values()) >= 2:
                    p = c.most_common(1)[0][0]
                    break
            pred.append(p)
        cols["ngram"].append(torch.tensor(pred) == g)
    return {k: torch.cat(v).numpy() for k, v in cols.items()}


def full_vocabulary(head, embed, out_w, texts):
    """Agreement when the head's logits are completed with ``alpha * target row . z + beta`` outside its vocabulary."""
    ids, slots = head.target_ids(), _slots(head)
    zs, gs = [], []
    with torch.no_grad():
        for k in range(0, len(texts), 8):
            chunk = texts[k : k + 8]
            batch = _collate(chunk, slots)
            x = batch["ids"]
            nxt = torch.zeros_like(x)
            nxt[:, :-1] = x[:, 1:]
            pos = torch.arange(x.shape[1]) + 1
            out, _, _ = head.layer(F.embedding(nxt, embed), head.fuse(batch["aux"]), head.rope(pos))
            z = _rms_norm(out, head.norm.weight, head.eagle.rms_norm_eps)
            for r, t in enumerate(chunk):
                n, st = len(t["ids"]), t["start"]
                zs.append(z[r, st - 2 : n - 2])
                gs.append(t["top_ids"][: n - st, 0].long())
        z, g = torch.cat(zs), torch.cat(gs)
        small, rows = head.lm_head(z), z @ out_w.T
    best = (0.0, None)
    for alpha in (0.5, 1.0, 1.5, 2.0):
        for beta in (-4.0, -2.0, 0.0, 2.0):
            full = rows * alpha + beta
            full[:, ids] = small
            best = max(best, (float((full.argmax(-1) == g).float().mean()), (alpha, beta)))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True, help="the build's features-fp32.pt (fit, validation, held-out)")
    ap.add_argument("--head", default="datasets/smollm2/eagle3")
    args = ap.parse_args()
    counts = json.loads((Path(args.head) / "speckv.json").read_text())["texts"]
    feats = torch.load(args.features, weights_only=True)
    n_fit, n_val = counts["fit"], counts["validation"]
    fit, val, held = feats[:n_fit], feats[n_fit : n_fit + n_val], feats[n_fit + n_val :]
    ngram = [collections.defaultdict(collections.Counter) for _ in range(5)]
    for f in fit:
        x = f["ids"].tolist()
        for i in range(f["start"], len(x)):
            for n in range(1, 5):
                ngram[n][tuple(x[i - n : i])][x[i]] += 1
    target = load_model("smollm2", "fp32")
    embed = target.get_input_embeddings().weight.detach().float()
    head = load_eagle3(args.head)
    v, h = rows(head, embed, val, ngram), rows(head, embed, held, ngram)
    print(f"held-out answer tokens: {len(h['head'])}; validation: {len(v['head'])}")
    print("head top-1..5 coverage:", np.round(h["top5"].mean(0), 3).tolist())
    print(f"outside the head's vocabulary: {h['oov'].mean():.3f} (validation {v['oov'].mean():.3f})")
    print(f"copy candidate right: {h['copy'].mean():.3f}")
    print(f"head argmax {h['head'].mean():.4f}; shipped gate {h['gate'].mean():.4f}")
    print(f"oracle of argmax | copy: {(h['head'] | h['copy']).mean():.4f}")
    m = v["x"][:, 0] > 0
    pick_copy = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05).fit(v["x"][m], v["copy"][m])
    pick_head = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05).fit(v["x"][m], v["head"][m])
    mh = h["x"][:, 0] > 0
    take = np.zeros(len(h["head"]), bool)
    take[mh] = pick_copy.predict_proba(h["x"][mh])[:, 1] > pick_head.predict_proba(h["x"][mh])[:, 1]
    print(
        f"learned chooser (match length, log max q, log q(copy), second log q, copy == argmax): "
        f"{np.where(take, h['copy'], h['head']).mean():.4f}"
    )
    out_w = target.state_dict().get("lm_head.weight", embed).float()
    acc, (alpha, beta) = full_vocabulary(head, embed, out_w, held)
    print(f"full vocabulary, the target's rows outside the head's: best {acc:.4f} (alpha {alpha}, beta {beta})")
    print(
        f"1-4-gram table of the fitted answers right: {h['ngram'].mean():.3f}; oracle of gate | n-gram: "
        f"{(h['gate'] | h['ngram']).mean():.4f}; of argmax | copy | n-gram: "
        f"{(h['head'] | h['copy'] | h['ngram']).mean():.4f}"
    )


if __name__ == "__main__":
    main()
