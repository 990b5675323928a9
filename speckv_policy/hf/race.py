"""Run the end-to-end race inside real Hugging Face generation (logic and report: :mod:`speckv_policy.evaluation.race`).

:func:`run_race` times every arm on every prompt, interleaved, at each
compression level and decoding, checks greedy outputs against the target's own,
and returns the raw runs with their summary.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from ..evaluation.race import HF_FIELDS, NEAR_TIE, ArmSpec, summarize_runs
from ..prompts import Prompt, encode_prompt
from .fast_draft import decode_step_blocker
from .hook import attach
from .live_costs import LiveCosts
from .models import LOCAL_MODELS, ModelSource, device_machine, draft_precision
from .onednn import ONEDNN_DTYPES, apply_linear_backend


@dataclass(frozen=True)
class RaceConfig:
    """What to race: models (specs a :class:`~speckv_policy.hf.models.ModelSource` resolves) and settings."""

    target: str
    draft: str
    compressions: tuple[str, ...] = ("fp32", "int8", "nf4")
    decodings: tuple[str, ...] = ("greedy", "sampling")
    temperature: float = 0.7
    max_new_tokens: int = 32
    repeats: int = 1
    device: str = "cpu"
    seed: int = 0
    draft_precision: str = "auto"
    target_linear: str = "default"
    draft_linear: str = "default"
    #: a second draft for the arms marked ``beside`` (the best arm on another draft, raced in the same run), or None
    beside_draft: str | None = None
    #: the beside draft's linear backend (each draft with its own, as calibrated for it)
    beside_draft_linear: str = "default"


def run_once(
    arm: ArmSpec,
    state: dict[str, Any],
    target: Any,
    draft: Any,
    ids: Any,
    *,
    compression: str,
    sampling: bool,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    pad: int | None,
    stopwatch: Callable[[], float],
) -> dict[str, Any]:
    """One timed generate call; returns tokens, seconds, output ids and the hook's decision time."""
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=sampling, pad_token_id=pad)
    if sampling:
        kw.update(temperature=temperature, top_p=1.0, top_k=0)
    if arm.assistant:
        kw["assistant_model"] = draft
        for k in HF_FIELDS:  # this arm's own HF state (persisted between its calls)
            setattr(draft.generation_config, k, state.get(k, arm.hf.get(k, getattr(draft.generation_config, k))))
    torch.manual_seed(seed)
    handle = None
    costs = arm.costs
    if isinstance(costs, str) and costs == "live":
        costs = state.setdefault("live_costs", LiveCosts())  # estimates carry over, as a server's would
    if arm.rule is not None:  # a history rule (SGLang-, vLLM-style): gamma decided before drafting, no probe
        rule = state.setdefault("rule", arm.rule(compression))  # kept across the block's prompts, like a server
        holder: dict[str, Any] = {}

        def gamma_fn(step: int) -> int:
            stats = holder["handle"].stats
            for s in stats[holder.get("seen", 0) :]:
                rule.observe(s.gamma, s.accepted)
            holder["seen"] = len(stats)
            return int(rule.gamma())

        handle = attach(target, gamma_fn, compression=compression, mode="fixed")
        holder["handle"] = handle
    elif arm.policy is not None:
        handle = attach(
            target,
            arm.policy,
            compression=compression,
            mode=arm.mode,
            feature_set="online" if callable(arm.policy) else None,
            costs=costs,
            settings={"max_gamma": 8, "probe_backoff": arm.backoff},
        )
    try:
        t0 = stopwatch()
        with torch.no_grad():
            out = target.generate(ids, **kw)
        seconds = stopwatch() - t0
    finally:
        summary = handle.summary() if handle is not None else {}
        steps = handle.stats if handle is not None else []
        if handle is not None:
            handle.detach()
    if arm.assistant:
        for k in HF_FIELDS:
            state[k] = getattr(draft.generation_config, k)
    new = out[0, ids.shape[1] :].tolist()
    return {
        "tokens": len(new),
        "seconds": seconds,
        "output": new,
        "steps": summary.get("steps"),
        "decision_s": summary.get("decision_us_mean", 0.0) * summary.get("steps", 0) / 1e6,
        "fallbacks": summary.get("fallbacks", 0),
        # per step, as the hook measured it (arms through the hook only): tokens drafted, sent and kept, and the
        # draft call's and the verification's time (to price the run with a cost model)
        "step_drafted": [x.drafted for x in steps],
        "step_gamma": [x.gamma for x in steps],
        "step_accepted": [x.accepted for x in steps],
        "step_draft_ms": [round(x.draft_ms, 3) for x in steps],
        "step_verify_ms": [round(x.verify_ms, 3) for x in steps],
    }


def chunking_noise(target: Any, context: Any, ref_token: int, other_token: int) -> tuple[float, float]:
    """How close the target's choice is at a differing token, against how much chunking moves its logits.

    Parameters
    ----------
    target : transformers model
        The target as benchmarked.
    context : torch.Tensor
        ``[1, L]`` prompt + the reference output before the first differing token.
    ref_token, other_token : int
        The target's own greedy token there and the one the assisted run produced.

    Returns
    -------
    gap : float
        ``logit(ref_token) - logit(other_token)`` from a one-token pass (the target's own greedy step).
    noise : float
        The largest change of any logit at that position when it is computed in a 2-, 4- or 8-token
        pass instead (a verification's shape). ``gap <= noise`` means the target's own choice there is
        decided by rounding, which a lossless speculative decoder cannot be expected to reproduce.
    """

    def last_logits(k: int) -> Any:
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(context[:, :-k], cache=cache, use_cache=True)
            return target(context[:, -k:], cache=cache, use_cache=True).logits[0, -1].float()

    single = last_logits(1)
    noise = max((float((last_logits(k) - single).abs().max()) for k in (2, 4, 8) if k < context.shape[1]), default=0.0)
    return float(single[ref_token] - single[other_token]), noise


def run_race(
    cfg: RaceConfig,
    arms: Sequence[ArmSpec],
    prompts: Sequence[Prompt],
    *,
    models: ModelSource = LOCAL_MODELS,
    progress: bool = True,
) -> dict[str, Any]:
    """Time every arm on every prompt, interleaved, and check greedy outputs.

    For each compression level and decoding, every arm runs once untimed
    (warm-up), then on each prompt in turn; the arm order rotates from prompt
    to prompt so no arm always runs first. Each arm keeps its own HF state
    across the prompts of a block, as a server would. Greedy outputs are
    compared with the ``target`` arm's; a difference is recorded with whether
    it is a near tie (:func:`chunking_noise`).

    Returns
    -------
    dict
        ``config``, ``machine``, ``arms``, ``minutes``, ``runs`` (one record
        per timed generate call, outputs dropped), ``summary``
        (:func:`~speckv_policy.evaluation.race.summarize_runs`), ``goals`` and
        ``mismatches``.
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("the race needs at least one prompt")
    if not any(a.name == "target" for a in arms):
        raise ValueError("the race needs the 'target' arm (the reference for every ratio)")
    torch.set_num_threads(os.cpu_count() or 1)
    tok = models.load_tokenizer(cfg.target)
    pad = getattr(tok, "eos_token_id", None)
    if any(a.beside for a in arms) and cfg.beside_draft is None:
        raise ValueError(f"arms {[a.name for a in arms if a.beside]} run with a beside draft; the config names none")
    drafts = {}
    linear = {"race": cfg.draft_linear, "beside": cfg.beside_draft_linear}
    for key, folder in (("race", cfg.draft), ("beside", cfg.beside_draft)):
        if folder is None:
            continue
        d = models.load_model(folder, draft_precision(cfg.device, cfg.draft_precision), cfg.device)
        apply_linear_backend(d, linear[key], dtypes=ONEDNN_DTYPES)
        d.generation_config.pad_token_id = None
        drafts[key] = d

    def draft_of(arm: ArmSpec) -> Any:
        return drafts["beside" if arm.beside else "race"]

    def forward_of(d: Any) -> str:
        why = decode_step_blocker(d)  # the hook's draft_forward='auto' decides the same way
        return "fast" if why is None else f"transformers ({why})"

    forwards = {key: forward_of(d) for key, d in drafts.items()}
    on_cuda = cfg.device.startswith("cuda")

    def stopwatch() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def encode(p: Prompt) -> torch.Tensor:
        return torch.tensor([encode_prompt(p, tok)], device=cfg.device)

    arms = list(arms)
    runs: list[dict[str, Any]] = []
    mismatches: list[str] = []
    t_start = time.time()
    total = len(cfg.compressions) * len(cfg.decodings) * len(prompts) * cfg.repeats * len(arms)
    bar = tqdm(total=total, desc="e2e", unit="run", file=sys.stderr, disable=not progress)
    for comp in cfg.compressions:
        target = models.load_model(cfg.target, comp, cfg.device)
        apply_linear_backend(target, cfg.target_linear)
        for dec in cfg.decodings:
            sampling = dec == "sampling"
            states: dict[str, dict[str, Any]] = {a.name: {} for a in arms}
            common = dict(
                compression=comp,
                sampling=sampling,
                temperature=cfg.temperature,
                max_new_tokens=cfg.max_new_tokens,
                pad=pad,
                stopwatch=stopwatch,
            )
            warm = encode(prompts[0])
            for a in arms:  # warm-up (untimed): first-call costs, HF's adaptive state gets a first update
                run_once(a, states[a.name], target, draft_of(a), warm, seed=cfg.seed, **common)
            for rep in range(cfg.repeats):
                for i, p in enumerate(prompts):
                    ids = encode(p)
                    seed = zlib.crc32(f"{cfg.seed}/{p.id}/{rep}".encode()) % (2**31)
                    order = arms[i % len(arms) :] + arms[: i % len(arms)]
                    block = []
                    for a in order:
                        r = run_once(a, states[a.name], target, draft_of(a), ids, seed=seed, **common)
                        r.update(
                            arm=a.name,
                            prompt_id=p.id,
                            task_type=p.task_type,
                            compression=comp,
                            decoding=dec,
                            repeat=rep,
                        )
                        block.append(r)
                        bar.update(1)
                    runs += block
                    if not sampling:
                        mismatches += _greedy_differences(target, ids, block, f"{comp} {p.id} repeat {rep}")
        del target
    bar.close()
    arm_names = [a.name for a in arms]
    result: dict[str, Any] = {
        "machine": f"{device_machine(cfg.device)}, torch {torch.__version__}, device {cfg.device}",
        "config": {
            "target": models.model_id(cfg.target),
            "draft": models.model_id(cfg.draft),
            **(
                {
                    "beside_draft": models.model_id(cfg.beside_draft),
                    "beside_draft_linear": cfg.beside_draft_linear,
                    "beside_draft_forward": forwards["beside"],
                }
                if cfg.beside_draft
                else {}
            ),
            "draft_precision": draft_precision(cfg.device, cfg.draft_precision),
            "target_linear": cfg.target_linear,
            "draft_linear": cfg.draft_linear,
            "draft_forward": forwards["race"],
            "prompts": len(prompts),
            "max_new_tokens": cfg.max_new_tokens,
            "repeats": cfg.repeats,
            "compressions": list(cfg.compressions),
            "decodings": list(cfg.decodings),
            "temperature": cfg.temperature,
        },
        "arms": arm_names,
        "minutes": (time.time() - t_start) / 60,
        "summary": summarize_runs(runs, arm_names),
        "mismatches": mismatches,
        "runs": [{k: v for k, v in r.items() if k != "output"} for r in runs],
    }
    return result


def _greedy_differences(target: Any, ids: torch.Tensor, block: list[dict[str, Any]], where: str) -> list[str]:
    """One line per run of ``block`` whose greedy output differs from the ``target`` arm's."""
    ref = next(r["output"] for r in block if r["arm"] == "target")
    out = []
    for r in block:
        if r["output"] == ref:
            continue
        n = next((k for k, (x, y) in enumerate(zip(r["output"], ref)) if x != y), min(len(r["output"]), len(ref)))
        note = ""
        if n < min(len(r["output"]), len(ref)):
            ctx = torch.cat([ids, torch.tensor([ref[:n]], dtype=ids.dtype, device=ids.device)], 1)
            gap, noise = chunking_noise(target, ctx, ref[n], r["output"][n])
            tie = NEAR_TIE if gap <= noise else "not a near tie"
            note = f" ({tie}: logit gap {gap:.4f}, chunking noise {noise:.4f})"
        out.append(f"{where} arm {r['arm']}: first difference at output token {n}{note}")
    return out
