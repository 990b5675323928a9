"""A decode step for Llama-architecture drafts without transformers' per-call machinery.

A draft token of a small draft is mostly fixed cost: besides its arithmetic,
transformers' ``LlamaForCausalLM`` forward builds masks and position
embeddings, updates its cache object and dispatches seven projections per
layer (what the step saves end to end: docs/design.md). The
step runs the same arithmetic with
less around it: the query, key and value projections as one matrix product and
the gate and up projections as another (the weights concatenated once, rows
unchanged), the rotary tables computed once, and the keys and values written
into preallocated buffers, so that dropping rejected tokens is setting a
length. It computes what the model's forward computes, operation for operation
in the model's dtype (the same RMSNorm, rotary embedding, attention by
``torch.nn.functional.scaled_dot_product_attention`` and SiLU MLP), and returns
the last position's logits from the model's own ``lm_head``. A draft whose
projections :func:`~speckv_policy.hf.onednn.use_onednn_linear` converted runs
them through their own oneDNN layers instead (one call per projection: their
packed weights cannot be concatenated), which costs a bf16 draft token less on
a CPU that multiplies bf16 natively. A draft that adds
to its logits (the distilled draft's context-copy mixture) exposes
``speckv_decode_logits(input_ids, past, logits)`` and is handed them, as its
forward would do.

:func:`decode_step_blocker` says why a draft cannot take it: anything but a
plain Llama (other attention or rotary variants, biases, tensor-parallel
slicing, quantised or other projection layers, a forward that does more than
transformers' own), or a draft with forward hooks on it or its modules (e.g.
accelerate's offloading), which must see the calls they hook. Such drafts keep
their forward. The lean draft loop
(:class:`~speckv_policy.hf.lean_draft.LeanDraft`) uses the step where it can
(``attach(..., draft_forward='auto')``). Speculative decoding stays lossless
whatever the draft computes; ``tests/test_fast_draft.py`` checks the logits
against the model's forward through prefill, single and multi-token feeds and
crops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .onednn import OneDNNLinear

__all__ = ["LlamaDecodeStep", "decode_step_blocker"]

#: The hook a draft model may define to post-process its logits the way its forward does.
LOGITS_HOOK = "speckv_decode_logits"

_WEIGHTS: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], _Weights]] = weakref.WeakKeyDictionary()
#: The projection layers the step computes: torch's own, or oneDNN's (all of a layer's attention or MLP projections
#: of one kind, so that the plain ones can be concatenated)
_PROJECTIONS = (torch.nn.Linear, OneDNNLinear)


def decode_step_blocker(model: Any) -> str | None:
    """Why :class:`LlamaDecodeStep` cannot run ``model`` (None when it can).

    Parameters
    ----------
    model : transformers PreTrainedModel
        A draft model.

    Returns
    -------
    str or None
        A short reason, or None for a plain Llama decoder it computes exactly.
    """
    from transformers.models.llama import modeling_llama as ml

    if not isinstance(model, ml.LlamaForCausalLM):
        return f"not a Llama model ({type(model).__name__})"
    if type(model).forward is not ml.LlamaForCausalLM.forward and not callable(getattr(model, LOGITS_HOOK, None)):
        return f"{type(model).__name__} overrides forward without {LOGITS_HOOK}()"
    cfg = model.config
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if (getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    rope = getattr(model.model, "rotary_emb", None)
    if type(rope) is not ml.LlamaRotaryEmbedding or getattr(rope, "rope_type", "default") != "default":
        return "rotary embedding other than the default"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "sliding-window or other non-full attention layers"
    if type(model.model.norm) is not ml.LlamaRMSNorm:
        return "final norm other than LlamaRMSNorm"
    for name, module in model.named_modules():
        # torch keeps a module's hooks in private dicts (no public getter); hooks must see the forward calls they hook
        if module._forward_hooks or module._forward_pre_hooks:  # noqa: SLF001
            return f"forward hooks on {name or 'the model'}"
    for i, layer in enumerate(model.model.layers):
        if type(layer) is not ml.LlamaDecoderLayer:
            return f"layer {i} is a {type(layer).__name__}"
        for part, names in ((layer.self_attn, "qkvo"), (layer.mlp, ("gate", "up", "down"))):
            kinds = set()
            for name in names:
                proj = getattr(part, f"{name}_proj")
                if type(proj) not in _PROJECTIONS:
                    return (
                        f"layer {i} {name}_proj is a {type(proj).__name__}, not a plain torch.nn.Linear "
                        "(or its OneDNNLinear)"
                    )
                kinds.add(type(proj))
            if len(kinds) > 1:
                return f"layer {i} mixes torch.nn.Linear and OneDNNLinear {'attention' if names == 'qkvo' else 'MLP'} projections"
        if type(layer.input_layernorm) is not ml.LlamaRMSNorm or type(layer.post_attention_layernorm) is not (
            ml.LlamaRMSNorm
        ):
            return f"layer {i} norm other than LlamaRMSNorm"
    return None


def _single(proj: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> proj(x)`` without the module call's machinery (the blocker saw no hooks)."""
    if type(proj) is OneDNNLinear:
        return proj.forward
    weight = proj.weight
    return lambda x: F.linear(x, weight)


def _joint(*projs: Any) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """``x -> (p(x) for p in projs)``: one product over the weights concatenated once, or, for oneDNN layers
    (whose packed weights cannot be joined), one call each."""
    if type(projs[0]) is OneDNNLinear:
        calls = tuple(p.forward for p in projs)
        return lambda x: tuple(c(x) for c in calls)
    weight = torch.cat([p.weight for p in projs]).contiguous()
    sizes = [p.weight.shape[0] for p in projs]
    return lambda x: F.linear(x, weight).split(sizes, dim=-1)


class _Weights:
    """A model's weights arranged for the decode step (concatenated once per model and weight version)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.embed = model.model.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(
                    (
                        layer.input_layernorm.weight,
                        float(layer.input_layernorm.variance_epsilon),
                        _joint(a.q_proj, a.k_proj, a.v_proj),
                        _single(a.o_proj),
                        layer.post_attention_layernorm.weight,
                        float(layer.post_attention_layernorm.variance_epsilon),
                        _joint(m.gate_proj, m.up_proj),
                        _single(m.down_proj),
                        float(a.scaling),
                    )
                )
        self.norm = model.model.norm.weight
        self.norm_eps = float(model.model.norm.variance_epsilon)
        rope = model.model.rotary_emb
        self.inv_freq = rope.inv_freq.detach().float()
        self.rope_scale = float(rope.attention_scaling)
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.embed.device)

    def rotary(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions ``0 .. end - 1`` (as the model's rotary embedding computes them)."""
        if self.cos.shape[0] < end:
            size = max(end, 2 * self.cos.shape[0], 256)
            pos = torch.arange(size, device=self.inv_freq.device).float()[:, None]
            freqs = pos * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            dev = self.embed.device
            self.cos = (emb.cos() * self.rope_scale).to(device=dev, dtype=self.dtype)
            self.sin = (emb.sin() * self.rope_scale).to(device=dev, dtype=self.dtype)
        return self.cos, self.sin


def _signature(model: Any) -> tuple[int, ...]:
    # a tensor's version counter (bumped by every in-place write) has no public getter
    return tuple(x for p in model.parameters() for x in (p.data_ptr(), p._version))  # noqa: SLF001


def _weights(model: Any) -> _Weights:
    sig = _signature(model)
    hit = _WEIGHTS.get(model)
    if hit is None or hit[0] != sig:
        hit = (sig, _Weights(model))
        _WEIGHTS[model] = hit
    return hit[1]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: in float32, back to the input's dtype, times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaDecodeStep:
    """Cached forward steps of a plain Llama draft, batch 1, with its own key/value buffers.

    Parameters
    ----------
    model : transformers LlamaForCausalLM
        A model :func:`decode_step_blocker` accepts (checked here).

    Attributes
    ----------
    length : int
        Tokens whose keys and values the buffers hold.
    """

    def __init__(self, model: Any) -> None:
        why = decode_step_blocker(model)
        if why is not None:
            raise ValueError(f"LlamaDecodeStep cannot run this model: {why}")
        self.model = model
        self.w = _weights(model)
        self.hook = getattr(model, LOGITS_HOOK, None)
        self.length = 0
        w = self.w
        shape = (len(w.layers), w.kv_heads, 256, w.head_dim)
        self.keys = torch.zeros(shape, dtype=w.dtype, device=w.embed.device)
        self.values = torch.zeros_like(self.keys)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (drop the rest), as cropping a cache does."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} cached positions to {length}")
        self.length = int(length)

    def _room(self, end: int) -> None:
        have = self.keys.shape[2]
        if end <= have:
            return
        size = max(end, 2 * have)
        grow = (*self.keys.shape[:2], size - have, self.keys.shape[3])
        pad = torch.zeros(grow, dtype=self.keys.dtype, device=self.keys.device)
        self.keys = torch.cat([self.keys, pad], dim=2)
        self.values = torch.cat([self.values, pad], dim=2)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed ``input_ids`` ``[1, T]`` after the cached positions; the last position's logits ``[1, 1, V]``.

        The logits are in the model's dtype, after the model's ``speckv_decode_logits`` where it has one.
        """
        w = self.w
        past = self.length
        t = input_ids.shape[1]
        end = past + t
        self._room(end)
        cos_all, sin_all = w.rotary(end)
        cos, sin = cos_all[past:end], sin_all[past:end]
        nq = w.heads * w.head_dim
        x = F.embedding(input_ids[0], w.embed)  # [T, H]
        mask = None
        if t > 1:
            mask = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(past)
        for i, (n1, e1, qkv, o_proj, n2, e2, gate_up, down, scale) in enumerate(w.layers):
            q, k, v = qkv(_rms(x, n1, e1))
            q = q.view(t, w.heads, w.head_dim).transpose(0, 1)
            k = k.view(t, w.kv_heads, w.head_dim).transpose(0, 1)
            v = v.view(t, w.kv_heads, w.head_dim).transpose(0, 1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.keys[i, :, past:end] = k
            self.values[i, :, past:end] = v
            o = F.scaled_dot_product_attention(
                q[None],
                self.keys[i, :, :end][None],
                self.values[i, :, :end][None],
                attn_mask=mask,
                scale=scale,
                enable_gqa=w.heads != w.kv_heads,
            )
            x = x + o_proj(o[0].transpose(0, 1).reshape(t, nq))
            gate, up = gate_up(_rms(x, n2, e2))
            x = x + down(F.silu(gate) * up)
        self.length = end
        logits = self.model.lm_head(_rms(x[-1:], w.norm, w.norm_eps))[None]  # [1, 1, V]
        if self.hook is not None:
            logits = self.hook(input_ids, past, logits)
        return logits
