"""Generation replayed at every position: what a policy does online, without running the models again.

A step log (``speckv-profile``) records one step per speculation step of a
profiling run that drafted ``gamma_max`` tokens every time, so it knows every
gamma's outcome only at the positions that run stopped at (after each
verification, ~2 tokens apart). A policy that chooses gamma 0 advances one
token and decides again at a position the log never visited, and its
acceptance history stays where its last drafting step left it; replaying the
log's steps under-counts those plain steps (docs/design.md).

In greedy decoding the text does not depend on gamma (the target's own greedy
continuation), and a draft of ``g`` tokens starting after ``k`` generated tokens
keeps ``min(g, run[k])`` of them, where ``run[k]`` is how many of the draft's
proposals, teacher-forced on that text, match it in a row from position ``k``.
So one target pass for the text and one draft pass over it give every
position's outcome, and :func:`simulate` walks a policy through the text
exactly as generation would: decide, keep ``min(g, run[k])``, advance by that
plus one, update the history, price the step with a cost model.
(Bitsandbytes' INT8 / NF4 multi-token passes are not bit-identical to single
steps, so there a generation's text can differ at near ties.)

Sampling is lossless too: whatever the gammas, the text is a sample of the
target's own distribution. Given such a text, speculative sampling keeps the
draft's token at position ``k`` with probability ``min(1, q(t_k) / p(t_k))``
(it emits ``t_k`` either by keeping a draft token equal to it, probability
``min(p, q)(t_k)``, or by resampling, for ``p(t_k)`` in all), independently
at every position. :func:`realize` draws those events, the same for every
policy, and the walk is the greedy one; replications average over the draws.

This module is numpy only; ``benchmarks/dense_replay.py`` computes the texts and
runs with the real pair.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..decisions import DecisionMode, PlainDecider, PlainStopDecider, make_mode
from ..features import ContextMatcher, OnlineFeatureState
from ..objective import CostModel
from ..schema import COMPRESSION_CODES

__all__ = [
    "DenseResult",
    "DenseText",
    "hindsight_oracle",
    "kept_runs",
    "match_runs",
    "pool_results",
    "realize",
    "simulate",
    "simulate_hindsight",
]

#: How a simulated policy decides: ``'fixed'`` (``decide(step) -> gamma``), ``'pre'``
#: (``decide(pre_values) -> gamma``), ``'gated'`` (``gate(gated_values) -> bool`` with the probe
#: columns 0, as the hook asks it, then
#: ``decide(gated_values) -> gamma`` after the probe token), ``'upfront'``
#: (``decide(online_features) -> gamma`` after the probe token), ``'per-token'`` (after every draft
#: token, ``decide(online_features of that token) -> g``: keep it if ``g >= 1``, go on if ``g >= 2``, as
#: the hook's per-token mode; needs :attr:`DenseText.branches`) or ``'rule'`` (``decide`` is a history
#: rule with ``gamma()`` and ``observe(gamma, accepted)``, e.g. the race's SGLang- and vLLM-style
#: peers, kept across the texts as a server keeps it across requests), or ``'stop'`` (``decide`` is a
#: :class:`~speckv_policy.stop.StopRule`: after every draft token, keep the best prefix so far and go on while a
#: longer draft is worth more, as ``attach(..., mode="stop")``; needs :attr:`DenseText.branches`), or
#: ``'truncate'`` (draft ``max_gamma`` tokens, ``decide(paper_features) -> gamma`` keeps the first ones).
SIMULATED_MODES = ("fixed", "pre", "gated", "upfront", "per-token", "truncate", "rule", "stop")


@dataclass(frozen=True)
class DenseText:
    """One prompt's greedy continuation and the draft's outcome at every position.

    Attributes
    ----------
    ids : sequence of int
        Prompt followed by the target's greedy continuation.
    prompt_len : int
        Number of prompt tokens in ``ids``.
    run : sequence of int
        ``run[k]``: how many draft proposals in a row, from generated position
        ``k`` on, equal the text (capped by the caller, e.g. at gamma_max).
    conf, entropy : sequence of float
        The draft's top-1 probability and entropy (nats) for generated position ``k``.
    branches : mapping or None
        ``branches[j]``, for every position ``j`` where the draft's proposal is
        not the text's: the top-1 probabilities and entropies of the tokens the
        draft would propose after its own token there (its greedy
        continuation, as two sequences) up to the longest draft replayed, or
        up to and including its end-of-sequence token, after which it stops
        drafting (empty when its token there is that token). Only
        ``'per-token'`` mode reads them: a per-token rule may draft past the
        first rejected token. In sampling, one such continuation per position
        where the draft's token can be rejected (see :attr:`accept_prob`).
    accept_prob : sequence of float or None
        Sampling only: ``accept_prob[k] = min(1, q(t_k) / p(t_k))``, the probability
        that speculative sampling keeps the draft's token at generated position
        ``k`` given that the text there is ``t_k`` (``p``, ``q``: the target's and
        the draft's processed next-token distributions given the text before
        ``k``). The text is a sample of the target's own; :func:`realize` draws
        the keep/reject events and sets :attr:`run` from them.
    """

    ids: Sequence[int]
    prompt_len: int
    run: Sequence[int]
    conf: Sequence[float]
    entropy: Sequence[float]
    branches: Mapping[int, tuple[Sequence[float], Sequence[float]]] | None = None
    accept_prob: Sequence[float] | None = None

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len

    def draft_token(self, k: int, i: int) -> tuple[float, float] | None:
        """Top-1 probability and entropy of token ``i`` (0-based) of a draft starting at generated position ``k``.

        None where the draft has stopped before it (its end-of-sequence token
        came earlier in its branch).

        Raises
        ------
        ValueError
            If the token lies after a rejected one and :attr:`branches` has no branch there.
        """
        r = int(self.run[k])
        if i <= r:  # the draft still follows the text (or proposes its first wrong token, at k + r)
            return float(self.conf[k + i]), float(self.entropy[k + i])
        branch = None if self.branches is None else self.branches.get(k + r)
        if branch is None:
            raise ValueError(f"draft token {i} from position {k} follows a rejected token at {k + r}: no branch data")
        if i - r - 1 >= len(branch[0]):
            return None
        return float(branch[0][i - r - 1]), float(branch[1][i - r - 1])


@dataclass(frozen=True)
class DenseResult:
    """Totals of a simulated policy over the texts (a run's first step, the prefill, left out).

    ``text_tokens`` and ``text_time`` hold the same totals per text, in the
    order of the texts (what a bootstrap over prompts resamples).
    """

    tokens: float
    time: float
    steps: int
    gammas: np.ndarray
    accepted: np.ndarray
    text_tokens: np.ndarray
    text_time: np.ndarray

    @property
    def tokens_per_second(self) -> float:
        return 1e3 * self.tokens / self.time if self.time > 0 else 0.0


def match_runs(proposals: Sequence[int], text: Sequence[int], cap: int) -> list[int]:
    """``run[k]`` for every ``k``: consecutive ``proposals[k + i] == text[k + i]``, at most ``cap``.

    ``proposals[k]`` is the draft's greedy token for generated position ``k``
    given the true text before it (a teacher-forced pass); a draft that starts at
    ``k`` keeps proposing the text as long as it matches, so its outcome is the
    run of matches from ``k``.
    """
    if len(proposals) != len(text):
        raise ValueError(f"{len(proposals)} proposals for {len(text)} text tokens")
    return kept_runs([a == b for a, b in zip(proposals, text)], cap)


def kept_runs(kept: Sequence[bool], cap: int) -> list[int]:
    """``run[k]``: how many of ``kept[k], kept[k + 1], ...`` are true in a row, at most ``cap``."""
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    n = len(kept)
    run = [0] * n
    streak = 0
    for k in range(n - 1, -1, -1):  # from the end: run[k] = 1 + run[k + 1] on a kept token
        streak = streak + 1 if kept[k] else 0
        run[k] = min(streak, cap)
    return run


def realize(texts: Sequence[DenseText], seed: int, cap: int) -> list[DenseText]:
    """Sampled texts with their keep/reject events drawn: one replication of speculative sampling along them.

    Given a text sampled from the target, speculative sampling keeps the draft's
    token at position ``k`` with probability ``accept_prob[k]``, independently
    of every other position (the draft's proposal and the verifier's coin are
    fresh at each position; the text fixes what came before). One uniform per
    position, ``u[k] < accept_prob[k]``, gives every policy the same events
    (common random numbers): a paired comparison, and a valid draw for each
    policy since a walk asks about each position at most once.

    Parameters
    ----------
    texts : sequence of DenseText
        With :attr:`DenseText.accept_prob`.
    seed : int
        Replication; text ``i`` draws from ``numpy.random.default_rng([seed, i])``.
    cap : int
        Cap on the runs, as in :func:`match_runs`.

    Returns
    -------
    list of DenseText
        The texts with :attr:`DenseText.run` from the drawn events.

    Raises
    ------
    ValueError
        If a text has no :attr:`DenseText.accept_prob` for each generated token,
        or one that is not a probability (naming the text and position).
    """
    out = []
    for i, text in enumerate(texts):
        if text.accept_prob is None or len(text.accept_prob) != text.generated:
            raise ValueError(f"text {i} has no accept_prob for its {text.generated} generated tokens")
        a = np.asarray(text.accept_prob, dtype=np.float64)
        if not np.all((a >= 0.0) & (a <= 1.0)):  # NaN fails too
            k = int(np.flatnonzero(~((a >= 0.0) & (a <= 1.0)))[0])
            raise ValueError(f"text {i}: accept_prob[{k}] = {float(a[k])!r}, expected a probability in [0, 1]")
        u = np.random.default_rng([seed, i]).random(text.generated)
        out.append(replace(text, run=kept_runs((u < a).tolist(), cap)))
    return out


def pool_results(results: Sequence[DenseResult]) -> DenseResult:
    """One result from replications over the same texts: totals summed, per-text totals summed text by text."""
    if not results:
        raise ValueError("no results to pool")
    n = {len(r.text_tokens) for r in results}
    if len(n) != 1:
        raise ValueError(f"replications over different numbers of texts: {sorted(n)}")
    return DenseResult(
        sum(r.tokens for r in results),
        sum(r.time for r in results),
        sum(r.steps for r in results),
        np.concatenate([r.gammas for r in results]),
        np.concatenate([r.accepted for r in results]),
        np.sum([r.text_tokens for r in results], axis=0),
        np.sum([r.text_time for r in results], axis=0),
    )


def simulate(
    texts: Sequence[DenseText],
    mode: str,
    decide: Callable[..., int] | Any,
    *,
    compression: str,
    cost: CostModel,
    gate: Callable[[list[float]], bool] | None = None,
    max_gamma: int = 8,
    visited: list[tuple[list[float], int, int]] | None = None,
    temperature: float = 0.0,
) -> DenseResult:
    """Walk a policy through texts (greedy, or sampled and :func:`realize`-d) the way generation would; price its steps.

    Parameters
    ----------
    texts : sequence of DenseText
    mode : {'fixed', 'pre', 'gated', 'upfront', 'per-token', 'truncate', 'rule', 'stop'}
        See :data:`SIMULATED_MODES`; every mode but ``'rule'`` is the hook's own decision mode class
        (:mod:`speckv_policy.decisions`), driven here as the hook drives it. Upfront and gated steps that read the
        probe token pay for it (one draft token) even when they then choose 0.
        As in the hook, no step drafts more than the tokens left but one (the
        last new token is always the target's own), probe included.
    decide : callable or rule
        The policy's length decision for the mode's features (``'rule'``: an
        object with ``gamma()`` and ``observe(gamma, accepted)``; ``'stop'``: a
        :class:`~speckv_policy.stop.StopRule`).
    compression : str
        Compression name (features and the cost model's row).
    cost : CostModel
        Prices each step: ``draft_ms(drafted) + verify_ms(gamma)``.
    gate : callable or None
        The gated mode's pre-draft gate.
    max_gamma : int, default=8
        Cap on any choice; the texts' ``run`` should be capped at least as high.
    visited : list or None
        ``'pre'`` mode: if given, every decision appends ``(pre_values, run[k], known)``
        (``known``: the longest draft whose outcome the text decides there), i.e. the
        states the policy meets, labelled like a step log's ``(accepted, drafted)``.
    temperature : float, default=0.0
        The sampling temperature the features carry (0: greedy).

    Returns
    -------
    DenseResult
    """
    if mode not in SIMULATED_MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(SIMULATED_MODES)}")
    if mode == "gated" and gate is None:
        raise ValueError("mode='gated' needs gate=")
    if mode == "rule" and not (callable(getattr(decide, "gamma", None)) and callable(getattr(decide, "observe", None))):
        raise ValueError(f"mode='rule' needs an object with gamma() and observe(gamma, accepted), got {decide!r}")
    if mode == "stop" and not callable(getattr(decide, "begin", None)):
        raise ValueError(f"mode='stop' needs a StopRule, got {decide!r}")
    code = COMPRESSION_CODES[compression]
    walker = _walker(mode, decide, gate, compression, max_gamma)
    gammas: list[int] = []
    kept: list[int] = []
    per_text: list[tuple[float, float]] = []
    for text in texts:
        tokens = time = 0.0
        state = OnlineFeatureState(compression, temperature)
        walker.start(state)
        matcher = ContextMatcher()
        ids = list(text.ids)
        k, first, step, synced = 0, True, 0, 0
        while k < text.generated:
            ctx = text.prompt_len + k
            budget = text.generated - k - 1  # the hook never drafts past the last new token
            match = 0
            if walker.reads_pre:
                matcher.extend(ids[synced:ctx])  # the context grows by what the last step kept
                synced = ctx
                match = matcher.match_len()
                if visited is not None and mode == "pre":
                    known = min(max_gamma, budget)
                    visited.append((state.pre_values(ctx, match), min(int(text.run[k]), known), known))
            cap = walker.plan(step, ctx, match, budget)
            g = drafted = 0
            if cap > 0:
                read: tuple[list[float], list[float]] = ([], [])
                for i in range(cap):  # the draft loop, as the hook runs it
                    token = None
                    if walker.reads_token(i + 1):
                        token = text.draft_token(k, i)
                        if token is None:  # the draft proposed its end-of-sequence token: it stops there
                            break
                        read[0].append(token[0])
                        read[1].append(token[1])
                    drafted = i + 1
                    if walker.asks_per_token and walker.after_token(i + 1, token, ctx + i):
                        break
                g = walker.finish(drafted, lambda read=read: read)
            a = min(g, text.run[k]) if g > 0 else 0
            state.update(g, a)
            walker.end_step(g, a)
            if not first:  # the first step carries the prefill, which no per-step price covers
                tokens += a + 1
                time += float(cost.draft_ms(drafted, code)) + float(cost.verify_ms(g, code))
                gammas.append(g)
                kept.append(a)
            first = False
            k += a + 1
            step += 1
        per_text.append((tokens, time))
    return _result(gammas, kept, per_text)


class _RuleWalker(DecisionMode):
    """A history rule (``gamma()``, ``observe(gamma, accepted)``) as a mode: the race's peers, kept across texts."""

    name = "rule"

    def plan(self, step: int, context_len: int, match_len: int, budget: int) -> int:
        self._begin_step()
        return max(0, min(int(self.decider.gamma()), self.max_gamma, budget))

    def finish(self, drafted: int, tokens: Callable[[], Any]) -> int:
        return drafted

    def end_step(self, gamma: int, accepted: int) -> None:
        self.decider.observe(gamma, accepted)


def _walker(mode: str, decide: Any, gate: Any, compression: str, max_gamma: int) -> DecisionMode:
    """The hook's own decision mode for ``mode`` (a history rule for ``'rule'``), asking ``decide``."""
    if mode == "rule":
        return _RuleWalker(decide, compression, max_gamma)
    if mode == "fixed":
        return make_mode(mode, decide, compression, max_gamma)
    if mode == "stop":
        return make_mode(mode, PlainStopDecider(decide, max_gamma), compression, max_gamma)
    return make_mode(mode, PlainDecider(decide, gate, max_gamma=max_gamma), compression, max_gamma)


def _result(gammas: list[int], kept: list[int], per_text: list[tuple[float, float]]) -> DenseResult:
    pt = np.asarray(per_text, dtype=np.float64).reshape(-1, 2)
    return DenseResult(
        float(pt[:, 0].sum()),
        float(pt[:, 1].sum()),
        len(gammas),
        np.asarray(gammas),
        np.asarray(kept),
        pt[:, 0],
        pt[:, 1],
    )


def hindsight_oracle(
    texts: Sequence[DenseText], *, compression: str, cost: CostModel, max_gamma: int = 8
) -> DenseResult:
    """The fastest gammas in hindsight: the choices that minimise each text's priced time, by dynamic programming.

    Knowing ``run`` at every position, a step at ``k`` drafting ``g`` (at most the
    tokens left but one, as in :func:`simulate`) reaches ``k + min(g, run[k]) + 1``
    at ``draft_ms(g) + verify_ms(g)``;
    the shortest path over positions is the best any gamma policy can do on
    these texts under ``cost`` (no probe, no decision cost). Priced like
    :func:`simulate`: the first step of each text (the prefill) is left out.
    """
    code = COMPRESSION_CODES[compression]
    price = [float(cost.draft_ms(g, code)) + float(cost.verify_ms(g, code)) for g in range(max_gamma + 1)]
    plans = []
    for text in texts:
        n = text.generated
        best = [0.0] * (n + 1)  # best[k]: least time from generated position k to the end
        choice = [0] * n
        for k in range(n - 1, -1, -1):
            options = [(price[0] + best[k + 1], 0)]
            for g in range(1, min(max_gamma, n - k - 1) + 1):
                a = min(g, int(text.run[k]))
                options.append((price[g] + best[k + a + 1], g))
            best[k], choice[k] = min(options)  # ties: the shorter draft
        plans.append(choice)
    return _walk(texts, [plan.__getitem__ for plan in plans], code, cost, max_gamma)


def simulate_hindsight(
    texts: Sequence[DenseText],
    choose: Callable[[DenseText, int], int],
    *,
    compression: str,
    cost: CostModel,
    max_gamma: int = 8,
) -> DenseResult:
    """Walk a rule that sees the text's outcomes (``choose(text, k) -> gamma``) and price it like :func:`simulate`.

    No policy can run such a rule; it bounds what a signal is worth, e.g. a
    perfect gate: ``lambda text, k: 3 if text.run[k] >= 1 else 0`` drafts
    exactly where the draft's first token will be kept.
    """
    rules = [functools.partial(choose, text) for text in texts]
    return _walk(texts, rules, COMPRESSION_CODES[compression], cost, max_gamma)


def _walk(
    texts: Sequence[DenseText], rules: Sequence[Callable[[int], int]], code: int, cost: CostModel, max_gamma: int
) -> DenseResult:
    """Each text walked by its rule (``rule(k) -> gamma``, no features, no probe) and priced, the prefill left out."""
    gammas: list[int] = []
    kept: list[int] = []
    per_text: list[tuple[float, float]] = []
    for text, rule in zip(texts, rules):
        tokens = time = 0.0
        k, first = 0, True
        while k < text.generated:
            g = max(0, min(int(rule(k)), max_gamma, text.generated - k - 1))
            a = min(g, int(text.run[k])) if g > 0 else 0
            if not first:
                tokens += a + 1
                time += float(cost.draft_ms(g, code)) + float(cost.verify_ms(g, code))
                gammas.append(g)
                kept.append(a)
            first = False
            k += a + 1
        per_text.append((tokens, time))
    return _result(gammas, kept, per_text)
