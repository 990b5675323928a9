"""Tiny random Llama pairs built in code, for mechanics tests only.

They prove plumbing (losslessness, profiling, quantized loading) without any
download; no figure about speed or quality may come from them. The draft is a
noisy copy of the target so that it agrees with it part of the time and both
the accept and the reject paths of verification run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_pair(
    vocab_size: int = 64,
    hidden_size: int = 64,
    layers: int = 2,
    noise: float = 0.03,
    seed: int = 0,
    init_range: float = 0.3,
    layer_scale: float = 1.0,
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A random target and a draft = target with Gaussian weight noise.

    ``noise`` is relative to each weight tensor's standard deviation; 0 makes
    the draft identical to the target. ``layer_scale`` < 1 shrinks the decoder
    layers' matrices, which makes the target close to a bigram model: predictable
    enough for a tiny EAGLE-3 head to learn (:func:`tiny_eagle3_head`).
    """
    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_range,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * init_range)
        for p in target.model.layers.parameters():
            if p.dim() > 1:
                p.mul_(layer_scale)
        draft = copy.deepcopy(target)
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    target.generation_config.pad_token_id = None
    draft.generation_config.pad_token_id = None
    return target.eval(), draft.eval()


def save_tiny_pair(folder: str | Path, **kwargs: object) -> tuple[Path, Path]:
    """Save :func:`tiny_llama_pair` to ``folder/target`` and ``folder/draft``."""
    folder = Path(folder)
    target, draft = tiny_llama_pair(**kwargs)  # type: ignore[arg-type]
    target.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    return folder / "target", folder / "draft"


def tiny_eagle3_head(
    target: LlamaForCausalLM,
    aux_layer_ids: tuple[int, ...],
    draft_vocab_size: int | None = None,
    texts: int = 48,
    length: int = 24,
    steps: int = 200,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
    precision: str = "fp32",
) -> object:
    """An EAGLE-3 head trained for ``steps`` optimizer steps on ``texts`` sampled continuations of ``target``.

    Enough for the head to agree with a tiny target part of the time, so that
    both the accept and the reject paths run (a random tiny target is hard to
    predict: its greedy continuations of ``prompts`` are added, so a test on
    those prompts sees drafts accepted); ``draft_vocab_size`` below the target's
    exercises the reduced vocabulary. The head is trained where ``target`` is (a GPU check trains it on CUDA), in
    ``precision`` (:func:`~speckv_policy.hf.eagle3_train.train_head`).
    """
    import tempfile

    from ..hf.eagle3 import Eagle3Config
    from ..hf.eagle3_train import choose_vocabulary, extract_features, init_head, train_head

    g = torch.Generator().manual_seed(seed)
    device = next(target.parameters()).device
    vocab = target.config.vocab_size
    corpus: dict[str, list] = {k: [] for k in ("ids", "start", "task_type", "prompt_id", "split")}
    torch.manual_seed(seed)
    given = [torch.tensor([p]) for p in prompts or []]
    for i in range(texts + len(given)):
        prompt = given[i - texts] if i >= texts else torch.randint(1, vocab, (1, 4), generator=g)
        prompt = prompt.to(device)
        with torch.no_grad():
            if (
                i % 2 or i >= texts
            ):  # greedy continuations (tiny random targets fall into cycles a head can learn) and samples
                out = target.generate(prompt, max_new_tokens=length, do_sample=False)
            else:
                out = target.generate(prompt, max_new_tokens=length, do_sample=True, temperature=0.7, top_k=0)
        corpus["ids"].append(out[0].cpu())
        corpus["start"].append(prompt.shape[1])
        corpus["task_type"].append("tiny")
        corpus["prompt_id"].append(f"tiny-{i}")
        corpus["split"].append("train")
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size or vocab, aux_layer_ids, verifier="tiny")
    feats = extract_features(corpus, list(range(len(corpus["ids"]))), target, cfg.aux_layer_ids, progress=False)
    ids, _ = choose_vocabulary(feats, cfg.draft_vocab_size)
    head = init_head(target, cfg, ids).to(device)
    embed = target.get_input_embeddings().weight.detach().float()
    with tempfile.TemporaryDirectory() as tmp:
        train_head(
            head,
            embed,
            feats,
            feats[:8],
            minutes=60.0,
            max_steps=steps,
            checkpoint=f"{tmp}/ck.pt",
            warmup=5,
            lr=3e-3,
            progress=False,
            tokens_per_batch=256,
            eval_minutes=60.0,
            precision=precision,
        )
    return head.eval()
