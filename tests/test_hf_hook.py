"""The Hugging Face hook: lossless for any gamma sequence, quantized targets, failure modes."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speckv_policy.hf import attach, detect_compression
from speckv_policy.runtime import PolicyFallbackWarning
from speckv_policy.testing import save_tiny_pair, tiny_llama_pair

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


@pytest.fixture(scope="module")
def pair():
    return tiny_llama_pair(seed=0)


def _greedy(target, ids, n):
    return target.generate(ids, max_new_tokens=n, do_sample=False)


def _cycle(seq):
    it = itertools.cycle(seq)
    return lambda features: next(it)


class _GatedCycle:
    """A gated policy for mode='gated': the gate opens when the next gamma of the cycle is > 0 or odd-indexed,
    and the length head returns the next gamma (so an open gate may still choose 0 after the probe)."""

    def __init__(self, seq):
        self._g = itertools.cycle(seq)
        self._open = itertools.cycle([bool(g) or i % 2 == 1 for i, g in enumerate(seq)])

    def decide_gate(self, features):
        return next(self._open)

    def __call__(self, features):
        return next(self._g)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=12),
    mode=st.sampled_from(["upfront", "per-token", "truncate", "fixed", "pre", "gated"]),
    prompt=st.lists(st.integers(1, 63), min_size=1, max_size=12),
    n_new=st.integers(1, 40),
)
def test_greedy_output_is_the_targets_for_any_gamma_sequence(pair, gammas, mode, prompt, n_new):
    target, draft = pair
    ids = torch.tensor([prompt])
    ref = _greedy(target, ids, n_new)
    fs = {"truncate": "paper", "pre": "pre", "gated": "gated"}.get(mode, "online")
    kw = {} if mode == "fixed" else {"feature_set": fs}
    settings = {"max_gamma": 8}
    if mode in ("upfront", "per-token") and gammas[0] % 2:
        settings["probe_backoff"] = 4  # plain steps without a probe are lossless too
    policy = _GatedCycle(gammas) if mode == "gated" else _cycle(gammas)
    with attach(target, policy, compression="fp32", mode=mode, **kw, settings=settings) as h:
        out = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert sum(s.accepted + 1 for s in h.stats) == out.shape[1] - ids.shape[1]


def test_the_policy_really_sets_gamma(pair):
    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    with attach(target, _cycle([3, 0, 5, 1]), compression="fp32", feature_set="online") as h:
        target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert [s.gamma for s in h.stats[:4]] == [3, 0, 5, 1]
    assert [s.drafted for s in h.stats[:4]] == [3, 1, 5, 1]  # gamma 0 still drafted the probe token
    acc = h.summary()["acceptance"]
    assert 0.1 < acc < 0.95  # both accept and reject paths ran


def test_probe_backoff_skips_probes_after_zero_decisions(pair):
    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    ref = _greedy(target, ids, 40)
    with attach(target, lambda f: 0, compression="fp32", feature_set="online", settings={"probe_backoff": 4}) as h:
        out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)  # plain steps are lossless
    # probe, skip 1, probe, skip 2, probe, skip 4, probe, skip 4, ...
    pattern = [not s.skipped for s in h.stats[:14]]
    assert pattern == [True, False, True, False, False, True, False, False, False, False, True, False, False, False]
    assert all(s.drafted == 0 and s.gamma == 0 for s in h.stats if s.skipped)
    assert h.summary()["skipped_probes"] == sum(s.skipped for s in h.stats) > 0
    # a probe that drafts resets the back-off: policy alternating 0 and 2 never skips twice in a row
    with attach(target, _cycle([0, 2]), compression="fp32", feature_set="online", settings={"probe_backoff": 8}) as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, _greedy(target, ids, 30))
    skipped = [s.skipped for s in h.stats]
    assert not any(a and b for a, b in zip(skipped, skipped[1:]))
    with pytest.raises(ValueError, match="probe_backoff applies"):
        attach(target, lambda s: 1, compression="fp32", mode="fixed", settings={"probe_backoff": 2})
    with pytest.raises(ValueError, match="probe_backoff must be"):
        attach(target, lambda f: 0, compression="fp32", feature_set="online", settings={"probe_backoff": -1})


def _exact_joint(target, ids, vocab):
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1].double(), -1)
        joint = np.zeros((vocab, vocab))
        for a in range(vocab):
            nxt = torch.cat([ids, torch.tensor([[a]])], 1)
            p2 = torch.softmax(target(nxt).logits[0, -1].double(), -1)
            joint[a] = (p1[a] * p2).numpy()
    return joint


def _chi2_pvalue(counts, expected_probs):
    from scipy.stats import chisquare

    n = counts.sum()
    exp = expected_probs.ravel() * n
    obs = counts.ravel()
    small = exp < 5
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    return chisquare(obs, exp).pvalue


def _two_token_counts(model, ids, vocab, n, **kwargs):
    """How often each pair of next two tokens is sampled in ``n`` seeded generations."""
    counts = np.zeros((vocab, vocab))
    start = ids.shape[1]
    for i in range(n):
        torch.manual_seed(i)
        out = model.generate(ids, max_new_tokens=2, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, **kwargs)
        counts[out[0, start], out[0, start + 1]] += 1
    return counts


SAMPLING_DRAWS = 1500


def _assisted_vs_draft_sampling(target, draft, ids, vocab, n=SAMPLING_DRAWS, mode="upfront", draft_counts=None):
    """Chi-square p-values of assisted sampling (random gamma 0..3) and of the draft's own samples
    against the target's exact two-token distribution; also the hook handle and the draft's counts
    (``draft_counts``: the draft's own ``n`` counts when a caller has drawn them already)."""
    joint = _exact_joint(target, ids, vocab)
    rng = np.random.default_rng(0)
    fs = mode if mode in ("pre", "gated") else "online"
    policy = lambda f: int(rng.integers(0, 4))  # noqa: E731
    if mode == "gated":
        policy = _GatedCycle([int(g) for g in rng.integers(0, 4, size=97)])
    if mode == "stop":  # a cost-aware stop rule whose choices vary with the draft's confidence (0..8 tokens)
        from speckv_policy.objective import CostModel
        from speckv_policy.stop import AcceptanceCurve, StopRule

        cost = CostModel((2.0,) * 3, (10.0,) * 3, (1.0,) * 3, draft_base_ms=(1.0,) * 3)
        pair = (AcceptanceCurve(-1.0, (3.0, 0.0, 0.0, 0.0)), AcceptanceCurve(0.4, (0.0,) * 4))
        policy = StopRule({("fp32", "sampling"): pair}, cost)
    with attach(target, policy, compression="fp32", mode=mode, feature_set=fs) as h:
        counts = _two_token_counts(target, ids, vocab, n, assistant_model=draft)
    if draft_counts is None:
        draft_counts = _two_token_counts(draft, ids, vocab, n)
    return h, _chi2_pvalue(counts, joint), _chi2_pvalue(draft_counts, joint), draft_counts


SAMPLING_PAIR = {"vocab_size": 12, "hidden_size": 32, "noise": 0.3, "seed": 3, "init_range": 0.15}
SAMPLING_PROMPT = [[1, 2, 3]]


@pytest.mark.parametrize("mode", ["upfront", "pre", "gated", "stop"])
def test_sampling_keeps_the_target_distribution(mode, draft_samples):
    target, draft = tiny_llama_pair(**SAMPLING_PAIR)
    ids, vocab = torch.tensor(SAMPLING_PROMPT), SAMPLING_PAIR["vocab_size"]
    h, p_assisted, p_draft, _ = _assisted_vs_draft_sampling(
        target, draft, ids, vocab, mode=mode, draft_counts=draft_samples
    )
    assert h.summary()["acceptance"] > 0.2 and max(s.gamma for s in h.stats) >= 1
    if mode == "stop":  # the rule's choices really vary: plain steps after the probe, one token, longer drafts
        assert {0, 1} <= {s.gamma for s in h.stats}  # two new tokens: one draft token at most
    assert p_assisted > 0.001
    assert p_draft < 1e-6  # the draft's own samples: the test must be able to tell them apart


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _load_quantized(path, kind):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = {
        "int8": BitsAndBytesConfig(load_in_8bit=True),
        # outlier decomposition off: every token's row is quantized on its own (batch-invariant)
        "int8-no-outliers": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=1e9),
        "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    }[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu").eval()


@pytest.mark.parametrize("kind", ["nf4", "int8-no-outliers"])
def test_quantized_target_greedy_equality(saved_pair, kind):
    from transformers import AutoModelForCausalLM

    tpath, dpath = saved_pair
    target = _load_quantized(tpath, kind)
    draft = AutoModelForCausalLM.from_pretrained(dpath).eval()
    assert detect_compression(target) == kind.split("-")[0]
    rng = np.random.default_rng(1)
    for prompt in ([1, 2, 3, 4], [9, 30, 2], [50]):
        ids = torch.tensor([prompt])
        ref = _greedy(target, ids, 30)
        for mode in ("upfront", "per-token"):
            with attach(target, lambda f: int(rng.integers(0, 9)), feature_set="online", mode=mode) as h:
                out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
            assert h.compression == kind.split("-")[0]
            assert torch.equal(out, ref), (kind, mode, prompt)


def test_default_int8_matches_transformers_own_assisted_decoding(saved_pair):
    """LLM.int8 picks outlier columns over all tokens of a forward pass, so verifying k tokens at
    once can differ numerically from k single steps, for transformers' own assisted decoding too.
    The hook must add nothing to that: same gamma, same tokens as transformers' untouched code."""
    from transformers import AutoModelForCausalLM

    tpath, dpath = saved_pair
    target = _load_quantized(tpath, "int8")
    draft = AutoModelForCausalLM.from_pretrained(dpath).eval()
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    for g in (1, 3, 6):
        draft.generation_config.num_assistant_tokens = g
        for prompt in ([1, 2, 3, 4], [9, 30, 2]):
            ids = torch.tensor([prompt])
            hf_own = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
            with attach(target, lambda step, g=g: g, compression="int8", mode="fixed"):
                ours = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
            assert torch.equal(ours, hf_own), (g, prompt)


@pytest.mark.parametrize(
    "bad", [lambda f: 1 / 0, lambda f: -1, lambda f: 99, lambda f: "four", lambda f: float("nan"), lambda f: 2.5]
)
def test_broken_policy_falls_back_with_one_warning(pair, bad):
    target, draft = pair
    ids = torch.tensor([[5, 6, 7]])
    ref = _greedy(target, ids, 25)
    with pytest.warns(PolicyFallbackWarning) as rec:
        with attach(target, bad, compression="fp32", feature_set="online", settings={"fallback_gamma": 2}) as h:
            out = target.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    assert h.summary()["fallbacks"] == len(h.stats) and all(s.gamma == 2 for s in h.stats[:-1])


def test_onnx_and_fitted_policies(pair, fitted, tmp_path):
    from speckv_policy.export import export_onnx

    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    ref = _greedy(target, ids, 30)
    export_onnx(fitted["table"], tmp_path / "t.onnx")
    for policy in (str(tmp_path / "t.onnx"), fitted["table"]):
        with attach(target, policy, compression="fp32") as h:
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref)
        assert all(s.decision_us > 0 for s in h.stats if s.drafted)
    with attach(target, fitted["paper-mlp16"], compression="fp32", mode="truncate") as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert {s.gamma for s in h.stats[:-1]} <= {2, 4, 6, 8}


def _count_calls(monkeypatch, module, name: str) -> dict[str, int]:
    """Replace ``module.name`` by a wrapper that counts its calls in the returned dict's ``calls``."""
    count, fn = {"calls": 0}, getattr(module, name)

    def counted(*args):
        count["calls"] += 1
        return fn(*args)

    monkeypatch.setattr(module, name, counted)
    return count


def test_a_policy_that_reads_no_entropy_decides_the_same_without_it(pair, fitted, tmp_path, monkeypatch):
    """The hook skips a draft token's entropy where the policy does not read it; every decision stays the same."""
    from speckv_policy.export import export_onnx
    from speckv_policy.hf import controller as hook
    from speckv_policy.runtime import RuntimePolicy

    full = _count_calls(monkeypatch, hook, "draft_token_stats_one")
    confidences = _count_calls(monkeypatch, hook, "draft_token_confidence_one")

    target, draft = pair
    export_onnx(fitted["table"], tmp_path / "t.onnx")
    rt = RuntimePolicy(tmp_path / "t.onnx")
    assert "conf_first" in rt.read_features and "entropy_first" not in rt.read_features
    entropies = []

    def told_everything(features):  # the same export behind a callable: the hook cannot know what it reads
        entropies.append(float(features[1]))
        return rt.decide(features)

    for mode in ("upfront", "per-token"):
        for prompt in ([[1, 2, 3]], [[5, 9, 5, 9, 5]]):
            ids = torch.tensor(prompt)
            runs, calls = [], []
            for policy in (rt, told_everything):
                before = full["calls"]
                with attach(target, policy, compression="fp32", mode=mode, feature_set="online") as h:
                    out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
                assert torch.equal(out, _greedy(target, ids, 30))
                runs.append([(s.gamma, s.drafted) for s in h.stats])
                calls.append(full["calls"] - before)
            assert runs[0] == runs[1]
            assert calls[0] == 0 < calls[1], "the full statistics run only for the callable"
    assert entropies and max(entropies) > 0, "the callable was handed real entropies"
    # a policy that reads neither (a fixed gamma) gets no statistics at all, and the same steps
    export_onnx(fitted["fixed"], tmp_path / "f.onnx")
    fixed = RuntimePolicy(tmp_path / "f.onnx")
    assert "conf_first" not in fixed.read_features and "entropy_first" not in fixed.read_features
    ids, runs = torch.tensor([[1, 2, 3]]), []
    for policy in (fixed, fixed.decide):
        before, conf_calls = full["calls"], confidences["calls"]
        with attach(target, policy, compression="fp32", mode="upfront", feature_set="online") as h:
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert torch.equal(out, _greedy(target, ids, 30))
        runs.append(
            ([(s.gamma, s.drafted) for s in h.stats], full["calls"] - before, confidences["calls"] - conf_calls)
        )
    assert runs[0][0] == runs[1][0] and runs[0][1:] == (0, 0) and runs[1][1] > 0


def test_corrupt_onnx_file_generation_still_runs(pair, tmp_path):
    target, draft = pair
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.warns(PolicyFallbackWarning) as rec:
        with attach(target, str(bad), compression="fp32", settings={"fallback_gamma": 3}) as h:
            out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert torch.equal(out, _greedy(target, ids, 20))
    assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    assert h.summary()["fallbacks"] == len(h.stats) and h.stats[0].gamma == 3


def test_clear_errors(pair, fitted):
    target, draft = pair
    with attach(target, _cycle([2]), compression="fp32", feature_set="online"):
        with pytest.raises(ValueError, match="batch size 2"):
            target.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=4, assistant_model=draft)
        with pytest.raises(ValueError, match="beam search"):
            target.generate(torch.tensor([[1, 2]]), max_new_tokens=4, assistant_model=draft, num_beams=2)
        with pytest.raises(RuntimeError, match="already attached"):
            attach(target, _cycle([2]), compression="fp32", feature_set="online")
    with pytest.raises(
        ValueError,
        match="reads the 'online' features and runs in mode 'upfront'; mode='truncate' would compute the 'paper'",
    ):
        attach(target, fitted["table"], compression="fp32", mode="truncate")
    with pytest.raises(ValueError, match="unknown mode"):
        attach(target, fitted["table"], compression="fp32", mode="eager")
    with pytest.raises(ValueError, match="unknown compression 'int4'"):
        attach(target, fitted["table"], compression="int4")
    with pytest.raises(ValueError, match="needs feature_set"):
        attach(target, _cycle([2]), compression="fp32")


def test_detach_restores_the_model(pair):
    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    h = attach(target, _cycle([2]), compression="fp32", feature_set="online")
    h.detach()
    assert "_get_candidate_generator" not in target.__dict__ and "generate" not in target.__dict__
    target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert h.stats == []


def test_stats_records_and_reset(pair):
    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    with attach(target, _cycle([2, 0, 3]), compression="fp32", feature_set="online") as h:
        target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
        records = h.stats_records()
        assert len(records) == len(h.stats) > 2
        assert [r["gamma"] for r in records[:3]] == [2, 0, 3]
        assert set(records[0]) >= {"step", "gamma", "accepted", "draft_ms", "verify_ms", "decision_us"}
        assert sum(r["accepted"] + 1 for r in records) == 12
        assert all(r["signals_us"] == 0.0 for r in records)  # the upfront mode computes no pre-draft signals
        h.reset_stats()
        assert h.stats == [] and h.stats_records() == [] and h.summary()["steps"] == 0
        target.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=draft)
        assert sum(s.accepted + 1 for s in h.stats) == 5  # counting starts afresh


def test_transformers_version_outside_the_tested_range_is_a_clear_error(monkeypatch):
    import transformers

    from speckv_policy.hf import _compat

    _compat.check_transformers_version()  # the installed version is tested
    low, high = _compat.TESTED_TRANSFORMERS
    monkeypatch.delenv("SPECKV_ALLOW_UNTESTED_TRANSFORMERS", raising=False)
    for version in ("4.46.0", high, "6.3.1"):
        with pytest.raises(_compat.IncompatibleTransformersError) as err:
            _compat.check_transformers_version(version)
        assert f"transformers {version}" in str(err.value) and f">={low},<{high}" in str(err.value)
    monkeypatch.setenv("SPECKV_ALLOW_UNTESTED_TRANSFORMERS", "1")
    with pytest.warns(RuntimeWarning, match="outside the tested range"):
        _compat.check_transformers_version("6.3.1")
    # an internal that disappeared is named, with both versions
    monkeypatch.delenv("SPECKV_ALLOW_UNTESTED_TRANSFORMERS")
    monkeypatch.delattr(_compat.AssistedCandidateGenerator, "_generate_candidates")
    with pytest.raises(
        _compat.IncompatibleTransformersError,
        match=rf"transformers {transformers.__version__} lacks .*_generate_candidates",
    ):
        _compat.check_transformers_version()


def test_costs_reprice_the_export_and_stay_lossless(pair, fitted, tmp_path):
    from speckv_policy.export import export_onnx
    from speckv_policy.objective import CostModel
    from speckv_policy.runtime import RuntimePolicy

    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    ref = _greedy(target, ids, 30)
    path = tmp_path / "g.onnx"
    export_onnx(fitted["gbt"], path)
    dear_draft = CostModel.relative(draft_cost=2.0, verify_cost_per_token=0.0)  # drafting never pays here
    costs_file = tmp_path / "costs.json"
    dear_draft.save(costs_file)
    mine = RuntimePolicy(path)
    for costs in (dear_draft, costs_file):
        with attach(target, mine, compression="fp32", costs=costs) as h:
            out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert torch.equal(out, ref)
        assert h.runtime is not mine and h.runtime.repriced and h.runtime.cost_model == dear_draft
        assert all(s.gamma == 0 for s in h.stats)  # priced so that drafting never pays, it never drafts
    assert not mine.repriced  # the caller's policy object is left as it was
    # live costs: estimates from the steps just timed (a tiny model steps in ~1 ms, far from the prior's prices)
    with attach(target, str(path), compression="fp32", costs="live") as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    live = h.live_costs
    assert live is not None and live.observations == len(h.stats) - 1  # not the prefill step
    prior = fitted["gbt"].cost_model_.time_table(h.runtime.candidates)[0]
    assert not np.allclose(live.step_ms(h.runtime.candidates), prior)
    with attach(target, str(path), compression="fp32", mode="per-token", costs="live") as h:
        out = target.generate(ids, max_new_tokens=30, do_sample=True, top_k=0, assistant_model=draft)
    assert out.shape[1] == ids.shape[1] + 30


def test_costs_errors(pair, fitted, tmp_path):
    from speckv_policy.export import export_onnx

    target, draft = pair
    export_onnx(fitted["paper-mlp16"], tmp_path / "p.onnx")
    export_onnx(fitted["table"], tmp_path / "t.onnx")
    with pytest.raises(ValueError, match="needs an ONNX export"):
        attach(target, fitted["table"], compression="fp32", costs="live")
    with pytest.raises(ValueError, match=r"a fixed gamma \(mode='fixed'\) decides nothing"):
        attach(target, lambda s: 2, compression="fp32", mode="fixed", costs="live")
    with pytest.raises(ValueError, match="maximises tokens_per_step"):
        attach(target, str(tmp_path / "p.onnx"), compression="fp32", mode="truncate", costs="live")
    assert "_get_candidate_generator" not in target.__dict__  # a refused attach leaves the model untouched
    # a missing cost file is not a misuse but a bad file: one warning and the fallback gamma, like a bad policy file
    with pytest.warns(PolicyFallbackWarning, match="cost model file not found: .*nope.json"):
        with attach(target, str(tmp_path / "t.onnx"), compression="fp32", costs=tmp_path / "nope.json") as h:
            target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False, assistant_model=draft)
    assert h.summary()["fallbacks"] > 0


def test_failing_live_costs_never_break_generation(pair, fitted, tmp_path):
    from speckv_policy.export import export_onnx
    from speckv_policy.hf import LiveCosts

    class Broken(LiveCosts):
        def observe(self, *args, **kwargs):
            raise FloatingPointError("simulated")

    target, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    export_onnx(fitted["gbt"], tmp_path / "g.onnx")
    with pytest.warns(PolicyFallbackWarning, match="live costs failed") as rec:
        with attach(target, str(tmp_path / "g.onnx"), compression="fp32", costs=Broken()) as h:
            out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert torch.equal(out, _greedy(target, ids, 20))
    assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1 and h.live_costs is None
