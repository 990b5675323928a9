"""speckv-policy as a transformers ``custom_generate`` recipe (a local folder holding ``custom_generate/generate.py``).

    from speckv_policy.hf.recipe import RECIPE_DIR

    out = target.generate(
        input_ids, assistant_model=draft, custom_generate=RECIPE_DIR, trust_remote_code=True,
        speckv_policy="exported/smollm2-gbt-gated.onnx", speckv_costs="costs.json", max_new_tokens=128,
    )

The recipe is :func:`speckv_policy.hf.attach` around the model's own ``generate``: nothing is copied, so the
recipe decides exactly as ``attach`` does (``tests/test_attach.py`` checks the same output). transformers
executes a local recipe only with ``trust_remote_code=True``; this one is the file next to this module.
"""

from __future__ import annotations

from pathlib import Path

#: The folder to pass as ``generate(..., custom_generate=RECIPE_DIR, trust_remote_code=True)``.
RECIPE_DIR = str(Path(__file__).resolve().parent)

__all__ = ["RECIPE_DIR"]
