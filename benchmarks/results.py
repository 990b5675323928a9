"""Render the results page from the races of record: ``docs/results.md``, ``docs/results.json`` and README's table.

    python benchmarks/results.py            # rewrite docs/results.{md,json} and the table in README.md
    python benchmarks/results.py --check    # exit 1 if any of them differs from what the runs say

The vLLM race of record, ``benchmarks/runs/vllm_race.json`` (``benchmarks/vllm_race.py --record``), gives the
"Serving with vLLM" section and its plot, ``docs/vllm_race.png``; the race with the EAGLE-3 head,
``benchmarks/runs/eagle3_race.json`` (a ``benchmarks/e2e.py --draft datasets/smollm2/eagle3`` JSON), the
"With the EAGLE-3 head" section.

The races of record are listed in ``benchmarks/runs/record.json`` (each one a ``benchmarks/e2e.py --out`` JSON
with every run it timed). Every figure is recomputed from those runs (medians of paired per-prompt ratios, paired
bootstrap 95% CIs over prompts, as the race reports them). The recommended policy is chosen here, by measurement:
of our arms raced in every block (compression x decoding), the one with the highest geometric mean speed-up over
the target alone across the blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from speckv_policy.atomic import atomic_write_text
from speckv_policy.evaluation.race import BESIDE_SEP, PEER_RULES, summarize_runs

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "runs"
#: What each of our race arms runs (the ``-repriced`` arms re-price the file with the day's calibration).
ARM_FILES = {
    "gbt-gated": "exported/smollm2-gbt-gated.onnx",
    "table-gated": "exported/smollm2-table-gated.onnx",
    "table-pre": "exported/smollm2-table-pre.onnx",
    "gbt-pre": "exported/smollm2-gbt-pre.onnx",
    "stop": "exported/smollm2-stop.json",
}
BLOCK_ORDER = [(c, d) for d in ("greedy", "sampling") for c in ("fp32", "int8", "nf4")]
README_START = "<!-- results:start (python benchmarks/results.py writes this table) -->"
README_END = "<!-- results:end -->"


def short_machine(line: str, note: str | None = None) -> str:
    """``Intel(R) Xeon(R) Processor, 2 threads`` from a race's machine line, or the record's note where the race
    predates recording the CPU."""
    m = re.match(r"(\S+) (.*?)\s*(\d+) CPU threads", line)
    if not m:
        return line.split(",")[0]
    cpu = m.group(2).strip() or (note.split(" (")[0] + "*" if note else "CPU not recorded")
    return f"{cpu}, {m.group(3)} threads"


def _ours(arm: str) -> bool:
    """Our arm on the race's own draft (not the target, a fixed gamma, a peer rule or an arm on a beside draft)."""
    return arm != "target" and not arm.startswith("fixed-") and arm not in PEER_RULES and BESIDE_SEP not in arm


def _file_of(arm: str) -> str:
    base = arm.removesuffix("-repriced").removesuffix("-live")
    return ARM_FILES.get(base, "?")


def _ci(v: dict[str, Any], key: str) -> dict[str, Any]:
    ci = v.get(key + "_ci")
    return {"ratio": round(v[key], 4), "ci": [round(ci[0], 4), round(ci[1], 4)] if ci else None}


def collect(record: dict[str, Any]) -> dict[str, Any]:
    """Every block's figures from the races of record (the latest race that ran a block is its run of record)."""
    blocks: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in record["runs"]:  # oldest first: a later race replaces an earlier one's blocks
        path = RUNS / entry["file"]
        if not path.is_file():
            raise SystemExit(f"{RUNS / 'record.json'} names {entry['file']}, which is not a file in {RUNS}")
        race = json.loads(path.read_text())
        summary = summarize_runs(race["runs"], race["arms"])
        for key, cell in summary.items():
            comp, dec, task = key.split("/")
            if task != "all":
                continue
            blocks[(comp, dec)] = {
                "compression": comp,
                "decoding": dec,
                "run": entry["file"],
                "date": entry["date"],
                "commit": entry["commit"],
                "machine": race["machine"],
                "cpu_note": entry.get("cpu"),
                "command": race["command"],
                "prompts": cell["runs_per_arm"],
                "best_fixed": cell["best_fixed"],
                "best_peer": cell["best_peer"],
                "arms": {
                    a: {k: v[k] for k in ("ms_per_token", "vs_target", "vs_target_ci")} for a, v in cell["arms"].items()
                },
                "cell": cell,
                "tasks": {
                    k.split("/")[2]: {a: v["vs_target"] for a, v in c["arms"].items()}
                    for k, c in summary.items()
                    if k.startswith(f"{comp}/{dec}/") and not k.endswith("/all")
                },
            }
    ordered = [blocks[b] for b in BLOCK_ORDER if b in blocks]
    ours = sorted(set.intersection(*[{a for a in b["arms"] if _ours(a)} for b in ordered]))
    score = {a: math.exp(sum(math.log(b["arms"][a]["vs_target"]) for b in ordered) / len(ordered)) for a in ours}
    best = max(ours, key=lambda a: score[a])
    for b in ordered:
        cell = b.pop("cell")
        v = cell["arms"][best]
        b["recommended"] = {
            "vs_target": _ci(v, "vs_target"),
            "vs_best_fixed": _ci(v, "vs_best_fixed"),
            "vs_best_peer": _ci(v, "vs_best_peer"),
        }
    return {
        "recommended": {"arm": best, "file": _file_of(best), "geomean_vs_target": round(score[best], 4)},
        "candidates": {a: round(s, 4) for a, s in sorted(score.items(), key=lambda kv: -kv[1])},
        "retired_reports_commit": record["retired_reports_commit"],
        "blocks": ordered,
        "vllm": _vllm_record(),
        "eagle3": _eagle3_record(record.get("eagle3_race", {})),
    }


def _eagle3_record(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The race with the EAGLE-3 head, block by block: the best of our arms against the same head's references."""
    path = RUNS / entry.get("file", "eagle3_race.json")
    if not path.is_file():
        return None
    race = json.loads(path.read_text())
    summary = summarize_runs(race["runs"], race["arms"])
    blocks = []
    for comp, dec in BLOCK_ORDER:
        cell = summary.get(f"{comp}/{dec}/all")
        if not cell:
            continue
        ours = [a for a in cell["arms"] if _ours(a)]
        best = max(ours, key=lambda a: cell["arms"][a]["tokens_per_second"])
        v = cell["arms"][best]
        blocks.append(
            {
                "compression": comp,
                "decoding": dec,
                "prompts": cell["runs_per_arm"],
                "best": best,
                "best_fixed": cell["best_fixed"],
                "best_peer": cell["best_peer"],
                "vs_target": _ci(v, "vs_target"),
                "vs_best_fixed": _ci(v, "vs_best_fixed"),
                "vs_best_peer": _ci(v, "vs_best_peer"),
                "best_beside": cell.get("best_beside"),
                "vs_beside": _ci(v, "vs_beside") if cell.get("best_beside") else None,
                "arms": {
                    a: {k: w[k] for k in ("ms_per_token", "vs_target", "vs_target_ci")} for a, w in cell["arms"].items()
                },
            }
        )
    return {
        "command": race["command"],
        "machine": race["machine"],
        "date": entry.get("date"),
        "cpu": entry.get("cpu"),
        "blocks": blocks,
    }


def eagle3_section(rec: dict[str, Any]) -> list[str]:
    """The "With the EAGLE-3 head" section: every arm drafting with the head, in one race."""
    out = [
        "## With the EAGLE-3 head",
        "",
        "Race `benchmarks/runs/eagle3_race.json`: our arms, the fixed gammas and the peer rules draft with the EAGLE-3 head"
        " `datasets/smollm2/eagle3`",
        "(one layer reading the target's hidden states, [draft.md](reference/draft.md#the-eagle-3-head)); the policies",
        "are `exported/smollm2-eagle3-*`, trained on the head's own profile (`datasets/smollm2/steps-eagle3.parquet`).",
        "Transformers cannot run the head, so Hugging Face's heuristic schedule runs as a rule through the hook",
        f"(`hf-heuristic`). Run on {rec['date']}; machine: {rec['machine']} ({rec['cpu']}).",
        "",
        f"    {rec['command']}",
        "",
    ]
    beside = any(b.get("best_beside") for b in rec["blocks"])
    if beside:
        out += [
            "Beside them, in the same run, the distilled draft's arms (`draft:...`: `datasets/smollm2/draft` with its",
            "own exports, re-priced by its own calibration): the last column compares the head's best arm with the",
            "fastest of them.",
            "",
        ]
    head = (
        "| target | decoding | best of ours | vs the target alone | vs the best fixed gamma | vs the best peer rule |"
    )
    out += [
        head + (" vs the distilled draft |" if beside else ""),
        "|---|---|---|---|---|---|" + ("---|" if beside else ""),
    ]
    for b in rec["blocks"]:
        row = (
            f"| {b['compression']} | {b['decoding']} | `{b['best']}` | {_fmt(b['vs_target'])} | "
            f"{_fmt(b['vs_best_fixed'])} ({b['best_fixed']}) | {_fmt(b['vs_best_peer'])} ({b['best_peer']}) |"
        )
        if beside:
            row += f" {_fmt(b['vs_beside'])} (`{b['best_beside']}`) |" if b.get("best_beside") else " - |"
        out.append(row)
    out.append("")
    for b in rec["blocks"]:
        out += [
            f"**{b['compression']} {b['decoding']}** ({b['prompts']} prompts):",
            "",
            "| arm | ms per token | vs the target alone |",
            "|---|---|---|",
        ]
        for a, v in sorted(b["arms"].items(), key=lambda kv: kv[1]["ms_per_token"]):
            tag = " (ours)" if _ours(a) else " (the distilled draft)" if BESIDE_SEP in a else ""
            out.append(f"| `{a}`{tag} | {v['ms_per_token']:.1f} | {_fmt(_ci(v, 'vs_target'))} |")
        out.append("")
    return out


def _vllm_record() -> dict[str, Any] | None:
    """The vLLM race of record, summarised again from its per-request rows (None when there is none)."""
    path = RUNS / "vllm_race.json"
    if not path.is_file():
        return None
    race = json.loads(path.read_text())
    conc = sorted({r["concurrency"] for r in race["rows"]})
    summary = _vllm_race_module().summarize(race["rows"], race["arms"], conc)  # recomputed from every request
    kept: dict[str, dict[str, float]] = {}
    for n in race.get("spec_counts", []):  # vLLM's counters per server of the race (the tuning sweep left out)
        if not n.get("tuning") and n.get("num_drafts"):
            k = kept.setdefault(n["arm"], {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0})
            for key, counter in (("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                                 ("accepted", "num_accepted_tokens")):  # fmt: skip
                k[key] += n[counter]
    acceptance = {a: kept[a] for a in race["arms"] if a in kept}
    return {"meta": race["meta"], "arms": race["arms"], "summary": summary, "acceptance": acceptance}


def _vllm_race_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_race", ROOT / "benchmarks" / "vllm_race.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def vllm_section(race: dict[str, Any]) -> list[str]:
    """The "Serving with vLLM" section from the vLLM race of record."""
    mod = _vllm_race_module()
    meta = race["meta"]
    table = mod.markdown(race["summary"], race["arms"], meta)
    catch_up = meta["costs"].get("catch_up_ms_per_token") or [None] * len(meta["costs"]["batch_sizes"])
    costs = "; ".join(
        f"batch {b}: {c['verify_base_ms'][0]:.1f} ms + {c['draft_ms_per_token'][0] + c['verify_ms_per_token'][0]:.1f}"
        " ms per draft token" + ("" if u is None else f" + {u:.2f} ms per caught-up token")
        for b, c, u in zip(meta["costs"]["batch_sizes"], meta["costs"]["costs"], catch_up)
    )
    return [
        "## Serving with vLLM",
        "",
        "Race `benchmarks/runs/vllm_race.json`: every arm through vLLM's OpenAI-compatible server, a client keeping",
        "*c* requests in flight. `gbt-gated-batch` is the shipped gated policy priced with one request's costs at the",
        "batch size each step runs in, measured inside vLLM first (`speckv-calibrate --engine vllm`: per request "
        f"{costs}"
        + (
            "; a caught-up token is one the draft reads before it drafts, what it missed while shut"
            if any(catch_up)
            else ""
        )
        + f"); `vllm-dynamic-sd` is vLLM's table tuned on training prompts as its docs say ({meta['table']})"
        + (
            f", `head-dynamic-sd` the head's, tuned the same way ({meta['head_table']})."
            if meta.get("head_table")
            else "."
        ),
        "",
        table,
        *acceptance_lines(race.get("acceptance", {})),
        "![output tokens/s against concurrency, one line per arm](vllm_race.png)",
        "",
    ]


def acceptance_lines(acceptance: dict[str, dict[str, float]]) -> list[str]:
    """What vLLM's speculative decoding counters say each arm's drafts kept, over all its servers in the race."""
    if not acceptance:
        return []
    lines = [
        "What the drafts kept, by vLLM's counters (`vllm:spec_decode_num_*`, summed over the race's servers: every "
        "concurrency and repetition):",
        "",
        "| arm | drafts | draft tokens | kept | kept per draft token | kept per draft |",
        "|---|---|---|---|---|---|",
    ]
    for arm, k in acceptance.items():
        lines.append(
            f"| {arm} | {k['drafts']:.0f} | {k['draft_tokens']:.0f} | {k['accepted']:.0f} | "
            f"{k['accepted'] / k['draft_tokens']:.2f} | {k['accepted'] / k['drafts']:.2f} |"
        )
    return [*lines, ""]


def _fmt(r: dict[str, Any]) -> str:
    ci = r["ci"]
    return f"{r['ratio']:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def readme_table(res: dict[str, Any]) -> str:
    """The README's table: the recommended policy against the three references, block by block."""
    rec = res["recommended"]
    lines = [
        f"Recommended policy `{rec['file']}` (race arm `{rec['arm']}`, re-priced with the day's calibration), wall clock, "
        "SmolLM2-135M-Instruct with its distilled draft, 48 held-out prompts per block, medians of per-prompt ratios of "
        "time per token [paired bootstrap 95% CI]; the races ran fixed gamma 2 as the fixed reference "
        "(* CPU named in the race's commit note):",
        "",
        "| target | decoding | vs the target alone | vs the best fixed gamma | vs the best peer rule | machine | race (date) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in res["blocks"]:
        r = b["recommended"]
        lines.append(
            f"| {b['compression']} | {b['decoding']} | {_fmt(r['vs_target'])} | {_fmt(r['vs_best_fixed'])} "
            f"({b['best_fixed']}) | {_fmt(r['vs_best_peer'])} ({b['best_peer']}) | {short_machine(b['machine'], b['cpu_note'])} | "
            f"[{b['run']}](docs/results.md#{b['compression']}-{b['decoding']}) ({b['date']}) |"
        )
    return "\n".join(lines)


def results_md(res: dict[str, Any]) -> str:
    """The whole results page."""
    rec = res["recommended"]
    out = [
        "# Results",
        "",
        "Generated by `python benchmarks/results.py` from the races of record in `benchmarks/runs/` (listed in",
        "`benchmarks/runs/record.json`); do not edit by hand. Each race ran every arm on the same 48 held-out prompts",
        "(12 per task type), 48 new tokens each, arms interleaved per prompt, the machine's costs calibrated first",
        "(`speckv-calibrate`), on the machine its row names: compare within a block, not across machines. Ratios are",
        "medians of per-prompt ratios of time per output token, with paired bootstrap 95% CIs over prompts.",
        "Greedy outputs equal the target's own at fp32; at INT8 / NF4 the races record every difference, each a",
        "measured near tie of bitsandbytes' multi-token passes.",
        "",
        "## Which policy is recommended, and why",
        "",
        f"Of our arms raced in every block, the one with the highest geometric mean speed-up over the target alone "
        f"across the blocks: **`{rec['arm']}`** ({rec['geomean_vs_target']:.3f}x), i.e. `attach(target, "
        f'"{rec["file"]}", costs="costs.json")` with a calibration of your machine. All candidates:',
        "",
        "| arm | file | geometric mean vs the target alone |",
        "|---|---|---|",
        *[f"| `{a}` | `{_file_of(a)}` | {s:.3f}x |" for a, s in res["candidates"].items()],
        "",
        "## Summary",
        "",
        readme_table(res).replace("(docs/results.md#", "(#"),
        "",
    ]
    for b in res["blocks"]:
        ours = [a for a in b["arms"] if _ours(a)]
        out += [
            f"## {b['compression']} {b['decoding']}",
            "",
            f"Race `benchmarks/runs/{b['run']}` ({b['date']}, commit {b['commit']}), {b['prompts']} prompts; "
            f"machine: {b['machine']}" + (f" ({b['cpu_note']})" if b["cpu_note"] else "") + ".",
            "",
            f"    {b['command']}",
            "",
            "| arm | ms per token | vs the target alone | " + " | ".join(sorted(b["tasks"])) + " |",
            "|---|---|---|" + "---|" * len(b["tasks"]),
        ]
        for a, v in sorted(b["arms"].items(), key=lambda kv: kv[1]["ms_per_token"]):
            tag = " (ours)" if a in ours else ""
            tasks = " | ".join(f"{b['tasks'][t].get(a, float('nan')):.2f}x" for t in sorted(b["tasks"]))
            out.append(f"| `{a}`{tag} | {v['ms_per_token']:.1f} | {_fmt(_ci(v, 'vs_target'))} | {tasks} |")
        out.append("")
    if res.get("eagle3") is not None:
        out += eagle3_section(res["eagle3"])
    if res.get("vllm") is not None:
        out += vllm_section(res["vllm"])
    out += [
        "## Earlier races",
        "",
        "The one-off race reports these races supersede (28 of them, with their JSON, plots and cost files) left the",
        f"tree; read them at commit {res['retired_reports_commit']} (`git show "
        f"{res['retired_reports_commit']}:docs/onednn_nf4_step.md`). What they taught is in",
        "[design.md](design.md).",
        "",
    ]
    return "\n".join(out)


def render(readme: str, res: dict[str, Any]) -> tuple[str, str, str]:
    """``(results.md, results.json, README.md)`` as they should be."""
    if README_START not in readme or README_END not in readme:
        raise SystemExit(f"README.md lacks the markers {README_START!r} ... {README_END!r}")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    new_readme = f"{head}{README_START}\n{readme_table(res)}\n{README_END}{tail}"
    return results_md(res), json.dumps(res, indent=1) + "\n", new_readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from the runs")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs", help="folder of results.md and results.json")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README whose results table is rewritten")
    args = ap.parse_args(argv)
    record = json.loads((RUNS / "record.json").read_text())
    md, js, readme = render(args.readme.read_text(), collect(record))
    targets = {args.docs / "results.md": md, args.docs / "results.json": js, args.readme: readme}
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p} differs from what benchmarks/runs/ says: run python benchmarks/results.py", file=sys.stderr)
        return 1 if stale else 0
    for p, text in targets.items():
        atomic_write_text(p, text)  # a temporary file renamed into place; never over a non-regular file
    vllm = json.loads(js).get("vllm")
    if vllm is not None:
        _vllm_race_module().plot(vllm["summary"], vllm["arms"], args.docs / "vllm_race.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
