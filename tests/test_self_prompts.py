"""Training prompts the target writes itself: finished, distinct, seeded, never a held-out prompt."""

from __future__ import annotations

import json

import pytest

from speckv_policy.cli.distill import main as distill_main
from speckv_policy.prompts import read_prompts
from speckv_policy.smollm2.self_prompts import finished_turns, self_prompts, user_turn_prefix

END = 2


def test_finished_turns_keeps_turns_that_closed_and_say_enough():
    rows = [
        [5, 6, 7, END, 9, 9],  # closed: kept up to the end token
        [5, 6, 7, 8, 9, 9],  # never closed: a cut request, dropped
        [5, END, 7],  # closed but too short, dropped
        [END],  # empty, dropped
    ]

    def decode(ids):
        return " ".join(f"word{i}" for i in ids)

    assert finished_turns(rows, END, decode) == ["word5 word6 word7"]
    assert finished_turns(rows, END, decode, min_chars=1) == ["word5 word6 word7", "word5"]


def test_user_turn_prefix_is_the_template_up_to_the_message():
    from speckv_policy.smollm2.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert full.startswith(prefix + "Hello there") and prefix.endswith("user\n") and "system" in prefix

    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        user_turn_prefix(Plain())


def test_the_target_writes_seeded_distinct_requests_and_the_cli_skips_heldout_and_excluded_ones(tmp_path):
    kw = {"seed": 1, "batch_size": 8, "max_new_tokens": 48, "progress": False}
    first = self_prompts(6, **kw)
    assert first == self_prompts(6, **kw)  # seeded
    texts = [r["prompt"] for r in first]
    assert len(set(texts)) == 6 and all(len(t) >= 12 and "<|im" not in t for t in texts)
    assert [r["id"] for r in first] == [f"gen-self-{k:05d}" for k in range(6)]
    assert {(r["task_type"], r["split"]) for r in first} == {("other", "train")}
    # through the CLI with the first request held out: the same draw, minus that request
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "h-0", "task_type": "chat", "split": "heldout", "prompt": texts[0]}) + "\n")
    out = tmp_path / "self.jsonl"
    args = ["self-prompts", "--out", str(out), "--count", "4", "--seed", "1", "--batch-size", "8"]
    assert distill_main([*args, "--max-new-tokens", "48", "--heldout", str(held)]) == 0
    again = read_prompts(out)
    assert [p.text for p in again] == texts[1:5]
    assert all(p.split == "train" and p.id.startswith("gen-") for p in again)
    # an earlier draw's file excludes its prompts whatever their split: the same draw minus the first two
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(json.dumps({"id": "gen-self-00000", "task_type": "other", "split": "train", "prompt": texts[1]}))
    assert distill_main([*args, "--max-new-tokens", "48", "--heldout", str(held), "--exclude", str(earlier)]) == 0
    assert [p.text for p in read_prompts(out)] == texts[2:6]


def test_too_few_finished_requests_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "self.jsonl"
    args = ["self-prompts", "--out", str(out), "--count", "3", "--batch-size", "2", "--max-new-tokens", "1"]
    assert distill_main(args) == 2  # one token closes no request
    err = capsys.readouterr().err
    assert "wrote 0 distinct finished requests" in err and "--max-new-tokens" in err
    assert not out.exists()


def test_a_bad_heldout_file_is_named_before_the_target_loads_and_writes_nothing(tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"id": "h-0", "task_type": "chat", "split": "heldout"}) + "\n")  # no prompt text
    out = tmp_path / "self.jsonl"
    assert distill_main(["self-prompts", "--out", str(out), "--count", "2", "--heldout", str(held)]) == 2
    err = capsys.readouterr().err
    assert f"{held}, line 1" in err and "'prompt'" in err
    assert distill_main(["self-prompts", "--out", str(out), "--heldout", str(tmp_path / "none.jsonl")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"id": "h-0", "task_type": "chat", "split": "heldout", "prompt": "Hi there, you."}))
    args = ["self-prompts", "--out", str(out), "--count", "2", "--batch-size", "2", "--max-new-tokens", "1"]
    assert distill_main([*args, "--heldout", str(good), "--exclude", f"{good},{tmp_path / 'gone.jsonl'}"]) == 2
    assert f"prompt file not found: {tmp_path / 'gone.jsonl'}" in capsys.readouterr().err
    assert not out.exists()
