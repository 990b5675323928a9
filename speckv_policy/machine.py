"""Name the machine that measured something (a cost model, a race, a latency benchmark).

Costs are a property of the machine: two machines of one kind (same core count, same
``platform.machine()``) priced the same target's INT8 step at 1.06x and 2.25x its fp32
step. A measurement that names the CPU (and the GPU, where one ran) says where it holds.
"""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_model", "describe_host"]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """Name the CPU, so machines of one kind can be told apart.

    Parameters
    ----------
    cpuinfo : str
        Linux's CPU description, read for its first ``model name`` line.

    Returns
    -------
    str
        That model name (e.g. ``"AMD EPYC 9B14"``), else :func:`platform.processor`, else ``""``.
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or ""


def describe_host(accelerator: str = "", cpuinfo: str = "/proc/cpuinfo") -> str:
    """One line naming this machine: architecture, CPU model, CPU threads, and an accelerator if given.

    Parameters
    ----------
    accelerator : str, default=""
        The accelerator the measurement ran on (e.g. ``torch.cuda.get_device_name()``); left out when empty.
    cpuinfo : str
        Passed to :func:`cpu_model`.

    Returns
    -------
    str
        E.g. ``"x86_64 AMD EPYC 9B14, 2 CPU threads"`` or ``"x86_64 ..., 16 CPU threads, NVIDIA H200"``.
    """
    cpu = " ".join(p for p in (platform.machine(), cpu_model(cpuinfo)) if p)
    parts = [cpu or "unknown CPU", f"{os.cpu_count() or '?'} CPU threads"]
    if accelerator:
        parts.append(accelerator)
    return ", ".join(parts)
