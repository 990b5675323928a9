"""The end-to-end race's logic: its arms, how runs are summarised, judged against goals and reported.

The race (run by :func:`speckv_policy.hf.race.run_race`, command line
``benchmarks/e2e.py``) times every draft-length strategy inside real Hugging
Face generation. This module holds everything about it that needs neither
torch nor transformers: the arm specifications, the AdaEDL-style rule, the
summary (medians of time per token and of paired per-run ratios), the goals,
the Markdown section, the plot, and which greedy differences are explained.

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
  with ``probe_backoff=8``: after a probe that ends in gamma 0, skip probing for 1, 2, 4, 8 steps) from ``exported/``,
  priced as shipped; ``{mlp,gbt,table}-repriced``: the same exports re-priced by a calibration of the machine the race
  runs on (``speckv-calibrate``, run first, as a user would); ``{mlp,gbt,table}-live``: re-priced after every step
  from live estimates of draft and verify times (``attach(..., costs="live")``, kept across the prompts of a block).

Every greedy output is compared with the target's own greedy output for the same prompt;
any difference is reported (and makes the exit status 1). Results: medians of time per output
token over the runs, ratios as medians of per-run ratios against runs of the same prompt and
repeat (so drift cancels). Writes JSON, a plot, and the e2e section of docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write_text
from ..runtime import RuntimePolicy
from ..schema import ONLINE
from .report import save_figure

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
    costs: Any = None  # attach(..., costs=): a calibration file or CostModel (re-priced), "live", or None


def make_arms(policy_dir: Path, prefix: str, names: list[str] | None, costs: Any = None) -> list[ArmSpec]:
    """Every arm of the race; ``costs`` (a calibration of this machine) adds the ``*-repriced`` arms.

    Raises
    ------
    SystemExit
        For an unknown arm name or a missing policy file.
    """
    off = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    arms = [ArmSpec("target", assistant=False)]
    arms += [ArmSpec(f"fixed-{g}", hf={**off, "num_assistant_tokens": g}, group="fixed") for g in (2, 4, 6, 8)]
    arms.append(
        ArmSpec(
            "hf-default",
            hf={
                "num_assistant_tokens": 20,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4,
            },
        )
    )
    arms.append(
        ArmSpec(
            "hf-heuristic",
            hf={
                "num_assistant_tokens": 20,
                "num_assistant_tokens_schedule": "heuristic",
                "assistant_confidence_threshold": 0.0,
            },
        )
    )
    arms.append(ArmSpec("adaedl", policy=adaedl_policy, mode="per-token"))
    arms.append(ArmSpec("mlp16", policy=policy_dir / f"{prefix}paper-mlp16.onnx", mode="truncate"))
    for kind in OURS:
        for mode, tag in (("upfront", "upfront"), ("per-token", "pertoken")):
            arms.append(ArmSpec(f"{kind}-{tag}", policy=policy_dir / f"{prefix}{kind}.onnx", mode=mode, group="ours"))
        arms.append(
            ArmSpec(
                f"{kind}-backoff",
                policy=policy_dir / f"{prefix}{kind}.onnx",
                mode="upfront",
                group="ours",
                backoff=BACKOFF,
            )
        )
        if costs is not None:  # the shipped export, re-priced by a calibration of this machine
            arms.append(
                ArmSpec(
                    f"{kind}-repriced",
                    policy=policy_dir / f"{prefix}{kind}.onnx",
                    mode="upfront",
                    group="ours",
                    costs=costs,
                )
            )
        arms.append(
            ArmSpec(
                f"{kind}-live", policy=policy_dir / f"{prefix}{kind}.onnx", mode="upfront", group="ours", costs="live"
            )
        )
    if names:
        unknown = sorted(set(names) - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"e2e: unknown arm(s) {', '.join(unknown)}; known: {', '.join(a.name for a in arms)}")
        arms = [a for a in arms if a.name in names or a.name == "target"]
    loaded: dict[Path, RuntimePolicy] = {}
    for a in arms:
        if isinstance(a.policy, Path):
            if not a.policy.exists():
                raise SystemExit(f"e2e: policy file for arm {a.name} not found: {a.policy} (run speckv-quickstart)")
            a.policy = loaded.setdefault(a.policy, RuntimePolicy(a.policy))  # load once, not per run
    return arms


#: Generation-config fields of the draft that HF's own strategies keep between calls.
HF_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
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


def _median_paired_ratio(
    by: dict[tuple, dict[str, Any]], pairs: list[tuple], med: dict[str, float], arm: str, ref: str | None
) -> float | None:
    """Median over (prompt, repeat) pairs of ``time per token of ref / time per token of arm``."""
    if ref is None or arm not in med or ref not in med:
        return None
    v = [
        by[p + (ref,)]["seconds"]
        / max(by[p + (ref,)]["tokens"], 1)
        / (by[p + (arm,)]["seconds"] / max(by[p + (arm,)]["tokens"], 1))
        for p in pairs
        if p + (arm,) in by and p + (ref,) in by
    ]
    return float(np.median(v))


def summarize_runs(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Medians of ms per output token and of paired ratios, per (compression, decoding[, task])."""
    cells: dict[tuple, dict[str, Any]] = {}
    keys = sorted({(r["compression"], r["decoding"]) for r in runs})
    tasks = sorted({r["task_type"] for r in runs})
    for comp, dec in keys:
        for task in [None, *tasks]:
            sel = [
                r
                for r in runs
                if r["compression"] == comp and r["decoding"] == dec and (task is None or r["task_type"] == task)
            ]
            if not sel:
                continue
            by = {(r["prompt_id"], r["repeat"], r["arm"]): r for r in sel}
            pairs = sorted({(r["prompt_id"], r["repeat"]) for r in sel})
            ms = {
                a: [1e3 * by[p + (a,)]["seconds"] / max(by[p + (a,)]["tokens"], 1) for p in pairs if p + (a,) in by]
                for a in arms
            }
            med = {a: float(np.median(v)) for a, v in ms.items() if v}
            fixed = [a for a in med if a.startswith("fixed-")]
            best_fixed = min(fixed, key=lambda a: med[a]) if fixed else None

            cell = {"runs_per_arm": len(pairs), "best_fixed": best_fixed, "arms": {}}
            for a in med:
                dec_s = sum(by[p + (a,)]["decision_s"] for p in pairs if p + (a,) in by)
                tot_s = sum(by[p + (a,)]["seconds"] for p in pairs if p + (a,) in by)
                cell["arms"][a] = {
                    "ms_per_token": med[a],
                    "tokens_per_second": 1e3 / med[a],
                    **{
                        key: _median_paired_ratio(by, pairs, med, a, ref)
                        for key, ref in (
                            ("vs_target", "target"),
                            ("vs_fixed4", "fixed-4"),
                            ("vs_best_fixed", best_fixed),
                            ("vs_hf_default", "hf-default"),
                        )
                    },
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
    lines = [
        BEGIN,
        "",
        "## End-to-end wall clock (`benchmarks/e2e.py`)",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"Machine: {result['machine']}. Target {cfg['target']}, draft {cfg['draft']}; {cfg['prompts']} held-out "
        f"prompts ({cfg['per_task']} per task type), {cfg['max_new_tokens']} new tokens, {cfg['repeats']} "
        f"repeat(s), arms interleaved per prompt; {result['minutes']:.1f} min in all. Figures are medians over "
        "runs of time per output token; ratios are medians of per-run ratios against the same prompt's run of "
        "the reference (x target = speed-up over the target alone).",
        "",
    ]
    cal = result.get("calibration")
    if cal and cal.get("describe"):
        lines += [
            f"Cost model of this machine, measured first (`speckv-calibrate`, {cal['seconds']:.0f} s, "
            f"{cal['steps']} steps; `*-repriced` arms decide with it, ms per compression code):",
            "",
        ]
        lines += [f"- {d}" for d in cal["describe"]] + [""]
    elif cal and cal.get("file"):
        lines += [f"`*-repriced` arms decide with the calibration in `{cal['file']}`.", ""]
    for key, cell in result["summary"].items():
        comp, dec, task = key.split("/")
        if task != "all":
            continue
        bf = cell["best_fixed"]
        lines += [
            f"### {comp}, {dec} (best fixed gamma: {bf.split('-')[1] if bf else '-'})",
            "",
            "| arm | tokens/s | ms/token | x target | x fixed 4 | x best fixed | x HF default | decision share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for a in arms:
            v = cell["arms"].get(a)
            if v is None:
                continue
            name = f"**{a}**" if a in ours else a
            share = f"{100 * v['decision_share']:.2f}%" if a in ours or a in ("mlp16", "adaedl") else ""
            lines.append(
                f"| {name} | {v['tokens_per_second']:.2f} | {v['ms_per_token']:.1f} | {_fmt(v['vs_target'])} | "
                f"{_fmt(v['vs_fixed4'])} | {_fmt(v['vs_best_fixed'])} | {_fmt(v['vs_hf_default'])} | {share} |"
            )
        lines.append("")
    tasks = sorted({k.split("/")[2] for k in result["summary"]} - {"all"})
    if tasks:
        lines += [
            "### x target alone by task type (greedy)",
            "",
            "| arm | " + " | ".join(f"{c}/{t}" for c in cfg["compressions"] for t in tasks) + " |",
            "|---|" + "---:|" * (len(cfg["compressions"]) * len(tasks)),
        ]
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
        lines.append(
            f"{len(result['mismatches'])} greedy run(s) differ from the target's own greedy output; "
            f"{len(bad)} of them unexplained, i.e. neither on a prompt where HF's own assisted arms "
            "(fixed-*, hf-*) differ too nor a near tie (the target's own logit gap there no larger than "
            "the change a multi-token pass makes to its logits): a target whose multi-token verification "
            "is not bit-identical to single steps, see docs/hf_hook.md:"
        )
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
        for label, key, goal in (
            ("best fixed gamma", "vs_best_fixed", 1.10),
            ("HF default", "vs_hf_default", 1.15),
            ("target alone", "vs_target", 1.00),
        ):
            if v.get(key) is not None:
                out.append(
                    f"{comp} greedy, best of ours ({best}) vs {label}: {v[key]:.2f}x (goal >= {goal:.2f}x) "
                    + ("MET" if v[key] >= goal else "MISSED")
                )
        for key, cell_t in s.items():
            c, d, t = key.split("/")
            if c == comp and d == "greedy" and t != "all":
                r = cell_t["arms"].get(best, {}).get("vs_target")
                worst = min(ours, key=lambda a: cell_t["arms"].get(a, {}).get("vs_target") or 0)
                goal = 1.15 if t == "code" else 1.00
                if r is not None:
                    out.append(
                        f"{comp} greedy {t}: {best} vs target alone {r:.2f}x (goal >= {goal:.2f}x) "
                        + ("MET" if r >= goal else "MISSED")
                        + f"; slowest of ours here: {worst} {cell_t['arms'][worst]['vs_target']:.2f}x"
                    )
        shares = [cell["arms"][a]["decision_share"] for a in ours]
        out.append(
            f"{comp} greedy decision overhead: max {100 * max(shares):.2f}% of generation time (goal < 1%) "
            + ("MET" if max(shares) < 0.01 else "MISSED")
        )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = result["config"]["compressions"]
    decs = result["config"]["decodings"]
    arms = [a for a in result["arms"] if a != "target"]
    fig, axes = plt.subplots(
        1, len(decs), figsize=(7 * len(decs), 0.3 * len(arms) * len(comps) / 2 + 2.5), squeeze=False, sharey=True
    )
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
    save_figure(fig, path, dpi=100)


def write_section(doc: Path, section: str) -> None:
    """Replace the e2e section of ``doc`` (or append it), atomically."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(doc, text)
