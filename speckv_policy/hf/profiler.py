"""``speckv-profile``: log step-level outcomes of real speculative decoding.

For every prompt x compression level x decoding mode, the target generates
with the draft through :func:`speckv_policy.hf.attach` in ``fixed`` mode. Most
steps draft ``gamma_max`` tokens, so every gamma <= gamma_max has its outcome;
a share of *calibration* steps draft a uniform gamma in 0..gamma_max, so the
verify cost can be fitted against gamma (gamma 0 is a plain target step).
``--fixed-gammas`` adds the paper's runs at constant gamma.

Each (run, prompt) unit is appended to the log atomically once finished, so
an interrupted profile keeps its finished units and a rerun continues where
it stopped. The last step of every generation is dropped: it may have been
cut by the token budget or an end-of-sequence token, which would bias its
accepted length.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..logs import append_log, read_log, read_log_metadata
from ..prompts import Prompt, encode_prompt
from .models import LOCAL_MODELS, ModelSource


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile. ``compressions`` and ``decodings`` are crossed with the prompts."""

    target: str
    draft: str
    out: str
    compressions: tuple[str, ...] = ("fp32", "int8", "nf4")
    decodings: tuple[str, ...] = ("greedy", "sampling")
    gamma_max: int = 8
    calibration_fraction: float = 0.15
    fixed_gammas: tuple[int, ...] = ()
    max_new_tokens: int = 64
    temperature: float = 0.7
    device: str = "cpu"
    seed: int = 0
    tag: str = "profile"


def profile_settings(cfg: ProfileConfig) -> str:
    """The settings that shape a profile's rows, as canonical JSON (recorded in the log, checked on resume).

    Left out: where rows go (``out``), and what names the units (``tag``,
    ``compressions``, ``decodings``, ``fixed_gammas`` are part of every run
    id), so a log can be extended with another level or decoding.
    """
    d = asdict(cfg)
    for k in ("out", "tag", "compressions", "decodings", "fixed_gammas"):
        d.pop(k)
    return json.dumps(d, sort_keys=True)


def _units(cfg: ProfileConfig, prompts: list[Prompt]) -> Iterator[tuple[str, str, str, int | None, Prompt]]:
    for comp in cfg.compressions:
        for dec in cfg.decodings:
            schedules: list[int | None] = [None, *cfg.fixed_gammas]
            for fixed in schedules:
                run = f"{cfg.tag}-{comp}-{dec}" + (f"-g{fixed}" if fixed is not None else "")
                for p in prompts:
                    yield run, comp, dec, fixed, p


def stats_to_rows(
    stats: list[Any],
    *,
    run_id: str,
    prompt: Prompt,
    compression: str,
    decoding: str,
    temperature: float,
    device: str,
    draft_id: str,
    target_id: str,
) -> list[dict[str, Any]]:
    """Turn :class:`speckv_policy.hf.hook.StepStats` of one generation into log rows (last step dropped)."""
    rows = []
    for s in stats[:-1]:
        rows.append(
            {
                "run_id": run_id,
                "prompt_id": prompt.id,
                "split": prompt.split,
                "task_type": prompt.task_type,
                "compression": compression,
                "decoding": decoding,
                "temperature": temperature if decoding == "sampling" else 0.0,
                "top_p": 1.0,
                "step": s.step,
                "context_len": s.context_len,
                "gamma": s.gamma,
                "accepted": s.accepted,
                "draft_confidence": s.draft_confidence,
                "draft_entropy": s.draft_entropy,
                "draft_token_prob": s.draft_token_prob,
                "draft_ms": s.draft_ms,
                "verify_ms": s.verify_ms,
                "device": device,
                "draft_model": draft_id,
                "target_model": target_id,
            }
        )
    return rows


def profile(
    cfg: ProfileConfig,
    prompts: list[Prompt],
    *,
    progress: bool = True,
    models: ModelSource = LOCAL_MODELS,
    force_new: bool = False,
) -> dict[str, int]:
    """Run (or resume) a profile; returns counts of units done, skipped and rows written.

    A log at ``cfg.out`` is resumed when it was made with the same settings and
    refused otherwise; ``force_new`` moves it aside (renamed with a timestamp)
    and starts a new one.

    ``models`` resolves ``cfg.target`` and ``cfg.draft`` to loaded models: local
    Hugging Face folders by default; :data:`speckv_policy.smollm2.models.SMOLLM2_MODELS`
    adds the ``smollm2`` target and distilled draft folders.
    """
    import torch
    from tqdm.auto import tqdm

    from .hook import attach

    out = Path(cfg.out)
    if out.suffix != ".parquet":
        raise ValueError(f"{out}: a step log is written as Parquet; give --out a path ending in .parquet")
    settings = profile_settings(cfg)
    done: set[tuple[str, str]] = set()
    if out.exists() and force_new:  # start afresh, but lose nothing: the old log moves aside
        aside = out.with_name(f"{out.stem}.old-{time.strftime('%Y%m%d-%H%M%S')}{out.suffix}")
        os.replace(out, aside)
        print(f"speckv-profile: moved the existing log to {aside}", file=sys.stderr)
    if out.exists():
        old = read_log(out)
        recorded = read_log_metadata(out).get("profile_settings")
        if recorded is not None and json.loads(recorded) != json.loads(settings):
            was, now = json.loads(recorded), json.loads(settings)
            diff = ", ".join(
                f"{k}: {was.get(k)!r} in the log, {now.get(k)!r} now"
                for k in sorted(set(was) | set(now))
                if was.get(k) != now.get(k)
            )
            raise ValueError(
                f"{out} was profiled with other settings ({diff}); resuming would mix them. "
                "Rerun with the log's settings, profile into another --out, or pass --force-new (the old log is "
                "moved aside, not deleted)"
            )
        done = set(zip(old["run_id"], old["prompt_id"]))
    units = list(_units(cfg, prompts))
    todo = [u for u in units if (u[0], u[4].id) not in done]
    counts = {"units": len(units), "skipped": len(units) - len(todo), "done": 0, "rows": 0}
    if not todo:
        return counts
    tokenizer = models.load_tokenizer(cfg.target)
    draft = models.load_model(cfg.draft, "fp32" if cfg.device == "cpu" else "fp16", cfg.device)
    draft.generation_config.pad_token_id = None
    ids_t, ids_d = models.model_id(cfg.target), models.model_id(cfg.draft)
    loaded: tuple[str, Any] | None = None
    bar = tqdm(todo, desc="speckv-profile", unit="prompt", disable=not progress, file=sys.stderr)
    for run, comp, dec, fixed, p in bar:
        if loaded is None or loaded[0] != comp:
            loaded = (comp, models.load_model(cfg.target, comp, cfg.device))
        target = loaded[1]
        unit_seed = zlib.crc32(f"{cfg.seed}/{run}/{p.id}".encode()) % (2**31)
        rng = np.random.default_rng(unit_seed)

        def gamma_fn(step: int, rng: np.random.Generator = rng, fixed: int | None = fixed) -> int:
            if fixed is not None:
                return fixed
            if rng.random() < cfg.calibration_fraction:
                return int(rng.integers(0, cfg.gamma_max + 1))
            return cfg.gamma_max

        ids = torch.tensor([encode_prompt(p, tokenizer)], device=cfg.device)
        torch.manual_seed(unit_seed)
        sampling = dec == "sampling"
        with attach(target, None, compression=comp, mode="fixed", gamma_fn=gamma_fn, record_tokens=True) as h:
            target.generate(
                ids,
                assistant_model=draft,
                max_new_tokens=cfg.max_new_tokens,
                do_sample=sampling,
                temperature=cfg.temperature if sampling else None,
                top_p=1.0 if sampling else None,
                top_k=0 if sampling else None,
                pad_token_id=getattr(tokenizer, "eos_token_id", None),
            )
        rows = stats_to_rows(
            h.stats,
            run_id=run,
            prompt=p,
            compression=comp,
            decoding=dec,
            temperature=cfg.temperature,
            device=cfg.device,
            draft_id=ids_d,
            target_id=ids_t,
        )
        if rows:
            append_log(out, rows, metadata={"profile_settings": settings})
        counts["done"] += 1
        counts["rows"] += len(rows)
        bar.set_postfix(rows=counts["rows"])
    return counts
