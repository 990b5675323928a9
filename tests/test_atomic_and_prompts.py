"""Core helpers: atomic writes (files and folders) and prompt files (read, write, encode)."""

from __future__ import annotations

import os
import stat

import pytest

from speckv_policy.atomic import atomic_write, atomic_write_dir, atomic_write_text
from speckv_policy.prompts import Prompt, PromptFileError, encode_prompt, read_prompts, write_prompt_file


def test_atomic_write_replaces_only_when_complete(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write_text(path, "good")
    os.chmod(path, 0o640)

    def half(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    assert path.read_text() == "good"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]  # no temporary left behind
    atomic_write_text(path, "better")
    assert path.read_text() == "better"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the replaced file's mode is kept


def test_atomic_write_dir(tmp_path):
    folder = tmp_path / "model"
    atomic_write_dir(folder, lambda tmp: (tmp / "a.bin").write_bytes(b"1"))
    assert (folder / "a.bin").read_bytes() == b"1"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755

    def broken(tmp):
        (tmp / "b.bin").write_bytes(b"2")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        atomic_write_dir(folder, broken)
    assert sorted(p.name for p in folder.iterdir()) == ["a.bin"]
    atomic_write_dir(folder, lambda tmp: (tmp / "c.bin").write_bytes(b"3"))
    assert sorted(p.name for p in folder.iterdir()) == ["c.bin"]  # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    # replace=False: a folder already there (another process finished first) is kept, the new one dropped
    assert not atomic_write_dir(folder, lambda tmp: (tmp / "d.bin").write_bytes(b"4"), replace=False)
    assert sorted(p.name for p in folder.iterdir()) == ["c.bin"]
    assert atomic_write_dir(tmp_path / "new", lambda tmp: (tmp / "e.bin").write_bytes(b"5"), replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "new"]  # no temporary left behind either way


def test_prompt_file_round_trip(tmp_path):
    records = [
        {"id": "a", "task_type": "code", "split": "train", "prompt": "Write a loop."},
        {"id": "b", "task_type": "chat", "split": "heldout", "input_ids": [3, 1, 4]},
    ]
    path = tmp_path / "p.jsonl"
    write_prompt_file(records, path)
    prompts = read_prompts(path)
    assert prompts == [
        Prompt("a", "code", "train", text="Write a loop."),
        Prompt("b", "chat", "heldout", input_ids=(3, 1, 4)),
    ]
    path.write_text(path.read_text() + '{"id": "a", "task_type": "code", "prompt": "again"}\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl, line 3: duplicate id 'a'"):
        read_prompts(path)


class _ChatTokenizer:
    """A tokenizer stand-in with a chat template: one id per character, like a real one returns a dict."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=False):
        assert add_generation_prompt and messages == [{"role": "user", "content": "hi"}]
        return {"input_ids": [1] + [ord(c) for c in "hi"] + [2], "attention_mask": [1, 1, 1, 1]}


class _PlainTokenizer:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [[ord(c) for c in text]]}


def test_encode_prompt():
    assert encode_prompt(Prompt("x", "code", "train", input_ids=(5, 6)), None) == [5, 6]
    text = Prompt("y", "chat", "train", text="hi")
    assert encode_prompt(text, _ChatTokenizer()) == [1, 104, 105, 2]
    assert encode_prompt(text, _PlainTokenizer()) == [104, 105]
    with pytest.raises(ValueError, match="prompt 'y' is text but the target has no tokenizer"):
        encode_prompt(text, None)
