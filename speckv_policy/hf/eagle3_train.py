"""Training an EAGLE-3 head on a CPU: target features, vocabulary, training-time test.

The loop (the speculators trainer expects an accelerator):

1. **Features** (:func:`extract_features`): the target reads each corpus text
   (prompt + its own answer, from ``speckv-distill corpus``) once, teacher-forced;
   kept per position are the states entering the head's target layers
   (concatenated, bf16) and, at answer positions, the target's top-k next-token
   log-probabilities. Also for a quantized target (``compression``), to measure
   what a head trained on fp32 features costs there.
2. **Vocabulary** (:func:`choose_vocabulary`): the ``size`` tokens the target
   writes or ranks first most often in its training answers.
3. **Training** (:func:`train_head`): EAGLE-3's training-time test. Row ``j``
   reads the target's features at position ``j`` and the embedding of token
   ``j + 1`` and is scored against the target's distribution for token
   ``j + 2``; each further step re-reads the layer's own outputs (the target's
   features are gone after the first draft token, as at run time), the true next
   tokens, and attends to the target-feature rows up to ``j`` plus its own chain
   (the mask EAGLE-3 and speculators use). Soft cross-entropy on the target's
   top-k restricted to the head's vocabulary; later steps count only where every
   earlier step was right. Wall-clock budget, cosine schedule, checkpoints every
   few minutes (resumable), best checkpoint by agreement on validation answers.
4. **Agreement** (:func:`agreement`, per position :func:`first_draft_hits`): the
   head's first draft token equals the target's greedy token, teacher-forced on
   answer positions (the measure ``docs/draft.md`` uses for the distilled draft).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from .copy_gate import DEFAULT_MAX_MATCH, copy_argmax, copy_candidates, copy_fit_rows, fit_copy_gate
from .eagle3 import Eagle3Config, Eagle3Head

TOPK = 16
# Training batches are padded to a width that is a multiple of this. Under bf16 autocast oneDNN builds and keeps
# kernels per batch shape: over the first 4 minutes of the SmolLM2 build (5,958 texts) exact widths took the process
# from 4.9 to 9.7 GB resident in 357 steps; padded to multiples of 16, it peaked at 6.4 GB in 458 steps.
TRAIN_PAD_MULTIPLE = 16


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _release_freed_heap() -> None:
    """Hand the pages glibc keeps after ``free`` back to the system (a no-op off glibc).

    Each feature batch allocates and frees hundreds of megabytes of logits and hidden states between the small
    tensors it keeps; glibc keeps the freed pages of such a heap. Over the 2,844 texts of the SmolLM2 build the
    process peaked at 18.7 GB resident for 1.7 GB of features; trimming after each batch, at 5.7 GB.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# ----------------------------------------------------------------------------- features
def extract_features(
    corpus: dict,
    idx: list[int],
    model: Any,
    layer_ids: tuple[int, ...],
    *,
    tokens_per_batch: int = 4096,
    progress: bool = True,
    desc: str = "features",
) -> list[dict[str, Any]]:
    """Teacher-forced target features of corpus texts ``idx``.

    Returns, per text: ``ids`` (int64 ``[T]``), ``start`` (first answer position),
    ``aux`` (bf16 ``[T, n_layers * hidden]``: the states entering ``layer_ids``),
    ``top_ids`` / ``top_logp`` (``[T - start + 1, TOPK]``: the target's top-k at
    positions ``start - 1 .. T - 1``), ``task_type``, ``prompt_id``, ``split``.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    order = sorted(idx, key=lambda i: len(corpus["ids"][i]))
    out: dict[int, dict[str, Any]] = {}
    bar = tqdm(total=len(order), desc=desc, disable=not progress, file=sys.stderr)
    i = 0
    while i < len(order):
        width = len(corpus["ids"][order[i]])
        j = i
        while j < len(order) and (j - i + 1) * max(width, len(corpus["ids"][order[j]])) <= tokens_per_batch:
            width = max(width, len(corpus["ids"][order[j]]))
            j += 1
        j = max(j, i + 1)
        chunk = order[i:j]
        width = max(len(corpus["ids"][c]) for c in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, c in enumerate(chunk):
            s = corpus["ids"][c].long()
            ids[b, : len(s)] = s
            mask[b, : len(s)] = 1
        with torch.no_grad():
            res = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        aux = torch.cat([res.hidden_states[k] for k in layer_ids], dim=-1).float().cpu()
        logits = res.logits.float().cpu()
        for b, c in enumerate(chunk):
            n = len(corpus["ids"][c])
            start = int(corpus["start"][c])
            logp = torch.log_softmax(logits[b, start - 1 : n], dim=-1)
            top = logp.topk(min(TOPK, logp.shape[-1]), dim=-1)
            out[c] = {
                "ids": corpus["ids"][c].long(),
                "start": start,
                "aux": aux[b, :n].to(torch.bfloat16),
                "top_ids": top.indices.to(torch.int32),
                "top_logp": top.values.to(torch.float16),
                "task_type": corpus["task_type"][c],
                "prompt_id": corpus["prompt_id"][c],
                "split": corpus["split"][c],
            }
        del res, aux, logits
        _release_freed_heap()
        bar.update(len(chunk))
        i = j
    bar.close()
    return [out[c] for c in idx]


def choose_vocabulary(texts: list[dict[str, Any]], size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` tokens the target writes or ranks first most often; and their share of its greedy tokens."""
    counts: dict[int, int] = {}
    for t in texts:
        for tok in torch.cat([t["ids"][t["start"] :], t["top_ids"][:, 0].long()]).tolist():
            counts[tok] = counts.get(tok, 0) + 1
    ranked = sorted(counts, key=lambda k: (-counts[k], k))[:size]
    if len(ranked) < size:  # a small corpus: fill with the lowest unused ids so the head has its declared size
        used = set(ranked)
        ranked += [k for k in range(size * 2 + len(used)) if k not in used][: size - len(ranked)]
    chosen = torch.tensor(sorted(ranked), dtype=torch.long)
    keep = set(ranked)
    greedy = [int(x) for t in texts for x in t["top_ids"][:, 0].tolist()]
    return chosen, float(np.mean([g in keep for g in greedy])) if greedy else 0.0


# ----------------------------------------------------------------------------- the head from the target
def init_head(target: Any, cfg: Eagle3Config, vocab: torch.Tensor) -> Eagle3Head:
    """A head warm-started from the target.

    ``fc`` passes the highest feature layer through, the decoder layer is a copy
    of the target's layer at that depth (the embedding half of q/k/v small and
    random), ``norm`` is the target's final norm and ``lm_head`` its output rows
    for the head's vocabulary: before training the head reads the target's
    features roughly as the target's own upper layers would.
    """
    head = Eagle3Head(cfg)
    sd = target.state_dict()
    h, n_aux = cfg.hidden_size, len(cfg.aux_layer_ids)
    src = f"model.layers.{cfg.aux_layer_ids[-1]}."
    with torch.no_grad():
        fc = torch.randn(h, n_aux * h) * 0.01
        fc[:, (n_aux - 1) * h :] += torch.eye(h)
        head.fc.weight.copy_(fc)
        lay = head.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            w = sd[src + f"self_attn.{name}.weight"].float()
            new = torch.randn(w.shape[0], 2 * h) * 0.01
            new[:, h:] = w
            getattr(lay.self_attn, name).weight.copy_(new)
        lay.self_attn.o_proj.weight.copy_(sd[src + "self_attn.o_proj.weight"].float())
        if cfg.layer_type == "qwen3":
            lay.self_attn.q_norm.weight.copy_(sd[src + "self_attn.q_norm.weight"].float())
            lay.self_attn.k_norm.weight.copy_(sd[src + "self_attn.k_norm.weight"].float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(lay.mlp, name).weight.copy_(sd[src + f"mlp.{name}.weight"].float())
        lay.hidden_norm.weight.copy_(sd[src + "input_layernorm.weight"].float())
        lay.input_layernorm.weight.copy_(sd[src + "input_layernorm.weight"].float())
        lay.post_attention_layernorm.weight.copy_(sd[src + "post_attention_layernorm.weight"].float())
        head.norm.weight.copy_(sd["model.norm.weight"].float())
        out_w = sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).float()
        head.lm_head.weight.copy_(out_w[vocab])
    head.set_vocabulary(vocab)
    return head


# ----------------------------------------------------------------------------- training-time test
def _collate(texts: list[dict[str, Any]], slots: torch.Tensor, pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Pad texts (right) into a batch; targets per sequence position (empty before the answer).

    The width is rounded up to a multiple of ``pad_to_multiple_of``; causal attention keeps the padding out of every
    real row, and no target is read there.
    """
    b, width = len(texts), max(len(t["ids"]) for t in texts)
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    dim, k_top = texts[0]["aux"].shape[1], texts[0]["top_ids"].shape[1]
    aux = torch.zeros(b, width, dim, dtype=torch.bfloat16)
    ids = torch.zeros(b, width, dtype=torch.long)
    length = torch.zeros(b, dtype=torch.long)
    top_slot = torch.full((b, width, k_top), -1, dtype=torch.long)
    top_p = torch.zeros(b, width, k_top)
    greedy = torch.full((b, width), -1, dtype=torch.long)
    for k, t in enumerate(texts):
        n, s = len(t["ids"]), t["start"]
        aux[k, :n] = t["aux"]
        ids[k, :n] = t["ids"]
        length[k] = n
        tid = t["top_ids"].long()
        top_slot[k, s - 1 : n] = slots[tid]
        top_p[k, s - 1 : n] = t["top_logp"].float().exp()
        greedy[k, s - 1 : n] = slots[tid[:, 0]]
    return {"aux": aux, "ids": ids, "length": length, "top_slot": top_slot, "top_p": top_p, "greedy": greedy}


def _chain_mask(width: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Attention mask of TTT step ``step``: target rows up to ``j`` (causal), then row ``j``'s own chain."""
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_forward(
    head: Eagle3Head, embed: torch.Tensor, batch: dict[str, torch.Tensor], steps: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Training-time-test loss of a batch (summed over steps); per step (correct, counted) first-token hits.

    Runs where the head's weights are (``embed`` must be there too); ``batch`` may be on the CPU. A later step
    scores only the rows whose earlier steps all matched the target's greedy token (a draft chain that survives
    verification); scoring every row, as EAGLE-3's own trainer does, measured no better (docs/design.md).
    """
    dev = head.device
    batch = {k: v.to(dev) for k, v in batch.items()}
    ids, length = batch["ids"], batch["length"]
    b, width = ids.shape
    rows = torch.arange(width, device=dev)
    hidden = head.fuse(batch["aux"].to(head.dtype))
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    alive = torch.ones(b, width, dtype=torch.bool, device=dev)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = []
    for s in range(steps):
        nxt = torch.zeros_like(ids)
        nxt[:, : width - 1 - s] = ids[:, 1 + s :]  # row j reads token j + 1 + s
        emb = F.embedding(nxt, embed)
        rope = head.rope(rows + 1 + s)
        past = None if s == 0 else (torch.cat(keys, dim=2), torch.cat(values, dim=2))
        out, k, v = head.layer(emb, hidden, rope, past, None if s == 0 else _chain_mask(width, s, dev))
        keys.append(k)
        values.append(v)
        logq = torch.log_softmax(head.logits(out).float(), dim=-1)
        # row j at step s is scored against the target's distribution at position j + 1 + s
        pos = rows + 1 + s
        inside = pos < width
        pos_c = pos.clamp_max(width - 1)
        slot = batch["top_slot"][:, pos_c]  # [b, width, K]
        p = batch["top_p"][:, pos_c] * (slot >= 0)
        greedy = batch["greedy"][:, pos_c]
        valid = inside[None] & (pos[None] < length[:, None]) & (greedy != -1) & alive
        valid &= batch["top_slot"][:, pos_c, 0] != -1  # an answer position (a target distribution is there)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        ce = -(p * logq.gather(-1, slot.clamp_min(0))).sum(-1)
        n = int(valid.sum())
        if n:
            total = total + ce[valid].sum() / n
        pred = logq.argmax(-1)
        hit = (pred == greedy) & valid
        stats.append((int(hit.sum()), n))
        alive = alive & (pred == greedy)
        hidden = head.next_hidden(out)
    return total, stats


def perturb_features(aux: torch.Tensor, n_aux: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """``aux`` plus Gaussian noise: each target state of each position gets noise of ``scale`` times its own RMS.

    The noise is relative because the three states a head reads differ in scale by orders of magnitude; a padded
    (all-zero) position stays zero.
    """
    b, width, dim = aux.shape
    x = aux.float().view(b, width, n_aux, dim // n_aux)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float32)
    return (x + scale * rms * noise).view(b, width, dim).to(aux.dtype)


def _batches(texts: list[dict[str, Any]], tokens_per_batch: int, rng: np.random.Generator) -> list[list[int]]:
    """Length-bucketed batches of about ``tokens_per_batch`` padded tokens, shuffled."""
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]["ids"]), rng.random()))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, len(texts[i]["ids"]))
        if cur and w * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, w = [], len(texts[i]["ids"])
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _first_draft_rows(head: Eagle3Head, embed: torch.Tensor, texts: list[dict[str, Any]]) -> Any:
    """Per text (batches of 8): the head's first-draft logits at each answer token, teacher-forced.

    Yields ``(text, logits [answer tokens, draft vocab], targets)``, where ``targets`` holds the target's top-k ids
    for each answer token (column 0: its greedy token). Row ``j`` reads the target's features up to position
    ``j`` and token ``j + 1``, and drafts token ``j + 2``. Computed where the head is, yielded on the CPU.
    """
    slots = _slots(head)
    dev = head.device
    head.eval()
    with torch.no_grad():
        for k in range(0, len(texts), 8):
            chunk = texts[k : k + 8]
            batch = _collate(chunk, slots)
            ids = batch["ids"].to(dev)
            width = ids.shape[1]
            nxt = torch.zeros_like(ids)
            nxt[:, :-1] = ids[:, 1:]
            aux = batch["aux"].to(dev)
            out, _, _ = head.layer(
                F.embedding(nxt, embed), head.fuse(aux), head.rope(torch.arange(width, device=dev) + 1)
            )
            logits = head.logits(out).float().cpu()
            for r, t in enumerate(chunk):
                n, s = len(t["ids"]), t["start"]
                yield t, logits[r, s - 2 : n - 2], t["top_ids"][: n - s].long()


def _copy_inputs(text: dict[str, Any], max_match: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy candidate and match length for each answer token of ``text`` (from the tokens before it)."""
    n, s = len(text["ids"]), text["start"]
    cand, length = copy_candidates(text["ids"].numpy().astype(np.int64), s - 1, n - s, max_match)
    return torch.from_numpy(cand), torch.from_numpy(length)


def first_draft_hits(
    head: Eagle3Head, embed: torch.Tensor, texts: list[dict[str, Any]], *, copy: bool = True
) -> list[torch.Tensor]:
    """Per text, whether the head's first draft token equals the target's greedy token at each answer position.

    Parameters
    ----------
    head : Eagle3Head
        The head (its copy gate is used when ``copy`` and it has one, as the hook drafts).
    embed : torch.Tensor
        The target's input embedding ``[vocab, hidden]``.
    texts : list of dict
        Features of :func:`extract_features`.
    copy : bool, default=True
        Draft through the head's context-copy gate where it has one.

    Returns
    -------
    list of torch.Tensor
        One bool tensor per text, element ``k`` for answer token ``k`` (position ``start + k``): teacher-forced,
        the head read the target's features up to the token before it. A target token outside the head's
        vocabulary is a miss unless the copy gate proposes it from the context.
    """
    gate = head.copy_gate() if copy else None
    head_ids = head.target_ids().cpu()
    slots = _slots(head)
    hits = []
    for t, logits, targets in _first_draft_rows(head, embed, texts):
        if gate is None:
            pred = head_ids[logits.argmax(-1)]
        else:
            cand, length = _copy_inputs(t, gate["max_match"])
            a, b = torch.tensor(gate["a"]), torch.tensor(gate["b"])
            pred = copy_argmax(logits, head_ids, slots, cand, length, a, b)
        hits.append(pred == targets[:, 0])
    return hits


def agreement(
    head: Eagle3Head, embed: torch.Tensor, texts: list[dict[str, Any]], *, copy: bool = True
) -> dict[str, float]:
    """Teacher-forced first-draft-token agreement with the target's greedy token, per task and overall.

    Over every answer token: :func:`first_draft_hits`, counted per ``task_type`` and over all texts.
    """
    counts: dict[str, list[int]] = {}
    for t, hit in zip(texts, first_draft_hits(head, embed, texts, copy=copy)):
        c = counts.setdefault(t["task_type"], [0, 0])
        c[0] += int(hit.sum())
        c[1] += len(hit)
    out_d = {task: round(h / max(1, n), 4) for task, (h, n) in sorted(counts.items())}
    hits, total = (sum(c[j] for c in counts.values()) for j in (0, 1))
    out_d["overall"] = round(hits / max(1, total), 4)
    return out_d


def fit_head_copy_gate(
    head: Eagle3Head, embed: torch.Tensor, texts: list[dict[str, Any]], max_match: int = DEFAULT_MAX_MATCH
) -> dict[str, Any]:
    """Fit the head's context-copy gate (:mod:`speckv_policy.hf.copy_gate`) on ``texts`` and install it.

    Fit on answers the head never fitted: on fitted text it is right more often than on new text, and the gate
    would learn to trust it too much. Returns the gate as ``speckv.json`` stores it.
    """
    slots = _slots(head)
    rows = []
    for t, logits, targets in _first_draft_rows(head, embed, texts):
        n, s = len(t["ids"]), t["start"]
        rows.append(
            copy_fit_rows(
                torch.log_softmax(logits, -1), targets, t["top_logp"][: n - s], slots, *_copy_inputs(t, max_match)
            )
        )
    parts = {k: [r[j] for r in rows] for j, k in enumerate(("lq", "p", "hit", "conf", "len"))}
    a, b = fit_copy_gate(*(torch.cat(parts[k]) for k in ("lq", "p", "hit", "conf", "len")), max_match=max_match)
    head.set_copy_gate(a, b, max_match)
    return head.copy_gate()


def _slots(head: Eagle3Head) -> torch.Tensor:
    """For every target id, its slot in the head's vocabulary (-1 outside it)."""
    slots = torch.full((head.eagle.vocab_size,), -1, dtype=torch.long)
    ids = head.target_ids().cpu()
    slots[ids] = torch.arange(len(ids))
    return slots


def train_head(
    head: Eagle3Head,
    embed: torch.Tensor,
    train: list[dict[str, Any]],
    val: list[dict[str, Any]],
    *,
    minutes: float,
    checkpoint: str | Path,
    steps: int = 2,
    lr: float = 2e-3,
    warmup: int = 50,
    tokens_per_batch: int = 2048,
    eval_minutes: float = 4.0,
    seed: int = 0,
    progress: bool = True,
    max_steps: int | None = None,
    precision: str = "fp32",
    weight_decay: float = 0.0,
    feature_noise: float = 0.0,
    train_lm_head: bool = True,
) -> dict[str, Any]:
    """Train ``head`` in place for ``minutes`` of wall clock (resuming ``checkpoint`` if it exists).

    ``max_steps`` also ends it (and sets the cosine schedule's length) after that many optimizer steps.
    ``precision="bf16"`` runs the forward and backward passes under bf16 autocast (the weights and the optimizer
    stay fp32; validation runs in fp32): 1.7x faster a step on a CPU with AMX, at the same agreement after the same
    steps, but many times slower where the CPU has no bf16 arithmetic (AVX2 only). ``weight_decay`` is AdamW's
    (decoupled; the norms' gains are not decayed); ``feature_noise`` adds Gaussian noise of that many times each
    target state's RMS to the fitted features (:func:`perturb_features`; the first TTT step's input only, as later
    steps read the head's own output; validation reads them clean). ``train_lm_head=False`` keeps ``lm_head`` as it
    is (:func:`init_head`: the target's own output rows), so the layer must learn to write in the target's output
    space.

    Returns what happened (steps, minutes, validation agreement history) and leaves the best checkpoint's
    weights in ``head``.
    """
    import copy

    from tqdm.auto import tqdm

    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if weight_decay < 0 or feature_noise < 0:
        raise ValueError(f"weight_decay and feature_noise must be >= 0, got {weight_decay} and {feature_noise}")
    checkpoint = Path(checkpoint)
    slots = _slots(head)
    head.lm_head.weight.requires_grad_(train_lm_head)
    trained = [p for p in head.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": trained, "weight_decay": 0.0}]  # one group: resumes older checkpoints
    if weight_decay > 0:  # the norms' gains are not decayed
        groups = [
            {"params": [p for p in trained if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
        ]
    opt = torch.optim.AdamW(groups, lr=lr)
    noise_rng = torch.Generator().manual_seed(seed)
    layers = [int(i) for i in head.eagle.aux_layer_ids]
    state: dict[str, Any] = {"step": 0, "seconds": 0.0, "planned": 0, "best": -1.0, "history": [], "epoch": 0}
    state["aux_layer_ids"] = layers
    best_sd = copy.deepcopy(head.state_dict())
    if checkpoint.exists():
        ck = torch.load(checkpoint, weights_only=True, map_location=head.device)
        got = ck["state"].get("aux_layer_ids", layers)  # checkpoints before the record: the caller's features decide
        if list(got) != layers:
            head.lm_head.weight.requires_grad_(True)
            raise ValueError(
                f"{checkpoint}: was trained on target layers {list(got)}, this head reads {layers}; resume with the "
                "layers it was started with, or use another work folder"
            )
        head.load_state_dict(ck["head"])
        best_sd = ck["best_head"]
        try:
            opt.load_state_dict(ck["opt"])
        except ValueError as exc:  # other parameter groups: the decay or the frozen output rows differ
            head.lm_head.weight.requires_grad_(True)
            raise ValueError(
                f"{checkpoint}: was trained with other optimizer settings (weight decay on or off, lm_head frozen or "
                f"not: {exc}); resume with the settings it was started with, or use another work folder"
            ) from None
        state = ck["state"]
        state["aux_layer_ids"] = layers  # recorded from now on in a checkpoint from before the record
    rng = np.random.default_rng(seed + int(state["epoch"]))
    budget = minutes * 60.0
    bar = tqdm(total=int(budget), desc="eagle3 train (s)", disable=not progress, file=sys.stderr, unit="s")
    bar.update(int(state["seconds"]))
    last_eval = state["seconds"]

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "best_head": best_sd, "opt": opt.state_dict(), "state": state}, tmp)
        tmp.replace(checkpoint)

    def evaluate() -> None:
        nonlocal best_sd
        acc = agreement(head, embed, val)["overall"]
        state["history"].append([state["step"], round(state["seconds"] / 60, 2), round(acc, 4)])
        if acc > state["best"]:
            state["best"] = acc
            best_sd = copy.deepcopy(head.state_dict())
        bar.set_postfix(step=state["step"], val=f"{acc:.3f}", best=f"{state['best']:.3f}")
        save()

    if max_steps is not None:
        state["planned"] = int(max_steps)

    def done() -> bool:
        return state["seconds"] >= budget or (max_steps is not None and state["step"] >= max_steps)

    while not done():
        for batch_idx in _batches(train, tokens_per_batch, rng):
            if done():
                break
            t0 = time.perf_counter()
            head.train()
            batch = _collate([train[i] for i in batch_idx], slots, TRAIN_PAD_MULTIPLE)
            if feature_noise > 0:
                batch["aux"] = perturb_features(batch["aux"], len(head.eagle.aux_layer_ids), feature_noise, noise_rng)
            with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss, _ = ttt_forward(head, embed, batch, steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            state["step"] += 1
            if state["planned"] == 0 and state["step"] == 20:  # plan the cosine schedule from the measured pace
                state["planned"] = int(20 * budget / max(state["seconds"], 1e-3))
            planned = max(state["planned"], state["step"] + 1)
            frac = state["step"] / planned
            scale = min(1.0, state["step"] / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
            for g in opt.param_groups:
                g["lr"] = lr * scale
            opt.step()
            dt = time.perf_counter() - t0
            state["seconds"] += dt
            bar.update(int(state["seconds"]) - bar.n)
            if state["seconds"] - last_eval >= eval_minutes * 60:
                last_eval = state["seconds"]
                evaluate()
        else:
            state["epoch"] += 1
            rng = np.random.default_rng(seed + int(state["epoch"]))
    if not state["history"] or state["history"][-1][0] != state["step"]:  # a resumed, finished run: measured
        evaluate()
    bar.close()
    head.load_state_dict(best_sd)
    head.lm_head.weight.requires_grad_(True)
    return {
        "steps": state["step"],
        "train_minutes": round(state["seconds"] / 60, 1),
        "epochs": round(state["epoch"], 2),
        "validation_agreement": round(state["best"], 4),
        "history": state["history"],
    }
