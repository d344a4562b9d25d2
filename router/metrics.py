"""Router Prometheus metrics (names from ``docs/architecture.md``; one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.directory.mirror import DirectoryMirror
from shared.prom import GcCollector, LoopHistogram

# vLLM's buckets for the same metrics
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
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
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
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
_E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class RouterMetrics:
    """All router metrics in a private registry (tests and multiple apps do not collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.requests = Counter(
            "pdserve:router_requests",
            "Requests routed, by the path taken "
            "(disagg | local | fallback as reported by the decode worker)",
            ["model_name", "path"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve:router_retries",
            "Requests re-sent to another worker (before or after the first token)",
            labels,
            registry=r,
        )
        self.errors = Counter(
            "pdserve:router_request_errors",
            "Requests answered with an error",
            ["model_name", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve:router_time_to_first_token_seconds",
            "Arrival at the router -> first output token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        GcCollector({"model_name": model_name, "role": "router"}, r)
        # observed once per streamed token: the lock-free kind (one label set: this model)
        self.itl = LoopHistogram(
            "pdserve:router_inter_token_latency_seconds",
            "Time between output deltas of one prompt's stream",
            {"model_name": model_name},
            _ITL_BUCKETS,
            r,
        )
        self.e2e = Histogram(
            "pdserve:router_e2e_request_latency_seconds",
            "Arrival at the router -> last output token",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.lookup = Histogram(
            "pdserve:router_directory_lookup_seconds",
            "Prefix-directory lookup (one Redis pipeline)",
            labels,
            buckets=_LOOKUP_BUCKETS,
            registry=r,
        )
        self.lookup_local = Histogram(
            "pdserve:router_directory_mirror_lookup_seconds",
            "Prefix-directory lookup in the router's own copy of the directory",
            labels,
            buckets=(0.00001, 0.000025, 0.00005, 0.0001, *_LOOKUP_BUCKETS),
            registry=r,
        )
        self.mirror_synced = Gauge(
            "pdserve:router_directory_mirror_synced",
            "1 while the router's copy of the directory follows Redis (lookups stay local)",
            labels,
            registry=r,
        )
        self.mirror_blocks = Gauge(
            "pdserve:router_directory_mirror_blocks",
            "Blocks held by some worker in the router's copy of the directory",
            labels,
            registry=r,
        )
        self.mirror_loads = Gauge(
            "pdserve:router_directory_mirror_loads",
            "Times the router's copy of the directory was loaded from Redis (start, resyncs)",
            labels,
            registry=r,
        )
        self.mirror_event = Gauge(
            "pdserve:router_directory_mirror_last_event",
            "Number of the last directory event the router's copy applied (the counter "
            "kvevn:{model} in Redis is the last one written)",
            labels,
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "pdserve:router_prefix_hit_tokens",
            "Prompt tokens already cached on the chosen decode worker",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve:router_prompt_tokens", "Prompt tokens routed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "pdserve:router_generation_tokens",
            "Output tokens returned (counted as they are streamed)",
            labels,
            registry=r,
        )
        self.inflight = Gauge(
            "pdserve:router_num_requests_inflight",
            "HTTP generation requests in flight",
            labels,
            registry=r,
        )
        m = model_name
        self.c_retries = self.retries.labels(m)
        self.c_ttft, self.c_itl, self.c_e2e = self.ttft.labels(m), self.itl, self.e2e.labels(m)
        self.c_lookup = self.lookup.labels(m)
        self.c_lookup_local = self.lookup_local.labels(m)
        self.c_hit = self.prefix_hit_tokens.labels(m)
        self.c_prompt, self.c_gen = self.prompt_tokens.labels(m), self.generation_tokens.labels(m)
        self.c_inflight = self.inflight.labels(m)
        self._model = m
        for path in ("disagg", "local", "fallback"):
            self.requests.labels(m, path)

    def watch_mirror(self, mirror: DirectoryMirror) -> None:
        """Read the mirror's state at each scrape."""
        m = self._model
        self.mirror_synced.labels(m).set_function(lambda: float(mirror.synced))
        self.mirror_blocks.labels(m).set_function(lambda: float(mirror.num_blocks))
        self.mirror_loads.labels(m).set_function(lambda: float(mirror.resyncs))
        self.mirror_event.labels(m).set_function(lambda: float(mirror.position))

    def routed(self, path: str) -> None:
        self.requests.labels(self._model, path).inc()

    def error(self, status: int) -> None:
        self.errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
