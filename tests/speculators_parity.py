"""Run by vLLM's environment (tests/test_vllm.py): speckv's EAGLE-3 head computes what speculators' own model computes.

For each of speculators' head options (``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``, a
trained input embedding, Llama-3's and YaRN's rotary scaling, Qwen3's decoder layer) it builds speculators' ``Eagle3DraftModel`` with random weights, saves it with speculators'
own ``save_pretrained``, loads that folder with :func:`speckv_policy.hf.eagle3.load_eagle3`, and runs both on the same
random target states and tokens, at positions from 3001, for three training-time-test steps (the first draft token, then two read from the
head's own output, teacher-forced, as speculators' forward does). Prints ``RESULT {json}``: per option, the largest
absolute logit difference of each step and whether the argmax tokens agree. Run from outside the repository: its
``datasets/`` folder would shadow the ``datasets`` package speculators imports.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from speculators import SpeculatorModelConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from torch.nn import functional as F
from transformers import LlamaConfig

from speckv_policy.hf.eagle3 import Eagle3Config, load_eagle3

VARIANTS = {
    "default": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},
    "trained_embedding": {"embed_requires_grad": True},
    "llama3_rope": {"rope": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "yarn_rope": {"rope": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 1024}},
    "qwen3_layer": {"layer": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}},
}  # fmt: skip
#: the first row's position: far enough that a scaled rotary type turns its slow frequencies measurably
FIRST_POSITION = 3001
STEPS, WIDTH, VOCAB, DRAFT_VOCAB = 3, 12, 300, 100


def speculators_head(folder: Path, options: dict, gen: torch.Generator) -> Eagle3DraftModel:
    """speculators' own head with random weights for a tiny Llama target, saved by speculators to ``folder``."""
    target = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6,
        vocab_size=VOCAB, rms_norm_eps=1e-6,
    )  # fmt: skip
    raw = Eagle3Config.for_target(target, DRAFT_VOCAB, (1, 3, 4), verifier="tiny").to_speculators()
    rope = options.get("rope")
    raw.update({k: v for k, v in options.items() if k not in ("rope", "layer")})
    raw["transformer_layer_config"].update(options.get("layer", {}))
    if rope is not None:
        raw["transformer_layer_config"].update(rope_parameters=rope, max_position_embeddings=4096)
    spec = folder / "spec"
    spec.mkdir()
    (spec / "config.json").write_text(json.dumps(raw))
    cfg = SpeculatorModelConfig.from_pretrained(str(spec))
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001 - speculators' own default needs flex
    model = Eagle3DraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") or ".weight" not in name else 0.1
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
        ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
        model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        model.t2d.zero_()
        model.t2d[ids] = True
    model.save_pretrained(str(folder / "saved"))
    return model


def compare(options: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = speculators_head(Path(tmp), options, gen)
        ours = load_eagle3(Path(tmp) / "saved")
    aux = torch.randn(1, WIDTH, 3 * 64, generator=gen)
    ids = torch.randint(0, VOCAB, (1, WIDTH), generator=gen)
    captured: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
    with torch.no_grad():
        positions = FIRST_POSITION + torch.arange(WIDTH)[None]
        theirs(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=positions,
               ttt_steps=STEPS)  # fmt: skip
    hook.remove()
    # the target's embedding differs from a trained one: the head must read its own where it carries one
    target_embedding = torch.randn(VOCAB, 64, generator=gen)
    if not options.get("embed_requires_grad"):
        target_embedding = theirs.embed_tokens.weight.detach().clone()
    embed = ours.input_embedding(target_embedding)
    causal = torch.ones(WIDTH, WIDTH, dtype=torch.bool).tril()
    rows = torch.arange(WIDTH)
    steps, keys, values = [], [], []
    with torch.no_grad():
        hidden = ours.fuse(aux)
        for s in range(STEPS):
            tokens = torch.cat([ids[:, s:], ids.new_zeros(1, s)], dim=1)  # speculators' teacher forcing
            past = None if s == 0 else (torch.cat(keys, dim=2), torch.cat(values, dim=2))
            mask = None if s == 0 else torch.cat([causal] + [torch.eye(WIDTH, dtype=torch.bool)] * s, dim=1)
            out, k, v = ours.layer(F.embedding(tokens, embed), hidden, ours.rope(rows + FIRST_POSITION + s), past, mask)
            keys.append(k)
            values.append(v)
            logits = ours.logits(out)
            steps.append(
                {
                    "max_abs_diff": float((logits - captured[s]).abs().max()),
                    "argmax_equal": bool(torch.equal(logits.argmax(-1), captured[s].argmax(-1))),
                    "scale": float(captured[s].abs().max()),
                }
            )
            hidden = ours.next_hidden(out)
    return {"steps": steps, "own_embedding": ours.embed_tokens is not None}


def main() -> None:
    result = {name: compare(opts, seed) for seed, (name, opts) in enumerate(VARIANTS.items())}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
