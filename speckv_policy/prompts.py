"""Prompt files: reading, validation and encoding to token ids.

A prompt file is JSON lines, one prompt per line::

    {"id": "code-001", "task_type": "code", "split": "train", "prompt": "Write ..."}
    {"id": "raw-7", "task_type": "chat", "split": "heldout", "input_ids": [1, 2, 3]}

The profiler, the draft distillation and the end-to-end race all read prompts
through this module and encode them with :func:`encode_prompt`, so a prompt
means the same token ids everywhere. No torch or transformers import here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .schema import TASK_TYPES

PROMPT_FIELDS = ("id", "task_type")
SPLITS = ("train", "heldout")


class PromptFileError(ValueError):
    """A prompt file line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: text (chat-formatted with the tokenizer) or token ids."""

    id: str
    task_type: str
    split: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None


def read_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSON-lines prompt file.

    Each line: ``{"id": ..., "task_type": ..., "split": "train"|"heldout",
    "prompt": "text"}`` or ``"input_ids": [ints]`` instead of ``prompt``.
    Blank lines and lines starting with ``#`` are skipped.

    Raises
    ------
    PromptFileError
        Naming the file, the line number and what was expected.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if not path.is_file():
        raise PromptFileError(f"{path}: not a prompt file (a folder or a device); give a JSON-lines file")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue

        def bad(msg: str, no: int = no) -> PromptFileError:
            return PromptFileError(f"{path}, line {no}: {msg}")

        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad(f"not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise bad("expected a JSON object")
        for f in PROMPT_FIELDS:
            if not isinstance(rec.get(f), str) or not rec[f]:
                raise bad(f"field '{f}' must be a non-empty string")
        if rec["task_type"] not in TASK_TYPES:
            raise bad(f"task_type must be one of {', '.join(TASK_TYPES)}, got {rec['task_type']!r}")
        split = rec.get("split", "train")
        if split not in SPLITS:
            raise bad(f"split must be 'train' or 'heldout', got {split!r}")
        if rec["id"] in seen:
            raise bad(f"duplicate id {rec['id']!r}")
        seen.add(rec["id"])
        text, ids = rec.get("prompt"), rec.get("input_ids")
        if (text is None) == (ids is None):
            raise bad("give exactly one of 'prompt' (text) or 'input_ids' (list of ints)")
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise bad("'prompt' must be a non-empty string")
        if ids is not None and (
            not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids)
        ):
            raise bad("'input_ids' must be a non-empty list of non-negative ints")
        prompts.append(Prompt(rec["id"], rec["task_type"], split, text, tuple(ids) if ids else None))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def encode_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    """Token ids of ``prompt``: its ``input_ids``, or its text through the tokenizer.

    Text goes through the tokenizer's chat template as one user turn with the
    generation prompt appended when the tokenizer has a template, else through
    the plain tokenizer.

    Raises
    ------
    ValueError
        If the prompt is text and ``tokenizer`` is None.
    """
    if prompt.input_ids is not None:
        return list(prompt.input_ids)
    if tokenizer is None:
        raise ValueError(f"prompt {prompt.id!r} is text but the target has no tokenizer; give input_ids")
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True)
    else:
        enc = tokenizer(prompt.text)
    ids = enc["input_ids"] if isinstance(enc, Mapping) or hasattr(enc, "keys") else enc
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        ids = ids[0]
    return [int(i) for i in ids]


def write_prompt_file(records: Iterable[Mapping[str, Any]], path: str | Path) -> None:
    """Write prompt records as JSON lines, atomically (read them back with :func:`read_prompts`)."""
    atomic_write_text(path, "".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in records))
