"""``speckv-distill``: build the distilled SmolLM2 draft and the EAGLE-3 head.

Steps: prompts, self-prompts, corpus, train, copy gate, cost, eagle3, eval.

See ``docs/reference/draft.md`` and ``datasets/smollm2/build.sh`` for the commands in order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write, atomic_write_text
from ..prompts import read_prompts, write_prompt_file
from ..smollm2.distill import agreement, fit_copy, generate_corpus, train_draft
from ..smollm2.draft_model import DRAFT_META, head_slots, load_draft, save_draft
from .common import comma_list, exit_cleanly_on_sigterm, fail, float_in, int_at_least, torch_device


class DistillError(ValueError):
    """A bad input to a speckv-distill command; main() prints it on one line and exits 2."""


def _load_corpora(paths: str) -> dict:
    """Load and concatenate comma-separated corpus files."""
    merged: dict[str, Any] = {}
    minutes = 0.0
    for path in paths.split(","):
        try:  # weights_only: tensors, lists, strings and numbers only; a pickle payload cannot run
            c = torch.load(path, weights_only=True)
        except Exception as exc:
            raise DistillError(
                f"{path}: not a speckv-distill corpus ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        if not isinstance(c, dict):
            raise DistillError(f"{path}: not a speckv-distill corpus (holds a {type(c).__name__})")
        minutes += float(c.pop("minutes", 0) or 0)
        for k, v in c.items():
            merged.setdefault(k, []).extend(v)
    merged["minutes"] = round(minutes, 1)
    return merged


def _fit_copy_command(args: argparse.Namespace) -> None:
    folder = Path(args.draft)
    if not (folder / DRAFT_META).exists():
        raise DistillError(f"{folder} has no {DRAFT_META} (a folder written by 'speckv-distill train')")
    if args.max_match < 1:
        raise DistillError(f"--max-match must be >= 1, got {args.max_match}")
    meta = json.loads((folder / DRAFT_META).read_text())
    prefix = meta.get("fit_prefix")
    if not prefix:
        raise DistillError(
            f"{folder / DRAFT_META} has no fit_prefix: the copy gate is fitted "
            "on answers the draft never fitted (train with --fit-prefix)"
        )
    corpus = _load_corpora(args.corpus)
    val = [
        i
        for i, s in enumerate(corpus["split"])
        if s == "train" and corpus["greedy"][i] and not corpus["prompt_id"][i].startswith(prefix)
    ]
    held = [i for i, s in enumerate(corpus["split"]) if s == "heldout"]
    if not val:
        raise DistillError(
            f"{args.corpus} has no greedy answer to a training prompt whose id "
            f"does not start with {prefix!r} (the draft's validation prompts)"
        )
    model = load_draft(folder)
    model.clear_copy_gate()  # measure without any earlier gate first
    slots = head_slots(model)
    before = {
        "validation": agreement(model, corpus, val, slots)["overall"],
        "heldout": agreement(model, corpus, held, slots) if held else {},
    }
    t0 = time.time()
    gate = fit_copy(model, corpus, val, args.max_match)
    meta["copy"] = gate
    meta["copy_fit"] = {
        "answers": len(val),
        "positions": sum(len(corpus["topk_ids"][i]) for i in val),
        "seconds": round(time.time() - t0, 1),
        "validation_agreement_without_copy": round(before["validation"], 4),
        "validation_agreement": round(agreement(model, corpus, val, slots)["overall"], 4),
    }
    if held:
        meta["heldout_agreement_without_copy"] = before["heldout"]
        meta["heldout_agreement"] = agreement(model, corpus, held, slots)
    atomic_write_text(folder / DRAFT_META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(
        json.dumps(
            {k: meta.get(k) for k in ("copy", "copy_fit", "heldout_agreement_without_copy", "heldout_agreement")},
            indent=1,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """``speckv-distill``: one line and exit 2 on a bad input or a failed write."""
    try:
        return _main(argv)
    except (DistillError, OSError) as exc:
        return fail("speckv-distill", exc)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speckv-distill", description="Distil a draft for SmolLM2-135M-Instruct.")
    sub = p.add_subparsers(
        dest="cmd", required=True, help="the step to run (datasets/smollm2/build.sh runs them in order)"
    )
    g = sub.add_parser(
        "prompts",
        help="template prompts for distillation (training only; the target writes the summarization passages)",
    )
    g.add_argument(
        "--heldout",
        default="datasets/prompts/prompts.jsonl",
        help="prompt file whose held-out prompts must not be repeated",
    )
    g.add_argument("--out", required=True, help="JSON-lines prompt file to write")
    g.add_argument("--per-task", type=int_at_least(1), default=220, help="prompts per task type (default 220)")
    g.add_argument("--seed", type=int, default=0, help="seed of the templates' fillers (default 0)")
    sp = sub.add_parser(
        "self-prompts",
        help="training prompts the target writes itself (sampled user turns: more varied than the templates)",
    )
    sp.add_argument("--out", required=True, help="JSON-lines prompt file to write")
    sp.add_argument("--count", type=int_at_least(1), default=2000, help="requests to write (default 2000)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    sp.add_argument(
        "--temperature",
        type=float_in(0.0, 100.0, low_open=True),
        default=1.0,
        help="sampling temperature of the requests (default 1.0)",
    )
    sp.add_argument("--batch-size", type=int_at_least(1), default=64, help="requests sampled at once (default 64)")
    sp.add_argument(
        "--max-new-tokens",
        type=int_at_least(1),
        default=80,
        help="a request still open after this many tokens is dropped (default 80)",
    )
    sp.add_argument(
        "--heldout",
        default="datasets/prompts/prompts.jsonl",
        help="prompt file whose held-out prompts must not be written",
    )
    sp.add_argument(
        "--exclude",
        default="",
        help="prompt files (comma-separated) none of whose prompts, of any split, may be written: earlier draws, so "
        "that a second draw with another --seed repeats no request of the first",
    )
    sp.add_argument(
        "--device",
        type=torch_device,
        default="cpu",
        help="torch device the target writes on: cpu (default) or cuda[:N]",
    )
    c = sub.add_parser("corpus", help="let the target answer the prompts; record its top-k distributions")
    c.add_argument("--prompts", required=True, help="JSON-lines prompt file to answer")
    c.add_argument("--out", required=True, help="corpus file to write (once, at the end)")
    c.add_argument(
        "--samples", type=int_at_least(1), default=4, help="answers per training prompt (1 greedy + sampled)"
    )
    c.add_argument("--max-new-tokens", type=int_at_least(1), default=160, help="new tokens per answer (default 160)")
    c.add_argument("--batch-size", type=int_at_least(1), default=16, help="prompts answered per batch (default 16)")
    c.add_argument("--dtype", default="bf16", help="dtype the target answers in (default bf16)")
    c.add_argument(
        "--temperature",
        type=float_in(0.0, 100.0, low_open=True),
        default=0.8,
        help="temperature of the sampled answers (default 0.8)",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the sampled answers (default 0)")
    c.add_argument("--sampled-only", action="store_true", help="no greedy answers (for an extra corpus)")
    c.add_argument(
        "--device",
        type=torch_device,
        default="cpu",
        help="torch device the target answers on: cpu (default) or cuda[:N]",
    )
    t = sub.add_parser("train", help="train the draft on a corpus")
    t.add_argument("--corpus", required=True, help="corpus file(s), comma-separated")
    t.add_argument("--out", required=True, help="draft folder to write")
    t.add_argument(
        "--minutes", type=float_in(0.0, 1e6, low_open=True), default=28.0, help="training time budget (default 28)"
    )
    t.add_argument("--layers", default="0,1", help="target layers the draft starts from, comma-separated (default 0,1)")
    t.add_argument(
        "--head-size", type=int_at_least(1), default=8192, help="tokens of the reduced output head (default 8192)"
    )
    t.add_argument("--lr", type=float_in(0.0, 10.0, low_open=True), default=1e-3, help="learning rate (default 1e-3)")
    t.add_argument(
        "--val-fraction",
        type=float_in(0.0, 0.9),
        default=0.1,
        help="share of training prompts for checkpoint selection (0: keep the last step)",
    )
    t.add_argument(
        "--fit-prefix",
        default=None,
        help="fit only training prompts whose id starts with this (e.g. gen-); the other training "
        "prompts select the checkpoint",
    )
    k = sub.add_parser("cost", help="ms per generated token: draft vs target (fp32, CPU)")
    k.add_argument("--draft", required=True, help="draft folder")
    k.add_argument("--tokens", type=int_at_least(1), default=32, help="tokens generated per timing (default 32)")
    k.add_argument("--no-copy", action="store_true", help="time the draft without its context-copy gate")
    k.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="the draft's dtype")
    cp = sub.add_parser("copy", help="fit the draft's context-copy gate on its validation answers (updates draft.json)")
    cp.add_argument("--corpus", required=True, help="corpus file(s) with the validation and held-out answers")
    cp.add_argument("--draft", required=True, help="draft folder whose draft.json gets the gate")
    cp.add_argument("--max-match", type=int, default=8, help="longest context match the gate reads (default 8)")
    h = sub.add_parser(
        "eagle3",
        help="train an EAGLE-3 head (speculators format) on the target's features: resumable, a progress bar",
    )
    h.add_argument("--corpus", required=True, help="corpus file(s), comma-separated")
    h.add_argument("--out", required=True, help="head folder to write (config.json, model.safetensors, speckv.json)")
    h.add_argument(
        "--work",
        required=True,
        help="folder for the features (shards of 512 texts, read memory-mapped) and the checkpoint (resumes from both)",
    )
    h.add_argument(
        "--minutes", type=float_in(0.0, 1e6, low_open=True), default=33.0, help="training time budget (default 33)"
    )
    h.add_argument(
        "--vocab-size", type=int_at_least(2), default=8192, help="tokens of the head's vocabulary (default 8192)"
    )
    h.add_argument(
        "--layers",
        type=comma_list(cast=int_at_least(0)),
        default=None,
        help="target layers whose entering states the head reads, comma-separated and increasing "
        "(default: speculators' 2, L/2, L-3; 2,15,27 for SmolLM2)",
    )
    h.add_argument("--ttt-steps", type=int_at_least(1), default=2, help="training-time-test depth (default 2)")
    h.add_argument("--lr", type=float_in(0.0, 10.0, low_open=True), default=2e-3, help="learning rate (default 2e-3)")
    h.add_argument(
        "--weight-decay", type=float_in(0.0, 10.0), default=0.0, help="AdamW's decoupled weight decay (default 0)"
    )
    h.add_argument(
        "--feature-noise",
        type=float_in(0.0, 10.0),
        default=0.0,
        help="Gaussian noise added to the fitted target states, times each state's RMS (default 0)",
    )
    h.add_argument(
        "--freeze-lm-head",
        action="store_true",
        help="keep the head's output rows the target's own (default: train them)",
    )
    h.add_argument("--fit-prefix", default="gen-", help="fit training prompts whose id starts with this (default gen-)")
    h.add_argument(
        "--compressions", default="fp32,int8,nf4", help="targets to measure held-out agreement on (default all three)"
    )
    h.add_argument(
        "--copy-max-match",
        type=int_at_least(0),
        default=8,
        help="the head's context-copy gate reads context matches up to this long (default 8; 0: no gate)",
    )
    h.add_argument(
        "--device",
        type=torch_device,
        default="cpu",
        help="torch device the target and the training run on: cpu (default) or cuda[:N]; features stay in --work",
    )
    h.add_argument(
        "--train-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: train under bf16 autocast (1.7x faster a step on a CPU with AMX, same agreement; much slower on "
        "AVX2-only CPUs); default fp32",
    )
    e = sub.add_parser("eval", help="held-out greedy agreement of a shipped draft")
    e.add_argument("--corpus", required=True, help="corpus file(s) with the held-out answers")
    e.add_argument("--draft", required=True, help="draft folder")
    args = p.parse_args(argv)
    exit_cleanly_on_sigterm()
    for path in (getattr(args, "corpus", None) or "").split(","):
        if path and not os.path.exists(path):
            print(
                f"speckv-distill: error: corpus not found: {path} (make one with 'speckv-distill corpus')",
                file=sys.stderr,
            )
            return 2
    torch.set_num_threads(os.cpu_count() or 1)
    if args.cmd == "prompts":
        from ..smollm2.distill_prompts import build_distill_prompts

        held = {p.text for p in read_prompts(args.heldout) if p.split == "heldout"}
        records = build_distill_prompts(args.per_task, seed=args.seed, heldout_texts=held)
        write_prompt_file(records, args.out)
        print(f"prompts: {len(records)} training prompts -> {args.out}")
    elif args.cmd == "self-prompts":
        from ..smollm2.self_prompts import self_prompts

        t0 = time.time()
        try:  # a bad held-out file, or too few finished requests: one line, exit 2
            held = {p.text for p in read_prompts(args.heldout) if p.split == "heldout"}
            for path in filter(None, args.exclude.split(",")):
                held |= {p.text for p in read_prompts(path)}
            records = self_prompts(
                args.count,
                seed=args.seed,
                temperature=args.temperature,
                batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens,
                exclude=held,
                device=args.device,
            )
        except ValueError as exc:
            raise DistillError(str(exc)) from None
        write_prompt_file(records, args.out)
        print(f"self-prompts: {len(records)} training prompts, {(time.time() - t0) / 60:.1f} min -> {args.out}")
    elif args.cmd == "corpus":
        t0 = time.time()
        corpus = generate_corpus(
            read_prompts(args.prompts),
            samples=args.samples,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            dtype=args.dtype,
            temperature=args.temperature,
            seed=args.seed,
            greedy_answers=not args.sampled_only,
            device=args.device,
        )
        corpus["minutes"] = round((time.time() - t0) / 60, 1)
        atomic_write(args.out, lambda tmp: torch.save(corpus, tmp))
        n = sum(len(x) for x in corpus["topk_ids"])
        print(f"corpus: {len(corpus['ids'])} answers, {n} answer tokens, {corpus['minutes']} min -> {args.out}")
    elif args.cmd == "train":
        corpus = _load_corpora(args.corpus)
        model, meta = train_draft(
            corpus,
            layers=tuple(int(x) for x in args.layers.split(",")),
            head_size=args.head_size,
            minutes=args.minutes,
            lr=args.lr,
            val_fraction=args.val_fraction,
            fit_prefix=args.fit_prefix,
        )
        meta["corpus_minutes"] = corpus.get("minutes")
        save_draft(model, args.out, meta)
        print(
            json.dumps(
                {
                    k: meta[k]
                    for k in (
                        "steps",
                        "best_step",
                        "validation_agreement",
                        "train_minutes",
                        "train_tokens",
                        "heldout_agreement",
                        "train_agreement",
                    )
                },
                indent=1,
            )
        )
    elif args.cmd == "cost":
        from ..hf.models import full_precision_dtype
        from ..smollm2.models import load_model

        ids = torch.randint(100, 5000, (1, 80), generator=torch.Generator().manual_seed(0))
        result = {}
        draft = load_draft(args.draft, dtype=full_precision_dtype(args.precision))
        if args.no_copy:
            draft.clear_copy_gate()
        for name, model in (("draft", draft), ("target", load_model("smollm2", "fp32"))):
            model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
            result[f"{name}_ms_per_token"] = round((time.perf_counter() - t0) / args.tokens * 1e3, 2)
        result["ratio"] = round(result["draft_ms_per_token"] / result["target_ms_per_token"], 3)
        print(json.dumps(result))
    elif args.cmd == "copy":
        _fit_copy_command(args)
    elif args.cmd == "eagle3":
        from ..smollm2.eagle3 import build_eagle3

        comps = tuple(c.strip() for c in args.compressions.split(",") if c.strip())
        bad = [c for c in comps if c not in ("fp32", "int8", "nf4")]
        if bad or "fp32" not in comps:
            raise DistillError(f"--compressions: expected fp32 and any of int8, nf4; got {args.compressions!r}")
        try:
            meta = build_eagle3(
                _load_corpora(args.corpus),
                args.out,
                args.work,
                fit_prefix=args.fit_prefix,
                minutes=args.minutes,
                draft_vocab_size=args.vocab_size,
                layer_ids=args.layers,
                steps=args.ttt_steps,
                lr=args.lr,
                compressions=comps,
                copy_max_match=args.copy_max_match,
                device=args.device,
                train_precision=args.train_precision,
                weight_decay=args.weight_decay,
                feature_noise=args.feature_noise,
                train_lm_head=not args.freeze_lm_head,
            )
        except ValueError as exc:
            raise DistillError(str(exc)) from None
        keys = ("steps", "train_minutes", "validation_agreement", "heldout_agreement", "heldout_agreement_without_copy")
        print(json.dumps({k: meta[k] for k in keys}, indent=1))
    else:
        corpus = _load_corpora(args.corpus)
        model = load_draft(args.draft)
        held = [i for i, s in enumerate(corpus["split"]) if s == "heldout"]
        print(json.dumps(agreement(model, corpus, held, head_slots(model)), indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
