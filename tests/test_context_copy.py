"""The draft's context copy: n-gram lookup, the mixture, cached forwards, losslessness, the gate fit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from speckv_policy.hf import attach
from speckv_policy.smollm2.context_copy import (
    ContextCopyDraft,
    copy_argmax,
    copy_candidates,
    fit_copy_gate,
    gate_probability,
    longest_suffix_match,
    mix_log_probs,
)
from speckv_policy.testing import tiny_llama_pair

from .test_hf_hook import _assisted_vs_draft_sampling

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


def _brute_force(seq: list[int], max_match: int) -> tuple[int, int]:
    best, cand = 0, -1
    for end in range(len(seq) - 1):  # an earlier occurrence ending at `end`, followed by seq[end + 1]
        m = 0
        while m < max_match and end - m >= 0 and seq[end - m] == seq[len(seq) - 1 - m]:
            m += 1
        if m >= 1 and m >= best:  # longest, then most recent
            best, cand = m, seq[end + 1]
    return cand, best


@pytest.mark.parametrize(
    "seq, max_match, expected",
    [
        ([5, 6, 7, 5, 6], 8, (7, 2)),  # "5 6" was followed by 7
        ([1, 2, 3], 8, (-1, 0)),  # the last token never occurred before
        ([4], 8, (-1, 0)),
        ([1, 9, 1, 8, 1], 8, (8, 1)),  # equal lengths: the most recent occurrence
        ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 8, (9, 3)),  # the longer match wins over the more recent one
        ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, (7, 2)),  # capped at 2: both match 2, the most recent wins
        ([7, 7, 7], 8, (7, 2)),  # overlapping occurrences
    ],
)
def test_longest_suffix_match_hand_cases(seq, max_match, expected):
    assert longest_suffix_match(np.array(seq), max_match) == expected


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=40), max_match=st.integers(1, 6))
def test_longest_suffix_match_equals_brute_force(seq, max_match):
    assert longest_suffix_match(np.array(seq), max_match) == _brute_force(seq, max_match)


def test_copy_candidates_per_position():
    ids = np.array([1, 2, 3, 1, 2, 4])
    cand, length = copy_candidates(ids, 2, 4)  # positions 2..5 predict tokens 3..6
    assert cand.tolist() == [-1, 2, 3, -1] and length.tolist() == [0, 1, 2, 0]


def test_mixture_is_a_distribution_with_the_stated_weights():
    log_q = torch.log_softmax(
        torch.tensor([[2.0, 1.0, 0.0, -torch.inf], [0.5, 0.5, 0.5, -torch.inf], [1.0, 0.0, 0.0, -torch.inf]]), -1
    )
    cand = torch.tensor([1, 3, -1])  # row 1: a candidate the draft gives q = 0; row 2: no match
    length = torch.tensor([2, 1, 0])
    a, b = torch.tensor([0.5, -1.0]), torch.tensor([0.2, 0.3])
    mixed = mix_log_probs(log_q, cand, length, a, b)
    torch.testing.assert_close(torch.logsumexp(mixed, -1), torch.zeros(3))
    q = log_q.exp()
    for row in range(2):
        g = torch.sigmoid(a[length[row] - 1] + b[length[row] - 1] * log_q[row].max())
        expected = (1 - g) * q[row]
        expected[cand[row]] += g
        torch.testing.assert_close(mixed[row].exp(), expected)
    torch.testing.assert_close(mixed[2], log_q[2])  # no match: the draft unchanged
    assert gate_probability(log_q.max(-1).values, length, a, b)[2] == 0


def test_copy_argmax_is_the_argmax_of_the_mixture():
    gen = torch.Generator().manual_seed(0)
    vocab, head_ids = 20, torch.tensor([1, 4, 6, 9, 13, 17])
    slots = torch.full((vocab,), -1, dtype=torch.long)
    slots[head_ids] = torch.arange(len(head_ids))
    head_logits = torch.randn(500, len(head_ids), generator=gen) * 2
    full = torch.full((500, vocab), -torch.inf)
    full[:, head_ids] = head_logits
    cand = torch.randint(-1, vocab, (500,), generator=gen)  # in the head, outside it, or none
    length = torch.where(cand >= 0, torch.randint(0, 4, (500,), generator=gen), 0)
    a, b = torch.tensor([-0.5, 0.5, 1.0]), torch.tensor([-0.3, -0.4, -0.2])
    picked = copy_argmax(head_logits, head_ids, slots, cand, length, a, b)
    torch.testing.assert_close(picked, mix_log_probs(full, cand, length, a, b).argmax(-1))
    assert (picked == cand).any() and (picked != cand).any()  # both branches ran


def test_mixture_reduced_over_a_pruned_heads_support_equals_the_full_one():
    gen = torch.Generator().manual_seed(1)
    vocab, head_ids = 30, torch.tensor([0, 3, 7, 8, 21, 29])
    full = torch.full((2, 40, vocab), -torch.inf)
    full[..., head_ids] = torch.randn(2, 40, len(head_ids), generator=gen) * 3
    cand = torch.randint(-1, vocab, (2, 40), generator=gen)  # in the head, outside it, or none
    length = torch.where(cand >= 0, torch.randint(0, 4, (2, 40), generator=gen), 0)
    a, b = torch.tensor([-0.5, 0.5, 1.0]), torch.tensor([-0.3, -0.4, -0.2])
    expected = mix_log_probs(full, cand, length, a, b)
    got = mix_log_probs(full.clone(), cand, length, a, b, inplace=True, support=head_ids)
    torch.testing.assert_close(got, expected)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[head_ids] = False
    outside = outside.expand_as(got).clone()
    outside[(*((length > 0) & (cand >= 0)).nonzero(as_tuple=True), cand[(length > 0) & (cand >= 0)])] = False
    assert torch.isneginf(got[outside]).all()  # q' = 0 off the head except at a copy candidate
    torch.testing.assert_close(torch.logsumexp(got, -1), torch.zeros(2, 40))


def _copy_draft(draft, a, b, max_match):
    model = ContextCopyDraft(draft.config)
    model.load_state_dict(draft.state_dict())
    model.generation_config.pad_token_id = None
    model.set_copy_gate(a, b, max_match)
    return model.eval()


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_llama_pair(seed=0, noise=0.3)
    return target, _copy_draft(draft, [2.0, 3.0, 4.0], [0.0, 0.0, 0.0], 3)


def test_cached_forward_equals_full_forward_even_after_a_crop(pair):
    _, model = pair
    seq = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 6, 1, 2]])
    with torch.no_grad():
        full = model(seq).logits
        assert not torch.allclose(full, super(ContextCopyDraft, model).forward(seq).logits)  # the copy acts
        cache = DynamicCache(config=model.config)
        out = model(seq[:, :6], cache=cache, use_cache=True)
        steps = [out.logits]
        for t in range(6, 10):
            out = model(seq[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, 1), full[:, :10], atol=1e-5, rtol=1e-5)
        # a rejection: HF crops the cache and feeds other tokens; the kept history must follow
        other = torch.tensor([[9, 9, 1, 2]])
        out.cache.crop(-3)  # 10 cached tokens -> 7
        crop_out = model(other, cache=out.cache, use_cache=True)
        torch.testing.assert_close(
            crop_out.logits, model(torch.cat([seq[:, :7], other], 1)).logits[:, 7:], atol=1e-5, rtol=1e-5
        )


def test_plain_model_without_a_gate(pair):
    _, model = pair
    plain = _copy_draft(model, [0.0], [0.0], 1)
    plain.clear_copy_gate()
    assert plain.copy_gate() is None
    seq = torch.tensor([[1, 2, 1, 2]])
    with torch.no_grad():
        torch.testing.assert_close(plain(seq).logits, super(ContextCopyDraft, plain).forward(seq).logits)
    with pytest.raises(ValueError, match="needs 2 values"):
        plain.set_copy_gate([0.0], [0.0, 1.0], 2)


@settings(max_examples=12, deadline=None)
@given(
    prompt=st.lists(st.integers(1, 6), min_size=2, max_size=12),
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=6),
    n_new=st.integers(1, 30),
)
def test_greedy_output_is_the_targets_with_a_copying_draft(pair, prompt, gammas, n_new):
    target, draft = pair
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=n_new, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=draft), ref)
    it = itertools.cycle(gammas)
    with attach(target, lambda f: next(it), compression="fp32", feature_set="online"):
        out = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)


def test_sampling_keeps_the_target_distribution_with_a_copying_draft():
    target, draft = tiny_llama_pair(vocab_size=12, hidden_size=32, noise=0.3, seed=3, init_range=0.15)
    draft = _copy_draft(draft, [1.5, 2.5], [0.0, 0.0], 2)
    ids = torch.tensor([[1, 2, 3, 1, 2]])  # "1 2" occurred before: the copy proposes 3
    h, p_assisted, p_draft, draft_counts = _assisted_vs_draft_sampling(target, draft, ids, 12)
    assert h.summary()["acceptance"] > 0.1 and max(s.gamma for s in h.stats) >= 1
    assert p_assisted > 0.001
    assert draft_counts[3].sum() > 0.5 * draft_counts.sum()  # it copies
    assert p_draft < 1e-6  # the copying draft's own samples: the test can tell them apart


def test_gate_fit_recovers_a_synthetic_ground_truth():
    """Synthetic data with a known gate: the teacher's token is the copy candidate with probability
    g + (1 - g) q(c), else drawn from the draft's q."""
    gen = torch.Generator().manual_seed(0)
    n, k = 40000, 4
    true_a, true_b = [-1.0, 1.0], [-0.5, 0.5]
    log_q = torch.log_softmax(torch.randn(n, k, generator=gen) * 1.5, -1)
    length = torch.randint(0, 3, (n,), generator=gen)
    g = gate_probability(log_q.max(-1).values, length, torch.tensor(true_a), torch.tensor(true_b))
    cand = torch.randint(0, k, (n,), generator=gen)
    mix = (1 - g)[:, None] * log_q.exp()
    mix[torch.arange(n), cand] += g
    token = torch.multinomial(mix, 1, generator=gen).squeeze(1)
    teacher_p = torch.nn.functional.one_hot(token, k).float()
    hit = torch.arange(k)[None] == cand[:, None]
    a, b = fit_copy_gate(log_q, teacher_p, hit, log_q.max(-1).values, length, max_match=2, steps=600)
    np.testing.assert_allclose(a, true_a, atol=0.15)
    np.testing.assert_allclose(b, true_b, atol=0.15)
