"""Run by ``tests/test_vllm.py`` with the vLLM environment's Python (``.venv-vllm``); prints one ``RESULT`` JSON line.

``offline``: one ``vllm.LLM`` without speculation, one with the speckv proposer, the same prompts, greedy: both
outputs and vLLM's speculation counters. ``server``: the reference without speculation offline, then vLLM's
OpenAI-compatible server started with the speckv proposer, the prompts sent to it concurrently, its counters read
from ``/metrics``, the server stopped.

Usage: ``python tests/vllm_driver.py offline|server TARGET_FOLDER DRAFT POLICY N_PROMPTS MAX_TOKENS [COSTS]``
(POLICY: an export, an int gamma or a named rule; COSTS: a cost or batch cost file). A DRAFT that is an EAGLE-3 head
folder is drafted by vLLM's own EAGLE-3 proposer at the int POLICY (``speculative_config``).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
# (the offline engine's arguments: speckv_policy.vllm.engine_args less max_num_seqs, so vLLM's default batch)


def _prompts(n: int) -> list:
    from speckv_policy.prompts import read_prompts

    held = [p for p in read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl") if p.split == "heldout"]
    return held[:: max(1, len(held) // n)][:n]


def _texts(tok, prompts) -> list[str]:
    return [
        tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def _plain(target: str, texts: list[str], max_tokens: int) -> list:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, **ENGINE)
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    result = [o.outputs[0] for o in outs]
    del llm
    return result


def offline(target: str, spec: dict, prompts, max_tokens: int) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    texts = _texts(AutoTokenizer.from_pretrained(target), prompts)
    result: dict[str, object] = {"prompts": [p.id for p in prompts]}
    result["plain"] = [list(o.token_ids) for o in _plain(target, texts, max_tokens)]
    llm = LLM(model=target, **ENGINE, speculative_config=spec, disable_log_stats=False)
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    result["speckv"] = [list(o.outputs[0].token_ids) for o in outs]
    result["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outs]
    result["spec"] = {  # vLLM's own speculation counters: what the proposer drafted and the target kept
        m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
    }
    return result


def server(target: str, spec: dict, prompts, max_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from speckv_policy.vllm import VLLMServer, engine_args

    texts = _texts(AutoTokenizer.from_pretrained(target), prompts)
    result: dict[str, object] = {"prompts": [p.id for p in prompts]}
    result["plain"] = [o.text for o in _plain(target, texts, max_tokens)]
    with VLLMServer(engine_args(target, max_num_seqs=len(texts)), speculative=spec) as srv:
        result["startup_s"] = srv.startup_s
        with ThreadPoolExecutor(len(texts)) as pool:  # concurrent requests: the engine batches them
            result["speckv"] = [r["text"] for r in pool.map(lambda t: srv.complete(t, max_tokens), texts)]
        result["spec"] = srv.metrics()
    return result


def main() -> None:
    from speckv_policy.vllm import speculative_config

    how, target, draft, policy, n, max_tokens = sys.argv[1:7]
    costs = sys.argv[7] if len(sys.argv) > 7 else None
    spec = speculative_config(
        draft,
        int(policy) if policy.isdigit() else policy,
        max_gamma=8,
        draft_loader="speckv_policy.smollm2.models.load_model",
        costs=costs,
    )
    run = {"offline": offline, "server": server}[how]
    print("RESULT " + json.dumps(run(target, spec, _prompts(int(n)), int(max_tokens))), flush=True)


if __name__ == "__main__":
    main()
