"""End-to-end wall-clock race: every draft-length strategy inside real Hugging Face generation.

    .venv/bin/python benchmarks/e2e.py                      # real pair, held-out prompts (CPU: ~40 min)
    .venv/bin/python benchmarks/e2e.py --per-task 1 --repeats 1 --max-new-tokens 16   # a quick look

For each compression level and decoding (greedy; sampling at T = 0.7) it runs, on the
held-out prompts, interleaved (every arm on one prompt, then the next prompt; the arm order
rotates from prompt to prompt so no arm always runs first):

* ``target``: the target alone;
* ``fixed-{2,4,6,8}``: Hugging Face assisted generation with a constant draft length and the
  confidence stop switched off (HF's own code);
* ``hf-default``: HF's defaults (up to 20 draft tokens, stop under draft confidence 0.4, the
  threshold re-tuned online by HF), untouched; ``hf-heuristic``: HF's ``heuristic`` schedule
  (+2 after a fully accepted draft, -1 otherwise; confidence stop off). HF keeps both states
  on the draft model between calls; each arm keeps its own across the prompts of a block,
  as a server would;
* ``adaedl``: an AdaEDL-style training-free entropy stop (per-token): stop drafting when
  ``1 - sqrt(0.2 * H)`` falls under ``lambda = 0.5 + 0.3 * (0.5 - ema_acceptance)`` (fixed
  constants, not tuned on the prompts here);
* ``mlp16``: the published MLP16 recipe (tokens-per-step objective; draft 8, keep gamma);
* ours: ``{mlp,gbt,table}-upfront``, ``{mlp,gbt,table}-pertoken`` and ``{mlp,gbt,table}-backoff`` (upfront
  with ``probe_backoff=8``: after a probe that ends in gamma 0, skip probing for 1, 2, 4, 8 steps) from ``exported/``.

Every greedy output is compared with the target's own greedy output for the same prompt;
any difference is reported (and makes the exit status 1). Results: medians of time per output
token over the runs, ratios as medians of per-run ratios against runs of the same prompt and
repeat (so drift cancels). Writes JSON, a plot, and the e2e section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from speckv_policy.schema import ONLINE  # noqa: E402

BEGIN, END = "<!-- e2e:begin -->", "<!-- e2e:end -->"
OURS = ("mlp", "gbt", "table")
ADAEDL_GAMMA, ADAEDL_BASE, ADAEDL_GAIN = 0.2, 0.5, 0.3
BACKOFF = 8  # probe back-off cap of the *-backoff arms (attach(..., probe_backoff=8))


def adaedl_policy(features: Any) -> int:
    """AdaEDL-style stop rule in per-token mode: 2 = keep the token and go on, 0 = drop it and stop."""
    x = np.asarray(features, dtype=np.float64).reshape(-1)
    h = x[ONLINE.names.index("entropy_first")]
    ema = x[ONLINE.names.index("ema_accept_rate")]
    lam = ADAEDL_BASE + ADAEDL_GAIN * (0.5 - ema)
    return 2 if 1.0 - np.sqrt(ADAEDL_GAMMA * max(h, 0.0)) >= lam else 0


@dataclass
class ArmSpec:
    """One strategy: how to configure the draft and (optionally) attach a policy."""

    name: str
    assistant: bool = True
    hf: dict[str, Any] = field(default_factory=dict)  # draft generation_config fields for HF's own code
    policy: Any = None
    mode: str | None = None
    group: str = "baseline"
    backoff: int = 0


def make_arms(policy_dir: Path, prefix: str, names: list[str] | None) -> list[ArmSpec]:
    off = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    arms = [ArmSpec("target", assistant=False)]
    arms += [ArmSpec(f"fixed-{g}", hf={**off, "num_assistant_tokens": g}, group="fixed") for g in (2, 4, 6, 8)]
    arms.append(ArmSpec("hf-default", hf={"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                                          "assistant_confidence_threshold": 0.4}))
    arms.append(ArmSpec("hf-heuristic", hf={"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "heuristic",
                                            "assistant_confidence_threshold": 0.0}))
    arms.append(ArmSpec("adaedl", policy=adaedl_policy, mode="per-token"))
    arms.append(ArmSpec("mlp16", policy=policy_dir / f"{prefix}paper-mlp16.onnx", mode="truncate"))
    for kind in OURS:
        for mode, tag in (("upfront", "upfront"), ("per-token", "pertoken")):
            arms.append(ArmSpec(f"{kind}-{tag}", policy=policy_dir / f"{prefix}{kind}.onnx", mode=mode, group="ours"))
        arms.append(ArmSpec(f"{kind}-backoff", policy=policy_dir / f"{prefix}{kind}.onnx", mode="upfront",
                            group="ours", backoff=BACKOFF))
    if names:
        unknown = sorted(set(names) - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"e2e: unknown arm(s) {', '.join(unknown)}; known: {', '.join(a.name for a in arms)}")
        arms = [a for a in arms if a.name in names or a.name == "target"]
    from speckv_policy.runtime import RuntimePolicy

    loaded: dict[Path, RuntimePolicy] = {}
    for a in arms:
        if isinstance(a.policy, Path):
            if not a.policy.exists():
                raise SystemExit(f"e2e: policy file for arm {a.name} not found: {a.policy} (run speckv-quickstart)")
            a.policy = loaded.setdefault(a.policy, RuntimePolicy(a.policy))  # load once, not per run
    return arms


HF_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def run_once(arm: ArmSpec, state: dict[str, Any], target: Any, draft: Any, ids: Any, *, compression: str,
             sampling: bool, temperature: float, max_new_tokens: int, seed: int, pad: int | None,
             stopwatch: Callable[[], float]) -> dict[str, Any]:
    """One timed generate call; returns tokens, seconds, output ids and the hook's decision time."""
    import torch

    from speckv_policy.hf import attach

    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=sampling, pad_token_id=pad)
    if sampling:
        kw.update(temperature=temperature, top_p=1.0, top_k=0)
    if arm.assistant:
        kw["assistant_model"] = draft
        for k in HF_FIELDS:  # this arm's own HF state (persisted between its calls)
            setattr(draft.generation_config, k, state.get(k, arm.hf.get(k, getattr(draft.generation_config, k))))
    torch.manual_seed(seed)
    handle = None
    if arm.policy is not None:
        handle = attach(target, arm.policy, compression=compression, mode=arm.mode, max_gamma=8,
                        feature_set="online" if callable(arm.policy) else None, probe_backoff=arm.backoff)
    try:
        t0 = stopwatch()
        with torch.no_grad():
            out = target.generate(ids, **kw)
        seconds = stopwatch() - t0
    finally:
        summary = handle.summary() if handle is not None else {}
        if handle is not None:
            handle.detach()
    if arm.assistant:
        for k in HF_FIELDS:
            state[k] = getattr(draft.generation_config, k)
    new = out[0, ids.shape[1]:].tolist()
    return {"tokens": len(new), "seconds": seconds, "output": new,
            "steps": summary.get("steps"), "decision_s": summary.get("decision_us_mean", 0.0) * summary.get("steps", 0) / 1e6,
            "fallbacks": summary.get("fallbacks", 0)}


HF_OWN = ("fixed-", "hf-")


NEAR_TIE = "near tie"


def unexplained(mismatches: list[str]) -> list[str]:
    """Mismatches that are neither on a prompt where HF's own assisted arms differ too, nor a near tie.

    With a target whose k-token verification is not bit-identical to k single steps (bitsandbytes
    INT8 / NF4 on CPU), assisted decoding can depart from plain greedy. Such a difference is
    explained when HF's own assisted arms (fixed-*, hf-*) differ on the same prompt and repeat too,
    or when :func:`chunking_noise` marked it as a near tie; anything else counts as a failure.
    """
    own = {m.split(" arm ")[0] for m in mismatches if m.split(" arm ")[1].startswith(HF_OWN)}
    return [m for m in mismatches if m.split(" arm ")[0] not in own and f"({NEAR_TIE}:" not in m]


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
    import torch
    from transformers import DynamicCache

    def last_logits(k: int) -> Any:
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(context[:, :-k], cache=cache, use_cache=True)
            return target(context[:, -k:], cache=cache, use_cache=True).logits[0, -1].float()

    single = last_logits(1)
    noise = max((float((last_logits(k) - single).abs().max()) for k in (2, 4, 8) if k < context.shape[1]),
                default=0.0)
    return float(single[ref_token] - single[other_token]), noise


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Medians of ms per output token and of paired ratios, per (compression, decoding[, task])."""
    cells: dict[tuple, dict[str, Any]] = {}
    keys = sorted({(r["compression"], r["decoding"]) for r in runs})
    tasks = sorted({r["task_type"] for r in runs})
    for comp, dec in keys:
        for task in [None, *tasks]:
            sel = [r for r in runs if r["compression"] == comp and r["decoding"] == dec
                   and (task is None or r["task_type"] == task)]
            if not sel:
                continue
            by = {(r["prompt_id"], r["repeat"], r["arm"]): r for r in sel}
            pairs = sorted({(r["prompt_id"], r["repeat"]) for r in sel})
            ms = {a: [1e3 * by[p + (a,)]["seconds"] / max(by[p + (a,)]["tokens"], 1) for p in pairs if p + (a,) in by]
                  for a in arms}
            med = {a: float(np.median(v)) for a, v in ms.items() if v}
            fixed = [a for a in med if a.startswith("fixed-")]
            best_fixed = min(fixed, key=lambda a: med[a]) if fixed else None

            def ratio(a: str, ref: str | None) -> float | None:
                if ref is None or a not in med or ref not in med:
                    return None
                v = [by[p + (ref,)]["seconds"] / max(by[p + (ref,)]["tokens"], 1)
                     / (by[p + (a,)]["seconds"] / max(by[p + (a,)]["tokens"], 1))
                     for p in pairs if p + (a,) in by and p + (ref,) in by]
                return float(np.median(v))

            cell = {"runs_per_arm": len(pairs), "best_fixed": best_fixed, "arms": {}}
            for a in med:
                dec_s = sum(by[p + (a,)]["decision_s"] for p in pairs if p + (a,) in by)
                tot_s = sum(by[p + (a,)]["seconds"] for p in pairs if p + (a,) in by)
                cell["arms"][a] = {
                    "ms_per_token": med[a], "tokens_per_second": 1e3 / med[a],
                    "vs_target": ratio(a, "target"), "vs_fixed4": ratio(a, "fixed-4"),
                    "vs_best_fixed": ratio(a, best_fixed), "vs_hf_default": ratio(a, "hf-default"),
                    "decision_share": dec_s / tot_s if tot_s > 0 else 0.0,
                }
            cells[(comp, dec, task or "all")] = cell
    return {f"{c}/{d}/{t}": v for (c, d, t), v in cells.items()}


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    arms = result["arms"]
    ours = [a for a in arms if a.split("-")[0] in OURS]
    lines = [BEGIN, "", "## End-to-end wall clock (`benchmarks/e2e.py`)", "", "```", result["command"], "```", "",
             f"Machine: {result['machine']}. Target {cfg['target']}, draft {cfg['draft']}; {cfg['prompts']} held-out "
             f"prompts ({cfg['per_task']} per task type), {cfg['max_new_tokens']} new tokens, {cfg['repeats']} "
             f"repeat(s), arms interleaved per prompt; {result['minutes']:.1f} min in all. Figures are medians over "
             "runs of time per output token; ratios are medians of per-run ratios against the same prompt's run of "
             "the reference (x target = speed-up over the target alone).", ""]
    for key, cell in result["summary"].items():
        comp, dec, task = key.split("/")
        if task != "all":
            continue
        bf = cell["best_fixed"]
        lines += [f"### {comp}, {dec} (best fixed gamma: {bf.split('-')[1] if bf else '-'})", "",
                  "| arm | tokens/s | ms/token | x target | x fixed 4 | x best fixed | x HF default | decision share |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for a in arms:
            v = cell["arms"].get(a)
            if v is None:
                continue
            name = f"**{a}**" if a in ours else a
            share = f"{100 * v['decision_share']:.2f}%" if a in ours or a in ("mlp16", "adaedl") else ""
            lines.append(f"| {name} | {v['tokens_per_second']:.2f} | {v['ms_per_token']:.1f} | {_fmt(v['vs_target'])} | "
                         f"{_fmt(v['vs_fixed4'])} | {_fmt(v['vs_best_fixed'])} | {_fmt(v['vs_hf_default'])} | {share} |")
        lines.append("")
    tasks = sorted({k.split("/")[2] for k in result["summary"]} - {"all"})
    if tasks:
        lines += ["### x target alone by task type (greedy)", "",
                  "| arm | " + " | ".join(f"{c}/{t}" for c in cfg["compressions"] for t in tasks) + " |",
                  "|---|" + "---:|" * (len(cfg["compressions"]) * len(tasks))]
        for a in arms:
            cells = []
            for c in cfg["compressions"]:
                for t in tasks:
                    v = result["summary"].get(f"{c}/greedy/{t}", {}).get("arms", {}).get(a)
                    cells.append(_fmt(v["vs_target"]) if v else "")
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Goals (printed, not unit tests)", ""] + [f"- {g}" for g in result["goals"]] + [""]
    lines += ["### Greedy outputs", ""]
    if result["mismatches"]:
        bad = unexplained(result["mismatches"])
        lines.append(f"{len(result['mismatches'])} greedy run(s) differ from the target's own greedy output; "
                     f"{len(bad)} of them unexplained, i.e. neither on a prompt where HF's own assisted arms "
                     "(fixed-*, hf-*) differ too nor a near tie (the target's own logit gap there no larger than "
                     "the change a multi-token pass makes to its logits): a target whose multi-token verification "
                     "is not bit-identical to single steps, see docs/hf_hook.md:")
        lines += [f"- {m}" for m in result["mismatches"][:30]]
    else:
        lines.append("Every greedy run produced exactly the target's own greedy output.")
    lines += ["", f"![speed-up over the target alone]({result['plot']})", "", END]
    return "\n".join(lines)


def goals(result: dict[str, Any]) -> list[str]:
    out = []
    s = result["summary"]
    ours = [a for a in result["arms"] if a.split("-")[0] in OURS]
    for comp in result["config"]["compressions"]:
        cell = s.get(f"{comp}/greedy/all")
        if not cell or not ours:
            continue
        best = max(ours, key=lambda a: cell["arms"][a]["tokens_per_second"])
        v = cell["arms"][best]
        for label, key, goal in (("best fixed gamma", "vs_best_fixed", 1.10), ("HF default", "vs_hf_default", 1.15),
                                 ("target alone", "vs_target", 1.00)):
            if v.get(key) is not None:
                out.append(f"{comp} greedy, best of ours ({best}) vs {label}: {v[key]:.2f}x (goal >= {goal:.2f}x) "
                           + ("MET" if v[key] >= goal else "MISSED"))
        for key, cell_t in s.items():
            c, d, t = key.split("/")
            if c == comp and d == "greedy" and t != "all":
                r = cell_t["arms"].get(best, {}).get("vs_target")
                worst = min(ours, key=lambda a: cell_t["arms"].get(a, {}).get("vs_target") or 0)
                goal = 1.15 if t == "code" else 1.00
                if r is not None:
                    out.append(f"{comp} greedy {t}: {best} vs target alone {r:.2f}x (goal >= {goal:.2f}x) "
                               + ("MET" if r >= goal else "MISSED")
                               + f"; slowest of ours here: {worst} {cell_t['arms'][worst]['vs_target']:.2f}x")
        shares = [cell["arms"][a]["decision_share"] for a in ours]
        out.append(f"{comp} greedy decision overhead: max {100 * max(shares):.2f}% of generation time (goal < 1%) "
                   + ("MET" if max(shares) < 0.01 else "MISSED"))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = result["config"]["compressions"]
    decs = result["config"]["decodings"]
    arms = [a for a in result["arms"] if a != "target"]
    fig, axes = plt.subplots(1, len(decs), figsize=(7 * len(decs), 0.3 * len(arms) * len(comps) / 2 + 2.5),
                             squeeze=False, sharey=True)
    for ax, dec in zip(axes[0], decs):
        y = np.arange(len(arms))
        h = 0.8 / len(comps)
        for i, comp in enumerate(comps):
            cell = result["summary"].get(f"{comp}/{dec}/all", {"arms": {}})
            vals = [cell["arms"].get(a, {}).get("vs_target") or 0 for a in arms]
            ax.barh(y + (i - (len(comps) - 1) / 2) * h, vals, h, label=comp)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(y, arms)
        ax.invert_yaxis()
        ax.set(title=f"{dec}: speed-up over the target alone (median paired ratio)", xlabel="x target")
        ax.grid(alpha=0.3, axis="x")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def write_section(doc: Path, section: str) -> None:
    """Replace the e2e section of ``doc`` (or append it), atomically."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default="datasets/smollm2/draft")
    ap.add_argument("--prompts", default="datasets/prompts/prompts.jsonl")
    ap.add_argument("--per-task", type=int, default=3, help="held-out prompts per task type (default 3)")
    ap.add_argument("--compressions", default="fp32,int8,nf4")
    ap.add_argument("--decodings", default="greedy,sampling")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--arms", default=None, help="comma-separated subset of arms (target always runs)")
    ap.add_argument("--policy-dir", default="exported")
    ap.add_argument("--policy-prefix", default="smollm2-")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="docs/e2e.json", help="raw runs and summary (JSON)")
    ap.add_argument("--plot", default="docs/e2e_speedup.png")
    ap.add_argument("--doc", default="docs/benchmarks.md", help="markdown file whose e2e section is rewritten")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="no runs: recompute the summary, goals, plot and doc section from a saved --out JSON")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        result["summary"] = summarize(result["runs"], result["arms"])
        result["goals"] = goals(result)
        result["plot"] = os.path.relpath(args.plot, Path(args.doc).parent)
        plot(result, Path(args.plot))
        write_section(Path(args.doc), markdown(result))
        print("\n".join(result["goals"]))
        return 1 if unexplained(result["mismatches"]) else 0

    import torch
    from tqdm.auto import tqdm

    from speckv_policy.models import load_model, load_tokenizer, model_id
    from speckv_policy.profiler import _encode, read_prompts

    torch.set_num_threads(os.cpu_count() or 1)
    prompts = [p for p in read_prompts(args.prompts) if p.split == "heldout"]
    picked = []
    for task in sorted({p.task_type for p in prompts}):
        picked += [p for p in prompts if p.task_type == task][: args.per_task]
    arms = make_arms(Path(args.policy_dir), args.policy_prefix, args.arms.split(",") if args.arms else None)
    comps = [c for c in args.compressions.split(",") if c]
    decs = [d for d in args.decodings.split(",") if d]
    tok = load_tokenizer(args.target)
    pad = getattr(tok, "eos_token_id", None)
    draft = load_model(args.draft, "fp32" if args.device == "cpu" else "fp16", args.device)
    draft.generation_config.pad_token_id = None
    on_cuda = args.device.startswith("cuda")

    def stopwatch() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    runs: list[dict[str, Any]] = []
    mismatches: list[str] = []
    t_start = time.time()
    total = len(comps) * len(decs) * len(picked) * args.repeats * len(arms)
    bar = tqdm(total=total, desc="e2e", unit="run", file=sys.stderr)
    for comp in comps:
        target = load_model(args.target, comp, args.device)
        for dec in decs:
            sampling = dec == "sampling"
            states: dict[str, dict[str, Any]] = {a.name: {} for a in arms}
            common = dict(compression=comp, sampling=sampling, temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, pad=pad, stopwatch=stopwatch)
            warm = _encode(picked[0], tok).to(args.device)
            for a in arms:  # warm-up (untimed): first-call costs, HF's adaptive state gets a first update
                run_once(a, states[a.name], target, draft, warm, seed=args.seed, **common)
            reference: dict[str, list[int]] = {}
            for rep in range(args.repeats):
                for i, p in enumerate(picked):
                    ids = _encode(p, tok).to(args.device)
                    seed = zlib.crc32(f"{args.seed}/{p.id}/{rep}".encode()) % (2**31)
                    order = arms[i % len(arms):] + arms[: i % len(arms)]
                    for a in order:
                        r = run_once(a, states[a.name], target, draft, ids, seed=seed, **common)
                        r.update(arm=a.name, prompt_id=p.id, task_type=p.task_type, compression=comp,
                                 decoding=dec, repeat=rep)
                        runs.append(r)
                        bar.update(1)
                    if not sampling:
                        ref = next(r["output"] for r in runs[-len(arms):] if r["arm"] == "target")
                        reference[p.id] = ref
                        for r in runs[-len(arms):]:
                            if r["output"] != ref:
                                n = next((k for k, (x, y) in enumerate(zip(r["output"], ref)) if x != y),
                                         min(len(r["output"]), len(ref)))
                                note = ""
                                if n < min(len(r["output"]), len(ref)):
                                    ctx = torch.cat([ids, torch.tensor([ref[:n]], dtype=ids.dtype,
                                                                       device=ids.device)], 1)
                                    gap, noise = chunking_noise(target, ctx, ref[n], r["output"][n])
                                    tie = NEAR_TIE if gap <= noise else "not a near tie"
                                    note = f" ({tie}: logit gap {gap:.4f}, chunking noise {noise:.4f})"
                                mismatches.append(f"{comp} {p.id} repeat {rep} arm {r['arm']}: first difference "
                                                  f"at output token {n}{note}")
        del target
    bar.close()
    arm_names = [a.name for a in arms]
    result: dict[str, Any] = {
        "command": "python benchmarks/e2e.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:])),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPU threads, "
                   f"torch {torch.__version__}, device {args.device}".replace("  ", " "),
        "config": {"target": model_id(args.target), "draft": model_id(args.draft), "prompts": len(picked),
                   "per_task": args.per_task, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                   "compressions": comps, "decodings": decs, "temperature": args.temperature},
        "arms": arm_names,
        "minutes": (time.time() - t_start) / 60,
        "summary": summarize(runs, arm_names),
        "mismatches": mismatches,
        "runs": [{k: v for k, v in r.items() if k != "output"} for r in runs],
        "plot": os.path.relpath(args.plot, Path(args.doc).parent),
    }
    result["goals"] = goals(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    plot(result, Path(args.plot))
    write_section(Path(args.doc), markdown(result))
    for key, cell in result["summary"].items():
        if key.endswith("/all"):
            print(key, {a: round(v["tokens_per_second"], 2) for a, v in cell["arms"].items()})
    print("\n".join(result["goals"]))
    print(f"greedy mismatches: {len(mismatches)}" + ("" if not mismatches else "\n  " + "\n  ".join(mismatches[:20])))
    print(f"wrote {out}, {args.plot}, e2e section of {args.doc}")
    return 1 if unexplained(mismatches) else 0


if __name__ == "__main__":
    raise SystemExit(main())
