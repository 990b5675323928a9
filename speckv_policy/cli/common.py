"""What every command line shares: argument types that reject bad numbers, SIGTERM handling, one-line errors."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable

import numpy as np


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    return parse


def comma_list(
    choices: tuple[str, ...] | None = None, *, cast: Callable[[str], object] = str
) -> Callable[[str], tuple]:
    """argparse type: a non-empty comma-separated list without repeats, each item one of ``choices`` (if given).

    ``cast`` converts each item (e.g. ``int_at_least(0)``); its errors name the item.
    """

    def parse(text: str) -> tuple:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        if choices is not None:
            unknown = [t for t in items if t not in choices]
            if unknown:
                raise argparse.ArgumentTypeError(
                    f"unknown value(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(choices)}"
                )
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"a value is repeated in {text!r}")
        try:
            return tuple(cast(t) for t in items)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None

    return parse


def device_name(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (the form only; :func:`torch_device` also checks it is here)."""
    import re

    if re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


def torch_device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` naming a device this machine has (checked with torch)."""
    name = device_name(text)
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: no CUDA device here (torch {torch.__version__} sees none); use --device cpu"
            )
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


#: The ``--draft-precision`` choices (validated again by ``hf.models.draft_precision``; tests keep the two equal).
DRAFT_PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")


def add_draft_precision_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--draft-precision`` (default ``auto``) to a command that loads the draft."""
    parser.add_argument(
        "--draft-precision",
        choices=DRAFT_PRECISION_CHOICES,
        default="auto",
        help="dtype the draft runs in (default auto: bf16 on a CPU with native bf16, fp32 on other CPUs, fp16 on CUDA)",
    )


#: The ``--target-linear`` choices (validated again by ``hf.onednn.apply_linear_backend``; tests keep the two equal).
TARGET_LINEAR_CHOICES = ("default", "onednn")


def add_draft_linear_argument(
    parser: argparse.ArgumentParser, flag: str = "--draft-linear", whose: str = "the draft"
) -> None:
    """Add ``flag`` (``--draft-linear`` unless named; default ``default``) to a command that drafts."""
    parser.add_argument(
        flag,
        choices=TARGET_LINEAR_CHOICES,
        default="default",
        help=f"{whose}'s bf16 / float32 linear layers on CPU: torch's own (default) or oneDNN's fused linear "
        "(onednn: a bf16 EAGLE-3 head's tokens cost less on a CPU with native bf16; a Llama draft model keeps "
        "its fast decode step on either; docs/user_guide.md)",
    )


def add_target_linear_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--target-linear`` (default ``default``) to a command that loads the target."""
    parser.add_argument(
        "--target-linear",
        choices=TARGET_LINEAR_CHOICES,
        default="default",
        help="the target's float32 linear layers on CPU: torch's own (default) or oneDNN's fused linear (onednn: "
        "every forward costs less, a multi-token verification most; docs/user_guide.md)",
    )


def export_arm_pairs(text: str) -> dict[str, str]:
    """Argparse type for ``EXPORT=ARM,EXPORT=ARM``: an ONNX export (an existing file) and the name it goes by.

    Raises
    ------
    argparse.ArgumentTypeError
        Naming the item that is not ``EXPORT=ARM``, a missing file or a name used twice.
    """
    import os

    pairs: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",")):
        path, sep, arm = item.partition("=")
        if not sep or not path or not arm:
            raise argparse.ArgumentTypeError(f"{item!r} is not EXPORT=ARM (e.g. exported/smollm2-gbt-pre.onnx=gbt-pre)")
        if not os.path.isfile(path):
            raise argparse.ArgumentTypeError(f"{path}: no such export")
        if arm in pairs.values():
            raise argparse.ArgumentTypeError(f"the name {arm!r} is given to two exports")
        pairs[path] = arm
    return pairs


def float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """argparse type: a float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < v <= high if low_open else low <= v <= high):
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low}, {high}], got {text}")
        return v

    return parse


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit(143)``, so ``finally`` blocks run and no temporary file is left behind.

    Only from the main thread (Python delivers signals there); elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def fail(prog: str, message: object) -> int:
    """Print ``prog: error: message`` on one line to stderr; return exit status 2."""
    text = str(message).strip().replace("\n", " ")
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


def warn_if_one_gamma(name: str, chosen: np.ndarray, prog: str) -> bool:
    """Print a warning when a learned policy chose one gamma on every held-out step (a degenerate fit)."""
    values = np.unique(np.asarray(chosen))
    if len(values) != 1 or name.startswith("fixed"):
        return False
    print(
        f"{prog}: warning: {name} chose gamma {int(values[0])} on every held-out step: check the cost model "
        "printed above and the log's timings (one bad timing can price every draft out)",
        file=sys.stderr,
    )
    return True
