"""Every use of transformers' private internals, in one place, behind a version check.

The hook needs a few things transformers does not promise to keep: the
model's ``_get_candidate_generator`` (the only way to make one model instance
draft through our candidate generator), four private methods of
``AssistedCandidateGenerator`` and three private helpers that sync the draft's
attention mask, position ids and token type ids. They are all reached through
the functions below, and importing this module checks the installed
transformers against the range the hook was tested on: outside it, or when an
internal is missing, it fails at once with a message naming both versions,
instead of an ``AttributeError`` deep inside ``generate``.

Set ``SPECKV_ALLOW_UNTESTED_TRANSFORMERS=1`` to try an untested version anyway
(a warning instead of the error); the losslessness tests say whether it works.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.generation import candidate_generator as _cg
from transformers.generation.candidate_generator import AssistedCandidateGenerator

__all__ = [
    "TESTED_TRANSFORMERS",
    "IncompatibleTransformersError",
    "check_transformers_version",
    "AssistedCandidateGenerator",
    "install_candidate_generator",
    "uninstall_candidate_generator",
    "has_installed_candidate_generator",
    "default_candidate_generator",
    "calculate_new_tokens",
    "sync_draft_inputs",
    "crop_draft_cache",
    "prepare_generation_args",
    "generate_candidates",
    "lean_draft_blocker",
    "new_draft_cache",
    "cache_keyword",
    "takes_logits_to_keep",
]

#: The transformers versions the hook was tested on: ``(lowest, first excluded)``.
TESTED_TRANSFORMERS = ("5.0", "6.0")
_MODEL_HOOK = "_get_candidate_generator"
_GENERATOR_METHODS = (
    "_calculate_new_tokens",
    "_update_past_and_masks",
    "_prepare_generation_args",
    "_generate_candidates",
)
_MASK_HELPERS = ("_prepare_attention_mask", "_prepare_position_ids", "_prepare_token_type_ids")


class IncompatibleTransformersError(ImportError):
    """The installed transformers is outside the tested range or lacks an internal the hook needs."""


def check_transformers_version(version: str | None = None) -> None:
    """Check ``version`` (default: the installed transformers) against :data:`TESTED_TRANSFORMERS`.

    Raises
    ------
    IncompatibleTransformersError
        Outside the range, or when one of the internals the hook uses is
        missing; the message names the installed and the tested versions.
        With ``SPECKV_ALLOW_UNTESTED_TRANSFORMERS=1`` a warning is issued instead.
    """
    installed = version or transformers.__version__
    low, high = TESTED_TRANSFORMERS
    tested = f">={low},<{high}"
    problem = None
    if not Version(low) <= Version(installed) < Version(high):
        problem = f"transformers {installed} is outside the tested range {tested}"
    elif version is None:
        from transformers import GenerationMixin

        missing = [f"GenerationMixin.{_MODEL_HOOK}"] if not hasattr(GenerationMixin, _MODEL_HOOK) else []
        missing += [
            f"AssistedCandidateGenerator.{m}" for m in _GENERATOR_METHODS if not hasattr(AssistedCandidateGenerator, m)
        ]
        missing += [f"candidate_generator.{f}" for f in _MASK_HELPERS if not hasattr(_cg, f)]
        if missing:
            problem = f"transformers {installed} lacks {', '.join(missing)}, which the hook uses"
    if problem is None:
        return
    message = (
        f"speckv-policy's Hugging Face hook: {problem} (tested: transformers{tested}). "
        f"Install a tested version: pip install 'transformers{tested}'; or set "
        "SPECKV_ALLOW_UNTESTED_TRANSFORMERS=1 to try anyway."
    )
    if os.environ.get("SPECKV_ALLOW_UNTESTED_TRANSFORMERS") == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise IncompatibleTransformersError(message)


check_transformers_version()


# -- the model side: which candidate generator generate() builds ---------------------------
def default_candidate_generator(model: Any) -> Callable[..., Any]:
    """The class's own ``_get_candidate_generator``, bound to ``model``."""
    return getattr(type(model), _MODEL_HOOK).__get__(model)


def install_candidate_generator(model: Any, factory: Callable[..., Any]) -> None:
    """Make this one model instance build its candidate generator with ``factory``.

    ``factory`` takes the arguments of transformers' ``_get_candidate_generator``
    (``generation_config, input_ids, inputs_tensor, logits_processor,
    model_kwargs, assistant_model, target_tokenizer, assistant_tokenizer``).
    """
    setattr(model, _MODEL_HOOK, factory)


def uninstall_candidate_generator(model: Any) -> None:
    """Undo :func:`install_candidate_generator` (a no-op when nothing is installed)."""
    model.__dict__.pop(_MODEL_HOOK, None)


def has_installed_candidate_generator(model: Any) -> bool:
    """Whether :func:`install_candidate_generator` was called on this instance."""
    return _MODEL_HOOK in model.__dict__


# -- the draft side: private steps of AssistedCandidateGenerator -----------------------------
def calculate_new_tokens(generator: AssistedCandidateGenerator, input_ids: Any) -> tuple[int, int]:
    """``(min_new, max_new)`` draft tokens allowed by the generation budget."""
    return generator._calculate_new_tokens(input_ids)


def sync_draft_inputs(generator: AssistedCandidateGenerator, input_ids: Any) -> None:
    """Crop the draft cache to ``input_ids`` and bring its masks and positions to the same length.

    transformers only syncs the masks when a draft cache exists; after steps
    that skipped the draft there is none, so they are brought to the current
    length here. A cache that lacks more than the last tokens (steps that
    skipped the draft) is fine: the draft's ``generate`` feeds every uncached
    token; what must not be there is an unverified one (:func:`crop_draft_cache`).
    """
    if generator._update_past_and_masks(input_ids):
        return
    cur = input_ids.shape[-1]
    enc_dec = generator.assistant_model.config.is_encoder_decoder
    kw = _cg._prepare_attention_mask(generator.assistant_kwargs, cur, enc_dec)
    kw = _cg._prepare_position_ids(kw, cur, enc_dec)
    generator.assistant_kwargs = _cg._prepare_token_type_ids(kw, cur)


def crop_draft_cache(generator: AssistedCandidateGenerator, length: int) -> None:
    """Crop the draft's cache to its first ``length`` positions (the tokens the target has verified).

    Without it, a rejected draft token stays in the cache whenever the next
    steps skip the draft: transformers crops to "all but the last two tokens",
    which then still covers the rejected position.
    """
    for key in ("cache", "past_key_values"):
        cache = generator.assistant_kwargs.get(key)
        if cache is not None and cache.get_seq_length() > length:
            cache.crop(length - cache.get_seq_length())


def prepare_generation_args(
    generator: AssistedCandidateGenerator, input_ids: Any, min_new: int, max_new: int
) -> dict[str, Any]:
    """The keyword arguments transformers passes to the draft's ``generate``."""
    return generator._prepare_generation_args(input_ids, min_new, max_new)


def generate_candidates(generator: AssistedCandidateGenerator, generation_args: dict[str, Any]) -> tuple[Any, Any]:
    """Run the draft: ``(ids including the context, logits of the new tokens)``."""
    return generator._generate_candidates(generation_args)


# -- the lean draft loop: the draft model's own forward calls and cache ------------------------
def cache_keyword(model: Any) -> str:
    """Name of the forward argument that takes the KV cache (``cache`` in recent 5.x, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def takes_logits_to_keep(model: Any) -> bool:
    """Whether ``model.forward`` can compute the last position's logits only (``logits_to_keep``)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def new_draft_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` for ``model``'s decoder."""
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


def lean_draft_blocker(model: Any, assistant_kwargs: dict[str, Any]) -> str | None:
    """Why the lean draft loop cannot draft for ``model`` (None when it can).

    The loop handles decoder-only drafts whose cache is made of full-attention
    dynamic layers (they crop exactly) and whose only extra input is an
    attention mask of ones; anything else keeps transformers' ``generate`` path.
    """
    if model.config.is_encoder_decoder:
        return "encoder-decoder draft"
    extra = sorted(
        k
        for k, v in assistant_kwargs.items()
        if v is not None
        and k not in ("attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values")
    )
    if extra:
        return f"draft inputs {', '.join(extra)}"
    mask = assistant_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return "padded attention mask"
    pos = assistant_kwargs.get("position_ids")
    if pos is not None and not (
        pos.dim() == 2 and bool((pos[0] == torch.arange(pos.shape[1], device=pos.device)).all())
    ):
        return "position ids other than 0, 1, 2, ..."
    from transformers.cache_utils import DynamicLayer

    layers = getattr(new_draft_cache(model), "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return "draft cache with sliding-window, linear-attention or static layers"
    return None
