"""Experiment: how well do heads trained on the template prompts agree on prompts unlike the templates?

The held-out agreement of record is measured on held-out *template* prompts. A user's traffic is more varied. Here
the target writes its own user turns (Magpie-style: the chat template up to the user turn, sampled), answers them
greedily in fp32, and every head given is scored teacher-forced on those answers and on the template held-out
answers of ``--task-corpus``, with and without its copy gate. No download: the prompts come from the target.

    python benchmarks/eagle3_varied_prompts.py --count 256 --task-corpus CORPUS.pt \
        --head datasets/smollm2/eagle3 --head out/HEAD ... --out out/varied

``--out`` keeps the prompts, the corpus and the features, so a second run with other heads is quick.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speckv_policy.hf.eagle3 import load_eagle3  # noqa: E402
from speckv_policy.hf.eagle3_train import agreement, extract_features  # noqa: E402
from speckv_policy.prompts import Prompt  # noqa: E402
from speckv_policy.smollm2.distill import generate_corpus  # noqa: E402
from speckv_policy.smollm2.models import load_model, load_tokenizer  # noqa: E402


def self_prompts(count: int, seed: int, temperature: float, batch: int = 64, max_tokens: int = 80) -> list[str]:
    """``count`` distinct user turns sampled from the target after its chat template's user header."""
    tok = load_tokenizer("smollm2")
    model = load_model("smollm2", "bf16", "cpu")
    marker = "\x00MARK\x00"
    full = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = full[: full.index(marker)]
    ids = torch.tensor([tok(prefix, add_special_tokens=False)["input_ids"]])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    seen: set[str] = set()
    out: list[str] = []
    rounds = 0
    while len(out) < count and rounds < 4 * (count // batch + 1):
        rounds += 1
        with torch.inference_mode():
            seqs = model.generate(
                ids.repeat(batch, 1),
                attention_mask=torch.ones(batch, ids.shape[1], dtype=torch.long),
                do_sample=True,
                temperature=temperature,
                top_p=None,
                top_k=None,
                max_new_tokens=max_tokens,
                eos_token_id=end,
                pad_token_id=end,
            )
        for row in seqs[:, ids.shape[1] :]:
            stop = (row == end).nonzero()
            if len(stop) == 0:  # ran past max_tokens: not a finished user turn
                continue
            text = tok.decode(row[: int(stop[0])], skip_special_tokens=True).strip()
            if len(text) < 12 or text in seen:
                continue
            seen.add(text)
            out.append(text)
        print(f"self prompts: {len(out)} after {rounds} batches", file=sys.stderr)
    return out[:count]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--task-corpus", required=True, help="a corpus whose held-out greedy answers are the reference")
    ap.add_argument("--head", action="append", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    pfile = out / "prompts.json"
    if not pfile.exists():
        pfile.write_text(json.dumps(self_prompts(args.count, args.seed, args.temperature), indent=1))
    texts = json.loads(pfile.read_text())
    print(f"{len(texts)} prompts ({time.time() - t0:.0f} s)", file=sys.stderr)
    cfile = out / "corpus.pt"
    if not cfile.exists():
        prompts = [Prompt(id=f"self-{k:04d}", task_type="self", split="heldout", text=t) for k, t in enumerate(texts)]
        corpus = generate_corpus(prompts, samples=1, dtype="fp32", batch_size=32, max_new_tokens=160)
        torch.save(corpus, cfile)
    corpus = torch.load(cfile, weights_only=True)
    print(f"answers ({time.time() - t0:.0f} s)", file=sys.stderr)
    task = torch.load(args.task_corpus, weights_only=True)
    held = [i for i in range(len(task["split"])) if task["split"][i] == "heldout" and task["greedy"][i]]
    target = load_model("smollm2", "fp32", "cpu")
    embed = target.get_input_embeddings().weight.detach().float()
    feats: dict[tuple[int, ...], tuple[list, list]] = {}
    rows = []
    for folder in args.head:
        head = load_eagle3(folder)
        layers = tuple(head.eagle.aux_layer_ids)
        if layers not in feats:
            feats[layers] = (
                extract_features(corpus, list(range(len(corpus["ids"]))), target, layers, desc="self features"),
                extract_features(task, held, target, layers, desc="task features"),
            )
        f_self, f_task = feats[layers]
        row = {"head": folder}
        for name, f in (("self", f_self), ("task", f_task)):
            row[name] = agreement(head, embed, f)["overall"]
            row[name + "_without_copy"] = agreement(head, embed, f, copy=False)["overall"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    n_self = sum(len(t) - s for t, s in zip(corpus["ids"], corpus["start"]))
    print(f"self answers: {len(corpus['ids'])} texts, {n_self} answer tokens; task held-out: {len(held)} texts")
    (out / "agreement.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
