"""The router's live dashboard: ``GET /dashboard`` (one self-contained page, no external
assets) and ``GET /dashboard/data`` (the JSON the page polls every second).

Everything is read on demand; nothing runs in the background. Three sources:

- :class:`LiveStats`, fed by the serving layer on the event loop: per-second slots of request
  and token counts and log-bucketed TTFT / ITL / e2e histograms (sliding-window rates and
  percentiles), plus a ring buffer of the last finished requests with the decode worker's
  phase timings (``GenerateChunk.timings``).
- the router's own Prometheus registry (cumulative totals: path split, retries, errors).
- every live worker's ``/metrics`` (the ``metrics`` URL of its registry record), scraped in
  parallel by :class:`WorkerScraper` with a short timeout and cached for ``cache_s``; rates
  are differences between scrapes. A worker that cannot be scraped is reported with the error
  and its last good figures; it never delays anything but the dashboard's own JSON.

No heavy imports here (the router must not load torch, the engine or kvtransfer).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import HTMLResponse, JSONResponse, Response

from router.records import RequestRecord
from shared.directory import ROLE_DECODE, ROLE_PREFILL, WorkerRecord

PAGE = Path(__file__).resolve().parent / "static" / "dashboard.html"
# The page may talk to its own origin only: no CDN, no external fonts, images or scripts.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)

# ---- sliding windows -------------------------------------------------------------------------

_LO = 1e-4  # seconds; latency histogram buckets are [LO * R**i, LO * R**(i+1))
_R = 1.05  # a bucket's midpoint is within 2.5 % of any value in it
_LOG_R = math.log(_R)


def bucket_of(seconds: float) -> int:
    """Histogram bucket index of a latency (values under 0.1 ms share bucket 0)."""
    return 0 if seconds <= _LO else int(math.log(seconds / _LO) / _LOG_R)


def bucket_value(index: int) -> float:
    """The geometric midpoint of bucket ``index`` (what percentiles report)."""
    return cast(float, _LO * _R ** (index + 0.5))  # float ** float is typed Any


def quantile(counts: dict[int, int], q: float) -> float | None:
    """Nearest-rank ``q`` quantile of a sparse bucket histogram (None when empty)."""
    n = sum(counts.values())
    if n == 0:
        return None
    rank, seen = max(1, math.ceil(q * n)), 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return bucket_value(index)
    raise AssertionError("unreachable: rank <= n")


@dataclass(slots=True)
class _Second:
    """Everything observed during one second of the monotonic clock."""

    second: int
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    paths: dict[str, int] = field(default_factory=dict)
    ttft: dict[int, int] = field(default_factory=dict)
    itl: dict[int, int] = field(default_factory=dict)
    e2e: dict[int, int] = field(default_factory=dict)


class LiveStats:
    """Sliding-window figures and the last finished requests. Event-loop thread only.

    Rates cover the last ``rate_window_s`` seconds, percentiles the last ``latency_window_s``;
    both are computed from whole one-second slots plus the current partial one.
    """

    def __init__(
        self,
        *,
        recent: int = 50,
        rate_window_s: int = 10,
        latency_window_s: int = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self.recent: deque[RequestRecord] = deque(maxlen=recent)
        self.requests_total = 0
        self.output_tokens_total = 0
        self._clock = clock
        self._started = clock()
        self._slots: deque[_Second] = deque()

    def _slot(self) -> _Second:
        now_s = int(self._clock())
        if not self._slots or self._slots[-1].second != now_s:
            self._slots.append(_Second(now_s))
            keep = max(self.rate_window_s, self.latency_window_s)
            while self._slots[0].second <= now_s - keep:
                self._slots.popleft()
        return self._slots[-1]

    def output(self, tokens: int, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        """One output event of a request: ``tokens`` new tokens, and its TTFT (first event) or
        the gap since the same prompt's previous event (ITL)."""
        s = self._slot()
        s.output_tokens += tokens
        self.output_tokens_total += tokens
        if ttft_s is not None:
            b = bucket_of(ttft_s)
            s.ttft[b] = s.ttft.get(b, 0) + 1
        if itl_s is not None:
            b = bucket_of(itl_s)
            s.itl[b] = s.itl.get(b, 0) + 1

    def request_finished(self, record: RequestRecord) -> None:
        s = self._slot()
        s.requests += 1
        s.prompt_tokens += record.prompt_tokens
        s.paths[record.path] = s.paths.get(record.path, 0) + 1
        b = bucket_of(record.e2e_s)
        s.e2e[b] = s.e2e.get(b, 0) + 1
        self.requests_total += 1
        self.recent.append(record)

    def window(self) -> dict[str, Any]:
        """Rates (per second), percentiles (seconds) and totals, as of now."""
        now = self._clock()
        now_s = int(now)
        rate = [s for s in self._slots if s.second > now_s - self.rate_window_s]
        lat = [s for s in self._slots if s.second > now_s - self.latency_window_s]
        span = max(1.0, min(self.rate_window_s - 1 + (now - now_s), now - self._started))

        def merged(attr: str) -> dict[str, Any]:
            out: dict[int, int] = {}
            for s in lat:
                for k, v in getattr(s, attr).items():
                    out[k] = out.get(k, 0) + v
            n = sum(out.values())
            return {"p50": quantile(out, 0.5), "p99": quantile(out, 0.99), "n": n}

        paths: dict[str, int] = {}
        for s in lat:
            for k, v in s.paths.items():
                paths[k] = paths.get(k, 0) + v
        return {
            "rate_window_s": self.rate_window_s,
            "latency_window_s": self.latency_window_s,
            "requests_per_s": sum(s.requests for s in rate) / span,
            "output_tokens_per_s": sum(s.output_tokens for s in rate) / span,
            "prompt_tokens_per_s": sum(s.prompt_tokens for s in rate) / span,
            "ttft": merged("ttft"),
            "itl": merged("itl"),
            "e2e": merged("e2e"),
            "paths": paths,
            "requests_total": self.requests_total,
            "output_tokens_total": self.output_tokens_total,
        }


# ---- worker scraping ------------------------------------------------------------------------

MAX_METRICS_BYTES = 8 << 20  # a worker's page is ~30 KB; anything near this is not one

_WORKER_SERIES = {
    "pdserve:num_requests_running": "running",
    "pdserve:num_requests_waiting": "waiting",
    "pdserve:kv_cache_usage_perc": "kv_usage",
    "pdserve:kv_cache_utilization": "kv_utilization",
    "pdserve:kv_cache_num_blocks": "num_blocks",
    "pdserve:kv_cache_free_blocks": "free_blocks",
    "pdserve:prefix_cache_queries_total": "prefix_queries",
    "pdserve:prefix_cache_hits_total": "prefix_hits",
    "pdserve:num_preemptions_total": "preemptions",
    "pdserve:kv_transfer_bytes_total": "transfer_bytes",
    "pdserve:kv_transfer_failures_total": "transfer_failures",
    "pdserve:prefill_fallbacks_total": "prefill_fallbacks",
    "pdserve:spec_decode_num_drafts_total": "spec_drafts",
    "pdserve:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "pdserve:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
}
COUNTERS = (
    "prefix_queries",
    "prefix_hits",
    "preemptions",
    "transfer_bytes",
    "transfer_failures",
    "prefill_fallbacks",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


def parse_worker_metrics(text: str) -> dict[str, float]:
    """The dashboard's figures from a worker's Prometheus text (label sets summed: transfer
    bytes over both directions, failures over reasons); absent series are absent keys."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = _WORKER_SERIES.get(s.name)
            if key is not None:
                if not math.isfinite(s.value):  # JSON has no NaN: one bad gauge broke the page
                    raise ValueError(f"{s.name} is {s.value}")
                out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass(slots=True)
class _History:
    samples: deque[tuple[float, dict[str, float]]]  # (monotonic time, figures), newest last
    generation: str = ""  # the worker process the samples came from (its registry record's)
    error: str | None = None


class WorkerScraper:
    """Scrapes workers' ``/metrics`` and keeps ``history_s`` of samples per worker for rates."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        timeout_s: float = 0.5,
        history_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.history_s = history_s
        self._clock = clock
        self._hist: dict[str, _History] = {}

    async def _fetch(self, url: str) -> str:
        async with (
            asyncio.timeout(self.timeout_s),
            self.client.stream("GET", url, timeout=self.timeout_s) as r,
        ):
            r.raise_for_status()
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_METRICS_BYTES:  # held in the router's memory otherwise
                    raise ValueError(f"metrics page larger than {MAX_METRICS_BYTES} bytes")
            return body.decode(r.encoding or "utf-8", errors="replace")

    async def scrape(self, records: Iterable[WorkerRecord]) -> None:
        """Fetch every record's metrics URL at once; bounded by ``timeout_s`` in total."""
        records = [r for r in records if r.info.metrics]
        texts = await asyncio.gather(
            *(self._fetch(r.info.metrics) for r in records), return_exceptions=True
        )
        now = self._clock()
        parsed = await asyncio.to_thread(_parse_all, texts)
        live = {r.worker_id for r in records}
        for wid in [w for w in self._hist if w not in live]:
            del self._hist[wid]
        for r, res in zip(records, parsed, strict=True):
            h = self._hist.setdefault(r.worker_id, _History(deque(), r.generation))
            if isinstance(res, BaseException):
                h.error = _describe(res)
                continue
            h.error = None
            if h.samples and (
                h.generation != r.generation  # restarted: another process's counters
                or any(res.get(k, 0.0) < h.samples[-1][1].get(k, 0.0) for k in COUNTERS)
                # scrapes run while a page polls: after a gap, a new window (not an hour's)
                or h.samples[-1][0] < now - self.history_s
            ):
                h.samples.clear()  # (counters that went back: a restart seen only that way)
            h.generation = r.generation
            h.samples.append((now, res))
            while len(h.samples) > 2 and h.samples[0][0] < now - self.history_s:
                h.samples.popleft()

    def view(self, record: WorkerRecord) -> dict[str, Any]:
        """What the page shows for one worker: last figures, errors and windowed rates."""
        if not record.info.metrics:
            return {"ok": False, "error": "no metrics URL in the registry"}
        h = self._hist.get(record.worker_id)
        if h is None or (not h.samples and h.error is None):
            return {"ok": False, "error": "not scraped yet"}
        out: dict[str, Any] = {"ok": h.error is None, "error": h.error}
        if not h.samples:
            return out
        (t0, first), (t1, last) = h.samples[0], h.samples[-1]
        out.update(last)  # the last good figures, with their age; no rates once stale
        out["age_s"] = self._clock() - t1
        q, hits = last.get("prefix_queries", 0.0), last.get("prefix_hits", 0.0)
        out["prefix_hit_rate_total"] = hits / q if q else None
        if h.error is not None or out["age_s"] > self.history_s:
            out.update(delta=None, transfer_bytes_per_s=None, prefix_hit_rate=None)
            return out
        dt = t1 - t0
        out["window_s"] = dt
        delta = {k: last.get(k, 0.0) - first.get(k, 0.0) for k in COUNTERS}
        out["delta"] = delta if dt > 0 else None
        out["transfer_bytes_per_s"] = delta["transfer_bytes"] / dt if dt >= 0.5 else None
        dq = delta["prefix_queries"]
        out["prefix_hit_rate"] = delta["prefix_hits"] / dq if dt > 0 and dq else None
        return out


def _parse_all(
    texts: list[str | BaseException],
) -> list[dict[str, float] | BaseException]:
    out: list[dict[str, float] | BaseException] = []
    for t in texts:
        try:
            out.append(t if isinstance(t, BaseException) else parse_worker_metrics(t))
        except Exception as e:  # noqa: BLE001 - a garbled page is that worker's error only
            out.append(e)
    return out


def _describe(e: BaseException) -> str:
    if isinstance(e, (TimeoutError, httpx.TimeoutException)):
        return "timed out"
    if isinstance(e, httpx.HTTPStatusError):
        return f"HTTP {e.response.status_code}"
    return f"{type(e).__name__}: {e}"[:200]


# ---- aggregation ----------------------------------------------------------------------------


def pool_summary(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and block-weighted averages over one role's worker views (see ``Dashboard``):
    the figures of this scrape's answers only (a worker that stopped answering kept adding its
    last ones), and for running / waiting the lease's where the scrape failed."""
    scraped = [w["scrape"] for w in workers if w["scrape"].get("ok")]

    def total(key: str) -> float:
        return cast(float, sum(s.get(key, 0.0) for s in scraped))

    blocks = sum(s.get("num_blocks", 0.0) for s in scraped)
    kv = (
        sum(s.get("kv_usage", 0.0) * s.get("num_blocks", 0.0) for s in scraped) / blocks
        if blocks
        else None
    )
    deltas = [s["delta"] for s in scraped if s.get("delta")]
    dq = sum(d["prefix_queries"] for d in deltas)
    rates = [
        s["transfer_bytes_per_s"] for s in scraped if s.get("transfer_bytes_per_s") is not None
    ]
    return {
        "workers": len(workers),
        "scraped": sum(1 for w in workers if w["scrape"].get("ok")),
        "kv_usage": kv,
        "blocks_total": sum(w["num_blocks"] for w in workers),
        "blocks_free": sum(w["free_blocks"] for w in workers),
        "prefix_hit_rate": sum(d["prefix_hits"] for d in deltas) / dq if dq else None,
        "prefix_hit_rate_total": (
            total("prefix_hits") / total("prefix_queries") if total("prefix_queries") else None
        ),
        "running": sum(_live(w, "running") for w in workers),
        "waiting": sum(_live(w, "waiting") for w in workers),
        "preemptions": total("preemptions"),
        "preemptions_window": sum(d["preemptions"] for d in deltas),
        "transfer_bytes_per_s": sum(rates) if rates else None,
        "transfer_failures": total("transfer_failures"),
        "prefill_fallbacks": total("prefill_fallbacks"),
        # speculative decoding: share of draft tokens accepted, tokens per speculating step
        "spec_acceptance_rate": (
            total("spec_accepted_tokens") / total("spec_draft_tokens")
            if total("spec_draft_tokens")
            else None
        ),
        "spec_mean_acceptance_length": (
            1.0 + total("spec_accepted_tokens") / total("spec_drafts")
            if total("spec_drafts")
            else None
        ),
    }


def _live(worker: dict[str, Any], key: str) -> float:
    """A worker's running or waiting count: this scrape's, else its lease's."""
    s = worker["scrape"]
    return cast(float, s[key] if s.get("ok") and key in s else worker[key])


def router_totals(registry: Any) -> dict[str, Any]:
    """Cumulative figures from the router's own Prometheus registry."""
    out: dict[str, Any] = {
        "paths": {},
        "errors": {},
        "retries": 0.0,
        "inflight": 0.0,
        "prompt_tokens": 0.0,
        "generation_tokens": 0.0,
    }
    simple = {
        "pdserve:router_retries_total": "retries",
        "pdserve:router_num_requests_inflight": "inflight",
        "pdserve:router_prompt_tokens_total": "prompt_tokens",
        "pdserve:router_generation_tokens_total": "generation_tokens",
    }
    for family in registry.collect():
        for s in family.samples:
            if s.name == "pdserve:router_requests_total":
                p = s.labels.get("path", "")
                out["paths"][p] = out["paths"].get(p, 0.0) + s.value
            elif s.name == "pdserve:router_request_errors_total":
                st = s.labels.get("status", "")
                out["errors"][st] = out["errors"].get(st, 0.0) + s.value
            elif s.name in simple:
                out[simple[s.name]] += s.value
    return out


class Dashboard:
    """Builds ``/dashboard/data``. ``pool`` needs ``records()``, ``healthy(role)``,
    ``inflight(worker_id)``, ``prefill_backlog(worker_id)``, ``decoding(worker_id)``,
    ``restarts(worker_id)`` and ``last_error`` (a :class:`router.workers.WorkerPool`)."""

    def __init__(
        self,
        pool: Any,
        registry: Any,
        live: LiveStats,
        model: str,
        *,
        client: httpx.AsyncClient | None = None,
        scrape_timeout_s: float = 0.5,
        cache_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.live = live
        self.model = model
        self.cache_s = cache_s
        self._own_client = client is None
        # trust_env=False: a proxy configured for the outside world must not see worker scrapes
        self.client = client or httpx.AsyncClient(trust_env=False, follow_redirects=False)
        self.scraper = WorkerScraper(self.client, scrape_timeout_s, clock=clock)
        self._clock = clock
        self._started = clock()
        self._scraped_at: float | None = None
        self._scrape_s = 0.0
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._own_client:
            await self.client.aclose()

    async def data(self) -> dict[str, Any]:
        async with self._lock:  # one scrape at a time; concurrent pages share its result
            if self._scraped_at is None or self._clock() - self._scraped_at >= self.cache_s:
                t0 = self._clock()
                await self.scraper.scrape(self.pool.records())
                self._scraped_at = self._clock()
                self._scrape_s = self._scraped_at - t0
        healthy = {
            r.worker_id for role in (ROLE_PREFILL, ROLE_DECODE) for r in self.pool.healthy(role)
        }
        workers = [
            self._worker(r, r.worker_id in healthy)
            for r in sorted(
                self.pool.records(), key=lambda r: (r.info.role != ROLE_PREFILL, r.worker_id)
            )
        ]
        pools = {
            role: pool_summary([w for w in workers if w["role"] == role])
            for role in (ROLE_PREFILL, ROLE_DECODE)
        }
        kv_rate = pools[ROLE_DECODE]["transfer_bytes_per_s"]
        if kv_rate is None:
            kv_rate = pools[ROLE_PREFILL]["transfer_bytes_per_s"]
        return {
            "model": self.model,
            "now": time.time(),
            "uptime_s": self._clock() - self._started,
            "window": self.live.window(),
            "router": router_totals(self.registry),
            "pools": pools,
            "cluster": {
                "transfer_bytes_per_s": kv_rate,
                "preemptions": sum(p["preemptions"] for p in pools.values()),
                "preemptions_window": sum(p["preemptions_window"] for p in pools.values()),
            },
            "workers": workers,
            "recent": [r.to_json() for r in reversed(self.live.recent)],
            "registry_error": self.pool.last_error,
            "scrape": {"age_s": self._clock() - self._scraped_at, "duration_s": self._scrape_s},
        }

    def _worker(self, r: WorkerRecord, healthy: bool) -> dict[str, Any]:
        return {
            "id": r.worker_id,
            "role": r.info.role,
            "address": r.info.grpc,
            "metrics_url": r.info.metrics,
            "num_blocks": r.info.num_blocks,
            "free_blocks": r.load.free_blocks,
            "running": r.load.running,
            "waiting": r.load.waiting,
            "inflight": self.pool.inflight(r.worker_id),
            "prefill_backlog": self.pool.prefill_backlog(r.worker_id),
            "decoding": self.pool.decoding(r.worker_id),
            "healthy": healthy,
            "generation": r.generation,
            "restarts": self.pool.restarts(r.worker_id),
            "scrape": self.scraper.view(r),
        }


def add_dashboard_routes(app: FastAPI) -> None:
    """``GET /dashboard`` and ``GET /dashboard/data`` (needs ``app.state.dashboard``)."""
    page = PAGE.read_bytes()
    headers = {
        "Cache-Control": "no-store",
        "Content-Security-Policy": _CSP,
        "X-Content-Type-Options": "nosniff",
    }

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return HTMLResponse(page, headers=headers)

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request) -> Response:
        data = await request.app.state.dashboard.data()
        return JSONResponse(data, headers={"Cache-Control": "no-store"})
