"""The EAGLE-3 head for SmolLM2-135M-Instruct: features, training and held-out agreement in one resumable build.

``speckv-distill eagle3`` runs :func:`build_eagle3`; the loop itself is
:mod:`speckv_policy.hf.eagle3_train` (the speculators trainer expects an
accelerator). The folder it writes is the speculators ``eagle3`` layout
(:mod:`speckv_policy.hf.eagle3`) plus ``speckv.json`` (what the build measured).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write, atomic_write_text
from ..hf.eagle3 import Eagle3Config
from ..hf.eagle3_train import (
    agreement,
    choose_vocabulary,
    extract_features,
    fit_head_copy_gate,
    init_head,
    train_head,
)

# texts per features shard: one shard is in memory while it is extracted (~0.3 GB of SmolLM2 features)
SHARD_TEXTS = 512
# in each features folder: the target layers its shards were read from
FEATURE_LAYERS = "layers.json"


def _load_features(path: Path, corpus: dict, idx: list[int], stale_hint: str) -> list[dict[str, Any]]:
    """A features file's texts, memory-mapped (pages are read as they are used), checked against corpus texts ``idx``."""
    try:  # weights_only: tensors, lists, strings and numbers; a pickle payload cannot run
        feats = torch.load(path, weights_only=True, mmap=True)
    except Exception as exc:
        raise ValueError(
            f"{path}: not a features file of this build ({type(exc).__name__}); {stale_hint} to extract again"
        ) from None
    if not isinstance(feats, list) or not all(
        isinstance(f, dict) and isinstance(f.get("ids"), torch.Tensor) for f in feats
    ):
        raise ValueError(
            f"{path}: not a features file of this build (expected a list of texts, each with its token 'ids'); "
            f"{stale_hint} to extract again"
        )
    if len(feats) != len(idx):
        stale = f"it holds {len(feats)} texts where the corpus asks for {len(idx)}"
    else:
        k = next(
            (k for k, (f, i) in enumerate(zip(feats, idx)) if not torch.equal(f["ids"], corpus["ids"][i].long())),
            None,
        )
        stale = None if k is None else f"its text {k} has other token ids than the corpus' text {idx[k]}"
    if stale:
        raise ValueError(
            f"{path}: {stale} (the corpus changed since they were extracted); {stale_hint} or use another --work folder"
        )
    return feats


def _check_layers(folder: Path, layer_ids: tuple[int, ...], unrecorded: tuple[int, ...]) -> None:
    """Refuse features in ``folder`` (or its single-file form) read from other target layers than ``layer_ids``.

    The folder's ``layers.json`` names the layers its shards were extracted at; it is written before the first
    shard. Features without it were written by builds that always read ``unrecorded`` (speculators' default).
    """
    import json

    record, legacy = folder / FEATURE_LAYERS, folder.with_suffix(".pt")
    has_features = legacy.exists() or any(folder.glob("part-*.pt"))
    if record.exists() and not record.is_file():
        raise ValueError(f"{record}: not a regular file; delete it or use another --work folder")
    try:
        got = tuple(json.loads(record.read_text())["aux_layer_ids"]) if record.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{record}: not a layer record of this build; delete the folder to extract again") from None
    if got is None and has_features:
        got = tuple(unrecorded)
    if got is not None and tuple(got) != tuple(layer_ids):
        raise ValueError(
            f"{folder}: its features were read from target layers {list(got)}, the head asks for {list(layer_ids)}; "
            "use another --work folder (or delete this one) to extract them again"
        )
    if not record.exists() and (folder.exists() or not legacy.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps({"aux_layer_ids": list(layer_ids)}) + "\n")


def _cached_features(
    folder: Path,
    corpus: dict,
    idx: list[int],
    model: Any,
    layer_ids: tuple[int, ...],
    desc: str,
    progress: bool,
    unrecorded: tuple[int, ...] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """The features of corpus texts ``idx`` and how many of them were extracted now (the rest were read).

    ``folder`` holds them in shards of :data:`SHARD_TEXTS` texts (``part-00000.pt``, ...), each saved as soon as it
    is extracted, so an interrupted build resumes at the next shard; all are read back memory-mapped, so the build
    holds one shard in memory rather than every text's features. A single ``<folder>.pt`` file, as builds before the
    shards wrote, is read instead where there is no folder. Features read from other target layers than
    ``layer_ids`` are refused (see :func:`_check_layers`; ``unrecorded``, default ``layer_ids``: the layers of
    features written before builds recorded them).
    """
    _check_layers(folder, layer_ids, layer_ids if unrecorded is None else unrecorded)
    legacy = folder.with_suffix(".pt")
    if legacy.exists() and not folder.exists():
        return _load_features(legacy, corpus, idx, "delete it"), 0
    parts = [idx[k : k + SHARD_TEXTS] for k in range(0, len(idx), SHARD_TEXTS)]
    names = [f"part-{k:05d}.pt" for k in range(len(parts))]
    folder.mkdir(parents=True, exist_ok=True)
    stray = sorted(p.name for p in folder.glob("part-*.pt") if p.name not in names)
    if stray:
        raise ValueError(
            f"{folder}: holds {stray[0]} where the corpus asks for {len(parts)} shards of {SHARD_TEXTS} texts "
            "(the corpus changed since they were extracted); delete the folder or use another --work folder"
        )
    feats: list[dict[str, Any]] = []
    extracted = 0
    for k, (part, name) in enumerate(zip(parts, names)):
        path = folder / name
        if not path.exists():
            new = extract_features(
                corpus,
                part,
                model,
                layer_ids,
                progress=progress,
                desc=f"{desc} {k + 1}/{len(parts)}",
                tokens_per_batch=2048,
            )
            atomic_write(path, lambda tmp: torch.save(new, tmp))  # noqa: B023 - called at once
            del new
            extracted += len(part)
        feats += _load_features(path, corpus, part, "delete the folder")
    return feats, extracted


def _previous_meta(folder: Path) -> dict[str, Any]:
    """What the head folder's ``speckv.json`` recorded, if it holds a readable one (else empty)."""
    import json

    from ..hf.eagle3 import EAGLE3_META

    try:
        meta = json.loads((folder / EAGLE3_META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def build_eagle3(
    corpus: dict,
    out: str | Path,
    work: str | Path,
    *,
    fit_prefix: str = "gen-",
    minutes: float = 33.0,
    draft_vocab_size: int = 8192,
    layer_ids: tuple[int, ...] | None = None,
    steps: int = 2,
    lr: float = 2e-3,
    tokens_per_batch: int = 2048,
    compressions: tuple[str, ...] = ("fp32", "int8", "nf4"),
    copy_max_match: int = 8,
    device: str = "cpu",
    train_precision: str = "fp32",
    weight_decay: float = 0.0,
    feature_noise: float = 0.0,
    train_lm_head: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the EAGLE-3 head for SmolLM2 and write its speculators folder to ``out``.

    ``corpus`` is a merged ``speckv-distill corpus`` dict: training texts whose prompt id starts with
    ``fit_prefix`` are fitted; the other training prompts' greedy answers select the checkpoint; held-out answers
    are measured once at the end, at every compression in ``compressions`` (the head reads that target's
    features and is compared with that target's greedy tokens). After training, the head's context-copy gate
    (:mod:`speckv_policy.hf.copy_gate`, matches up to ``copy_max_match`` tokens; 0: none) is fitted on the
    checkpoint-selection answers, and held-out agreement is measured with it and without. ``work`` keeps the
    features (in shards, read memory-mapped: see :func:`_cached_features`) and the training checkpoint, so an
    interrupted build resumes. ``device`` runs the target and the training there (``"cuda"`` on a GPU); the
    features stay in ``work`` either way. ``train_precision``, ``weight_decay``, ``feature_noise`` and
    ``train_lm_head``: :func:`~speckv_policy.hf.eagle3_train.train_head`'s ``precision`` and the rest.
    """
    from transformers import AutoConfig

    from .gguf import smollm2_safetensors
    from .models import load_model

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    split, pid = corpus["split"], corpus["prompt_id"]
    fit = [i for i in range(len(split)) if split[i] == "train" and pid[i].startswith(fit_prefix)]
    val = [i for i in range(len(split)) if split[i] == "train" and not pid[i].startswith(fit_prefix)]
    val = [i for i in val if corpus["greedy"][i]]
    held = [i for i in range(len(split)) if split[i] == "heldout" and corpus["greedy"][i]]
    if not fit or not val:
        raise ValueError(
            f"the corpus needs training texts with prompt ids starting {fit_prefix!r} (got {len(fit)}) "
            f"and other training prompts' greedy answers (got {len(val)})"
        )
    t0 = time.time()
    # the target's shape from its config alone: a head it cannot have (layers out of range), or work-folder features
    # read at other layers, are refused before the target loads
    target_config = AutoConfig.from_pretrained(smollm2_safetensors())
    cfg = Eagle3Config.for_target(
        target_config, draft_vocab_size, layer_ids, verifier="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    ids = cfg.aux_layer_ids
    default_ids = Eagle3Config.for_target(target_config, draft_vocab_size).aux_layer_ids  # what older builds read
    for name in ("fp32", *(f"{c}-heldout" for c in compressions if c != "fp32")):  # the folders used below
        _check_layers(work / f"features-{name}", ids, default_ids)
    target = load_model("smollm2", "fp32", device)
    feats, extracted = _cached_features(
        work / "features-fp32", corpus, fit + val + held, target, ids, "features fp32", progress, default_ids
    )
    f_fit, f_val, f_held = feats[: len(fit)], feats[len(fit) : len(fit) + len(val)], feats[len(fit) + len(val) :]
    feature_minutes: float | None = round((time.time() - t0) / 60, 1)
    # a resumed build: the extraction time is that of the run that extracted them, if it recorded one; resumed part
    # way through the shards, no one run's time is the extraction's
    if extracted == 0:
        feature_minutes = _previous_meta(Path(out)).get("feature_minutes")
    elif extracted < len(feats):
        feature_minutes = None
    vocab, coverage = choose_vocabulary(f_fit, draft_vocab_size)
    head = init_head(target, cfg, vocab).to(device)
    embed = target.get_input_embeddings().weight.detach().float()
    torch.manual_seed(0)
    info = train_head(
        head,
        embed,
        f_fit,
        f_val,
        minutes=minutes,
        checkpoint=work / "train-checkpoint.pt",
        steps=steps,
        lr=lr,
        tokens_per_batch=tokens_per_batch,
        progress=progress,
        precision=train_precision,
        weight_decay=weight_decay,
        feature_noise=feature_noise,
        train_lm_head=train_lm_head,
    )
    copy_gate = fit_head_copy_gate(head, embed, f_val, copy_max_match) if copy_max_match > 0 else None
    held_agreement: dict[str, dict[str, float]] = {"fp32": agreement(head, embed, f_held)}
    plain_agreement: dict[str, dict[str, float]] = {"fp32": agreement(head, embed, f_held, copy=False)}
    del target
    for comp in compressions:
        if comp == "fp32":
            continue
        quant = load_model("smollm2", comp, device)
        fq, _ = _cached_features(
            work / f"features-{comp}-heldout", corpus, held, quant, ids, f"features {comp}", progress, default_ids
        )
        held_agreement[comp] = agreement(head, embed, fq)
        plain_agreement[comp] = agreement(head, embed, fq, copy=False)
        del quant
    meta = {
        "base": "smollm2",
        "kind": "eagle3",
        "aux_layer_ids": list(ids),
        "draft_vocab_size": draft_vocab_size,
        "vocabulary_greedy_coverage": round(coverage, 4),
        "ttt_steps": steps,
        "train_precision": train_precision,
        "lr": lr,
        "weight_decay": weight_decay,
        "feature_noise": feature_noise,
        "train_lm_head": train_lm_head,
        "tokens_per_batch": tokens_per_batch,
        "fit_prefix": fit_prefix,
        "texts": {"fit": len(fit), "validation": len(val), "heldout": len(held)},
        "fit_positions": int(sum(len(t["ids"]) for t in f_fit)),
        "feature_minutes": feature_minutes,
        "corpus_minutes": corpus.get("minutes"),
        **info,
        "heldout_agreement": held_agreement,
        "heldout_agreement_without_copy": plain_agreement,
        "copy_fit_texts": len(val) if copy_gate is not None else 0,
        **({"copy": copy_gate} if copy_gate is not None else {}),
    }
    head.save(out, meta=meta)
    return meta
