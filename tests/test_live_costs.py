"""LiveCosts: running step-cost estimates start at the prior, follow medians, ignore outliers, extrapolate unseen counts."""

from __future__ import annotations

import numpy as np
import pytest

from speckv_policy.hf.live_costs import LiveCosts
from speckv_policy.objective import CostModel

PRIOR = CostModel.relative(draft_cost=0.1, verify_cost_per_token=0.05, decision_draft_tokens=1)
CANDS = np.arange(9)


def test_starts_at_the_prior_and_needs_start():
    live = LiveCosts()
    with pytest.raises(RuntimeError, match="start"):
        live.step_ms(CANDS)
    live.start(PRIOR, 2)
    np.testing.assert_allclose(live.step_ms(CANDS), PRIOR.time_table(CANDS)[2])
    np.testing.assert_allclose(live.table(CANDS), PRIOR.time_table(CANDS))


def test_follows_the_median_and_shrinks_to_the_rescaled_prior():
    live = LiveCosts(window=16, prior_weight=4)
    live.start(PRIOR, 0)
    v1, v2 = float(PRIOR.verify_ms(1, 0)), float(PRIOR.verify_ms(2, 0))
    for _ in range(16):  # verification observed at 2x the prior for 1 token and 4x for 2 tokens
        live.observe(drafted=1, draft_ms=float(PRIOR.draft_ms(1, 0)), verified=1, verify_ms=2 * v1)
        live.observe(drafted=2, draft_ms=float(PRIOR.draft_ms(2, 0)), verified=2, verify_ms=4 * v2)
    g2 = live.step_ms(CANDS)[2]
    # 16 observations of 4 v2 against 4 pseudo-observations of the prior rescaled by the median ratio (3)
    assert g2 == pytest.approx(float(PRIOR.draft_ms(2, 0)) + (16 * 4 * v2 + 4 * 3 * v2) / 20)
    live.observe(drafted=2, draft_ms=float(PRIOR.draft_ms(2, 0)), verified=2, verify_ms=500.0)
    assert live.step_ms(CANDS)[2] == pytest.approx(g2)  # one outlier does not move the median
    assert live.observations == 33


def test_unseen_counts_scale_with_what_was_seen():
    live = LiveCosts(prior_weight=0)
    live.start(PRIOR, 1)
    for g in (1, 2):  # every verification observed at 3x the prior, drafting at 2x
        live.observe(
            drafted=g, draft_ms=2 * float(PRIOR.draft_ms(g, 1)), verified=g, verify_ms=3 * float(PRIOR.verify_ms(g, 1))
        )
    est = live.step_ms(CANDS)
    for g in (5, 8):  # never seen: the prior, scaled by the observed ratios
        assert est[g] == pytest.approx(2 * float(PRIOR.draft_ms(g, 1)) + 3 * float(PRIOR.verify_ms(g, 1)))
    # gamma 0 pays the probe (decision_draft_tokens=1): one draft token, verify of gamma 0
    assert est[0] == pytest.approx(2 * float(PRIOR.draft_ms(1, 1)) + 3 * float(PRIOR.verify_ms(0, 1)))
    # other compression levels keep the prior's prices
    np.testing.assert_allclose(live.table(CANDS)[[0, 2]], PRIOR.time_table(CANDS)[[0, 2]])


def test_bad_settings_and_prior_file(tmp_path):
    with pytest.raises(ValueError, match="window"):
        LiveCosts(window=0)
    with pytest.raises(ValueError, match="prior_weight"):
        LiveCosts(prior_weight=-1)
    PRIOR.save(tmp_path / "c.json")
    live = LiveCosts(prior=tmp_path / "c.json")
    live.start(CostModel.relative(), 0)  # a given prior wins over the export's
    assert live.prior == PRIOR
