"""Draft with the draft model's own cached forward calls instead of ``generate()``.

Transformers' assisted generation drafts by calling ``assistant_model.generate``
once per speculation step, which rebuilds the generation config, the logits
processors, the stopping criteria and the cache bookkeeping every time: on a
2-core CPU that is milliseconds per step before the first draft token.
:class:`LeanDraft` does only what drafting needs: one forward call per draft
token on a cache it keeps across steps, the logits processors transformers
would apply (the target's list: temperature, top-k, top-p, repetition
penalty, ...), then argmax or a sample from the processed distribution (the
distribution ``generate`` samples from; on CPU drawn by inverse CDF,
:func:`sample_tokens`, ~10x cheaper than ``torch.multinomial`` over a large
vocabulary, ``benchmarks/draft_sampler.py`` at commit 730b4b6). It returns the processed
scores, which transformers' speculative sampling uses as the draft
distribution, so verification and acceptance stay transformers' own code.

The cache is kept consistent by comparing the tokens it holds with the
sequence the target hands back: after a step, the context and the accepted
draft tokens are a common prefix; everything after it (rejected draft tokens,
a probe the policy dropped) is cropped. Steps that skip the draft need no
bookkeeping at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessorList

from . import _compat

#: ``stop(k, scores, position) -> bool``: called after draft token ``k`` (1-based).
StopFn = Callable[[int, torch.Tensor, int], bool]


def sample_tokens(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]``, drawn from it exactly, shape ``[B, 1]``.

    On CPU by inverse CDF in float64 (one uniform per row, a cumulative sum and a
    binary search: ~70 us over a 49,152-entry vocabulary against ~740 us for
    ``torch.multinomial``, which draws one exponential per entry). A token of
    probability 0 is never drawn: should rounding land on one, the row is drawn by
    ``torch.multinomial``. Rows that are not distributions (a NaN, an infinity, a
    negative entry, a zero sum) go to ``torch.multinomial`` too, which raises its
    usual error. Elsewhere than on CPU, ``torch.multinomial``.
    """
    if probs.device.type != "cpu":
        return torch.multinomial(probs, num_samples=1)
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()) or bool((probs < 0).any()):
        return torch.multinomial(probs, num_samples=1)  # raises: not a distribution
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64) * total
    tok = torch.searchsorted(cdf, u, right=True).clamp_max(probs.shape[-1] - 1)
    bad = ~(probs.gather(-1, tok) > 0)
    if bool(bad.any()):
        tok = torch.where(bad, torch.multinomial(probs, num_samples=1), tok)
    return tok


class TokenChooser:
    """How a draft token is picked from its logits, as transformers' draft ``generate`` would.

    The target's logits processors (temperature, top-k, top-p, repetition penalty, ...), end-of-sequence
    suppressed below ``min_length``, then argmax or an exact sample (:func:`sample_tokens`). Shared by every
    drafting loop, so the draft distribution handed to speculative sampling is the one tokens were drawn from.
    """

    def __init__(
        self,
        logits_processor: Any,
        do_sample: bool,
        eos_token_id: int | list[int] | None,
        min_length: int,
        device: Any,
    ) -> None:
        self.processors = LogitsProcessorList(list(logits_processor or []))
        self.do_sample = bool(do_sample)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.min_length = int(min_length or 0)

    def choose(self, ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token [1, 1], processed scores [1, vocab])`` after context ``ids``; ``logits`` may be changed in place."""
        s = self.processors(ids, logits) if len(self.processors) else logits
        if self.eos is not None and ids.shape[1] < self.min_length:
            s[:, self.eos] = -float("inf")
        tok = sample_tokens(torch.softmax(s, dim=-1)) if self.do_sample else s.argmax(dim=-1, keepdim=True)
        return tok, s

    def is_eos(self, tok: torch.Tensor) -> bool:
        """Whether ``tok`` ends the sequence (drafting stops after it)."""
        return self.eos is not None and bool((tok[0, 0] == self.eos).any())


class LeanDraft:
    """Drafting loop for a decoder-only draft with full-attention dynamic cache layers.

    Parameters
    ----------
    model : transformers PreTrainedModel
        The draft.
    logits_processor : list of LogitsProcessor
        Applied to each draft token's logits, as transformers' candidate
        generator passes them to the draft's ``generate``.
    do_sample : bool
        Sample from the processed distribution (else argmax).
    eos_token_id : int, list of int or None
        Drafting stops after one of these tokens.
    min_length : int
        The target's ``min_length``: end-of-sequence tokens are suppressed while
        the sequence is shorter, like the draft's ``generate`` would.
    decode_step : LlamaDecodeStep or None
        Run the draft's forward steps through this
        (:class:`~speckv_policy.hf.fast_draft.LlamaDecodeStep`, its own key/value
        buffers) instead of the model's forward and a transformers cache.
    """

    def __init__(
        self,
        model: Any,
        logits_processor: Any,
        do_sample: bool,
        eos_token_id: int | list[int] | None,
        min_length: int = 0,
        decode_step: Any = None,
    ) -> None:
        self.model = model
        self.step = decode_step
        self.chooser = TokenChooser(logits_processor, do_sample, eos_token_id, min_length, model.device)
        self.cache = _compat.new_draft_cache(model) if decode_step is None else None
        self.forward_kwargs: dict[str, Any] = {"use_cache": True}
        if _compat.takes_logits_to_keep(model):
            self.forward_kwargs["logits_to_keep"] = 1  # the last position's logits only
        self.cache_arg = _compat.cache_keyword(model)
        self.cached = torch.empty(0, dtype=torch.long, device=model.device)  # the tokens the cache holds
        self.forwards = 0  # forward calls made
        self.fed = 0  # tokens fed to them (prefill included)

    def _sync(self, ids: torch.Tensor) -> int:
        """Crop the cache to its longest prefix shared with ``ids`` (at most ``len - 1``); return its length."""
        have = self.cached.shape[0]
        n = min(have, ids.shape[1] - 1)
        if n > 0:
            diff = (self.cached[:n] != ids[0, :n]).nonzero()
            if diff.numel():
                n = int(diff[0, 0])
        if n < have:
            if self.step is not None:
                self.step.truncate(n)
            else:
                self.cache.crop(n - have)
            self.cached = self.cached[:n]
        return n

    @torch.no_grad()
    def draft(
        self, input_ids: torch.Tensor, max_new: int, stop: StopFn | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft up to ``max_new >= 1`` tokens after ``input_ids`` (batch 1).

        Returns
        -------
        ids : torch.LongTensor of shape (1, len + k)
            The context followed by the ``k`` drafted tokens.
        scores : torch.Tensor of shape (1, k, vocab)
            The processed scores each token was picked from.
        """
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        start = input_ids.shape[1]
        past = self._sync(input_ids)
        feed = input_ids[:, past:]
        ids = input_ids
        scores: list[torch.Tensor] = []
        ones = (
            None
            if self.step is not None
            else torch.ones((1, start + max_new), dtype=torch.long, device=input_ids.device)
        )
        for k in range(1, max_new + 1):
            if self.step is not None:
                last = self.step(feed)
            else:
                last = self.model(
                    input_ids=feed,
                    attention_mask=ones[:, : ids.shape[1]],
                    **self.forward_kwargs,
                    **{self.cache_arg: self.cache},
                ).logits
            self.forwards += 1
            self.fed += feed.shape[1]
            logits = last[:, -1].to(copy=True, dtype=torch.float32)
            tok, s = self.chooser.choose(ids, logits)
            self.cached = ids[0]  # every token but the new one is now in the cache
            ids = torch.cat([ids, tok], dim=-1)
            scores.append(s)
            if stop is not None and stop(k, s[0], start + k - 1):
                break
            if k == max_new or self.chooser.is_eos(tok):
                break
            feed = tok
        return ids, torch.stack(scores, dim=1)
