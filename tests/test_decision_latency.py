"""benchmarks/decision_latency.py: the goal summary, --marginal's step timing and the replay it rests on."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from speckv_policy.hf import attach
from speckv_policy.testing import tiny_llama_pair

from .conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


def _bench():
    return load_benchmark("decision_latency.py")


def test_time_outside_the_forwards_per_step():
    events = [
        ("target", False, 0.0),  # step 0 (prefill): only its end opens the first interval
        ("target", True, 1.0),
        ("draft", False, 1.5),
        ("draft", True, 2.0),
        ("draft", False, 2.25),
        ("draft", True, 2.5),
        ("target", False, 3.0),
        ("target", True, 5.0),  # step 1: 4 s from end to end, 0.75 s drafting, 2 s verifying -> 1.25 s outside
        ("target", False, 5.5),
        ("target", True, 6.0),  # step 2: a plain step, 1 s end to end, 0.5 s forward
    ]
    assert _bench().nonforward_us(events) == pytest.approx([1.25e6, 0.5e6])


def test_a_pre_policys_choices_replayed_take_the_same_forward_passes():
    """The A/B compares step by step: the replay must run the same tokens through the same passes."""
    target, draft = tiny_llama_pair(seed=0)
    passes = []
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: passes.append(n)) for n, m in (("t", target), ("d", draft))]
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    try:
        it = itertools.cycle([3, 0, 5, 1, 0, 8, 2])
        with attach(target, lambda features: next(it), mode="pre", feature_set="pre", compression="fp32") as h:
            a = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
        gammas, with_policy = [s.gamma for s in h.stats], list(passes)
        passes.clear()
        with attach(target, gammas.__getitem__, compression="fp32", mode="fixed"):
            b = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    finally:
        for hk in hooks:
            hk.remove()
    assert torch.equal(a, b)
    assert passes == with_policy and with_policy.count("d") > 0 and 0 in gammas


def test_the_goal_summary_sets_each_in_generation_figure_beside_its_hot_call():
    rows = [
        ("a-pre", "Python engine, RuntimePolicy.decide", 3.0),
        ("a-pre", "onnxruntime, RuntimePolicy.decide", 20.0),
        ("a-pre", "Python engine, inside generate (distilled draft, pre mode, us per step)", 42.0),
        ("a-pre", "Python engine, ... of which the policy call(s)", 41.0),
        ("a-pre", "onnxruntime, inside generate (distilled draft, pre mode, us per step)", 300.0),
        ("stop", "Python, inside generate (distilled draft, stop mode, us per draft token)", 180.0),
    ]
    assert _bench().goal_rows(rows, goal_us=50.0) == [
        "| a-pre | Python engine | distilled draft, pre mode, us per step | 42.0 | 20.0 | 2.1x | yes |",
        "| a-pre | onnxruntime | distilled draft, pre mode, us per step | 300.0 | 20.0 | 15.0x | no |",
        "| stop | Python | distilled draft, stop mode, us per draft token | 180.0 | - | - | no |",
    ]
