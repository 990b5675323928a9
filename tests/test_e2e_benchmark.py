"""The end-to-end race: benchmarks/e2e.py on a tiny random pair (smoke: mechanics, not speed), and its parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speckv_policy.evaluation import race
from speckv_policy.hf import race as hf_race
from speckv_policy.hf.onednn import onednn_available
from speckv_policy.machine import cpu_model
from speckv_policy.testing import save_tiny_pair

from .conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def run_e2e(args: list[str]) -> int:
    """``python benchmarks/e2e.py ARGS`` as a user runs it; returns the exit status."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    target, draft = save_tiny_pair(d)
    rng = np.random.default_rng(0)
    lines = []
    for task in ("code", "math", "chat", "summarization"):
        for split in ("train", "heldout") if task in ("code", "chat") else ("train",):
            ids = rng.integers(1, 64, size=int(rng.integers(3, 8))).tolist()
            lines.append(json.dumps({"id": f"{task}-{split}", "task_type": task, "split": split, "input_ids": ids}))
    (d / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return d, target, draft


E2E = load_benchmark("e2e.py")  # the goals it judges a race by live there, not in the library


def test_e2e_smoke_on_tiny_pair(tiny_setup):
    d, target, draft = tiny_setup
    doc = d / "bench.md"
    doc.write_text("# Benchmarks\n\nkept text\n")
    args = [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--prompts",
        str(d / "prompts.jsonl"),
        "--per-task",
        "1",
        "--compressions",
        "fp32",
        "--decodings",
        "greedy,sampling",
        "--max-new-tokens",
        "6",
        "--policy-prefix",
        "synthetic-",
        "--calibrate",
        "2",
        "--costs-out",
        str(d / "costs.json"),
        "--out",
        str(d / "e2e.json"),
        "--plot",
        str(d / "e2e.png"),
        "--doc",
        str(doc),
    ]
    assert run_e2e(args) == 0
    res = json.loads((d / "e2e.json").read_text())
    expected = {
        "target",
        "fixed-2",
        "fixed-4",
        "fixed-6",
        "fixed-8",
        "hf-fixed-4",
        "hf-default",
        "hf-heuristic",
        "adaedl",
        "mlp16",
        "mlp-upfront",
        "mlp-pertoken",
        "gbt-upfront",
        "gbt-pertoken",
        "table-upfront",
        "table-pertoken",
        "mlp-backoff",
        "gbt-backoff",
        "table-backoff",
        *(f"{k}-{tag}" for k in ("mlp", "gbt", "table") for tag in ("repriced", "live")),
        "sglang-adaptive",
        "ema-goodput",
    }
    assert set(res["arms"]) == expected
    assert cpu_model() in res["machine"]  # the CPU is named, so races on two machines read apart
    # the race calibrated this machine first and raced the exports re-priced with it
    from speckv_policy.objective import CostModel

    assert CostModel.load(d / "costs.json").device == "cpu"
    assert res["calibration"]["file"] == str(d / "costs.json") and res["calibration"]["steps"] > 0
    assert res["mismatches"] == []  # every greedy arm reproduced the target's greedy output
    runs = res["runs"]
    assert len(runs) == 2 * 2 * len(expected)  # 2 decodings x 2 held-out prompts x arms
    assert {r["prompt_id"] for r in runs} == {"code-heldout", "chat-heldout"}  # held-out prompts only
    assert all(r["tokens"] == 6 and r["seconds"] > 0 for r in runs)
    assert all(r["fallbacks"] == 0 for r in runs)
    for r in runs:  # every run through the hook saved its steps; HF's own arms and the target alone have none
        hooked = r["steps"] is not None
        assert (len(r["step_gamma"]) == r["steps"]) if hooked else r["step_gamma"] == []
        assert len(r["step_drafted"]) == len(r["step_accepted"]) == len(r["step_draft_ms"]) == len(r["step_gamma"])
        assert all(
            a <= g <= d or (g == 0 and a == 0)
            for a, g, d in zip(r["step_accepted"], r["step_gamma"], r["step_drafted"])
        )
    cell = res["summary"]["fp32/greedy/all"]
    assert cell["arms"]["target"]["vs_target"] == pytest.approx(1.0)
    lo, hi = cell["arms"]["gbt-upfront"]["vs_target_ci"]  # paired bootstrap CI over the 2 prompts
    assert lo <= cell["arms"]["gbt-upfront"]["vs_target"] <= hi
    assert cell["best_peer"] in race.PEER_RULES
    assert cell["best_fixed"] in {"fixed-2", "fixed-4", "fixed-6", "fixed-8"}
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept text") and text.count(race.BEGIN) == 1
    assert "### fp32, greedy" in text and "Every greedy run produced exactly" in text
    assert "measured first (`speckv-calibrate`" in text
    assert res["config"]["draft_forward"] == "fast" and "forward steps through the Llama decode step" in text
    assert (d / "e2e.png").read_bytes()[:4] == b"\x89PNG"
    # re-rendering from the saved JSON reproduces the section without running anything
    before = doc.read_text()
    assert run_e2e(["--render", str(d / "e2e.json"), "--plot", str(d / "e2e.png"), "--doc", str(doc)]) == 0
    assert doc.read_text() == before
    # a second run replaces the section instead of appending another; this one runs the target's linear layers on
    # oneDNN (every arm, the target alone included), the draft's too, and still reproduces the (converted) target's
    # greedy output
    arms = ["--arms", "fixed-4,gbt-upfront", "--target-linear", "onednn", "--draft-linear", "onednn"]
    assert run_e2e(args[:-2] + ["--doc", str(doc), *arms]) == 0
    text = doc.read_text()
    assert text.count(race.BEGIN) == 1 and "hf-heuristic" not in text
    assert "(float32 linear layers on onednn)" in text
    assert "linear layers on onednn, forward steps through the Llama decode step;" in text  # oneDNN in the step
    res = json.loads((d / "e2e.json").read_text())
    assert res["config"]["target_linear"] == "onednn" and res["config"]["draft_linear"] == "onednn"
    assert res["config"]["draft_forward"] == "fast"
    assert res["mismatches"] == []


def test_a_second_draft_races_beside_in_the_same_run(tiny_setup):
    """--beside-draft: its arms run interleaved with the race's own, named TAG:ARM, calibrated for their draft."""
    import shutil

    d, target, draft = tiny_setup
    twin = d / "twin"
    if not twin.exists():
        shutil.copytree(draft, twin)
    args = ["--target", str(target), "--draft", str(draft), "--prompts", str(d / "prompts.jsonl"), "--per-task", "1"]
    args += ["--compressions", "fp32", "--decodings", "greedy", "--max-new-tokens", "6", "--policy-prefix"]
    args += ["synthetic-", "--calibrate", "2", "--costs-out", str(d / "c1.json"), "--arms", "fixed-2,gbt-repriced"]
    args += ["--beside-draft", str(twin), "--beside-prefix", "synthetic-", "--beside-arms", "gbt-repriced,fixed-4"]
    args += ["--beside-costs-out", str(d / "c2.json"), "--out", str(d / "b.json"), "--plot", str(d / "b.png")]
    args += ["--doc", str(d / "b.md")]
    # each draft gets its own linear backend (recorded with the draft and its calibration)
    linear = "onednn" if onednn_available() else "default"
    args += ["--draft-linear", linear]
    assert run_e2e(args) == 0
    res = json.loads((d / "b.json").read_text())
    assert res["arms"] == ["target", "fixed-2", "gbt-repriced", "twin:fixed-4", "twin:gbt-repriced"]
    assert res["config"]["beside_draft"].endswith("twin")
    assert res["config"]["draft_linear"] == linear and res["config"]["beside_draft_linear"] == "default"
    assert res["config"]["beside_draft_forward"] == "fast" and res["config"]["draft_forward"] == "fast"
    assert res["calibration"]["draft_linear"] == linear and res["beside_calibration"]["draft_linear"] == "default"
    assert res["beside_calibration"]["file"] == str(d / "c2.json") and (d / "c2.json").is_file()
    assert res["beside_calibration"]["draft"] == str(twin) and res["beside_calibration"]["steps"] > 0
    runs = [r for r in res["runs"] if r["arm"] == "twin:fixed-4"]
    assert len(runs) == 2 and all(max(r["step_gamma"]) == 4 for r in runs)  # ran, with its own rule
    assert res["mismatches"] == []
    cell = res["summary"]["fp32/greedy/all"]
    assert cell["best_fixed"] == "fixed-2"  # a beside arm is a reference of its own, not a fixed or peer arm
    assert cell["best_beside"] in {"twin:fixed-4", "twin:gbt-repriced"}
    assert cell["arms"][cell["best_beside"]]["vs_beside"] == pytest.approx(1.0)
    assert "vs_beside" in cell["arms"]["gbt-repriced"]
    goals = [g for g in res["goals"] if "beside draft" in g]
    assert goals and goals[0].startswith("fp32 greedy, best of ours (gbt-repriced) vs the best arm on the beside")
    with pytest.raises(ValueError, match="tag must be non-empty"):
        race.beside_arms([race.ArmSpec("fixed-2")], "a:b")
    # bad --beside-draft settings are refused before anything runs (no calibration first), naming what is wrong
    for extra, message in (
        (["--beside-draft", str(d / "missing")], f"draft folder not found: {d / 'missing'}"),
        (["--beside-draft", str(twin), "--calibrate", "0"], "it needs --calibrate > 0"),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), *args[:-2], *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and message in proc.stderr and "calibrated" not in proc.stdout


def test_adaedl_rule():
    from speckv_policy.schema import ONLINE

    row = np.zeros(ONLINE.n_features, dtype=np.float32)
    row[ONLINE.names.index("ema_accept_rate")] = 0.5
    row[ONLINE.names.index("entropy_first")] = 0.0
    assert race.adaedl_policy(row) == 2  # certain draft: bound 1 >= 0.5, keep drafting
    row[ONLINE.names.index("entropy_first")] = 2.0  # bound 1 - sqrt(0.4) = 0.37 < 0.5: stop
    assert race.adaedl_policy(row) == 0
    row[ONLINE.names.index("ema_accept_rate")] = 1.0  # high acceptance lowers the threshold to 0.35
    assert race.adaedl_policy(row) == 2


def test_unexplained_mismatches():
    ms = [
        "int8 p1 repeat 0 arm hf-fixed-4: first difference at output token 3",
        "int8 p1 repeat 0 arm gbt-upfront: first difference at output token 3",
        "fp32 p2 repeat 0 arm gbt-upfront: first difference at output token 1",
    ]
    assert race.unexplained(ms) == ms[2:]
    tie = [
        "nf4 p3 repeat 0 arm gbt-backoff: first difference at output token 5 (near tie: logit gap 0.0086, "
        "chunking noise 0.3046000)",
        "nf4 p4 repeat 0 arm gbt-backoff: first difference at output token 5 (not a near tie: logit gap 2.5, "
        "chunking noise 0.3)",
    ]
    assert race.unexplained(tie) == tie[1:]


def test_chunking_noise_tells_a_near_tie_from_a_real_difference():
    import torch

    from speckv_policy.testing import tiny_llama_pair

    target, _ = tiny_llama_pair(seed=1)
    ctx = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4, 6, 10]])
    with torch.no_grad():
        top2 = target(ctx).logits[0, -1].topk(2)
    first, second = int(top2.indices[0]), int(top2.indices[1])
    gap, noise = hf_race.chunking_noise(target, ctx, first, second)
    assert gap == pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-4)
    assert noise < 1e-4 < gap  # fp32: chunking barely moves the logits, the difference would be real

    class ShapeNoisy(torch.nn.Module):  # a target whose multi-token passes shift one logit (like int8/nf4 rounding)
        def __init__(self, model, token, delta):
            super().__init__()
            self.model, self.config, self.token, self.delta = model, model.config, token, delta

        def forward(self, input_ids, **kwargs):
            out = self.model(input_ids, **kwargs)
            if input_ids.shape[1] > 1:
                out.logits[..., self.token] += self.delta
            return out

    gap2, noise2 = hf_race.chunking_noise(ShapeNoisy(target, second, gap + 0.5), ctx, first, second)
    assert gap2 == pytest.approx(gap, abs=1e-4) and noise2 == pytest.approx(gap + 0.5, abs=1e-4)  # a near tie


def test_unknown_arm_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown arm"):
        race.make_arms(ROOT / "exported", "smollm2-", ["nope"])


def test_sglang_style_steps_follow_the_accepted_length():
    rule = race.SGLangStyleSteps()
    assert rule.gamma() == 3  # starts on the middle tier
    for _ in range(10):
        rule.observe(3, 3)  # every draft fully accepted: EMA -> 3, round(3) + 1 = 4, nearest tier 3... then 7
    assert rule.gamma() in (3, 7)
    for _ in range(30):
        rule.observe(rule.gamma(), rule.gamma())
    assert rule.gamma() == 7
    for _ in range(40):
        rule.observe(rule.gamma(), 0)  # nothing accepted: down to the smallest tier
    assert rule.gamma() == 1
    rule.observe(0, 0)  # a step that did not draft changes nothing
    assert rule.gamma() == 1


def test_ema_goodput_choice():
    flat = np.full(9, 10.0)  # verification free, drafting free: longer is never worse
    rule = race.GoodputEMA(np.full(8, 0.9), flat)
    assert rule.gamma() == 8
    costly = 10.0 + 4.0 * np.arange(9)  # each draft token costs 40% of a step
    rule = race.GoodputEMA(np.full(8, 0.3), costly)
    assert rule.gamma() == 0  # low acceptance and dear drafts: a plain step
    for _ in range(60):
        rule.observe(1, 1)  # position 1 always accepted now
    assert rule.p[0] > 0.95 and rule.gamma() >= 1
    with pytest.raises(ValueError, match="step_ms needs 9 values"):
        race.GoodputEMA(np.full(8, 0.5), np.ones(3))


def test_conditional_acceptance_from_a_log():
    from speckv_policy.logs import read_log

    log = read_log(ROOT / "datasets" / "smollm2" / "steps.parquet")
    p = race.conditional_acceptance(log, "fp32")
    assert p.shape == (8,) and ((p > 0) & (p < 1)).all()


def _race_run(prompt, arm, seconds, *, tokens=10, task="code", compression="fp32", decoding="greedy"):
    """One saved race run, as benchmarks/e2e.py --out records it (what summarize_runs reads)."""
    return {
        "tokens": tokens,
        "seconds": seconds,
        "steps": 1,
        "decision_s": 0.0,
        "fallbacks": 0,
        "arm": arm,
        "prompt_id": prompt,
        "task_type": task,
        "compression": compression,
        "decoding": decoding,
        "repeat": 0,
    }


def test_pooled_ratios_are_total_tokens_over_total_time_not_the_median_of_ratios():
    """Two prompts: gbt is 2x the target on the first and 0.5x on the second, but the second takes longer, so pooled
    over the runs (the offline evaluator's statistic) it is slower (20 tokens in 5 s against 20 in 4 s) while the
    median of the per-prompt ratios says 1.25x."""

    def run(prompt, arm, tokens, seconds):
        return _race_run(prompt, arm, seconds, tokens=tokens)

    runs = [
        run("p1", "target", 10, 2.0),
        run("p2", "target", 10, 2.0),
        run("p1", "gbt-upfront", 10, 1.0),
        run("p2", "gbt-upfront", 10, 4.0),
        run("p1", "fixed-2", 10, 1.5),
        run("p2", "fixed-2", 10, 3.0),
        run("p1", "fixed-4", 10, 3.0),
        run("p2", "fixed-4", 10, 1.5),
    ]
    cell = race.summarize_runs(runs, ["target", "gbt-upfront", "fixed-2", "fixed-4"])["fp32/greedy/all"]
    assert cell["arms"]["gbt-upfront"]["vs_target"] == pytest.approx(1.25)  # median of 2.0 and 0.5
    pooled = cell["pooled"]
    gbt = pooled["arms"]["gbt-upfront"]
    assert gbt["tokens_per_second"] == pytest.approx(4.0)
    assert gbt["vs_target"] == pytest.approx(0.8)  # 4 tok/s against 5
    # resamples of two prompts: p1 twice (2x), p2 twice (0.5x), one of each (0.8x)
    assert gbt["vs_target_ci"] == pytest.approx([0.5, 2.0])
    # fixed-2 and fixed-4 both pool to 20 tokens in 4.5 s: the best fixed is one of them, at 4.44 tok/s
    assert pooled["best_fixed"] in ("fixed-2", "fixed-4")
    assert gbt["vs_best_fixed"] == pytest.approx(4.0 / (20 / 4.5))
    # the CI's reference is each resample's best fixed gamma: p1 twice -> fixed-2 (10 / 6.67 = 1.5), p2 twice ->
    # fixed-4 (2.5 / 6.67 = 0.375; against a reference fixed on the full sample it would read 0.75 or 1.5)
    assert gbt["vs_best_fixed_ci"] == pytest.approx([0.375, 1.5])
    assert "best_peer" in pooled and pooled["best_peer"] is None and "vs_best_peer" not in gbt
    result = {
        "config": {
            "target": "t",
            "draft": "d",
            "prompts": 2,
            "per_task": 1,
            "max_new_tokens": 10,
            "repeats": 1,
            "compressions": ["fp32"],
        },
        "arms": ["target", "gbt-upfront", "fixed-2", "fixed-4"],
        "summary": race.summarize_runs(runs, ["target", "gbt-upfront", "fixed-2", "fixed-4"]),
        "machine": "m",
        "minutes": 0.1,
        "command": "c",
        "mismatches": [],
        "plot": "p.png",
    }
    result["goals"] = E2E.goals(result)
    assert any("pooled over the runs, best of ours (gbt-upfront) vs target alone: 0.80x" in g for g in result["goals"])
    text = race.markdown(result)
    assert "Pooled over the runs (total tokens / total time" in text
    assert "| **gbt-upfront** | 4.00 | 0.80 [" in text


def test_the_report_covers_every_decoding_the_race_ran():
    """A race with greedy and sampling blocks: one per-task table and one set of goal lines per decoding; sampling's
    goals hold every task type to the target alone (the 1.15x code goal is greedy's)."""

    def run(prompt, task, arm, decoding, seconds):
        return _race_run(prompt, arm, seconds, task=task, compression="nf4", decoding=decoding)

    arms = ["target", "fixed-2", "gbt-gated"]
    speed = {"target": 2.0, "fixed-2": 1.9, "gbt-gated": 1.6}
    runs = [
        run(f"{t}-{i}", t, a, d, speed[a] * (1.5 if (t, d, a) == ("chat", "sampling", "gbt-gated") else 1.0))
        for d in ("greedy", "sampling")
        for t in ("chat", "code")
        for i in range(2)
        for a in arms
    ]
    cfg = {"target": "t", "draft": "d", "prompts": 4, "per_task": 2, "max_new_tokens": 10, "repeats": 1}
    result = {
        "config": {**cfg, "compressions": ["nf4"], "decodings": ["greedy", "sampling"]},
        "arms": arms,
        "runs": runs,
        "mismatches": [],
        "command": "python benchmarks/e2e.py",
        "machine": "test",
        "minutes": 0.1,
        "plot": "x.png",
    }
    result["summary"] = race.summarize_runs(runs, arms)
    result["goals"] = E2E.goals(result)
    text = race.markdown(result)
    assert "### x target alone by task type (greedy)" in text and "### x target alone by task type (sampling)" in text
    lines = result["goals"]
    assert any(g.startswith("nf4 greedy code: gbt-gated vs target alone 1.25x (goal >= 1.15x) MET") for g in lines)
    assert any(g.startswith("nf4 sampling code: gbt-gated vs target alone 1.25x (goal >= 1.00x) MET") for g in lines)
    assert any(g.startswith("nf4 sampling chat: gbt-gated vs target alone 0.83x (goal >= 1.00x) MISSED") for g in lines)
    assert [g.split(",")[0].split(" ")[1] for g in lines if " vs target alone: " in g] == [
        "greedy",
        "greedy",
        "sampling",
        "sampling",
    ]  # medians, then pooled, per block
    greedy_only = {**result, "config": {**result["config"], "decodings": ["greedy"]}}
    assert "(sampling)" not in race.markdown(greedy_only) and not any("sampling" in g for g in E2E.goals(greedy_only))


def test_the_race_runs_the_shipped_stop_rule_as_shipped_re_priced_and_live():
    from speckv_policy.objective import CostModel
    from speckv_policy.stop import StopRule

    costs = CostModel((1.0,) * 3, (5.0,) * 3, (0.5,) * 3)
    arms = race.make_arms(ROOT / "exported", "smollm2-", ["stop", "stop-repriced", "stop-live"], costs)
    by = {a.name: a for a in arms}
    assert set(by) == {"target", "stop", "stop-repriced", "stop-live"}
    for name in ("stop", "stop-repriced", "stop-live"):
        assert by[name].mode == "stop" and by[name].group == "ours" and isinstance(by[name].policy, StopRule)
    assert by["stop-repriced"].costs is costs and by["stop"].costs is None and by["stop-live"].costs == "live"
    assert by["stop"].policy is by["stop-repriced"].policy  # loaded once
