"""Prompts the target writes itself, for a draft's training corpus when no real traffic is at hand.

The target's chat template is cut right after the user turn's header and the target continues it, sampled, until
it closes the turn (Magpie-style: an instruction-tuned model writes the kind of requests it was tuned on). The
requests are far more varied than :mod:`.distill_prompts`' templates, and nothing is downloaded.
``speckv-distill self-prompts`` runs :func:`self_prompts`; ``speckv-distill corpus`` then lets the target answer
them like any prompt file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# a user turn shorter than this many characters is dropped (an empty or one-word turn teaches nothing)
MIN_TURN_CHARS = 12
_MARKER = "\x00speckv-user-turn\x00"


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template's text up to where a user's message begins (system turn and user header included).

    Raises
    ------
    ValueError
        If the tokenizer has no chat template, or its template does not keep a user message verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: there is no user turn for the target to write")
    full = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in full:
        raise ValueError("the tokenizer's chat template does not keep a user message verbatim")
    return full[: full.index(_MARKER)]


def finished_turns(
    rows: Iterable[Sequence[int]], end_id: int, decode: Callable[[list[int]], str], *, min_chars: int = MIN_TURN_CHARS
) -> list[str]:
    """The text of every generated row that closed its turn with ``end_id``; unfinished and short rows are dropped.

    Parameters
    ----------
    rows : iterable of sequences of int
        Token ids generated after :func:`user_turn_prefix`.
    end_id : int
        The token that ends a turn (``<|im_end|>`` for SmolLM2).
    decode : callable
        Token ids -> text (special tokens skipped).
    min_chars : int, default=MIN_TURN_CHARS
        Shorter texts (after stripping) are dropped.
    """
    out = []
    for row in rows:
        row = [int(t) for t in row]
        if end_id not in row:  # ran out of tokens before the turn closed: a cut request
            continue
        text = decode(row[: row.index(end_id)]).strip()
        if len(text) >= min_chars:
            out.append(text)
    return out


def self_prompts(
    count: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    batch_size: int = 64,
    max_new_tokens: int = 80,
    exclude: Iterable[str] = (),
    dtype: str = "bf16",
    device: str = "cpu",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """``count`` distinct user requests written by SmolLM2-135M-Instruct, as training prompt records.

    Parameters
    ----------
    count : int
        Requests to write.
    seed : int, default=0
        Seed of the sampling (the same seed and arguments write the same requests on the same machine).
    temperature : float, default=1.0
        Sampling temperature of the requests.
    batch_size : int, default=64
        Requests sampled at once.
    max_new_tokens : int, default=80
        A request still open after this many tokens is dropped.
    exclude : iterable of str
        Texts never to return (the held-out prompts).
    dtype, device : str
        What the target writes in and where.
    progress : bool, default=True
        Show a progress bar.

    Returns
    -------
    list of dict
        Prompt records ``{"id": "gen-self-00000", "task_type": "other", "split": "train", "prompt": text}`` for
        :func:`speckv_policy.prompts.write_prompt_file`.

    Raises
    ------
    ValueError
        If ``count`` distinct finished requests were not written in ``4 * ceil(count / batch_size) + 4`` batches.
    """
    import torch
    from tqdm.auto import tqdm

    from .models import load_model, load_tokenizer

    tok = load_tokenizer("smollm2")
    model = load_model("smollm2", dtype, device)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    prefix = torch.tensor([tok(user_turn_prefix(tok), add_special_tokens=False)["input_ids"]], device=device)
    banned = set(exclude)
    seen: set[str] = set()
    texts: list[str] = []
    max_batches = 4 * -(-count // batch_size) + 4
    torch.manual_seed(seed)
    bar = tqdm(total=count, desc="self prompts", disable=not progress, file=sys.stderr)
    batches = 0
    while len(texts) < count and batches < max_batches:
        batches += 1
        with torch.inference_mode():
            seqs = model.generate(
                prefix.repeat(batch_size, 1),
                attention_mask=torch.ones(batch_size, prefix.shape[1], dtype=torch.long, device=device),
                do_sample=True,
                temperature=temperature,
                top_p=None,
                top_k=None,
                max_new_tokens=max_new_tokens,
                eos_token_id=end_id,
                pad_token_id=end_id,
            ).cpu()
        rows = seqs[:, prefix.shape[1] :].tolist()
        for text in finished_turns(rows, end_id, lambda ids: tok.decode(ids, skip_special_tokens=True)):
            if text not in seen and text not in banned and len(texts) < count:
                seen.add(text)
                texts.append(text)
                bar.update(1)
    bar.close()
    if len(texts) < count:
        raise ValueError(
            f"the target wrote {len(texts)} distinct finished requests in {batches} batches of {batch_size}, "
            f"not {count}: lower --temperature or raise --max-new-tokens"
        )
    return [
        {"id": f"gen-self-{k:05d}", "task_type": "other", "split": "train", "prompt": t} for k, t in enumerate(texts)
    ]
