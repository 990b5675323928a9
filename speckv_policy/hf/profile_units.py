"""The units of a profile: what to run, how one unit runs through the hook, which units are left to do.

Shared by the single-process profiler (:mod:`speckv_policy.hf.profiler`) and its Ray workers
(:mod:`speckv_policy.hf.profile_ray`).
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

from ..logs import logged_units, read_log_metadata
from ..prompts import Prompt, encode_prompt
from .models import LOCAL_MODELS, ModelSource, draft_precision
from .onednn import ONEDNN_DTYPES, apply_linear_backend


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
    draft_precision: str = "auto"
    target_linear: str = "default"
    draft_linear: str = "default"


def profile_settings(cfg: ProfileConfig) -> str:
    """The settings that shape a profile's rows, as canonical JSON (recorded in the log, checked on resume).

    Left out: where rows go (``out``), and what names the units (``tag``,
    ``compressions``, ``decodings``, ``fixed_gammas`` are part of every run
    id), so a log can be extended with another level or decoding.
    """
    d = asdict(cfg)
    for k in ("out", "tag", "compressions", "decodings", "fixed_gammas"):
        d.pop(k)
    d["draft_precision"] = draft_precision(cfg.device, cfg.draft_precision)  # what ran, not "auto"
    for option in ("target_linear", "draft_linear"):
        if d[option] == "default":
            d.pop(option)  # logs written before the option existed resume unchanged
    return json.dumps(d, sort_keys=True)


def _recorded_settings(out: Path, recorded: str | None) -> dict[str, Any] | None:
    """The settings a log recorded (None if it recorded none); ValueError naming the log if they are not an object."""
    if recorded is None:
        return None
    try:
        was = json.loads(recorded)
    except ValueError:
        was = None
    if not isinstance(was, dict):
        raise ValueError(f"{out}: its recorded profile_settings are not a JSON object ({recorded[:80]!r})")
    return was


def profile_units(cfg: ProfileConfig, prompts: list[Prompt]) -> Iterator[tuple[str, str, str, int | None, Prompt]]:
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
                "target_confidence": s.target_confidence,
                "target_entropy": s.target_entropy,
                "context_match_len": s.context_match_len,
            }
        )
    return rows


#: One unit of work: (run id, compression, decoding, fixed gamma or None, prompt).
Unit = tuple[str, str, str, int | None, Prompt]


class UnitProfiler:
    """Loads the draft once and the target once per compression level, and profiles units of work.

    One lives in the profiling process, or one per Ray worker
    (:mod:`speckv_policy.hf.profile_ray`).
    """

    def __init__(self, cfg: ProfileConfig, models: ModelSource = LOCAL_MODELS) -> None:
        self.cfg = cfg
        self.models = models
        self.tokenizer = models.load_tokenizer(cfg.target)
        self.draft = models.load_model(cfg.draft, draft_precision(cfg.device, cfg.draft_precision), cfg.device)
        apply_linear_backend(self.draft, cfg.draft_linear, dtypes=ONEDNN_DTYPES)
        self.draft.generation_config.pad_token_id = None
        self.ids = (models.model_id(cfg.target), models.model_id(cfg.draft))
        self._loaded: tuple[str, Any] | None = None

    def run(self, unit: Unit) -> list[dict[str, Any]]:
        """Generate one (run, prompt) unit through the hook and return its log rows."""
        import torch

        from .hook import attach

        cfg = self.cfg
        run, comp, dec, fixed, p = unit
        if self._loaded is None or self._loaded[0] != comp:
            self._loaded = None  # free the previous level's target before loading the next
            self._loaded = (comp, self.models.load_model(cfg.target, comp, cfg.device))
            apply_linear_backend(self._loaded[1], cfg.target_linear)
        target = self._loaded[1]
        unit_seed = zlib.crc32(f"{cfg.seed}/{run}/{p.id}".encode()) % (2**31)
        rng = np.random.default_rng(unit_seed)

        def gamma_fn(step: int) -> int:
            if fixed is not None:
                return fixed
            if rng.random() < cfg.calibration_fraction:
                return int(rng.integers(0, cfg.gamma_max + 1))
            return cfg.gamma_max

        ids = torch.tensor([encode_prompt(p, self.tokenizer)], device=cfg.device)
        torch.manual_seed(unit_seed)
        sampling = dec == "sampling"
        with attach(target, gamma_fn, compression=comp, mode="fixed", settings={"record_tokens": True}) as h:
            target.generate(
                ids,
                assistant_model=self.draft,
                max_new_tokens=cfg.max_new_tokens,
                do_sample=sampling,
                temperature=cfg.temperature if sampling else None,
                top_p=1.0 if sampling else None,
                top_k=0 if sampling else None,
                pad_token_id=getattr(self.tokenizer, "eos_token_id", None),
            )
        return stats_to_rows(
            h.stats,
            run_id=run,
            prompt=p,
            compression=comp,
            decoding=dec,
            temperature=cfg.temperature,
            device=cfg.device,
            draft_id=self.ids[1],
            target_id=self.ids[0],
        )


def plan_profile(
    cfg: ProfileConfig, prompts: list[Prompt], *, force_new: bool = False
) -> tuple[list[Unit], list[Unit]]:
    """Check ``cfg.out`` (settings recorded in an existing log must match) and return ``(all units, units to do)``.

    ``cfg.out`` is a ``.parquet`` file or a log dataset directory (a path
    without suffix). ``force_new`` moves an existing log aside (renamed with a
    timestamp) first.
    """
    out = Path(cfg.out)
    if out.suffix not in (".parquet", "") or (out.suffix == ".parquet" and out.is_dir()):
        raise ValueError(
            f"{out}: a step log is a Parquet file (--out ending in .parquet) or a log dataset directory "
            "(--out without a suffix)"
        )
    settings = profile_settings(cfg)
    if out.exists() and force_new:  # start afresh, but lose nothing: the old log moves aside
        aside = out.with_name(f"{out.stem}.old-{time.strftime('%Y%m%d-%H%M%S')}{out.suffix}")
        os.replace(out, aside)
        print(f"speckv-profile: moved the existing log to {aside}", file=sys.stderr)
    done: set[tuple[str, str]] = set()
    if out.exists():
        recorded = read_log_metadata(out).get("profile_settings")
        was = _recorded_settings(out, recorded)
        if was is not None and was != json.loads(settings):
            now = json.loads(settings)
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
        done = logged_units(out)
    units = list(profile_units(cfg, prompts))
    return units, [u for u in units if (u[0], u[4].id) not in done]
