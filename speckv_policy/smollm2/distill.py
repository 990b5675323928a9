"""How the distilled draft for SmolLM2-135M-Instruct is built: corpus, training, copy gate, agreement.

Design (measured feasible in the issue): target layers 0 and 1 copied, the
input embedding shared with the target and frozen, a trainable head over the
``head_size`` tokens the target generates most, initialised from their
embedding rows. Loss: KL from the target's next-token distribution (over the
head tokens) + 0.5 x cross-entropy on the target's top token. The target's
distribution is recorded while it generates the training text (top-k per
position), so training never runs the target again.

Shipped weights hold only what differs from the target (the two layers, the
final norm, the head and its token ids) in fp16; :func:`load_draft` rebuilds
the draft from them and the target's embedding, with the context-copy gate
from ``draft.json`` (:mod:`speckv_policy.smollm2.context_copy`).

Commands (see ``docs/reference/draft.md``)::

    speckv-distill corpus  --prompts datasets/prompts/prompts.jsonl --out corpus.pt
    speckv-distill train   --corpus corpus.pt --out datasets/smollm2/draft --fit-prefix gen-
    speckv-distill copy    --corpus corpus.pt --draft datasets/smollm2/draft   # the context-copy gate
    speckv-distill eval    --corpus corpus.pt --draft datasets/smollm2/draft
    speckv-distill cost    --draft datasets/smollm2/draft
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import numpy as np
import torch

from .draft_model import build_draft, head_slots
from .gguf import target_state

TOPK = 32


# ----------------------------------------------------------------------------- corpus
def generate_corpus(
    prompts: list[Any],
    *,
    samples: int = 4,
    max_new_tokens: int = 160,
    batch_size: int = 16,
    temperature: float = 0.8,
    seed: int = 0,
    dtype: str = "bf16",
    greedy_answers: bool = True,
    device: str = "cpu",
    progress: bool = True,
) -> dict:
    """Let the target answer every prompt; keep tokens and its top-k distribution.

    Each prompt gets one greedy answer and ``samples - 1`` sampled ones. Returns
    a dict of lists: ``ids`` (prompt + answer), ``start`` (first answer
    position), ``topk_ids`` / ``topk_logp`` (per answer position, the target's
    top-k next-token log-probabilities), ``prompt_id``, ``task_type``, ``split``.
    The target answers on ``device``; what is kept is on the CPU.
    """
    from tqdm.auto import tqdm

    from .models import load_model, load_tokenizer

    tok = load_tokenizer("smollm2")
    model = load_model("smollm2", dtype, device)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    jobs = [(p, s) for p in prompts for s in range(samples if p.split == "train" else 1)]
    if not greedy_answers:  # sampled answers only (a second corpus for more varied data)
        jobs = [(p, s + 1) for p in prompts if p.split == "train" for s in range(samples)]
    out: dict[str, list] = {
        k: [] for k in ("ids", "start", "topk_ids", "topk_logp", "prompt_id", "task_type", "split", "greedy")
    }
    torch.manual_seed(seed)
    recorder = _TopKRecorder(TOPK)
    handle = model.get_output_embeddings().register_forward_hook(recorder)
    bar = tqdm(total=len(jobs), desc="corpus", disable=not progress, file=sys.stderr)
    try:
        for greedy in (True, False):
            todo = [(p, s) for p, s in jobs if (s == 0) == greedy]
            todo.sort(key=lambda job: len(job[0].text or job[0].input_ids or ""))  # similar lengths: little padding
            for i in range(0, len(todo), batch_size):
                chunk = todo[i : i + batch_size]
                _answer_batch(model, tok, chunk, pad, recorder, out, greedy, max_new_tokens, temperature, device)
                bar.update(len(chunk))
    finally:
        handle.remove()
        bar.close()
    return out


class _TopKRecorder:
    """Forward hook on the target's output layer: the top-k next-token log-probabilities of each step.

    Every forward pass of ``generate`` produces the logits of one new token per row (the prompt's
    pass, then one per decoded token); only the last position's top-k is kept, so memory does not
    grow with the vocabulary (holding every step's full logits took 11.5 GB for 64 answers of 160 tokens).
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[torch.Tensor] = []
        self.logp: list[torch.Tensor] = []

    def __call__(self, module: Any, inputs: Any, logits: torch.Tensor) -> None:
        top = torch.log_softmax(logits[:, -1].float(), -1).topk(self.k, dim=-1)
        self.ids.append(top.indices)
        self.logp.append(top.values)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, steps, k]`` token ids and log-probabilities recorded since the last call (on the CPU)."""
        ids, logp = torch.stack(self.ids, 1).cpu(), torch.stack(self.logp, 1).cpu()
        self.ids, self.logp = [], []
        return ids, logp


def _answer_batch(
    model: Any,
    tok: Any,
    chunk: list[tuple[Any, int]],
    pad: int,
    recorder: _TopKRecorder,
    out: dict[str, list],
    greedy: bool,
    max_new_tokens: int,
    temperature: float,
    device: str,
) -> None:
    """Answer one batch of prompts (left-padded) and append its answers and top-k rows to ``out``."""
    from ..prompts import encode_prompt

    enc = [torch.tensor(encode_prompt(p, tok)) for p, _ in chunk]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, e in enumerate(enc):
        ids[j, width - len(e) :] = e
        mask[j, width - len(e) :] = 1
    with torch.no_grad():
        sequences = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        ).cpu()
    top_ids, top_logp = recorder.take()
    if top_ids.shape[1] != sequences.shape[1] - width:
        raise RuntimeError(
            f"the target ran {top_ids.shape[1]} forward passes for {sequences.shape[1] - width} new tokens"
        )
    for j, ((p, _), e) in enumerate(zip(chunk, enc)):
        new = sequences[j, width:]
        n = len(new)
        if tok.eos_token_id is not None and (new == tok.eos_token_id).any():
            n = int((new == tok.eos_token_id).nonzero()[0]) + 1
        if n < 2:
            continue
        out["ids"].append(torch.cat([e, new[:n]]).to(torch.int32))
        out["start"].append(len(e))
        out["topk_ids"].append(top_ids[j, :n].to(torch.int32))
        out["topk_logp"].append(top_logp[j, :n].to(torch.float16))
        out["prompt_id"].append(p.id)
        out["task_type"].append(p.task_type)
        out["split"].append(p.split)
        out["greedy"].append(greedy)


# ----------------------------------------------------------------------------- training
def _batches(corpus: dict, idx: list[int], tokens_per_batch: int, rng: np.random.Generator):
    order = rng.permutation(idx)
    batch: list[int] = []
    size = 0
    for i in order:
        n = len(corpus["ids"][i])
        if batch and size + n > tokens_per_batch:
            yield batch
            batch, size = [], 0
        batch.append(int(i))
        size += n
    if batch:
        yield batch


def _collate(corpus: dict, batch: list[int], pos_of: torch.Tensor):
    """Pad a batch; per answer position: teacher top-k restricted to head tokens."""
    seqs = [corpus["ids"][i].long() for i in batch]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    rows, cols, t_idx, t_logp = [], [], [], []
    for b, (i, s) in enumerate(zip(batch, seqs)):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
        start = corpus["start"][i]
        n = len(corpus["topk_ids"][i])
        # logits at position start-1+j predict answer token j, whose teacher top-k is topk[j]
        rows.append(torch.full((n,), b))
        cols.append(torch.arange(start - 1, start - 1 + n))
        t_idx.append(corpus["topk_ids"][i].long())
        t_logp.append(corpus["topk_logp"][i].float())
    rows_t, cols_t = torch.cat(rows), torch.cat(cols)
    tid, tlp = torch.cat(t_idx), torch.cat(t_logp)
    head_pos = pos_of[tid]  # -1 where the teacher's token is outside the head
    return ids, mask, rows_t, cols_t, head_pos, tlp


def _loss(model: Any, ids, mask, rows, cols, head_pos, tlp, ce_weight: float):
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
    small = hidden @ model.lm_head.weight.t()  # [P, H] logits over head tokens
    logq = torch.log_softmax(small, -1)
    valid = head_pos >= 0
    p = torch.where(valid, tlp.exp(), torch.zeros_like(tlp))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)  # teacher restricted to head tokens
    gathered = logq.gather(1, head_pos.clamp_min(0))
    kl = (p * (torch.log(p.clamp_min(1e-12)) - gathered)).sum(-1).mean()
    top = head_pos[:, 0]
    ce_mask = top >= 0
    ce = -(logq[ce_mask].gather(1, top[ce_mask, None])).mean() if ce_mask.any() else kl * 0
    return kl + ce_weight * ce, kl.item(), ce.item()


def _copy_inputs(corpus: dict, batch: list[int], max_match: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy candidate and match length at every answer position of a batch (as in :func:`_collate`)."""
    from .context_copy import copy_candidates

    cands, lengths = [], []
    for i in batch:
        c, m = copy_candidates(
            corpus["ids"][i].numpy().astype(np.int64), corpus["start"][i] - 1, len(corpus["topk_ids"][i]), max_match
        )
        cands.append(torch.from_numpy(c))
        lengths.append(torch.from_numpy(m))
    return torch.cat(cands), torch.cat(lengths)


def _predict(model: Any, hidden: torch.Tensor, corpus: dict, batch: list[int], slots: torch.Tensor) -> torch.Tensor:
    """The draft's greedy token at each position, with its copy mixture when it has one."""
    small = hidden @ model.lm_head.weight.t()
    gate = model.copy_gate() if hasattr(model, "copy_gate") else None
    if gate is None:
        return model.lm_head.token_ids[small.argmax(-1)]
    from .context_copy import copy_argmax

    cand, length = _copy_inputs(corpus, batch, gate["max_match"])
    return copy_argmax(small, model.lm_head.token_ids, slots, cand, length, model.copy_a, model.copy_b)


def agreement(model: Any, corpus: dict, idx: list[int], pos_of: torch.Tensor) -> dict[str, float]:
    """Greedy agreement: draft argmax == target argmax on answer positions, per task and overall.

    A draft with a fitted copy gate is measured with it (as HF runs it); ``pos_of`` is
    :func:`_head_slots` of the model.
    """
    hits: dict[str, list[int]] = {}
    with torch.no_grad():
        for batch in _batches(corpus, idx, 4096, np.random.default_rng(0)):
            ids, mask, rows, cols, head_pos, tlp = _collate(corpus, batch, pos_of)
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
            pred = _predict(model, hidden, corpus, batch, pos_of)
            teacher = torch.cat([corpus["topk_ids"][i][:, 0].long() for i in batch])
            ok = (pred == teacher).int()
            start = 0
            for i in batch:
                n = len(corpus["topk_ids"][i])
                hits.setdefault(corpus["task_type"][i], []).extend(ok[start : start + n].tolist())
                start += n
    out = {t: float(np.mean(v)) for t, v in sorted(hits.items())}
    out["overall"] = float(np.mean([x for v in hits.values() for x in v]))
    return out


def fit_copy(model: Any, corpus: dict, idx: list[int], max_match: int = 8) -> dict[str, Any]:
    """Fit the draft's context-copy gate on answers ``idx`` and install it.

    Fit on answers the draft never fitted (its validation prompts): on fitted
    text the draft is right far more often than on new text, and the gate
    would learn to trust it too much.
    """
    from ..hf.copy_gate import copy_fit_rows
    from .context_copy import fit_copy_gate

    slots = head_slots(model)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("lq", "p", "hit", "conf", "len")}
    with torch.no_grad():
        for batch in _batches(corpus, idx, 4096, np.random.default_rng(0)):
            ids, mask, rows, cols, _, tlp = _collate(corpus, batch, slots)
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
            log_q = torch.log_softmax((hidden @ model.lm_head.weight.t()).float(), -1)
            tid = torch.cat([corpus["topk_ids"][i].long() for i in batch])
            row = copy_fit_rows(log_q, tid, tlp, slots, *_copy_inputs(corpus, batch, max_match))
            for k, v in zip(("lq", "p", "hit", "conf", "len"), row):
                parts[k].append(v)
    a, b = fit_copy_gate(*(torch.cat(parts[k]) for k in ("lq", "p", "hit", "conf", "len")), max_match=max_match)
    model.set_copy_gate(a, b, max_match)
    return model.copy_gate()


def train_draft(
    corpus: dict,
    *,
    layers: tuple[int, ...] = (0, 1),
    head_size: int = 8192,
    minutes: float = 28.0,
    lr: float = 1e-3,
    warmup: int = 50,
    tokens_per_batch: int = 2048,
    ce_weight: float = 0.5,
    val_fraction: float = 0.1,
    eval_every: int = 100,
    seed: int = 0,
    fit_prefix: str | None = None,
    progress: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Distil a draft within a wall-clock budget (cosine schedule over the estimated steps).

    A ``val_fraction`` of the *training* prompts is set aside; every ``eval_every`` steps the
    greedy agreement on it is measured and the best checkpoint is kept (held-out prompts are
    never looked at before the final measurement).

    With ``fit_prefix`` (e.g. ``"gen-"``), only training prompts whose id starts with it are
    fitted, and the greedy answers of the *other* training prompts select the checkpoint
    (``val_fraction`` is then unused). The draft then never sees the prompts the policies are
    trained on, so their acceptance statistics are those of unseen prompts, like the held-out ones.
    """
    import copy

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    all_train = [i for i, s in enumerate(corpus["split"]) if s == "train"]
    train_prompts = sorted({corpus["prompt_id"][i] for i in all_train})
    if fit_prefix:
        val_prompts = {p for p in train_prompts if not p.startswith(fit_prefix)}
        if len(val_prompts) == len(train_prompts):
            raise ValueError(f"no training prompt id starts with {fit_prefix!r}")
    else:
        val_prompts = set(
            np.random.default_rng(seed).permutation(train_prompts)[: int(val_fraction * len(train_prompts))]
        )
    val_idx = [i for i in all_train if corpus["prompt_id"][i] in val_prompts and corpus["greedy"][i]]
    train_idx = [i for i in all_train if corpus["prompt_id"][i] not in val_prompts]
    held_idx = [i for i, s in enumerate(corpus["split"]) if s == "heldout"]
    counts = torch.zeros(max(int(t.max()) for t in corpus["ids"]) + 1, dtype=torch.long)
    for i in train_idx:
        counts += torch.bincount(corpus["topk_ids"][i][:, 0].long(), minlength=len(counts))[: len(counts)]
        s = corpus["ids"][i][corpus["start"][i] :].long()
        counts += torch.bincount(s, minlength=len(counts))[: len(counts)]
    head_ids = counts.argsort(descending=True)[:head_size].sort().values
    config, state = target_state()
    head_ids = head_ids[head_ids < config.vocab_size]
    model = build_draft(layers, head_ids, config, state)
    pos_of = head_slots(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    t0 = time.time()
    budget = minutes * 60
    step, history = 0, []
    best: tuple[float, int, Any] = (-1.0, 0, None)
    est_total = None
    while time.time() - t0 < budget:
        for batch in _batches(corpus, train_idx, tokens_per_batch, rng):
            elapsed = time.time() - t0
            if elapsed >= budget:
                break
            if step == 20:
                est_total = int(budget / (elapsed / 20))
            total = est_total or 10**6
            scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
            for g in opt.param_groups:
                g["lr"] = lr * scale
            loss, kl, ce = _loss(model, *_collate(corpus, batch, pos_of), ce_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                history.append(
                    {"step": step, "minutes": round(elapsed / 60, 2), "kl": round(kl, 4), "ce": round(ce, 4)}
                )
                if progress:
                    print(f"step {step} {elapsed / 60:.1f} min kl {kl:.3f} ce {ce:.3f}", file=sys.stderr, flush=True)
            if val_idx and step % eval_every == 0:
                model.eval()
                val = agreement(model, corpus, val_idx, pos_of)["overall"]
                model.train()
                history.append({"step": step, "val_agreement": round(val, 4)})
                if progress:
                    print(f"step {step} validation agreement {val:.3f}", file=sys.stderr, flush=True)
                if val > best[0]:
                    best = (val, step, copy.deepcopy(model.state_dict()))
    if best[2] is not None:
        model.load_state_dict(best[2])
    model.eval()
    n_train_tokens = sum(len(corpus["topk_ids"][i]) for i in train_idx)
    meta = {
        "base": "smollm2",
        "layers": list(layers),
        "head_size": int(len(head_ids)),
        "ce_weight": ce_weight,
        "lr": lr,
        "tokens_per_batch": tokens_per_batch,
        "steps": step,
        "best_step": best[1],
        "validation_agreement": round(best[0], 4),
        "validation_prompts": len(val_prompts),
        "fit_prefix": fit_prefix,
        "train_minutes": round((time.time() - t0) / 60, 1),
        "train_tokens": n_train_tokens,
        "train_sequences": len(train_idx),
        "heldout_agreement": agreement(model, corpus, held_idx, pos_of) if held_idx else {},
        "train_agreement": agreement(
            model, corpus, _spread([i for i in train_idx if corpus["greedy"][i]], 200), pos_of
        ),
        "history": history,
    }
    return model, meta


def _spread(items: list[int], n: int) -> list[int]:
    """At most ``n`` items evenly spaced over ``items`` (every task type, not just the first)."""
    if len(items) <= n:
        return items
    return [items[int(k * len(items) / n)] for k in range(n)]
