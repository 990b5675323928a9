"""The file names of an EAGLE-3 head folder (the ``speculators`` format) and how to recognise one without torch.

The Hugging Face integration loads such a folder (:func:`speckv_policy.hf.eagle3.load_eagle3`); the vLLM integration
hands it to vLLM's own EAGLE-3 proposer. Both decide what a folder is with :func:`is_eagle3_dir`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["EAGLE3_CONFIG", "EAGLE3_WEIGHTS", "is_eagle3_dir"]

#: the speculators config file (``speculators_model_type: "eagle3"``)
EAGLE3_CONFIG = "config.json"
#: the head's weights
EAGLE3_WEIGHTS = "model.safetensors"


def is_eagle3_dir(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a speculators ``eagle3`` config.

    Parameters
    ----------
    path : str or Path
        A folder (anything else, or a folder without a readable ``config.json``, is not a head).

    Returns
    -------
    bool
        True when ``path/config.json`` is a JSON object with ``"speculators_model_type": "eagle3"``.
    """
    p = Path(path) / EAGLE3_CONFIG
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("speculators_model_type") == "eagle3"
    except (OSError, ValueError, AttributeError):
        return False
