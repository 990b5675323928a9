"""Context copy for the distilled draft: a learned mixture with n-gram lookup.

A 2-layer draft predicts free text well enough but cannot copy: summaries
repeat the passage, code repeats names, math repeats numbers. Prompt lookup
decoding fixes that with no model at all: find the most recent earlier
occurrence of the context's last ``m`` tokens and propose the token that
followed it. :class:`ContextCopyDraft` combines both as a proper
distribution (the mixture of :mod:`speckv_policy.hf.copy_gate`, whose
functions this module re-exports), so speculative sampling stays exact::

    q'(v) = (1 - g) q(v) + g [v == c],   g = sigmoid(a[m] + b[m] * log max_v q(v))

where ``q`` is the draft's own distribution, ``c`` the copy candidate, ``m``
the length of the longest suffix match (capped at ``max_match``; ``g = 0``
without a match) and ``a``, ``b`` are fitted by :func:`fit_copy_gate` on
answers the draft never fitted. The draft's logits are replaced by
``log q'``, so greedy drafting, sampling, HF's confidence threshold and the
features speckv logs all see the same distribution.

The copy candidate needs the token history, which a cached forward does not
receive: the model keeps it per batch row, indexed by the cache length, so
HF's cache cropping after a rejection simply overwrites stale entries.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from transformers import LlamaForCausalLM

from ..hf.copy_gate import (
    DEFAULT_MAX_MATCH,
    copy_argmax,
    copy_candidates,
    fit_copy_gate,
    gate_probability,
    longest_suffix_match,
    mix_log_probs,
)

__all__ = [
    "DEFAULT_MAX_MATCH",
    "ContextCopyDraft",
    "copy_argmax",
    "copy_candidates",
    "fit_copy_gate",
    "gate_probability",
    "longest_suffix_match",
    "mix_log_probs",
]


#: The name LlamaForCausalLM.forward gives its cache argument in the installed transformers (renamed in 5.2x).
_PARENT_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class ContextCopyDraft(LlamaForCausalLM):
    """The distilled draft with a fitted context-copy mixture on its output.

    Set the gate with :meth:`set_copy_gate`; until then the model behaves like a
    plain :class:`~transformers.LlamaForCausalLM`.
    """

    def set_copy_gate(self, a: list[float], b: list[float], max_match: int = DEFAULT_MAX_MATCH) -> None:
        """Install the gate parameters (one ``a`` and ``b`` per match length 1 .. ``max_match``)."""
        if len(a) != max_match or len(b) != max_match:
            raise ValueError(f"copy gate needs {max_match} values of a and b, got {len(a)} and {len(b)}")
        self.copy_a = torch.tensor([round(float(x), 5) for x in a], dtype=torch.float32)  # as draft.json keeps it
        self.copy_b = torch.tensor([round(float(x), 5) for x in b], dtype=torch.float32)
        self.copy_max_match = int(max_match)
        self._history = np.zeros((0, 0), dtype=np.int64)

    def clear_copy_gate(self) -> None:
        """Remove the gate: the model is then the plain draft."""
        self.copy_a = self.copy_b = None

    def copy_gate(self) -> dict[str, Any] | None:
        """The gate as stored in ``draft.json`` (None when unset)."""
        if getattr(self, "copy_a", None) is None:
            return None
        return {
            "max_match": self.copy_max_match,
            "a": [round(float(x), 5) for x in self.copy_a],
            "b": [round(float(x), 5) for x in self.copy_b],
        }

    def use_history(self, tokens: Any) -> None:
        """The tokens before the next forward's ``input_ids`` (one sequence), for callers interleaving sequences.

        The gate reads the whole sequence but a forward with a cache sees only its new tokens, so the model keeps
        the sequence it last ran. A caller that runs several sequences in turn, each with its own cache (the vLLM
        proposer), says which one comes next; ``tokens`` must be as long as that sequence's cache.
        """
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        self._history = np.concatenate([ids, np.zeros((1, max(64, ids.shape[1])), dtype=np.int64)], axis=1)

    def _remember(self, input_ids: torch.Tensor, past: int) -> np.ndarray:
        ids = input_ids.detach().cpu().numpy()
        rows, end = ids.shape[0], past + ids.shape[1]
        hist = self._history
        if hist.shape[0] != rows or past == 0:
            hist = np.zeros((rows, max(end, 64)), dtype=np.int64)
        elif hist.shape[1] < end:
            hist = np.concatenate(
                [hist, np.zeros((rows, max(end, 2 * hist.shape[1]) - hist.shape[1]), dtype=np.int64)], axis=1
            )
        hist[:, past:end] = ids
        self._history = hist
        return hist[:, :end]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        """LlamaForCausalLM's forward, with the kept positions' logits replaced by ``log q'``.

        ``logits_to_keep`` is named so that ``generate`` asks for the last position only.
        """
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        past = cache.get_seq_length() if cache is not None else 0
        kwargs[_PARENT_CACHE_ARG] = cache  # transformers 5.2x calls it 'cache', earlier 5.x 'past_key_values'
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        if getattr(self, "copy_a", None) is None or input_ids is None:
            return out
        out.logits = self.speckv_decode_logits(input_ids, past, out.logits)
        return out

    def speckv_decode_logits(self, input_ids: torch.Tensor, past: int, logits: torch.Tensor) -> torch.Tensor:
        """The kept positions' logits ``[B, kept, V]`` after feeding ``input_ids`` at cache length ``past``, mixed.

        What :meth:`forward` applies to the plain model's logits (``log q'``, in their dtype; unchanged
        without a gate). :class:`~speckv_policy.hf.fast_draft.LlamaDecodeStep` calls it the same way.
        """
        if getattr(self, "copy_a", None) is None:
            return logits
        hist = self._remember(input_ids, past)
        kept = logits.shape[1]
        first = hist.shape[1] - kept
        cand = np.empty((hist.shape[0], kept), dtype=np.int64)
        length = np.empty_like(cand)
        for row in range(hist.shape[0]):
            cand[row], length[row] = copy_candidates(hist[row], first, kept, self.copy_max_match)
        scores = logits.float()
        dev = scores.device
        mixed = mix_log_probs(
            scores,
            torch.from_numpy(cand).to(dev),
            torch.from_numpy(length).to(dev),
            self.copy_a.to(dev),
            self.copy_b.to(dev),
            inplace=True,
            support=getattr(self.lm_head, "token_ids", None),  # a pruned head: the rest is -inf
        )
        return mixed.to(logits.dtype)
