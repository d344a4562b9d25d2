"""The dashboard's JSON, with fakes: sliding-window rates and percentiles on a fake clock, the
phase breakdown, worker scraping (rates between scrapes, failures, timeouts, caching, counter
resets) and the pool / router aggregation; the two routes on a bare app."""

from __future__ import annotations

import asyncio
import math
import random
import re
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from router.dashboard import (
    Dashboard,
    LiveStats,
    add_dashboard_routes,
    parse_worker_metrics,
    quantile,
)
from router.metrics import RouterMetrics
from router.records import PhaseTimings, RequestRecord
from shared.directory import ROLE_DECODE, ROLE_PREFILL, WorkerInfo, WorkerLoad, WorkerRecord


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(
    path: str = "disagg",
    e2e: float = 0.05,
    timings: PhaseTimings | None = None,
    rid: str = "r",
    prompt: int = 200,
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        finished_at=time.time(),
        path=path,
        decode_worker="decode-0",
        prefill_worker="prefill-0" if path != "local" else "",
        prompt_tokens=prompt,
        completion_tokens=16,
        cached_tokens=0,
        ttft_s=0.01,
        e2e_s=e2e,
        attempts=1,
        timings=timings,
    )


# ---- sliding windows --------------------------------------------------------------------------


def test_request_and_token_rates_follow_a_steady_load():
    clock = Clock(1000.0)
    live = LiveStats(rate_window_s=10, latency_window_s=60, clock=clock)
    # 4 requests/s and 40 tokens/s for 60 s, then read the rate at several sub-second phases
    while clock.t < 1060.0:
        live.output(10)
        live.request_finished(record())
        clock.t += 0.25
    for frac in (0.0, 0.1, 0.5, 0.9):
        clock.t = 1060.0 + frac
        w = live.window()
        assert w["requests_per_s"] == pytest.approx(4.0, rel=0.12), frac
        assert w["output_tokens_per_s"] == pytest.approx(40.0, rel=0.12), frac
        assert w["prompt_tokens_per_s"] == pytest.approx(800.0, rel=0.12), frac
    assert w["requests_total"] == 240 and w["output_tokens_total"] == 2400
    assert w["paths"] == {"disagg": 236}  # (1000.9, 1060.9]: the first second has slid out
    clock.t += 11.0  # idle: the rate window empties, totals stay
    w = live.window()
    assert w["requests_per_s"] == 0.0 and w["output_tokens_per_s"] == 0.0
    assert w["requests_total"] == 240


def test_rate_right_after_start_is_not_inflated():
    clock = Clock(500.2)
    live = LiveStats(clock=clock)
    live.request_finished(record())
    clock.t = 500.3  # 0.1 s after start: one request is not "10 requests/s"
    assert live.window()["requests_per_s"] == 1.0


def test_latency_percentiles_match_exact_values_within_bucket_error():
    clock = Clock(2000.0)
    live = LiveStats(latency_window_s=60, clock=clock)
    ttfts = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    for v in ttfts:
        live.output(1, ttft_s=v)
        live.output(1, itl_s=v / 10)
    w = live.window()
    assert w["ttft"]["n"] == 100 and w["itl"]["n"] == 100
    assert w["ttft"]["p50"] == pytest.approx(0.050, rel=0.025)
    assert w["ttft"]["p99"] == pytest.approx(0.099, rel=0.025)
    assert w["itl"]["p50"] == pytest.approx(0.0050, rel=0.025)
    assert w["e2e"] == {"p50": None, "p99": None, "n": 0}


def test_percentiles_slide_old_samples_out():
    clock = Clock(3000.0)
    live = LiveStats(latency_window_s=60, clock=clock)
    for _ in range(50):
        live.output(1, ttft_s=2.0)  # a slow minute...
    clock.t += 40
    for _ in range(50):
        live.output(1, ttft_s=0.020)  # ...then a fast one
    w = live.window()
    assert w["ttft"]["n"] == 100 and w["ttft"]["p99"] == pytest.approx(2.0, rel=0.025)
    clock.t += 25  # the slow samples are now older than 60 s
    w = live.window()
    assert w["ttft"]["n"] == 50 and w["ttft"]["p99"] == pytest.approx(0.020, rel=0.025)
    clock.t += 60
    assert live.window()["ttft"] == {"p50": None, "p99": None, "n": 0}


@pytest.mark.parametrize("seed", range(5))
def test_quantile_is_within_bucket_error_of_nearest_rank(seed):
    from router.dashboard import bucket_of

    rng = random.Random(seed)
    values = [rng.lognormvariate(-3, 1.5) + 2e-4 for _ in range(rng.randrange(1, 3000))]
    counts: dict[int, int] = {}
    for v in values:
        counts[bucket_of(v)] = counts.get(bucket_of(v), 0) + 1
    ordered = sorted(values)
    for q in (0.01, 0.5, 0.9, 0.99, 1.0):
        exact = ordered[max(1, math.ceil(q * len(values))) - 1]
        assert quantile(counts, q) == pytest.approx(exact, rel=0.025)
    assert quantile({}, 0.5) is None


def test_ring_buffer_keeps_the_last_requests():
    live = LiveStats(recent=50)
    for i in range(70):
        live.request_finished(record(rid=f"r{i}"))
    assert [r.request_id for r in live.recent] == [f"r{i}" for i in range(20, 70)]


# ---- phase breakdown ----------------------------------------------------------------------------


def test_disaggregated_phases_add_up_and_do_not_double_count_the_overlap():
    # numbers as a decode worker reported them: queue_s is stamped when the KV arrived, and
    # transfer_s (Prefill call -> last block) contains P's compute
    t = PhaseTimings(
        queue_s=0.0067,
        prefill_s=0.0031,
        transfer_s=0.0061,
        transfer_bytes=16384,
        blocks_transferred=1,
        first_token_s=0.0085,
        decode_s=0.0238,
    )
    r = record("disagg", e2e=0.0346, timings=t)
    ph = dict(r.phases())
    assert list(ph) == ["router", "queue", "prefill", "transfer", "handoff", "decode"]
    assert ph["queue"] == pytest.approx(0.0067 - 0.0061)
    assert ph["prefill"] == pytest.approx(0.0031)
    assert ph["transfer"] == pytest.approx(0.0061 - 0.0031)  # the KV wait prefill did not hide
    assert ph["handoff"] == pytest.approx(0.0085 - 0.0067)
    assert ph["router"] == pytest.approx(0.0346 - 0.0085 - 0.0238)
    assert sum(ph.values()) == pytest.approx(0.0346)
    assert all(v >= 0 for v in ph.values())
    j = r.to_json()
    assert j["timings"]["transfer_bytes"] == 16384 and len(j["phases"]) == 6


def test_local_and_missing_timings_phases():
    t = PhaseTimings(queue_s=0.002, prefill_s=0.010, first_token_s=0.012, decode_s=0.1)
    ph = dict(record("local", e2e=0.115, timings=t).phases())
    assert ph["transfer"] == 0 and ph["handoff"] == pytest.approx(0)
    assert ph["prefill"] == pytest.approx(0.010) and ph["router"] == pytest.approx(0.003)
    assert sum(ph.values()) == pytest.approx(0.115)
    # inconsistent figures never make a negative segment
    bad = PhaseTimings(queue_s=0.5, prefill_s=0.4, transfer_s=0.9, first_token_s=0.3, decode_s=0.1)
    assert all(v >= 0 for _, v in record("disagg", e2e=0.2, timings=bad).phases())
    # the stream was cut by the router (stop string): only the router's own figures
    assert record("disagg", e2e=0.05, timings=None).phases() == [("ttft", 0.01), ("decode", 0.04)]


# ---- worker scraping and aggregation -----------------------------------------------------------


def worker_text(
    role: str,
    wid: str,
    *,
    running=0,
    waiting=0,
    usage=0.0,
    blocks=100,
    free=100,
    queries=0,
    hits=0,
    preempt=0,
    sent=0,
    received=0,
    failures=0,
    fallbacks=0,
) -> str:
    lab = f'model_name="m",role="{role}",worker_id="{wid}"'
    return "\n".join(
        [
            "# TYPE pdserve:num_requests_running gauge",
            f"pdserve:num_requests_running{{{lab}}} {running}",
            "# TYPE pdserve:num_requests_waiting gauge",
            f"pdserve:num_requests_waiting{{{lab}}} {waiting}",
            "# TYPE pdserve:kv_cache_usage_perc gauge",
            f"pdserve:kv_cache_usage_perc{{{lab}}} {usage}",
            "# TYPE pdserve:kv_cache_utilization gauge",
            f"pdserve:kv_cache_utilization{{{lab}}} 0.5",
            "# TYPE pdserve:kv_cache_num_blocks gauge",
            f"pdserve:kv_cache_num_blocks{{{lab}}} {blocks}",
            "# TYPE pdserve:kv_cache_free_blocks gauge",
            f"pdserve:kv_cache_free_blocks{{{lab}}} {free}",
            "# TYPE pdserve:prefix_cache_queries counter",
            f"pdserve:prefix_cache_queries_total{{{lab}}} {queries}",
            "# TYPE pdserve:prefix_cache_hits counter",
            f"pdserve:prefix_cache_hits_total{{{lab}}} {hits}",
            "# TYPE pdserve:num_preemptions counter",
            f"pdserve:num_preemptions_total{{{lab}}} {preempt}",
            "# TYPE pdserve:kv_transfer_bytes counter",
            f'pdserve:kv_transfer_bytes_total{{direction="send"}} {sent}',
            f'pdserve:kv_transfer_bytes_total{{direction="recv"}} {received}',
            "# TYPE pdserve:kv_transfer_failures counter",
            f'pdserve:kv_transfer_failures_total{{direction="recv",reason="timeout"}} {failures}',
            "# TYPE pdserve:prefill_fallbacks counter",
            f'pdserve:prefill_fallbacks_total{{{lab},reason="timeout"}} {fallbacks}',
            "# TYPE pdserve:time_to_first_token_seconds histogram",
            f'pdserve:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} 3',
            f"pdserve:time_to_first_token_seconds_count{{{lab}}} 3",
            f"pdserve:time_to_first_token_seconds_sum{{{lab}}} 0.3",
            "",
        ]
    )


def rec(
    wid: str,
    role: str,
    port: int,
    num_blocks: int = 100,
    free: int = 100,
    metrics: str | None = None,
) -> WorkerRecord:
    url = f"http://127.0.0.1:{port}/metrics" if metrics is None else metrics
    info = WorkerInfo(
        worker_id=wid,
        role=role,
        model="m",
        grpc=f"127.0.0.1:{port + 1000}",
        block_size=16,
        num_blocks=num_blocks,
        metrics=url,
    )
    return WorkerRecord(info, WorkerLoad(free, 1, 2), "g1", 1)


class FakePool:
    def __init__(self, records: list[WorkerRecord]) -> None:
        self.restart_counts: dict[str, int] = {}
        self._records = records
        self.cooling: set[str] = set()
        self.last_error: str | None = None

    def records(self, role=None):
        return [r for r in self._records if role is None or r.info.role == role]

    def healthy(self, role, exclude=frozenset()):
        return [r for r in self.records(role) if r.worker_id not in self.cooling | set(exclude)]

    def inflight(self, worker_id):
        return {"decode-0": 3}.get(worker_id, 0)

    def prefill_backlog(self, worker_id):
        return {"prefill-0": 512}.get(worker_id, 0)

    def decoding(self, worker_id):
        return {"decode-0": 2}.get(worker_id, 0)

    def restarts(self, worker_id):
        return self.restart_counts.get(worker_id, 0)


class Workers:
    """An httpx transport serving each worker's current metrics text; counts the calls."""

    def __init__(self) -> None:
        self.texts: dict[int, str] = {}
        self.calls = 0
        self.broken: dict[int, str] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        port = request.url.port
        how = self.broken.get(port)
        if how == "500":
            return httpx.Response(500, text="boom")
        if how == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if how == "hang":
            await asyncio.sleep(30)
        if how == "garbage":
            return httpx.Response(200, text="this is { not prometheus\n")
        return httpx.Response(200, text=self.texts[port])


def make_dashboard(records, workers: Workers, clock: Clock, registry=None) -> Dashboard:
    client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    return Dashboard(
        FakePool(records),
        registry or RouterMetrics("m").registry,
        LiveStats(clock=clock),
        "m",
        client=client,
        scrape_timeout_s=0.3,
        cache_s=1.0,
        clock=clock,
    )


def test_parse_sums_label_sets_and_ignores_other_series():
    got = parse_worker_metrics(
        worker_text("decode", "d", sent=5, received=7, failures=2, queries=9)
    )
    assert got["transfer_bytes"] == 12 and got["transfer_failures"] == 2
    assert got["prefix_queries"] == 9 and "time_to_first_token_seconds" not in str(got)


def test_rates_windowed_hit_rate_and_pool_totals():
    clock = Clock(100.0)
    w = Workers()
    recs = [
        rec("prefill-0", ROLE_PREFILL, 9001, num_blocks=300, free=250),
        rec("decode-0", ROLE_DECODE, 9002, num_blocks=100, free=40),
        rec("decode-1", ROLE_DECODE, 9003, num_blocks=300, free=300),
    ]
    w.texts[9001] = worker_text("prefill", "prefill-0", blocks=300, queries=1000, hits=1000, sent=0)
    w.texts[9002] = worker_text("decode", "decode-0", blocks=100, usage=0.5, queries=500, hits=0)
    w.texts[9003] = worker_text("decode", "decode-1", blocks=300, usage=0.1)
    metrics = RouterMetrics("m")
    metrics.routed("disagg")
    metrics.routed("disagg")
    metrics.routed("local")
    metrics.error(429)
    metrics.c_retries.inc()
    dash = make_dashboard(recs, w, clock, metrics.registry)

    async def run():
        first = await dash.data()
        assert w.calls == 3
        assert first["workers"][0]["scrape"]["transfer_bytes_per_s"] is None  # one sample only
        clock.t += 0.5
        await dash.data()
        assert w.calls == 3  # cached for cache_s: nothing scraped again
        clock.t += 1.5  # 2 s after the first scrape
        w.texts[9001] = worker_text(
            "prefill",
            "prefill-0",
            blocks=300,
            queries=2000,
            hits=1500,
            sent=2_000_000_000,
            running=2,
        )
        w.texts[9002] = worker_text(
            "decode",
            "decode-0",
            blocks=100,
            usage=0.5,
            queries=1500,
            hits=250,
            received=2_000_000_000,
            preempt=3,
            running=4,
            waiting=1,
        )
        d = await dash.data()
        assert w.calls == 6
        await dash.close()
        return d

    d = asyncio.run(run())
    by_id = {x["id"]: x for x in d["workers"]}
    assert [x["id"] for x in d["workers"]] == ["prefill-0", "decode-0", "decode-1"]
    p0, d0 = by_id["prefill-0"]["scrape"], by_id["decode-0"]["scrape"]
    assert p0["ok"] and p0["transfer_bytes_per_s"] == pytest.approx(1e9)
    assert p0["prefix_hit_rate"] == pytest.approx(0.5)  # 500 of the last 1000 tokens
    assert p0["prefix_hit_rate_total"] == pytest.approx(0.75)
    assert d0["transfer_bytes_per_s"] == pytest.approx(1e9) and d0["running"] == 4
    assert by_id["decode-0"]["inflight"] == 3 and by_id["decode-0"]["free_blocks"] == 40
    assert by_id["decode-0"]["decoding"] == 2 and by_id["prefill-0"]["prefill_backlog"] == 512
    dec, pre = d["pools"]["decode"], d["pools"]["prefill"]
    assert dec["kv_usage"] == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)  # block-weighted
    assert dec["prefix_hit_rate"] == pytest.approx(0.25)  # 250 of 1000 queried, decode-1 idle
    assert dec["preemptions"] == 3 and dec["preemptions_window"] == 3
    assert dec["running"] == 4 and dec["waiting"] == 1
    assert dec["blocks_total"] == 400 and dec["blocks_free"] == 340
    assert pre["running"] == 2 and pre["scraped"] == 1
    assert d["cluster"]["transfer_bytes_per_s"] == pytest.approx(1e9)
    assert d["router"]["paths"] == {"disagg": 2, "local": 1, "fallback": 0}
    assert d["router"]["errors"] == {"429": 1} and d["router"]["retries"] == 1


def test_failing_workers_are_reported_and_do_not_hold_up_the_others():
    clock = Clock(100.0)
    w = Workers()
    recs = [
        rec("decode-0", ROLE_DECODE, 9002),
        rec("decode-1", ROLE_DECODE, 9003),
        rec("decode-2", ROLE_DECODE, 9004),
        rec("decode-3", ROLE_DECODE, 9005),
        rec("decode-4", ROLE_DECODE, 9006),
        rec("decode-5", ROLE_DECODE, 9007, metrics=""),
    ]
    w.texts[9002] = worker_text("decode", "decode-0", running=1)
    w.broken.update({9003: "500", 9004: "refused", 9005: "hang", 9006: "garbage"})
    dash = make_dashboard(recs, w, clock)
    t0 = time.monotonic()
    d = asyncio.run(dash.data())
    # the hung worker (30 s) costs one scrape timeout (0.3 s); room for a loaded machine
    assert time.monotonic() - t0 < 5.0
    s = {x["id"]: x["scrape"] for x in d["workers"]}
    assert s["decode-0"]["ok"] and s["decode-0"]["running"] == 1
    assert s["decode-1"] == {"ok": False, "error": "HTTP 500"}
    assert not s["decode-2"]["ok"] and "refused" in s["decode-2"]["error"]
    assert s["decode-3"] == {"ok": False, "error": "timed out"}
    assert not s["decode-4"]["ok"] and s["decode-4"]["error"]
    assert s["decode-5"] == {"ok": False, "error": "no metrics URL in the registry"}
    assert d["pools"]["decode"]["workers"] == 6 and d["pools"]["decode"]["scraped"] == 1
    # decode-0 scraped (1); the five others by their leases (1 running, 2 waiting each)
    assert d["pools"]["decode"]["running"] == 1 + 5 and d["pools"]["decode"]["waiting"] == 10


def test_last_good_figures_survive_a_failed_scrape_and_a_restart_resets_rates():
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002)]
    w.texts[9002] = worker_text("decode", "decode-0", received=1000, running=5)
    dash = make_dashboard(recs, w, clock)

    async def run():
        await dash.data()
        clock.t += 1.0
        w.broken[9002] = "refused"
        d1 = await dash.data()
        clock.t += 1.0
        del w.broken[9002]
        w.texts[9002] = worker_text("decode", "decode-0", received=10)  # restarted: counters back
        d2 = await dash.data()
        clock.t += 1.0
        w.texts[9002] = worker_text("decode", "decode-0", received=510)
        d3 = await dash.data()
        return d1, d2, d3

    d1, d2, d3 = asyncio.run(run())
    s1 = d1["workers"][0]["scrape"]
    assert not s1["ok"] and s1["running"] == 5 and s1["age_s"] == pytest.approx(1.0)
    assert d2["workers"][0]["scrape"]["transfer_bytes_per_s"] is None  # no rate across a reset
    assert d3["workers"][0]["scrape"]["transfer_bytes_per_s"] == pytest.approx(500.0)


def test_worker_that_left_the_registry_is_forgotten():
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002), rec("decode-1", ROLE_DECODE, 9003)]
    w.texts.update(
        {9002: worker_text("decode", "decode-0"), 9003: worker_text("decode", "decode-1")}
    )
    dash = make_dashboard(recs, w, clock)

    async def run():
        await dash.data()
        recs.pop()
        clock.t += 2
        return await dash.data()

    d = asyncio.run(run())
    assert [x["id"] for x in d["workers"]] == ["decode-0"]
    assert set(dash.scraper._hist) == {"decode-0"}


def test_cooling_worker_and_registry_error_are_shown():
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002)]
    w.texts[9002] = worker_text("decode", "decode-0")
    dash = make_dashboard(recs, w, clock)
    dash.pool.cooling.add("decode-0")
    dash.pool.last_error = "registry unavailable: ConnectionError()"
    d = asyncio.run(dash.data())
    assert d["workers"][0]["healthy"] is False
    assert d["registry_error"].startswith("registry unavailable")


# ---- routes -----------------------------------------------------------------------------------


def test_routes_serve_a_self_contained_page_and_the_json():
    clock = Clock(100.0)
    w = Workers()
    w.texts[9002] = worker_text("decode", "decode-0")
    app = FastAPI()
    add_dashboard_routes(app)
    app.state.dashboard = make_dashboard([rec("decode-0", ROLE_DECODE, 9002)], w, clock)
    app.state.dashboard.live.request_finished(record(rid="cmpl-1"))
    with TestClient(app) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        html = page.text
        assert "<script>" in html and "<style>" in html
        # nothing is loaded from elsewhere: no src/href to a URL, no external script or sheet
        assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
        assert not re.search(
            r"<script[^>]+src|<link[^>]+stylesheet|@import|url\(", html, re.IGNORECASE
        )
        data = client.get("/dashboard/data")
        assert data.status_code == 200 and data.headers["cache-control"] == "no-store"
        body = data.json()
        assert body["recent"][0]["request_id"] == "cmpl-1"
        assert body["workers"][0]["id"] == "decode-0" and body["window"]["requests_total"] == 1


def test_a_worker_that_stopped_answering_leaves_the_pool_figures():
    # it kept adding its last scrape's queue, KV use and transfer rate to the pool and the
    # cluster headline however long it had been gone (a static worker, or until its lease lapsed)
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002), rec("decode-1", ROLE_DECODE, 9003)]
    w.texts[9002] = worker_text("decode", "decode-0", received=0, running=5, waiting=3, usage=0.9)
    w.texts[9003] = worker_text("decode", "decode-1", received=0, running=0, usage=0.1)
    dash = make_dashboard(recs, w, clock)

    async def run():
        await dash.data()
        clock.t += 2.0
        w.texts[9002] = worker_text(
            "decode", "decode-0", received=2_000_000_000, running=5, waiting=3, usage=0.9
        )
        live = await dash.data()
        w.broken[9002] = "refused"
        clock.t += 599.0
        await dash.data()
        clock.t += 1.0
        return live, await dash.data()

    live, gone = asyncio.run(run())
    assert live["pools"]["decode"]["transfer_bytes_per_s"] == pytest.approx(1e9)
    s = gone["workers"][0]["scrape"]
    assert not s["ok"] and s["running"] == 5 and s["age_s"] == pytest.approx(600.0)
    assert s["transfer_bytes_per_s"] is None and s["delta"] is None
    p = gone["pools"]["decode"]
    assert p["scraped"] == 1
    assert p["transfer_bytes_per_s"] == pytest.approx(0.0)  # decode-1's, only
    assert gone["cluster"]["transfer_bytes_per_s"] == pytest.approx(0.0)
    assert p["kv_usage"] == pytest.approx(0.1)
    assert p["running"] == 1 and p["waiting"] == 2  # decode-0's lease (1, 2) + decode-1's (0, 0)


def test_a_scrape_after_an_idle_gap_starts_a_new_window():
    # scrapes run only while a page polls: the first one after an hour compared against the
    # hour-old sample and showed an hour's average as "recent"
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002)]
    w.texts[9002] = worker_text("decode", "decode-0", preempt=0, received=0, queries=0)
    dash = make_dashboard(recs, w, clock)

    async def run():
        await dash.data()
        clock.t += 1.0
        await dash.data()
        clock.t += 3600.0
        w.texts[9002] = worker_text(
            "decode", "decode-0", preempt=500, received=3_600_000, queries=1000, hits=900
        )
        first = await dash.data()
        clock.t += 1.0
        w.texts[9002] = worker_text(
            "decode", "decode-0", preempt=501, received=3_601_000, queries=1010, hits=901
        )
        return first, await dash.data()

    first, second = asyncio.run(run())
    s = first["workers"][0]["scrape"]
    assert s["window_s"] == 0.0 and s["transfer_bytes_per_s"] is None
    assert s["prefix_hit_rate"] is None and first["cluster"]["preemptions_window"] == 0
    assert s["prefix_hit_rate_total"] == pytest.approx(0.9)
    s = second["workers"][0]["scrape"]
    assert s["window_s"] == pytest.approx(1.0) and s["transfer_bytes_per_s"] == pytest.approx(1000)
    assert (
        s["prefix_hit_rate"] == pytest.approx(0.1) and second["cluster"]["preemptions_window"] == 1
    )


def test_a_restart_is_known_by_its_generation_not_only_by_counters_going_back():
    # the new process's counters had passed the old one's: their difference was shown as a rate
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002)]
    w.texts[9002] = worker_text("decode", "decode-0", received=1000, queries=10, hits=5)
    dash = make_dashboard(recs, w, clock)

    async def run():
        await dash.data()
        clock.t += 1.0
        await dash.data()
        old = recs[0]
        recs[0] = WorkerRecord(old.info, old.load, "g2", 1)
        w.texts[9002] = worker_text(
            "decode", "decode-0", received=900_000_000, queries=2000, hits=100
        )
        clock.t += 1.0
        return await dash.data()

    s = asyncio.run(run())["workers"][0]["scrape"]
    assert s["ok"] and s["window_s"] == 0.0
    assert s["transfer_bytes_per_s"] is None and s["prefix_hit_rate"] is None


def test_a_non_finite_value_fails_that_worker_not_the_page():
    # JSON has no NaN: one worker's NaN gauge made /dashboard/data a 500 for the whole cluster
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002), rec("decode-1", ROLE_DECODE, 9003)]
    w.texts[9002] = worker_text("decode", "decode-0", running=2)
    w.texts[9003] = worker_text("decode", "decode-1").replace(
        'kv_cache_usage_perc{model_name="m",role="decode",worker_id="decode-1"} 0.0',
        'kv_cache_usage_perc{model_name="m",role="decode",worker_id="decode-1"} NaN',
    )
    app = FastAPI()
    add_dashboard_routes(app)
    app.state.dashboard = make_dashboard(recs, w, clock)
    r = TestClient(app).get("/dashboard/data")
    assert r.status_code == 200, r.text
    s = {x["id"]: x["scrape"] for x in r.json()["workers"]}
    assert s["decode-0"]["ok"] and s["decode-0"]["running"] == 2
    assert not s["decode-1"]["ok"] and "NaN" in s["decode-1"]["error"].replace("nan", "NaN")


def test_an_oversized_metrics_page_fails_that_worker(monkeypatch):
    # the whole body was read into the router's memory, however large
    import router.dashboard as dashboard_mod

    monkeypatch.setattr(dashboard_mod, "MAX_METRICS_BYTES", 4096)
    clock = Clock(100.0)
    w = Workers()
    recs = [rec("decode-0", ROLE_DECODE, 9002), rec("decode-1", ROLE_DECODE, 9003)]
    w.texts[9002] = worker_text("decode", "decode-0", running=2)
    w.texts[9003] = worker_text("decode", "decode-1") + "# " + "x" * 10_000 + "\n"
    d = asyncio.run(make_dashboard(recs, w, clock).data())
    s = {x["id"]: x["scrape"] for x in d["workers"]}
    assert s["decode-0"]["ok"] and s["decode-0"]["running"] == 2
    assert not s["decode-1"]["ok"] and "larger than 4096 bytes" in s["decode-1"]["error"]
