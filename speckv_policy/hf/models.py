"""Load a local Hugging Face causal LM at a compression level, offline.

``load_model(folder, "nf4")`` loads any local model folder in full precision
(fp32, bf16, fp16) or quantized by bitsandbytes (INT8, NF4) on CPU or CUDA.
Nothing is downloaded. A :class:`ModelSource` bundles the three functions the
profiler and the race need, so a testbed can add its own model names (see
:data:`speckv_policy.smollm2.models.SMOLLM2_MODELS`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..machine import describe_host
from .eagle3 import is_eagle3_dir, load_eagle3

__all__ = [
    "COMPRESSIONS_LOADABLE",
    "DRAFT_PRECISIONS",
    "ModelSource",
    "LOCAL_MODELS",
    "cpu_has_native_bf16",
    "draft_precision",
    "load_model",
    "load_tokenizer",
    "model_id",
    "quiet_int8_cast_log",
]

#: Compression names :func:`load_model` understands.
COMPRESSIONS_LOADABLE = ("fp32", "bf16", "fp16", "int8", "nf4")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def full_precision_dtype(compression: str) -> torch.dtype:
    """The torch dtype of a full-precision compression name (``fp32``, ``bf16``, ``fp16``).

    Raises
    ------
    ValueError
        For a quantized or unknown name.
    """
    if compression not in _DTYPES:
        raise ValueError(f"{compression!r} is not a full-precision dtype; expected fp32, bf16 or fp16")
    return _DTYPES[compression]


#: What ``--draft-precision`` accepts: a full-precision dtype, or ``auto`` (:func:`draft_precision`).
DRAFT_PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), as torch reports it."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # a torch without the probe or a CPU it cannot query
            continue
    return False


def device_machine(device: str) -> str:
    """:func:`speckv_policy.machine.describe_host` for a torch device: the host, and the GPU's name on CUDA.

    Parameters
    ----------
    device : str
        The torch device a measurement ran on (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    """
    gpu = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else ""
    return describe_host(gpu)


def draft_precision(device: str, requested: str = "auto") -> str:
    """The dtype name the draft runs in: ``requested``, or for ``auto`` the cheapest safe one.

    ``auto`` is fp16 on CUDA; on CPU it is bf16 where the CPU multiplies bf16
    natively (half the bytes per draft token: a small draft's token is bound by
    reading its weights) and fp32 elsewhere (bf16 is emulated there, and slower).

    Raises
    ------
    ValueError
        For a name outside :data:`DRAFT_PRECISIONS`.
    """
    if requested not in DRAFT_PRECISIONS:
        raise ValueError(f"draft precision {requested!r}: expected one of {', '.join(DRAFT_PRECISIONS)}")
    if requested != "auto":
        return requested
    if not str(device).startswith("cpu"):
        return "fp16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def _check_folder(path: str | os.PathLike[str]) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path}")
    return str(path)


def load_tokenizer(path: str | os.PathLike[str], **from_pretrained: Any) -> Any:
    """Tokenizer of a local model folder, or None when the folder has none (tiny test models)."""
    from transformers import AutoTokenizer

    if not from_pretrained:
        _check_folder(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), **from_pretrained)
    except (OSError, ValueError):
        return None


#: The logger bitsandbytes' INT8 matmul writes to, and the start of the record it writes on every call on CPU.
_BNB_MATMUL_LOGGER = "bitsandbytes.autograd._functions"
_INT8_CAST_RECORD = "MatMul8bitLt: inputs will be cast from"


class _DropInt8CastRecord(logging.Filter):
    """Drops bitsandbytes' per-call "inputs will be cast ... to float16" record; passes every other one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_INT8_CAST_RECORD))


def quiet_int8_cast_log() -> bool:
    """Stop bitsandbytes logging a warning on every INT8 matmul whose input is not fp16 (every CPU call).

    bitsandbytes' ``MatMul8bitLt`` casts a float32 input to float16 before it
    quantizes it and says so with ``logger.warning`` on every call: on CPU that
    is one record per INT8 layer per forward (210 for SmolLM2-135M), which
    written to a file cost 2.7-3.5 ms per forward, ~8% of an INT8 target step,
    on the 2-core machine measured here (``benchmarks/int8_log_cost.py`` at commit 730b4b6), and
    bury everything else on stderr. This adds a filter for that one record
    to bitsandbytes' logger (nothing else is dropped; the cast itself is
    unchanged). :func:`load_model` calls it when it loads an INT8 model; call
    it yourself for an INT8 model you load otherwise.

    Returns
    -------
    bool
        Whether the filter was added now (``False``: it was already there).
    """
    logger = logging.getLogger(_BNB_MATMUL_LOGGER)
    if any(isinstance(f, _DropInt8CastRecord) for f in logger.filters):
        return False
    logger.addFilter(_DropInt8CastRecord())
    return True


def load_model(
    path: str | os.PathLike[str],
    compression: str = "fp32",
    device: str = "cpu",
    llm_int8_threshold: float | None = None,
    **from_pretrained: Any,
) -> Any:
    """Load a causal LM from a local folder at ``compression`` (``fp32``, ``bf16``, ``fp16``, ``int8``, ``nf4``).

    INT8 and NF4 go through bitsandbytes (CPU or CUDA); full precision casts
    to the named dtype. ``llm_int8_threshold`` overrides bitsandbytes' outlier
    threshold (6.0); a huge value switches outlier decomposition off, which
    makes INT8 verification batch-invariant (see docs/reference/hook.md). Loading an
    INT8 model silences bitsandbytes' per-call cast warning
    (:func:`quiet_int8_cast_log`). Extra keywords go to ``from_pretrained``
    (e.g. ``gguf_file``).

    Raises
    ------
    FileNotFoundError
        If ``path`` is not a folder.
    ValueError
        For an unknown compression name.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not from_pretrained.get("gguf_file"):
        _check_folder(path)
    if is_eagle3_dir(path):  # a draft head in the speculators eagle3 format (it drafts only with its target)
        if compression not in _DTYPES:
            raise ValueError(f"{path}: an EAGLE-3 head runs in full precision (fp32, bf16 or fp16), not {compression}")
        return load_eagle3(path, device=device, dtype=_DTYPES[compression])
    if compression in _DTYPES:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES[compression], **from_pretrained)
        model = model.to(device)
    elif compression in ("int8", "nf4"):
        compute = torch.float16 if device.startswith("cuda") else torch.float32
        int8_kw = {} if llm_int8_threshold is None else {"llm_int8_threshold": llm_int8_threshold}
        q = (
            BitsAndBytesConfig(load_in_8bit=True, **int8_kw)
            if compression == "int8"
            else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                str(path), quantization_config=q, device_map=device, dtype=compute, **from_pretrained
            )
        if compression == "int8":
            quiet_int8_cast_log()
    else:
        raise ValueError(f"unknown compression {compression!r}; expected {', '.join(COMPRESSIONS_LOADABLE)}")
    return model.eval()


def model_id(path: str | os.PathLike[str]) -> str:
    """A short identifier for logs: the folder's name (``eagle3:`` before an EAGLE-3 head's)."""
    return ("eagle3:" if is_eagle3_dir(path) else "") + Path(path).name


@dataclass(frozen=True)
class ModelSource:
    """How model specs (folder paths or names) become models, tokenizers and log identifiers.

    Attributes
    ----------
    load_model : callable
        ``load_model(spec, compression, device) -> model``.
    load_tokenizer : callable
        ``load_tokenizer(spec) -> tokenizer or None``.
    model_id : callable
        ``model_id(spec) -> str`` written into step logs.
    """

    load_model: Callable[..., Any]
    load_tokenizer: Callable[[str], Any]
    model_id: Callable[[str], str]


#: Local Hugging Face model folders only.
LOCAL_MODELS = ModelSource(load_model=load_model, load_tokenizer=load_tokenizer, model_id=model_id)
