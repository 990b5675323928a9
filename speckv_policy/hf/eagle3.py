"""An EAGLE-3 draft head: one decoder layer reading the target's own hidden states, in the ``speculators`` format.

EAGLE-3 (Li et al., 2025) drafts from three of the target's hidden states
(low, middle and high layers, concatenated and projected by ``fc``) and the
embedding of the token sampled after them, through one Llama (or Qwen3) decoder layer
whose attention reads both (q/k/v over ``2 * hidden``; ``input_layernorm`` on
the embedding half, ``hidden_norm`` on the hidden half), a final ``norm`` and
an LM head over a reduced vocabulary (``d2t[i]`` is the offset from draft id
``i`` to its target id; ``t2d`` marks the target ids the head covers). Later
draft tokens read the layer's own output in place of the target's features.

The folder is the layout vLLM's ``speculators`` library defines and vLLM
serves: ``config.json`` (``speculators_model_type: "eagle3"``,
``transformer_layer_config``, ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size``,
``speculators_config`` naming the verifier) and ``model.safetensors``
(``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). The heads
built here store no input embedding: drafting reads the target's (vLLM shares
it too); a folder that carries ``embed_tokens`` drafts with it where it
differs from the target's, as vLLM does. Layer id
``k`` means the state entering the target's layer ``k`` (Hugging Face's
``hidden_states[k]``, vLLM's auxiliary layer ``k``).

The project's own ``speckv.json`` beside them may hold a context-copy gate
(:mod:`speckv_policy.hf.copy_gate`, key ``"copy"``): the hook then drafts
from the head's distribution mixed with n-gram lookup of the context, as the
distilled draft does. vLLM reads only the speculators files and serves the
head without it.

Loading reads JSON and safetensors only: nothing in the folder executes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..atomic import atomic_write_dir
from ..head_format import EAGLE3_CONFIG, EAGLE3_WEIGHTS, is_eagle3_dir
from .copy_gate import check_copy_gate, longest_suffix_match, mix_log_probs

__all__ = ["EAGLE3_CONFIG", "EAGLE3_WEIGHTS", "Eagle3Config", "Eagle3Head", "is_eagle3_dir", "load_eagle3"]

#: training metadata the project writes beside the speculators files (agreement, corpus, time)
EAGLE3_META = "speckv.json"


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 head is: its decoder layer's shape, its vocabulary and the target layers it reads.

    Parameters
    ----------
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim : int
        The decoder layer's shape (the target's, so that features and embeddings fit).
    vocab_size : int
        The target's vocabulary size.
    draft_vocab_size : int
        Tokens the head's LM head covers.
    aux_layer_ids : tuple of int
        Target layers whose input states the head reads (``hidden_states[k]``), low to high.
    rms_norm_eps, rope_theta : float
        As in the target.
    rope_parameters : dict or None
        The target's rotary scaling where it has one (transformers' ``rope_parameters``: ``rope_type`` ``linear``,
        ``llama3`` or ``yarn`` with its factors, ``rope_theta`` included); None for plain RoPE at ``rope_theta``.
    norm_before_residual : bool
        Whether the residual is the normalised hidden half (speculators' option; False by default).
    norm_before_fc : bool
        One RMSNorm (``input_norm``) over the concatenated target states before ``fc`` (speculators' gpt-oss option).
    fc_norm : bool
        One RMSNorm per target state (``fc_norm.{i}``) before ``fc``; exclusive with ``norm_before_fc``.
    norm_output : bool
        Later draft tokens read the layer's output after the final ``norm`` (speculators' "Eagle 3.1" option), not
        before it.
    verifier : str
        The target's name (``speculators_config.verifier.name_or_path``).
    layer_type : str
        The decoder layer's kind, speculators' ``transformer_layer_config.model_type``: ``"llama"``, or ``"qwen3"``
        (Qwen3's layer: RMSNorms over each head's queries and keys, ``q_norm`` / ``k_norm``).
    extra_layer_config : dict
        Further ``transformer_layer_config`` entries kept as read (written back unchanged).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_parameters: dict[str, Any] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    verifier: str = ""
    verifier_architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    layer_type: str = "llama"
    extra_layer_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(
        cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None, verifier: str = ""
    ) -> Eagle3Config:
        """The head shape for a Llama- or Qwen3-style target config; layers default to speculators' ``[2, L // 2,
        L - 3]``.

        Raises
        ------
        ValueError
            If ``aux_layer_ids`` is empty, not increasing, or names a layer the target does not have.
        """
        n = int(target_config.num_hidden_layers)
        ids = tuple(int(i) for i in aux_layer_ids) if aux_layer_ids is not None else (2, n // 2, n - 3)
        if not ids or any(i < 0 or i >= n for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(
                f"aux_layer_ids must be increasing layer indices in 0..{n - 1} of the target's {n} layers (the states "
                f"entering them, concatenated in layer order as vLLM does), got {list(ids)}"
            )
        rope = dict(getattr(target_config, "rope_parameters", None) or {})
        theta = float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
        scaled = rope.get("rope_type", "default") != "default"
        _check_rope_type(rope.get("rope_type", "default"), "the target's rope_parameters")
        extra = {"max_position_embeddings": int(target_config.max_position_embeddings)} if scaled else {}
        heads = int(target_config.num_attention_heads)
        return cls(
            hidden_size=int(target_config.hidden_size),
            intermediate_size=int(target_config.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(target_config, "num_key_value_heads", heads)),
            head_dim=int(getattr(target_config, "head_dim", None) or target_config.hidden_size // heads),
            vocab_size=int(target_config.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=ids,
            rms_norm_eps=float(target_config.rms_norm_eps),
            rope_theta=theta,
            rope_parameters=rope if scaled else None,
            verifier=verifier,
            verifier_architectures=tuple(getattr(target_config, "architectures", None) or ("LlamaForCausalLM",)),
            layer_type="qwen3" if getattr(target_config, "model_type", "llama") == "qwen3" else "llama",
            extra_layer_config=extra,
        )

    def to_speculators(self, speculative_tokens: int = 3) -> dict[str, Any]:
        """The ``config.json`` dict in the speculators ``eagle3`` format."""
        layer = dict(self.extra_layer_config)
        layer.update(
            {
                "model_type": self.layer_type,
                "architectures": [LAYER_TYPES[self.layer_type]],
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "num_hidden_layers": 1,
                "vocab_size": self.vocab_size,
                "rms_norm_eps": self.rms_norm_eps,
                "hidden_act": "silu",
                "attention_bias": False,
                "mlp_bias": False,
                "tie_word_embeddings": False,
                "rope_parameters": dict(
                    self.rope_parameters or {"rope_theta": self.rope_theta, "rope_type": "default"}
                ),
            }
        )
        options = {k: True for k in ("norm_before_fc", "fc_norm", "norm_output") if getattr(self, k)}
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            **options,
            "target_hidden_size": self.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "torch_dtype": "bfloat16",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": int(speculative_tokens),
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": self.verifier, "architectures": list(self.verifier_architectures)},
            },
        }

    @classmethod
    def from_speculators(cls, raw: Any, source: str = "config.json") -> Eagle3Config:
        """Read a speculators ``eagle3`` config dict; a missing or wrong field is a ValueError naming it."""

        def need(d: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
            if not isinstance(d, dict) or key not in d:
                raise ValueError(f"{source}: missing '{where}{key}' (a speculators eagle3 config)")
            v = d[key]
            if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
                raise ValueError(f"{source}: '{where}{key}' must be {kind}, got {v!r}")
            return v

        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        kind = raw.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"{source}: speculators_model_type must be 'eagle3', got {kind!r}")
        layer = need(raw, "transformer_layer_config", dict, "")
        layer_type = layer.get("model_type", "llama")
        if layer_type not in LAYER_TYPES:
            raise ValueError(
                f"{source}: transformer_layer_config.model_type {layer_type!r} is not supported "
                f"(supported: {', '.join(LAYER_TYPES)})"
            )
        if "sliding_attention" in (layer.get("layer_types") or []):
            raise ValueError(
                f"{source}: transformer_layer_config.layer_types: sliding-window attention is not supported"
            )
        n_layers = layer.get("num_hidden_layers", 1)
        if n_layers != 1:
            raise ValueError(f"{source}: transformer_layer_config.num_hidden_layers must be 1, got {n_layers!r}")
        ids = need(raw, "eagle_aux_hidden_state_layer_ids", list, "")
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{source}: 'eagle_aux_hidden_state_layer_ids' must be non-negative integers, got {ids!r}")
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(
                f"{source}: 'eagle_aux_hidden_state_layer_ids' must be increasing (vLLM concatenates the states in "
                f"layer order), got {ids!r}"
            )
        w = "transformer_layer_config."
        hidden = need(layer, "hidden_size", int, w)
        heads = need(layer, "num_attention_heads", int, w)
        rope = _rope_parameters(layer, source)
        theta = float(rope.get("rope_theta", 10000.0))
        target_hidden = raw.get("target_hidden_size") or hidden
        if target_hidden != hidden:
            raise ValueError(f"{source}: target_hidden_size {target_hidden} != hidden_size {hidden} is not supported")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        flags = {}
        for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            flag = raw.get(name, False)
            if not isinstance(flag, bool):
                raise ValueError(f"{source}: '{name}' must be true or false, got {flag!r}")
            flags[name] = flag
        if flags["norm_before_fc"] and flags["fc_norm"]:
            raise ValueError(f"{source}: 'norm_before_fc' and 'fc_norm' exclude each other (speculators' rule)")
        known = {
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "rope_parameters",
            "rope_theta",
            "rope_scaling",
        }
        return cls(
            hidden_size=hidden,
            intermediate_size=need(layer, "intermediate_size", int, w),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            vocab_size=need(layer, "vocab_size", int, w),
            draft_vocab_size=need(raw, "draft_vocab_size", int, ""),
            aux_layer_ids=tuple(ids),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_parameters=rope if rope["rope_type"] != "default" else None,
            **flags,
            verifier=str(verifier),
            layer_type=layer_type,
            extra_layer_config={k: v for k, v in layer.items() if k not in known},
        )


#: the decoder layers a head may have (speculators' ``model_type``) and the architecture name each is written with
LAYER_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

#: rotary types whose frequencies do not depend on the sequence length (transformers' names)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _check_rope_type(kind: Any, where: str) -> None:
    if kind not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_type {kind!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)}; "
            "'dynamic' and 'longrope' change with the sequence length)"
        )


def _rope_parameters(layer: dict[str, Any], source: str) -> dict[str, Any]:
    """A layer config's rotary parameters as transformers normalises them (legacy ``rope_scaling`` and ``rope_theta``
    included), checked to be a static type."""
    from transformers import LlamaConfig

    keys = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings")
    try:
        rope = dict(LlamaConfig(**{k: layer[k] for k in keys if layer.get(k) is not None}).rope_parameters or {})
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{source}: transformer_layer_config's rotary parameters are not readable ({e})") from None
    rope.setdefault("rope_type", "default")
    _check_rope_type(rope["rope_type"], f"{source}: transformer_layer_config")
    return rope


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in float32, scale in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, Llama's half-split convention; ``x`` is ``[B, heads, T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Eagle3Head(nn.Module):
    """The EAGLE-3 head's weights and its three computations: fuse, one layer step, logits.

    Parameters
    ----------
    config : Eagle3Config
        The head's shape.
    own_embedding : bool, default=False
        Whether the head carries an input embedding (``embed_tokens``, as speculators saves one); without one,
        drafting reads the target's (:meth:`input_embedding`).

    Notes
    -----
    ``self.config`` is a ``transformers.LlamaConfig`` view (vocabulary size,
    ``is_encoder_decoder``) so that ``generate(..., assistant_model=head)``
    accepts it; :attr:`eagle` is the :class:`Eagle3Config`.
    """

    def __init__(self, config: Eagle3Config, *, own_embedding: bool = False) -> None:
        super().__init__()
        from transformers import GenerationConfig, LlamaConfig

        c = config
        self.eagle = c
        self.config = LlamaConfig(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            num_hidden_layers=1,
            vocab_size=c.vocab_size,
        )
        self.generation_config = GenerationConfig()
        h, n_aux = c.hidden_size, len(c.aux_layer_ids)
        self.fc = nn.Linear(n_aux * h, h, bias=False)
        layer = nn.Module()
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, c.num_attention_heads * c.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, c.num_key_value_heads * c.head_dim, bias=False)
        attn.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, h, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        if c.layer_type == "qwen3":  # Qwen3: an RMSNorm over each head's queries and keys, before the rotation
            attn.q_norm = nn.Module()
            attn.q_norm.weight = nn.Parameter(torch.ones(c.head_dim))
            attn.k_norm = nn.Module()
            attn.k_norm.weight = nn.Parameter(torch.ones(c.head_dim))
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = nn.Parameter(torch.ones(h))
        layer.hidden_norm = nn.Module()
        layer.hidden_norm.weight = nn.Parameter(torch.ones(h))
        layer.post_attention_layernorm = nn.Module()
        layer.post_attention_layernorm.weight = nn.Parameter(torch.ones(h))
        self.layers = nn.ModuleList([layer])
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        if c.norm_before_fc:
            self.input_norm = nn.Module()
            self.input_norm.weight = nn.Parameter(torch.ones(n_aux * h))
        if c.fc_norm:
            self.fc_norm = nn.ModuleList()
            for _ in range(n_aux):
                norm = nn.Module()
                norm.weight = nn.Parameter(torch.ones(h))
                self.fc_norm.append(norm)
        #: the head's own input embedding, or None (drafting reads the target's; see :meth:`input_embedding`)
        self.embed_tokens = nn.Embedding(c.vocab_size, h) if own_embedding else None
        self._copy: dict[str, Any] | None = None
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        #: rotary frequencies, float32 whatever the weights' dtype (not a buffer, so ``.to(dtype)`` leaves it)
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        #: the rotary type's scale on cos and sin (yarn's; 1 otherwise)
        self.rope_scaling = 1.0
        if c.rope_parameters is not None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            view = LlamaConfig(
                hidden_size=c.hidden_size,
                num_attention_heads=c.num_attention_heads,
                head_dim=c.head_dim,
                max_position_embeddings=int(c.extra_layer_config.get("max_position_embeddings", 2048)),
                rope_parameters=dict(c.rope_parameters),
            )
            inv_freq, scale = ROPE_INIT_FUNCTIONS[c.rope_parameters["rope_type"]](view, "cpu")
            self.inv_freq, self.rope_scaling = inv_freq.float(), float(scale)

    @property
    def device(self) -> torch.device:
        """Where the head's weights are (read from a norm weight: linear layers may be swapped for oneDNN's)."""
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The head's weights' dtype."""
        return self.norm.weight.dtype

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Cover ``target_ids`` (sorted ascending, distinct): fills ``d2t`` (offsets) and ``t2d`` (a mask)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).to(self.d2t.device)
        if ids.numel() != self.eagle.draft_vocab_size:
            raise ValueError(f"expected {self.eagle.draft_vocab_size} token ids, got {ids.numel()}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("token ids must be distinct and ascending")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft-vocabulary slot."""
        return torch.arange(self.eagle.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Project the concatenated target states ``[..., n_aux * hidden]`` to ``[..., hidden]`` (after the
        config's ``norm_before_fc`` or ``fc_norm``, if any)."""
        c = self.eagle
        x = aux.to(self.dtype)
        if c.norm_before_fc:
            x = _rms_norm(x, self.input_norm.weight, c.rms_norm_eps)
        elif c.fc_norm:
            parts = x.chunk(len(c.aux_layer_ids), dim=-1)
            x = torch.cat([_rms_norm(p, n.weight, c.rms_norm_eps) for p, n in zip(parts, self.fc_norm)], dim=-1)
        return self.fc(x)

    def set_copy_gate(self, a: list[float], b: list[float], max_match: int) -> None:
        """Draft from the head's distribution mixed with context copy (:mod:`speckv_policy.hf.copy_gate`): one
        intercept ``a`` and confidence slope ``b`` per match length 1 .. ``max_match``."""
        gate = check_copy_gate({"max_match": max_match, "a": list(a), "b": list(b)}, "copy gate")
        gate["a"], gate["b"] = [round(x, 5) for x in gate["a"]], [round(x, 5) for x in gate["b"]]  # as stored
        self._copy = gate
        self._copy_ab = (torch.tensor(gate["a"]), torch.tensor(gate["b"]))  # once, not per draft token

    def clear_copy_gate(self) -> None:
        """Draft from the head's own distribution only."""
        self._copy = None

    def copy_gate(self) -> dict[str, Any] | None:
        """The gate as ``speckv.json`` stores it (``max_match``, ``a``, ``b``), or None."""
        return (
            None if self._copy is None else {k: (list(v) if isinstance(v, list) else v) for k, v in self._copy.items()}
        )

    def draft_log_probs(self, logits: torch.Tensor, history: Any, support: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary drafting scores ``[1, vocab]`` after ``history`` (the context and the tokens drafted so
        far, 1-D): ``logits`` (``-inf`` outside the head's vocabulary) unchanged without a copy gate, else
        ``log q'`` of the mixture with the context's copy candidate (which may lie outside the vocabulary).
        ``support``: :meth:`target_ids` on ``logits``' device, if the caller keeps it (computed here otherwise)."""
        gate = self._copy
        if gate is None:
            return logits
        cand, length = longest_suffix_match(np.asarray(history, dtype=np.int64), gate["max_match"])
        dev = logits.device
        a, b = self._copy_ab
        return mix_log_probs(
            logits.float(),
            torch.tensor([cand], device=dev),
            torch.tensor([length], device=dev),
            a.to(dev),
            b.to(dev),
            support=self.target_ids().to(dev) if support is None else support,
        )

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft token reads in place of the target's features: the layer output ``out`` (after the
        final norm where the config says ``norm_output``)."""
        if self.eagle.norm_output:
            return _rms_norm(out, self.norm.weight, self.eagle.rms_norm_eps)
        return out

    def input_embedding(self, target_embedding: torch.Tensor) -> torch.Tensor:
        """The embedding matrix drafting reads: the head's own where it carries one that differs from the target's
        (as vLLM does), else ``target_embedding``.

        A carried copy equal to the target's (speculators saves the verifier's frozen embedding) is dropped here,
        so the head holds no second copy after the first generation.
        """
        own = self.embed_tokens
        if own is None:
            return target_embedding
        w = own.weight.detach()
        if w.shape == target_embedding.shape and torch.equal(w.to(target_embedding), target_embedding):
            self.embed_tokens = None
            return target_embedding
        return w

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` (``[T]`` or ``[B, T]``), shaped to broadcast over heads."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.rope_scaling).to(self.dtype), (emb.sin() * self.rope_scaling).to(self.dtype)
        if cos.dim() == 2:
            return cos[None, None], sin[None, None]
        return cos[:, None], sin[:, None]

    def layer(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder-layer step over ``T`` new rows.

        Parameters
        ----------
        embeds, hidden : torch.Tensor of shape (B, T, hidden)
            The token embeddings and the (fused or own) hidden states of the new rows.
        rope : (cos, sin)
            From :meth:`rope` for the new rows' positions.
        past : (keys, values) or None
            Earlier rows' keys and values, ``[B, kv_heads, S, head_dim]``.
        mask : torch.Tensor or None
            Boolean ``[T, S + T]`` (or broadcastable): True where a new row may attend. None: causal over the new
            rows, all of ``past`` visible.

        Returns
        -------
        out, keys, values : torch.Tensor
            The layer's output ``[B, T, hidden]`` and the new rows' keys and values.
        """
        c = self.eagle
        lay = self.layers[0]
        a = lay.self_attn
        b, t, _ = embeds.shape
        embeds, hidden = embeds.to(self.dtype), hidden.to(self.dtype)
        normed_hidden = _rms_norm(hidden, lay.hidden_norm.weight, c.rms_norm_eps)
        x = torch.cat([_rms_norm(embeds, lay.input_layernorm.weight, c.rms_norm_eps), normed_hidden], dim=-1)
        residual = normed_hidden if c.norm_before_residual else hidden
        q = a.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if c.layer_type == "qwen3":
            q, k = _rms_norm(q, a.q_norm.weight, c.rms_norm_eps), _rms_norm(k, a.k_norm.weight, c.rms_norm_eps)
        cos, sin = rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        if mask is None and past is not None and past[0].shape[2] > 0:
            s = past[0].shape[2]
            mask = torch.ones(t, s + t, dtype=torch.bool, device=q.device).tril(s)
        groups = c.num_attention_heads // c.num_key_value_heads
        attn = F.scaled_dot_product_attention(
            q,
            keys.repeat_interleave(groups, dim=1),
            values.repeat_interleave(groups, dim=1),
            attn_mask=mask,
            is_causal=mask is None and t > 1,
            scale=1.0 / math.sqrt(c.head_dim),
        )
        h = residual + a.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        m = lay.mlp
        y = _rms_norm(h, lay.post_attention_layernorm.weight, c.rms_norm_eps)
        h = h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))
        return h, k, v

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., draft_vocab_size]`` of layer outputs."""
        return self.lm_head(_rms_norm(out, self.norm.weight, self.eagle.rms_norm_eps))

    def save(self, folder: str | Path, meta: dict[str, Any] | None = None, speculative_tokens: int = 3) -> None:
        """Write the speculators folder (bf16 weights, ``config.json``) and ``speckv.json`` (``meta`` and the copy
        gate, if any), atomically."""
        from safetensors.torch import save_file

        if self._copy is not None:  # the copy gate travels in speckv.json
            meta = {**(meta or {}), "copy": self.copy_gate()}

        def write(tmp: Path) -> None:
            sd = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
            sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in sd.items()}
            save_file(sd, str(tmp / EAGLE3_WEIGHTS), metadata={"format": "pt"})
            cfg = self.eagle.to_speculators(speculative_tokens)
            (tmp / EAGLE3_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
            if meta is not None:
                (tmp / EAGLE3_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

        atomic_write_dir(folder, write)


def load_eagle3(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Eagle3Head:
    """Load an EAGLE-3 head folder (speculators format).

    Raises
    ------
    FileNotFoundError
        If ``config.json`` or ``model.safetensors`` is missing.
    ValueError
        If the config is not an eagle3 config this module reads (one Llama or Qwen3 layer, a static rotary type),
        or a weight is missing, extra or misshapen (named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, w_path = folder / EAGLE3_CONFIG, folder / EAGLE3_WEIGHTS
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing (an EAGLE-3 head folder holds {EAGLE3_CONFIG} and {EAGLE3_WEIGHTS})")
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    cfg = Eagle3Config.from_speculators(raw, str(cfg_path))
    try:
        sd = load_file(str(w_path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{w_path}: not a readable safetensors file ({e})") from None
    head = Eagle3Head(cfg, own_embedding="embed_tokens.weight" in sd)
    if "d2t" not in sd and "t2d" not in sd and cfg.draft_vocab_size == cfg.vocab_size:
        # a full-vocabulary head may ship no vocabulary maps (vLLM reads it so): draft id i is target id i
        sd["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        sd["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    own = head.state_dict()
    missing = sorted(set(own) - set(sd))
    extra = sorted(set(sd) - set(own))
    if missing or extra:
        raise ValueError(f"{w_path}: weights do not match the config: missing {missing}, unexpected {extra}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{w_path}: '{k}' has shape {tuple(v.shape)}, the config implies {tuple(own[k].shape)}")
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()})
    meta_path = folder / EAGLE3_META
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except ValueError as e:
            raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
        if isinstance(meta, dict) and meta.get("copy") is not None:
            gate = check_copy_gate(meta["copy"], f"{meta_path} 'copy'")
            head.set_copy_gate(gate["a"], gate["b"], gate["max_match"])
    ids = head.target_ids()
    if int(ids.min()) < 0 or int(ids.max()) >= head.eagle.vocab_size or not bool(head.t2d[ids].all()):
        raise ValueError(f"{w_path}: d2t maps draft ids outside the vocabulary or disagrees with t2d")
    return head.to(device=device, dtype=dtype).eval()
