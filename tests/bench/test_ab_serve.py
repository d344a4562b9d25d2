"""``bench/ab_serve.py``: variants parsed strictly, rounds alternate, the same seeds for every
variant of a round, and the summary's ratios and paired per-round ratios computed from the runs."""

from __future__ import annotations

import pytest

from bench.ab_serve import parse_args, parse_variant, round_order, run_seed, summarize


def _run(variant, rnd, tput, ttft, workload="prefixrep1024"):
    return {
        "variant": variant,
        "round": rnd,
        "workload": workload,
        "metrics": {
            "completed": 64,
            "output_throughput": tput,
            "p99_ttft_ms": ttft,
            "median_tpot_ms": 10.0,
            "p99_itl_ms": 20.0,
        },
    }


def test_summary_ratios_are_to_the_first_variant_and_paired_by_round():
    runs = [
        _run("base", 0, 1000, 100),
        _run("base", 0, 1200, 100),
        _run("new", 0, 1320, 90),
        _run("new", 0, 1320, 90),
        _run("new", 1, 900, 80),
        _run("base", 1, 1000, 100),
        {"variant": "new", "round": 1, "workload": "prefixrep1024", "error": "no result"},
    ]
    s = summarize(runs, ["base", "new"])["prefixrep1024"]
    assert s["base"]["output_throughput"]["mean"] == pytest.approx(3200 / 3)
    assert "ratio" not in s["base"]["output_throughput"]
    new = s["new"]["output_throughput"]
    assert (new["min"], new["max"]) == (900, 1320)
    assert new["ratio"] == pytest.approx((3540 / 3) / (3200 / 3))
    assert new["paired"] == pytest.approx([1320 / 1100, 0.9])  # round 0, round 1
    assert s["new"]["p99_ttft_ms"]["ratio"] == pytest.approx((260 / 3) / 100)


def test_rounds_alternate_and_seeds_repeat_only_across_variants():
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    seeds = {run_seed(900, wi, r, s, 2) for wi in range(6) for r in range(5) for s in range(2)}
    assert len(seeds) == 6 * 5 * 2


@pytest.mark.parametrize(
    "spec", ["not json", "[]", '{"env": {"A": 1}}', '{"args": "--x"}', '{"flags": []}']
)
def test_a_malformed_variant_is_a_usage_error(spec):
    with pytest.raises(SystemExit, match="--variant x"):
        parse_variant("x", spec)


def test_arguments():
    a = parse_args(
        ["--topology", "1x1", "--workloads", "r256_n64,prefixrep1024"]
        + ["--variant", "base", "{}", "--variant", "off", '{"env": {"PDSERVE_X": "0"}}']
    )
    assert a.topo == (1, 1) and [w.name for w in a.wl] == ["r256_n64", "prefixrep1024"]
    assert a.variants["off"] == {"env": {"PDSERVE_X": "0"}, "args": []}
    with pytest.raises(SystemExit):
        parse_args(["--variant", "base", "{}"])  # one variant
    for topology in ("1x0", "two", "1x1x1"):
        with pytest.raises(SystemExit):
            parse_args(["--topology", topology, "--variant", "a", "{}", "--variant", "b", "{}"])
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "nope", "--variant", "a", "{}", "--variant", "b", "{}"])
