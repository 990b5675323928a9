"""Batch-aware costs and the engines' own rules in the vLLM proposer, without vLLM.

BatchCosts.fit is checked against SYNTHETIC engine steps drawn from known costs; the proposer runs in the synthetic
engine loop of tests/test_vllm_proposer.py (greedy verification against the tiny target)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from speckv_policy.batch_costs import CATCH_UP_COLUMN, STEP_COLUMNS, BatchCosts, is_batch_costs_file
from speckv_policy.objective import CostModel, CostModelError
from speckv_policy.peers import DynamicSDTable, SGLangStyleSteps
from speckv_policy.runtime import PolicyFallbackWarning
from speckv_policy.vllm import ProposerSettings, SpeckvProposer
from speckv_policy.vllm.calibrate import engine_steps, read_timings
from tests.test_vllm_proposer import GATED, _config, _engine, _greedy

TRUE = {  # per batch size: verify base (ms), verify per draft token, draft per call, draft per token
    1: (100.0, 2.0, 1.5, 6.0),
    4: (110.0, 3.0, 1.5, 6.0),
    16: (150.0, 4.0, 1.5, 6.0),
}
CATCH_UP = 0.05  # ms per context token a draft reads before its first draft token


def _synthetic_steps(seed: int = 0, n: int = 200, noise: float = 0.5) -> dict[str, np.ndarray]:
    """Engine steps with known costs: random draft lengths 0..4 per request, each drafting request's draft catching
    up on 1..3 context tokens (it drafted last step) or on 4..200 (it was shut, or the request is new), Gaussian
    timing noise."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[float]] = {k: [] for k in (*STEP_COLUMNS, CATCH_UP_COLUMN)}
    for b, (vb, vt, dc, dt) in TRUE.items():
        for _ in range(n):
            g = rng.integers(0, 5, size=b)
            fed = np.where(rng.random(b) < 0.8, rng.integers(1, 4, size=b), rng.integers(4, 201, size=b))
            tokens, drafting, caught_up = int(g.sum()), int((g > 0).sum()), int(fed[g > 0].sum())
            cols["batch"].append(b)
            cols["draft_tokens"].append(tokens)
            cols["drafting"].append(drafting)
            cols[CATCH_UP_COLUMN].append(caught_up)
            cols["draft_ms"].append(dc * drafting + dt * tokens + CATCH_UP * caught_up + abs(rng.normal(0, noise)))
            cols["verify_ms"].append(vb + vt * tokens + rng.normal(0, noise))
    return {k: np.asarray(v) for k, v in cols.items()}


def test_batch_costs_fit_recovers_known_costs_and_prices_one_requests_share():
    costs = BatchCosts.fit(_synthetic_steps(), device="cpu")
    assert costs.batch_sizes == (1, 4, 16)
    for b, (vb, vt, dc, dt) in TRUE.items():
        c = costs.at(b)
        assert c.verify_base_ms[0] == pytest.approx(vb / b, rel=0.03)  # the fixed part, shared by the batch
        assert c.verify_ms_per_token[0] == pytest.approx(vt, abs=0.15)
        assert c.draft_ms_per_token[0] == pytest.approx(dt, abs=0.15)
        assert c.draft_base_ms[0] == pytest.approx(dc, abs=0.3)
        assert costs.catch_up_at(b) == pytest.approx(CATCH_UP, abs=0.005)
    # carried forward like vLLM's table: 2..3 use batch 1's costs, 5..15 batch 4's, past 16 batch 16's
    assert costs.at(3) == costs.at(1) and costs.at(15) == costs.at(4) and costs.at(999) == costs.at(16)
    assert costs.catch_up_at(15) == costs.catch_up_at(4)
    # one draft token costs a larger share of a request's step as the batch grows: gamma should fall
    share = [costs.at(b).step_ms(1, 0) / costs.at(b).step_ms(0, 0) for b in (1, 4, 16)]
    assert share[0] < share[1] < share[2]
    # without the catch-up column (steps timed before it) nothing is charged for it, and the rest still fits
    old = BatchCosts.fit({k: v for k, v in _synthetic_steps().items() if k != CATCH_UP_COLUMN})
    assert old.catch_up_ms_per_token == () and old.catch_up_at(16) == 0.0
    assert old.at(16).verify_base_ms[0] == pytest.approx(150.0 / 16, rel=0.03)


def test_batch_costs_fit_leaves_out_outliers_and_thin_batch_sizes():
    steps = _synthetic_steps(n=60)
    steps["verify_ms"][5] = 1e6  # a page fault / another process: dropped, not fitted
    keep = ~((steps["batch"] == 4) & (np.arange(len(steps["batch"])) % 60 > 4))  # batch 4: only 5 steps left
    thin = {k: v[keep] for k, v in steps.items()}
    costs = BatchCosts.fit(thin, min_steps=8)
    assert costs.batch_sizes == (1, 16)
    assert costs.at(1).verify_base_ms[0] == pytest.approx(100.0, rel=0.03)
    with pytest.raises(ValueError, match="missing column 'drafting'"):
        BatchCosts.fit({k: v for k, v in steps.items() if k != "drafting"})
    with pytest.raises(ValueError, match="no batch size has 8 timed steps"):
        BatchCosts.fit({k: v[:3] for k, v in steps.items()})


def test_batch_cost_files_round_trip_and_bad_ones_are_named(tmp_path):
    costs = BatchCosts.fit(_synthetic_steps(n=40), device="cpu", machine="test box")
    good = tmp_path / "batch.json"
    costs.save(good)
    assert BatchCosts.load(good) == costs and is_batch_costs_file(good)
    assert len(costs.catch_up_ms_per_token) == 3
    before = {k: v for k, v in json.loads(good.read_text()).items() if k != "catch_up_ms_per_token"}
    assert BatchCosts.load(before).catch_up_at(1) == 0.0  # a file from before the catch-up was measured
    single = tmp_path / "single.json"
    CostModel.relative().save(single)
    assert not is_batch_costs_file(single) and not is_batch_costs_file(tmp_path / "absent.json")
    d = json.loads(good.read_text())
    cases = {
        "format": ({**d, "format": "other"}, "not a batch cost file"),
        "order": ({**d, "batch_sizes": [16, 4, 1]}, "increasing"),
        "count": ({**d, "costs": d["costs"][:2]}, "one cost model per batch size"),
        "entry": (
            {**d, "costs": [d["costs"][0], {**d["costs"][1], "verify_base_ms": [-1, 1, 1]}, d["costs"][2]]},
            r"costs\[1\]",
        ),
        "type": ({**d, "costs": [d["costs"][0], 7, d["costs"][2]]}, r"costs\[1\] must be a cost model"),
        "unknown": ({**d, "extra": 1}, "unknown fields extra"),
        "catch-up count": ({**d, "catch_up_ms_per_token": [0.1]}, "one cost per batch size"),
        "catch-up value": ({**d, "catch_up_ms_per_token": [0.1, -1, 0.1]}, r"costs in 0\.\."),
        "catch-up type": ({**d, "catch_up_ms_per_token": 0.1}, "must be a list"),
    }
    for name, (bad, match) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(CostModelError, match=match) as err:
            BatchCosts.load(path)
        assert str(path) in str(err.value)


def test_engine_steps_pair_calls_and_skip_prefills_and_batch_changes():
    def call(t, batch, new=0, tokens=4, drafting=2, decoding=None):
        d = batch if decoding is None else decoding
        return {"t_in": t, "t_out": t + 0.01, "batch": batch, "new": new, "draft_tokens": tokens,
                "drafting": drafting, "decoding": d, "caught_up": int(100 * t)}  # fmt: skip

    calls = [call(0.0, 2, new=2), call(0.1, 2), call(0.2, 2), call(0.3, 1), call(0.4, 1, new=1), call(0.5, 1)]
    calls.append(call(0.6, 1, decoding=0))
    steps = engine_steps(calls)
    # kept: (0,1) and (1,2) at batch 2 -- call 0's new requests were prefilled before it, not in its gap --
    # and (4,5) at batch 1; (2,3) changes batch, (3,4) has a prefill in the gap, (5,6) has a request not decoding
    assert steps["batch"].tolist() == [2, 2, 1]
    assert steps["verify_ms"] == pytest.approx([90.0, 90.0, 90.0])
    assert steps["draft_ms"] == pytest.approx([10.0, 10.0, 10.0])
    assert steps[CATCH_UP_COLUMN].tolist() == [0, 10, 40]  # each step's own call's


def test_dynamic_sd_table_looks_up_as_vllm_expands_it():
    t = DynamicSDTable([[1, 16, 3], [32, 128, 2]])
    assert [t.gamma(b) for b in (1, 16, 17, 31, 32, 128, 500)] == [3, 3, 3, 3, 2, 2, 2]
    assert DynamicSDTable.from_best({1: 3, 4: 1, 16: 0}).as_config() == [[1, 3, 3], [4, 15, 1], [16, 65536, 0]]
    for bad, match in [([[2, 4, 1]], "start at batch size 1"), ([[1, 8, 2], [4, 9, 1]], "overlaps"),
                       ([[1, 8]], "expected"), ([[1, 8, -1]], "K >= 0"), ([], "non-empty")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            DynamicSDTable(bad)


def test_the_proposer_runs_vllms_table_by_batch_size_and_stays_lossless(pair_dir):
    target, draft = pair_dir
    p = SpeckvProposer(_config(8), ProposerSettings(draft=draft, batch_schedule=[[1, 1, 5], [2, 8, 1]]))
    p.load_model()
    prompts = [[5, 9, 13, 2], [7, 7, 1, 30, 4]]
    full, steps = _engine(p, target, prompts, 24)
    both = min(len(r) for r in steps)  # engine steps with both requests in the batch: K 1; after that, batch 1: K 5
    assert {s[0] for r in steps for s in r[:both]} == {1}
    assert max(s[0] for r in steps for s in r[both:]) > 1
    alone, steps1 = _engine(p, target, prompts[:1], 24)  # batch 1 -> K 5 (less at the length limit)
    assert max(s[0] for s in steps1[0]) == 5
    assert full[0] == _greedy(target, prompts[0], 24) and alone[0] == full[0]
    with pytest.raises(ValueError, match="not both"):
        ProposerSettings(draft=draft, policy=4, batch_schedule=[[1, 4, 2]])
    with pytest.raises(ValueError, match="start at batch size 1"):
        ProposerSettings(draft=draft, batch_schedule=[[2, 4, 2]])


def test_the_sglang_rule_moves_between_tiers_with_the_engines_acceptance(pair_dir):
    target, draft = pair_dir
    p = SpeckvProposer(_config(8), ProposerSettings(draft=draft, policy="sglang-adaptive"))
    p.load_model()
    prompts = [[5, 9, 13, 2], [7, 7, 1, 30, 4], [3, 3, 8, 1]]
    full, steps = _engine(p, target, prompts, 40)
    drafted = {s[0] for req in steps for s in req}
    assert drafted <= {1, 3, 7}  # SGLang's tiers only: the rule never drafts 0 or a length between tiers
    assert len(drafted) >= 2  # the tier moved from where it started (3)
    assert all(f == _greedy(target, q, 40) for f, q in zip(full, prompts))
    assert SGLangStyleSteps().gamma() == 3  # where every request started


def test_explore_drafts_random_lengths_and_timings_make_engine_steps(pair_dir, tmp_path):
    target, draft = pair_dir
    timings = tmp_path / "t.jsonl"
    p = SpeckvProposer(_config(4), ProposerSettings(draft=draft, policy="explore", timings=str(timings), seed=1))
    p.load_model()
    prompts = [[5, 9, 13, 2], [7, 7, 1, 30, 4], [3, 3, 8, 1]]
    full, steps = _engine(p, target, prompts, 30)
    lengths = [s[0] for req in steps for s in req]
    assert set(lengths) == {0, 1, 2, 3, 4}  # the whole range 0..max_gamma is drawn, nothing past it
    assert all(f == _greedy(target, q, 30) for f, q in zip(full, prompts))
    rows = read_timings(timings)
    assert len(rows) == p.calls and rows[0]["new"] == 3 and rows[1]["new"] == 0
    assert sum(r["draft_tokens"] for r in rows) == p.drafted
    assert sum(r["caught_up"] for r in rows) == p.caught_up
    assert len(engine_steps(rows)["batch"]) >= 5
    # now and then a drawn 0 holds for a run of steps, so that drafts catch up on more than one step's tokens
    runs = [len(r) for req in steps for r in "".join("0" if s[0] == 0 else "x" for s in req).split("x")]
    assert max(runs) >= 4


def test_the_proposer_counts_the_context_each_draft_catches_up_on(pair_dir, tmp_path):
    target, draft = pair_dir
    timings = tmp_path / "t.jsonl"
    p = SpeckvProposer(_config(4), ProposerSettings(draft=draft, policy=2, timings=str(timings)))
    p.load_model()
    prompts = [[5, 9, 13, 2], [7, 7, 1, 30, 4], [3, 3, 8, 1]]
    _engine(p, target, prompts, 12)
    rows = read_timings(timings)
    # the first draft of a request reads its whole context (the prompt and the token its prefill sampled); after
    # a draft of 2 the next reads the tokens sampled since, less the first draft token where it was kept: 1 to 3
    assert rows[0]["caught_up"] == sum(len(q) + 1 for q in prompts)
    assert all(r["drafting"] <= r["caught_up"] <= 3 * r["drafting"] for r in rows[1:])
    assert sum(r["caught_up"] for r in rows) == p.caught_up


def _batch_costs(tmp_path, *, drafting_ms: float) -> str:
    """Batch costs where a step's fixed part is 100 ms at every batch size: shared by 1 request it dwarfs drafting,
    shared by 16 it does not."""
    models = []
    for b in (1, 16):
        models.append(CostModel((drafting_ms,) * 3, (100.0 / b,) * 3, (1.0,) * 3, unit="ms"))
    path = tmp_path / "batch.json"
    BatchCosts((1, 16), tuple(models)).save(path)
    return str(path)


def test_a_batch_priced_policy_drafts_less_as_the_batch_grows(pair_dir, tmp_path):
    target, draft = pair_dir
    costs = _batch_costs(tmp_path, drafting_ms=6.0)
    p = SpeckvProposer(_config(8), ProposerSettings(draft=draft, policy=GATED, costs=costs))
    p.load_model()
    assert p.batch_costs is not None
    one = [[5, 9, 13, 2]]
    _, alone = _engine(p, target, one, 32)
    p2 = SpeckvProposer(_config(8), ProposerSettings(draft=draft, policy=GATED, costs=costs))
    p2.load_model()
    many = [[5, 9, 13, 2 + i] for i in range(16)]
    full, crowded = _engine(p2, target, many, 32)
    per_step = lambda steps: np.mean([s[0] for req in steps for s in req])  # noqa: E731
    assert per_step(alone) > per_step(crowded)  # the costs of a 16-request batch say: draft less
    assert all(f == _greedy(target, q, 32) for f, q in zip(full, many))


def test_a_draft_that_must_catch_up_is_priced_for_it_and_the_policy_drafts_less(pair_dir, tmp_path):
    target, draft = pair_dir
    path = _batch_costs(tmp_path, drafting_ms=6.0)
    priced = BatchCosts.load(path)
    caught_up = tmp_path / "catch-up.json"
    BatchCosts(priced.batch_sizes, priced.costs, catch_up_ms_per_token=(200.0, 200.0)).save(caught_up)
    per_step = {}
    for name, costs in (("free", path), ("priced", str(caught_up))):
        p = SpeckvProposer(_config(8), ProposerSettings(draft=draft, policy=GATED, costs=costs))
        p.load_model()
        prompts = [[5, 9, 13, 2], [7, 7, 1, 30, 4]]
        full, steps = _engine(p, target, prompts, 32)
        assert all(f == _greedy(target, q, 32) for f, q in zip(full, prompts))
        per_step[name] = np.mean([s[0] for req in steps for s in req])
    assert per_step["priced"] < per_step["free"]


def test_a_drafting_overhead_prices_every_drafting_candidate_alike_on_both_engines():
    from speckv_policy.runtime import RuntimePolicy

    rng = np.random.default_rng(0)
    for costs in (_cost_model(), None):  # re-priced, and at the export's own costs
        python, graph = (RuntimePolicy(GATED, engine=e, costs=costs) for e in ("python", "onnxruntime"))
        assert python.engine == "python" and graph.engine == "onnxruntime"
        names = python.feature_set.names
        rows = rng.uniform(0, 1, size=(64, len(names))).astype(np.float32)  # rates, confidence: 0..1
        for name, high in (("compression_code", 3), ("prev_accepted", 9), ("prev_gamma", 9), ("log_context_len", 7),
                           ("context_match_len", 9), ("entropy_first", 6)):  # fmt: skip
            rows[:, names.index(name)] = rng.integers(0, high, size=64) if high < 7 else rng.uniform(0, high, 64)
        opened = {}
        for overhead in (0.0, 1.0, 20.0, 1e6):
            gates = [python.decide_gate(r.tolist(), drafting_overhead=overhead) for r in rows]
            assert gates == [graph.decide_gate(r, drafting_overhead=overhead) for r in rows]
            lengths = [python.decide(r.tolist(), drafting_overhead=overhead) for r in rows]
            assert lengths == [graph.decide(r, drafting_overhead=overhead) for r in rows]
            opened[overhead] = sum(gates)
        assert opened[0.0] >= opened[20.0] and opened[1e6] == 0  # a dearer draft opens the gate no more often
        assert opened[0.0] > opened[1e6]
    with pytest.raises(ValueError, match="drafting_overhead must be a finite cost >= 0"):
        python.decide_gate(rows[0].tolist(), drafting_overhead=-1.0)
    fallback = RuntimePolicy(GATED, costs=_cost_model(), fallback_gamma=2)
    with pytest.warns(PolicyFallbackWarning, match="drafting_overhead"):
        assert fallback.decide(rows[0].tolist(), drafting_overhead=float("nan")) == 2


def _cost_model() -> CostModel:
    return CostModel((6.0,) * 3, (40.0,) * 3, (1.0,) * 3, unit="ms")


def test_a_bad_batch_cost_file_falls_back_with_one_warning(pair_dir, tmp_path):
    target, draft = pair_dir
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "speckv-batch-costs", "batch_sizes": [1], "costs": [{"x": 1}]}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = SpeckvProposer(_config(8), ProposerSettings(draft=draft, policy=GATED, costs=str(bad), fallback_gamma=2))
        p.load_model()
        full, steps = _engine(p, target, [[5, 9, 13, 2]], 20)
    fallbacks = [x for x in w if issubclass(x.category, PolicyFallbackWarning)]
    assert len(fallbacks) == 1 and str(bad) in str(fallbacks[0].message)
    assert {s[0] for s in steps[0][:-1]} == {2}
    assert full[0] == _greedy(target, [5, 9, 13, 2], 20)


def test_the_vllm_race_summary_pairs_prompts_and_compares_with_the_best_of_vllms_options():
    from tests.conftest import load_benchmark

    race = load_benchmark("vllm_race.py")
    rng = np.random.default_rng(0)
    speed = {"none": 1.0, "fixed-1": 1.3, "fixed-2": 1.2, "vllm-dynamic-sd": 1.3, "gbt-gated-batch": 1.4,
             "head-fixed-1": 1.5}  # fmt: skip
    rows = []
    for rep in range(2):
        for j in range(6):
            base = rng.uniform(2.0, 4.0)  # prompts differ; the pairing keeps that out of the ratios
            for arm, s in speed.items():
                rows.append({"arm": arm, "concurrency": 4, "repeat": rep, "prompt": f"p{j}", "tokens": 64,
                             "seconds": base / s, "wall": 10.0})  # fmt: skip
    out = race.summarize(rows, list(speed), [4], resamples=300)["4"]
    sec = sum(r["seconds"] for r in rows if r["arm"] == "none")
    assert out["none"]["tokens_per_s"] == pytest.approx(4 * 64 * 12 / sec)  # Little's law: c * tokens / seconds
    for arm, s in speed.items():
        if arm != "none":
            assert out[arm]["vs_none"]["ratio"] == pytest.approx(s)
            lo, hi = out[arm]["vs_none"]["ci"]
            assert lo == pytest.approx(s) and hi == pytest.approx(s)  # the same ratio on every prompt: no spread
    assert out["gbt-gated-batch"]["vs_best_vllm"]["ratio"] == pytest.approx(1.4 / 1.5)  # the head's arm
    assert out["gbt-gated-batch"]["vs_vllm_same_draft"]["ratio"] == pytest.approx(1.4 / 1.3)  # the draft's only
    md = race.markdown({"4": out}, list(speed), {"vllm": "0", "machine": "m", "prompts": 6, "max_tokens": 64,
                                                 "repeats": 2, "date": "d"})  # fmt: skip
    assert "| gbt-gated-batch |" in md and "| 4 | 1.08x (1.08-1.08) | 0.93x (0.93-0.93) |" in md
    # a table's arm and the fixed arm of the K the table gives: what separates them is the race's server spread
    same = race.same_k_spread({"4": out}, {"table": [[1, 3, 3], [4, 65536, 1]]})
    assert same == [("vllm-dynamic-sd", "fixed-1", "4", pytest.approx(1.0))]
    assert race.same_k_spread({"4": out}, {"table": [[1, 65536, 0]]}) == []  # K = 0: no fixed arm to compare
    assert race.command_args(["--record", "--note", "a b", "--repeats", "1", "--note=c"]) == [
        "--record",
        "--repeats",
        "1",
    ]
    # the servers' order: as listed, then reversed, so every arm's mean position over two repetitions is the same
    arms = list(speed)
    assert race.arm_order(arms, 0) == arms and race.arm_order(arms, 3) == arms[::-1]
    pos = {a: race.arm_order(arms, 0).index(a) + race.arm_order(arms, 1).index(a) for a in arms}
    assert set(pos.values()) == {len(arms) - 1}


def test_the_vllm_race_serves_the_head_at_a_fixed_k_at_k_0_and_at_its_own_tuned_table(monkeypatch):
    from pathlib import Path

    from tests.conftest import load_benchmark

    race = load_benchmark("vllm_race.py")
    monkeypatch.chdir(Path(race.ROOT))  # the race names the head by its path in the repository
    tables = {"draft": [[1, 3, 1], [4, 65536, 0]], "head": [[1, 3, 2], [4, 65536, 0]]}
    fixed = race.spec_for("head-fixed-3", "costs.json", tables, "cpu")
    assert fixed == {"method": "eagle3", "model": race.HEAD, "num_speculative_tokens": 3}
    never = race.spec_for("head-fixed-0", "costs.json", tables, "cpu")  # the tuning sweep's K = 0, head loaded
    assert never["method"] == "eagle3" and never["num_speculative_tokens_per_batch_size"] == [[1, 65536, 0]]
    tuned = race.spec_for("head-dynamic-sd", "costs.json", tables, "cpu")
    assert tuned["num_speculative_tokens_per_batch_size"] == tables["head"]  # the head's table, not the draft's
    assert tuned["num_speculative_tokens"] == 2
    with pytest.raises(ValueError, match="head's Dynamic SD arm needs its tuned table"):
        race.spec_for("head-dynamic-sd", "costs.json", {"draft": tables["draft"]}, "cpu")
    assert set(race.VLLM_OWN) >= {"head-fixed-1", "head-dynamic-sd"}  # our policy is compared with the head's arms


def test_calibrating_inside_vllm_without_vllm_says_where_vllm_lives(tmp_path, capsys):
    import importlib.util

    from speckv_policy.cli.calibrate import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    out = tmp_path / "batch.json"
    assert main(["--engine", "vllm", "--out", str(out)]) == 2
    assert "bash .ci/setup-vllm" in capsys.readouterr().err and not out.exists()


def test_the_vllm_race_refuses_a_bad_cost_file_or_table_by_its_option_before_serving(tmp_path):
    from tests.conftest import load_benchmark

    race = load_benchmark("vllm_race.py")
    good = _batch_costs(tmp_path, drafting_ms=6.0)
    table = "[[1, 3, 2], [4, 65536, 0]]"
    assert race.read_inputs(good, table, None) == {"draft": [[1, 3, 2], [4, 65536, 0]], "head": None}
    assert race.read_inputs(None, None, table)["head"] == [[1, 3, 2], [4, 65536, 0]]
    bad_json = tmp_path / "not-costs.json"
    bad_json.write_text('{"format": "something else"}')
    for args, why in (
        ((str(tmp_path / "absent.json"), None, None), r"--costs: .*absent\.json"),
        ((str(bad_json), None, None), r"--costs: .*not-costs\.json"),
        ((None, "[[1, 3, 2]", None), r"--table '\[\[1, 3, 2\]'"),
        ((None, None, "[[2, 8, 1]]"), r"--head-table .*must start at batch size 1"),
        ((None, None, "5"), r"--head-table '5': a Dynamic SD schedule is a non-empty list"),
    ):
        with pytest.raises(ValueError, match=why):
            race.read_inputs(*args)


def test_the_vllm_races_prompts_are_the_records_held_out_prompts_and_never_training_ones():
    """``pick_prompts`` (shared by the race and benchmarks/vllm_proposer_time.py) picks what the race of record raced."""
    from tests.conftest import load_benchmark

    race = load_benchmark("vllm_race.py")

    class Template:  # stands in for the tokenizer's chat template: the prompt's own text
        def apply_chat_template(self, messages, **kwargs):
            return messages[0]["content"]

    texts, ids = race.pick_prompts(Template(), "heldout", 16)
    record = json.loads((race.ROOT / "benchmarks" / "runs" / "vllm_race.json").read_text())
    assert len(ids) == len(set(ids)) == 16 and len(texts) == 16
    assert set(ids) == {r["prompt"] for r in record["rows"]}
    _, train = race.pick_prompts(Template(), "train", 8)
    assert len(train) == 8 and not set(train) & set(ids)
