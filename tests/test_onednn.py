"""oneDNN linear layers for a float32 target on CPU: same function as nn.Linear, lossless speculation on top."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speckv_policy.hf import attach, onednn
from speckv_policy.hf.onednn import (
    LINEAR_BACKENDS,
    ONEDNN_DTYPES,
    OneDNNLinear,
    apply_linear_backend,
    fused_linear_available,
    onednn_available,
    use_onednn_linear,
)
from speckv_policy.testing import tiny_llama_pair

from .test_hf_hook import SAMPLING_PAIR, SAMPLING_PROMPT, _assisted_vs_draft_sampling, _cycle

pytestmark = [
    pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN"),
    pytest.mark.filterwarnings("ignore:.*generation_config.*together.*"),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 24), (1, 7, 24), (1, 1, 24), (2, 3, 4, 24), (0, 24)])
def test_onednn_linear_computes_what_the_layer_computes(fused, bias, shape, monkeypatch):
    if fused:
        assert fused_linear_available(), "this torch build should run oneDNN's fused linear"
    else:  # a build without the fused op: the same weights through layout conversions
        monkeypatch.setattr(onednn, "fused_linear_available", lambda dtype=torch.float32: False)
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    fast = OneDNNLinear(lin)
    assert fast.fused is fused and ("(fused)" if fused else "(converted)") in repr(fast)
    x = torch.randn(*shape)
    strided = torch.randn(*shape[:-1], 48)[..., ::2]  # a non-contiguous input is fine too
    with torch.no_grad():
        expected = lin(x)
        got = fast(x)
        got_strided = fast(strided)
        expected_strided = lin(strided)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_strided, expected_strided, rtol=1e-5, atol=1e-5)
    assert (fast.in_features, fast.out_features) == (24, 40) and "onednn" in repr(fast)
    # with autograd on, an input that needs gradients takes the conversions (the fused op has no autograd kernel)
    x.requires_grad_(True)
    torch.testing.assert_close(fast(x).detach(), expected, rtol=1e-5, atol=1e-5)


def test_a_fused_op_that_disagrees_is_not_used(monkeypatch):
    fused_linear_available.cache_clear()
    try:
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, b, *a: torch.zeros(2, 3, 24))
        assert not fused_linear_available()
        fused_linear_available.cache_clear()

        def missing(*args):
            raise RuntimeError("Could not run 'mkldnn::_linear_pointwise' with arguments from the 'CPU' backend")

        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", missing)
        assert not fused_linear_available()
    finally:
        monkeypatch.undo()
        fused_linear_available.cache_clear()
    assert fused_linear_available()


#: Whether this CPU runs oneDNN's fused linear in bfloat16 (it needs avx512bw/vl/dq or avx_ne_convert: an AMD EPYC
#: without them runs float32 only); the bf16 tests check the refusal instead where it cannot.
BF16 = fused_linear_available(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU cannot run oneDNN's fused linear in bfloat16")


class _QuantizedLike(torch.nn.Linear):
    """Stands in for bitsandbytes' layers (subclasses of nn.Linear with their own forward)."""


def test_only_plain_cpu_linears_of_the_dtypes_asked_for_are_swapped():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 8)),
        torch.nn.Linear(8, 8).to(torch.bfloat16),
        _QuantizedLike(8, 8),
        torch.nn.Linear(8, 8).to(torch.float16),
    )
    assert use_onednn_linear(model) == 2  # float32 by default
    assert isinstance(model[0], OneDNNLinear) and isinstance(model[1][1], OneDNNLinear)
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is _QuantizedLike
    assert use_onednn_linear(model) == 0  # nothing left to convert
    assert apply_linear_backend(model, "default") == 0
    with pytest.warns(UserWarning, match="no float32 nn.Linear on CPU to convert"):
        assert apply_linear_backend(model, "onednn") == 0
    if BF16:
        assert apply_linear_backend(model, "onednn", dtypes=ONEDNN_DTYPES) == 1  # the bf16 layer (a bf16 draft's)
        assert isinstance(model[2], OneDNNLinear) and model[2].fused and type(model[4]) is torch.nn.Linear
    else:
        with pytest.raises(RuntimeError, match="cannot run oneDNN's fused linear in torch.bfloat16"):
            apply_linear_backend(model, "onednn", dtypes=ONEDNN_DTYPES)
    with pytest.raises(ValueError, match=r"dtypes \[torch.float16\] cannot run on oneDNN here"):
        use_onednn_linear(model, dtypes=(torch.float16,))


@needs_bf16
def test_a_bf16_layer_runs_fused_and_computes_what_the_layer_computes(monkeypatch):
    assert fused_linear_available(torch.bfloat16), "this torch build should run oneDNN's fused linear in bf16"
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).to(torch.bfloat16)
    fast = OneDNNLinear(lin)
    assert fast.fused
    x = torch.randn(1, 5, 64).to(torch.bfloat16)
    with torch.no_grad():
        got, want = fast(x), lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)  # bf16 rounding, another order
    x.requires_grad_(True)  # with autograd on: the conversions' way, the same values
    torch.testing.assert_close(fast(x).detach().float(), want.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="fused=False is for float32"):
        OneDNNLinear(lin, fused=False)
    monkeypatch.setattr(onednn, "fused_linear_available", lambda dtype=torch.float32: dtype == torch.float32)
    with pytest.raises(RuntimeError, match="cannot run oneDNN's fused linear in torch.bfloat16"):
        OneDNNLinear(lin)
    with pytest.raises(RuntimeError, match="cannot run oneDNN's fused linear in torch.bfloat16"):
        use_onednn_linear(torch.nn.Sequential(lin), dtypes=ONEDNN_DTYPES)


@needs_bf16
def test_a_draft_on_onednn_keeps_speculation_lossless(converted_pair):
    """A bf16 draft on oneDNN's fused linear proposes other tokens at most; the output stays the target's."""
    target, _, _ = converted_pair
    _, draft = tiny_llama_pair(seed=0)
    draft = draft.to(torch.bfloat16)
    assert apply_linear_backend(draft, "onednn", dtypes=ONEDNN_DTYPES) > 0
    ids = torch.tensor([[3, 17, 8, 41, 5]])
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    with attach(target, _cycle([1, 4, 0, 3]), mode="upfront", feature_set="online", compression="fp32") as h:
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref) and sum(s.drafted for s in h.stats) > 0


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown linear backend 'mkl'; expected one of default, onednn"):
        apply_linear_backend(torch.nn.Linear(2, 2), "mkl")
    with pytest.raises(TypeError, match="plain torch.nn.Linear, got _QuantizedLike"):
        OneDNNLinear(_QuantizedLike(2, 2))
    with pytest.raises(ValueError, match="float32 or bfloat16 weight on CPU, got torch.float16"):
        OneDNNLinear(torch.nn.Linear(2, 2).to(torch.float16))


def test_the_way_can_be_chosen(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    assert use_onednn_linear(model, fused=False) == 2 and not model[0].fused and not model[1].fused
    assert OneDNNLinear(torch.nn.Linear(8, 8), fused=True).fused
    monkeypatch.setattr(onednn, "fused_linear_available", lambda dtype=torch.float32: False)
    with pytest.raises(RuntimeError, match="cannot run oneDNN's fused linear in torch.float32"):
        OneDNNLinear(torch.nn.Linear(8, 8), fused=True)
    with pytest.raises(RuntimeError, match="cannot run oneDNN's fused linear in torch.float32"):
        use_onednn_linear(torch.nn.Linear(8, 8), fused=True)


def test_cli_choices_are_the_backends():
    from speckv_policy.cli.common import TARGET_LINEAR_CHOICES

    assert TARGET_LINEAR_CHOICES == LINEAR_BACKENDS


@pytest.fixture(scope="module")
def converted_pair():
    target, draft = tiny_llama_pair(seed=0)
    reference, _ = tiny_llama_pair(seed=0)
    assert use_onednn_linear(target) > 0
    return target, draft, reference


def test_converted_target_keeps_its_logits(converted_pair):
    target, _, reference = converted_pair
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=10),
    mode=st.sampled_from(["upfront", "fixed", "pre"]),
    prompt=st.lists(st.integers(1, 63), min_size=1, max_size=10),
    n_new=st.integers(1, 30),
)
def test_greedy_output_is_the_converted_targets(converted_pair, gammas, mode, prompt, n_new):
    target, draft, _ = converted_pair
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=n_new, do_sample=False)
    kw = {} if mode == "fixed" else {"feature_set": "pre" if mode == "pre" else "online"}
    with attach(target, _cycle(gammas), compression="fp32", mode=mode, **kw, settings={"max_gamma": 8}):
        out = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)


def test_sampling_keeps_the_converted_targets_distribution(draft_samples):
    target, draft = tiny_llama_pair(**SAMPLING_PAIR)
    use_onednn_linear(target)
    ids, vocab = torch.tensor(SAMPLING_PROMPT), SAMPLING_PAIR["vocab_size"]
    h, p_assisted, p_draft, _ = _assisted_vs_draft_sampling(
        target, draft, ids, vocab, mode="pre", draft_counts=draft_samples
    )
    assert max(s.gamma for s in h.stats) >= 1
    assert p_assisted > 0.001
    assert p_draft < 1e-6  # the test can tell a wrong distribution apart
