"""What a stop rule's per-token signals predict: held-out log loss and ROC AUC of its acceptance curve, per signal set.

Usage:
    python benchmarks/stop_signals.py [--log datasets/smollm2/steps.parquet]

The stop rule's ``now`` curve (``speckv_policy.stop``: a token's acceptance given its predecessors were accepted) is
fitted the way ``training.fit_stop_rule`` fits it (logistic regression, C=10) on the log's train split and scored on
its held-out split, per compression level and decoding, with the rule's inputs (``STOP_FEATURES``) and with the
sampled token's own draft probability added (``draft_token_prob``, its log and its ratio to the top-1 probability):
in sampling the verifier keeps a drafted token with probability ``min(1, p_target / p_draft)`` of *that* token, so
this is the signal a sampling rule would read if the draft loop passed it on; and with the step's history added
(the ``pre`` set's acceptance history and context length, ``stop.GATE_FEATURES`` but the context match the rule
already reads, under the profile's own history): what the curve would gain from knowing how the generation has gone.
Lower log loss, higher AUC: better.
"""

from __future__ import annotations

import argparse
import math


def _rows(part, extra: str, history=None):
    """Token rows of the 'now' curve: the rule's inputs, plus ``extra`` ('' | 'token' | 'history') columns."""
    import numpy as np

    from speckv_policy.stop import gate_features, stop_features

    X, y = [], []
    for idx, conf, ent, tok, acc, m in zip(
        part.index,
        part["draft_confidence"],
        part["draft_entropy"],
        part["draft_token_prob"],
        part["accepted"],
        part["context_match_len"],
    ):
        hist = gate_features(history.loc[idx].to_numpy())[:-1] if extra == "history" else []
        for i in range(min(int(acc) + 1, len(conf))):
            x = stop_features(conf[i], ent[i], m) + hist
            if extra == "token":
                x += [float(tok[i]), math.log(max(1e-6, float(tok[i]))), float(tok[i]) / max(1e-6, float(conf[i]))]
            X.append(x)
            y.append(int(i < int(acc)))
    return np.asarray(X), np.asarray(y)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    args = ap.parse_args(argv)
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score

    from speckv_policy.features import features_from_log
    from speckv_policy.logs import read_log

    log = read_log(args.log)
    history, _, _ = features_from_log(log, "pre")  # each drafting step's pre-draft row, under the logged history
    log = log.loc[history.index]
    print(f"{args.log}: the stop rule's 'now' curve, fitted on the train split, scored on the held-out split\n")
    print(
        "| level | decoding | held-out tokens | rule's inputs: log loss | AUC | + sampled token's probability: log loss "
        "| AUC | + the step's history: log loss | AUC |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (comp, dec), part in log[log["gamma"] > 0].groupby(["compression", "decoding"], sort=True):
        cells = []
        for extra in ("", "token", "history"):
            Xt, yt = _rows(part[part["split"] == "train"], extra, history)
            Xh, yh = _rows(part[part["split"] == "heldout"], extra, history)
            if len(set(yt.tolist())) < 2 or len(set(yh.tolist())) < 2:
                break
            p = LogisticRegression(C=10.0, max_iter=3000).fit(Xt, yt).predict_proba(Xh)[:, 1]
            cells += [f"{log_loss(yh, p):.4f}", f"{roc_auc_score(yh, p):.4f}"]
        if len(cells) == 6:
            print(f"| {comp} | {dec} | {len(yh)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
