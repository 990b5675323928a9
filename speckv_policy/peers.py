"""The serving engines' own draft-length rules, as the speckv proposer and the races run them.

Pure Python (no torch, no engine): :class:`SGLangStyleSteps` (SGLang's ``--speculative-adaptive``) and
:class:`DynamicSDTable` (vLLM's Dynamic SD, ``num_speculative_tokens_per_batch_size``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DynamicSDTable", "SGLangStyleSteps"]


class SGLangStyleSteps:
    """SGLang-style adaptive steps (``--speculative-adaptive``), as its docs and PRs describe it; decides before drafting.

    After each verification an EMA of the accepted length (draft tokens
    accepted) is updated; every ``interval`` steps the target is
    ``round(ema) + 1`` (SGLang's documented target): above the current tier,
    the tier moves up to the first one that reaches it; below, down to the
    last one under it, with the EMA shifted by ``up_hysteresis`` /
    ``down_hysteresis`` for the two directions. Tiers
    ``(1, 3, 7)`` and ``interval=5`` are SGLang's defaults; ``alpha`` (the EMA
    weight, 0.2) and the hysteresis (0, -0.25, from a shipped SGLang config)
    are not tuned on the prompts here. The state persists across requests, as
    a server's controller would.
    """

    def __init__(
        self,
        tiers: tuple[int, ...] = (1, 3, 7),
        alpha: float = 0.2,
        interval: int = 5,
        up_hysteresis: float = 0.0,
        down_hysteresis: float = -0.25,
    ) -> None:
        self.tiers = tuple(sorted(tiers))
        self.alpha, self.interval = alpha, interval
        self.up, self.down = up_hysteresis, down_hysteresis
        self.tier = self.tiers[len(self.tiers) // 2]
        self.ema: float | None = None
        self.steps = 0

    def observe(self, gamma: int, accepted: int) -> None:
        """One verified step: ``accepted`` of ``gamma`` draft tokens kept."""
        if gamma <= 0:
            return
        self.ema = float(accepted) if self.ema is None else (1 - self.alpha) * self.ema + self.alpha * accepted
        self.steps += 1
        if self.steps % self.interval:
            return
        up_target = round(self.ema + self.up) + 1  # SGLang's target: round(ema) + 1, with hysteresis
        down_target = round(self.ema + self.down) + 1
        if up_target > self.tier:  # up to the first tier that reaches the target
            self.tier = min((t for t in self.tiers if t >= up_target), default=self.tiers[-1])
        elif down_target < self.tier:  # down to the last tier under it
            self.tier = max((t for t in self.tiers if t <= down_target), default=self.tiers[0])

    def gamma(self) -> int:
        """Draft length for the next step."""
        return self.tier


class DynamicSDTable:
    """vLLM's Dynamic SD: a fixed draft length per batch size, from ``[start_bs, end_bs, K]`` ranges.

    As vLLM's scheduler expands it (``vllm/v1/spec_decode/dynamic/utils.py``): the first range starts at batch size 1,
    ranges are inclusive and increasing, a gap carries the previous range's K forward, and batch sizes past the last
    range keep its K. vLLM's docs tell users to fill the table with the best K measured at each concurrency.

    Parameters
    ----------
    schedule : sequence of (int, int, int)
        ``(start_bs, end_bs, K)`` entries.

    Raises
    ------
    ValueError
        If an entry is not three ints with ``1 <= start <= end`` and ``K >= 0``, the ranges overlap or are out of
        order, or the first does not start at 1.
    """

    def __init__(self, schedule: Sequence[Sequence[int]]) -> None:
        entries: list[tuple[int, int, int]] = []
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
            raise ValueError(f"a Dynamic SD schedule is a non-empty list of [start_bs, end_bs, K], got {schedule!r}")
        for e in schedule:
            ok = isinstance(e, Sequence) and len(e) == 3
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
            if not ok or not (1 <= e[0] <= e[1] and e[2] >= 0):
                raise ValueError(f"Dynamic SD entry {e!r}: expected [start_bs, end_bs, K], 1 <= start <= end, K >= 0")
            if entries and e[0] <= entries[-1][1]:
                raise ValueError(f"Dynamic SD entry {list(e)} overlaps or precedes {list(entries[-1])}")
            entries.append((int(e[0]), int(e[1]), int(e[2])))
        if entries[0][0] != 1:
            raise ValueError(f"the first Dynamic SD range must start at batch size 1, got {list(entries[0])}")
        self.schedule = tuple(entries)

    def gamma(self, batch_size: int) -> int:
        """K at ``batch_size``: the range holding it, else the last range that starts below it."""
        k = self.schedule[0][2]
        for start, _end, value in self.schedule:
            if start > batch_size:
                break
            k = value
        return k

    def as_config(self) -> list[list[int]]:
        """The table as vLLM's ``num_speculative_tokens_per_batch_size``."""
        return [list(e) for e in self.schedule]

    @classmethod
    def from_best(cls, best: dict[int, int]) -> DynamicSDTable:
        """The table vLLM's docs recommend: ``best`` maps each measured concurrency to its best K.

        Concurrency ``c`` covers batch sizes from itself up to the next measured one (minus one); the smallest covers
        from 1.
        """
        if not best:
            raise ValueError("no measured concurrency to build a Dynamic SD table from")
        cs = sorted(best)
        entries = []
        for i, c in enumerate(cs):
            start = 1 if i == 0 else c
            end = cs[i + 1] - 1 if i + 1 < len(cs) else max(c, 1 << 16)
            entries.append([start, end, int(best[c])])
        return cls(entries)
