"""Prometheus metrics of a worker (names follow vLLM's with the ``pdserve:`` prefix).

Engine figures are read from ``EngineCore.stats()`` at scrape time by a collector; request
latencies are histograms the services observe. Each worker builds its own registry (no global
state), labelled with ``role``, ``worker_id`` and ``model_name``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from shared.engine import EngineStats
from shared.prom import GcCollector, LoopHistogram

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


# engine step durations: from a one-token decode step (~1 ms) to a long prefill chunk
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
# vLLM's buckets for vllm:iteration_tokens_total
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector:
    def __init__(self, stats_fn: Callable[[], EngineStats], labels: dict[str, str]) -> None:
        self.stats_fn = stats_fn
        self.labels = labels

    def collect(self):
        s = self.stats_fn()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc, v):
            g = GaugeMetricFamily(f"pdserve:{name}", doc, labels=names)
            g.add_metric(values, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=names)
            c.add_metric(values, v)
            return c

        yield gauge(
            "num_requests_running", "Sequences running (incl. waiting for remote KV).", s.running
        )
        yield gauge("num_requests_waiting", "Sequences waiting or swapped out.", s.waiting)
        yield gauge(
            "prefill_backlog_tokens",
            "Prompt tokens admitted and not computed yet (waiting, running or swapped out): "
            "the prefill work queued on this worker; a prefill pool's scaling signal.",
            s.prefill_backlog_tokens,
        )
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks held by live requests.", s.kv_cache_usage
        )
        yield gauge(
            "kv_cache_utilization",
            "Tokens held / token slots allocated to running requests.",
            s.kv_utilization,
        )
        yield gauge("kv_cache_num_blocks", "KV blocks in the pool.", s.num_blocks)
        yield gauge(
            "kv_cache_free_blocks", "Free KV blocks (incl. cached free blocks).", s.free_blocks
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, once per request at its first "
            "admission (a re-admission after a preemption is not counted, as in vLLM).",
            s.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache, at a request's first admission (as "
            "prefix_cache_queries).",
            s.prefix_cache_hits,
        )
        yield counter("num_preemptions", "Preempted sequences.", s.num_preemptions)
        # speculative decoding, vLLM's names (zero without --speculative-config)
        yield counter(
            "spec_decode_num_drafts", "Sequence-steps that carried drafts.", s.spec_num_drafts
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            s.spec_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each draft position (0 = the first draft).",
            labels=[*names, "position"],
        )
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([*values, str(pos)], n)
        yield per_pos


class _LoopCounter:
    """A Prometheus counter with one fixed label set and no lock, for a count taken on every
    streamed output (``Counter.inc`` takes a lock each time). Counted and collected on the
    event loop thread only, as :class:`shared.prom.LoopHistogram`; exposed as ``Counter``'s
    (``_total`` and ``_created``)."""

    def __init__(
        self, name: str, documentation: str, labels: dict[str, str], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labels = labels
        self._value = 0.0
        self._created = time.time()
        registry.register(self)

    def inc(self, amount: float = 1) -> None:
        self._value += amount

    def describe(self) -> list[Metric]:
        return [Metric(self._name, self._doc, "counter")]

    def collect(self) -> list[Metric]:
        m = Metric(self._name, self._doc, "counter")
        m.add_sample(self._name + "_total", self._labels, self._value)
        m.add_sample(self._name + "_created", self._labels, self._created)
        return [m]


class WorkerMetrics:
    def __init__(
        self, role: str, worker_id: str, model: str, stats_fn: Callable[[], EngineStats]
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "worker_id": worker_id, "model_name": model}
        self.registry.register(_EngineCollector(stats_fn, labels))
        GcCollector(labels, self.registry)
        names = list(labels)
        kw = dict(labelnames=names, registry=self.registry)
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=LATENCY_BUCKETS,
            **kw,
        ).labels(**labels)
        # observed per token on the gRPC event loop: the lock-free kind
        self.itl = LoopHistogram(
            "pdserve:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            LATENCY_BUCKETS,
            self.registry,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Arrival to finish, or to the end of a request ended early (aborted, a stop string, "
            "a deadline, a failure); once per request. Not for a request resumed here after a "
            "failover (it arrived on the worker that failed).",
            buckets=LATENCY_BUCKETS + (160.0, 320.0),
            **kw,
        ).labels(**labels)
        self.queue = Histogram(
            "pdserve:request_queue_time_seconds",
            "Arrival to first scheduled; once per request, at its first token.",
            buckets=LATENCY_BUCKETS,
            **kw,
        ).labels(**labels)
        # observed on the engine thread after every step (prometheus_client's locking kind)
        self.step_time = Histogram(
            "pdserve:engine_step_seconds",
            "Duration of each engine step: schedule, forward pass, sampling, bookkeeping.",
            buckets=STEP_BUCKETS,
            **kw,
        ).labels(**labels)
        self.iteration_tokens = Histogram(
            "pdserve:iteration_tokens_total",
            "Tokens scheduled per engine step (prompt chunks and decode tokens).",
            buckets=ITERATION_TOKEN_BUCKETS,
            **kw,
        ).labels(**labels)
        self.requests = Counter(
            "pdserve:request_success",
            "Finished sequences (each sample of an n > 1 request) by finish reason, once each: "
            "stop, length, abort (ended early: client gone, deadline, failover, or a stop "
            "string the worker cannot tell from those), error (failed); stop also counts a "
            "sample the router ended by a stop string while others ran on (DecodeWorker.Abort).",
            labelnames=names + ["finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens",
            "Prompt tokens of requests, counted once per request at its first token (also for "
            "a request that ends early after it; a request resumed here after a failover counts "
            "its prompt again: it is prefilled again here).",
            **kw,
        ).labels(**labels)
        # counted per output on the gRPC event loop: the lock-free kind
        self.generation_tokens = _LoopCounter(
            "pdserve:generation_tokens",
            "Tokens generated, counted as each step's tokens are streamed (also those of "
            "requests that end early).",
            labels,
            self.registry,
        )
        self.prefill_fallbacks = Counter(
            "pdserve:prefill_fallbacks",
            "Remote prefills that failed and were done locally.",
            labelnames=names + ["reason"],
            registry=self.registry,
        )
        self.paths = Counter(
            "pdserve:decode_prefill_path",
            "Requests by prefill path (local, disagg, fallback: a remote prefill done here after all), counted as they end.",
            labelnames=names + ["path"],
            registry=self.registry,
        )
        self.engine_hung = Gauge(
            "pdserve:engine_hung",
            "1 while the engine thread made no progress for --engine-hang-timeout.",
            **kw,
        ).labels(**labels)
        self.engine_hangs = Counter(
            "pdserve:engine_hangs", "Times the engine stopped progressing.", **kw
        ).labels(**labels)
        self._labels = labels

    def hung(self, now: bool) -> None:
        self.engine_hung.set(1 if now else 0)
        if now:
            self.engine_hangs.inc()

    def finished(self, reason: str) -> None:
        self.requests.labels(**self._labels, finished_reason=reason).inc()

    def fallback(self, reason: str) -> None:
        self.prefill_fallbacks.labels(**self._labels, reason=reason).inc()

    def path(self, path: str) -> None:
        self.paths.labels(**self._labels, path=path).inc()

    def observe_step(self, seconds: float, tokens: int) -> None:
        """One engine step (engine thread): its duration and the tokens it scheduled."""
        self.step_time.observe(seconds)
        self.iteration_tokens.observe(tokens)
