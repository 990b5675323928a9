"""speckv-policy: learned, cost-aware speculation-length (gamma) policies.

Layers, each importing only the ones below it (import-linter checks this):

* core (this folder): ``schema``, ``features``, ``objective``, ``logs``,
  ``prompts``, ``atomic``, ``policies``, ``training``, ``export``, ``runtime``;
* :mod:`speckv_policy.evaluation`: the offline evaluator, its report, SYNTHETIC
  logs, the end-to-end race's logic;
* :mod:`speckv_policy.hf`: the Hugging Face hook, the profiler, model loading,
  the race runner;
* :mod:`speckv_policy.smollm2` (the SmolLM2 testbed) and
  :mod:`speckv_policy.testing` (tiny model pairs);
* :mod:`speckv_policy.cli`: one module per console script.

The package root stays light: importing :mod:`speckv_policy` or
:mod:`speckv_policy.runtime` pulls in neither scikit-learn nor torch. The
names below are loaded lazily on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "GammaPolicy": "speckv_policy.policies.base",
    "MLPPolicy": "speckv_policy.policies.mlp",
    "GBTPolicy": "speckv_policy.policies.gbt",
    "TablePolicy": "speckv_policy.policies.table",
    "FixedGammaPolicy": "speckv_policy.policies.baselines",
    "PaperMLP16Policy": "speckv_policy.policies.baselines",
    "CostModel": "speckv_policy.objective",
    "RuntimePolicy": "speckv_policy.runtime",
    "read_log": "speckv_policy.logs",
    "write_log": "speckv_policy.logs",
    "validate_log": "speckv_policy.logs",
    "features_from_log": "speckv_policy.features",
    "export_onnx": "speckv_policy.export",
    "evaluate_log": "speckv_policy.evaluation",
    "attach": "speckv_policy.hf",
    "HookSettings": "speckv_policy.settings",
    "StopRule": "speckv_policy.stop",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'speckv_policy' has no attribute {name!r}")
