"""The cost-aware stop rule: its decisions, its file, its fit, and mode='stop' in the hook and the replay."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from speckv_policy.evaluation.dense import simulate
from speckv_policy.features import OnlineFeatureState
from speckv_policy.hf.live_costs import LiveCosts
from speckv_policy.objective import CostModel
from speckv_policy.runtime import PolicyFallbackWarning
from speckv_policy.stop import (
    GATE_FEATURES,
    STOP_FEATURES,
    AcceptanceCurve,
    StopRule,
    StopRuleError,
    gate_features,
    stop_features,
)
from speckv_policy.testing import tiny_llama_pair

from .conftest import teacher_forced_text

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


def _cost() -> CostModel:
    # draft 1 ms per call + 2 ms per token; verification 10 ms + 1 ms per draft token, every level
    return CostModel((2.0,) * 3, (10.0,) * 3, (1.0,) * 3, draft_base_ms=(1.0,) * 3)


def _const(p: float) -> AcceptanceCurve:
    """A curve that says ``p`` whatever the token."""
    return AcceptanceCurve(math.log(p / (1 - p)), (0.0,) * len(STOP_FEATURES))


def _rule(now: AcceptanceCurve, nxt: AcceptanceCurve | None = None, **kw) -> StopRule:
    pair = (now, nxt or now)
    return StopRule({("fp32", "greedy"): pair, ("fp32", "sampling"): pair}, _cost(), **kw)


def _run(state, confs):
    goes = []
    for c in confs:
        goes.append(state.after_token(c, 0.5))
        if not goes[-1]:
            break
    return goes


def test_sure_tokens_are_drafted_to_the_cap_and_hopeless_ones_dropped():
    # p = 0.999: every further token adds ~1 token worth 10 ms for 1 ms of verify + 2 ms of drafting
    st = _rule(_const(0.999)).begin("fp32", 0.0, 5, 0)
    assert _run(st, [0.9] * 9) == [True] * 4 + [False] and (st.kept, st.drafted) == (5, 5)
    # p = 0.01: the probe token is worth 0.1 ms against 10 -> 11 ms of verification: send nothing, stop
    st = _rule(_const(0.01)).begin("fp32", 0.0, 8, 0)
    assert _run(st, [0.9] * 9) == [False] and (st.kept, st.drafted) == (0, 1)


def test_the_rule_keeps_the_best_prefix_and_goes_on_only_while_a_longer_draft_pays():
    """By hand: V = 10 ms (a plain step) and verify(g) = 10 + g ms. Sending nothing is worth -10; a first token
    with p = 0.5 is worth 10 * 0.5 - 11 = -6, so it is kept. With p_next = 0.9, two tokens would be worth
    10 * (0.5 + 0.45) - 12 - 2 (drafting) = -4.5 > -6: go on. A second token with p = 0.9 is worth
    10 * 0.95 - 12 = -2.5: kept. With p_next = 0.2 every longer draft is worth less than -6: stop at one.
    A first token with p = 0.05 (-10.5) is dropped: a plain step after the probe."""
    table = {0.3: 0.5, 0.7: 0.9, 0.1: 0.05}

    class ByConfidence(AcceptanceCurve):
        def __call__(self, x):  # the token's confidence picks its chance
            return table[round(x[0], 1)]

    cur = ByConfidence(0.0, (0.0,) * 4)
    st = _rule(cur, _const(0.9)).begin("fp32", 0.0, 8, 0)
    assert st.after_token(0.3, 0.1) is True and st.kept == 1 and st.best == pytest.approx(-6.0)
    assert st.after_token(0.7, 0.1) is True and st.kept == 2 and st.best == pytest.approx(-2.5)
    st = _rule(cur, _const(0.2)).begin("fp32", 0.0, 8, 0)
    assert st.after_token(0.3, 0.1) is False and st.kept == 1
    st = _rule(cur, _const(0.2)).begin("fp32", 0.0, 8, 0)
    assert st.after_token(0.1, 0.1) is False and (st.kept, st.drafted) == (0, 1) and st.best == pytest.approx(-10.0)
    # the cap: never asks for a token past it
    st = _rule(cur, _const(0.9)).begin("fp32", 0.0, 1, 0)
    assert st.after_token(0.3, 0.1) is False and st.kept == 1


def test_a_cheaper_target_step_values_tokens_less_and_drafts_less():
    cheap = replace(_cost(), verify_base_ms=(3.0,) * 3)  # the same draft cost against a far cheaper plain step
    rule = _rule(_const(0.7))
    long = rule.begin("fp32", 0.0, 8, 0)
    short = rule.reprice(cheap).begin("fp32", 0.0, 8, 0)
    assert len(_run(long, [0.5] * 8)) > len(_run(short, [0.5] * 8))
    assert rule.reprice(cheap).cost_model == cheap and rule.cost_model == _cost()


def test_curves_by_compression_code_and_decoding():
    rule = _rule(_const(0.6))
    assert rule.curves_for("fp16", 0.0) == rule.curves[("fp32", "greedy")]  # fp16 / bf16 share code 0's curves
    assert rule.curves_for("fp32", 0.7) == rule.curves[("fp32", "sampling")]
    with pytest.raises(KeyError, match="no curves for int8/greedy"):
        rule.begin("int8", 0.0, 4, 0)


def test_the_file_round_trips_and_bad_files_get_errors_naming_file_and_key(tmp_path):
    rule = _rule(AcceptanceCurve(-1.0, (2.0, -0.1, -0.3, 0.4), rows=12), _const(0.8), token_value=1.2)
    path = tmp_path / "stop.json"
    rule.save(path)
    assert StopRule.load(path) == rule and StopRule.load(rule) is rule
    good = json.loads(path.read_text())

    def bad(edit, match):
        d = json.loads(json.dumps(good))
        edit(d)
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(d))
        with pytest.raises(StopRuleError, match=match) as err:
            StopRule.load(p)
        assert str(p) in str(err.value)

    bad(lambda d: d.update(format="speckv-policy"), "'format'")
    bad(lambda d: d.update(version=3), "up to 2")
    bad(lambda d: d.update(features=list(reversed(STOP_FEATURES))), "in that order")
    bad(
        lambda d: d["curves"]["fp32/greedy"]["now"].update(coef=[1.0, "x", 0, 0]),
        r"curves\['fp32/greedy'\].*not a number",
    )
    bad(lambda d: d["curves"]["fp32/greedy"]["now"].update(coef=[1.0]), r"curves\['fp32/greedy'\].*coef needs 4")
    bad(lambda d: d["curves"].update({"fp8/greedy": d["curves"]["fp32/greedy"]}), "fp8/greedy")
    bad(lambda d: d["cost_model"].pop("verify_base_ms"), "'cost_model'.*missing fields verify_base_ms")
    bad(lambda d: d.update(token_value=-1), "token_value")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(StopRuleError, match="not a JSON stop rule"):
        StopRule.load(tmp_path / "text.json")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        StopRule.load(tmp_path / "nope.json")


def _gate(intercept: float, **coef: float) -> AcceptanceCurve:
    """A gate whose logit is ``intercept + sum(coef[name] * feature[name])``."""
    return AcceptanceCurve(intercept, tuple(coef.get(n, 0.0) for n in GATE_FEATURES), features=GATE_FEATURES)


def test_the_gate_reads_the_pre_draft_history_and_closes_by_hand():
    state = OnlineFeatureState("fp32")
    state.update(drafted=4, accepted=1)
    pre = state.pre_values(context_len=19, match_len=3)
    assert gate_features(pre) == pytest.approx([0.5, (1 + 1) / (1 + 1 + 2), 1.0, 4.0, 0.0, math.log(20), math.log(4)])
    # open iff the last drafting step kept at least one token (logit -0.5 + 1.0 * prev_accepted); greedy only
    rule = replace(_rule(_const(0.5)), gates={("fp32", "greedy"): _gate(-0.5, prev_accepted=1.0)})
    assert rule.opens("fp32", 0.0, pre) is True and rule.opens("bf16", 0.0, pre) is True  # code 0 shares it
    state.update(drafted=3, accepted=0)
    closed = state.pre_values(context_len=23, match_len=0)
    assert rule.opens("fp32", 0.0, closed) is False
    assert rule.opens("fp32", 0.7, closed) is True  # no sampling gate: always drafts
    assert _rule(_const(0.5)).opens("fp32", 0.0, closed) is True  # no gate at all
    with pytest.raises(KeyError, match="unknown compression 'fp8'"):
        rule.opens("fp8", 0.0, pre)
    with pytest.raises(ValueError, match="a gate reads"):
        replace(rule, gates={("fp32", "greedy"): _const(0.5)})
    with pytest.raises(ValueError, match="gate key fp8/greedy"):
        replace(rule, gates={("fp8", "greedy"): _gate(0.0)})


def test_a_gated_rule_round_trips_and_a_version_1_file_still_loads(tmp_path):
    rule = replace(_rule(_const(0.6)), gates={("fp32", "sampling"): _gate(0.3, ema_accept_rate=-2.0)})
    path = tmp_path / "gated.json"
    rule.save(path)
    assert StopRule.load(path) == rule
    d = json.loads(path.read_text())
    assert d["version"] == 2 and d["gate_features"] == list(GATE_FEATURES)
    d1 = {k: v for k, v in _rule(_const(0.6)).to_dict().items() if k not in ("gates", "gate_features")}
    d1["version"] = 1  # what speckv-policy wrote before gates
    assert StopRule.from_dict(d1) == _rule(_const(0.6))
    for edit, match in (
        (lambda d: d["gates"]["fp32/sampling"].update(coef=[1.0]), r"gates\['fp32/sampling'\].*coef needs 7"),
        (lambda d: d.update(gate_features=list(reversed(GATE_FEATURES))), "'gate_features'.*in that order"),
        (lambda d: d["gates"]["fp32/sampling"].update(rows=1.5), "'rows' must be an integer"),
        (lambda d: d.pop("gates"), "'gates' must be a JSON object"),
    ):
        bad = json.loads(json.dumps(d))
        edit(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(StopRuleError, match=match):
            StopRule.load(tmp_path / "bad.json")


def _markov_log(n_runs: int, seed: int):
    """SYNTHETIC step log with a known law: of a step's 4 draft tokens the first 3 are accepted when the run is
    'easy' and none when it is 'hard'; a run stays in its regime from step to step with probability 0.9, so the
    last step's outcome (prev_fully_accepted) is what tells drafting pays. The draft's confidence says nothing."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for run in range(n_runs):
        easy = bool(rng.random() < 0.5)
        for step in range(30):
            easy = easy if rng.random() < 0.9 else not easy
            rows.append(
                dict(
                    run_id="synthetic",
                    prompt_id=f"p{run}",
                    split="train",
                    task_type="chat",
                    compression="fp32",
                    decoding="greedy",
                    temperature=0.0,
                    step=step,
                    context_len=20 + 5 * step,
                    gamma=4,
                    accepted=3 if easy else 0,
                    draft_confidence=rng.uniform(0.3, 0.9, 4),
                    draft_entropy=rng.uniform(0.1, 2.0, 4),
                    context_match_len=float(rng.integers(0, 3)),
                )
            )
    return pd.DataFrame(rows)


def test_the_gate_is_fitted_on_what_the_rules_step_gains_and_learns_a_known_law():
    import pandas as pd

    from speckv_policy.training import fit_stop_rule, stop_gate_rows

    log = _markov_log(120, seed=1)
    # gains by hand: a rule sure of every token drafts and sends all 4; V = verify(0) = 10 ms, verify(4) = 14 ms,
    # drafting 1 + 4 * 2 = 9 ms: an easy step keeps 3 tokens, 10 * 3 + 10 - 14 - 9 = 17 ms; a hard one -13 ms
    sure = _rule(_const(0.999))
    X, gain = stop_gate_rows(log, sure)[("fp32", "greedy")]
    assert len(gain) == len(log) and set(np.round(gain, 9).tolist()) == {17.0, -13.0}
    assert (gain == 17.0).sum() == (log["accepted"] == 3).sum() > 100
    rule = fit_stop_rule(log, _cost(), gate=True, source="synthetic")
    assert list(rule.gates) == [("fp32", "greedy")] and rule.trained_on["gate_steps"] == {"fp32/greedy": len(log)}
    state = OnlineFeatureState("fp32")
    state.update(drafted=4, accepted=3)
    assert rule.opens("fp32", 0.0, state.pre_values(100, 1)) is True
    state.update(drafted=4, accepted=0)
    assert rule.opens("fp32", 0.0, state.pre_values(100, 1)) is False
    assert fit_stop_rule(log, _cost()).gates == {}  # off by default
    # a level whose tokens are never accepted gets no curves, so no gate, and its steps are left out of the rows
    never = log.assign(compression="int8", accepted=0, prompt_id=log["prompt_id"] + "-int8")
    both = pd.concat([log, never], ignore_index=True)
    rule2 = fit_stop_rule(both, _cost(), gate=True)
    assert set(rule2.curves) == set(rule2.gates) == {("fp32", "greedy")}
    assert set(stop_gate_rows(both, rule2)) == {("fp32", "greedy")}


def test_fit_on_a_log_with_a_known_acceptance_process():
    """SYNTHETIC per-token log: token i is accepted with probability sigmoid(-3 + 6 * confidence) given its
    predecessors were; the fitted 'now' curve must recover that law."""
    import pandas as pd

    from speckv_policy.training import fit_stop_rule, stop_rule_rows

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(3000):
        conf = rng.uniform(0.05, 0.99, 8)
        p = 1 / (1 + np.exp(3 - 6 * conf))
        ok = rng.random(8) < p
        acc = int(np.argmin(ok)) if not ok.all() else 8
        rows.append(
            dict(
                split="train",
                compression="int8",
                decoding="greedy",
                gamma=8,
                accepted=acc,
                draft_confidence=conf,
                draft_entropy=rng.uniform(0, 2, 8),
                context_match_len=float(rng.integers(0, 5)),
            )
        )
    log = pd.DataFrame(rows)
    rule = fit_stop_rule(log, _cost(), source="synthetic")
    now, _ = rule.curves[("int8", "greedy")]
    for c in (0.2, 0.5, 0.9):
        assert now(stop_features(c, 1.0, 2)) == pytest.approx(1 / (1 + math.exp(3 - 6 * c)), abs=0.05)
    assert rule.trained_on["log"] == "synthetic" and list(rule.curves) == [("int8", "greedy")]
    xn, yn, xx, yx = stop_rule_rows(log)[("int8", "greedy")]
    assert len(yn) == sum(min(a + 1, 8) for a in log["accepted"]) and len(yx) == sum(min(a, 7) for a in log["accepted"])
    with pytest.raises(ValueError, match="missing: context_match_len"):
        fit_stop_rule(log.drop(columns="context_match_len"), _cost())
    with pytest.raises(ValueError, match="gate trains on a step log's history.*missing: run_id, prompt_id, step"):
        fit_stop_rule(log, _cost(), gate=True)  # a gate needs each run's steps in order
    short = log.copy()
    short["draft_confidence"] = [np.array([0.5]) if i == 3 else c for i, c in enumerate(short["draft_confidence"])]
    with pytest.raises(ValueError, match="row 3: 1 draft_confidence"):
        fit_stop_rule(short, _cost())


@pytest.fixture(scope="module")
def pair():
    return tiny_llama_pair(seed=5, noise=0.05)


def _varied_rule(seed: int) -> StopRule:
    rng = np.random.default_rng(seed)
    curve = AcceptanceCurve(float(rng.uniform(-3, 3)), tuple(float(v) for v in rng.normal(0, 3, 4)))
    rule = _rule(curve, AcceptanceCurve(float(rng.uniform(-2, 4)), tuple(float(v) for v in rng.normal(0, 2, 4))))
    if seed % 2:  # odd seeds: a random pre-draft gate too
        gate = AcceptanceCurve(
            float(rng.uniform(-1, 1)),
            tuple(float(v) for v in rng.normal(0, 1, len(GATE_FEATURES))),
            features=GATE_FEATURES,
        )
        rule = replace(rule, gates={("fp32", "greedy"): gate})
    return rule


@pytest.mark.parametrize("seed", range(6))
def test_greedy_output_is_the_targets_in_stop_mode(pair, seed):
    from speckv_policy.hf import attach

    target, draft = pair
    rng = np.random.default_rng(100 + seed)
    for _ in range(3):
        ids = torch.tensor([rng.integers(1, 63, int(rng.integers(1, 10))).tolist()])
        n = int(rng.integers(1, 40))
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        with attach(target, _varied_rule(seed), compression="fp32", mode="stop") as h:
            out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref)
        assert sum(s.accepted + 1 for s in h.stats) == out.shape[1] - ids.shape[1]
        assert all(s.gamma <= s.drafted for s in h.stats) and h.summary()["fallbacks"] == 0


def test_stop_mode_takes_the_replays_steps_on_a_tiny_pair(pair):
    """Greedy generation through the hook in stop mode against dense.simulate on the target's text, the draft's
    teacher-forced pass and its branches after each wrong token: the same steps, the last included."""
    from speckv_policy.hf import attach

    target, draft = pair
    ids = torch.tensor([[1, 7, 3, 9, 4, 7, 3]])
    n = 28
    rule = _rule(AcceptanceCurve(-3.0, (4.0, -0.2, -0.3, 0.5)), AcceptanceCurve(-1.0, (3.0, 0.0, 0.0, 0.5)))
    # gated: draft only where the context's tail repeats (logit -0.5 + log(1 + m): open from m = 1 on)
    gated = replace(rule, gates={("fp32", "greedy"): _gate(-0.5, log1p_context_match_len=1.0)})
    text, ref = teacher_forced_text(target, draft, ids, n)
    for r in (rule, gated):
        with torch.inference_mode(), attach(target, r, mode="stop", compression="fp32") as h:
            out = target.generate(ids, max_new_tokens=n, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref)
        res = simulate([text], "stop", r, compression="fp32", cost=_cost())
        hook = [(s.gamma, s.accepted) for s in h.stats][1:]  # the first step is the prefill, left out
        assert list(zip(res.gammas.tolist(), res.accepted.tolist())) == hook
        assert any(g > 1 for g, _ in hook)
        dropped = [s for s in h.stats if s.gamma == 0 and s.drafted == 1]  # the probe token, drafted and dropped
        closed = [s for s in h.stats if s.drafted == 0 and s.context_len < ids.shape[1] + n - 1]
        assert len(dropped) > 0 if r is rule else len(closed) > 0  # a closed gate: a plain step, nothing drafted
        assert all(s.context_match_len < 1 for s in closed) and (r is gated or not closed)
    with pytest.raises(ValueError, match="needs a StopRule"):
        simulate([text], "stop", lambda f: 2, compression="fp32", cost=_cost())


def test_a_broken_or_missing_rule_falls_back_with_one_warning(pair, tmp_path):
    from speckv_policy.hf import attach

    target, draft = pair
    ids = torch.tensor([[5, 6, 7]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    (tmp_path / "broken.json").write_text("{")
    int8_only = StopRule({("int8", "greedy"): (_const(0.5), _const(0.5))}, _cost())
    for policy in (str(tmp_path / "missing.json"), str(tmp_path / "broken.json"), int8_only):
        with pytest.warns(PolicyFallbackWarning) as rec:
            with attach(target, policy, compression="fp32", mode="stop", settings={"fallback_gamma": 2}) as h:
                out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref)
        assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
        drafting = [s for s in h.stats if s.drafted > 0]  # a step with no room left to draft asks nothing
        assert h.summary()["fallbacks"] == len(drafting) and all(s.fallback for s in drafting)
        assert all(s.gamma == s.drafted <= 2 for s in drafting) and sum(s.gamma == 2 for s in drafting) > 5


def test_a_gate_that_fails_drafts_and_warns_once(pair):
    from speckv_policy.hf import attach

    class Broken(AcceptanceCurve):
        def __call__(self, x):
            raise FloatingPointError("gate blew up")

    target, draft = pair
    ids = torch.tensor([[5, 6, 7]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    gate = Broken(0.0, (0.0,) * len(GATE_FEATURES), features=GATE_FEATURES)
    rule = replace(_rule(_const(0.9)), gates={("fp32", "greedy"): gate})
    with pytest.warns(PolicyFallbackWarning, match="gate blew up") as rec:
        with attach(target, rule, compression="fp32", mode="stop") as h:
            out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref) and len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    drafting = [s for s in h.stats if s.drafted > 0]
    assert drafting and all(s.fallback for s in drafting) and h.summary()["fallbacks"] == len(drafting)


def test_stop_mode_reprices_and_says_what_it_cannot_take(pair, tmp_path):
    from speckv_policy.hf import attach

    target, draft = pair
    costs = tmp_path / "costs.json"
    cheap = replace(_cost(), verify_base_ms=(3.0,) * 3)
    cheap.save(costs)
    ids = torch.tensor([[1, 7, 3, 9]])
    drafted = {}
    for name, kw in (("own", {}), ("cheap", {"costs": str(costs)})):
        with attach(target, _rule(_const(0.7)), compression="fp32", mode="stop", **kw) as h:
            target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
        drafted[name] = np.mean([s.drafted for s in h.stats])
    assert drafted["cheap"] < drafted["own"]
    # a cost file that is missing (or bad) falls back like a bad rule file: one warning naming it, output unchanged
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    for bad in (LiveCosts(prior=tmp_path / "no.json"), str(tmp_path / "none.json")):
        with pytest.warns(PolicyFallbackWarning, match="cost model file not found") as rec:
            with attach(target, _rule(_const(0.7)), compression="fp32", mode="stop", costs=bad) as h:
                out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref) and len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
        assert h.summary()["fallbacks"] > 0 and all(st.fallback for st in h.stats if st.drafted > 0)
    with pytest.raises(TypeError, match="needs a StopRule"):
        attach(target, lambda f: 2, compression="fp32", mode="stop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a good rule warns about nothing
        with attach(target, _rule(_const(0.7)), compression="fp32", mode="stop"):
            target.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=draft)


def test_live_stop_prices_start_at_the_prior_and_follow_the_machine():
    """No observation: the rule's own prices. Drafting observed 3x the prior's time at every count: the per-token price
    is 3x (the prior rescaled, shrinkage and all); verification observed as priced: unchanged."""
    cost = _cost()
    live = LiveCosts()
    with pytest.raises(RuntimeError, match="start"):
        live.stop_prices(8)
    live.start(cost, 0)
    verify, per_token = live.stop_prices(8)
    assert verify == pytest.approx(cost.verify_ms(list(range(9)), 0).tolist()) and per_token == pytest.approx(2.0)
    for _ in range(10):
        for k in range(1, 9):
            live.observe(k, 3 * float(cost.draft_ms(k, 0)), k, float(cost.verify_ms(k, 0)))
    verify, per_token = live.stop_prices(8)
    assert per_token == pytest.approx(6.0) and verify == pytest.approx(cost.verify_ms(list(range(9)), 0).tolist())
    assert live.stop_prices(1) == (pytest.approx(verify[:2]), 2.0)  # one token: no second one to price
    with pytest.raises(ValueError, match="max_gamma must be >= 1"):
        live.stop_prices(0)
    rule = _rule(_const(0.7))
    own = rule.begin("fp32", 0.0, 8, 0)
    given = rule.begin("fp32", 0.0, 8, 0, (rule.cost_model.verify_ms(list(range(9)), 0).tolist(), 2.0))
    assert _run(own, [0.5] * 8) == _run(given, [0.5] * 8) and own.kept == given.kept
    dear = rule.begin("fp32", 0.0, 8, 0, (verify, 6.0))  # drafting 3x dearer: drafts fewer tokens
    assert sum(_run(dear, [0.5] * 8)) < sum(_run(rule.begin("fp32", 0.0, 8, 0), [0.5] * 8))
    for bad in (([1.0] * 5, 2.0), ([1.0] * 9, float("nan")), ([1.0] * 8 + [-1.0], 2.0)):
        with pytest.raises(ValueError, match="prices need 9 finite verification times"):
            rule.begin("fp32", 0.0, 8, 0, bad)


def test_stop_mode_with_live_costs_is_lossless_and_reprices_every_step(pair):
    from speckv_policy.hf import attach

    target, draft = pair
    ids = torch.tensor([[1, 7, 3, 9]])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)

    class Recorded(LiveCosts):  # the clock injected: every step "took" the same recorded times, not the machine's
        def observe(self, drafted, draft_ms, verified, verify_ms):
            super().observe(drafted, 0.1 * drafted, verified, 0.5 + 0.05 * verified)

    with attach(target, _rule(_const(0.7)), compression="fp32", mode="stop", costs=Recorded()) as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    live = h.live_costs
    assert isinstance(live, Recorded) and live.observations == len(h.stats) - 1  # not the prefill step
    # steps recorded at ~a millisecond, not the prior's 10+: the live prices moved far from the rule's own
    verify, per_token = live.stop_prices(8)
    assert verify[0] < 0.5 * float(_cost().verify_ms(0, 0)) and per_token < float(_cost().draft_ms(1, 0))
    with attach(target, _rule(_const(0.7)), compression="fp32", mode="stop", costs="live") as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref) and h.live_costs.observations == len(h.stats) - 1  # real clock: lossless, no figure

    class Failing(LiveCosts):
        def observe(self, *a):
            raise ArithmeticError("clock broke")

    with pytest.warns(PolicyFallbackWarning, match="clock broke") as rec:
        with attach(target, _rule(_const(0.7)), compression="fp32", mode="stop", costs=Failing()) as h:
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref) and len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    assert h.summary()["fallbacks"] == 0
