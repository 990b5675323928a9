"""The user guide's "your own pair" walk-through, run as written on a tiny random pair (so the guide cannot rot)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speckv_policy.testing import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _walkthrough() -> tuple[list[str], str]:
    text = (ROOT / "docs" / "user_guide.md").read_text()
    block = text.split("<!-- walkthrough:start -->", 1)[1].split("<!-- walkthrough:end -->", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", block, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    commands = [line for line in bash.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return commands, python


def test_the_walkthrough_runs_as_written_on_a_tiny_pair(tmp_path, monkeypatch):
    target, draft = save_tiny_pair(tmp_path / "models")
    rng = np.random.default_rng(0)
    tasks = ["code", "math", "chat", "summarization"]
    prompts = [
        {
            "id": f"p{i}",
            "task_type": tasks[i % 4],
            "split": "heldout" if i % 4 == 3 else "train",
            "input_ids": rng.integers(1, 64, size=int(rng.integers(3, 9))).tolist(),
        }
        for i in range(8)
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    env = {
        **os.environ,
        "TARGET": str(target),
        "DRAFT": str(draft),
        "PROMPTS": str(tmp_path / "prompts.jsonl"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    commands, python = _walkthrough()
    assert [c.split()[0] for c in commands] == ["speckv-profile", "speckv-export", "speckv-calibrate", "speckv-eval"]
    for command in commands:
        command = command.replace("--seconds 90", "--seconds 4")  # the one substitution: a shorter timing budget
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "gated.onnx").is_file() and (tmp_path / "costs.json").is_file()
    assert (tmp_path / "out" / "eval" / "eval.md").is_file()
    monkeypatch.chdir(tmp_path)
    scope = {"TARGET": str(target), "DRAFT": str(draft)}
    exec(compile(python, "docs/user_guide.md", "exec"), scope)  # noqa: S102 - the guide's own code
    assert scope["handle"].summary()["steps"] > 0
