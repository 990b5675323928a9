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

import argparse
import json
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .logs import LogValidationError, append_log, read_log
from .schema import TASK_TYPES

PROMPT_FIELDS = ("id", "task_type")
SPLITS = ("train", "heldout")


class PromptFileError(ValueError):
    """A prompt file line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: text (chat-formatted with the tokenizer) or token ids."""

    id: str
    task_type: str
    split: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSON-lines prompt file.

    Each line: ``{"id": ..., "task_type": ..., "split": "train"|"heldout",
    "prompt": "text"}`` or ``"input_ids": [ints]`` instead of ``prompt``.
    Blank lines and lines starting with ``#`` are skipped.

    Raises
    ------
    PromptFileError
        Naming the file, the line number and what was expected.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue

        def bad(msg: str, no: int = no) -> PromptFileError:
            return PromptFileError(f"{path}, line {no}: {msg}")

        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad(f"not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise bad("expected a JSON object")
        for f in PROMPT_FIELDS:
            if not isinstance(rec.get(f), str) or not rec[f]:
                raise bad(f"field '{f}' must be a non-empty string")
        if rec["task_type"] not in TASK_TYPES:
            raise bad(f"task_type must be one of {', '.join(TASK_TYPES)}, got {rec['task_type']!r}")
        split = rec.get("split", "train")
        if split not in SPLITS:
            raise bad(f"split must be 'train' or 'heldout', got {split!r}")
        if rec["id"] in seen:
            raise bad(f"duplicate id {rec['id']!r}")
        seen.add(rec["id"])
        text, ids = rec.get("prompt"), rec.get("input_ids")
        if (text is None) == (ids is None):
            raise bad("give exactly one of 'prompt' (text) or 'input_ids' (list of ints)")
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise bad("'prompt' must be a non-empty string")
        if ids is not None and (not isinstance(ids, list) or not ids or
                                not all(isinstance(i, int) and i >= 0 for i in ids)):
            raise bad("'input_ids' must be a non-empty list of non-negative ints")
        prompts.append(Prompt(rec["id"], rec["task_type"], split, text, tuple(ids) if ids else None))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


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


def _units(cfg: ProfileConfig, prompts: list[Prompt]) -> Iterator[tuple[str, str, str, int | None, Prompt]]:
    for comp in cfg.compressions:
        for dec in cfg.decodings:
            schedules: list[int | None] = [None, *cfg.fixed_gammas]
            for fixed in schedules:
                run = f"{cfg.tag}-{comp}-{dec}" + (f"-g{fixed}" if fixed is not None else "")
                for p in prompts:
                    yield run, comp, dec, fixed, p


def _encode(prompt: Prompt, tokenizer: Any) -> Any:
    import torch

    if prompt.input_ids is not None:
        return torch.tensor([list(prompt.input_ids)])
    if tokenizer is None:
        raise ValueError(f"prompt {prompt.id!r} is text but the target has no tokenizer; give input_ids")
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                            add_generation_prompt=True, return_tensors="pt")
        return enc["input_ids"] if hasattr(enc, "keys") else enc
    return tokenizer(prompt.text, return_tensors="pt").input_ids


def stats_to_rows(stats: list[Any], *, run_id: str, prompt: Prompt, compression: str, decoding: str,
                  temperature: float, device: str, draft_id: str, target_id: str) -> list[dict[str, Any]]:
    """Turn :class:`speckv_policy.hf.StepStats` of one generation into log rows (last step dropped)."""
    rows = []
    for s in stats[:-1]:
        rows.append({
            "run_id": run_id, "prompt_id": prompt.id, "split": prompt.split, "task_type": prompt.task_type,
            "compression": compression, "decoding": decoding,
            "temperature": temperature if decoding == "sampling" else 0.0, "top_p": 1.0,
            "step": s.step, "context_len": s.context_len, "gamma": s.gamma, "accepted": s.accepted,
            "draft_confidence": s.draft_confidence, "draft_entropy": s.draft_entropy,
            "draft_token_prob": s.draft_token_prob, "draft_ms": s.draft_ms, "verify_ms": s.verify_ms,
            "device": device, "draft_model": draft_id, "target_model": target_id,
        })
    return rows


def profile(cfg: ProfileConfig, prompts: list[Prompt], *, progress: bool = True) -> dict[str, int]:
    """Run (or resume) a profile; returns counts of units done, skipped and rows written."""
    import torch
    from tqdm.auto import tqdm

    from .hf import attach
    from .models import load_model, load_tokenizer, model_id

    out = Path(cfg.out)
    done: set[tuple[str, str]] = set()
    if out.exists():
        old = read_log(out)
        done = set(zip(old["run_id"], old["prompt_id"]))
    units = list(_units(cfg, prompts))
    todo = [u for u in units if (u[0], u[4].id) not in done]
    counts = {"units": len(units), "skipped": len(units) - len(todo), "done": 0, "rows": 0}
    if not todo:
        return counts
    tokenizer = load_tokenizer(cfg.target)
    draft = load_model(cfg.draft, "fp32" if cfg.device == "cpu" else "fp16", cfg.device)
    draft.generation_config.pad_token_id = None
    ids_t, ids_d = model_id(cfg.target), model_id(cfg.draft)
    loaded: tuple[str, Any] | None = None
    bar = tqdm(todo, desc="speckv-profile", unit="prompt", disable=not progress, file=sys.stderr)
    for run, comp, dec, fixed, p in bar:
        if loaded is None or loaded[0] != comp:
            loaded = (comp, load_model(cfg.target, comp, cfg.device))
        target = loaded[1]
        unit_seed = zlib.crc32(f"{cfg.seed}/{run}/{p.id}".encode()) % (2**31)
        rng = np.random.default_rng(unit_seed)

        def gamma_fn(step: int, rng: np.random.Generator = rng, fixed: int | None = fixed) -> int:
            if fixed is not None:
                return fixed
            if rng.random() < cfg.calibration_fraction:
                return int(rng.integers(0, cfg.gamma_max + 1))
            return cfg.gamma_max

        ids = _encode(p, tokenizer).to(cfg.device)
        torch.manual_seed(unit_seed)
        sampling = dec == "sampling"
        with attach(target, None, compression=comp, mode="fixed", gamma_fn=gamma_fn, record_tokens=True) as h:
            target.generate(ids, assistant_model=draft, max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                            temperature=cfg.temperature if sampling else None, top_p=1.0 if sampling else None,
                            top_k=0 if sampling else None, pad_token_id=getattr(tokenizer, "eos_token_id", None))
        rows = stats_to_rows(h.stats, run_id=run, prompt=p, compression=comp, decoding=dec,
                             temperature=cfg.temperature, device=cfg.device, draft_id=ids_d, target_id=ids_t)
        if rows:
            append_log(out, rows)
        counts["done"] += 1
        counts["rows"] += len(rows)
        bar.set_postfix(rows=counts["rows"])
    return counts


def _csv(text: str, cast: Any = str) -> tuple[Any, ...]:
    return tuple(cast(t.strip()) for t in text.split(",") if t.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speckv-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model folder, or 'smollm2'")
    p.add_argument("--draft", required=True, help="draft model folder")
    p.add_argument("--prompts", required=True, help="JSON-lines prompt file")
    p.add_argument("--out", required=True, help="step log (.parquet) to create or resume")
    p.add_argument("--compressions", default="fp32,int8,nf4")
    p.add_argument("--decodings", default="greedy,sampling")
    p.add_argument("--gamma-max", type=int, default=8)
    p.add_argument("--calibration-fraction", type=float, default=0.15)
    p.add_argument("--fixed-gammas", default="", help="also run constant gammas, e.g. 2,4,6,8 (the paper's runs)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="profile", help="prefix of run ids")
    p.add_argument("--limit", type=int, help="profile only the first N prompts")
    p.add_argument("--stride", type=int, default=1, help="profile every N-th prompt (a spread subset)")
    args = p.parse_args(argv)
    try:
        if args.stride < 1:
            raise ValueError(f"--stride must be >= 1, got {args.stride}")
        prompts = read_prompts(args.prompts)[:: args.stride][: args.limit]
        cfg = ProfileConfig(
            target=args.target, draft=args.draft, out=args.out,
            compressions=_csv(args.compressions), decodings=_csv(args.decodings), gamma_max=args.gamma_max,
            calibration_fraction=args.calibration_fraction, fixed_gammas=_csv(args.fixed_gammas, int),
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, device=args.device,
            seed=args.seed, tag=args.tag,
        )
        for d in cfg.decodings:
            if d not in ("greedy", "sampling"):
                raise ValueError(f"unknown decoding {d!r}; expected greedy or sampling")
        counts = profile(cfg, prompts)
    except (PromptFileError, LogValidationError, ValueError, FileNotFoundError, ModuleNotFoundError) as exc:
        print(f"speckv-profile: error: {exc}", file=sys.stderr)
        return 2
    print(f"speckv-profile: {counts['done']} prompt runs profiled, {counts['skipped']} already in {args.out}, "
          f"{counts['rows']} steps written")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
