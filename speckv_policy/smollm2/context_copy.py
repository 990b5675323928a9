"""Context copy for the distilled draft: a learned mixture with n-gram lookup.

A 2-layer draft predicts free text well enough but cannot copy: summaries
repeat the passage, code repeats names, math repeats numbers. Prompt lookup
decoding fixes that with no model at all: find the most recent earlier
occurrence of the context's last ``m`` tokens and propose the token that
followed it. :class:`ContextCopyDraft` combines both as a proper
distribution, so speculative sampling stays exact::

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

DEFAULT_MAX_MATCH = 8


def longest_suffix_match(history: np.ndarray, max_match: int = DEFAULT_MAX_MATCH) -> tuple[int, int]:
    """The token that followed the most recent longest match of the context's suffix.

    Parameters
    ----------
    history : numpy.ndarray
        1-D token ids, the context up to and including the current token.
    max_match : int
        Longest suffix length compared.

    Returns
    -------
    candidate : int
        The token after the matched occurrence, or -1 without any match.
    length : int
        The match length (1 .. ``max_match``), 0 without any match.
    """
    n = len(history)
    if n < 2:
        return -1, 0
    ends = np.flatnonzero(history[:-1] == history[-1])  # earlier occurrences of the current token
    if ends.size == 0:
        return -1, 0
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for k in range(1, min(max_match, n - 1)):
        back = ends - k
        alive &= back >= 0
        alive[alive] = history[back[alive]] == history[n - 1 - k]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    end = int(ends[length == best][-1])
    return int(history[end + 1]), best


def copy_candidates(
    ids: np.ndarray, first: int, count: int, max_match: int = DEFAULT_MAX_MATCH
) -> tuple[np.ndarray, np.ndarray]:
    """Copy candidate and match length for positions ``first .. first + count - 1`` of ``ids``.

    Position ``t`` predicts token ``t + 1`` from ``ids[: t + 1]``.
    """
    cand = np.full(count, -1, dtype=np.int64)
    length = np.zeros(count, dtype=np.int64)
    for k in range(count):
        cand[k], length[k] = longest_suffix_match(ids[: first + k + 1], max_match)
    return cand, length


def gate_probability(log_conf: torch.Tensor, length: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Copy weight ``g`` per position (0 where ``length`` is 0)."""
    idx = (length.clamp(min=1, max=len(a)) - 1).long()
    g = torch.sigmoid(a[idx] + b[idx] * log_conf)
    return torch.where(length > 0, g, torch.zeros_like(g))


def mix_log_probs(
    logits: torch.Tensor,
    cand: torch.Tensor,
    length: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    inplace: bool = False,
    support: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log q'`` from the draft's logits ``[..., V]`` (float32; overwritten when ``inplace``).

    ``cand`` and ``length`` hold the copy candidate and match length per position ``[...]``.
    ``support``, when given, holds the vocabulary ids whose logits may be finite (a pruned
    head's tokens; every other logit must be -inf): the normaliser and the top probability
    are then reduced over those ids only, the same values at a sixth of the cost for the
    shipped draft's 8,192-token head.
    """
    out = logits if inplace else logits.clone()
    part = out if support is None else out.index_select(-1, support)
    lse = torch.logsumexp(part, -1, keepdim=True)
    g = gate_probability((part.amax(-1, keepdim=True) - lse).squeeze(-1), length, a, b)
    out.sub_(lse - torch.log1p(-g).unsqueeze(-1))  # log of (1 - g) q
    where = ((length > 0) & (cand >= 0)).nonzero(as_tuple=True)
    if where[0].numel():
        at = (*where, cand[where])
        out[at] = torch.logaddexp(out[at], torch.log(g[where]))  # + g at the candidate
    return out


def copy_argmax(
    head_logits: torch.Tensor,
    head_ids: torch.Tensor,
    slots: torch.Tensor,
    cand: torch.Tensor,
    length: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """The argmax of :func:`mix_log_probs` without building full-vocabulary logits.

    Parameters
    ----------
    head_logits : torch.Tensor
        ``[P, H]`` the draft's logits over its head tokens (every other token has q = 0).
    head_ids : torch.Tensor
        ``[H]`` the vocabulary id of each head slot.
    slots : torch.Tensor
        ``[V]`` each vocabulary id's head slot, -1 outside the head.
    cand, length : torch.Tensor
        ``[P]`` copy candidate and match length per position.
    a, b : torch.Tensor
        The gate.

    Returns
    -------
    torch.Tensor
        ``[P]`` vocabulary ids: the candidate where ``g + (1 - g) q(c) >= (1 - g) max q``, else the draft's argmax.
    """
    log_q = torch.log_softmax(head_logits.float(), -1)
    top = log_q.max(-1).values
    g = gate_probability(top, length, a, b)
    slot = slots[cand.clamp_min(0)]
    q_cand = torch.where(
        (cand >= 0) & (slot >= 0), log_q.gather(1, slot.clamp_min(0)[:, None]).squeeze(1).exp(), torch.zeros_like(top)
    )
    take = (length > 0) & (cand >= 0) & (g + (1 - g) * q_cand >= (1 - g) * top.exp())
    return torch.where(take, cand, head_ids[log_q.argmax(-1)])


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


def fit_copy_gate(
    log_q_teacher: torch.Tensor,
    teacher_p: torch.Tensor,
    teacher_is_cand: torch.Tensor,
    log_conf: torch.Tensor,
    length: torch.Tensor,
    max_match: int = DEFAULT_MAX_MATCH,
    steps: int = 300,
) -> tuple[list[float], list[float]]:
    """Fit the gate by the teacher's cross-entropy under the mixture.

    Parameters
    ----------
    log_q_teacher : torch.Tensor
        ``[P, K]`` the draft's log-probabilities of the teacher's top-K tokens (-inf outside the head).
    teacher_p : torch.Tensor
        ``[P, K]`` the teacher's probabilities of those tokens (renormalised over the K).
    teacher_is_cand : torch.Tensor
        ``[P, K]`` bool, whether each of those tokens is the copy candidate.
    log_conf : torch.Tensor
        ``[P]`` the draft's log max probability.
    length : torch.Tensor
        ``[P]`` match lengths; only positions with a match are used.
    max_match : int
        Number of gate parameters per kind.
    steps : int
        Adam steps (full batch).

    Returns
    -------
    a, b : list of float
        Gate intercepts and confidence slopes per match length 1 .. ``max_match``.
    """
    use = length > 0
    lq, p, hit, conf, m = log_q_teacher[use], teacher_p[use], teacher_is_cand[use], log_conf[use], length[use]
    lq = lq.clamp_min(-60.0)  # finite, so that logaddexp has finite gradients
    floor = torch.full_like(lq, -60.0)
    a = torch.zeros(max_match, requires_grad=True)
    b = torch.zeros(max_match, requires_grad=True)
    opt = torch.optim.Adam([a, b], lr=0.05)
    for _ in range(steps):
        g = gate_probability(conf, m, a, b).unsqueeze(-1)
        mixed = torch.logaddexp(
            lq + torch.log1p(-g.clamp_max(1 - 1e-6)), torch.where(hit, torch.log(g.clamp_min(1e-30)), floor)
        )
        loss = -(p * mixed).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return a.detach().tolist(), b.detach().tolist()
