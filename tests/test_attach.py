"""attach()'s surface: the mode comes from the policy file, an int is a fixed gamma, advanced knobs live in one
settings object, and the old keywords still work for one release with a deprecation warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speckv_policy.hf import HookSettings, attach
from speckv_policy.testing import tiny_llama_pair

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


@pytest.fixture(scope="module")
def pair():
    return tiny_llama_pair(seed=0)


@pytest.mark.parametrize(
    "file, mode",
    [
        ("smollm2-gbt-gated.onnx", "gated"),
        ("smollm2-gbt-pre.onnx", "pre"),
        ("smollm2-gbt.onnx", "upfront"),
        ("smollm2-paper-mlp16.onnx", "truncate"),
        ("smollm2-stop.json", "stop"),
    ],
)
def test_the_mode_comes_from_the_policy_file(pair, file, mode):
    target, draft = pair
    ids = torch.tensor([[1, 7, 3, 9]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    with attach(target, ROOT / "exported" / file) as h:  # nothing but the file
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert h.mode == mode and torch.equal(out, ref) and h.summary()["fallbacks"] == 0


def test_an_int_is_a_fixed_gamma_and_per_token_overrides_an_online_export(pair):
    target, draft = pair
    ids = torch.tensor([[2, 4, 6]])
    with attach(target, 3) as h:
        target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert h.mode == "fixed" and {s.gamma for s in h.stats[:-1]} == {3}
    with attach(target, ROOT / "exported" / "smollm2-gbt.onnx", mode="per-token") as h:
        target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert h.mode == "per-token"


def test_refusals_speak_the_users_terms(pair):
    target, _ = pair
    gated = ROOT / "exported" / "smollm2-gbt-gated.onnx"
    with pytest.raises(ValueError, match="reads the 'gated' features and runs in mode 'gated'; mode='upfront'"):
        attach(target, gated, mode="upfront")
    with pytest.raises(ValueError, match="a stop rule runs in mode 'stop', not 'pre'"):
        attach(target, ROOT / "exported" / "smollm2-stop.json", mode="pre")
    with pytest.raises(ValueError, match="policy=3 is a fixed gamma"):
        attach(target, 3, mode="gated")
    with pytest.raises(ValueError, match="fixed gamma must be in 0..64"):
        attach(target, 99)
    with pytest.raises(ValueError, match="a fixed gamma .* decides nothing"):
        attach(target, 2, costs="live")
    with pytest.raises(ValueError, match="attach needs a policy"):
        attach(target)
    with pytest.raises(ValueError, match="settings: unknown 'max_gama'"):
        attach(target, 2, settings={"max_gama": 4})
    with pytest.raises(ValueError, match="settings: unknown draft_loop 'fast'"):
        HookSettings(draft_loop="fast")
    with pytest.raises(ValueError, match="fallback_gamma 9 exceeds max_gamma 8"):
        HookSettings(max_gamma=8, fallback_gamma=9)


def test_live_costs_run_where_they_can_and_are_refused_in_plain_words_where_not(pair):
    """costs='live' on an ungated export or the stop rule re-prices every step; on a gated export the refusal says
    what to do instead (it used to name LiveCosts(prior=...), which the user never passed)."""
    target, draft = pair
    ids = torch.tensor([[1, 7, 3, 9]])
    for file in ("smollm2-gbt-pre.onnx", "smollm2-stop.json"):
        with attach(target, ROOT / "exported" / file, costs="live") as h:
            target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft)
        assert h.live_costs is not None and h.live_costs.observations == len(h.stats) - 1
    with pytest.raises(ValueError, match="costs='live' is not available for a gated export.*speckv-calibrate"):
        attach(target, ROOT / "exported" / "smollm2-gbt-gated.onnx", costs="live")


def test_old_keywords_warn_and_still_work(pair):
    target, draft = pair
    ids = torch.tensor([[5, 9, 5, 9]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    with pytest.warns(DeprecationWarning, match=r"attach\(max_gamma=...\) is deprecated.*settings="):
        with pytest.warns(DeprecationWarning, match=r"attach\(gamma_fn=...\) is deprecated"):
            h = attach(target, mode="fixed", gamma_fn=lambda step: 5, max_gamma=4)
    with h:
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref) and {s.gamma for s in h.stats[:-1]} == {4}  # gamma_fn's 5, capped at max_gamma 4
    with pytest.warns(DeprecationWarning) as rec:
        h = attach(target, lambda f: 0, feature_set="online", probe_backoff=2, record_tokens=True)
    assert sorted(str(w.message).split("(")[1].split("=")[0] for w in rec) == ["probe_backoff", "record_tokens"]
    with h:
        target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert h.summary()["skipped_probes"] > 0
    with pytest.raises(ValueError, match="given both as a keyword and in settings="):
        with pytest.warns(DeprecationWarning):
            attach(target, 2, max_gamma=4, settings={"max_gamma": 3})
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        attach(target, 2, max_gamm=4)


def test_runtime_policy_cost_model_keyword_is_deprecated_for_costs():
    from speckv_policy.runtime import RuntimePolicy

    path = ROOT / "exported" / "smollm2-gbt.onnx"
    costs = ROOT / "benchmarks" / "runs" / "quant_costs.json"
    with pytest.warns(DeprecationWarning, match="cost_model=...\\) is deprecated"):
        old = RuntimePolicy(path, cost_model=costs)
    assert old.cost_model == RuntimePolicy(path, costs=costs).cost_model and old.repriced


def test_the_custom_generate_recipe_is_attach_around_generate(pair):
    """generate(..., custom_generate=RECIPE_DIR): lossless, and the policy really decides (a schedule that records
    its calls); an export runs in its own mode there too."""
    from speckv_policy.hf.recipe import RECIPE_DIR

    target, draft = pair
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    ref = target.generate(ids, max_new_tokens=14, do_sample=False)
    seen = []

    def schedule(step):
        seen.append(step)
        return 2

    recipe = {"custom_generate": RECIPE_DIR, "trust_remote_code": True, "max_new_tokens": 14, "do_sample": False}
    out = target.generate(ids, assistant_model=draft, speckv_policy=schedule, speckv_mode="fixed", **recipe)
    assert torch.equal(out, ref) and seen[:3] == [0, 1, 2]
    gated = ROOT / "exported" / "smollm2-gbt-gated.onnx"
    out = target.generate(ids, assistant_model=draft, speckv_policy=gated, **recipe)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="needs speckv_policy="):
        target.generate(ids, assistant_model=draft, **recipe)


@pytest.mark.parametrize("bad", ["raises", -1, 2.5, None, 10**6, True])
def test_a_failing_fixed_schedule_falls_back_like_every_other_mode(pair, bad):
    """Issue 38: fixed mode was the one mode where a failing gamma_fn made generate() raise. Now: one warning, the
    fallback gamma on every failed step, counted, and the target's own output."""
    from speckv_policy.runtime import PolicyFallbackWarning

    target, draft = pair
    ids = torch.tensor([[2, 7, 1, 8]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)

    def schedule(step):
        if bad == "raises":
            raise ArithmeticError("schedule broke")
        return bad

    with pytest.warns(PolicyFallbackWarning, match="using fallback gamma 3") as rec:
        with attach(target, schedule, mode="fixed", settings={"fallback_gamma": 3}) as h:
            out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert len([w for w in rec if w.category is PolicyFallbackWarning]) == 1
    assert h.summary()["fallbacks"] == len(h.stats) and all(s.fallback for s in h.stats)
    assert {s.gamma for s in h.stats[:-1]} == {3}
