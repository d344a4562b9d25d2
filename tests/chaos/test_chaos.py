"""The chaos suite's short form (``bench/chaos.py``): real processes started one by one, a
steady load of greedy streams with known outputs, and faults while streams are mid-flight:
nothing may be lost, duplicated or changed, and a frozen worker must not hold its streams for
the whole freeze. The full suite (20 s freezes, Redis down 30 s, a 10,000-request soak) is
``pdserve chaos``; its figures are in docs/benchmarks.md, "Reliability"."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench import chaos

pytestmark = pytest.mark.integration


def test_faults_under_load_lose_nothing(tmp_path):
    p = argparse.ArgumentParser()
    chaos.add_cli_args(p)
    args = p.parse_args(
        [
            "--faults",
            "kill-decode,kill-prefill,stop-decode,slow-readers,kill-redis,drain,kill-router,"
            "stop-router",
            "--freeze",
            "8",
            "--slow-read",
            "4",
            "--before",
            "1",
            "--after",
            "2",
            "--soak",
            "150",
            "--cases",
            "12",
            "--run-dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "chaos.json"),
            "--router-arg=--stall-timeout=1.5",
            # the router's silent-call timer well inside the 8 s freezes, so that a stopped
            # router resumes with it overdue (stop-router)
            "--router-arg=--worker-stall-timeout=5",
        ]
    )
    report_rc = asyncio.run(chaos.main_async(args))
    import json

    report = json.loads((tmp_path / "chaos.json").read_text())
    rows = {f["fault"]: f for f in report["faults"]}
    for name, f in rows.items():
        assert f["started"] > 0, name
        assert (f["lost"], f["duplicated"], f["wrong"]) == (0, 0, 0), (name, f["examples"])
    # the frozen decode worker's streams fail over within seconds, not at the end of the freeze
    assert rows["stop-decode"]["longest_s"] < 8.0, rows["stop-decode"]
    # requests sent while the router restarts wait for it on the socket pdserve up holds
    # (refused before: thousands of connection errors in one restart), and only the streams
    # in flight through the killed router end with it
    kr = rows["kill-router"]
    assert kr["identical"] + kr["cut"] == kr["started"] and kr["identical"] > kr["cut"], kr
    # a router stopped for 8 s (past its 5 s --worker-stall-timeout and gRPC's keepalive)
    # takes its own pause for no worker's failure: every stream through it goes on whole
    sr = rows["stop-router"]
    assert sr["identical"] == sr["started"], sr
    assert sr["longest_s"] >= 8.0, sr  # the streams really waited out the freeze
    # slow readers get their whole, identical streams (and fail no worker)
    assert rows["slow-readers"]["identical"] == rows["slow-readers"]["started"]
    soak = report["soak"]
    assert soak["lost"] == soak["duplicated"] == soak["wrong"] == 0, soak["examples"]
    assert soak["identical"] + soak["cancelled"] == soak["requests"] == 150
    for name, w in report["workers_end"].items():
        assert w["integrity_ok"] and w["used_blocks"] == 0, (name, w)
    assert report["restarts"]["decode-0"] >= 1 and report["restarts"]["prefill-0"] >= 1
    assert report_rc == 0 and report["ok"]
