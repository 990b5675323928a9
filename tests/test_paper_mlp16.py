"""The published MLP16 baseline: decision rule and the released npz format."""

from __future__ import annotations

import numpy as np
import pytest

from speckv_policy.policies import PaperMLP16Policy
from speckv_policy.schema import PAPER


def test_decision_is_argmax_rate_times_gamma_plus_one(fitted, heldout):
    p = fitted["paper-mlp16"]
    X, _ = heldout["paper"]
    rates = p.acceptance_rates(X)
    assert ((rates >= 0) & (rates <= 1)).all()
    expected = p.candidates_[np.argmax(rates * np.array([2, 4, 6, 8]) + 1, axis=1)]
    np.testing.assert_array_equal(p.predict(X), expected)
    assert p.coefs_[0].shape == (6, 16) and p.coefs_[1].shape == (16, 1)


def test_npz_round_trip(fitted, heldout, tmp_path):
    p = fitted["paper-mlp16"]
    path = tmp_path / "mlp16.npz"
    p.to_npz(path)
    loaded = PaperMLP16Policy.from_npz(path)
    X, _ = heldout["paper"]
    np.testing.assert_array_equal(loaded.predict(X), p.predict(X))


def test_npz_with_hand_weights(tmp_path):
    # rate = relu(mean_confidence - 0.1 * gamma): confident drafts favour long gammas
    W1 = np.zeros((6, 16))
    W1[1, 0], W1[5, 0] = 1.0, -0.1
    W2 = np.zeros((16, 1))
    W2[0, 0] = 1.0
    np.savez(tmp_path / "w.npz", W1=W1, b1=np.zeros(16), W2=W2, b2=np.zeros(1))
    p = PaperMLP16Policy.from_npz(tmp_path / "w.npz")
    x = np.array([[0.0, 0.95, 0.0, 0.9, 0.0], [0.0, 0.45, 0.0, 0.4, 0.0]])
    # row 0: rates .75 .55 .35 .15 -> E 2.5 3.2 3.1 2.2 -> gamma 4; row 1: rates .25 .05 0 0 -> E 1.5 1.2 1 1 -> 2
    assert p.predict(x).tolist() == [4, 2]
    assert list(p.feature_names_) == list(PAPER.names)


def test_npz_shape_errors(tmp_path):
    np.savez(tmp_path / "bad.npz", W1=np.zeros((5, 16)), b1=np.zeros(16), W2=np.zeros((16, 1)), b2=np.zeros(1))
    with pytest.raises(ValueError, match=r"W1 has shape \(5, 16\), expected \(6, 16\)"):
        PaperMLP16Policy.from_npz(tmp_path / "bad.npz")
    np.savez(tmp_path / "missing.npz", W1=np.zeros((6, 16)))
    with pytest.raises(ValueError, match="lacks array 'b1'"):
        PaperMLP16Policy.from_npz(tmp_path / "missing.npz")
