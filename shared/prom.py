"""Prometheus helpers shared by the router and the workers (no torch import)."""

from __future__ import annotations

import bisect
import gc
import itertools
import math
import time

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString


class LoopHistogram:
    """A Prometheus histogram with one fixed label set and no lock, for a value observed on
    every streamed token: ``observe`` is a bisect and two additions (``prometheus_client``'s
    ``Histogram.observe`` takes a lock per bucket and per sum, several times the cost).

    Observed and collected on the event loop thread only (``/metrics`` renders there). Its
    exposition is the same as ``Histogram``'s: ``_bucket`` / ``_count`` / ``_sum`` and
    ``_created``.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labels = labels
        self._bounds = [float(b) for b in buckets] + [math.inf]
        self._le = [floatToGoString(b) for b in self._bounds]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1  # first bound >= amount
        self._sum += amount

    def describe(self) -> list[Metric]:
        return [Metric(self._name, self._doc, "histogram")]

    def collect(self) -> list[Metric]:
        m = Metric(self._name, self._doc, "histogram")
        total = 0
        for le, total in zip(self._le, itertools.accumulate(self._counts), strict=True):
            m.add_sample(self._name + "_bucket", {"le": le, **self._labels}, float(total))
        m.add_sample(self._name + "_count", self._labels, float(total))
        m.add_sample(self._name + "_sum", self._labels, self._sum)
        m.add_sample(self._name + "_created", self._labels, self._created)
        return [m]


# how long one run of the cyclic collector stops the process: a young collection takes
# microseconds, a full one over an unfrozen heap of a loaded model ~0.1-0.3 s on these cores
GC_PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _GcPauses:
    """The durations of this process's cyclic garbage collections, per generation, timed by a
    ``gc.callbacks`` hook (one per process: every registry reads the same counts). A
    collection holds the GIL from start to stop, so every Python thread waits it out: the
    engine's step, the event loop's streaming."""

    def __init__(self) -> None:
        self.bounds = [float(b) for b in GC_PAUSE_BUCKETS] + [math.inf]
        self.counts = [[0] * len(self.bounds) for _ in range(3)]
        self.sums = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        self.created = time.time()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # collections never overlap (the collector is not re-entered), so one start time does
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        g = min(int(info.get("generation", 2)), 2)
        self.counts[g][bisect.bisect_left(self.bounds, took)] += 1
        self.sums[g] += took


_gc_pauses: _GcPauses | None = None
# gc.get_freeze_count() walks the whole permanent generation (12 ms per million objects, the
# GIL held): counted once when freeze_startup_heap froze it, not on every scrape
_frozen_objects = 0


class GcCollector:
    """``pdserve:gc_pause_seconds{generation}`` (a histogram of the collector's runs) and
    ``pdserve:gc_frozen_objects`` (objects moved out of its reach by ``gc.freeze()``, which
    a full collection no longer walks) with ``labels``, for ``registry``."""

    def __init__(self, labels: dict[str, str], registry: CollectorRegistry) -> None:
        global _gc_pauses
        if _gc_pauses is None:
            _gc_pauses = _GcPauses()
        self._pauses = _gc_pauses
        self._labels = labels
        self._le = [floatToGoString(b) for b in self._pauses.bounds]
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [
            Metric("pdserve:gc_pause_seconds", "", "histogram"),
            Metric("pdserve:gc_frozen_objects", "", "gauge"),
        ]

    def collect(self) -> list[Metric]:
        p = self._pauses
        h = Metric(
            "pdserve:gc_pause_seconds",
            "Duration of each cyclic garbage collection of this process, by generation (every "
            "Python thread waits it out).",
            "histogram",
        )
        for g in range(3):
            labels = {**self._labels, "generation": str(g)}
            total = 0
            for le, total in zip(self._le, itertools.accumulate(p.counts[g]), strict=True):
                h.add_sample("pdserve:gc_pause_seconds_bucket", {**labels, "le": le}, float(total))
            h.add_sample("pdserve:gc_pause_seconds_count", labels, float(total))
            h.add_sample("pdserve:gc_pause_seconds_sum", labels, p.sums[g])
            h.add_sample("pdserve:gc_pause_seconds_created", labels, p.created)
        f = Metric(
            "pdserve:gc_frozen_objects",
            "Objects frozen out of the garbage collector's generations after start-up (counted "
            "when they were frozen).",
            "gauge",
        )
        f.add_sample("pdserve:gc_frozen_objects", self._labels, float(_frozen_objects))
        return [h, f]


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now (the model, the engine, the servers: they
    live as long as the process) out of the cyclic collector's generations, so a full
    collection walks only what requests allocate (vLLM's engine core and API server do the
    same). Call once start-up is done; returns the objects frozen."""
    global _frozen_objects
    gc.collect()
    gc.freeze()
    _frozen_objects = gc.get_freeze_count()
    return _frozen_objects
