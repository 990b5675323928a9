"""The lean draft loop: same steps as transformers' generate() path, processed scores, fallbacks."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from speckv_policy.hf import attach, candidates
from speckv_policy.hf.lean_draft import LeanDraft, sample_tokens
from speckv_policy.testing import tiny_llama_pair

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


@pytest.fixture(scope="module")
def pair():
    return tiny_llama_pair(seed=0)


def _run(target, draft, ids, n_new, gammas, mode, loop, backoff=0):
    it = itertools.cycle(gammas)
    fs = "paper" if mode == "truncate" else "online"
    kw = {} if mode == "fixed" else {"feature_set": fs}
    settings = {"max_gamma": 8, "draft_loop": loop, "probe_backoff": backoff}
    with attach(target, lambda f: next(it), compression="fp32", mode=mode, **kw, settings=settings) as h:
        out = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=draft)
    return out, [(s.gamma, s.drafted, s.accepted, s.skipped) for s in h.stats], h.draft_loop


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=10),
    mode=st.sampled_from(["upfront", "per-token", "truncate", "fixed"]),
    prompt=st.lists(st.integers(1, 63), min_size=1, max_size=10),
    n_new=st.integers(1, 36),
    backoff=st.sampled_from([0, 3]),
)
def test_lean_loop_takes_the_same_steps_as_transformers_generate_path(pair, gammas, mode, prompt, n_new, backoff):
    """Same draft tokens => same gamma, drafted and accepted counts at every step, in every mode,
    across rejections, dropped probes and plain steps: the lean cache never goes stale."""
    target, draft = pair
    ids = torch.tensor([prompt])
    backoff = backoff if mode in ("upfront", "per-token") else 0
    lean = _run(target, draft, ids, n_new, gammas, mode, "lean", backoff)
    slow = _run(target, draft, ids, n_new, gammas, mode, "generate", backoff)
    assert lean[2] == "lean" and slow[2].startswith("generate")
    assert torch.equal(lean[0], slow[0])
    assert torch.equal(lean[0], target.generate(ids, max_new_tokens=n_new, do_sample=False))
    assert lean[1] == slow[1]


def test_lean_loop_reuses_its_cache(pair):
    target, draft = pair
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    made = []
    real = candidates.LeanDraft

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    candidates.LeanDraft = Spy
    try:
        out, steps, _ = _run(target, draft, ids, 40, [3, 0, 5, 2, 8], "fixed", "lean")
    finally:
        candidates.LeanDraft = real
    (lean,) = made
    drafted = sum(s[1] for s in steps)
    assert lean.forwards == drafted  # one forward per draft token, no re-prefill
    # each token of the final sequence is fed at most once, plus rejected drafts and one re-feed per step
    assert ids.shape[1] <= lean.fed <= out.shape[1] + drafted
    assert lean.fed < ids.shape[1] + sum(ids.shape[1] + i for i in range(out.shape[1] - ids.shape[1]))


def test_lean_scores_are_the_processed_distribution_it_samples_from(pair):
    """Speculative sampling takes q from the returned scores, so they must be exactly what each token
    was drawn from: the target's logits processors applied once to the draft's logits."""
    _, draft = pair
    procs = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    ids = torch.tensor([[1, 2, 3]])
    lean = LeanDraft(draft, procs, do_sample=True, eos_token_id=None)
    torch.manual_seed(0)
    out, scores = lean.draft(ids, 4)
    assert out.shape == (1, 7) and scores.shape == (1, 4, draft.config.vocab_size)
    with torch.no_grad():
        raw = draft(out).logits[0].float()
    for k in range(4):
        pos = ids.shape[1] - 1 + k
        want = LogitsProcessorList(procs)(out[:, : pos + 1], raw[pos : pos + 1].clone())[0]
        assert torch.equal(torch.isfinite(scores[0, k]), torch.isfinite(want))
        fin = torch.isfinite(want)
        assert torch.allclose(scores[0, k][fin], want[fin], atol=1e-4)
        assert torch.isfinite(scores[0, k, out[0, pos + 1]])  # the drawn token had q > 0
    assert int(torch.isfinite(scores[0, 0]).sum()) == 5  # top-k applied once


def test_lean_loop_stops_at_eos_and_respects_min_length(pair):
    _, draft = pair
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        first = int(draft(ids).logits[0, -1].argmax())
    ids_out, _ = LeanDraft(draft, [], do_sample=False, eos_token_id=first).draft(ids, 6)
    assert ids_out.shape[1] == 4  # stopped right after the end-of-sequence token
    ids_out, scores = LeanDraft(draft, [], do_sample=False, eos_token_id=first, min_length=10).draft(ids, 6)
    assert ids_out.shape[1] == 9 and first not in ids_out[0, 3:].tolist()
    assert torch.isinf(scores[0, :, first]).all()
    with pytest.raises(ValueError, match="max_new"):
        LeanDraft(draft, [], do_sample=False, eos_token_id=None).draft(ids, 0)


def test_unsupported_inputs_use_the_generate_path_and_say_so(pair):
    target, draft = pair
    ids = torch.tensor([[0, 4, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1]])  # a padded single sequence
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with attach(target, lambda s: 3, compression="fp32", mode="fixed") as h:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert h.draft_loop == "generate (padded attention mask)"
    with pytest.raises(ValueError, match="unknown draft_loop"):
        attach(target, lambda s: 3, compression="fp32", mode="fixed", settings={"draft_loop": "fast"})


@pytest.mark.parametrize("loop", ["lean", "generate"])
def test_drafts_are_the_drafts_own_greedy_continuation_after_rejections_and_plain_steps(pair, loop):
    """Regression: a rejected draft token followed by plain (gamma 0) steps once stayed in the generate() path's
    cache, and the draft proposed from a context with a hole (token 23 where the draft's own argmax is 55)."""
    target, draft = pair
    seen = []
    real = candidates.SpeckvCandidateGenerator.get_candidates

    def spy(self, input_ids, **kw):
        out = real(self, input_ids, **kw)
        seen.append((input_ids.clone(), out[0].clone()))
        return out

    candidates.SpeckvCandidateGenerator.get_candidates = spy
    try:
        _run(target, draft, torch.tensor([[1, 1]]), 24, [0, 0, 2], "fixed", loop)
    finally:
        candidates.SpeckvCandidateGenerator.get_candidates = real
    checked = 0
    for ctx, cand in seen:
        ids = ctx
        for tok in cand[0, ctx.shape[1] :].tolist():
            with torch.no_grad():
                want = int(draft(ids).logits[0, -1].argmax())  # no cache at all
            assert tok == want, (loop, ctx.tolist())
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            checked += 1
    assert checked >= 8


def test_lean_loop_works_for_a_draft_without_logits_to_keep(pair):
    """Some architectures' forward takes no ``logits_to_keep``: the loop then asks for all positions' logits."""
    import inspect

    target, draft = pair
    real_forward = draft.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kw):
        assert "logits_to_keep" not in kw
        return real_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
        )

    forward.__signature__ = inspect.Signature(
        [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
            for n in ("input_ids", "attention_mask", "position_ids", "cache", "use_cache")
        ]
    )
    draft.forward = forward
    try:
        ids = torch.tensor([[4, 5, 6]])
        lean = LeanDraft(draft, [], do_sample=False, eos_token_id=None)
        assert "logits_to_keep" not in lean.forward_kwargs
        out, _ = lean.draft(ids, 5)
    finally:
        del draft.forward
    want = draft.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, want)


def test_sample_tokens_draws_each_row_from_its_distribution_and_never_a_zero():
    gen = torch.Generator().manual_seed(3)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]])
    torch.manual_seed(0)
    n = 20000
    draws = torch.cat([sample_tokens(probs) for _ in range(n)], dim=1)  # [2, n]
    for row in range(2):
        freq = torch.bincount(draws[row], minlength=6).double() / n
        assert (freq[probs[row] == 0] == 0).all()  # a zero-probability token is never drawn
        # chi-square, 5 / 1 degrees of freedom at most: far below the 0.1% critical values (20.5 / 10.8)
        support = probs[row] > 0
        chi2 = float((n * (freq[support] - probs[row][support]) ** 2 / probs[row][support]).sum())
        assert chi2 < 10.8
    big = torch.softmax(torch.randn(1, 49152, generator=gen) * 3, -1)
    big[0, :100] = 0.0  # zeros at the start: u = 0 must not pick them
    assert all(int(sample_tokens(big)) >= 100 for _ in range(200))


def test_sample_tokens_falls_back_when_rounding_lands_on_a_zero(monkeypatch):
    probs = torch.tensor([[0.25, 0.75, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a[0], dtype=torch.float64))  # u = the total
    torch.manual_seed(1)
    assert all(int(sample_tokens(probs)) in (0, 1) for _ in range(50))  # clamped onto index 2 (p = 0): multinomial
    for bad in ([[float("nan"), 1.0]], [[0.0, 0.0]], [[-0.5, 1.5]], [[float("inf"), 1.0]]):
        with pytest.raises(RuntimeError, match="probability tensor|invalid multinomial"):  # multinomial's own errors
            sample_tokens(torch.tensor(bad))
