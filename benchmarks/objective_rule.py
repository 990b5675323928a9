"""Is the per-step ratio a good stand-in for long-run tokens/s? Offline, against the renewal-reward (Dinkelbach) rule.

Usage:
    python benchmarks/objective_rule.py [--log datasets/smollm2/steps.parquet] [--policy gbt,mlp,table]
        [--feature-set pre,gated] [--history-rounds 2] [--bootstrap 2000]

A policy maximises ``E[tokens | g] / step_ms(g)`` at every step (docs/objective.md).
A generation's throughput is ``sum tokens / sum time``, which the renewal-reward
argument maximises with ``E[tokens | g] - lam * step_ms(g)``, ``lam`` the
throughput the policy achieves (Dinkelbach's iteration finds it). This trains
each family the way the shipped ``pre`` / gated exports are trained, fits
``lam`` per compression level on the training runs (the policy's own expected
tokens on its own choices, iterated to a fixed point), and evaluates both rules
on the held-out runs with ``speckv-eval``'s evaluator in one call (same rows,
same resamples): tokens/s against the target alone with a paired bootstrap 95%
CI over prompts, and the fraction of the oracle. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", default="datasets/smollm2/steps.parquet")
    ap.add_argument("--policy", default="gbt,mlp,table")
    ap.add_argument("--feature-set", default="pre,gated")
    ap.add_argument("--history-rounds", type=int, default=2)
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args(argv)

    import numpy as np

    from speckv_policy.evaluation import evaluate_log
    from speckv_policy.logs import read_log
    from speckv_policy.objective import CostModel
    from speckv_policy.policies import training_data
    from speckv_policy.training import batch_chooser, fit_from_log, make_policy

    t0 = time.perf_counter()
    log = read_log(args.log)
    cm = {0: CostModel.fit(log, decision_draft_tokens=0), 1: CostModel.fit(log, decision_draft_tokens=1)}

    def codes(X):
        return np.clip(np.rint(np.asarray(X["compression_code"], dtype=float)), 0, 2).astype(np.int64)

    def scores(policy, X, lam):
        v = policy.expected_values(X)
        return v["tokens_per_step"] - lam[codes(X)][:, None] * v["step_time"], v["candidates"]

    def long_run(policy, lam):
        """The renewal-reward rule; for a gated policy the gate and the head each compare E - lam * T."""
        if hasattr(policy, "gate_"):
            n = policy.n_gate_features_

            def choose(X):
                s, cand = scores(policy.gate_, X.iloc[:, :n], lam)
                opened = s[:, cand != 0].max(axis=1) > s[:, cand == 0][:, 0]
                h, _ = scores(policy.head_, X, lam)
                return np.where(opened, cand[np.argmax(h, axis=1)], 0).astype(np.int64), opened

            return choose

        def choose(X):
            s, cand = scores(policy, X, lam)
            return cand[np.argmax(s, axis=1)]

        return choose

    def fit_lambda(policy, fs):
        """Dinkelbach on the training runs: lam = expected tokens / time of the rule's own choices, to a fixed point."""
        X, _ = training_data(log, fs, split="train")
        c = codes(X)
        price = cm[0]
        lam = np.array([1.0 / float(price.step_ms(0, k)) for k in range(3)])  # start: the target alone
        for _ in range(50):
            out = long_run(policy, lam)(X)
            gamma, opened = out if isinstance(out, tuple) else (out, None)
            target = policy.head_ if opened is not None else policy
            v = target.expected_values(X)
            idx = np.searchsorted(v["candidates"], gamma)
            tokens = v["tokens_per_step"][np.arange(len(X)), idx]
            t = price.step_ms(gamma, c)
            if opened is not None:
                tokens = np.where(opened, tokens, 1.0)  # a closed gate makes a plain step
                t = t + np.where(opened & (gamma == 0), price.draft_ms(1, c), 0.0)  # an open gate pays the probe
            new = np.array([tokens[c == k].sum() / t[c == k].sum() if (c == k).any() else lam[k] for k in range(3)])
            if np.allclose(new, lam, rtol=1e-7):
                break
            lam = new
        return lam

    policies, lams = {}, {}
    for kind in [k.strip() for k in args.policy.split(",") if k.strip()]:
        for fs in [f.strip() for f in args.feature_set.split(",") if f.strip()]:
            probe = 0 if fs == "pre" else 1
            p = make_policy(kind, feature_set=fs, cost_model=cm[probe])
            p = fit_from_log(p, log, history_rounds=args.history_rounds)
            lam = fit_lambda(p, fs)
            lams[f"{kind}-{fs}"] = lam
            policies[f"{kind}-{fs} per-step ratio"] = (fs, batch_chooser(p))
            policies[f"{kind}-{fs} long-run"] = (fs, long_run(p, lam))
            print(f"trained {kind}-{fs} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    res, _ = evaluate_log(log, policies, policy_cost=cm[1], n_resamples=args.bootstrap)
    ov, boot = res["groups"]["overall"], res["bootstrap"]["overall"]
    print(
        f"{res['rows']} held-out steps of {res['prompts']} prompts ({args.log}); cost model fitted from the log; "
        f"--history-rounds {args.history_rounds}; {args.bootstrap} paired bootstrap resamples; "
        f"{time.perf_counter() - t0:.0f} s\n"
    )
    print(
        "| policy | rule | lam per level (tokens/s) | tokens/s | x target alone [95% CI] | x oracle | long-run / ratio |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for name, lam in lams.items():
        base = ov["arms"][f"{name} per-step ratio"]["tokens_per_second"]
        for rule in ("per-step ratio", "long-run"):
            a = ov["arms"][f"{name} {rule}"]
            ci = boot[f"{name} {rule}"]["vs_target"]["ci"]
            lam_txt = " / ".join(f"{1000 * x:.1f}" for x in lam) if rule == "long-run" else ""
            print(
                f"| {name} | {rule} | {lam_txt} | {a['tokens_per_second']:.2f} | {a['vs_target']:.3f} "
                f"[{ci[0]:.3f}, {ci[1]:.3f}] | {a['vs_oracle']:.3f} | {a['tokens_per_second'] / base:.3f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
