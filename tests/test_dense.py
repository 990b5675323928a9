"""Greedy generation replayed at every position (speckv_policy.evaluation.dense)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from speckv_policy.evaluation.dense import DenseText, hindsight_oracle, match_runs, simulate, simulate_hindsight
from speckv_policy.objective import CostModel
from speckv_policy.testing import tiny_llama_pair

from .conftest import run_benchmark, table_rows, teacher_forced_text

ROOT = Path(__file__).resolve().parents[1]


def test_match_runs_counts_consecutive_matches_from_each_position():
    text = [5, 6, 7, 8, 9, 10]
    proposals = [5, 6, 0, 8, 9, 10]
    assert match_runs(proposals, text, cap=8) == [2, 1, 0, 3, 2, 1]
    assert match_runs(proposals, text, cap=2) == [2, 1, 0, 2, 2, 1]
    with pytest.raises(ValueError, match="3 proposals for 6"):
        match_runs(proposals[:3], text, cap=8)


def _cost() -> CostModel:
    # draft 1 ms per call + 2 ms per token; verification 10 ms + 1 ms per draft token, every level
    return CostModel(
        draft_ms_per_token=(2.0, 2.0, 2.0),
        verify_base_ms=(10.0, 10.0, 10.0),
        verify_ms_per_token=(1.0, 1.0, 1.0),
        draft_base_ms=(1.0, 1.0, 1.0),
    )


def test_simulate_walks_a_text_as_generation_would():
    """Runs [3, 0, 0, 1, 0, 0, 2, 1, 0, 0]: fixed gamma 2 keeps min(2, run) and advances by that plus one."""
    run = [3, 0, 0, 1, 0, 0, 2, 1, 0, 0]
    text = DenseText(ids=list(range(100, 112)), prompt_len=2, run=run, conf=[0.5] * 10, entropy=[1.0] * 10)
    res = simulate([text], "fixed", lambda step: 2, compression="fp32", cost=_cost())
    # positions visited: 0 (keeps 2, the prefill step, not counted), 3 (keeps 1), 5 (0), 6 (2), 9 (the last
    # position: the hook drafts nothing there, the last new token is the target's own)
    assert res.gammas.tolist() == [2, 2, 2, 0] and res.accepted.tolist() == [1, 0, 2, 0]
    assert res.tokens == 2 + 1 + 3 + 1
    assert res.time == pytest.approx(3 * (1 + 2 * 2 + 10 + 2) + 10)
    plain = simulate([text], "fixed", lambda step: 0, compression="fp32", cost=_cost())
    assert plain.steps == 9 and plain.tokens == 9 and plain.time == pytest.approx(9 * 10.0)
    with pytest.raises(ValueError, match="unknown mode"):
        simulate([text], "nope", lambda s: 0, compression="fp32", cost=_cost())
    with pytest.raises(ValueError, match="needs gate"):
        simulate([text], "gated", lambda s: 0, compression="fp32", cost=_cost())


def test_the_hindsight_oracle_is_the_shortest_path_through_the_text():
    """Runs [0, 3, 2, 1, 0, 0] priced 10 ms for a plain step and 11 + 3 g ms for a draft of g (by hand: from the
    end, the best is a plain step at 0 (the prefill, left out), gamma 3 at 1 (keeps 3), a plain step at 5)."""
    run = [0, 3, 2, 1, 0, 0]
    text = DenseText(ids=list(range(30, 38)), prompt_len=2, run=run, conf=[0.5] * 6, entropy=[1.0] * 6)
    best = hindsight_oracle([text], compression="fp32", cost=_cost())
    assert best.gammas.tolist() == [3, 0] and best.accepted.tolist() == [3, 0]
    assert best.tokens == 5 and best.time == pytest.approx(20.0 + 10.0)
    # no other choice of gammas is faster: every fixed gamma and random schedules (run[0] = 0, so every walk's
    # first step, left out, advances one token and the oracle's is the cheapest: the comparison is exact)
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(3):
        proposals = [0] + rng.integers(0, 2, 195).tolist()
        texts.append(DenseText(list(range(200)), 4, match_runs(proposals, [1] * 196, 8), [0.5] * 196, [1.0] * 196))
    best = hindsight_oracle(texts, compression="nf4", cost=_cost())
    assert best.text_tokens.tolist() == [195.0] * 3
    schedules = [np.full(400, g) for g in range(9)]
    schedules += [np.random.default_rng(seed).integers(0, 9 if seed % 2 else 3, 400) for seed in range(40)]
    for choices in schedules:
        other = simulate(texts, "fixed", choices.__getitem__, compression="nf4", cost=_cost())
        assert other.tokens == best.tokens and best.time <= other.time + 1e-9


def test_a_hindsight_rule_is_walked_and_priced_like_a_policy():
    """A perfect gate drafting 2 where the first draft token is kept equals fixed gamma 2 on a text where it
    always is, and the target alone where it never is."""
    always = DenseText(list(range(20)), 2, [2] * 18, [0.5] * 18, [1.0] * 18)
    never = DenseText(list(range(20)), 2, [0] * 18, [0.5] * 18, [1.0] * 18)
    gate = lambda text, k: 2 if text.run[k] >= 1 else 0  # noqa: E731
    for text, same in ((always, 2), (never, 0)):
        a = simulate_hindsight([text], gate, compression="fp32", cost=_cost())
        b = simulate([text], "fixed", lambda step, g=same: g, compression="fp32", cost=_cost())
        assert (a.tokens, a.time, a.gammas.tolist()) == (b.tokens, b.time, b.gammas.tolist())


def test_draft_tokens_follow_the_text_then_the_drafts_own_branch():
    # from position 1 the draft matches 2 tokens (positions 1, 2), proposes a wrong one at 3, then its branch
    text = DenseText(
        list(range(10, 18)),
        2,
        [0, 2, 1, 0, 0, 0],
        [0.1, 0.9, 0.8, 0.3, 0.2, 0.6],
        [1.0] * 6,
        {3: ([0.7, 0.5], [2.0, 3.0])},
    )
    assert [text.draft_token(1, i)[0] for i in range(5)] == [0.9, 0.8, 0.3, 0.7, 0.5]
    assert text.draft_token(1, 4) == (0.5, 3.0)
    assert text.draft_token(1, 5) is None  # a branch that ends: the draft proposed its end-of-sequence token
    with pytest.raises(ValueError, match="follows a rejected token at 0: no branch data"):
        text.draft_token(0, 1)


def test_per_token_mode_keeps_and_stops_as_the_hook_does():
    """A stop rule: go on while the token's confidence is >= 0.5, keep a token >= 0.25 (1), drop one below (0)."""
    conf = [0.9, 0.9, 0.9, 0.3, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    branches = {j: ([0.95] * 7, [0.1] * 7) for j in range(12)}
    text = DenseText(list(range(60, 74)), 2, [3, 2, 1, 0, 1, 0, 3, 2, 1, 0, 0, 0], conf, [1.0] * 12, branches)

    def rule(features):  # index 0: the token's confidence (the online feature set)
        return 2 if features[0] >= 0.5 else 1 if features[0] >= 0.25 else 0

    res = simulate([text], "per-token", rule, compression="fp32", cost=_cost(), max_gamma=5)
    # k=0 (the prefill, left out): 0.9 0.9 0.9 (matches), 0.3 (the wrong token at 3): kept, stop; 3 kept.
    # k=4: 0.9 (match), 0.1 (wrong, at 5): dropped, stop: gamma 1 of 2 drafted, kept.
    # k=6: 0.9 0.9 0.9 (matches), 0.9 (wrong, at 9), then the draft's own branch 0.95: 5 (max_gamma), 3 kept.
    # k=10: one token left in the budget: drafted and sent, rejected. k=11: nothing left to draft: a plain step.
    assert res.gammas.tolist() == [1, 5, 1, 0] and res.accepted.tolist() == [1, 3, 0, 0]
    assert res.tokens == 2 + 4 + 1 + 1
    assert res.time == pytest.approx((5 + 11) + (11 + 15) + (3 + 11) + 10)  # drafted 2, 5, 1, 0; sent 1, 5, 1, 0
    with pytest.raises(ValueError, match="no branch data"):
        simulate([replace(text, branches=None)], "per-token", lambda f: 2, compression="fp32", cost=_cost())
    # the draft stops after its end-of-sequence token: a wrong token that is one has an empty branch
    ended = simulate(
        [replace(text, branches={**branches, 9: ([], [])})],
        "per-token",
        rule,
        compression="fp32",
        cost=_cost(),
        max_gamma=5,
    )
    assert ended.gammas.tolist() == [1, 4, 1, 0]  # k=6: 3 matches, the wrong (end) token at 9, then nothing


def test_per_token_mode_takes_the_hooks_own_steps_on_a_tiny_pair():
    """Greedy generation through the hook in per-token mode with a confidence stop, against the simulation on
    the target's text, the draft's teacher-forced pass and its branches after each wrong token: the same steps."""
    from speckv_policy.hf import attach

    target, draft = tiny_llama_pair(seed=5, noise=0.05)
    ids = torch.tensor([[1, 7, 3, 9, 4, 7, 3]])
    n = 28
    text, ref = teacher_forced_text(target, draft, ids, n)
    cut = float(np.median(text.conf))

    def stop_rule(features):  # keep and go on above the median confidence, else drop and stop
        return 2 if features[0] > cut else 0

    with (
        torch.inference_mode(),
        attach(target, stop_rule, mode="per-token", feature_set="online", settings={"max_gamma": 8}) as h,
    ):
        out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    res = simulate([text], "per-token", stop_rule, compression="fp32", cost=_cost())
    hook = [(s.gamma, s.accepted) for s in h.stats][1:]  # the first step is the prefill, left out
    assert list(zip(res.gammas.tolist(), res.accepted.tolist())) == hook  # every step, the last included
    assert any(g > 1 for g, _ in hook) and any(g == 0 for g, _ in hook)


def test_rule_mode_asks_and_tells_the_rule_and_keeps_it_across_texts():
    from speckv_policy.evaluation.race import HFHeuristicSchedule

    class Recorder:
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def gamma(self) -> int:
            return 1 + len(self.seen) % 3

        def observe(self, gamma: int, accepted: int) -> None:
            self.seen.append((gamma, accepted))

    text = DenseText(list(range(10, 20)), 2, [2, 1, 0, 3, 2, 1, 0, 0], [0.5] * 8, [1.0] * 8)
    rule = Recorder()
    res = simulate([text, text], "rule", rule, compression="nf4", cost=_cost())
    assert len(rule.seen) == res.steps + 2  # every step told, the two prefill steps included
    # asked 1, 2, 3, 1, 2, 3, 1 (the count runs on across texts); told what the step drafted: nothing at a text's
    # last position
    assert [g for g, _ in rule.seen] == [1, 2, 3, 0, 2, 3, 0]
    with pytest.raises(ValueError, match="mode='rule' needs an object with gamma"):
        simulate([text], "rule", lambda step: 2, compression="nf4", cost=_cost())
    hf = HFHeuristicSchedule(start=3)
    for g, a, expect in ((3, 3, 5), (5, 2, 4), (4, 0, 3), (3, 3, 5), (0, 0, 5)):
        hf.observe(g, a)
        assert hf.gamma() == expect
    hf = HFHeuristicSchedule(start=1)
    hf.observe(1, 0)
    assert hf.gamma() == 1


def test_simulate_reports_every_texts_totals():
    texts = [
        DenseText(list(range(10, 22)), 2, [3, 0, 0, 1, 0, 0, 2, 1, 0, 0], [0.5] * 10, [1.0] * 10),
        DenseText(list(range(40, 47)), 3, [1, 0, 2, 0], [0.5] * 4, [1.0] * 4),
    ]
    both = simulate(texts, "fixed", lambda step: 1, compression="int8", cost=_cost())
    alone = [simulate([t], "fixed", lambda step: 1, compression="int8", cost=_cost()) for t in texts]
    assert both.text_tokens.tolist() == [a.tokens for a in alone]
    assert both.text_time.tolist() == pytest.approx([a.time for a in alone])
    assert both.tokens == sum(a.tokens for a in alone) and both.time == pytest.approx(sum(a.time for a in alone))


def test_a_pre_policys_history_only_moves_on_drafting_steps():
    """A pre policy that drafts only while the last drafting step was fully accepted."""
    run = [0] * 12
    text = DenseText(ids=list(range(50, 64)), prompt_len=2, run=run, conf=[0.5] * 12, entropy=[1.0] * 12)

    def decide(pre):  # index 5: prev_fully_accepted; index 4: prev_gamma (0 before any drafting step)
        return 2 if pre[4] == 0 or pre[5] == 1 else 0

    res = simulate([text], "pre", decide, compression="nf4", cost=_cost())
    # step 0 drafts 2 and keeps none: from then on the history says "not fully accepted" and never changes
    assert res.gammas.tolist() == [0] * 11 and res.tokens == 11  # positions 1..11, one token each


def test_simulate_reproduces_the_hooks_steps_on_a_tiny_pair():
    """Greedy generation through the hook in 'pre' mode with a policy that reads its features, against the
    simulation on the target's greedy text and the draft's teacher-forced proposals: the same steps."""
    from speckv_policy.hf import attach

    target, draft = tiny_llama_pair(seed=3, noise=0.05)
    ids = torch.tensor([[1, 7, 3, 9, 4, 7, 3]])
    n = 24

    def decide(pre):  # depends on the history, the context length and the self-repetition
        return int((pre[3] + pre[8] + pre[6]) % 4)

    with torch.inference_mode():
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        with attach(target, decide, mode="pre", feature_set="pre", settings={"max_gamma": 8}) as h:
            out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=draft)
        logits = draft(ref).logits[0]
    assert torch.equal(out, ref)
    plen, seq = ids.shape[1], ref[0].tolist()
    proposals = logits[plen - 1 : len(seq) - 1].argmax(-1).tolist()
    text = DenseText(seq, plen, match_runs(proposals, seq[plen:], 8), [0.5] * n, [1.0] * n)
    res = simulate([text], "pre", decide, compression="fp32", cost=_cost())
    hook = [(s.gamma, s.accepted) for s in h.stats][1:]  # the first step is the prefill, left out
    assert list(zip(res.gammas.tolist(), res.accepted.tolist())) == hook  # every step, the last included
    assert any(g > 0 for g, _ in hook) and any(g == 0 for g, _ in hook)


def test_dense_replay_benchmark_on_the_real_pair():
    """benchmarks/dense_replay.py on two prompts of the shipped race at NF4: every arm priced, the race beside it."""
    import json

    stdout = run_benchmark("dense_replay.py", "--compressions", "nf4", "--max-prompts", "2")
    rows = {r[1]: r for r in table_rows(stdout, "nf4") if len(r) == 12}  # the first table
    assert {"target", "fixed-2", "fixed-4", "gbt-repriced", "gbt-pre-repriced", "gbt-gated-repriced"} <= set(rows)
    assert float(rows["fixed-2"][3]) == pytest.approx(1.0) and float(rows["target"][4]) == pytest.approx(1.0)
    assert float(rows["target"][11]) == pytest.approx(1.0)  # x target alone, replayed at every position
    ratio = float(rows["gbt-pre-repriced"][2]) / float(rows["target"][2])
    assert float(rows["gbt-pre-repriced"][11]) == pytest.approx(ratio, abs=2e-3)
    # gamma 0 only at a text's last position (nothing left to draft); tokens per step
    assert 0.0 < float(rows["fixed-2"][4]) < 0.05 and float(rows["fixed-2"][5]) > 1.0
    race = json.loads((ROOT / "benchmarks" / "runs" / "quant_steps.json").read_text())
    first_two = sorted({r["prompt_id"] for r in race["runs"]})[:2]
    sel = [
        r for r in race["runs"] if r["compression"] == "nf4" and r["arm"] == "fixed-2" and r["prompt_id"] in first_two
    ]
    assert float(rows["fixed-2"][8]) == pytest.approx(
        sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel), abs=0.01
    )


def test_simulate_records_the_states_a_pre_policy_meets():
    run = [2, 1, 0, 3, 2, 1, 0, 0]
    text = DenseText(ids=list(range(10, 20)), prompt_len=2, run=run, conf=[0.5] * 8, entropy=[1.0] * 8)
    visited: list = []
    res = simulate([text], "pre", lambda pre: 1, compression="int8", cost=_cost(), visited=visited)
    # gamma 1 everywhere: positions 0 (keeps 1), 2 (0), 3 (1), 5 (1), 7 (the last: nothing decidable after it)
    assert [v[1:] for v in visited] == [(2, 7), (0, 5), (3, 4), (1, 2), (0, 0)]
    assert all(len(v[0]) == 9 for v in visited)  # the 'pre' feature row
    assert visited[1][0][3] == 1.0 and visited[2][0][3] == 0.0  # prev_accepted: 1 after position 0, 0 after 2
    assert res.steps == len(visited) - 1  # the prefill step is recorded as a state, not counted as a step


def test_dense_replay_benchmark_on_the_logs_heldout_prompts_without_a_race():
    stdout = run_benchmark("dense_replay.py", "--all-heldout", "--compressions", "fp32", "--max-prompts", "2")
    assert stdout.startswith("2 held-out prompts of the log")
    rows = {r[1]: r for r in table_rows(stdout, "fp32") if len(r) == 12}  # the first table
    assert {"target", "fixed-2", "gbt-pre-repriced"} <= set(rows)
    assert rows["fixed-2"][8] == "" and rows["fixed-2"][9] == ""  # no race beside it
    # the second table: pooled, with paired bootstrap CIs and the oracle in hindsight
    ci = {r[2]: r for r in table_rows(stdout, "fp32") if r[1] == "all (2)"}
    assert {"oracle", "gbt-pre-repriced", "gbt-gated-repriced", "stop"} <= set(ci)  # stop: exported/smollm2-stop.json
    assert "stop-gated" in ci and rows["stop-gated"][6] == ""  # the same rule, a gate fitted by the benchmark
    assert {"adaedl", "sglang-adaptive", "ema-goodput", "hf-heuristic"} <= set(ci)  # the peers' rules
    assert ci["oracle"][9] == "1.000" and float(ci["oracle"][4]) >= 1.0
    assert ci[ci["oracle"][8]][7] == "1.000"  # the best peer against itself
    assert rows["stop"][6] == "" and float(rows["stop"][5]) > 1.0  # no step-log replay of a stop rule
    for arm in ("gbt-pre-repriced", "gbt-gated-repriced", "stop"):
        ratio, lo, hi = (float(v) for v in ci[arm][4].replace("[", "").replace("]", "").replace(",", " ").split())
        assert lo <= ratio <= hi
        assert ratio == pytest.approx(float(ci[arm][3]) / float(rows["target"][2]), abs=2e-3)
        assert float(ci[arm][9]) <= 1.0
    # the third table: rules that know the first draft token's fate, bounded by the oracle; the signals' AUC
    bound = {r[1]: r for r in table_rows(stdout, "fp32") if r[1].startswith(("oracle in", "perfect gate"))}
    assert len(bound) == 5 and bound["oracle in hindsight"][5] == "1.000"
    assert all(float(r[5]) <= 1.0 for r in bound.values())
    assert "ROC AUC for it of the probe token's confidence" in stdout


def test_dense_replay_benchmark_in_sampling():
    """--decoding sampling on two held-out prompts: the texts are sampled, every arm walks the same draws (fp32: the
    quantized levels' sampling runs through the same code, and the real-pair test replays NF4)."""
    args = ["--all-heldout", "--compressions", "fp32", "--max-prompts", "2", "--decoding", "sampling"]
    stdout = run_benchmark("dense_replay.py", *args, "--replications", "3")
    assert "sampling at temperature 0.7, 3 draws of the keep/reject events per text" in stdout
    rows = {r[1]: r for r in table_rows(stdout, "fp32") if len(r) == 12}
    assert float(rows["target"][4]) == 1.0 and float(rows["target"][5]) == 1.0  # never drafts, one token a step
    assert 0.0 < float(rows["fixed-2"][4]) < 0.05  # gamma 0 only where nothing is left to draft
    ci = {r[2]: r for r in table_rows(stdout, "fp32") if r[1] == "all (2)"}
    assert {"oracle", "gbt-pre-repriced", "adaedl", "ema-goodput"} <= set(ci)
    assert all(float(r[9]) <= 1.0 for r in ci.values())  # the oracle knows the draws: nothing beats it
    ratio, lo, hi = (float(v) for v in ci["gbt-pre-repriced"][4].strip("[]").replace("[", "").replace(",", " ").split())
    assert lo <= ratio <= hi
    again = run_benchmark("dense_replay.py", *args, "--replications", "3")
    assert again.split("texts in")[0] == stdout.split("texts in")[0]  # seeded: the same texts and draws


def test_bad_pairs_and_exports_get_a_clear_error():
    import argparse
    import subprocess
    import sys

    from speckv_policy.cli.common import export_arm_pairs

    assert export_arm_pairs("exported/smollm2-gbt.onnx=a, exported/smollm2-table.onnx=b") == {
        "exported/smollm2-gbt.onnx": "a",
        "exported/smollm2-table.onnx": "b",
    }
    for bad, why in (
        ("exported/smollm2-gbt.onnx", "is not EXPORT=ARM"),
        ("=a", "is not EXPORT=ARM"),
        ("exported/nope.onnx=a", "exported/nope.onnx: no such export"),
        ("exported/smollm2-gbt.onnx=a,exported/smollm2-table.onnx=a", "'a' is given to two exports"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            export_arm_pairs(bad)
    for script, args, why in (
        ("dense_replay.py", ["--pairs", "exported/smollm2-paper-mlp16.onnx=p"], "feature set 'paper' has no"),
        ("dense_replay.py", ["--race", "nope.json"], "nope.json: no such file"),
        ("dense_replay.py", ["--stop-rule", "nope.json"], "nope.json: no such file"),
        (
            "dense_replay.py",
            ["--stop-rule", "benchmarks/runs/onednn_costs.json"],
            "benchmarks/runs/onednn_costs.json: 'format'",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, cwd=ROOT
        )
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1000:]


def test_kept_runs_realize_and_pool():
    from speckv_policy.evaluation.dense import kept_runs, pool_results, realize

    assert kept_runs([True, True, False, True, True, True], 2) == [2, 1, 0, 2, 2, 1]
    text = DenseText(list(range(10, 22)), 2, [0] * 10, [0.5] * 10, [1.0] * 10, accept_prob=[1.0] * 5 + [0.0] * 5)
    (sure,) = realize([text], seed=3, cap=8)
    assert list(sure.run) == [5, 4, 3, 2, 1, 0, 0, 0, 0, 0]  # probability 1 always kept, 0 never
    half = replace(text, accept_prob=[0.5] * 10)
    a, b = realize([half, half], seed=7, cap=8), realize([half, half], seed=7, cap=8)
    assert [list(t.run) for t in a] == [list(t.run) for t in b]  # the same events for every arm that asks
    assert list(a[0].run) != list(a[1].run) or list(a[0].run) != list(realize([half], seed=8, cap=8)[0].run)
    draws = [realize([half] * 40, seed=s, cap=8) for s in range(20)]
    kept = np.mean([t.run[k] >= 1 for d in draws for t in d for k in range(10)])
    assert kept == pytest.approx(0.5, abs=0.03)  # 8,000 events
    with pytest.raises(ValueError, match="text 0 has no accept_prob"):
        realize([replace(text, accept_prob=None)], seed=0, cap=8)
    with pytest.raises(ValueError, match="text 1: accept_prob\\[3\\] = nan, expected a probability"):
        realize([text, replace(text, accept_prob=[0.5] * 3 + [float("nan")] + [0.5] * 6)], seed=0, cap=8)
    with pytest.raises(ValueError, match="accept_prob\\[0\\] = 1.5"):
        realize([replace(text, accept_prob=[1.5] + [0.5] * 9)], seed=0, cap=8)
    r1 = simulate(a, "fixed", lambda s: 2, compression="int8", cost=_cost())
    r2 = simulate(b, "fixed", lambda s: 1, compression="int8", cost=_cost())
    both = pool_results([r1, r2])
    assert both.tokens == r1.tokens + r2.tokens and both.steps == r1.steps + r2.steps
    assert both.text_tokens.tolist() == (r1.text_tokens + r2.text_tokens).tolist()
    assert both.gammas.tolist() == r1.gammas.tolist() + r2.gammas.tolist()
    with pytest.raises(ValueError, match="different numbers of texts"):
        pool_results([r1, simulate(a[:1], "fixed", lambda s: 2, compression="int8", cost=_cost())])


def test_speculative_sampling_keeps_the_token_it_emits_with_probability_min_1_q_over_p():
    """The identity the sampling replay rests on, checked by running speculative sampling at one position."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
    q = np.array([0.2, 0.4, 0.1, 0.05, 0.25])
    n = 400_000
    x = rng.choice(5, size=n, p=q)
    keep = rng.random(n) < np.minimum(1.0, p[x] / q[x])
    residual = np.maximum(p - q, 0.0)
    out = np.where(keep, x, rng.choice(5, size=n, p=residual / residual.sum()))
    assert np.bincount(out, minlength=5) / n == pytest.approx(p, abs=0.004)  # lossless: the target's distribution
    for t in range(4):
        assert keep[out == t].mean() == pytest.approx(min(1.0, q[t] / p[t]), abs=0.01)


def test_the_sampling_replay_matches_speculative_sampling_on_a_tiny_pair():
    """Steps per text of fixed gamma 3 in sampling: the hook's own runs against the replay on texts the target
    sampled alone, with its keep/reject events drawn from min(1, q / p). Events drawn from min(1, p / q) or from
    q(t) alone land 18-30 standard errors away (checked when this test was written)."""
    from speckv_policy.evaluation.dense import realize
    from speckv_policy.hf import attach

    target, draft = tiny_llama_pair(seed=11, noise=0.1)
    ids = torch.tensor([[1, 7, 3, 9, 4, 7, 3]])
    n, runs, temp = 16, 150, 0.7
    kw = dict(max_new_tokens=n, do_sample=True, temperature=temp, top_k=0, top_p=1.0)
    online = []
    texts = []
    with torch.inference_mode():
        for seed in range(runs):
            torch.manual_seed(seed)
            with attach(target, lambda step: 3, mode="fixed", settings={"max_gamma": 3}) as h:
                target.generate(ids, assistant_model=draft, **kw)
            online.append(len(h.stats) - 1)  # steps after the first (the prefill)
            torch.manual_seed(10_000 + seed)
            seq = target.generate(ids, **kw)
            plen = ids.shape[1]
            logp = (target(seq).logits[0, plen - 1 : -1] / temp).log_softmax(-1)
            logq = (draft(seq).logits[0, plen - 1 : -1] / temp).log_softmax(-1)
            t = seq[0, plen:].unsqueeze(-1)
            accept = (logq.gather(-1, t) - logp.gather(-1, t)).exp().clamp(max=1.0).squeeze(-1)
            m = seq.shape[1] - plen
            texts.append(DenseText(seq[0].tolist(), plen, [0] * m, [0.5] * m, [1.0] * m, accept_prob=accept.tolist()))
    replayed = [
        simulate([t], "fixed", lambda s: 3, compression="fp32", cost=_cost()).steps for t in realize(texts, 0, 8)
    ]
    online_a, replay_a = np.asarray(online, float), np.asarray(replayed, float)
    se = np.sqrt(online_a.var() / len(online_a) + replay_a.var() / len(replay_a))
    assert online_a.mean() < 0.9 * n  # speculation saves steps: the check has teeth
    assert abs(online_a.mean() - replay_a.mean()) < 4 * se, (online_a.mean(), replay_a.mean(), se)
