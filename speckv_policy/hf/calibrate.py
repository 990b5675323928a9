"""Measure a target/draft pair's cost model on the machine that runs it (``speckv-calibrate``).

Costs are a property of the machine, not of the model pair: the same SmolLM2
target cost INT8 1.06x fp32 on one 2-core machine and 2.2x on another. This
module times real generation through the hook in ``fixed`` mode, with every
gamma in ``0..gamma_max`` equally often (gamma 0 is a plain target step), so it
measures exactly what generation pays per step: the draft call (fixed part and
per token) and the verification of ``gamma + 1`` tokens. The result is a
:class:`~speckv_policy.objective.CostModel`, fitted like a profile's
(:meth:`CostModel.fit`), that re-prices any export
(``RuntimePolicy(path, costs=...)``, ``speckv-export --reprice``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..objective import CostModel
from ..prompts import Prompt, encode_prompt
from .hook import attach
from .models import LOCAL_MODELS, ModelSource, device_machine, draft_precision
from .onednn import ONEDNN_DTYPES, apply_linear_backend

#: Steps timed per gamma and level before a calibration stops (it runs past its budget, up to 4x, to get them).
MIN_PER_GAMMA = 3


@dataclass(frozen=True)
class CalibrationConfig:
    """What to time: models (specs a :class:`~speckv_policy.hf.models.ModelSource` resolves) and budget."""

    target: str
    draft: str
    compressions: tuple[str, ...] = ("fp32", "int8", "nf4")
    gamma_max: int = 8
    seconds: float = 120.0
    max_new_tokens: int = 48
    device: str = "cpu"
    seed: int = 0
    draft_precision: str = "auto"
    target_linear: str = "default"
    draft_linear: str = "default"


def _gamma_cycle(gamma_max: int, rng: np.random.Generator) -> Callable[[int], int]:
    """``gamma_fn(step)``: every gamma in 0..gamma_max once per round, in a shuffled order."""
    order: list[int] = []

    def gamma_fn(step: int) -> int:
        if not order:
            order.extend(rng.permutation(gamma_max + 1).tolist())
        return int(order.pop())

    return gamma_fn


def calibrate(
    cfg: CalibrationConfig,
    prompts: Sequence[Prompt],
    *,
    models: ModelSource = LOCAL_MODELS,
    progress: Callable[[str, int, float], None] | None = None,
) -> tuple[CostModel, pd.DataFrame]:
    """Time generation at every compression level for ``cfg.seconds`` in all; fit the cost model.

    The budget is split evenly over the levels; each level first runs one
    untimed generation (first-call costs), then generates from the prompts in
    turn until its share is spent and every gamma was timed at least
    :data:`MIN_PER_GAMMA` times (running past the share for that, at most 4x). The first step of every generation (it also
    pays the prompt's prefill) and the last (it may be cut by the budget) are
    left out.

    Parameters
    ----------
    cfg : CalibrationConfig
    prompts : sequence of Prompt
        Text or token-id prompts, used in turn.
    models : ModelSource
        How ``cfg.target`` and ``cfg.draft`` load.
    progress : callable or None
        ``progress(compression, steps_so_far, seconds_so_far)`` after each generation.

    Returns
    -------
    cost_model : CostModel
        Fitted with ``decision_draft_tokens=0``; device ``cfg.device``.
    steps : pandas.DataFrame
        The timed steps (``compression``, ``gamma``, ``draft_ms``, ``verify_ms``, ...).

    Raises
    ------
    ValueError
        Without prompts, with ``gamma_max < 1`` or a budget too small to time two gammas per level.
    """
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if cfg.gamma_max < 1:
        raise ValueError(f"gamma_max must be >= 1, got {cfg.gamma_max}")
    if not cfg.seconds > 0:
        raise ValueError(f"seconds must be > 0, got {cfg.seconds}")
    rng = np.random.default_rng(cfg.seed)
    tok = models.load_tokenizer(cfg.target)
    pad = getattr(tok, "eos_token_id", None)
    draft = models.load_model(cfg.draft, draft_precision(cfg.device, cfg.draft_precision), cfg.device)
    apply_linear_backend(draft, cfg.draft_linear, dtypes=ONEDNN_DTYPES)
    draft.generation_config.pad_token_id = None
    encoded = [torch.tensor([encode_prompt(p, tok)], device=cfg.device) for p in prompts]
    budget = cfg.seconds / len(cfg.compressions)
    rows: list[dict[str, Any]] = []
    for comp in cfg.compressions:
        target = models.load_model(cfg.target, comp, cfg.device)
        apply_linear_backend(target, cfg.target_linear)
        gamma_fn = _gamma_cycle(cfg.gamma_max, rng)

        def generate(
            ids: torch.Tensor, target: Any = target, gamma_fn: Callable[[int], int] = gamma_fn, comp: str = comp
        ) -> list:
            with attach(target, gamma_fn, compression=comp, mode="fixed") as h, torch.no_grad():
                target.generate(
                    ids, assistant_model=draft, max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=pad
                )
            return h.stats

        generate(encoded[0][:, :8])  # warm-up, untimed
        t0 = time.perf_counter()
        n = i = 0
        seen = np.zeros(cfg.gamma_max + 1, dtype=np.int64)
        # the budget, and past it (up to 4x) until every gamma was timed MIN_PER_GAMMA times
        while (elapsed := time.perf_counter() - t0) < budget or (seen.min() < MIN_PER_GAMMA and elapsed < 4 * budget):
            stats = generate(encoded[i % len(encoded)])
            for s in stats[1:-1]:
                rows.append(
                    {
                        "compression": comp,
                        "device": cfg.device,
                        "step": s.step,
                        "gamma": s.gamma,
                        "draft_ms": s.draft_ms,
                        "verify_ms": s.verify_ms,
                    }
                )
                seen[min(s.gamma, cfg.gamma_max)] += 1
                n += 1
            i += 1
            if progress is not None:
                progress(comp, n, time.perf_counter() - t0)
        del target
        if len({r["gamma"] for r in rows if r["compression"] == comp}) < 2:
            raise ValueError(f"{comp}: the budget timed fewer than two gammas; give more --seconds")
    steps = pd.DataFrame(rows)
    return replace(CostModel.fit(steps, device=cfg.device, min_rows=3), machine=device_machine(cfg.device)), steps
