"""Metric definitions and arrival processes on hand-made records (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.client import RequestRecord
from bench.metrics import (
    MetricsError,
    compute_metrics,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
    peak_concurrency,
)
from bench.runner import arrival_offsets

pytestmark = pytest.mark.unit

ALL = ["ttft", "tpot", "itl", "e2el"]


def _rec(i, ttft, itl, out, start=0.0, prompt=10, ok=True, error=""):
    r = RequestRecord(i, i, 0, prompt, out, start=start, success=ok, error=error)
    r.ttft, r.itl, r.output_tokens = ttft, list(itl), out
    r.latency = ttft + sum(itl)
    r.end = start + r.latency
    return r


def test_tpot_itl_e2e_and_throughput_definitions():
    recs = [
        _rec(0, 0.100, [0.010, 0.020, 0.030], out=4),  # tpot = 0.06/3
        _rec(1, 0.200, [0.040], out=5, start=0.05),  # 5 tokens in 2 events: tpot = 0.04/4
        _rec(2, 0.300, [], out=1, start=0.1),  # single token: no TPOT
        _rec(3, 0, [], out=0, ok=False, error="HTTP 500: boom"),
        _rec(4, 0, [], out=0, ok=False, error="HTTP 500: boom"),
    ]
    m = compute_metrics(recs, duration=2.0, percentiles=[50, 99], metrics=ALL)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert m["errors"] == {"HTTP 500: boom": 2}
    assert m["ttft"]["mean"] == pytest.approx(200.0)
    assert m["tpot"]["mean"] == pytest.approx((20.0 + 10.0) / 2)
    assert m["itl"]["median"] == pytest.approx(25.0)  # gaps 10, 20, 30, 40 pooled
    assert m["itl"]["p99"] == pytest.approx(np.percentile([10, 20, 30, 40], 99))
    assert m["e2el"]["mean"] == pytest.approx((160 + 240 + 300) / 3)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(20.0)


def test_goodput_uses_all_given_slos():
    recs = [
        _rec(0, 0.1, [0.01] * 9, out=10),  # ttft 100, tpot 10
        _rec(1, 0.6, [0.01] * 9, out=10),  # ttft 600
        _rec(2, 0.1, [0.09] * 9, out=10),  # tpot 90
        _rec(3, 0.1, [], out=1),  # tpot counts as 0
    ]
    m = compute_metrics(recs, 2.0, [50], ALL, slos={"ttft": 500, "tpot": 50})
    assert m["goodput"]["good_requests"] == 2
    assert m["goodput"]["request_goodput"] == pytest.approx(1.0)


def test_all_failed_gives_none_latencies_and_zero_rates():
    recs = [_rec(0, 0, [], 0, ok=False, error="x")]
    m = compute_metrics(recs, 0.0, [99], ALL)
    assert m["ttft"] == {"mean": None, "median": None, "std": None, "p99": None}
    assert m["output_throughput"] == 0.0 and m["request_throughput"] == 0.0


def test_peak_concurrency():
    recs = [_rec(0, 1.0, [], 1, start=0.0), _rec(1, 1.0, [], 1, start=0.5)]
    recs.append(_rec(2, 1.0, [], 1, start=1.0))  # starts as request 0 ends
    assert peak_concurrency(recs) == 2


def test_parsers_reject_bad_specs():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert parse_percentile_metrics("ttft, itl") == ["ttft", "itl"]
    for bad in (["ttft=5"], ["itl:5"], ["tpot:x"], ["ttft:0"]):
        with pytest.raises(MetricsError):
            parse_goodput(bad)
    with pytest.raises(MetricsError):
        parse_percentiles("a,b")
    with pytest.raises(MetricsError):
        parse_percentile_metrics("ttft,latency")


def test_poisson_arrivals_have_the_requested_rate():
    t = arrival_offsets(20000, rate=8.0, burstiness=1.0, seed=3)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    np.testing.assert_array_equal(t, arrival_offsets(20000, 8.0, 1.0, seed=3))


def test_burstiness_changes_the_spread_not_the_rate():
    gaps = np.diff(arrival_offsets(20000, rate=4.0, burstiness=0.25, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)  # gamma CV = 1/sqrt(k)


def test_infinite_rate_sends_everything_at_once():
    assert not arrival_offsets(5, math.inf, 1.0, 0).any()
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, 1.0, 0)
