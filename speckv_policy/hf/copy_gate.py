"""A context-copy mixture on a draft's distribution: n-gram lookup of the context, gated by the draft's confidence.

A small draft predicts free text well enough but cannot copy: summaries repeat the passage, code repeats names, math
repeats numbers. Prompt lookup decoding fixes that with no model at all: find the most recent earlier occurrence of
the context's last ``m`` tokens and propose the token that followed it. The mixture combines both as a proper
distribution, so speculative sampling stays exact::

    q'(v) = (1 - g) q(v) + g [v == c],   g = sigmoid(a[m] + b[m] * log max_v q(v))

where ``q`` is the draft's own distribution, ``c`` the copy candidate, ``m`` the length of the longest suffix match
(capped at ``max_match``; ``g = 0`` without a match) and ``a``, ``b`` are fitted by :func:`fit_copy_gate` on answers
the draft never fitted. The distilled SmolLM2 draft (:mod:`speckv_policy.smollm2.context_copy`) and the EAGLE-3 head
(:class:`speckv_policy.hf.eagle3.Eagle3Head`) both draft through it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "DEFAULT_MAX_MATCH",
    "check_copy_gate",
    "copy_argmax",
    "copy_candidates",
    "copy_fit_rows",
    "fit_copy_gate",
    "gate_probability",
    "longest_suffix_match",
    "mix_log_probs",
]

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


def copy_fit_rows(
    log_q: torch.Tensor,
    top_ids: torch.Tensor,
    top_logp: torch.Tensor,
    slots: torch.Tensor,
    cand: torch.Tensor,
    length: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs :func:`fit_copy_gate` takes, from a draft's log-probabilities over its head ``log_q [P, H]``, the
    teacher's top-K ids and log-probabilities ``[P, K]``, each vocabulary id's head slot (``slots [V]``, -1 outside
    the head) and the copy candidates and match lengths ``[P]``."""
    at = slots[top_ids]
    lq = torch.where(at >= 0, log_q.gather(1, at.clamp_min(0)), torch.full(at.shape, -60.0, device=log_q.device))
    p = top_logp.float().exp()
    return lq, p / p.sum(-1, keepdim=True), top_ids == cand[:, None], log_q.max(-1).values, length


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


def check_copy_gate(gate: object, source: str) -> dict:
    """A stored gate (``{"max_match": M, "a": [M floats], "b": [M floats]}``) checked; a ValueError names ``source``."""
    if not isinstance(gate, dict) or not {"max_match", "a", "b"} <= set(gate):
        raise ValueError(f"{source}: a copy gate is an object with 'max_match', 'a' and 'b', got {gate!r}")
    m = gate["max_match"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"{source}: copy gate 'max_match' must be an integer >= 1, got {m!r}")
    for key in ("a", "b"):
        v = gate[key]
        ok = isinstance(v, list) and len(v) == m
        ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in v)
        if not ok:
            raise ValueError(f"{source}: copy gate '{key}' must be {m} finite numbers, got {v!r}")
    return {"max_match": int(m), "a": [float(x) for x in gate["a"]], "b": [float(x) for x in gate["b"]]}
