"""``speckv-profile``: log step-level outcomes of real speculative decoding.

For every prompt x compression level x decoding mode, the target generates
with the draft through :func:`speckv_policy.hf.attach` in ``fixed`` mode. Most
steps draft ``gamma_max`` tokens, so every gamma <= gamma_max has its outcome;
a share of *calibration* steps draft a uniform gamma in 0..gamma_max, so the
verify cost can be fitted against gamma (gamma 0 is a plain target step).
``--fixed-gammas`` adds the paper's runs at constant gamma.

Each (run, prompt) unit is appended to the log atomically once finished (a
part file of its own when the log is a dataset directory), so an interrupted
profile keeps its finished units and a rerun continues where it stopped. Units
can be sharded over a Ray cluster (:mod:`speckv_policy.hf.profile_ray`). The last step of every generation is dropped: it may have been
cut by the token budget or an end-of-sequence token, which would bias its
accepted length.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from ..logs import append_log
from ..prompts import Prompt
from .models import LOCAL_MODELS, ModelSource
from .profile_units import ProfileConfig, Unit, UnitProfiler, plan_profile, profile_settings, stats_to_rows

__all__ = ["ProfileConfig", "Unit", "UnitProfiler", "plan_profile", "profile", "profile_settings", "stats_to_rows"]


def profile(
    cfg: ProfileConfig,
    prompts: list[Prompt],
    *,
    progress: bool = True,
    models: ModelSource = LOCAL_MODELS,
    force_new: bool = False,
    ray_address: str | None = None,
    workers: int | None = None,
    on_unit_done: Any = None,
) -> dict[str, int]:
    """Run (or resume) a profile; returns counts of units done, skipped and rows written.

    A log at ``cfg.out`` (a ``.parquet`` file or a log dataset directory) is
    resumed when it was made with the same settings and refused otherwise;
    ``force_new`` moves it aside (renamed with a timestamp) and starts a new one.

    ``models`` resolves ``cfg.target`` and ``cfg.draft`` to loaded models: local
    Hugging Face folders by default; :data:`speckv_policy.smollm2.models.SMOLLM2_MODELS`
    adds the ``smollm2`` target and distilled draft folders.

    ``ray_address`` shards the units over a Ray cluster (``"local"`` starts one
    on this machine) with ``workers`` actors, each loading the models once and
    writing its units' parts into the dataset directory ``cfg.out`` (needs the
    ``[ray]`` extra; see :mod:`speckv_policy.hf.profile_ray`). ``on_unit_done(n,
    total)`` is called after each finished unit.
    """
    from tqdm.auto import tqdm

    units, todo = plan_profile(cfg, prompts, force_new=force_new)
    counts = {"units": len(units), "skipped": len(units) - len(todo), "done": 0, "rows": 0}
    if not todo:
        return counts
    metadata = {"profile_settings": profile_settings(cfg)}
    bar = tqdm(total=len(todo), desc="speckv-profile", unit="prompt", disable=not progress, file=sys.stderr)
    if ray_address is not None:
        from .profile_ray import profile_on_ray

        results = profile_on_ray(cfg, todo, models, metadata, ray_address, workers)
    else:
        worker = UnitProfiler(cfg, models)

        def _local() -> Iterator[int]:
            for unit in todo:
                rows = worker.run(unit)
                if rows:
                    append_log(cfg.out, rows, metadata=metadata)
                yield len(rows)

        results = _local()
    for n_rows in results:
        counts["done"] += 1
        counts["rows"] += n_rows
        bar.update(1)
        bar.set_postfix(rows=counts["rows"])
        if on_unit_done is not None:
            on_unit_done(counts["done"], len(todo))
    bar.close()
    return counts
