"""Run by ``tests/test_vllm.py`` with the vLLM environment's Python (``.venv-vllm``); prints one ``RESULT`` JSON line.

One process, so vLLM is imported and the reference engine built once for every run: vLLM without speculation writes
each prompt's greedy continuation once per ``max_tokens`` the runs ask for (token ids and text); then each run
starts its own engine with speculation (returned as its ``config``), the same prompts, greedy. An ``offline`` run
uses ``vllm.LLM`` and returns the token ids and vLLM's speculation counters; a ``server`` run starts vLLM's
OpenAI-compatible server with the speculative config, sends the prompts to it concurrently, returns the texts and the
counters of ``/metrics``, and stops it. A run that fails returns its error, and the others still run.

The reference and the offline runs keep vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
the same engine, scheduler and proposer, without a fresh process per engine that imports torch and vLLM again (measured
here: the reference and three offline engines in 73 s instead of 226). The server run keeps vLLM's default, its engine core in a process of
its own, as a deployment runs it, so the proposer's settings still cross a process boundary in one run.

Usage: ``python tests/vllm_driver.py TARGET_FOLDER N_PROMPTS RUNS_JSON``, RUNS_JSON a list of ``{"name", "how":
"offline"|"server", "draft", "policy", "max_tokens", "costs", "batch_schedule"}`` (policy: an export, an int gamma or
a named rule; costs, optional: a cost or batch cost file; batch_schedule, optional: vLLM's Dynamic SD table, with the
policy left at 2). A draft that is an EAGLE-3 head folder is drafted by vLLM's own EAGLE-3 proposer at the int policy
or the table's K (``speculative_config``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T0 = time.monotonic()
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"  # read by vLLM when an engine starts, so set before any engine
os.environ[IN_PROCESS] = "0"
ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
# (the offline engine's arguments: speckv_policy.vllm.engine_args less max_num_seqs, so vLLM's default batch)


def _prompts(n: int) -> list:
    from speckv_policy.prompts import read_prompts

    held = [p for p in read_prompts(ROOT / "datasets" / "prompts" / "prompts.jsonl") if p.split == "heldout"]
    return held[:: max(1, len(held) // n)][:n]


def _greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def plain(target: str, texts: list[str], lengths: set[int]) -> tuple[list, dict]:
    """vLLM without speculation: the prompts' token ids, and per length the continuations' ids and texts."""
    from vllm import LLM

    llm = LLM(model=target, **ENGINE)
    out: dict[str, dict] = {}
    prompt_ids: list = []
    for n in sorted(lengths):
        gen = llm.generate(texts, _greedy(n), use_tqdm=False)
        prompt_ids = [list(o.prompt_token_ids) for o in gen]
        out[str(n)] = {"ids": [list(o.outputs[0].token_ids) for o in gen], "text": [o.outputs[0].text for o in gen]}
    del llm
    gc.collect()
    return prompt_ids, out


def offline(target: str, spec: dict, texts: list[str], max_tokens: int) -> dict:
    from vllm import LLM

    llm = LLM(model=target, **ENGINE, speculative_config=spec, disable_log_stats=False)
    gen = llm.generate(texts, _greedy(max_tokens), use_tqdm=False)
    result = {
        "speckv": [list(o.outputs[0].token_ids) for o in gen],
        "spec": {  # vLLM's own speculation counters: what the proposer drafted and the target kept
            m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
        },
    }
    del llm
    gc.collect()
    return result


def server(target: str, spec: dict, texts: list[str], max_tokens: int) -> dict:
    from speckv_policy.vllm import VLLMServer, engine_args

    env = {k: v for k, v in os.environ.items() if k != IN_PROCESS}  # vLLM's default: the engine core apart
    with VLLMServer(engine_args(target, max_num_seqs=len(texts)), speculative=spec, env=env) as srv:
        with ThreadPoolExecutor(len(texts)) as pool:  # concurrent requests: the engine batches them
            replies = list(pool.map(lambda t: srv.complete(t, max_tokens), texts))
        return {"speckv": [r["text"] for r in replies], "spec": srv.metrics(), "startup_s": srv.startup_s}


def main() -> None:
    from transformers import AutoTokenizer

    from speckv_policy.vllm import speculative_config

    target, n, runs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    prompts = _prompts(n)
    tok = AutoTokenizer.from_pretrained(target)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    prompt_ids, reference = plain(target, texts, {int(r["max_tokens"]) for r in runs})
    result: dict[str, object] = {"prompts": [p.id for p in prompts], "prompt_token_ids": prompt_ids}
    result["plain"] = reference
    seconds = {"plain": round(time.monotonic() - T0, 1)}  # the reference with vLLM's import, then each run's own
    done: dict[str, dict] = {}
    for run in runs:
        t0 = time.monotonic()
        policy = str(run["policy"])
        try:
            spec = speculative_config(
                run["draft"],
                int(policy) if policy.isdigit() else policy,
                max_gamma=8,
                draft_loader="speckv_policy.smollm2.models.load_model",
                costs=run.get("costs"),
                batch_schedule=run.get("batch_schedule"),
            )
            done[run["name"]] = {"offline": offline, "server": server}[run["how"]](
                target, spec, texts, int(run["max_tokens"])
            ) | {"config": spec}
        except Exception:  # noqa: BLE001 - reported to the test of this run; the other runs go on
            done[run["name"]] = {"error": traceback.format_exc()[-4000:]}
        seconds[run["name"]] = round(time.monotonic() - t0, 1)
    result["runs"], result["seconds"] = done, seconds
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
