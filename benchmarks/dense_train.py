"""Train a `pre` policy on the states it meets in greedy generation, and judge it at every position (an experiment).

Usage:
    python benchmarks/dense_train.py [--compressions int8,nf4] [--rounds 2] [--costs docs/onednn_quant_costs.json]

The shipped `pre` GBT learns from the step log plus its own replayed histories (``--history-rounds 2``), which visit
only the profile's step positions. Here the training prompts' greedy texts are built once per compression level
(``speckv_policy.evaluation.dense``: one target ``generate`` and one teacher-forced draft pass per prompt), the policy
is walked through them the way generation walks it, and the states it meets, each labelled with the draft outcome the
text decides there, join its training rows; repeated ``--rounds`` times (DAgger-style). Both policies, the shipped
recipe refitted here and the dense one (and the shipped export), priced with the calibration, are then judged on the held-out prompts' texts
at every position, against fixed gamma 2 and the target alone. Nothing is written: this prints figures only.
"""

from __future__ import annotations

import argparse
import copy
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--prompts", default="datasets/prompts/prompts.jsonl")
    ap.add_argument("--costs", default="docs/onednn_quant_costs.json")
    ap.add_argument("--compressions", default="int8,nf4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--export", default="exported/smollm2-gbt-pre.onnx", help="the shipped export, judged alongside")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-train-prompts", type=int, default=None)
    ap.add_argument("--max-heldout-prompts", type=int, default=None)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    from speckv_policy.cli.common import add_target_linear_argument

    add_target_linear_argument(ap)
    args = ap.parse_args(argv)

    import numpy as np
    import pandas as pd
    import torch

    from speckv_policy.evaluation.dense import DenseText, match_runs, simulate
    from speckv_policy.features import draft_token_stats_from_logits
    from speckv_policy.hf.models import draft_precision
    from speckv_policy.hf.onednn import apply_linear_backend
    from speckv_policy.logs import read_log
    from speckv_policy.objective import CostModel
    from speckv_policy.policies import POLICIES
    from speckv_policy.prompts import encode_prompt, read_prompts
    from speckv_policy.runtime import RuntimePolicy
    from speckv_policy.schema import get_feature_set
    from speckv_policy.smollm2.models import SMOLLM2_MODELS
    from speckv_policy.training import fit_from_log, with_cost_model

    t_start = time.perf_counter()
    log = read_log(args.log)
    calibration = CostModel.load(args.costs)
    names = list(get_feature_set("pre").names)
    prompts = read_prompts(args.prompts)
    logged = set(log["prompt_id"])
    train = [p for p in prompts if p.split == "train" and p.id in logged][: args.max_train_prompts]
    held = [p for p in prompts if p.split == "heldout" and p.id in logged][: args.max_heldout_prompts]
    comps = [c for c in args.compressions.split(",") if c]
    tok = SMOLLM2_MODELS.load_tokenizer(args.target)
    draft = SMOLLM2_MODELS.load_model(args.draft, draft_precision("cpu", "auto"), "cpu")

    def texts_of(target: object, ps: list) -> list:
        out = []
        with torch.inference_mode():
            for p in ps:
                x = torch.tensor([encode_prompt(p, tok)])
                seq_t = target.generate(  # type: ignore[attr-defined]
                    x, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id
                )
                logits = draft(seq_t, logits_to_keep=0).logits[0].float()
                plen, seq = x.shape[1], seq_t[0].tolist()
                own = logits[plen - 1 : len(seq) - 1]
                conf, ent = draft_token_stats_from_logits(own)
                runs = match_runs(own.argmax(-1).tolist(), seq[plen:], 8)
                out.append(DenseText(seq, plen, runs, conf.tolist(), ent.tolist()))
        return out

    dense: dict[str, tuple[list, list]] = {}
    for comp in comps:
        target = SMOLLM2_MODELS.load_model(args.target, comp, "cpu")
        apply_linear_backend(target, args.target_linear)
        dense[comp] = (texts_of(target, train), texts_of(target, held))
        del target
    t_texts = time.perf_counter() - t_start
    # the shipped recipe (speckv-export --policy gbt --feature-set pre --decision-draft-tokens 0 --history-rounds 2)
    own_cost = CostModel.fit(log, decision_draft_tokens=0)
    shipped = fit_from_log(POLICIES["gbt"](feature_set="pre", cost_model=own_cost), log, history_rounds=2)
    from speckv_policy.policies.base import training_data

    X0, y0 = training_data(log, "pre", split="train")
    policy = copy.deepcopy(shipped)  # the same fit (deterministic); the dense rounds start from it
    Xs, ys = [X0], [y0]
    for r in range(args.rounds):
        priced = with_cost_model(policy, calibration)
        for comp in comps:
            visited: list = []
            simulate(
                dense[comp][0],
                "pre",
                lambda row, pol=priced: int(pol.predict(np.asarray([row], dtype=np.float32))[0]),
                compression=comp,
                cost=calibration,
                visited=visited,
            )
            Xs.append(pd.DataFrame([v[0] for v in visited], columns=names).astype(np.float32))
            ys.append(np.array([[v[1], v[2]] for v in visited], dtype=np.int64))
        policy.fit(pd.concat(Xs, ignore_index=True), np.vstack(ys))
        print(f"round {r + 1}: {sum(len(x) for x in Xs)} training rows")
    print(
        f"\n{len(train)} training and {len(held)} held-out prompts, {args.max_new_tokens} new tokens, greedy; texts "
        f"built in {t_texts:.0f} s; priced with {args.costs}\n"
    )
    print("| level | policy | tok/s | x target alone | x fixed-2 | gamma-0 share | tokens/step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for comp in comps:
        held_texts = dense[comp][1]
        res = {
            "target alone": simulate(held_texts, "fixed", lambda s: 0, compression=comp, cost=calibration),
            "fixed-2": simulate(held_texts, "fixed", lambda s: 2, compression=comp, cost=calibration),
        }
        export = RuntimePolicy(args.export)
        export.reprice(calibration)
        res["gbt-pre (shipped export)"] = simulate(held_texts, "pre", export.decide, compression=comp, cost=calibration)
        for name, pol in (("gbt-pre (shipped recipe)", shipped), ("gbt-pre (dense rounds)", policy)):
            priced = with_cost_model(pol, calibration)
            res[name] = simulate(
                held_texts,
                "pre",
                lambda row, pol=priced: int(pol.predict(np.asarray([row], dtype=np.float32))[0]),
                compression=comp,
                cost=calibration,
            )
        base, f2 = res["target alone"].tokens_per_second, res["fixed-2"].tokens_per_second
        for name, r in res.items():
            print(
                f"| {comp} | {name} | {r.tokens_per_second:.2f} | {r.tokens_per_second / base:.3f} | "
                f"{r.tokens_per_second / f2:.3f} | {np.mean(r.gammas == 0):.2f} | {r.tokens / r.steps:.2f} |"
            )
    print(f"\n{(time.perf_counter() - t_start) / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
