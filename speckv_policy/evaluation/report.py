"""Markdown tables and PNG plots for :func:`speckv_policy.evaluation.evaluate` results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write
from ..schema import COMPRESSION_CODES
from .offline import EvalSet


def _p(p: float) -> str:
    return f"{p:.4f}" if p >= 1e-4 else "<1e-4"


def _policies(result: dict[str, Any]) -> list[str]:
    return list(result["gamma_histogram"])


def _history_note(history: str) -> str:
    if history == "policy":
        return (
            "History features (previous step's acceptance and gamma, acceptance EMAs) are each policy's own: the "
            "held-out runs are replayed step by step with the policy's choices (`speckv_policy.replay`)."
        )
    return "History features are the profile's own steps' (`--history logged`), not what the policy would write."


def _pairs_section(result: dict[str, Any]) -> list[str]:
    """``speckv-eval --decide-costs``: each export deciding with other prices against itself, paired."""
    pairs = result.get("pairs") or {}
    if not pairs:
        return []
    lines = [
        "## Deciding with other prices",
        "",
        f"Each export re-priced with `{result.get('decide_costs', '?')}` (NAME@STEM) against the same export deciding "
        "with the prices every strategy here is judged by: the paired ratio of their tokens/s (95% CI over prompts) "
        "and the share of held-out steps on which both chose the same gamma."
        + "".join(
            f" `{path}` timed no step at {', '.join(levels)}: its prices there are another level's, so read those "
            "rows as a what-if."
            for path, levels in result.get("unmeasured_levels", {}).items()
        ),
        "",
        "| export | against | steps | x | 95% CI | p | same gamma |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for name, pair in pairs.items():
        for group, same in pair["same_choice"].items():
            v = result["bootstrap"].get(group, {}).get(name, {}).get("vs_pair")
            cells = [f"{v['ratio']:.3f}", f"{v['ci'][0]:.3f}-{v['ci'][1]:.3f}", _p(v["p_value"])] if v else ["", "", ""]
            lines.append(f"| {name} | {pair['reference']} | {group} | " + " | ".join(cells) + f" | {same:.1%} |")
    return [*lines, ""]


def markdown(
    result: dict[str, Any], *, title: str = "Offline evaluation", command: str | None = None, log: str | None = None
) -> str:
    """Render an evaluation result as Markdown (overall table with CIs, then per group)."""
    only = "; ".join(f"{k} {v}" for k, v in result.get("selected", {}).items())
    unit = result["unit"]
    ov = result["groups"]["overall"]
    boot = result["bootstrap"].get("overall", {})
    best = ov["best_fixed"]
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        f"{'Log `' + log + '`' + (f' (only {only})' if only else '') + ': ' if log else ''}{result['rows']} held-out steps from {result['prompts']} held-out "
        f"prompts (every outcome known up to gamma {result['max_gamma']}). Throughput in {unit} under "
        f"{result.get('costs_note', 'the fitted cost model')}; CIs: paired bootstrap over prompts, "
        f"{result['n_resamples']} resamples, 95%; p: two-sided, ratio = 1. "
        + _history_note(result.get("history", "logged")),
        "",
        f"## Overall (best fixed gamma in hindsight: {best.split('-')[1]})",
        "",
        "| strategy | tokens/step | tokens/s | 95% CI | x oracle | x target alone | 95% CI | p | x best fixed | 95% CI "
        "| p | x fixed 4 | 95% CI | p | mean gamma |",
        "|---|---:|---:|---|---:|---:|---|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    order = _policies(result) + ["oracle", "fixed-0", best, "fixed-4"]
    seen = set()
    for name in order:
        if name in seen:
            continue
        seen.add(name)
        a = ov["arms"][name]
        b = boot.get(name, {})
        ci = b.get("tokens_per_second_ci")
        row = [
            f"**{name}**" if name in result["gamma_histogram"] else name,
            f"{a['tokens_per_step']:.3f}",
            f"{a['tokens_per_second']:.2f}",
            f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "",
        ]
        row.append(f"{a['vs_oracle']:.3f}")
        for key in ("vs_target", "vs_best_fixed", "vs_fixed4"):
            row.append(f"{a[key]:.3f}")
            if key in b:
                row += [f"{b[key]['ci'][0]:.3f}-{b[key]['ci'][1]:.3f}", _p(b[key]["p_value"])]
            else:
                row += ["", ""]
        row.append(f"{a['mean_gamma']:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += _pairs_section(result)
    groups = [g for g in result["groups"] if g != "overall"]
    simple = [g for g in groups if "/" not in g]
    for heading, keys in (
        ("By compression level and task type", simple),
        ("By compression level x task type", [g for g in groups if "/" in g]),
    ):
        if not keys:
            continue
        lines += [
            f"## {heading}",
            "",
            "tokens/s, then x best fixed gamma (its value) / x fixed 4 / x oracle"
            + (" ; [95% CI of x best fixed]" if heading.startswith("By compression level and") else ""),
            "",
            "| group | rows | best fixed | " + " | ".join(_policies(result)) + " |",
            "|---|---:|---:|" + "---|" * len(_policies(result)),
        ]
        for g in keys:
            s = result["groups"][g]
            cells = []
            for name in _policies(result):
                a = s["arms"][name]
                cell = (
                    f"{a['tokens_per_second']:.2f} ({a['vs_best_fixed']:.3f} / {a['vs_fixed4']:.3f} / "
                    f"{a['vs_oracle']:.3f})"
                )
                b = result["bootstrap"].get(g, {}).get(name)
                if b:
                    cell += f" [{b['vs_best_fixed']['ci'][0]:.3f}-{b['vs_best_fixed']['ci'][1]:.3f}]"
                cells.append(cell)
            bf = s["arms"][s["best_fixed"]]["tokens_per_second"]
            lines.append(
                f"| {g} | {s['rows']} | {bf:.2f} (gamma {s['best_fixed'].split('-')[1]}) | " + " | ".join(cells) + " |"
            )
        lines.append("")
    lines += [
        "## Chosen gamma per compression level (held-out steps)",
        "",
        "| policy | compression | " + " | ".join(f"g={g}" for g in range(result["max_gamma"] + 1)) + " |",
        "|---|---|" + "---:|" * (result["max_gamma"] + 1),
    ]
    for name, per in result["gamma_histogram"].items():
        for comp, counts in per.items():
            lines.append(f"| {name} | {comp} | " + " | ".join(str(c) for c in counts[: result["max_gamma"] + 1]) + " |")
    lines.append("")
    if result.get("gates"):
        lines += [
            "## Gated policies: the gate (held-out steps)",
            "",
            "Share of steps whose gate opened, and of steps whose gate opened, paid the probe and then chose 0:",
            "",
            "| policy | " + " | ".join(next(iter(result["gates"].values()))) + " |",
            "|---|" + "---:|" * len(next(iter(result["gates"].values()))),
        ]
        for name, per in result["gates"].items():
            cells = [f"{v['open']:.1%} open, {v['open_then_zero']:.1%} open then 0" for v in per.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Write a matplotlib figure as PNG atomically (a failed write never replaces a good plot), then close it."""
    import matplotlib.pyplot as plt

    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)


def plots(result: dict[str, Any], eval_set: EvalSet, out_dir: str | Path) -> list[Path]:
    """Write acceptance_vs_confidence.png, gamma_histogram.png and tokens_per_second.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = eval_set.rows
    comps = [c for c in COMPRESSION_CODES if c in set(rows["compression"])]
    written = []

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    edges = np.linspace(0, 1, 11)
    for c in comps:
        r = rows[rows["compression"] == c]
        b = np.clip(np.digitize(r["conf_first"].to_numpy(), edges) - 1, 0, 9)
        mids, p1, mean_acc = [], [], []
        for k in range(10):
            m = b == k
            if m.sum() >= 10:
                mids.append((edges[k] + edges[k + 1]) / 2)
                p1.append(float(np.mean(r["accepted"].to_numpy()[m] >= 1)))
                mean_acc.append(float(np.mean(r["accepted"].to_numpy()[m])))
        ax[0].plot(mids, p1, marker="o", label=c)
        ax[1].plot(mids, mean_acc, marker="o", label=c)
    ax[0].set(xlabel="draft confidence of the first token", ylabel="P(first draft token accepted)", ylim=(0, 1))
    ax[1].set(xlabel="draft confidence of the first token", ylabel=f"mean accepted length (of {eval_set.max_gamma})")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(title="target")
    fig.suptitle("Acceptance against draft confidence (held-out steps; bins with >= 10 steps)")
    fig.tight_layout()
    written.append(out / "acceptance_vs_confidence.png")
    save_figure(fig, written[-1])

    names = _policies(result)
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 3.6), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, c in zip(axes[0], comps):
        for i, n in enumerate(names):
            counts = np.asarray(result["gamma_histogram"][n].get(c, []), dtype=float)
            if counts.sum() == 0:
                continue
            x = np.arange(len(counts))
            ax.bar(x + (i - (len(names) - 1) / 2) * width, counts / counts.sum(), width, label=n)
        ax.set(title=c, xlabel="chosen gamma")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("share of held-out steps")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "gamma_histogram.png")
    save_figure(fig, written[-1])

    ov = result["groups"]["overall"]
    boot = result["bootstrap"].get("overall", {})
    fixed = [f"fixed-{g}" for g in range(result["max_gamma"] + 1)]
    order = names + fixed + ["oracle"]
    vals = [ov["arms"][n]["tokens_per_second"] for n in order]
    lo = [vals[i] - boot[n]["tokens_per_second_ci"][0] if n in boot else 0 for i, n in enumerate(order)]
    hi = [boot[n]["tokens_per_second_ci"][1] - vals[i] if n in boot else 0 for i, n in enumerate(order)]
    colors = ["tab:blue"] * len(names) + ["tab:gray"] * len(fixed) + ["tab:green"]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(order) + 1.2))
    y = np.arange(len(order))[::-1]
    ax.barh(y, vals, xerr=[lo, hi], color=colors, capsize=3)
    ax.set_yticks(y, order)
    ax.set_xlabel(f"{result['unit']} (held-out, 95% bootstrap CI over prompts)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    written.append(out / "tokens_per_second.png")
    save_figure(fig, written[-1])
    return written
