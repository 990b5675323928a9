"""Censoring, expected tokens, the cost model and the objectives, by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from speckv_policy.evaluation.synthetic import SYNTHETIC_COSTS
from speckv_policy.objective import (
    CostModel,
    analytic_expected_tokens,
    expected_tokens_from_survival,
    objective_values,
    realized_throughput,
    survival_observations,
    tokens_if,
)


def test_tokens_if_hand_cases():
    # drafted 4, accepted 2: any gamma knows its outcome (rejection at 3)
    assert tokens_if(np.arange(7), 2, 4).tolist() == [1, 2, 3, 3, 3, 3, 3]
    # drafted 4, all accepted: gammas beyond 4 are censored
    out = tokens_if(np.arange(7), 4, 4)
    assert out[:5].tolist() == [1, 2, 3, 4, 5]
    assert np.isnan(out[5:]).all()
    # drafted 0 (plain step), accepted 0
    assert tokens_if(0, 0, 0) == 1


def test_survival_observations_respect_censoring():
    events, risk = survival_observations(np.array([2, 4, 0]), np.array([4, 4, 2]), 6)
    # row 0: accepted 1,2; rejected at 3; 4..6 unobserved
    assert risk[0].tolist() == [True, True, True, False, False, False]
    assert events[0].tolist() == [1, 1, 0, 0, 0, 0]
    # row 1: gamma 4 fully accepted: says nothing about 5 and 6
    assert risk[1].tolist() == [True, True, True, True, False, False]
    assert events[1].tolist() == [1, 1, 1, 1, 0, 0]
    # row 2: rejected at 1
    assert risk[2].tolist() == [True, False, False, False, False, False]
    assert events[2].tolist() == [0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95, 1.0])
def test_expected_tokens_from_survival_matches_analytic(alpha):
    K = 10
    surv = np.array([[alpha**k for k in range(1, K + 1)]])
    cands = list(range(K + 1))
    got = expected_tokens_from_survival(surv, cands)[0]
    np.testing.assert_allclose(got, analytic_expected_tokens(alpha, np.array(cands)), rtol=1e-12)


def test_analytic_formula_hand_values():
    assert analytic_expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert analytic_expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert analytic_expected_tokens(0.0, 8) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "alpha,c,best",
    [
        (0.8, 0.05, 8),
        (0.8, 0.1, 6),
        (0.8, 0.2, 4),
        (0.8, 0.3, 3),
        (0.8, 0.5, 2),
        (0.9, 0.05, 13),
        (0.9, 0.1, 10),
        (0.9, 0.2, 7),
        (0.9, 0.3, 5),
        (0.9, 0.5, 3),
    ],
)
def test_best_gamma_reproduces_published_table(alpha, c, best):
    # Leviathan et al.: speed-up E / (gamma c + 1): our cost model with a flat verifier
    cm = CostModel.relative(draft_cost=c, verify_cost_per_token=0.0)
    cands = np.arange(0, 25)
    e = analytic_expected_tokens(alpha, cands)
    v = objective_values(e[None, :], cm.time_table(cands)[:1], "tokens_per_second", cm.unit)
    assert cands[np.argmax(v)] == best


def test_step_ms_hand_computed():
    cm = CostModel((5.0, 6.0, 7.0), (50.0, 60.0, 70.0), (2.0, 3.0, 4.0))
    assert cm.step_ms(0, 0) == pytest.approx(50.0)
    assert cm.step_ms(4, 1) == pytest.approx(4 * 6 + 60 + 4 * 3)
    upfront = CostModel((5.0,) * 3, (50.0,) * 3, (2.0,) * 3, decision_draft_tokens=1)
    assert upfront.step_ms(0, 0) == pytest.approx(55.0)  # first draft token already paid
    assert upfront.step_ms(3, 2) == pytest.approx(15 + 50 + 6)
    assert cm.time_table([0, 2]).shape == (3, 2)


def test_cost_model_fit_recovers_generating_costs(synthetic):
    cm = CostModel.fit(synthetic[0])
    np.testing.assert_allclose(cm.draft_ms_per_token, SYNTHETIC_COSTS.draft_ms_per_token, rtol=0.02)
    np.testing.assert_allclose(cm.verify_base_ms, SYNTHETIC_COSTS.verify_base_ms, rtol=0.03)
    np.testing.assert_allclose(cm.verify_ms_per_token, SYNTHETIC_COSTS.verify_ms_per_token, rtol=0.1)
    assert CostModel.from_dict(cm.to_dict()) == cm


def test_cost_model_fit_errors(synthetic):
    log = synthetic[0]
    constant = log[log["gamma"] == 8]
    with pytest.raises(ValueError, match="cannot fit the verify-cost slope"):
        CostModel.fit(constant)
    two = log.copy()
    two.loc[two.index[:10], "device"] = "cuda:0"
    with pytest.raises(ValueError, match="several devices"):
        CostModel.fit(two)
    with pytest.raises(ValueError, match="no rows for device 'tpu'"):
        CostModel.fit(log, device="tpu")


def test_cost_model_table_catches_a_cheap_single_token_step():
    """A CPU-like log: one-token forwards (gamma 0) cost 40 ms, any multi-token verify ~60 ms + 1/token."""
    import pandas as pd

    rng = np.random.default_rng(0)
    g = rng.integers(0, 9, size=900)
    verify = np.where(g == 0, 40.0, 60.0 + g) * rng.uniform(0.98, 1.02, size=g.size)
    draft = np.where(g > 0, 3.0 + 4.0 * g, 0.0)
    log = pd.DataFrame(
        {
            "device": "cpu",
            "compression": "fp32",
            "gamma": g,
            "draft_ms": draft,
            "verify_ms": verify,
            "step": np.arange(g.size) % 30 + 1,
        }
    )
    table = CostModel.fit(log)
    line = CostModel.fit(log, verify="line")
    assert table.step_ms(0, 0) == pytest.approx(40.0, rel=0.02)
    assert line.step_ms(0, 0) > 55.0  # a line through gamma >= 1 misses the cheap plain step
    assert table.step_ms(4, 0) == pytest.approx(3.0 + 16.0 + 64.0, rel=0.02)
    assert table.draft_base_ms[0] == pytest.approx(3.0, abs=1e-6) and table.draft_ms_per_token[0] == pytest.approx(4.0)
    again = CostModel.from_dict(json.loads(table.to_json()))
    assert again == table
    with pytest.raises(ValueError, match="'table' or 'line'"):
        CostModel.fit(log, verify="spline")


def test_cost_model_borrows_slope_and_missing_levels(synthetic):
    log = synthetic[0]
    fp16_varied = log[log["compression"] == "fp16"]
    int8_fixed = log[(log["compression"] == "int8") & (log["gamma"] == 8)]
    import pandas as pd

    cm = CostModel.fit(pd.concat([fp16_varied, int8_fixed]))
    # int8 verify at gamma 8 must still match its mean (first steps, which pay the prefill, left out)
    later = int8_fixed[int8_fixed["step"] > 0]
    assert cm.step_ms(8, 1) - 8 * cm.draft_ms_per_token[1] == pytest.approx(later["verify_ms"].mean(), rel=1e-6)
    assert cm.verify_table_ms[1][8] == pytest.approx(later["verify_ms"].mean(), rel=1e-9)
    # nf4 absent: borrows the nearest level (int8)
    assert cm.verify_base_ms[2] == cm.verify_base_ms[1]


def test_cost_model_rejects_bad_values():
    with pytest.raises(ValueError, match="needs 3 values"):
        CostModel((1.0,), (1.0,) * 3, (1.0,) * 3)
    with pytest.raises(ValueError, match="verify_base_ms must be finite, > 0"):
        CostModel((1.0,) * 3, (0.0,) * 3, (1.0,) * 3)


def test_cost_model_names_the_machine_that_measured_it(tmp_path):
    cm = CostModel((1.0,) * 3, (2.0,) * 3, (0.5,) * 3, device="cpu")
    assert "machine" not in cm.to_dict()  # unknown origin: files read as before the field existed
    named = replace(cm, machine="x86_64 Example CPU, 2 CPU threads")
    assert named == cm  # descriptive, not compared: the same times price the same
    path = tmp_path / "costs.json"
    named.save(path)
    assert CostModel.load(path).machine == "x86_64 Example CPU, 2 CPU threads"
    assert CostModel.load(cm.to_dict()).machine == ""
    with pytest.raises(ValueError, match="machine must be a string"):
        CostModel.load({**cm.to_dict(), "machine": 3})


def test_realized_throughput_hand_computed():
    cm = CostModel((10.0,) * 3, (100.0,) * 3, (0.0,) * 3)
    chosen = np.array([2, 4])
    acc = np.array([1, 4])
    drafted = np.array([8, 4])
    # tokens: min(1,2)+1 = 2; min(4,4)+1 = 5. time: 120 + 140 = 260 ms
    assert realized_throughput(chosen, acc, drafted, np.zeros(2, int), cm) == pytest.approx(1000 * 7 / 260)
    assert realized_throughput(chosen, acc, drafted, np.zeros(2, int), cm, "tokens_per_step") == 3.5
    # censored choice (6 > drafted 4, all accepted) credited only the known 5 tokens
    assert (
        realized_throughput(np.array([6]), np.array([4]), np.array([4]), np.zeros(1, int), cm, "tokens_per_step") == 5.0
    )


def test_tokens_per_second_refuses_free_drafting():
    # tokens-per-step always prefers the longest draft; tokens/s stops when drafting costs more
    cm = CostModel.relative(draft_cost=0.3, verify_cost_per_token=0.05)
    cands = np.arange(9)
    e = analytic_expected_tokens(0.5, cands)[None, :]
    per_step = objective_values(e, cm.time_table(cands)[:1], "tokens_per_step")
    per_sec = objective_values(e, cm.time_table(cands)[:1], "tokens_per_second", cm.unit)
    assert cands[np.argmax(per_step)] == 8
    assert cands[np.argmax(per_sec)] <= 2
