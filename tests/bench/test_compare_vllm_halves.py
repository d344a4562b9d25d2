"""``bench/compare_vllm.py``: ratios over the seeds both halves ran, runs with failed requests
marked and failing the exit status, and a saved half reused only when it was run the same way
(servers and ``vllm bench serve`` faked: no process, no network)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import compare_vllm as cv

pytestmark = pytest.mark.unit


def _run(workload, seed, tput, ttft, failed=0, completed=64):
    return {
        "workload": workload,
        "seed": seed,
        "metrics": {
            "completed": completed,
            "failed": failed,
            "output_throughput": tput,
            "median_ttft_ms": ttft,
            "p99_ttft_ms": ttft,
            "median_tpot_ms": 1.0,
            "p99_itl_ms": 1.0,
        },
    }


def test_ratios_use_only_the_seeds_both_halves_ran():
    """A vLLM half of seeds 100-102 against a pdserve half of 100-101: seed 102 (vLLM's
    slowest here) must not be in vLLM's mean."""
    pd = {"runs": [_run("r256_n64", 100, 1000, 50), _run("r256_n64", 101, 1000, 50)]}
    vl = {"runs": [_run("r256_n64", s, 1000, t) for s, t in ((100, 50), (101, 50), (102, 500))]}
    m = cv.ratios(pd, vl)["r256_n64"]["median_ttft_ms"]
    assert m["vllm"]["n"] == 2 and m["ratio"]["mean"] == pytest.approx(1.0)
    assert m["seeds"] == [100, 101]
    # no seed in common: no ratio
    other = {"runs": [_run("r256_n64", 500, 1000, 25)]}
    assert cv.ratios(other, vl)["r256_n64"]["median_ttft_ms"]["ratio"] is None


def test_a_ratio_over_runs_with_failed_requests_is_marked():
    """60 of 64 failed: vllm bench serve's TTFT is over the 4 that succeeded (2x "better")."""
    pd = {"runs": [_run("r256_n64", 100, 1000, 50, failed=60, completed=4)]}
    vl = {"runs": [_run("r256_n64", 100, 1000, 100)]}
    text = cv.format_tables(cv.ratios(pd, vl))
    row = next(ln for ln in text.splitlines() if ln.startswith("| r256_n64 | 1"))
    assert "0.50x!" in row, row
    assert "r256_n64: pdserve seed 100: 60 of 64 requests failed" in text
    clean = cv.format_tables(cv.ratios(vl, vl))
    assert "!" not in clean


# ---- main(): saved halves --------------------------------------------------------------


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """main() with fake measure(): records which halves ran; ``failed[(label, workload)]``
    gives a run failed requests."""
    vllm_py = tmp_path / "python"
    vllm_py.write_text("")
    monkeypatch.setattr(cv, "VLLM_PY", vllm_py)
    monkeypatch.setattr(cv, "ensure_model", lambda p: p)
    monkeypatch.setattr(cv, "loadavg", lambda: [0.0, 0.0, 0.0])
    state: dict = {"ran": [], "failed": {}}

    def fake_measure(server, model, workloads, seeds, seed_base, raw, label, *rest):
        state["ran"].append(label)
        runs = []
        for wi, w in workloads:
            for rep in range(seeds):
                bad = state["failed"].get((label, w.name), 0)
                runs.append(_run(w.name, cv.seed_for(wi, rep, seed_base), 1000, 50, bad, 64 - bad))
        return {"system": label, "runs": runs, "started": "now", "temperature": rest[-1]}

    monkeypatch.setattr(cv, "measure", fake_measure)

    def main(*args: str) -> int:
        base = ["--out-dir", str(tmp_path / "out"), "--raw-dir", str(tmp_path / "raw")]
        return cv.main([*base, "--no-plot", "--seeds", "2", *args])

    state["main"] = main
    state["out"] = tmp_path / "out"
    return state


def test_a_failed_run_makes_the_exit_status_non_zero(harness, capsys):
    assert harness["main"]("--quick") == 0
    harness["failed"][("pdserve", "r256_n64")] = 3
    capsys.readouterr()
    assert harness["main"]("--quick", "--skip-vllm") == 1
    out = capsys.readouterr().out
    assert "3 of 64 requests failed" in out and "1.00x!" in out, out


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--seed-base", "500"], "seeds"),
        (["--seeds", "3"], "seeds"),
        (["--model-dir", "/elsewhere"], "model"),
        (["--vllm-extra=--enforce-eager"], "server"),
        (["--top-p", "0.9"], "top_p"),
    ],
)
def test_a_saved_half_run_another_way_is_not_reused(harness, capsys, flags, needle):
    assert harness["main"]("--quick") == 0
    capsys.readouterr()
    assert harness["main"]("--quick", "--skip-vllm", *flags) == 2
    out = capsys.readouterr().out
    assert "--skip-vllm: cannot reuse" in out and needle in out, out
    assert harness["ran"] == ["vllm", "pdserve"]  # nothing ran the second time


def test_a_saved_pdserve_half_with_other_flags_is_not_reused(harness, capsys):
    assert harness["main"]("--quick") == 0
    capsys.readouterr()
    assert harness["main"]("--quick", "--skip-pdserve", "--pdserve-extra=--spec 2") == 2
    assert "--skip-pdserve: cannot reuse" in capsys.readouterr().out


def test_a_saved_half_run_the_same_way_is_reused(harness):
    assert harness["main"]("--quick") == 0
    assert harness["main"]("--quick", "--skip-vllm") == 0
    assert harness["ran"] == ["vllm", "pdserve", "pdserve"]


def test_a_workload_subset_does_not_overwrite_the_full_run(harness):
    assert harness["main"]() == 0
    full = {p.name: p.read_text() for p in Path(harness["out"]).glob("compare_full*.json")}
    assert "compare_full_vllm.json" in full
    assert harness["main"]("--workloads", "r256_n64") == 0
    after = {p.name: p.read_text() for p in Path(harness["out"]).glob("compare_full*.json")}
    assert after == full
    sub = json.loads((harness["out"] / "compare_workloads_r256_n64_vllm.json").read_text())
    assert {r["workload"] for r in sub["runs"]} == {"r256_n64"}


# ---- --interleave ----------------------------------------------------------------------


@pytest.fixture
def interleave(tmp_path, monkeypatch):
    """measure_interleaved over three fake servers (a ``sleep`` process each, so the real
    SIGCONT of the clean-up touches nothing else): records starts, stops, pauses, resumes and
    runs in order; ``fail[name] = n``: that server's n-th resume times out."""
    import subprocess

    events: list[tuple] = []
    fail: dict[str, int] = {}
    procs: list[subprocess.Popen] = []

    class FakeServer(cv.Server):
        def __init__(self, name: str) -> None:
            super().__init__(0, tmp_path / f"{name}.log", 60)
            self.name = name
            self.resumes = 0

        def start(self, startup_timeout: float) -> None:
            events.append(("start", self.name))
            self.proc = subprocess.Popen(["sleep", "60"])
            procs.append(self.proc)

        def stop(self, grace_s: float = 60.0) -> None:
            events.append(("stop", self.name))

        def pause(self) -> None:
            events.append(("pause", self.name))

        def resume(self, timeout_s: float = 120.0) -> float:
            self.resumes += 1
            if fail.get(self.name) == self.resumes:
                raise TimeoutError(f"{self.name} not serving 120s after SIGCONT")
            events.append(("resume", self.name))
            return 0.5

    monkeypatch.setattr(cv, "loadavg", lambda: [0.0, 0.0, 0.0])
    monkeypatch.setattr(cv, "scrape_all", lambda server: {})
    monkeypatch.setattr(cv, "warmup", lambda server, *a: {"short": {}, "long": {}})
    monkeypatch.setattr(cv, "scan_log", lambda path: {})

    def fake_bench(base_url, model, args, seed, raw_dir, name, **kw):
        events.append(("run", name))
        return {"seed": seed, "rc": 0, "metrics": {}, "load_before": [0.0], "load_after": [0.0]}

    monkeypatch.setattr(cv, "vllm_bench", fake_bench)
    servers = {n: FakeServer(n) for n in ("vllm", "pdserve-colocated-1D", "pdserve-1P1D")}
    chosen = [(i, w) for i, w in enumerate(cv.WORKLOADS) if w.name in ("r256_n64", "r1088_n64")]

    def run():
        return cv.measure_interleaved(servers, "m", chosen, 3, 100, tmp_path, 60, 0, 0)

    yield SimpleNamespace(events=events, fail=fail, servers=servers, chosen=chosen, run=run)
    for proc in procs:
        proc.kill()
        proc.wait()


def test_interleave_runs_every_seed_on_every_system_in_rotated_order(interleave):
    """All servers up at once, started and stopped once each; every (workload, seed) runs on
    every system, the first system of each seed rotating, only that system running (the others
    paused), and each run lands in its own system's record."""
    recs = interleave.run()
    events, servers, chosen = interleave.events, interleave.servers, interleave.chosen
    starts = [e[1] for e in events if e[0] == "start"]
    stops = [e[1] for e in events if e[0] == "stop"]
    assert starts == stops == list(servers)
    # each run: its system resumed just before, paused right after; the others stay paused
    running: set[str] = set()
    for kind, name in events:
        if kind == "resume":
            running.add(name)
        elif kind == "pause":
            running.discard(name)
        elif kind == "run":
            assert running == {name.split("_")[0]}, (name, running)
    runs = [e[1] for e in events if e[0] == "run"]
    assert len(runs) == 2 * 3 * 3
    firsts = [runs[i].split("_")[0] for i in range(0, len(runs), 3)]
    assert firsts[:3] == ["vllm", "pdserve-colocated-1D", "pdserve-1P1D"]  # rotated per seed
    for label, rec in recs.items():
        got = sorted((r["workload"], r["seed"]) for r in rec["runs"])
        want = sorted((w.name, cv.seed_for(wi, rep, 100)) for wi, w in chosen for rep in range(3))
        assert got == want, label
        assert all(set(r["idle_peers_cpu_s"]) == set(servers) - {label} for r in rec["runs"])
        assert rec["interleaved_with"] == [x for x in servers if x != label]
        assert all(r["resume_s"] == 0.5 for r in rec["runs"])
        assert "server_cpu_s" in rec and "gone" not in rec
    # SIGSTOP does not stop a server's `timeout` countdown: the lifetime covers all of them
    assert all(srv.lifetime_s == 60 * 3 for srv in servers.values())


def test_a_system_that_does_not_come_back_fails_its_own_runs_only(interleave):
    """Its third resume times out: its remaining seeds are error runs, the other systems run
    every seed, every record is returned (before, the error left measure_interleaved and every
    system's results were lost), and every server is stopped."""
    interleave.fail["pdserve-1P1D"] = 3
    recs = interleave.run()
    bad = recs["pdserve-1P1D"]
    assert [("error" in r) for r in bad["runs"]] == [False, False] + [True] * 4
    assert "not serving" in bad["gone"] and "server_cpu_s" not in bad
    for label in ("vllm", "pdserve-colocated-1D"):
        assert len(recs[label]["runs"]) == 6 and not any("error" in r for r in recs[label]["runs"])
    assert [e[1] for e in interleave.events if e[0] == "stop"] == list(interleave.servers)


def test_interleave_takes_no_saved_half(harness, capsys):
    assert harness["main"]("--quick", "--interleave", "--skip-vllm") == 2
    assert "takes no --skip" in capsys.readouterr().out


def test_a_saved_interleaved_half_is_not_reused_by_a_run_on_its_own():
    want = {"model": "m", "temperature": 0, "top_p": None, "server": {}, "workloads": {}}
    assert cv.setup_mismatch({**want, "interleaved": False}, {**want, "interleaved": False}) is None
    assert cv.setup_mismatch(dict(want), {**want, "interleaved": False}) is None  # older halves
    why = cv.setup_mismatch({**want, "interleaved": True}, {**want, "interleaved": False})
    assert why == "it ran interleaved"


def test_sigterm_stops_every_server_of_an_interleaved_run(interleave, monkeypatch):
    """A SIGTERM in the middle of an interleaved run (a ``kill``, a ``timeout`` around it) ends
    it as Ctrl-C does: every server is resumed and stopped. Before, the default action ended the
    process at once and left the paused systems SIGSTOPped, holding their ports."""
    import os
    import signal

    real = cv.vllm_bench
    count = {"runs": 0}

    def bench_then_term(*args, **kw):
        count["runs"] += 1
        if count["runs"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kw)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cv, "vllm_bench", bench_then_term)
    with pytest.raises(SystemExit) as exc, cv.sigterm_as_exit():
        interleave.run()
    assert exc.value.code == 128 + signal.SIGTERM
    assert [e[1] for e in interleave.events if e[0] == "stop"] == list(interleave.servers)
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back
    # the second run never started: the signal ended the run at once
    assert len([e for e in interleave.events if e[0] == "run"]) == 1
