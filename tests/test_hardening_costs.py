"""Second hardening round, costs and decisions: cost files checked at the door for every consumer, ``--reprice`` as
safe as an export, outliers caught in groups of any size, the runtime's contract applied offline too."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from speckv_policy.cli import evaluate as eval_cli
from speckv_policy.cli import export as export_cli
from speckv_policy.logs import write_log
from speckv_policy.objective import CostModel, CostModelError, CostModelWarning
from speckv_policy.runtime import PolicyFallbackWarning, PolicyLoadError, RuntimePolicy
from speckv_policy.stop import StopRule, StopRuleError

ROOT = Path(__file__).resolve().parents[1]
GATED = ROOT / "exported" / "smollm2-gbt-gated.onnx"
ONLINE = ROOT / "exported" / "smollm2-gbt.onnx"
STOP = ROOT / "exported" / "smollm2-stop.json"

GOOD = CostModel.relative().to_dict()
#: cost files the first round let through (AttributeError, IndexError, numpy type errors, or an export deciding
#: gamma 0 everywhere), each with the field its error must name
BAD_COSTS = {
    "n_rows a list": ({**GOOD, "n_rows": [1, 2]}, "n_rows"),
    "empty table rows": ({**GOOD, "verify_table_ms": [[], [], []]}, "verify_table_ms"),
    "ragged table": ({**GOOD, "verify_table_ms": [[1.0], [1.0, 2.0], [1.0]]}, "verify_table_ms"),
    "overhead a string": ({**GOOD, "overhead_ms": "abc"}, "overhead_ms"),
    "overhead NaN": ({**GOOD, "overhead_ms": float("nan")}, "overhead_ms"),
    "overhead -1e4": ({**GOOD, "overhead_ms": -1e4}, "overhead_ms"),
    "table of 1e308": ({**GOOD, "verify_table_ms": [[1e308] * 3] * 3}, "verify_table_ms"),
    "huge per-token": ({**GOOD, "draft_ms_per_token": [1e12] * 3}, "draft_ms_per_token"),
    "unknown unit": ({**GOOD, "unit": "s"}, "unit"),
    "boolean probe": ({**GOOD, "decision_draft_tokens": True}, "decision_draft_tokens"),
    "device a number": ({**GOOD, "device": 5}, "device"),
    "strings as times": ({**GOOD, "verify_base_ms": ["1", "1", "1"]}, "verify_base_ms"),
    "a number for a list": ({**GOOD, "draft_base_ms": 3.0}, "draft_base_ms"),
}


def _write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


@pytest.mark.parametrize("case", sorted(BAD_COSTS))
def test_every_cost_field_is_checked_at_load_naming_file_and_field(case, tmp_path):
    d, field = BAD_COSTS[case]
    path = _write(tmp_path / "costs.json", d)
    with pytest.raises(CostModelError, match=rf"costs\.json: invalid cost model \({field}"):
        CostModel.load(path)
    with pytest.raises(CostModelError, match=field):
        CostModel.load(d)


@pytest.mark.parametrize("case", sorted(BAD_COSTS))
def test_a_bad_cost_file_falls_back_with_one_warning_in_the_runtime(case, tmp_path):
    path = _write(tmp_path / "costs.json", BAD_COSTS[case][0])
    with pytest.raises(PolicyLoadError, match="costs.json"):
        RuntimePolicy(GATED, costs=path)
    with pytest.warns(PolicyFallbackWarning, match="costs.json") as rec:
        rt = RuntimePolicy(GATED, costs=path, fallback_gamma=4)
    assert len(rec) == 1 and rt.engine == "none"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rt.decide(np.zeros(11, np.float32)) == 4


def test_a_stop_rule_carrying_a_bad_cost_model_is_refused_naming_it(tmp_path):
    rule = json.loads(STOP.read_text())
    rule["cost_model"]["n_rows"] = [3]
    with pytest.raises(StopRuleError, match=r"rule\.json: 'cost_model'.*n_rows"):
        StopRule.load(_write(tmp_path / "rule.json", rule))


def test_cost_and_rule_paths_that_are_folders_or_fifos_are_refused_without_opening(tmp_path):
    from speckv_policy.stop import StopRule

    with pytest.raises(CostModelError, match="is a folder, not a file"):
        CostModel.load(tmp_path)
    with pytest.raises(StopRuleError, match="is a folder, not a file"):
        StopRule.load(tmp_path)
    fifo = tmp_path / "costs.json"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    with pytest.raises(CostModelError, match="not a regular file"):
        CostModel.load(fifo)
    with pytest.raises(StopRuleError, match="not a regular file"):
        StopRule.load(fifo)
    with pytest.raises(FileNotFoundError, match="cost model file not found"):
        CostModel.load(tmp_path / "none.json")


@pytest.fixture(scope="module")
def pair():
    from speckv_policy.testing import tiny_llama_pair

    return tiny_llama_pair()


@pytest.mark.parametrize("how", ["file", "live prior", "stop rule", "stop rule live prior"])
def test_attach_with_a_bad_cost_file_falls_back_with_one_warning_and_keeps_the_output(how, pair, tmp_path):
    from speckv_policy.hf import attach
    from speckv_policy.hf.live_costs import LiveCosts

    target, draft = pair
    bad = _write(tmp_path / "costs.json", BAD_COSTS["overhead -1e4"][0])
    policy = str(STOP) if how.startswith("stop") else str(ONLINE)
    costs = LiveCosts(prior=bad) if how.endswith("live prior") else str(bad)
    ids = torch.tensor([[3, 9, 4, 7]])
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    with pytest.warns(PolicyFallbackWarning, match=r"costs\.json.*overhead_ms") as rec:
        with attach(target, policy, compression="fp32", costs=costs) as h:
            out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert torch.equal(out, ref)
    assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    assert h.summary()["fallbacks"] > 0 and all(s.fallback for s in h.stats if s.drafted > 0)


def test_cost_file_errors_from_clis_name_the_file_and_exit_2(tmp_path, synthetic, capsys):
    bad = _write(tmp_path / "c.json", BAD_COSTS["n_rows a list"][0])
    log = tmp_path / "steps.parquet"
    write_log(synthetic[0], log)
    out = tmp_path / "e"
    argv = ["--log", str(log), "--policy", str(ONLINE), "--costs", str(bad), "--out", str(out), "--no-plots"]
    assert eval_cli.main(argv) == 2
    assert "c.json: invalid cost model (n_rows" in capsys.readouterr().err
    assert export_cli.main(["--stop-rule", str(tmp_path / "r.json"), "--train", str(log), "--costs", str(bad)]) == 2
    assert "c.json: invalid cost model (n_rows" in capsys.readouterr().err
    assert (
        export_cli.main(["--stop-rule", str(tmp_path / "r.json"), "--train", str(log), "--costs", str(tmp_path)]) == 2
    )
    assert "is a folder, not a file" in capsys.readouterr().err


# -- --reprice ------------------------------------------------------------------------------------------------------


@pytest.fixture()
def good_copy(tmp_path):
    keep = tmp_path / "keep.onnx"
    keep.write_bytes(GATED.read_bytes())
    return keep


def test_reprice_refuses_a_bad_cost_file_and_keeps_the_good_output(tmp_path, good_copy, capsys):
    before = good_copy.read_bytes()
    nan = _write(tmp_path / "nan.json", BAD_COSTS["overhead NaN"][0])
    assert export_cli.main(["--reprice", str(nan), str(GATED), str(good_copy)]) == 2
    assert "nan.json: invalid cost model (overhead_ms" in capsys.readouterr().err
    assert good_copy.read_bytes() == before


def test_reprice_refuses_a_result_that_drafts_one_gamma_everywhere_unless_asked(tmp_path, good_copy, capsys):
    before = good_copy.read_bytes()
    dear = tmp_path / "dear.json"
    CostModel.relative(draft_cost=50.0).save(dear)  # drafting 50x a target step: gamma 0 on every row
    assert export_cli.main(["--reprice", str(dear), str(GATED), str(good_copy)]) == 2
    err = capsys.readouterr().err
    assert "drafts gamma 0 on every one of 512 spanning feature rows" in err and "--allow-one-gamma" in err
    assert good_copy.read_bytes() == before
    assert export_cli.main(["--reprice", str(dear), str(GATED), str(good_copy), "--allow-one-gamma"]) == 0
    assert "gammas 0: 100%" in capsys.readouterr().out
    assert RuntimePolicy(good_copy).decide_gated_batch(np.zeros((3, 11), np.float32))[0].tolist() == [0, 0, 0]


def test_reprice_of_a_malformed_export_never_replaces_a_good_file(tmp_path, good_copy, capsys):
    before = good_copy.read_bytes()
    costs = tmp_path / "c.json"
    CostModel.relative().save(costs)
    model = onnx.load(GATED)  # a valid ONNX file whose metadata the runtime refuses
    props = {p.key: p.value for p in model.metadata_props}
    props["speckv.feature_names"] = '["nope"]'
    del model.metadata_props[:]
    helper.set_model_props(model, props)
    broken = tmp_path / "broken.onnx"
    onnx.save(model, broken)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(GATED.read_bytes()[:3000])
    for src in (broken, truncated):
        assert export_cli.main(["--reprice", str(costs), str(src), str(good_copy)]) == 2
        assert f"cannot re-price: {src}" in capsys.readouterr().err
        assert good_copy.read_bytes() == before


def test_reprice_writes_a_stop_rule_only_under_a_json_name_and_an_export_only_under_onnx(tmp_path, capsys):
    costs = tmp_path / "c.json"
    CostModel.relative().save(costs)
    assert export_cli.main(["--reprice", str(costs), str(STOP), str(tmp_path / "rule.onnx")]) == 2
    assert "writes a stop rule's JSON: name OUTPUT .json" in capsys.readouterr().err
    assert export_cli.main(["--reprice", str(costs), str(GATED), str(tmp_path / "m.json")]) == 2
    assert "writes an ONNX export: name OUTPUT .onnx" in capsys.readouterr().err
    assert not list(tmp_path.glob("rule.*")) and not (tmp_path / "m.json").exists()
    assert export_cli.main(["--reprice", str(costs), str(STOP), str(tmp_path / "rule.json")]) == 0
    assert StopRule.load(tmp_path / "rule.json").cost_model == CostModel.relative()
    assert export_cli.main(["--reprice", str(costs), str(GATED), str(tmp_path / "m.onnx")]) == 0
    assert "checked: loads and decides on 512 spanning feature rows" in capsys.readouterr().out


# -- outliers in small groups ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [1, 2])
def test_an_absurd_time_in_a_small_group_is_left_out_with_a_warning(synthetic, group_size):
    log = synthetic[0]
    # the fp16 gamma-5 group cut down to one or two rows, one of them absurd
    group = log.index[(log["step"] > 0) & (log["compression"] == "fp16") & (log["gamma"] == 5)]
    log = log.drop(group[group_size:])
    clean = CostModel.fit(log, verify="line")
    log = log.copy()
    log.loc[group[0], "verify_ms"] = 1e9
    with pytest.warns(CostModelWarning, match=rf"left out 1 step\(s\).*row {group[0]} "):
        robust = CostModel.fit(log, verify="line")
    np.testing.assert_allclose(robust.verify_base_ms, clean.verify_base_ms, rtol=0.05)
    np.testing.assert_allclose(robust.verify_ms_per_token, clean.verify_ms_per_token, rtol=0.2, atol=1e-3)


def test_small_groups_of_plausible_times_are_kept(synthetic):
    log = synthetic[0]
    # gammas 0 and 7 at NF4 cut down to one row each, at plausible times: kept, no warning
    for g in (0, 7):
        group = log.index[(log["compression"] == "nf4") & (log["gamma"] == g)]
        log = log.drop(group[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CostModelWarning)
        CostModel.fit(log)


def test_an_outlier_in_a_level_of_two_rows_is_judged_against_the_other_levels():
    import pandas as pd

    rows = []
    for comp, scale in (("fp32", 1.0), ("int8", 2.0)):
        for g in range(0, 5):
            for _ in range(4):
                rows.append((comp, g, 1.0 * g * scale, 10.0 * scale * (1 + 0.05 * g)))
    rows += [("nf4", 2, 2.0, 30.0), ("nf4", 3, 3.0, 1e7)]  # NF4: two steps, one absurd
    df = pd.DataFrame(rows, columns=["compression", "gamma", "draft_ms", "verify_ms"])
    df["device"], df["step"] = "cpu", 1
    with pytest.warns(CostModelWarning, match=r"left out 1 step\(s\).*verify 1e\+07 ms"):
        cm = CostModel.fit(df, verify="line")
    assert cm.verify_base_ms[2] < 100


def test_export_train_on_a_log_with_one_absurd_step_reports_sane_figures(synthetic, tmp_path, capsys):
    log = synthetic[0]
    group = log.index[(log["step"] > 0) & (log["compression"] == "int8") & (log["gamma"] == 6)]
    log = log.drop(group[1:]).copy()  # alone in its group
    log.loc[group[0], "verify_ms"] = 1e9
    path = tmp_path / "steps.parquet"
    write_log(log, path)
    with pytest.warns(CostModelWarning):
        assert export_cli.main([str(tmp_path / "m.onnx"), "--train", str(path), "--policy", "table"]) == 0
    out = capsys.readouterr().out
    ratio = float(out.split("x the target alone")[0].rsplit(" ", 1)[1])
    assert 0.5 < ratio < 5


# -- the runtime's contract, offline and at run time ----------------------------------------------------------------


def _graph_with(tmp_path: Path, name: str, out: str, value, src: Path = GATED) -> Path:
    """A copy of the export ``src`` whose output ``out`` is replaced by a constant ``value`` (broadcast per row)."""
    model = onnx.load(src)
    g = model.graph
    producer = next(n for n in g.node if out in n.output)
    renamed = out + "_orig"
    producer.output[list(producer.output).index(out)] = renamed
    for n in g.node:
        for i, x in enumerate(n.input):
            if x == out:
                n.input[i] = renamed
    elem = next(o.type.tensor_type.elem_type for o in g.output if o.name == out)
    arr = np.asarray(value, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem))
    g.initializer.append(onnx.numpy_helper.from_array(arr, out + "_const"))
    # out = renamed * 0 + const (broadcast over rows)
    zero = onnx.numpy_helper.from_array(np.zeros((), arr.dtype), out + "_zero")
    g.initializer.append(zero)
    g.node.extend(
        [
            helper.make_node("Mul", [renamed, out + "_zero"], [out + "_z"]),
            helper.make_node("Add", [out + "_z", out + "_const"], [out]),
        ]
    )
    path = tmp_path / name
    onnx.save(model, path)
    return path


def test_offline_evaluation_refuses_graph_outputs_the_runtime_refuses(tmp_path, capsys):
    from speckv_policy.features import spanning_rows

    rows = spanning_rows("gated", n=30)
    gamma100 = RuntimePolicy(_graph_with(tmp_path, "g100.onnx", "gamma", 100), engine="onnxruntime")
    with pytest.raises(PolicyLoadError, match=r"returned gamma 100 \(row 0\), not one of its candidates"):
        gamma100.decide_batch(rows)
    gate7 = RuntimePolicy(_graph_with(tmp_path, "gate7.onnx", "gate", 7), engine="onnxruntime")
    with pytest.raises(PolicyLoadError, match=r"gate returned 7 \(row 0\), expected 0 or 1"):
        gate7.decide_gated_batch(rows)
    nan = RuntimePolicy(_graph_with(tmp_path, "nan.onnx", "expected_tokens", [np.nan] * 9), engine="onnxruntime")
    nan.reprice(CostModel.relative())
    with pytest.raises(PolicyLoadError, match=r"expected tokens for gamma 0 \(row 0\) is nan"):
        nan.decide_batch(rows)
    neg = RuntimePolicy(_graph_with(tmp_path, "neg.onnx", "expected_tokens", [-1.0] * 9), engine="onnxruntime")
    neg.reprice(CostModel.relative())
    with pytest.raises(PolicyLoadError, match=r"is -1.0, expected a finite number >= 0"):
        neg.decide_batch(rows)
    good = RuntimePolicy(GATED)
    for code in (7, -3, 0.5):
        bad_rows = rows.copy()
        bad_rows[4, 0] = code
        with pytest.raises(ValueError, match=rf"compression_code {code:g} \(row 4\) is not a known compression"):
            good.decide_gated_batch(bad_rows)
        with pytest.raises(ValueError, match="not a known compression code"):
            RuntimePolicy(GATED).decide(bad_rows[4])


def test_speckv_eval_refuses_an_export_whose_graph_returns_a_gamma_outside_its_candidates(tmp_path, synthetic, capsys):
    log = tmp_path / "steps.parquet"
    write_log(synthetic[0], log)
    # an online export whose gamma output is 100 on every row
    model_path = _graph_with(tmp_path, "online-gamma100.onnx", "gamma", 100, src=ONLINE)
    argv = ["--log", str(log), "--policy", str(model_path), "--out", str(tmp_path / "e"), "--no-plots"]
    assert eval_cli.main(argv) == 2
    assert "returned gamma 100" in capsys.readouterr().err


def test_live_costs_with_nan_expected_tokens_warn_once_and_fall_back(tmp_path):
    path = _graph_with(tmp_path, "nan-tokens.onnx", "expected_tokens", [np.nan] * 9, src=ONLINE)
    with pytest.warns(PolicyFallbackWarning, match="expected tokens") as rec:
        rt = RuntimePolicy(path, fallback_gamma=2, engine="onnxruntime")
        rt.set_step_times(np.ones((3, len(rt.candidates))))  # what live costs do each step
        assert rt.decide(np.array([0.5, 1.0, 0, 0.5, 0.5, 3.0, 0.0], np.float32)) == 2
        assert rt.decide(np.array([0.5, 1.0, 1, 0.5, 0.5, 3.0, 0.0], np.float32)) == 2
    assert len(rec) == 1
