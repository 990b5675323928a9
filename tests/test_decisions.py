"""The decision modes (speckv_policy.decisions): the hook and the dense replay drive the same classes, so on the
same text they make the same decisions in every mode."""

from __future__ import annotations

import pytest
import torch

from speckv_policy.decisions import MODES, PlainDecider, make_mode
from speckv_policy.evaluation.dense import simulate
from speckv_policy.features import OnlineFeatureState
from speckv_policy.objective import CostModel
from speckv_policy.stop import STOP_FEATURES, AcceptanceCurve, StopRule
from speckv_policy.testing import tiny_llama_pair

from .conftest import teacher_forced_text

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


def _cost() -> CostModel:
    return CostModel((2.0,) * 3, (10.0,) * 3, (1.0,) * 3, draft_base_ms=(1.0,) * 3)


def _stop_rule() -> StopRule:
    """A rule whose acceptance curve reads the token's confidence: it drafts on where the draft is sure."""
    curve = AcceptanceCurve(-1.0, (6.0,) + (0.0,) * (len(STOP_FEATURES) - 1))
    pair = (curve, curve)
    return StopRule({("fp32", "greedy"): pair, ("fp32", "sampling"): pair}, _cost())


class _Gated:
    """A gated policy reading its features: the gate on the history and the context, the head on the probe."""

    def decide_gate(self, f):
        return (f[3] + f[4] + f[8]) % 3 != 1

    def __call__(self, f):
        return int(f[9] * 10) % 5


#: Per mode: (policy, feature_set) such that every decision reads what the mode computes.
POLICIES = {
    "fixed": (lambda step: (3 * step) % 5, None),
    "pre": (lambda f: int(f[3] + f[8] + f[6]) % 4, "pre"),
    "gated": (_Gated(), "gated"),
    "upfront": (lambda f: (int(f[0] * 10) + int(f[3] * 3)) % 5, "online"),
    "per-token": (lambda f: 2 if f[0] > 0.02 else int(f[0] * 100) % 2, "online"),
    "truncate": (lambda f: int(f[1] * 40) % 6, "paper"),
    "stop": (_stop_rule(), None),
}


@pytest.fixture(scope="module")
def text_and_pair():
    target, draft = tiny_llama_pair(seed=5, noise=0.05)
    ids = torch.tensor([[1, 7, 3, 9, 4, 7, 3]])
    text, ref = teacher_forced_text(target, draft, ids, 30)
    return target, draft, ids, text, ref


def test_every_mode_is_covered():
    assert set(POLICIES) == set(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_the_hook_and_the_replay_make_identical_decisions(text_and_pair, mode):
    """Greedy generation through the hook and the dense replay along the same text: the same gamma and the same
    kept tokens at every step, in every mode (the replay drives the hook's own mode classes)."""
    from speckv_policy.hf import attach

    target, draft, ids, text, ref = text_and_pair
    policy, fs = POLICIES[mode]
    kw = {"feature_set": fs} if fs else {}
    with torch.inference_mode(), attach(target, policy, mode=mode, settings={"max_gamma": 8}, **kw) as h:
        out = target.generate(ids, max_new_tokens=text.generated, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    gate = policy.decide_gate if mode == "gated" else None
    res = simulate([text], mode, policy, compression="fp32", cost=_cost(), gate=gate, max_gamma=8)
    hook = [(s.gamma, s.accepted) for s in h.stats][1:]  # the first step is the prefill, left out
    assert list(zip(res.gammas.tolist(), res.accepted.tolist())) == hook
    assert len({g for g, _ in hook}) > 1  # the policy's choices varied: the comparison is not trivial


def test_modes_drive_as_documented_without_models():
    """The protocol by hand: plan -> after_token -> finish, upfront with a probe that chooses 3, per-token stopping
    at the first token whose step would draft fewer than 2, the fixed schedule clipped to the budget."""
    state = OnlineFeatureState("fp32")
    up = make_mode("upfront", PlainDecider(lambda f: 3, lists=False), "fp32", 8)
    up.start(state)
    assert up.plan(0, 10, 0, budget=20) == 8 and up.reads_token(1) and not up.reads_token(2)
    assert [up.after_token(k, (0.5, 1.0) if k == 1 else None, 9 + k) for k in (1, 2, 3)] == [False, False, True]
    assert up.finish(3, lambda: ([], [])) == 3
    seen = iter([2, 2, 1])
    per = make_mode("per-token", PlainDecider(lambda f: next(seen), lists=False), "fp32", 8)
    per.start(state)
    per.plan(0, 10, 0, 20)
    assert [per.after_token(k, (0.5, 1.0), 9 + k) for k in (1, 2, 3)] == [False, False, True]
    assert per.finish(3, lambda: ([], [])) == 3
    fixed = make_mode("fixed", lambda step: 6, "fp32", 8)
    fixed.start(state)
    assert fixed.plan(0, 10, 0, budget=2) == 2 and fixed.finish(2, lambda: ([], [])) == 2
    with pytest.raises(ValueError, match="probe_backoff applies to the upfront and per-token modes"):
        make_mode("pre", PlainDecider(lambda f: 1), "fp32", 8, probe_backoff=2)
    with pytest.raises(ValueError, match="unknown mode 'sideways'"):
        make_mode("sideways", PlainDecider(lambda f: 1), "fp32", 8)


def test_probe_backoff_skips_probes_after_gamma_0_doubling():
    state = OnlineFeatureState("fp32")
    up = make_mode("upfront", PlainDecider(lambda f: 0, lists=False), "fp32", 8, probe_backoff=4)
    up.start(state)
    caps = []
    for step in range(12):
        cap = up.plan(step, 10, 0, 20)
        caps.append(cap)
        if cap:
            up.after_token(1, (0.5, 1.0), 10)
            up.finish(1, lambda: ([], []))
    # probe, skip 1, probe, skip 2, probe, skip 4, probe, skip 4 ...
    assert [c > 0 for c in caps] == [True, False, True, False, False, True] + [False] * 4 + [True, False]


def test_a_stop_rule_that_breaks_falls_back_in_the_hooks_adapter_and_raises_in_the_replays():
    from speckv_policy.decisions import PlainStopDecider

    class Broken(StopRule):
        def begin(self, *a, **k):
            raise ArithmeticError("no curve")

    rule = _stop_rule()
    broken = Broken(rule.curves, rule.cost_model)
    mode = make_mode("stop", PlainStopDecider(broken), "fp32", 8)
    mode.start(OnlineFeatureState("fp32"))
    mode.plan(0, 10, 0, 20)
    with pytest.raises(RuntimeError, match="no curve"):
        mode.after_token(1, (0.9, 0.1), 10)
