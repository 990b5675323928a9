"""Run by ``tests/test_vllm.py`` with the vLLM environment's Python: one engine without speculation, one with the speckv
proposer, the same prompts, greedy; prints one JSON line with both outputs and the proposer's counts.

Usage: ``python tests/vllm_driver.py TARGET_FOLDER DRAFT POLICY N_PROMPTS MAX_TOKENS`` (POLICY: an export or an int).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package from this checkout (the vLLM environment does not install it)


def main() -> None:
    from vllm import LLM, SamplingParams

    from speckv_policy.prompts import read_prompts
    from speckv_policy.vllm import speculative_config

    target, draft, policy, n, max_tokens = sys.argv[1:6]
    policy_arg: str | int = int(policy) if policy.isdigit() else policy
    prompts = [p for p in read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl") if p.split == "heldout"]
    prompts = prompts[:: max(1, len(prompts) // int(n))][: int(n)]
    engine = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
    result: dict[str, object] = {"prompts": [p.id for p in prompts]}
    spec = speculative_config(
        draft, policy_arg, max_gamma=8, draft_loader="speckv_policy.smollm2.models.load_model", fallback_gamma=2
    )
    for name, kw in (("plain", {}), ("speckv", {"speculative_config": spec, "disable_log_stats": False})):
        llm = LLM(model=target, **engine, **kw)
        tok = llm.get_tokenizer()
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
        t0 = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        result[f"{name}_s"] = time.perf_counter() - t0
        result[name] = [list(o.outputs[0].token_ids) for o in outs]
        if name == "speckv":  # vLLM's own speculation counters: what the proposer drafted and the target kept
            result["spec"] = {
                m.name: getattr(m, "value", None)
                for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
            }
        del llm
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
