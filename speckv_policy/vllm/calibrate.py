"""Step costs by batch size, measured inside vLLM: what ``speckv-calibrate --engine vllm`` runs.

One engine, the speckv proposer drafting a random length (0..``max_gamma``) for every request at every step (and
now and then keeping a request's draft shut for a run of steps, so that drafts catch up on contexts of every
length) and timing each of its calls; batches of 16, 8, 4, 2 and 1 requests, every one generating the same number
of tokens. A proposer call drafts for the whole batch; the time from the end of one call to the start of the next is
the rest of the engine step (the target's pass over every request's draft, sampling, scheduling). Pairs of
consecutive calls with the same batch and no new request between them are steps;
:meth:`~speckv_policy.batch_costs.BatchCosts.fit` turns them into one request's costs at each batch size.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..batch_costs import CATCH_UP_COLUMN, STEP_COLUMNS, BatchCosts
from .engine import engine_args
from .proposer import speculative_config

__all__ = ["DEFAULT_BATCH_SIZES", "calibrate_vllm", "engine_steps", "read_timings"]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)


def read_timings(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The proposer's per-call timings (``ProposerSettings.timings``), one dict per call; a torn last line is dropped."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the engine stopped mid-write
    return rows


def engine_steps(calls: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Engine steps from consecutive proposer calls, as :meth:`BatchCosts.fit` reads them.

    Call ``i`` drafts for ``batch`` requests (``draft_ms``: its own duration, ``caught_up``: the context tokens its
    drafts read before their first draft token); the target verifies those drafts before call ``i + 1`` starts
    (``verify_ms``: the gap). A pair is kept when both calls see the same batch, every
    request in it was decoding, and call ``i + 1`` met no new request (a new request means a prefill ran in the gap).
    """
    out: dict[str, list[float]] = {c: [] for c in (*STEP_COLUMNS, CATCH_UP_COLUMN)}
    for a, b in zip(calls, calls[1:]):
        same = a["batch"] == b["batch"] and a["decoding"] == a["batch"] and b["decoding"] == b["batch"]
        if not same or b["new"] or b["t_in"] < a["t_out"]:
            continue
        out["batch"].append(a["batch"])
        out["draft_ms"].append(1e3 * (a["t_out"] - a["t_in"]))
        out["verify_ms"].append(1e3 * (b["t_in"] - a["t_out"]))
        out["draft_tokens"].append(a["draft_tokens"])
        out["drafting"].append(a["drafting"])
        out[CATCH_UP_COLUMN].append(a[CATCH_UP_COLUMN])
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def calibrate_vllm(
    target: str | os.PathLike[str],
    draft: str,
    prompts: Sequence[str],
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    max_tokens: int = 48,
    rounds: int = 2,
    max_gamma: int = 4,
    device: str = "cpu",
    draft_loader: str = "speckv_policy.hf.models.load_model",
    engine: dict[str, Any] | None = None,
    progress: Any = None,
) -> tuple[BatchCosts, dict[str, np.ndarray]]:
    """Time engine steps at each batch size inside ``vllm.LLM`` and fit :class:`BatchCosts`.

    Parameters
    ----------
    target : path
        The target's Hugging Face folder, as vLLM loads it.
    draft : str
        The draft, as ``draft_loader`` reads it.
    prompts : sequence of str
        Prompt texts (chat template applied); cycled to fill the largest batch.
    batch_sizes : sequence of int
        Batch sizes to time (run largest first).
    max_tokens : int, default=48
        Tokens every request generates (end of sequence ignored, so a batch stays whole).
    rounds : int, default=2
        Passes over the batch sizes.
    max_gamma : int, default=4
        Longest random draft.
    device : str, default="cpu"
        ``cpu`` or ``cuda``: the engine's and the draft's device.
    engine : dict or None
        Overrides for :func:`engine_args`.
    progress : callable or None
        Called as ``progress(batch_size, steps_so_far)``.

    Returns
    -------
    (BatchCosts, dict)
        The fitted costs and the timed steps.
    """
    from vllm import LLM, SamplingParams

    from ..machine import describe_host

    sizes = sorted({int(b) for b in batch_sizes}, reverse=True)
    if not sizes or sizes[-1] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if not prompts:
        raise ValueError("no prompts to time")
    fd, timings = tempfile.mkstemp(prefix="speckv-vllm-timings-", suffix=".jsonl")
    os.close(fd)
    try:
        spec = speculative_config(
            draft, "explore", max_gamma=max_gamma, draft_loader=draft_loader, device=device, timings=timings
        )
        args = engine_args(str(target), device=device, max_num_seqs=max(sizes), **(engine or {}))
        args.pop("model")
        llm = LLM(model=str(target), speculative_config=spec, **args)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(list(prompts[:1]), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        cycled = [prompts[i % len(prompts)] for i in range(max(sizes))]
        for _ in range(rounds):
            for b in sizes:
                llm.generate(cycled[:b], params, use_tqdm=False)
                if progress is not None:
                    progress(b, len(engine_steps(read_timings(timings))["batch"]))
        del llm
        steps = engine_steps(read_timings(timings))
    finally:
        Path(timings).unlink(missing_ok=True)
    costs = BatchCosts.fit(steps, device=device, machine=describe_host(), engine="vllm")
    return costs, steps
