"""The layering is enforced, not hoped for: import-linter's contracts (pyproject.toml) pass here and fail on violations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """Run ``lint-imports`` with the repo's contracts on the ``speckv_policy`` found in ``package_parent``."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=package_parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_contracts_are_kept():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("evaluation/offline.py", "from ..cli import quickstart", "Layers"),  # a lower layer imports a higher one
        ("smollm2/models.py", "from ..testing import tiny", "Layers"),  # independent siblings
        ("runtime.py", "import torch", "Runtime"),  # the runtime stays torch-free
        ("training.py", "from .policies._sklearn_compat import Interval", "Private modules"),
        ("smollm2/gguf.py", "from . import models", "No import cycle"),  # gguf <-> models
    ],
)
def test_a_deliberate_violation_breaks_its_contract(tmp_path, module, line, contract):
    shutil.copytree(ROOT / "speckv_policy", tmp_path / "speckv_policy", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "speckv_policy" / module
    text = path.read_text()
    head, rest = text.split("\nfrom __future__ import annotations\n", 1)
    path.write_text(f"{head}\nfrom __future__ import annotations\n{line}  # deliberate violation\n{rest}")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = [ln for ln in proc.stdout.splitlines() if ln.rstrip().endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), proc.stdout
    assert "1 broken" in proc.stdout or "2 broken" in proc.stdout, proc.stdout


def _private_imports(path: Path, package_root: Path) -> list[str]:
    """``from M import _name`` where ``_name`` is a private name (not a submodule) of another module."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    here = path.relative_to(package_root.parent).with_suffix("").parts
    package = here[:-1] if path.name != "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1]
            parts = list(base) + (node.module.split(".") if node.module else [])
        else:
            parts = node.module.split(".") if node.module else []
        if not parts or parts[0] != "speckv_policy":
            continue
        target = package_root.parent.joinpath(*parts)
        for alias in node.names:
            name = alias.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            if (target / f"{name}.py").exists() or (target / name).is_dir():
                continue  # a private module: the private-modules contract governs those
            found.append(f"{path}:{node.lineno}: {name} from {'.'.join(parts)}")
    return found


def test_no_private_name_crosses_a_module_boundary():
    pkg = ROOT / "speckv_policy"
    files = [*pkg.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    bad = [hit for f in files for hit in _private_imports(f, pkg)]
    assert not bad, "private names imported from other modules:\n" + "\n".join(bad)


def test_the_private_name_check_can_fail(tmp_path):
    pkg = tmp_path / "speckv_policy"
    (pkg / "policies").mkdir(parents=True)
    (pkg / "policies" / "base.py").write_text("def _helper():\n    pass\n")
    probe = pkg / "training.py"
    probe.write_text("from .policies.base import _helper\nfrom .policies import base\n")
    assert _private_imports(probe, pkg) == [f"{probe}:1: _helper from speckv_policy.policies.base"]
