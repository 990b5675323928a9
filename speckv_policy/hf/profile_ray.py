"""Profiling sharded over a Ray cluster (the ``[ray]`` extra): ``speckv-profile --ray [ADDRESS]``.

One actor per worker loads the target and the draft once
(:class:`~speckv_policy.hf.profiler.UnitProfiler`), takes units of work from
an :class:`ray.util.ActorPool` and writes each finished unit as a part file of
the log dataset directory (a path every worker sees: a shared filesystem on a
cluster). GPU workers reserve one GPU each; CPU workers ``cpus_per_worker``
cores, and torch in each uses that many threads.

Failures: a worker that dies is restarted by Ray and its unit retried there
(``max_restarts``, ``max_task_retries``). A part's file name depends only on its
unit and is written atomically, so a retried unit replaces its part and no step
is ever stored twice; a killed run leaves finished parts and no partial one,
and rerunning the same command finishes the rest.

Nothing imports this module, or Ray, unless ``--ray`` is given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ..logs import append_log, is_dataset_path
from .models import ModelSource
from .profile_units import ProfileConfig, Unit, UnitProfiler

#: How often Ray restarts a dead worker and retries its unit.
MAX_RETRIES = 3
#: Actor names, ``{prefix}{i}`` in namespace :data:`NAMESPACE`, so tools (and tests) can find a worker.
ACTOR_PREFIX = "speckv-profile-worker-"
NAMESPACE = "speckv"


class _Worker:
    """Ray actor body: one :class:`UnitProfiler`, writing its units' parts itself."""

    def __init__(self, cfg: ProfileConfig, models: ModelSource, metadata: dict[str, str], threads: int) -> None:
        import torch

        if cfg.device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.cfg = cfg
        self.metadata = metadata
        self.profiler = UnitProfiler(cfg, models)

    def run(self, unit: Unit) -> int:
        rows = self.profiler.run(unit)
        if rows:
            append_log(self.cfg.out, rows, metadata=self.metadata)
        return len(rows)


def _import_ray() -> Any:
    try:
        import ray
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "speckv-profile --ray needs Ray: pip install 'speckv-policy[ray]' (or pip install 'ray>=2.9')"
        ) from None
    return ray


def profile_on_ray(
    cfg: ProfileConfig,
    todo: list[Unit],
    models: ModelSource,
    metadata: dict[str, str],
    address: str,
    workers: int | None = None,
    cpus_per_worker: int = 1,
) -> Iterator[int]:
    """Profile ``todo`` on Ray; yields each finished unit's row count as it completes.

    Parameters
    ----------
    address : str
        ``"local"`` starts a Ray instance on this machine; anything else is
        passed to ``ray.init(address=...)`` (``"auto"``, ``"ray://head:10001"``).
    workers : int or None
        Actors to start; default: one per GPU for CUDA profiles, else one per
        ``cpus_per_worker`` cores of the cluster (at most the units to do).
    """
    if not is_dataset_path(cfg.out):
        raise ValueError(
            f"{cfg.out}: Ray workers write part files into a log dataset directory; give --out a path without "
            ".parquet (every worker must see it: a shared filesystem on a cluster)"
        )
    ray = _import_ray()
    from ray.util import ActorPool

    started = not ray.is_initialized()
    if started:
        kw: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "include_dashboard": False}
        if address == "local":
            ray.init(num_cpus=max(os.cpu_count() or 1, (workers or 1) * cpus_per_worker), **kw)
        else:
            ray.init(address=address, **kw)
    try:
        gpu = cfg.device.startswith("cuda")
        res = ray.cluster_resources()
        if workers is None:
            workers = int(res.get("GPU", 0)) if gpu else int(res.get("CPU", 1)) // cpus_per_worker
        workers = max(1, min(int(workers), len(todo)))
        # cfg.out must mean the same directory to every worker
        cfg = replace(cfg, out=os.path.abspath(cfg.out))
        actor_cls = ray.remote(_Worker)
        options = {
            "num_gpus": 1 if gpu else 0,
            "num_cpus": 0 if gpu else cpus_per_worker,
            "max_restarts": MAX_RETRIES,
            "max_task_retries": MAX_RETRIES,
            "namespace": NAMESPACE,
        }
        actors = [
            actor_cls.options(name=f"{ACTOR_PREFIX}{i}", **options).remote(cfg, models, metadata, cpus_per_worker)
            for i in range(workers)
        ]
        pool = ActorPool(actors)
        yield from pool.map_unordered(lambda actor, unit: actor.run.remote(unit), todo)
        for a in actors:
            ray.kill(a)
    finally:
        if started:
            ray.shutdown()
