"""Latency of a segment and of its submodules, measured in the *same* runs (forward hooks, and
backward hooks in train mode; CUDA events, else ``time.perf_counter``): medians and 90th
percentiles over ``repeats`` runs after ``warmup``. Why: docs/ANALYSIS.md, 'What is measured, and how'."""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..model.devices import synchronize
from ..errors import ConfigError

log = logging.getLogger(__name__)

SUM_TOLERANCE = 0.10  # submodule medians must sum to within 10% of their parent's
MIN_RUNS = 3  # timed runs kept even past max_seconds


class _Clock:
    """Marks points in time on one device; :meth:`elapsed_ms` between two marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


@dataclass
class Latency:
    """Summary of one set of timed runs, in milliseconds."""

    median: float
    p90: float
    runs: list[float]

    @classmethod
    def of(cls, runs: Sequence[float]) -> "Latency":
        runs = sorted(runs)
        return cls(statistics.median(runs), percentile(runs, 90), list(runs))

    def to_dict(self) -> dict:
        return {"median": self.median, "p90": self.p90, "runs": len(self.runs)}

    @property
    def spread(self) -> float:
        """(p90 - median) / median: how far the slower runs lie from the median (a busy machine's
        runs spread; 0 where nothing was timed)."""
        return (self.p90 - self.median) / self.median if self.median > 0 else 0.0


def percentile(sorted_runs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of sorted values."""
    if not sorted_runs:
        return float("nan")
    pos = (len(sorted_runs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_runs) - 1)
    return sorted_runs[lo] + (sorted_runs[hi] - sorted_runs[lo]) * (pos - lo)


class _Hooks:
    """Forward (and backward) hooks that accumulate each named module's time per run."""

    def __init__(self, modules: dict[str, nn.Module], clock: _Clock, backward: bool):
        self.clock = clock
        self.open: dict[tuple[str, str], object] = {}
        self.pairs: dict[str, list] = {name: [] for name in modules}
        self.handles = []
        for name, mod in modules.items():
            self.handles.append(mod.register_forward_pre_hook(self._start(name, "f")))
            self.handles.append(mod.register_forward_hook(self._stop(name, "f")))
            if backward:
                self.handles.append(mod.register_full_backward_pre_hook(self._start(name, "b")))
                self.handles.append(mod.register_full_backward_hook(self._stop(name, "b")))

    def _start(self, name, phase):
        def hook(*_):
            self.open[(name, phase)] = self.clock.mark()
        return hook

    def _stop(self, name, phase):
        def hook(*_):
            start = self.open.pop((name, phase), None)
            if start is not None:
                self.pairs[name].append((start, self.clock.mark()))
        return hook

    def collect_ms(self) -> dict[str, float]:
        """This run's time per module (summed over its calls), then reset for the next run."""
        out = {n: sum(self.clock.elapsed_ms(a, b) for a, b in ps) for n, ps in self.pairs.items()}
        for ps in self.pairs.values():
            ps.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class Timing:
    """The segment's latency and each submodule's, from the same runs."""

    total: Latency
    modules: dict[str, Latency]


def time_runs(run: Callable[[], None], modules: dict[str, nn.Module], device: torch.device,
              repeats: int, warmup: int, backward: bool = False,
              prepare: Callable[[], None] = lambda: None,
              max_seconds: Optional[float] = None) -> Timing:
    """Call ``run()`` ``warmup + repeats`` times with hooks on ``modules`` (name -> module);
    ``prepare()`` runs before each call, untimed. Returns the total and per-module latencies.
    ``max_seconds`` bounds slow runs: warm-up stops after one run once a quarter of it is used,
    timing once it is used and :data:`MIN_RUNS` runs are in."""
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    clock = _Clock(device)
    hooks = _Hooks(modules, clock, backward)
    totals, per_module = [], {n: [] for n in modules}
    budget = float("inf") if max_seconds is None else max_seconds
    began, warm_end = time.perf_counter(), warmup
    try:
        for i in range(warmup + repeats):
            spent = time.perf_counter() - began
            if i < warm_end and i >= 1 and spent > budget / 4:
                warm_end = i  # enough warm-up for a slow run
            if i >= warm_end and len(totals) >= MIN_RUNS and spent > budget:
                break
            prepare()
            synchronize(device)
            start = clock.mark()
            run()
            stop = clock.mark()
            synchronize(device)
            ms = hooks.collect_ms()
            if i >= warm_end:
                totals.append(clock.elapsed_ms(start, stop))
                for n, v in ms.items():
                    per_module[n].append(v)
    finally:
        hooks.remove()
    return Timing(Latency.of(totals), {n: Latency.of(v) for n, v in per_module.items()})


@dataclass
class SumCheck:
    """Do the children's median latencies add up to their parent's?"""

    parent: str          # module name ("" = the segment)
    children: list[str]
    parent_ms: float
    children_ms: float
    ok: bool             # within SUM_TOLERANCE
    spread: float = 0.0  # the runs' largest (p90 - median) / median, parent's and children's
    noisy: bool = False  # not ok, but within SUM_TOLERANCE + spread: the runs spread too much to tell

    @property
    def ratio(self) -> float:
        return self.children_ms / self.parent_ms if self.parent_ms > 0 else float("nan")

    @property
    def verdict(self) -> str:
        return "ok" if self.ok else ("noisy" if self.noisy else "off")

    def to_dict(self) -> dict:
        return {"parent": self.parent, "children": self.children, "parent_ms": self.parent_ms,
                "children_ms": self.children_ms, "ratio": self.ratio, "ok": self.ok, "spread": self.spread,
                "verdict": self.verdict}


def sum_check(parent: str, parent_ms: float, children: dict[str, float], spread: float = 0.0) -> SumCheck:
    """Within 10% (``SUM_TOLERANCE``): ok. Beyond it, but within 10% plus ``spread`` (the runs'
    measured (p90 - median) / median, e.g. on a busy machine): noisy, not a fault of the
    attribution: measure again on an idle machine or with more ``--repeats``. Beyond both: off."""
    total = sum(children.values())
    gap = abs(total - parent_ms)
    ok = parent_ms > 0 and gap <= SUM_TOLERANCE * parent_ms
    noisy = not ok and parent_ms > 0 and gap <= (SUM_TOLERANCE + spread) * parent_ms
    if not ok:
        (log.info if noisy else log.warning)(
            "submodules of %r sum to %.3f ms against %.3f ms%s", parent or "(segment)", total, parent_ms,
            f" (the runs spread by {spread:.0%}: noisy)" if noisy else "")
    return SumCheck(parent, list(children), parent_ms, total, ok, spread, noisy)
