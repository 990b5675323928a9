"""The Llama decode step: the model's own logits through feeds and crops, which drafts it takes, the hook's choice."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from speckv_policy.hf import attach
from speckv_policy.hf.fast_draft import LlamaDecodeStep, decode_step_blocker
from speckv_policy.hf.onednn import OneDNNLinear, fused_linear_available, use_onednn_linear
from speckv_policy.testing import tiny_llama_pair

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")


@pytest.fixture(scope="module")
def pair():
    return tiny_llama_pair(seed=3)


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1:]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.lists(st.integers(0, 63), min_size=12, max_size=40),
    ops=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=12),
)
def test_decode_step_gives_the_models_logits_through_feeds_and_crops(pair, tokens, ops):
    """Feed chunks of 1-5 tokens, dropping 0-3 positions before some (as a rejected draft is dropped): after every
    call the last position's logits equal the model's full forward over the same prefix."""
    _, draft = pair
    step = LlamaDecodeStep(draft)
    seq: list[int] = []
    pool = iter(tokens * 4)
    for size, drop in ops:
        drop = min(drop, step.length - 1) if step.length > 1 else 0
        if drop:
            step.truncate(step.length - drop)
            seq = seq[: step.length]
        chunk = [next(pool) for _ in range(size)]
        seq += chunk
        got = step(torch.tensor([chunk]))
        assert step.length == len(seq)
        torch.testing.assert_close(got, _full_logits(draft, torch.tensor([seq])), rtol=1e-4, atol=1e-4)


def test_decode_step_grows_its_buffers_past_their_first_size(pair):
    _, draft = pair
    step = LlamaDecodeStep(draft)
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(0))
    step(ids[:, :250])
    for t in range(250, 300):
        got = step(ids[:, t : t + 1])
    assert step.keys.shape[2] >= 300
    torch.testing.assert_close(got, _full_logits(draft, ids), rtol=1e-4, atol=1e-4)


def test_decode_step_follows_weights_changed_in_place(pair):
    """The concatenated weights are rebuilt when a parameter changes (its version moves), never stale."""
    _, draft = pair
    model = copy.deepcopy(draft)
    ids = torch.tensor([[1, 5, 9, 2]])
    before = LlamaDecodeStep(model)(ids)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    after = LlamaDecodeStep(model)(ids)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, _full_logits(model, ids), rtol=1e-4, atol=1e-4)


def test_truncate_refuses_what_it_does_not_hold(pair):
    step = LlamaDecodeStep(pair[1])
    step(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="cannot truncate 3 cached positions to 4"):
        step.truncate(4)


def test_blocker_names_what_the_step_cannot_compute(pair):
    _, draft = pair
    assert decode_step_blocker(draft) is None

    class Overrides(type(draft)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    odd = copy.deepcopy(draft)
    odd.__class__ = Overrides
    assert decode_step_blocker(odd) == "Overrides overrides forward without speckv_decode_logits()"
    biased = copy.deepcopy(draft)
    biased.config.attention_bias = True
    assert decode_step_blocker(biased) == "attention or MLP biases"
    swapped = copy.deepcopy(draft)
    swapped.model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert decode_step_blocker(swapped) == (
        "layer 1 up_proj is a Identity, not a plain torch.nn.Linear (or its OneDNNLinear)"
    )
    assert decode_step_blocker(torch.nn.Linear(2, 2)) == "not a Llama model (Linear)"
    with pytest.raises(ValueError, match="cannot run this model: attention or MLP biases"):
        LlamaDecodeStep(biased)


@pytest.mark.skipif(not fused_linear_available(), reason="no oneDNN fused linear in this torch build")
def test_a_layer_with_both_kinds_of_projection_keeps_its_forward(pair):
    mixed = copy.deepcopy(pair[1])
    mixed.model.layers[0].self_attn.k_proj = OneDNNLinear(mixed.model.layers[0].self_attn.k_proj)
    assert decode_step_blocker(mixed) == "layer 0 mixes torch.nn.Linear and OneDNNLinear attention projections"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_on_onednn_layers_takes_the_decode_step(pair, dtype):
    """Converted by use_onednn_linear, the draft's step gives the converted model's own logits through feeds and
    crops, and the hook drafts through it with the target's output."""
    if not fused_linear_available(dtype):
        pytest.skip(f"no oneDNN fused linear in {dtype} in this torch build")
    target, draft = pair
    converted = copy.deepcopy(draft).to(dtype)
    assert use_onednn_linear(converted, dtypes=(dtype,)) == 2 * 7 + 1
    assert decode_step_blocker(converted) is None
    step = LlamaDecodeStep(converted)
    cache = DynamicCache()  # the model's own forward, fed the same chunks (in bf16 the chunking moves the rounding)
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(4))
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for end, drop in ((12, 0), (15, 2), (16, 0), (20, 3), (21, 0)):
        if drop:
            step.truncate(step.length - drop)
            cache.crop(-drop)
        chunk = ids[:, step.length : end]
        got = step(chunk)
        with torch.no_grad():
            want = converted(input_ids=chunk, cache=cache, use_cache=True).logits[:, -1:]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(got.float(), _full_logits(converted, ids[:, :end]).float(), rtol=0.1, atol=0.1)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with attach(target, lambda s: 3, compression="fp32", mode="fixed") as h:
        out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=converted)
    assert h.draft_forward == "fast"
    assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False))


def _steps(target, draft, ids, n_new, gammas, how, sample=False):
    it = itertools.cycle(gammas)
    with attach(target, lambda s: next(it), compression="fp32", mode="fixed", settings={"draft_forward": how}) as h:
        torch.manual_seed(0)
        out = target.generate(ids, max_new_tokens=n_new, do_sample=sample, assistant_model=draft)
    return out, [(s.gamma, s.drafted, s.accepted) for s in h.stats], h.draft_forward


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=8),
    prompt=st.lists(st.integers(1, 63), min_size=1, max_size=10),
    n_new=st.integers(1, 30),
)
def test_the_hook_drafts_the_same_steps_through_the_decode_step(pair, gammas, prompt, n_new):
    """attach(draft_forward='auto') runs a plain Llama draft through the decode step and takes the steps the
    draft's own forward takes; greedy output is the target's own."""
    target, draft = pair
    ids = torch.tensor([prompt])
    fast = _steps(target, draft, ids, n_new, gammas, "auto")
    slow = _steps(target, draft, ids, n_new, gammas, "transformers")
    assert fast[2] == "fast" and slow[2] == "transformers (draft_forward='transformers')"
    assert fast[1] == slow[1]
    assert torch.equal(fast[0], slow[0])
    assert torch.equal(fast[0], target.generate(ids, max_new_tokens=n_new, do_sample=False))


def test_sampling_through_the_decode_step_draws_what_the_forward_draws(pair):
    """Same seed, same draft distributions: the same sampled text and steps both ways."""
    target, draft = pair
    ids = torch.tensor([[7, 3, 9]])
    fast = _steps(target, draft, ids, 24, [3, 1, 4], "auto", sample=True)
    slow = _steps(target, draft, ids, 24, [3, 1, 4], "transformers", sample=True)
    assert fast[2] == "fast" and torch.equal(fast[0], slow[0]) and fast[1] == slow[1]


def test_a_draft_with_forward_hooks_keeps_its_forward(pair):
    """Hooks on the draft (a profiler's, accelerate's offloading) must see the calls they hook."""
    target, draft = pair
    calls = []
    hk = draft.model.layers[0].register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        assert decode_step_blocker(draft) == "forward hooks on model.layers.0"
        out, steps, how = _steps(target, draft, torch.tensor([[4, 2]]), 10, [2], "auto")
    finally:
        hk.remove()
    assert how == "transformers (forward hooks on model.layers.0)" and len(calls) >= len(steps) > 0
    assert decode_step_blocker(draft) is None


def test_unknown_draft_forward_is_refused(pair):
    with pytest.raises(ValueError, match="unknown draft_forward 'fastest'; expected one of auto, transformers"):
        attach(pair[0], lambda s: 1, compression="fp32", mode="fixed", settings={"draft_forward": "fastest"})


def test_shipped_draft_gives_its_forwards_logits_with_its_copy_mixture():
    """The distilled SmolLM2 draft (bf16, context-copy mixture through speckv_decode_logits): the decode step's
    logits are the model's cached forward's at every step of a draft that repeats its context."""
    from transformers import DynamicCache

    from speckv_policy.smollm2.draft_model import load_draft

    draft = load_draft("datasets/smollm2/draft", dtype=torch.bfloat16)
    assert decode_step_blocker(draft) is None
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 504, 3458, 314, 260, 1345, 28, 504, 3458]])
    step = LlamaDecodeStep(draft)
    cache = DynamicCache(config=draft.config)
    feeds = [ids[:, :10], ids[:, 10:11], ids[:, 11:13], ids[:, 13:14], ids[:, 14:15]]
    for feed in feeds:
        past = cache.get_seq_length()
        with torch.no_grad():
            want = draft(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=1).logits
        got = step(feed)
        assert step.length == past + feed.shape[1]
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=2e-2, atol=0.1)
