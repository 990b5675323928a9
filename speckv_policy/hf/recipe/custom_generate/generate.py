"""A learned, cost-aware draft length for assisted generation: speckv-policy's hook as a ``custom_generate`` recipe.

transformers copies this file into its module cache and calls :func:`generate` with the model and every argument
of ``model.generate``; it therefore imports the installed package absolutely and adds nothing of its own: it is
:func:`speckv_policy.hf.attach` around the model's own ``generate``.
"""

from __future__ import annotations

from typing import Any

from speckv_policy.hf import attach


def generate(
    model: Any,
    *args: Any,
    speckv_policy: Any = None,
    speckv_costs: Any = None,
    speckv_settings: Any = None,
    speckv_mode: str | None = None,
    **kwargs: Any,
) -> Any:
    """``model.generate(*args, **kwargs)`` with the draft length of ``speckv_policy`` (see ``attach``).

    ``speckv_policy``, ``speckv_costs``, ``speckv_settings`` and ``speckv_mode`` are ``attach``'s ``policy``,
    ``costs``, ``settings`` and ``mode``.

    Raises
    ------
    ValueError
        Without ``speckv_policy`` or without an ``assistant_model`` (the recipe decides a draft's length).
    """
    if speckv_policy is None:
        raise ValueError("the speckv-policy recipe needs speckv_policy= (an export, a stop rule's .json, or an int)")
    if kwargs.get("assistant_model") is None:
        raise ValueError("the speckv-policy recipe decides a draft's length: pass assistant_model=<draft model>")
    with attach(model, speckv_policy, mode=speckv_mode, costs=speckv_costs, settings=speckv_settings):
        return model.generate(*args, **kwargs)
