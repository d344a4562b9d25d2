"""``shared.prom``: the cyclic collector's pauses and the frozen start-up heap, as exported by
the router and every worker (``pdserve:gc_pause_seconds``, ``pdserve:gc_frozen_objects``)."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.prom import GcCollector, freeze_startup_heap

pytestmark = pytest.mark.unit


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name in ("pdserve:gc_pause_seconds_count", "pdserve:gc_frozen_objects"):
                out[(s.name, s.labels.get("generation", ""))] = s.value
            if s.name == "pdserve:gc_pause_seconds_bucket" and s.labels["le"] == "+Inf":
                out[("inf", s.labels["generation"])] = s.value
    return out


def test_each_collection_is_counted_in_its_generation():
    reg = CollectorRegistry()
    GcCollector({"role": "test"}, reg)
    GcCollector({"role": "another registry"}, CollectorRegistry())  # one hook per process
    before = _scrape(reg)
    gc.collect(2)
    gc.collect(0)
    after = _scrape(reg)
    assert (
        after[("pdserve:gc_pause_seconds_count", "2")]
        >= before[("pdserve:gc_pause_seconds_count", "2")] + 1
    )
    assert (
        after[("pdserve:gc_pause_seconds_count", "0")]
        >= before[("pdserve:gc_pause_seconds_count", "0")] + 1
    )
    for g in "012":  # the histogram is consistent: +Inf bucket == count
        assert after[("inf", g)] == after[("pdserve:gc_pause_seconds_count", g)]
    assert (
        sum(
            1
            for cb in gc.callbacks
            if getattr(cb, "__self__", None).__class__.__name__ == "_GcPauses"
        )
        == 1
    )


def test_freezing_moves_the_live_heap_out_of_reach():
    reg = CollectorRegistry()
    GcCollector({"role": "test"}, reg)
    keep = [{"i": i} for i in range(20_000)]  # long-lived start-up state
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(keep)
        # the gauge is the count taken when the heap froze
        assert _scrape(reg)[("pdserve:gc_frozen_objects", "")] == frozen
        young = len(gc.get_objects())
        assert young < frozen  # a full collection now walks only what came after
    finally:
        gc.unfreeze()  # the test process goes on allocating


def test_a_scrape_does_not_walk_the_frozen_heap(monkeypatch):
    """``gc.get_freeze_count()`` walks the whole permanent generation with the GIL held (12 ms
    per million frozen objects): every ``/metrics`` scrape of a worker or the router stalled
    its event loop and engine thread that long (the dashboard scrapes each worker once a
    second). The count is taken once, when the heap is frozen."""
    reg = CollectorRegistry()
    GcCollector({"role": "test"}, reg)
    try:
        frozen = freeze_startup_heap()

        def walk() -> int:
            raise AssertionError("a scrape walked the frozen heap")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        assert _scrape(reg)[("pdserve:gc_frozen_objects", "")] == frozen
    finally:
        gc.unfreeze()
