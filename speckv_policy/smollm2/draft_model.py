"""The distilled SmolLM2 draft as a model: its pruned head, building it from the target, saving and loading.

Shipped weights hold only what differs from the target (the two layers, the
final norm, the head and its token ids) in fp16; :func:`load_draft` rebuilds
the draft from them and the target's embedding, with the context-copy gate
from ``draft.json`` (:mod:`speckv_policy.smollm2.context_copy`). How it is
trained lives in :mod:`speckv_policy.smollm2.distill`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_write_dir
from .gguf import target_state

DRAFT_FILE = "draft.safetensors"
DRAFT_META = "draft.json"


class PrunedHead(nn.Module):
    """Linear head over a subset of the vocabulary; other tokens get -inf.

    The draft can then only propose head tokens, which keeps speculative
    sampling exact (a token the draft never proposes has q = 0).
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.register_buffer("token_ids", token_ids.long(), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = hidden @ self.weight.t()
        out = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, small)


def build_draft(
    layers: tuple[int, ...],
    head_ids: torch.Tensor,
    config: Any = None,
    state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A draft initialised from the target: chosen layers copied, head from embedding rows."""
    import copy

    from .context_copy import ContextCopyDraft

    if config is None or state is None:
        config, state = target_state()
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = False
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    model = ContextCopyDraft(cfg)
    sd = {
        "model.embed_tokens.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    for new, old in enumerate(layers):
        for k, v in state.items():
            pre = f"model.layers.{old}."
            if k.startswith(pre):
                sd[f"model.layers.{new}." + k[len(pre) :]] = v
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    emb = state["model.embed_tokens.weight"]
    model.lm_head = PrunedHead(emb[head_ids].clone(), head_ids, cfg.vocab_size)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model.to(dtype).eval()


def save_draft(model: Any, folder: str | Path, meta: dict[str, Any]) -> None:
    """Write only what differs from the target (fp16), atomically."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        sd = {
            k: v.detach().to(torch.float16).contiguous()
            for k, v in model.state_dict().items()
            if not k.startswith("model.embed_tokens") and k != "lm_head.token_ids"
        }
        sd["lm_head.token_ids"] = model.lm_head.token_ids.to(torch.int32).contiguous()
        save_file(sd, str(tmp / DRAFT_FILE))
        (tmp / DRAFT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(folder, write)


def load_draft(folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Rebuild the shipped draft from its folder and the target's embedding.

    Raises
    ------
    FileNotFoundError
        If the folder lacks the weights or metadata.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / DRAFT_FILE).exists() or not (folder / DRAFT_META).exists():
        raise FileNotFoundError(f"{folder}: expected {DRAFT_FILE} and {DRAFT_META} (a speckv distilled draft)")
    meta = json.loads((folder / DRAFT_META).read_text())
    sd = load_file(str(folder / DRAFT_FILE))
    head_ids = sd.pop("lm_head.token_ids").long()
    config, state = target_state()
    model = build_draft(tuple(meta["layers"]), head_ids, config, state)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) == {"model.embed_tokens.weight"}, (missing, unexpected)
    model.generation_config.pad_token_id = None
    if meta.get("copy"):
        model.set_copy_gate(meta["copy"]["a"], meta["copy"]["b"], meta["copy"]["max_match"])
    return model.to(device=device, dtype=dtype).eval()


def head_slots(model: Any) -> torch.Tensor:
    """For every vocabulary id, its index in the draft's head (-1 outside it)."""
    slots = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    slots[model.lm_head.token_ids] = torch.arange(len(model.lm_head.token_ids))
    return slots
