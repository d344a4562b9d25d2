"""Prometheus helpers shared by the router and the workers (no torch import)."""

from __future__ import annotations

import bisect
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
