"""Can the draft report its own acceptance better than its confidence does? Two cheap draft-side levers, measured.

Usage:
    speckv-distill corpus --prompts datasets/prompts/prompts.jsonl --out corpus.pt --samples 1 --max-new-tokens 160
    python benchmarks/acceptance_probe.py --corpus corpus.pt [--draft datasets/smollm2/draft]

The corpus holds the target's own greedy answers to the task prompts and, at every answer position, the target's
top-32 next-token log-probabilities (bf16 target; ~3 min on 2 cores). The shipped draft (with its context-copy
mixture) reads each answer teacher-forced, so at answer position ``t`` it sees exactly the context it would see when
drafting token ``t`` after its earlier tokens were accepted; the greedy acceptance event there is "the draft's top
token is the target's".

1. **An acceptance head on the draft's hidden state.** A logistic model of that event, fitted on the training
   prompts' answers and scored on the held-out prompts' (the first ``--positions`` answer tokens, the race's
   length), from the stop rule's curve inputs (``stop.STOP_FEATURES``: the draft's top-1 probability, entropy,
   ``log(1 - p)``, ``log(1 + m)``; here ``m`` is the context's self-repeating suffix at the token itself) and from
   those plus the draft's 576-dimensional last hidden state, at several regularisation strengths. Held-out ROC AUC
   and log loss, and the AUC difference with a paired bootstrap 95% CI over held-out prompts.
2. **The draft's sampling temperature.** Exact speculative sampling keeps a drafted token with probability
   ``sum_v min(p(v), q(v))`` in expectation, for any draft distribution ``q``, so the draft may sample at its own
   temperature without changing the output's distribution. The expected acceptance of the draft's first token at
   the target's temperature ``--temperature`` (over the target's top 32), per draft temperature, held-out prompts.
"""

from __future__ import annotations

import argparse
import time


def _answer_rows(model, corpus: dict, i: int, positions: int):
    """Per answer position of answer ``i``: the curve inputs, the hidden state, the draft's log q' and the label."""
    import numpy as np
    import torch

    from speckv_policy.smollm2.context_copy import copy_candidates, mix_log_probs
    from speckv_policy.stop import stop_features

    ids = corpus["ids"][i].long()
    start = int(corpus["start"][i])
    n = min(len(corpus["topk_ids"][i]), positions)
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None, : start - 1 + n]).last_hidden_state[0, start - 1 : start - 1 + n]
        logits = model.lm_head(hidden).float()
        gate = model.copy_gate()
        cand, length = copy_candidates(ids.numpy().astype(np.int64), start - 1, n, gate["max_match"])
        log_q = mix_log_probs(
            logits,
            torch.from_numpy(cand),
            torch.from_numpy(length),
            model.copy_a,
            model.copy_b,
            support=model.lm_head.token_ids,
        )
    p = log_q.exp()
    conf = p.max(-1).values
    ent = -torch.where(p > 0, p * log_q, torch.zeros_like(p)).sum(-1)
    teacher = corpus["topk_ids"][i][:n, 0].long()
    curve = [stop_features(float(c), float(e), float(m)) for c, e, m in zip(conf, ent, length)]
    label = (log_q.argmax(-1) == teacher).numpy().astype(int)
    return np.asarray(curve), hidden.float().numpy(), log_q, label


def _prompt_resamples(prompt, rng, draws: int = 2000):
    """Paired bootstrap over prompts: index sets of whole prompts drawn with replacement."""
    import numpy as np

    groups = [np.flatnonzero(prompt == p) for p in np.unique(prompt)]
    for _ in range(draws):
        pick = rng.integers(0, len(groups), len(groups))
        yield np.concatenate([groups[k] for k in pick])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="speckv-distill corpus of the task prompts' greedy answers")
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    ap.add_argument("--positions", type=int, default=48, help="answer positions per answer (the race's length)")
    ap.add_argument("--temperature", type=float, default=0.7, help="the target's sampling temperature")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score
    from sklearn.preprocessing import StandardScaler

    from speckv_policy.smollm2.draft_model import load_draft

    t0 = time.perf_counter()
    try:  # weights_only: tensors, lists, strings and numbers only; a pickle payload cannot run
        corpus = torch.load(args.corpus, weights_only=True)
    except Exception as exc:
        raise SystemExit(f"{args.corpus}: not a speckv-distill corpus ({type(exc).__name__})") from None
    need = ("ids", "start", "topk_ids", "topk_logp", "prompt_id", "task_type", "split", "greedy")
    missing = [k for k in need if not isinstance(corpus, dict) or k not in corpus]
    if missing:
        raise SystemExit(f"{args.corpus}: not a speckv-distill corpus (missing {', '.join(missing)})")
    model = load_draft(args.draft)
    if model.copy_gate() is None:
        raise SystemExit(
            f"{args.draft}: the draft has no context-copy gate (draft.json 'copy'); expected the shipped one"
        )
    draft_temps = (0.5, 0.6, 0.7, 0.8, 1.0)
    curve, hidden, label, split, prompt, task = [], [], [], [], [], []
    accept = {td: [] for td in draft_temps}
    for i in range(len(corpus["ids"])):
        if not corpus["greedy"][i]:
            continue
        c, h, log_q, y = _answer_rows(model, corpus, i, args.positions)
        curve.append(c)
        hidden.append(h)
        label.append(y)
        split += [corpus["split"][i]] * len(y)
        prompt += [corpus["prompt_id"][i]] * len(y)
        task += [corpus["task_type"][i]] * len(y)
        tid = corpus["topk_ids"][i][: len(y)].long()
        p = torch.softmax(corpus["topk_logp"][i][: len(y)].float() / args.temperature, -1)
        for td in draft_temps:
            accept[td].append(torch.minimum(p, torch.softmax(log_q / td, -1).gather(1, tid)).sum(-1).numpy())
    curve, hidden, y = np.concatenate(curve), np.concatenate(hidden), np.concatenate(label)
    split, prompt, task = np.asarray(split), np.asarray(prompt), np.asarray(task)
    tr, te = split == "train", split == "heldout"
    for name, part in (("training", tr), ("held-out", te)):
        if len(set(y[part].tolist())) < 2:
            raise SystemExit(
                f"{args.corpus}: expected greedy answers to {name} prompts where the draft is both right and wrong; "
                f"got {int(part.sum())} such positions"
            )
    print(
        f"{int(tr.sum())} training and {int(te.sum())} held-out positions ({len(np.unique(prompt[te]))} held-out "
        f"prompts); the draft's top token is the target's at {y[te].mean():.3f} of held-out positions"
    )

    arms = [("curve inputs", curve, 10.0)] + [
        (f"curve inputs + hidden state, C={c:g}", np.c_[curve, hidden], c) for c in (1.0, 0.01, 0.001)
    ]
    scores = {}
    print("\n| acceptance model | held-out ROC AUC | held-out log loss | training ROC AUC |")
    print("|---|---:|---:|---:|")
    for name, X, c in arms:
        scale = StandardScaler().fit(X[tr])
        fit = LogisticRegression(C=c, max_iter=5000).fit(scale.transform(X[tr]), y[tr])
        s_te = fit.predict_proba(scale.transform(X[te]))[:, 1]
        s_tr = fit.predict_proba(scale.transform(X[tr]))[:, 1]
        scores[name] = s_te
        print(
            f"| {name} | {roc_auc_score(y[te], s_te):.4f} | {log_loss(y[te], s_te):.4f} | "
            f"{roc_auc_score(y[tr], s_tr):.4f} |"
        )
    base = scores["curve inputs"]
    rng = np.random.default_rng(0)
    yt, pt = y[te], prompt[te]
    print("\n| acceptance model | held-out AUC minus the curve inputs' [95% CI over prompts] |")
    print("|---|---|")
    for name, s in scores.items():
        if name == "curve inputs":
            continue
        diffs = [roc_auc_score(yt[k], s[k]) - roc_auc_score(yt[k], base[k]) for k in _prompt_resamples(pt, rng)]
        lo, hi = np.quantile(diffs, [0.025, 0.975])
        print(f"| {name} | {roc_auc_score(yt, s) - roc_auc_score(yt, base):+.4f} [{lo:+.4f}, {hi:+.4f}] |")

    types = sorted(set(task[te]))
    print(f"\nExpected acceptance of a sampled draft token at target temperature {args.temperature:g} (held-out):")
    print("\n| draft temperature | overall | " + " | ".join(types) + " |")
    print("|---:|---:|" + "---:|" * len(types))
    for td in draft_temps:
        a = np.concatenate(accept[td])[te]
        row = " | ".join(f"{a[task[te] == t].mean():.4f}" for t in types)
        print(f"| {td:g} | {a.mean():.4f} | {row} |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
