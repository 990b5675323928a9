"""Hugging Face integration: the generation hook, the step profiler, loading local models.

    from speckv_policy.hf import attach
    with attach(target, "policy.onnx") as handle:
        target.generate(input_ids, assistant_model=draft, max_new_tokens=128)

Importing this package checks the installed transformers against the range the
hook was tested on (:mod:`speckv_policy.hf._compat`).
"""

from ..settings import HookSettings
from .candidates import Eagle3CandidateGenerator, SpeckvCandidateGenerator
from .eagle3 import Eagle3Config, Eagle3Head, load_eagle3
from .fast_draft import LlamaDecodeStep, decode_step_blocker
from .hook import MODES, SpeckvHandle, StepStats, attach, detect_compression
from .live_costs import LiveCosts
from .models import quiet_int8_cast_log
from .onednn import use_onednn_linear

__all__ = [
    "Eagle3CandidateGenerator",
    "Eagle3Config",
    "Eagle3Head",
    "load_eagle3",
    "attach",
    "HookSettings",
    "detect_compression",
    "LiveCosts",
    "SpeckvHandle",
    "SpeckvCandidateGenerator",
    "StepStats",
    "MODES",
    "use_onednn_linear",
    "LlamaDecodeStep",
    "decode_step_blocker",
    "quiet_int8_cast_log",
]
