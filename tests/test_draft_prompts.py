"""Template prompts for draft distillation: distinct, seeded, never a held-out prompt."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from speckv_policy.prompts import read_prompts
from speckv_policy.smollm2.distill_prompts import template_prompts

ROOT = Path(__file__).resolve().parents[1]


def test_template_prompts_are_distinct_seeded_and_exclude():
    a = template_prompts(50, seed=3)
    assert a == template_prompts(50, seed=3)
    assert a != template_prompts(50, seed=4)
    for task, texts in a.items():
        assert len(texts) == len(set(texts)) == 50, task
    banned = set(a["code"][:10])
    b = template_prompts(50, seed=3, exclude=banned)
    assert not banned & set(b["code"])


def test_template_prompts_say_when_they_run_out():
    with pytest.raises(ValueError, match="distinct .* prompts can be made"):
        template_prompts(100_000)


def test_shipped_distill_prompts_are_training_only_and_unseen():
    gen = read_prompts(ROOT / "datasets" / "prompts" / "distill.jsonl")
    task = read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl")
    assert all(p.split == "train" and p.id.startswith("gen-") for p in gen)
    held = {p.text for p in task if p.split == "heldout"}
    assert not {p.text for p in gen} & held  # never a held-out prompt
    # templates may rebuild a short hand-written training prompt by chance: one does (code-033), documented
    same = {p.text for p in gen} & {p.text for p in task}
    assert len(same) <= 1
    counts = Counter(p.task_type for p in gen)
    assert set(counts) == {"code", "math", "chat", "summarization"} and min(counts.values()) >= 200
    summ = [p for p in gen if p.task_type == "summarization"]
    assert all("\n\n" in p.text and len(p.text.split("\n\n", 1)[1].split()) >= 25 for p in summ)
