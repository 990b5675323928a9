"""One feature module for run time (numpy/torch) and for logs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv_policy.features import (
    OnlineFeatureState,
    as_feature_matrix,
    draft_token_confidence_one,
    draft_token_stats,
    draft_token_stats_from_logits,
    draft_token_stats_one,
    features_from_log,
    paper_features,
)
from speckv_policy.schema import ONLINE, PAPER, compression_code, get_feature_set


def test_token_stats_hand_values():
    conf, ent = draft_token_stats(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    np.testing.assert_allclose(conf, [0.5, 1.0])
    np.testing.assert_allclose(ent, [math.log(2), 0.0], atol=1e-12)


def test_token_stats_torch_equals_numpy_and_logits():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)) * 3
    logits[0, :10] = -np.inf  # top-k filtered tokens
    logits[1, 1:] = -np.inf  # top-k = 1: certain, entropy 0
    logits[2, :25] -= 1e5  # tokens far below the floor the torch path clamps differences at
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    c_np, h_np = draft_token_stats(p)
    c_t, h_t = draft_token_stats(torch.tensor(p))
    c_l, h_l = draft_token_stats_from_logits(torch.tensor(logits))
    c_ln, h_ln = draft_token_stats_from_logits(logits)
    for c, h in ((c_t.numpy(), h_t.numpy()), (c_l.numpy(), h_l.numpy()), (c_ln, h_ln)):
        np.testing.assert_allclose(c, c_np, rtol=1e-5)
        np.testing.assert_allclose(h, h_np, rtol=1e-5, atol=1e-6)
    assert c_l[1] == 1.0 and h_l[1] == 0.0
    for row in range(4):  # one distribution (the per-token path, a dot product) as each row of a batch
        c1, h1 = draft_token_stats_from_logits(torch.tensor(logits[row]))
        assert c1.dim() == 0 and float(c1) == pytest.approx(c_np[row], rel=1e-5)
        assert float(h1) == pytest.approx(h_np[row], rel=1e-5, abs=1e-6)
    c_half, h_half = draft_token_stats_from_logits(torch.tensor(logits).half())  # fp16 logits are upcast first
    assert np.isfinite(c_half.numpy()).all() and np.isfinite(h_half.numpy()).all()


def test_token_stats_one_is_the_batch_row_and_leaves_the_scores_alone():
    """The hook's per-draft-token statistics (numpy on a copy) equal the logged batch rows bit for bit, handle removed
    tokens, never write to the caller's scores, and read bf16 / fp16 scores."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(5, 300)) * 4).astype(np.float32)
    logits[0, :40] = -np.inf  # top-k filtered
    logits[1, 1:] = -np.inf  # one token left: certain
    logits[2, :100] -= 1e5  # far below exp's float32 underflow
    logits[3, :] = 7.0  # uniform: every token the top one
    t = torch.tensor(logits)
    before = t.clone()
    c, h = draft_token_stats_from_logits(t)
    for row in range(5):
        c1, h1 = draft_token_stats_one(t[row])
        assert isinstance(c1, float) and isinstance(h1, float)
        assert (c1, h1) == (float(c[row]), float(h[row]))
        assert (c1, h1) == draft_token_stats_one(logits[row])  # numpy scores: the same numbers
    assert torch.equal(t, before)  # float32 scores are copied before the in-place work
    p = torch.softmax(t.double(), -1)
    c_ref, h_ref = draft_token_stats(p)
    np.testing.assert_allclose(c.numpy(), c_ref.numpy(), rtol=1e-6)
    np.testing.assert_allclose(h.numpy(), h_ref.numpy(), rtol=1e-5, atol=1e-6)
    assert draft_token_stats_one(t[1]) == (1.0, 0.0)
    assert draft_token_stats_one(t[3]) == pytest.approx((1 / 300, math.log(300)), rel=1e-6)
    for low in (t.bfloat16(), t.half()):
        c_low, h_low = draft_token_stats_one(low[4])
        ref = draft_token_stats(torch.softmax(low[4].double(), -1))
        assert c_low == pytest.approx(float(ref[0]), rel=1e-5) and h_low == pytest.approx(float(ref[1]), rel=1e-5)


def test_online_state_hand_computed():
    s = OnlineFeatureState("int8", temperature=0.7)
    f0 = s.features(0.9, 0.3, context_len=9)
    np.testing.assert_allclose(f0, [0.9, 0.3, 1, 0.5, 0.5, math.log(10), 0.7], rtol=1e-6)
    s.update(drafted=4, accepted=2)  # 2 accepts, 1 rejection
    assert s.prev_rate == pytest.approx(2 / 3)
    assert s.ema_rate == pytest.approx((2 + 1) / (3 + 2))
    s.update(drafted=0, accepted=0)  # plain step: no information
    assert s.prev_rate == pytest.approx(2 / 3)
    s.update(drafted=3, accepted=3)  # all accepted: no rejection
    assert s.prev_rate == 1.0
    acc, rej = 0.8 * 2 + 3, 0.8 * 1
    assert s.ema_rate == pytest.approx((acc + 1) / (acc + rej + 2))
    with pytest.raises(ValueError, match="accepted must be in"):
        s.update(2, 3)
    with pytest.raises(ValueError, match="unknown compression 'int4'"):
        OnlineFeatureState("int4")


def test_paper_features_hand_computed():
    f = paper_features([0.9, 0.5], [math.log(2), 2 * math.log(2)], "nf4")
    np.testing.assert_allclose(f, [1.5, 0.7, 2.0, 0.5, 2], rtol=1e-6)


def test_features_from_log_replays_the_runtime_state(synthetic):
    log, _ = synthetic
    X, acc, drafted = features_from_log(log, "online")
    assert list(X.columns) == list(ONLINE.names)
    # replay one sequence by hand with the runtime class
    seq = log[(log.run_id == log.run_id.iloc[0]) & (log.prompt_id == log.prompt_id.iloc[0])].sort_values("step")
    temp = float(seq.temperature.iloc[0]) if seq.decoding.iloc[0] == "sampling" else 0.0
    state = OnlineFeatureState(seq.compression.iloc[0], temp)
    for idx, r in seq.iterrows():
        if r.gamma > 0:
            np.testing.assert_array_equal(
                X.loc[idx].to_numpy(np.float32),
                state.features(r.draft_confidence[0], r.draft_entropy[0], r.context_len),
            )
        state.update(r.gamma, r.accepted)
    assert (acc <= drafted).all() and len(X) == int((log.gamma > 0).sum())
    Xp, _, _ = features_from_log(log, "paper")
    assert list(Xp.columns) == list(PAPER.names)


def test_as_feature_matrix_errors():
    with pytest.raises(ValueError, match="missing features for set 'online': temperature"):
        as_feature_matrix({n: 0.0 for n in ONLINE.names if n != "temperature"}, "online")
    with pytest.raises(ValueError, match=r"expects \(n, 7\)"):
        as_feature_matrix(np.zeros(5), ONLINE)
    with pytest.raises(ValueError, match="unknown feature set 'foo'"):
        get_feature_set("foo")
    assert compression_code("bf16") == 0 and compression_code("nf4") == 2


@settings(max_examples=300, deadline=None)
@given(
    scores=st.lists(
        st.one_of(
            st.floats(-60.0, 60.0, width=32),
            st.floats(-1e6, -150.0, width=32),  # near and far below the entropy's clamp
            st.just(-np.inf),  # removed by top-k / top-p
        ),
        min_size=1,
        max_size=64,
    ).filter(lambda v: max(v) > -np.inf)
)
def test_the_confidence_alone_is_the_statistics_first_value_bit_for_bit(scores):
    """What the hook computes for a policy that reads no entropy is the number the full statistics give."""
    torch = pytest.importorskip("torch")
    x = np.asarray(scores, dtype=np.float32)
    conf = draft_token_confidence_one(x)
    assert isinstance(conf, float) and conf == draft_token_stats_one(x)[0]
    t = torch.tensor(x)
    assert draft_token_confidence_one(t) == draft_token_stats_one(t)[0] == conf
    assert torch.equal(t, torch.tensor(x))  # only read
    low = t.bfloat16()
    assert draft_token_confidence_one(low) == draft_token_stats_one(low)[0]
