"""Run by ``tests/test_vllm.py`` with the vLLM environment's Python (``.venv-vllm``); prints one ``RESULT`` JSON line.

``offline``: one ``vllm.LLM`` without speculation, one with the speckv proposer, the same prompts, greedy: both
outputs and vLLM's speculation counters. ``server``: the reference without speculation offline, then vLLM's
OpenAI-compatible server started with the speckv proposer, the prompts sent to it concurrently, its counters read
from ``/metrics``, the server stopped.

Usage: ``python tests/vllm_driver.py offline|server TARGET_FOLDER DRAFT POLICY N_PROMPTS MAX_TOKENS`` (POLICY: an
export or an int gamma).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}


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
    result["spec"] = {  # vLLM's own speculation counters: what the proposer drafted and the target kept
        m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
    }
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(target: str, spec: dict, prompts, max_tokens: int) -> dict:
    from transformers import AutoTokenizer

    texts = _texts(AutoTokenizer.from_pretrained(target), prompts)
    result: dict[str, object] = {"prompts": [p.id for p in prompts]}
    result["plain"] = [o.text for o in _plain(target, texts, max_tokens)]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
    cmd += ["--kv-cache-memory-bytes", str(1 << 30), "--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 600:
                raise RuntimeError("the server did not come up in 600 s")
            time.sleep(1)
        result["startup_s"] = time.monotonic() - t0

        def complete(text: str) -> str:
            body = {"model": target, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0}
            req = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())["choices"][0]["text"]

        with ThreadPoolExecutor(len(texts)) as pool:  # concurrent requests: the engine batches them
            result["speckv"] = list(pool.map(complete, texts))
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        result["spec"] = {
            line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num") and "_total" in line
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


def main() -> None:
    from speckv_policy.vllm import speculative_config

    how, target, draft, policy, n, max_tokens = sys.argv[1:7]
    spec = speculative_config(
        draft,
        int(policy) if policy.isdigit() else policy,
        max_gamma=8,
        draft_loader="speckv_policy.smollm2.models.load_model",
    )
    run = {"offline": offline, "server": server}[how]
    print("RESULT " + json.dumps(run(target, spec, _prompts(int(n)), int(max_tokens))), flush=True)


if __name__ == "__main__":
    main()
