"""Tiny random Llama pairs built in code, for mechanics tests only.

They prove plumbing (losslessness, profiling, quantized loading) without any
download; no figure about speed or quality may come from them. The draft is a
noisy copy of the target so that it agrees with it part of the time and both
the accept and the reject paths of verification run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_pair(
    vocab_size: int = 64,
    hidden_size: int = 64,
    layers: int = 2,
    noise: float = 0.03,
    seed: int = 0,
    init_range: float = 0.3,
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A random target and a draft = target with Gaussian weight noise.

    ``noise`` is relative to each weight tensor's standard deviation; 0 makes
    the draft identical to the target.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_range,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * init_range)
        draft = copy.deepcopy(target)
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    target.generation_config.pad_token_id = None
    draft.generation_config.pad_token_id = None
    return target.eval(), draft.eval()


def save_tiny_pair(folder: str | Path, **kwargs: object) -> tuple[Path, Path]:
    """Save :func:`tiny_llama_pair` to ``folder/target`` and ``folder/draft``."""
    folder = Path(folder)
    target, draft = tiny_llama_pair(**kwargs)  # type: ignore[arg-type]
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return folder / "target", folder / "draft"
