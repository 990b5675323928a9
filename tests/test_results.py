"""The results page: one command renders docs/results.md, docs/results.json and README's table from the races of
record, and what ships is what it renders; the docs stay small and their links resolve."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from .conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _results_module():
    return load_benchmark("results.py")


def test_the_shipped_results_are_what_the_runs_of_record_render(tmp_path):
    results = _results_module()
    assert results.main(["--check"]) == 0  # docs/results.{md,json} and README's table, as shipped
    docs, readme = tmp_path / "docs", tmp_path / "README.md"
    docs.mkdir()
    shutil.copy(ROOT / "README.md", readme)
    text = readme.read_text()
    readme.write_text(text.replace("| fp32 | greedy | 1.", "| fp32 | greedy | 9.", 1))  # a hand edit of the table
    assert results.main(["--check", "--docs", str(docs), "--readme", str(readme)]) == 1
    assert results.main(["--docs", str(docs), "--readme", str(readme)]) == 0
    assert readme.read_text() == text
    assert (docs / "results.md").read_text() == (ROOT / "docs" / "results.md").read_text()


def test_the_recommendation_is_the_best_geometric_mean_over_every_block():
    res = json.loads((ROOT / "docs" / "results.json").read_text())
    blocks = res["blocks"]
    assert {(b["compression"], b["decoding"]) for b in blocks} == {
        (c, d) for c in ("fp32", "int8", "nf4") for d in ("greedy", "sampling")
    }
    best = res["recommended"]["arm"]
    assert res["candidates"][best] == max(res["candidates"].values())
    assert (ROOT / res["recommended"]["file"]).is_file()
    readme = (ROOT / "README.md").read_text().splitlines()
    head = "\n".join(readme[:60])
    assert "bash .ci/setup" in head and "python -m pytest" in head and "| fp32 | greedy |" in head
    assert res["recommended"]["file"] in "\n".join(readme[:80]) and len(readme) <= 150


def test_docs_are_small_and_every_relative_link_resolves():
    docs = ROOT / "docs"
    size = sum(p.stat().st_size for p in docs.rglob("*") if p.is_file())
    assert size <= 3 * 1024 * 1024, f"docs/ holds {size / 1e6:.1f} MB"
    pages = [ROOT / "README.md", *docs.rglob("*.md"), ROOT / "exported" / "README.md", ROOT / "datasets" / "README.md"]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_a_record_naming_a_missing_race_is_a_clear_error():
    results = _results_module()
    record = {"retired_reports_commit": "x", "runs": [{"file": "gone.json", "date": "d", "commit": "c"}]}
    with pytest.raises(SystemExit, match="names gone.json, which is not a file"):
        results.collect(record)


def test_the_vllm_section_says_what_each_arms_drafts_kept_by_vllms_own_counters():
    results = _results_module()
    lines = results.acceptance_lines({"head-fixed-2": {"drafts": 10.0, "draft_tokens": 20.0, "accepted": 13.0}})
    assert "| head-fixed-2 | 10 | 20 | 13 | 0.65 | 1.30 |" in lines
    assert results.acceptance_lines({}) == []  # a race without counters: no table
    shipped = json.loads((ROOT / "docs" / "results.json").read_text())["vllm"]["acceptance"]
    for arm, k in shipped.items():  # a fixed K drafts exactly K every draft; nothing keeps more than it drafted
        assert 0 <= k["accepted"] <= k["draft_tokens"]
        if re.fullmatch(r"(head-)?fixed-\d", arm):
            assert k["draft_tokens"] == int(arm[-1]) * k["drafts"], arm
