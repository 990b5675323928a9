"""Drafting with an EAGLE-3 head inside Hugging Face assisted generation.

The target's features come from its own verification passes: forward
pre-hooks on the decoder layers the head reads (:class:`TargetFeatureTap`)
keep the states entering them, and after each verification only the
positions the target kept (the context and the accepted draft tokens) are
handed to the head (:meth:`Eagle3Drafter.add_features`). The head's cache
holds one row per position with target features; rows drafted from the head's
own outputs are dropped after every step. The first step of a generation
drafts nothing (the target's prefill provides the first features).

Verification and acceptance stay transformers' own code, so the output is the
target's whatever the head proposes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from .eagle3 import Eagle3Head
from .lean_draft import StopFn, TokenChooser

__all__ = ["Eagle3Drafter", "TargetFeatureTap", "eagle3_blocker"]


def _decoder_layers(target: Any) -> Any:
    """The target's list of decoder layers (Llama-style ``model.layers``), or None."""
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def eagle3_blocker(target: Any, head: Eagle3Head) -> str | None:
    """Why ``head`` cannot draft for ``target`` (None: it can)."""
    layers = _decoder_layers(target)
    if layers is None:
        return f"{type(target).__name__} has no Llama-style model.layers to read features from"
    c = head.eagle
    bad = [i for i in c.aux_layer_ids if i >= len(layers)]
    if bad:
        return f"the head reads target layers {list(c.aux_layer_ids)} but the target has {len(layers)}"
    cfg = getattr(target, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    vocab = getattr(cfg, "vocab_size", None)
    if hidden != c.hidden_size:
        return f"the head reads hidden size {c.hidden_size}, the target's is {hidden}"
    if vocab != c.vocab_size:
        return f"the head's vocabulary has {c.vocab_size} ids, the target's {vocab}"
    return None


class TargetFeatureTap:
    """Forward pre-hooks that keep the states entering the target's layers ``layer_ids`` on each forward.

    Parameters
    ----------
    target : transformers model
        A Llama-style decoder (``model.layers``).
    layer_ids : tuple of int
        The layers whose inputs to keep (Hugging Face's ``hidden_states[k]``).
    """

    def __init__(self, target: Any, layer_ids: tuple[int, ...]) -> None:
        layers = _decoder_layers(target)
        if layers is None:
            raise ValueError(f"{type(target).__name__} has no Llama-style model.layers")
        self.layer_ids = tuple(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = []
        for i in sorted(set(self.layer_ids)):
            self.handles.append(layers[i].register_forward_pre_hook(self._keeper(i), with_kwargs=True))

    def _keeper(self, i: int) -> Callable[..., None]:
        def keep(module: Any, args: tuple, kwargs: dict) -> None:
            self.captured[i] = args[0] if args else kwargs["hidden_states"]

        return keep

    def take(self) -> torch.Tensor | None:
        """The last forward's states ``[T, n_layers * hidden]`` (batch row 0), or None if incomplete; clears."""
        got = self.captured
        self.captured = {}
        if any(i not in got for i in self.layer_ids):
            return None
        return torch.cat([got[i][0].detach() for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        """Unhook the target."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.captured = {}


class Eagle3Drafter:
    """The head's drafting loop and cache for one generation (batch 1).

    Parameters
    ----------
    head : Eagle3Head
        The draft head.
    embed : torch.Tensor
        The input embedding matrix ``[vocab, hidden]`` the head reads (:meth:`Eagle3Head.input_embedding`).
    logits_processor : list of LogitsProcessor
        Applied to each draft token's (full-vocabulary) logits, as transformers would.
    do_sample : bool
        Sample from the processed distribution (else argmax).
    eos_token_id : int, list of int or None
        Drafting stops after one of these tokens.
    min_length : int
        End-of-sequence tokens are suppressed while the sequence is shorter.
    """

    def __init__(
        self,
        head: Eagle3Head,
        embed: torch.Tensor,
        logits_processor: Any,
        do_sample: bool,
        eos_token_id: int | list[int] | None,
        min_length: int = 0,
    ) -> None:
        self.head = head
        self.embed = embed
        self.chooser = TokenChooser(logits_processor, do_sample, eos_token_id, min_length, head.device)
        self.vocab = head.eagle.vocab_size
        self.slots = head.target_ids().to(head.device)
        c = head.eagle
        shape = (1, c.num_key_value_heads, 0, c.head_dim)
        self.keys = torch.empty(shape, dtype=head.dtype, device=head.device)
        self.values = torch.empty(shape, dtype=head.dtype, device=head.device)
        self.rows = 0  # cache rows with target features: row j reads position j's features and token j + 1
        self.pending: list[torch.Tensor] = []  # target features not yet in the cache, for rows self.rows..
        self.known = 0  # positions with target features (in the cache or pending)

    def add_features(self, feats: torch.Tensor, first_position: int, keep_until: int) -> None:
        """Target states for positions ``first_position..`` of one forward; keep those before ``keep_until``.

        Raises
        ------
        ValueError
            If they leave a gap after the positions already known.
        """
        if first_position > self.known:
            raise ValueError(f"target features start at position {first_position}, {self.known} are known")
        new = feats[self.known - first_position : keep_until - first_position]
        if new.shape[0] > 0:
            self.pending.append(new.to(self.head.device))
            self.known += new.shape[0]

    def ready(self, context_len: int) -> bool:
        """Whether every position but the last of a ``context_len`` context has target features."""
        return self.known >= context_len - 1 and self.known > 0

    @torch.no_grad()
    def draft(
        self, input_ids: torch.Tensor, max_new: int, stop: StopFn | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft up to ``max_new >= 1`` tokens after ``input_ids`` (batch 1); see :meth:`ready`.

        Returns
        -------
        ids : torch.LongTensor of shape (1, len + k)
            The context followed by the ``k`` drafted tokens.
        scores : torch.Tensor of shape (1, k, vocab)
            The processed full-vocabulary scores each token was picked from (``-inf`` outside the head's vocabulary).
        """
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        head = self.head
        start = input_ids.shape[1]
        if not self.ready(start):
            raise ValueError(f"target features cover {self.known} positions; a {start}-token context needs {start - 1}")
        # drop the rows the last draft added, then read the new target features (rows self.rows .. start - 2)
        self.keys, self.values = self.keys[:, :, : self.rows], self.values[:, :, : self.rows]
        feats = torch.cat(self.pending)[: start - 1 - self.rows]
        self.pending = []
        self.known = start - 1
        tokens = input_ids[0, self.rows + 1 : start].to(head.device)
        positions = torch.arange(self.rows + 1, start, device=head.device)
        out = self._step(F.embedding(tokens, self.embed)[None], head.fuse(feats)[None], positions)
        self.rows = start - 1
        ids = input_ids
        scores: list[torch.Tensor] = []
        for k in range(1, max_new + 1):
            small = head.logits(out[:, -1]).float()
            logits = small.new_full((1, self.vocab), float("-inf"))
            logits[:, self.slots] = small
            logits = head.draft_log_probs(logits, ids[0].cpu().numpy(), self.slots)  # the copy mixture, if any
            tok, s = self.chooser.choose(ids, logits)
            ids = torch.cat([ids, tok.to(ids.device)], dim=-1)
            scores.append(s)
            if stop is not None and stop(k, s[0], start + k - 1):
                break
            if k == max_new or self.chooser.is_eos(tok):
                break
            pos = torch.tensor([start + k - 1], device=head.device)
            out = self._step(F.embedding(tok.to(head.device), self.embed), head.next_hidden(out[:, -1:]), pos)
        return ids, torch.stack(scores, dim=1)

    def _step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run new rows through the head's layer on the cache; returns their outputs."""
        past = (self.keys, self.values) if self.keys.shape[2] else None
        out, k, v = self.head.layer(embeds, hidden, self.head.rope(positions), past)
        self.keys = torch.cat([self.keys, k], dim=2)
        self.values = torch.cat([self.values, v], dim=2)
        return out
