"""Generation replayed at every position, set beside a race: a faithful offline evaluator, greedy or sampling.

Usage:
    python benchmarks/dense_replay.py [--race benchmarks/runs/quant_steps.json] [--costs benchmarks/runs/quant_costs.json]
        [--all-heldout] [--decoding greedy|sampling] [--replications 16]

For each compression level of the race (or ``--compressions``) and each of its held-out prompts, the target writes
its greedy continuation once (plain ``generate``) and the draft reads it once (a teacher-forced pass), which gives
the outcome of a draft of any length at every position (``speckv_policy.evaluation.dense``). With ``--decoding
sampling`` the target samples its continuation instead (temperature 0.7 as the race) and the two passes give, at
every position, the chance that speculative sampling keeps the draft's token there; every arm then walks the same
``--replications`` draws of those keep/reject events, pooled. Every arm is then
walked through those texts the way generation would walk it (decide, keep what matches, advance, update the
history) and priced with the calibration. Beside each arm: what the step-log replay (``speckv-eval``'s evaluator, on
the same prompts) and the race measured, as tokens/s and as a ratio to fixed gamma 2. The arm ``stop`` is the
cost-aware stop rule of ``--stop-rule`` (default ``exported/smollm2-stop.json``), re-priced like the exports;
``stop-gated`` is the same rule with a pre-draft gate fitted here, under the same prices, on ``--log``'s train split
(``speckv_policy.training.fit_stop_gates``). The step-log replay has no stop mode.

A second table per level gives the same replay with the issue's statistics: tokens/s pooled over the prompts, paired
bootstrap 95% CIs over prompts for x the target alone and x the best fixed gamma (0..8, re-chosen in every resample),
overall and per task type, and the share of the fastest gammas in hindsight (a shortest path over every position of
the texts, :func:`~speckv_policy.evaluation.dense.hindsight_oracle`) that each arm reaches. A third table says what
the signals could be worth: the oracle against rules that know only whether the draft's first token will be kept (a
perfect gate, then a fixed gamma), and how well the signals a policy has predict that (ROC AUC over every position).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import replace

BRANCH = 7  # draft tokens after a wrong one that a per-token rule (max gamma 8) can reach
RUN_CAP = 20  # runs counted up to HF's heuristic schedule's starting draft length
DEFAULT_PAIRS = (
    "exported/smollm2-gbt.onnx=gbt-repriced,exported/smollm2-gbt-pre.onnx=gbt-pre-repriced,"
    "exported/smollm2-gbt-gated.onnx=gbt-gated-repriced"
)


def main(argv: list[str] | None = None) -> int:
    from speckv_policy.cli.common import add_target_linear_argument, export_arm_pairs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--race", default="benchmarks/runs/quant_steps.json", help="a benchmarks/e2e.py --out JSON")
    ap.add_argument("--costs", default="benchmarks/runs/quant_costs.json", help="calibration every arm is priced with")
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet", help="step log for the step-log replay")
    ap.add_argument("--prompts", default="datasets/prompts/prompts.jsonl")
    ap.add_argument("--compressions", default=None, help="default: the race's")
    ap.add_argument("--max-prompts", type=int, default=None, help="only the first N of the race's prompts")
    ap.add_argument(
        "--all-heldout", action="store_true", help="every held-out prompt of --log at fp32/INT8/NF4, no race beside it"
    )
    ap.add_argument("--pairs", type=export_arm_pairs, default=DEFAULT_PAIRS, help="comma-separated EXPORT=RACE_ARM")
    ap.add_argument(
        "--stop-rule",
        default="exported/smollm2-stop.json",
        help="a cost-aware stop rule (speckv-export --stop-rule) replayed as the arm 'stop', re-priced like the "
        "exports; '' leaves it out",
    )
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    ap.add_argument("--decoding", choices=("greedy", "sampling"), default="greedy")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the race's default)")
    ap.add_argument("--replications", type=int, default=16, help="sampling: draws of the keep/reject events per text")
    ap.add_argument("--seed", type=int, default=0, help="sampling: seeds the texts, the branches and the draws")
    add_target_linear_argument(ap)
    args = ap.parse_args(argv)
    if args.decoding == "sampling" and not (args.temperature > 0 and args.replications >= 1):
        ap.error("--decoding sampling needs --temperature > 0 and --replications >= 1")
    import os

    files = [args.costs, args.log, args.prompts] + ([] if args.all_heldout else [args.race])
    for f in files + ([args.stop_rule] if args.stop_rule else []):
        if not os.path.isfile(f):
            ap.error(f"{f}: no such file")

    import numpy as np
    import torch

    from speckv_policy.cli.evaluate import load_for_eval
    from speckv_policy.evaluation import evaluation_set, priced_arms
    from speckv_policy.evaluation.dense import (
        hindsight_oracle,
        pool_results,
        realize,
        simulate,
        simulate_hindsight,
    )
    from speckv_policy.evaluation.race import (
        GoodputEMA,
        HFHeuristicSchedule,
        SGLangStyleSteps,
        adaedl_policy,
        conditional_acceptance,
    )
    from speckv_policy.hf.models import draft_precision
    from speckv_policy.hf.onednn import apply_linear_backend
    from speckv_policy.logs import read_log
    from speckv_policy.objective import CostModel
    from speckv_policy.prompts import encode_prompt, read_prompts
    from speckv_policy.runtime import PolicyLoadError, RuntimePolicy
    from speckv_policy.schema import COMPRESSION_CODES
    from speckv_policy.smollm2.models import SMOLLM2_MODELS
    from speckv_policy.stop import StopRule, StopRuleError

    log = read_log(args.log)
    if args.all_heldout:  # every held-out prompt of the log, no race beside it
        race = {"config": {"compressions": ["fp32", "int8", "nf4"], "max_new_tokens": 48}, "runs": []}
        ids = sorted(set(log.loc[log["split"] == "heldout", "prompt_id"]))[: args.max_prompts]
    else:
        with open(args.race, encoding="utf-8") as fh:
            race = json.load(fh)
        ids = sorted({r["prompt_id"] for r in race["runs"]})[: args.max_prompts]
    comps = args.compressions.split(",") if args.compressions else race["config"]["compressions"]
    n_new = int(race["config"]["max_new_tokens"])
    prompts = [p for p in read_prompts(args.prompts) if p.id in ids]
    cost = CostModel.load(args.costs)
    pairs = args.pairs
    exports = {}
    for path, arm in pairs.items():
        modes = {"pre": "pre", "gated": "gated", "online": "upfront"}
        try:
            rt = RuntimePolicy(path)
            fs = rt.feature_set.name if rt.feature_set is not None else "?"
            if fs not in modes:
                raise ValueError(f"feature set {fs!r} has no every-position replay (pre, gated or online exports only)")
            rt.reprice(cost)
        except (ValueError, PolicyLoadError) as exc:
            msg = str(exc)
            ap.error(msg if msg.startswith(path) else f"{path}: {msg}")
        exports[arm] = (rt, modes[fs])
    stop = None
    if args.stop_rule:
        try:
            stop = StopRule.load(args.stop_rule).reprice(cost)
        except (StopRuleError, ValueError) as exc:
            ap.error(str(exc))
    stop_gated = None
    if stop is not None:  # the same rule with a pre-draft gate fitted here on the log's train split, at these prices
        from speckv_policy.training import fit_stop_gates

        stop_gated = fit_stop_gates(log, stop)
    ours = list(exports) + (["stop", "stop-gated"] if stop is not None else [])
    # the step-log replay of the same exports on the same prompts (what speckv-eval reports, restricted to them)
    replay_cost = replace(cost, decision_draft_tokens=1)  # as speckv-eval --costs prices an upfront policy
    chooser = {arm: load_for_eval(path, cost_model=replay_cost) for path, arm in pairs.items()}
    es = evaluation_set(log, tuple(sorted({fs for fs, _ in chooser.values()} | {"online"})))
    replay = {a.name: a for a in priced_arms(es, chooser, policy_cost=replay_cost)[0]}

    tok = SMOLLM2_MODELS.load_tokenizer(args.target)
    draft = SMOLLM2_MODELS.load_model(args.draft, draft_precision("cpu", "auto"), "cpu")
    sampling = args.decoding == "sampling"
    temp = args.temperature if sampling else 0.0
    how = (
        f"sampling at temperature {temp:g}, {args.replications} draws of the keep/reject events per text"
        if sampling
        else "greedy"
    )
    print(
        f"{len(prompts)} held-out prompts of {'the log' if args.all_heldout else args.race}, {n_new} new tokens, {how}; "
        f"priced with {args.costs}; tokens/s over every step after the prefill; online = the race's runs pooled\n"
    )
    print(
        "| level | arm | replayed at every position: tok/s | x fixed-2 | gamma-0 share | tokens/step "
        "| step-log replay: x fixed-2 | gamma-0 share | race: tok/s | x fixed-2 | gamma-0 share "
        "| replayed at every position: x target alone |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ci_tables: list[str] = []
    headroom: list[str] = []
    for comp in comps:
        t0 = time.perf_counter()
        target = SMOLLM2_MODELS.load_model(args.target, comp, "cpu")
        apply_linear_backend(target, args.target_linear)
        eos = target.generation_config.eos_token_id
        eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        with torch.inference_mode():
            encoded = [torch.tensor([encode_prompt(p, tok)]) for p in prompts]
            if sampling:
                texts = _sampled_texts(target, draft, encoded, eos, n_new, temp, args.seed, tok.eos_token_id)
            else:
                texts = _greedy_texts(target, draft, encoded, eos, n_new, tok.eos_token_id)
        del target
        # greedy: the text decides every outcome; sampling: replications of the keep/reject events, the same for every arm
        draws = (
            [realize(texts, args.seed * 1000 + r, RUN_CAP) for r in range(args.replications)] if sampling else [texts]
        )

        def over(walk, *walk_args, draws=draws, **kw):
            """``walk(texts, *walk_args, **kw)`` on every draw, pooled."""
            return pool_results([walk(d, *walk_args, **kw) for d in draws])

        arms = {"target": ("fixed", lambda s: 0, None), "fixed-2": ("fixed", lambda s: 2, None)}
        arms["fixed-4"] = ("fixed", lambda s: 4, None)
        for arm, (rt, mode) in exports.items():
            arms[arm] = (mode, rt.decide, rt.decide_gate if mode == "gated" else None)
        if stop is not None:
            arms["stop"] = ("stop", stop, None)
            arms["stop-gated"] = ("stop", stop_gated, None)
        priced = dict(compression=comp, cost=cost)
        res = {a: over(simulate, m, f, gate=g, temperature=temp, **priced) for a, (m, f, g) in arms.items()}
        mask = (es.rows["compression"] == comp).to_numpy() & (es.rows["decoding"] == args.decoding).to_numpy()
        mask &= es.rows["prompt_id"].isin([p.id for p in prompts]).to_numpy()

        sel = [r for r in race["runs"] if r["compression"] == comp and r["decoding"] == args.decoding]
        sel = [r for r in sel if r["prompt_id"] in {p.id for p in prompts}]
        f2, base = res["fixed-2"].tokens_per_second, res["target"].tokens_per_second
        on_f2 = _online(sel, "fixed-2")[0] if sel else float("nan")
        for a, r in res.items():
            on_rate, on_zero = _online(sel, a)
            name = "fixed-0" if a == "target" else a  # the step-log replay's name for the target alone
            rep = " | "  # the log profiled these prompts in this decoding? (sampling: 15 of the 48 held-out ones)
            if mask.any() and name in replay:  # the step-log replay has no stop mode
                ratio = _replay_rate(replay[name], mask) / _replay_rate(replay["fixed-2"], mask)
                rep = f"{ratio:.3f} | {np.mean(replay[name].chosen[mask] == 0):.2f}"
            print(
                f"| {comp} | {a} | {r.tokens_per_second:.2f} | {r.tokens_per_second / f2:.3f} | "
                f"{np.mean(r.gammas == 0):.2f} | {r.tokens / r.steps:.2f} | {rep} | "
                + (f"{on_rate:.2f} | {on_rate / on_f2:.3f} | " if sel else "| | ")
                + f"{'' if on_zero is None else f'{on_zero:.2f}'} | {r.tokens_per_second / base:.3f} |"
            )
        print(f"| {comp} | ({len(texts)} texts in {time.perf_counter() - t0:.0f} s) | | | | | | | | | | |")
        res["fixed-0"] = res["target"]  # the bootstrap's name for the target alone
        for g in range(1, 9):
            res.setdefault(f"fixed-{g}", over(simulate, "fixed", lambda s, g=g: g, **priced))
        res["oracle"] = over(hindsight_oracle, **priced)
        code = COMPRESSION_CODES[comp]
        vllm = functools.partial(GoodputEMA, conditional_acceptance(log, comp), cost.time_table(np.arange(9))[code])

        def rule(make, cap=8, priced=priced, draws=draws):
            """A history rule made afresh for every draw, kept across its texts."""
            runs = [simulate(d, "rule", make(), max_gamma=cap, temperature=temp, **priced) for d in draws]
            return pool_results(runs)

        peers = {  # the race's peer rules, each kept across the texts as the race keeps it across a block's prompts
            "adaedl": over(simulate, "per-token", adaedl_policy, temperature=temp, **priced),
            "sglang-adaptive": rule(SGLangStyleSteps),
            "ema-goodput": rule(vllm),
            "hf-heuristic": rule(HFHeuristicSchedule, RUN_CAP),
        }
        res.update(peers)
        ci_tables.append(
            _ci_table(comp, res, ours, list(peers), [p.task_type for p in prompts], [p.id for p in prompts])
        )
        bound = {
            f"perfect gate, then fixed-{g}": over(simulate_hindsight, functools.partial(_perfect_gate, g), **priced)
            for g in range(1, 5)
        }
        headroom.append(_headroom(comp, [t for d in draws for t in d], res, bound, ours))
    print("\n".join(ci_tables))
    print("\n".join(headroom))
    return 0


def _perfect_gate(gamma: int, text, k: int) -> int:
    """Draft ``gamma`` exactly where the draft's first token will be kept (a rule no policy can run)."""
    return gamma if text.run[k] >= 1 else 0


def _greedy_texts(target, draft, encoded: list, eos: set, n_new: int, pad: int) -> list:
    """Each prompt's greedy continuation, the draft's teacher-forced proposals and its branches after wrong ones."""

    from speckv_policy.evaluation.dense import DenseText, match_runs
    from speckv_policy.features import draft_token_stats_from_logits

    texts = []
    for x in encoded:
        out = target.generate(x, max_new_tokens=n_new, do_sample=False, pad_token_id=pad)
        logits = draft(out, logits_to_keep=0).logits[0].float()  # row i predicts token i + 1
        plen, seq = x.shape[1], out[0].tolist()
        own = logits[plen - 1 : len(seq) - 1]
        conf, ent = draft_token_stats_from_logits(own)
        proposals = own.argmax(-1).tolist()
        branches = {}  # where the draft is wrong: what it would draft after its own token (per-token rules)
        for j, (mine, true) in enumerate(zip(proposals, seq[plen:])):
            if mine != true:
                branches[j] = _branch(draft, seq[: plen + j] + [mine], eos, pad, None)
        runs = match_runs(proposals, seq[plen:], RUN_CAP)
        texts.append(DenseText(seq, plen, runs, conf.tolist(), ent.tolist(), branches))
    return texts


def _sampled_texts(target, draft, encoded: list, eos: set, n_new: int, temp: float, seed: int, pad: int) -> list:
    """Each prompt's sampled continuation, the chance the draft's token is kept at each position given it, and
    where it can be rejected, the draft's own sampled continuation after a rejected token.

    The draft's token at a rejected position is distributed as ``max(0, q - p)`` normalised (speculative sampling's
    rejected proposals); ``p`` and ``q`` are the target's and the draft's distributions at ``temp`` (top-k and top-p
    off, as the race samples)."""
    import torch

    from speckv_policy.evaluation.dense import DenseText
    from speckv_policy.features import draft_token_stats_from_logits

    texts = []
    for i, x in enumerate(encoded):
        torch.manual_seed(seed * 100_003 + i)
        kw = dict(do_sample=True, temperature=temp, top_p=1.0, top_k=0, pad_token_id=pad)
        out = target.generate(x, max_new_tokens=n_new, **kw)
        plen, seq = x.shape[1], out[0].tolist()
        logp = (target(out).logits[0, plen - 1 : len(seq) - 1].float() / temp).log_softmax(-1)
        zq = draft(out, logits_to_keep=0).logits[0, plen - 1 : len(seq) - 1].float() / temp
        logq = zq.log_softmax(-1)
        t = torch.tensor(seq[plen:]).unsqueeze(-1)
        accept = (logq.gather(-1, t) - logp.gather(-1, t)).exp().clamp(max=1.0).squeeze(-1)  # min(1, q(t) / p(t))
        conf, ent = draft_token_stats_from_logits(zq)
        branches = {}
        for j in torch.nonzero(accept < 1).flatten().tolist():
            residual = (logq[j].exp() - logp[j].exp()).clamp_min(0.0)
            rejected = int(torch.multinomial(residual / residual.sum(), 1))
            branches[j] = _branch(draft, seq[: plen + j] + [rejected], eos, pad, kw)
        texts.append(
            DenseText(seq, plen, [0] * (len(seq) - plen), conf.tolist(), ent.tolist(), branches, accept.tolist())
        )
    return texts


def _branch(draft, ids: list, eos: set, pad: int, sampling: dict | None) -> tuple[list, list]:
    """Confidences and entropies of what the draft proposes after ``ids`` (its last token its own), up to BRANCH
    tokens or its end-of-sequence token; nothing after an end-of-sequence token (the lean loop stops there)."""
    import torch

    from speckv_policy.features import draft_token_stats_from_logits

    if ids[-1] in eos:
        return [], []
    kw = dict(sampling) if sampling is not None else dict(do_sample=False, pad_token_id=pad)
    cont = draft.generate(
        torch.tensor([ids]), max_new_tokens=BRANCH, output_scores=True, return_dict_in_generate=True, **kw
    )
    c, e = draft_token_stats_from_logits(torch.stack(cont.scores, 1)[0].float())
    return c.tolist(), e.tolist()


def _headroom(comp: str, texts: list, res: dict, bound: dict, ours_names: list[str]) -> str:
    """What a perfect first-token gate is worth, and how well the signals a policy has predict it (ROC AUC)."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from speckv_policy.features import ContextMatcher

    f2, base, best = (res[a].tokens_per_second for a in ("fixed-2", "target", "oracle"))
    rows = [
        f"\n{comp}: what knowing the first draft token's fate is worth (tokens/s pooled over the prompts)\n",
        "| level | rule | tok/s | x target alone | x fixed-2 | x oracle | gamma-0 share |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    ours = {a: res[a] for a in ours_names}
    for name, r in {"oracle in hindsight": res["oracle"], **bound, **ours}.items():
        v = r.tokens_per_second
        rows.append(
            f"| {comp} | {name} | {v:.2f} | {v / base:.3f} | {v / f2:.3f} | {v / best:.3f} | "
            f"{np.mean(r.gammas == 0):.2f} |"
        )
    kept, conf, ent, match = [], [], [], []
    for t in texts:  # every position k: is the draft's first token kept, and the signals known there
        matcher = ContextMatcher()
        matcher.extend(list(t.ids[: t.prompt_len]))
        for k in range(t.generated - 1):
            kept.append(t.run[k] >= 1)
            conf.append(t.conf[k])
            ent.append(-t.entropy[k])
            match.append(matcher.match_len())
            matcher.extend([t.ids[t.prompt_len + k]])
    y = np.asarray(kept)
    rows.append(
        f"\n{comp}: the draft's first token is kept at {y.mean():.1%} of {len(y)} positions; ROC AUC for it of the "
        f"probe token's confidence {roc_auc_score(y, conf):.3f}, of minus its entropy {roc_auc_score(y, ent):.3f} "
        f"(both need the probe), of the context's self-repetition (match length) {roc_auc_score(y, match):.3f}"
    )
    return "\n".join(rows)


def _ci_table(comp: str, res: dict, ours: list[str], peers: list[str], tasks: list[str], prompt_ids: list[str]) -> str:
    """Pooled tokens/s, paired bootstrap CIs over prompts (x the target alone, the best fixed gamma, the best peer
    rule), overall and per task type, and x the oracle in hindsight."""
    import numpy as np

    from speckv_policy.evaluation import TARGET_ALONE, Arm, paired_bootstrap

    arms = []
    for name, r in res.items():
        if name == "target":
            continue  # the same walk as fixed-0 (TARGET_ALONE)
        kind = "fixed" if name.startswith("fixed-") else "oracle" if name == "oracle" else "policy"
        kind = "peer" if name in peers else kind
        arms.append(Arm(name, r.text_tokens, r.text_time, np.zeros(len(r.text_tokens)), kind=kind))
    clusters = np.asarray(prompt_ids)
    rows = [
        f"\n{comp}: pooled over the prompts, 95% paired bootstrap CIs over prompts (10,000 resamples; the best fixed "
        "gamma of 0..8 and the best peer rule re-chosen in each); x oracle = tokens/s over the fastest gammas in "
        "hindsight's\n",
        "| level | prompts | arm | tok/s | x target alone [95% CI] | x best fixed [95% CI] | best fixed "
        "| x best peer [95% CI] | best peer | x oracle |",
        "|---|---|---|---:|---|---|---:|---|---:|---:|",
    ]
    groups = [("all", np.ones(len(tasks), bool))] + [(t, np.asarray(tasks) == t) for t in sorted(set(tasks))]
    for label, mask in groups:
        if mask.sum() < 2:
            continue
        boot = paired_bootstrap(arms, clusters, mask)

        def rate(name: str, mask: np.ndarray = mask) -> float:
            return 1e3 * res[name].text_tokens[mask].sum() / res[name].text_time[mask].sum()

        fixed = max((f"fixed-{g}" for g in range(9)), key=rate)
        peer = max(peers, key=rate)
        for name in ["oracle", fixed, *peers, *ours]:
            cell = []
            for key, ref in (("vs_target", TARGET_ALONE), ("vs_best_fixed", fixed), ("vs_best_peer", peer)):
                if name in ours:
                    b = boot[name][key]
                    cell.append(f"{b['ratio']:.3f} [{b['ci'][0]:.3f}, {b['ci'][1]:.3f}]")
                else:
                    cell.append(f"{rate(name) / rate(ref):.3f}")
            rows.append(
                f"| {comp} | {label} ({int(mask.sum())}) | {name} | {rate(name):.2f} | {cell[0]} | {cell[1]} | "
                f"{fixed} | {cell[2]} | {peer} | {rate(name) / rate('oracle'):.3f} |"
            )
    return "\n".join(rows)


def _replay_rate(arm: object, mask: object) -> float:
    """Tokens per unit of modelled time of a step-log replay arm on the rows in ``mask``."""
    return float(arm.tokens[mask].sum() / arm.time[mask].sum())  # type: ignore[attr-defined]


def _online(runs: list[dict], arm: str) -> tuple[float, float | None]:
    """The race's pooled tokens/s of ``arm`` and, where it saved its steps, its gamma-0 share (prefill left out)."""
    import numpy as np

    rs = [r for r in runs if r["arm"] == arm]
    if not rs:
        return float("nan"), None
    steps = [g for r in rs for g in r.get("step_gamma", [])[1:]]
    zero = float(np.mean(np.asarray(steps) == 0)) if steps else None
    return sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs), zero


if __name__ == "__main__":
    raise SystemExit(main())
