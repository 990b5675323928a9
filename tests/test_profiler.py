"""speckv-profile on tiny models built in code: rows, resume, prompt errors, one feature code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from speckv_policy.cli import profile as profile_cli
from speckv_policy.features import features_from_log
from speckv_policy.hf import attach, profiler
from speckv_policy.hf.models import draft_precision
from speckv_policy.hf.profiler import ProfileConfig
from speckv_policy.logs import read_log, validate_log
from speckv_policy.machine import describe_host
from speckv_policy.objective import CostModel
from speckv_policy.prompts import Prompt, PromptFileError, read_prompts
from speckv_policy.testing import save_tiny_pair, tiny_llama_pair

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("prof")
    target, draft = save_tiny_pair(d)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(4):
        lines.append(
            json.dumps(
                {
                    "id": f"p{i}",
                    "task_type": ["code", "math", "chat", "summarization"][i],
                    "split": "heldout" if i == 3 else "train",
                    "input_ids": rng.integers(1, 64, size=int(rng.integers(2, 8))).tolist(),
                }
            )
        )
    (d / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return d, str(target), str(draft)


def _cfg(d, target, draft, out, **kw):
    base = dict(
        target=target,
        draft=draft,
        out=str(out),
        compressions=("fp32", "nf4"),
        decodings=("greedy", "sampling"),
        max_new_tokens=30,
        seed=3,
    )
    base.update(kw)
    return ProfileConfig(**base)


@pytest.fixture(scope="module")
def full_run(setup):
    d, target, draft = setup
    out = d / "full.parquet"
    counts = profiler.profile(_cfg(d, target, draft, out), read_prompts(d / "prompts.jsonl"), progress=False)
    return out, counts


def test_profile_rows_validate_and_fit_a_cost_model(full_run):
    out, counts = full_run
    assert counts["done"] == 2 * 2 * 4 and counts["skipped"] == 0
    log = read_log(out)  # validates every row against the schema
    assert len(log) == counts["rows"] > 100
    assert set(log["compression"]) == {"fp32", "nf4"} and set(log["decoding"]) == {"greedy", "sampling"}
    assert (log["gamma"] == 8).mean() > 0.6 and (log["gamma"] < 8).any()  # gamma_max plus calibration steps
    assert set(log.loc[log["prompt_id"] == "p3", "split"]) == {"heldout"}
    assert (log.loc[log["decoding"] == "sampling", "temperature"] == 0.7).all()
    cm = CostModel.fit(log)
    assert all(v > 0 for v in cm.verify_base_ms) and all(v > 0 for v in cm.draft_ms_per_token)
    assert 0 < log["accepted"].mean() < 8


def test_interrupted_profile_resumes_to_the_same_rows(setup, full_run, monkeypatch):
    d, target, draft = setup
    out = d / "resumed.parquet"
    prompts = read_prompts(d / "prompts.jsonl")
    real_append = profiler.append_log
    calls = {"n": 0}

    def crash_on_third(path, rows, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_append(path, rows, **kwargs)

    monkeypatch.setattr(profiler, "append_log", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        profiler.profile(_cfg(d, target, draft, out), prompts, progress=False)
    partial = read_log(out)
    assert partial["prompt_id"].nunique() == 2  # the two finished units survived, intact
    monkeypatch.setattr(profiler, "append_log", real_append)
    counts = profiler.profile(_cfg(d, target, draft, out), prompts, progress=False)
    assert counts["skipped"] == 2 and counts["done"] == 14
    resumed, reference = read_log(out), read_log(full_run[0])
    key = ["run_id", "prompt_id", "step"]
    a = resumed.sort_values(key).reset_index(drop=True)
    b = reference.sort_values(key).reset_index(drop=True)
    cols = ["run_id", "prompt_id", "step", "gamma", "accepted", "context_len"]
    assert a[cols].equals(b[cols])  # seeded per unit: same outcomes as the uninterrupted run


def test_fixed_gamma_runs(setup, tmp_path):
    d, target, draft = setup
    out = tmp_path / "fixed.parquet"
    profiler.profile(
        _cfg(d, target, draft, out, compressions=("fp32",), decodings=("greedy",), fixed_gammas=(2, 4)),
        read_prompts(d / "prompts.jsonl")[:2],
        progress=False,
    )
    log = read_log(out)
    assert set(log["run_id"]) == {"profile-fp32-greedy", "profile-fp32-greedy-g2", "profile-fp32-greedy-g4"}
    assert set(log.loc[log["run_id"].str.endswith("-g4"), "gamma"]) == {4}


def test_profile_with_the_targets_linear_layers_on_onednn(setup, tmp_path):
    """--target-linear onednn: the profile runs the converted target and records the setting (resume checks it)."""
    from speckv_policy.logs import read_log_metadata

    d, target, draft = setup
    out = tmp_path / "onednn.parquet"
    cfg = _cfg(d, target, draft, out, compressions=("fp32",), decodings=("greedy",), target_linear="onednn")
    profiler.profile(cfg, read_prompts(d / "prompts.jsonl")[:2], progress=False)
    log = read_log(out)
    assert len(log) > 0 and set(log["compression"]) == {"fp32"}
    settings = json.loads(read_log_metadata(out)["profile_settings"])
    assert settings["target_linear"] == "onednn" and "draft_linear" not in settings  # the default is not recorded
    # the draft's layers on oneDNN too: recorded, and a resume with other draft layers is refused
    out2 = tmp_path / "onednn-draft.parquet"
    both = dict(compressions=("fp32",), decodings=("greedy",), target_linear="onednn")
    profiler.profile(
        _cfg(d, target, draft, out2, draft_linear="onednn", **both),
        read_prompts(d / "prompts.jsonl")[:2],
        progress=False,
    )
    assert json.loads(read_log_metadata(out2)["profile_settings"])["draft_linear"] == "onednn"
    with pytest.raises(ValueError, match="draft_linear: 'onednn' in the log, None now"):
        profiler.profile(_cfg(d, target, draft, out2, **both), read_prompts(d / "prompts.jsonl")[:3], progress=False)


@pytest.mark.parametrize(
    "line,msg",
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"id": "x", "task_type": "poetry", "input_ids": [1]}', "line 2: task_type must be one of"),
        ('{"id": "x", "task_type": "code"}', "line 2: give exactly one of 'prompt'"),
        ('{"id": "a", "task_type": "code", "input_ids": [1]}', "line 2: duplicate id 'a'"),
        ('{"id": "x", "task_type": "code", "input_ids": [-1]}', "line 2: 'input_ids' must be"),
        ('{"id": "x", "task_type": "code", "split": "test", "prompt": "hi"}', "line 2: split must be"),
    ],
)
def test_bad_prompt_file_names_the_line(tmp_path, line, msg):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "task_type": "code", "input_ids": [1, 2]}\n' + line + "\n")
    with pytest.raises(PromptFileError, match=msg):
        read_prompts(f)


def test_cli_reports_prompt_errors(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("[1, 2]\n")
    assert (
        profile_cli.main(["--target", "t", "--draft", "d", "--prompts", str(f), "--out", str(tmp_path / "o.parquet")])
        == 2
    )
    assert "line 1: expected a JSON object" in capsys.readouterr().err


class _RecordingGate:
    """Gated policy recording, per step, the gate's row and (when it opened) the length head's row."""

    def __init__(self, rng, seen):
        self.rng, self.seen, self.gate_rows = rng, seen, []

    def decide_gate(self, x):
        self.gate_rows.append(np.array(x, copy=True))
        self.seen.append(None)
        return bool(self.rng.random() < 0.8)

    def __call__(self, x):
        self.seen[-1] = np.array(x, copy=True)
        return int(self.rng.integers(0, 6))


@pytest.mark.parametrize("mode, feature_set", [("upfront", "online"), ("pre", "pre"), ("gated", "gated")])
def test_runtime_features_equal_log_features(mode, feature_set):
    """The hook's features at run time and features_from_log on the logged steps are the same numbers."""
    target, draft = tiny_llama_pair(seed=1)
    seen = []
    rng = np.random.default_rng(0)

    def policy(x):
        seen.append(np.array(x, copy=True))
        return int(rng.integers(0, 6))

    if mode == "gated":
        policy = _RecordingGate(rng, seen)
    # repeated tokens, so the context-match signal takes several values
    ids = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4]])
    with attach(
        target, policy, compression="int8", mode=mode, feature_set=feature_set, settings={"record_tokens": True}
    ) as h:
        target.generate(ids, max_new_tokens=60, do_sample=True, temperature=0.7, assistant_model=draft)
    prompt = Prompt("p", "code", "train", input_ids=(3, 1, 4, 1, 5, 3, 1, 4))
    rows = profiler.stats_to_rows(
        h.stats + [h.stats[-1]],
        run_id="r",
        prompt=prompt,
        compression="int8",
        decoding="sampling",
        temperature=0.7,
        device="cpu",
        draft_id="d",
        target_id="t",
    )
    log = validate_log(__import__("pandas").DataFrame(rows))
    X, acc, drafted = features_from_log(log, feature_set)
    runtime = np.array([f for f, s in zip(seen, h.stats) if s.gamma > 0])
    assert len(X) == len(runtime) > 5
    np.testing.assert_allclose(X.to_numpy(), runtime, rtol=1e-6, atol=1e-7)
    if feature_set != "online":  # the signals vary: the context match is live, and a recording run logs the target's
        assert X["context_match_len"].nunique() > 1 and X["context_match_len"].max() >= 1
        assert log["target_confidence"].nunique() > 3
        assert (log["target_confidence"].iloc[0], log["target_entropy"].iloc[0]) == (0.0, 0.0)
    if mode == "gated":  # the gate saw the same pre columns, its probe columns zero
        gates = np.array(policy.gate_rows)
        assert len(gates) == len(h.stats) and np.all(gates[:, -2:] == 0)
        opened = [g for g, f in zip(gates, seen) if f is not None]
        np.testing.assert_array_equal(np.array(opened)[:, :-2], np.array([f for f in seen if f is not None])[:, :-2])


def test_model_loading_errors_name_the_problem(setup, tmp_path):
    from speckv_policy.hf import models as hf_models
    from speckv_policy.smollm2 import models as smollm2_models

    _, target, _ = setup
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model folder not found: {missing}"):
        hf_models.load_model(missing)
    with pytest.raises(FileNotFoundError, match=r"or use 'smollm2'"):
        smollm2_models.load_model(str(missing))
    with pytest.raises(ValueError, match="unknown compression 'int4'"):
        hf_models.load_model(target, "int4")
    # a local folder goes through both sources alike
    assert hf_models.model_id(target) == smollm2_models.model_id(str(target)) == "target"
    assert smollm2_models.load_tokenizer(str(target)) is None  # tiny models have no tokenizer
    m = smollm2_models.load_model(str(target), "bf16")
    assert m.dtype == torch.bfloat16 and not m.training


def test_calibrate_times_every_gamma_through_the_hook(setup, tmp_path, capsys):
    from speckv_policy.cli import calibrate as calibrate_cli
    from speckv_policy.hf.calibrate import CalibrationConfig, calibrate

    d, target, draft = setup
    cfg = CalibrationConfig(
        target=target, draft=draft, compressions=("fp32", "int8"), gamma_max=4, seconds=3.0, max_new_tokens=20
    )
    cost, steps = calibrate(cfg, read_prompts(d / "prompts.jsonl"))
    assert set(steps["compression"]) == {"fp32", "int8"} and set(steps["gamma"]) == set(range(5))
    assert (steps["step"] > 0).all()  # first steps (prefill) left out
    assert cost.device == "cpu" and cost.decision_draft_tokens == 0 and len(cost.verify_table_ms[0]) == 5
    assert cost.machine == describe_host()  # the cost file says which machine measured it
    # the fitted table is the mean verify time per gamma, per level
    g2 = steps[(steps["compression"] == "int8") & (steps["gamma"] == 2)]
    usual = (g2["verify_ms"] <= 5 * g2["verify_ms"].median()) & (g2["draft_ms"] <= 5 * g2["draft_ms"].median())
    usual |= len(g2) < 3  # outliers are judged in groups of 3 or more
    assert cost.verify_table_ms[1][2] == pytest.approx(g2.loc[usual, "verify_ms"].mean())  # outliers left out
    out = tmp_path / "costs.json"
    assert (
        calibrate_cli.main(
            [
                "--target",
                target,
                "--draft",
                draft,
                "--prompts",
                str(d / "prompts.jsonl"),
                "--compressions",
                "fp32",
                "--seconds",
                "1",
                "--gamma-max",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert CostModel.load(out).device == "cpu" and "2 (nf4)" in text and "not timed" in text
    assert CostModel.load(out).machine == describe_host()
    assert f"on cpu ({describe_host()})" in text
    assert (
        calibrate_cli.main(
            ["--target", target, "--draft", draft, "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(out)]
        )
        == 2
    )
    assert "prompt file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate_cli.main(["--out", str(out), "--seconds", "-1"])
    for endless in ("inf", "nan"):  # issue 38: --seconds inf timed forever
        with pytest.raises(SystemExit) as exc:
            calibrate_cli.main(["--out", str(out), "--seconds", endless])
        assert exc.value.code == 2
    assert "--seconds: must be" in capsys.readouterr().err


def test_resume_with_other_settings_is_refused(setup, full_run, capsys):
    d, target, draft = setup
    out, _ = full_run
    before = out.read_bytes()
    prompts = read_prompts(d / "prompts.jsonl")
    with pytest.raises(ValueError, match=r"profiled with other settings \(gamma_max: 8 in the log, 4 now"):
        profiler.profile(_cfg(d, target, draft, out, gamma_max=4), prompts, progress=False)
    with pytest.raises(ValueError, match="temperature: 0.7 in the log, 0.9 now"):
        profiler.profile(_cfg(d, target, draft, out, temperature=0.9), prompts, progress=False)
    ran = draft_precision("cpu")  # what "auto" resolved to and the log recorded
    other = "fp32" if ran == "bf16" else "bf16"
    with pytest.raises(ValueError, match=f"draft_precision: '{ran}' in the log, '{other}' now"):
        profiler.profile(_cfg(d, target, draft, out, draft_precision=other), prompts, progress=False)
    with pytest.raises(ValueError, match="target_linear: None in the log, 'onednn' now"):
        profiler.profile(_cfg(d, target, draft, out, target_linear="onednn"), prompts, progress=False)
    assert out.read_bytes() == before
    # the same settings resume (nothing left to do), another level extends the log
    assert profiler.profile(_cfg(d, target, draft, out), prompts, progress=False)["done"] == 0
    args = [
        "--target",
        target,
        "--draft",
        draft,
        "--prompts",
        str(d / "prompts.jsonl"),
        "--out",
        str(out),
        "--compressions",
        "fp32",
        "--gamma-max",
        "4",
        "--max-new-tokens",
        "30",
        "--seed",
        "3",
    ]
    assert profile_cli.main(args) == 2
    assert "profiled with other settings" in capsys.readouterr().err
    assert profile_cli.main(args[:7] + [str(d / "x.csv")] + args[8:]) == 2
    assert "ending in .parquet" in capsys.readouterr().err
    # --force-new starts afresh and moves the old log aside: nothing is lost
    copy = d / "forced.parquet"
    copy.write_bytes(before)
    assert profile_cli.main(args[:7] + [str(copy)] + args[8:] + ["--force-new", "--limit", "1"]) == 0
    aside = [f for f in d.iterdir() if f.name.startswith("forced.old-")]
    assert len(aside) == 1 and aside[0].read_bytes() == before
    assert set(read_log(copy)["compression"]) == {"fp32"} and read_log(copy)["prompt_id"].nunique() == 1


def test_draft_precision_auto_resolves_by_device_and_cpu(monkeypatch):
    from speckv_policy.hf import models

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert draft_precision("cpu") == "bf16" and draft_precision("cuda:0") == "fp16"
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    assert draft_precision("cpu") == "fp32"
    assert draft_precision("cpu", "fp16") == "fp16" and draft_precision("cuda", "fp32") == "fp32"  # explicit wins
    with pytest.raises(ValueError, match="draft precision 'int8': expected one of auto, fp32, bf16, fp16"):
        draft_precision("cpu", "int8")
    from speckv_policy.cli.common import DRAFT_PRECISION_CHOICES

    assert DRAFT_PRECISION_CHOICES == models.DRAFT_PRECISIONS  # what the CLIs offer is what the loader takes
