"""``pdserve chaos``: faults under load, and a soak, against real processes; nothing may be lost.

    pdserve chaos --out bench/results/chaos.json              # every fault, then the soak
    pdserve chaos --faults kill-decode,stop-decode --soak 0    # a subset

The cluster is started one process at a time as compose starts it: Redis (a local
``redis-server`` on a fixed port, so that it can be killed and started again), the router, one
prefill and two decode workers, each its own process, with a supervisor that restarts whatever
exits (``pdserve up``'s, as compose's ``restart: unless-stopped`` would). A steady load of
greedy streaming requests runs throughout; every prompt's output is known beforehand (one
undisturbed run each, at the start), long prompts take the disaggregated path. Each fault is
injected while streams are mid-flight, then the load goes on until the cluster recovered:

  kill-decode      kill -9 a decode worker (restarted by the supervisor)
  kill-prefill     kill -9 the prefill worker while long prompts are being transferred
  kill-redis       kill -9 Redis, start it again on the same port
  redis-down       Redis unreachable (SIGSTOP) for --redis-down seconds
  stop-decode      SIGSTOP a decode worker for --freeze seconds, then SIGCONT
  stop-prefill     SIGSTOP the prefill worker for --freeze seconds
  slow-readers     8 clients stop reading their streams for --slow-read seconds
  drain            SIGTERM a decode worker (it drains; the supervisor starts it again)
  kill-router      kill -9 the router; the supervisor starts it again on the listening socket
                   pdserve up holds, so requests sent meanwhile wait instead of being refused
                   (streams through the killed router end with it: counted as cut, not lost)
  stop-router      SIGSTOP the router for --freeze seconds, then SIGCONT: its streams wait and
                   go on (the router does not take its own pause for its workers' silence)

Per fault: streams started, completed identical to the undisturbed output, lost (an error or a
cut stream), duplicated (a token sent twice), wrong (any other difference), and the longest
request. The soak then sends ``--soak`` mixed requests (streaming and not, n > 1, stop strings,
cancels) and reports the same counts, every process's RSS over time, and each worker's
``check_integrity()`` with the blocks still in use at the end. Exit status 0 when nothing was
lost, duplicated or wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

FAULTS = (
    "kill-decode",
    "kill-prefill",
    "kill-redis",
    "redis-down",
    "stop-decode",
    "stop-prefill",
    "slow-readers",
    "drain",
    "kill-router",
    "stop-router",
)


# ---- requests and their expected outputs -----------------------------------------------------


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    max_tokens: int
    expected: tuple[int, ...] = ()
    text: str = ""


@dataclass
class Result:
    kind: str  # "stream" | "plain" | "cancel" | ...
    outcome: str  # identical | lost | duplicated | wrong | cancelled | slow-identical ...
    seconds: float
    status: int = 200
    detail: str = ""
    started_at: float = 0.0  # time.monotonic() when the request was sent
    retried: bool = False  # sent again on a new connection (see _STALE_CONNECTION)


def classify(got: list[int], want: tuple[int, ...], error: str | None) -> str:
    """identical / lost (cut short or failed) / duplicated (a token sent twice) / wrong."""
    if not error and tuple(got) == want:
        return "identical"
    if list(want[: len(got)]) == got:
        return "lost"  # a prefix: the rest never came
    # a duplicate: removing repeated tokens at one spot gives a prefix of the expected
    for i in range(1, len(got)):
        for k in range(1, min(i, 64) + 1):
            if got[i - k : i] == got[i : i + k]:
                fixed = got[:i] + got[i + k :]
                if list(want[: len(fixed)]) == fixed:
                    return "duplicated"
    return "wrong"


def _cancelled(got: list[int], want: tuple[int, ...]) -> str:
    """A stream cancelled after ``got``: "cancelled" when ``got`` is a prefix of the expected
    output, else "duplicated" or "wrong" (what :func:`classify` calls it)."""
    if list(want[: len(got)]) == got:
        return "cancelled"
    return classify(got, want, "cancelled")


def token_ids(logprobs: dict | None) -> list[int]:
    if not logprobs:
        return []
    return [int(t.split(":", 1)[1]) for t in logprobs.get("tokens", [])]


# kill -9 of the router: a request that failed before any response on a reading / writing
# error went out on a kept-alive connection to the killed router (its FIN had not reached the
# client's pool yet). HTTP clients send such a request again on a new connection (the openai
# SDK retries connection errors), and so does the load of that fault, once. A CI run counted
# one such request, sent after the kill, as a lost stream ("ReadError('')", no response). A
# refused connection (ConnectError) is not retried: it stays a lost request. Other faults do
# not retry at all (no server there closes a client's connection).
_STALE_CONNECTION = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


async def stream_one(
    client,
    url: str,
    model: str,
    case: Case,
    pause_s: float = 0.0,
    cancel_after: int | None = None,
    timeout_s: float = 120.0,
    retry_stale: bool = False,
) -> Result:
    """One streaming completion; ``pause_s``: stop reading after the first chunk for that
    long (a slow client); ``cancel_after``: disconnect after that many tokens;
    ``retry_stale``: see ``_STALE_CONNECTION``."""
    body = {
        "model": model,
        "prompt": case.prompt,
        "max_tokens": case.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    t0 = time.monotonic()
    retried = False
    for attempt in range(2):
        got: list[int] = []
        error = None
        status = 0  # no response yet
        done = finished = False  # saw ``data: [DONE]`` / a choice's finish_reason
        try:
            async with client.stream(
                "POST", f"{url}/v1/completions", json=body, timeout=timeout_s
            ) as resp:
                status = resp.status_code
                if status != 200:
                    error = (await resp.aread()).decode(errors="replace")[:200]
                else:
                    paused = False
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                            continue
                        if not line.startswith("data: "):
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            error = json.dumps(ev["error"])[:200]
                            break
                        for ch in ev.get("choices") or ():
                            got += token_ids(ch.get("logprobs"))
                            finished = finished or bool(ch.get("finish_reason"))
                        if pause_s and not paused and got:
                            paused = True
                            await asyncio.sleep(pause_s)
                        if cancel_after is not None and len(got) >= cancel_after:
                            outcome = _cancelled(got, case.expected)
                            return Result(
                                "cancel",
                                outcome,
                                time.monotonic() - t0,
                                detail="" if outcome == "cancelled" else repr(got)[:200],
                            )
                    if error is None and not done:
                        error = "the stream ended without data: [DONE]"
                    elif error is None and not finished:
                        error = "the stream ended without a finish_reason"
        except _STALE_CONNECTION as e:
            if retry_stale and status == 0 and attempt == 0:
                retried = True
                continue  # see _STALE_CONNECTION: sent again, on a new connection
            error = repr(e)[:200]
        except Exception as e:  # noqa: BLE001 - a transport failure is a lost stream
            error = repr(e)[:200]
        break
    kind = "slow" if pause_s else "stream"
    return Result(
        kind,
        classify(got, case.expected, error),
        time.monotonic() - t0,
        status,
        error or "",
        t0,
        retried,
    )


async def plain_one(
    client,
    url: str,
    model: str,
    case: Case,
    n: int = 1,
    stop: str | None = None,
    timeout_s: float = 120.0,
) -> Result:
    """One non-streaming completion (``n`` greedy samples; a stop string cut from the
    expected text)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": case.prompt,
        "max_tokens": case.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "n": n,
    }
    if stop:
        body["stop"] = [stop]
    t0 = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001
        return Result("plain", "lost", time.monotonic() - t0, 0, repr(e)[:200])
    dt = time.monotonic() - t0
    if r.status_code != 200:
        return Result("plain", "lost", dt, r.status_code, r.text[:200])
    want = case.text if not stop else case.text[: case.text.index(stop)]
    texts = [c["text"] for c in r.json()["choices"]]
    ok = len(texts) == n and all(t == want for t in texts)
    return Result(
        "plain-n" if n > 1 else ("plain-stop" if stop else "plain"),
        "identical" if ok else "wrong",
        dt,
        200,
        "" if ok else repr(texts[:1])[:200],
    )


# ---- the cluster ----------------------------------------------------------------------------


def _free_port() -> int:
    # below the ephemeral range: Redis is restarted on its port by the kill-redis fault, and an
    # outgoing connection must not be able to take it in between (shared/ports.py)
    from shared.ports import free_port

    return free_port()


def make_cluster(
    run_dir: Path,
    model: str | None,
    worker_args: list[str],
    router_args: list[str],
    restart_backoff: float,
):
    from shared.cli.launcher import Cluster, cluster_args
    from shared.directory import EmbeddedRedis

    argv = [
        "--run-dir",
        str(run_dir),
        "--prefill",
        "1",
        "--decode",
        "2",
        "--port",
        str(_free_port()),
        "--threads-per-worker",
        "1",
        "--kv-cache-memory",
        "256MiB",
        "--restart-backoff",
        str(restart_backoff),
        "--startup-timeout",
        "180",
    ]
    if model:
        argv += ["--model", model]
    for a in worker_args:
        argv.append(f"--worker-arg={a}")
    for a in router_args:
        argv.append(f"--router-arg={a}")
    c = Cluster(cluster_args(argv))
    c.listen()  # the router's port held before any worker takes an ephemeral port
    c.redis = EmbeddedRedis(port=_free_port())
    c.redis_url = c.redis.start()
    print(f"[chaos] Redis {c.redis_url} (pid {c.redis.pid})", flush=True)
    workers = [
        c.spawn_worker("prefill", 0),
        c.spawn_worker("decode", 0),
        c.spawn_worker("decode", 1),
    ]
    c.wait_ready(workers)
    c.url = c.start_router()
    print(f"[chaos] router {c.url}", flush=True)
    return c


class Supervisor:
    """Calls ``Cluster.supervise()`` from a thread (what ``pdserve up`` does in its loop)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.paused = False  # while the chaos suite itself holds a process stopped

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            if not self.paused:
                self.cluster.supervise()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def child(cluster, name: str):
    return next(c for c in cluster.children if c.name == name)


def worker_pid(cluster, name: str) -> int:
    return child(cluster, name).proc.pid


def wait_healthy(cluster, timeout_s: float = 120.0) -> float:
    """Until every worker is ready (again) and the router sees both decode workers and the
    prefill worker; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        ok = all(c.proc.poll() is None and c.restart_at is None for c in cluster.children)
        ok = ok and all(c.announced_ready for c in cluster.children)
        if ok:
            try:
                h = httpx.get(f"{cluster.url}/health", timeout=2).json()
                if h.get("decode_workers") == 2 and h.get("prefill_workers") == 1:
                    return time.monotonic() - t0
            except Exception:  # noqa: BLE001 - not up yet
                pass
        time.sleep(0.2)
    raise TimeoutError(f"the cluster did not recover within {timeout_s:.0f} s")


def worker_stats(cluster) -> dict[str, dict]:

    from shared.proto import pdserve_pb2 as pb
    from shared.proto import pdserve_pb2_grpc as pb_grpc

    out = {}
    for name, info in sorted(cluster.ready.items()):
        with cluster.security.channel(info["grpc"]) as ch:
            stub = (
                pb_grpc.DecodeWorkerStub(ch)
                if info["role"] == "decode"
                else pb_grpc.PrefillWorkerStub(ch)
            )
            s = stub.Stats(pb.StatsRequest(check_integrity=True), timeout=10)
        out[name] = {
            "integrity_ok": s.integrity_ok,
            "integrity_error": s.integrity_error,
            "used_blocks": s.used_blocks,
            "running": s.running,
            "waiting": s.waiting,
            "fallbacks": s.prefill_fallbacks,
        }
    return out


def rss_mib(cluster) -> dict[str, float]:
    import psutil

    out = {}
    procs = {c.name: c.proc.pid for c in cluster.children}
    if cluster.redis is not None and cluster.redis.pid:
        procs["redis"] = cluster.redis.pid
    for name, pid in procs.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            out[name] = float("nan")
    return out


# ---- load -----------------------------------------------------------------------------------


class Load:
    """``streams`` clients sending streaming requests back to back until stopped."""

    def __init__(self, url: str, model: str, cases: list[Case], streams: int, seed: int):
        self.url, self.model, self.cases = url, model, cases
        self.streams = streams
        self.rng = random.Random(seed)
        self.results: list[Result] = []
        self.slow_pause = 0.0
        self.retry_stale = False  # kill-router: see _STALE_CONNECTION
        self.slow_clients = 0
        self._stop = asyncio.Event()

    async def _client(self, client, i: int) -> None:
        while not self._stop.is_set():
            case = self.rng.choice(self.cases)
            pause = 0.0
            if self.slow_clients > 0:
                self.slow_clients -= 1
                pause = self.slow_pause
            self.results.append(
                await stream_one(
                    client, self.url, self.model, case, pause, retry_stale=self.retry_stale
                )
            )

    async def run(self, until: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=self.streams * 3)
        async with httpx.AsyncClient(limits=limits) as client:
            tasks = [asyncio.create_task(self._client(client, i)) for i in range(self.streams)]
            await until.wait()
            self._stop.set()
            await asyncio.gather(*tasks)


def summarize(results: list[Result]) -> dict:
    outcomes = Counter(r.outcome for r in results)
    return {
        "started": len(results),
        "identical": outcomes.get("identical", 0),
        "lost": outcomes.get("lost", 0),
        "duplicated": outcomes.get("duplicated", 0),
        "wrong": outcomes.get("wrong", 0),
        "cancelled": outcomes.get("cancelled", 0),
        "cut": outcomes.get("cut", 0),
        "retried_on_a_new_connection": sum(r.retried for r in results),
        "longest_s": round(max((r.seconds for r in results), default=0.0), 2),
        "p50_s": round(statistics.median([r.seconds for r in results]), 3) if results else 0.0,
        "statuses": dict(Counter(r.status for r in results)),
        "examples": sorted(
            {
                f"{r.outcome}: {r.status} {r.detail}"
                for r in results
                if r.outcome not in ("identical", "cancelled", "cut")
            }
        )[:5],
    }


# ---- faults ---------------------------------------------------------------------------------


async def inject(fault: str, cluster, sup: Supervisor, args) -> str:
    """Inject one fault and undo it; returns what was done."""
    if fault == "kill-decode":
        pid = worker_pid(cluster, "decode-0")
        os.kill(pid, signal.SIGKILL)
        return f"kill -9 decode-0 (pid {pid})"
    if fault == "kill-prefill":
        pid = worker_pid(cluster, "prefill-0")
        os.kill(pid, signal.SIGKILL)
        return f"kill -9 prefill-0 (pid {pid}) with long prompts in flight"
    if fault == "kill-redis":
        pid = cluster.redis.pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not cluster.redis.alive or cluster.redis.pid == pid:  # the supervisor's job
            await asyncio.sleep(0.1)
            if time.monotonic() - t0 > 30:
                raise TimeoutError("Redis was not restarted")
        return (
            f"kill -9 Redis (pid {pid}); the supervisor started it again on the same port "
            f"{time.monotonic() - t0:.1f} s later"
        )
    if fault == "redis-down":
        pid = cluster.redis.pid
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(args.redis_down)
        os.kill(pid, signal.SIGCONT)
        return f"Redis stopped (SIGSTOP) for {args.redis_down:g} s"
    if fault in ("stop-decode", "stop-prefill", "stop-router"):
        name = {"stop-decode": "decode-0", "stop-prefill": "prefill-0"}.get(fault, "router")
        pid = worker_pid(cluster, name)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(args.freeze)
        os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {name} for {args.freeze:g} s, then SIGCONT"
    if fault == "drain":
        pid = worker_pid(cluster, "decode-1")
        os.kill(pid, signal.SIGTERM)
        return f"SIGTERM decode-1 (pid {pid}): drain, then the supervisor starts it again"
    if fault == "kill-router":
        pid = worker_pid(cluster, "router")
        os.kill(pid, signal.SIGKILL)
        return (
            f"kill -9 the router (pid {pid}); the supervisor starts it again on the socket "
            "pdserve up holds"
        )
    raise ValueError(fault)


def load_seed(fault: str) -> int:
    """The load's seed for ``fault``: the same in every process (``hash()`` of a str is
    randomised per process)."""
    return zlib.crc32(fault.encode()) & 0xFFFF


async def run_fault(fault: str, cluster, sup: Supervisor, cases: list[Case], args) -> dict:
    model = cluster.served_model_name
    load = Load(cluster.url, model, cases, args.streams, seed=load_seed(fault))
    load.retry_stale = fault == "kill-router"
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    await asyncio.sleep(args.before)
    t0 = time.monotonic()
    if fault == "slow-readers":
        load.slow_pause = args.slow_read
        load.slow_clients = 8
        extra = asyncio.create_task(_slow_readers(cluster.url, model, cases, args.slow_read))
        did = f"8 clients stopped reading their streams for {args.slow_read:g} s"
        slow = await extra
        load.results += slow
    else:
        did = await inject(fault, cluster, sup, args)
    fault_s = time.monotonic() - t0
    await asyncio.sleep(args.after)
    recovered_s = await asyncio.get_running_loop().run_in_executor(None, wait_healthy, cluster)
    stop.set()
    await runner
    if fault == "kill-router":
        # a stream whose HTTP connection was to the killed router ends with it: no server
        # can resume it (the client retries). Every request sent at or after the kill must
        # be served whole: while the router restarts, connections wait in the backlog of
        # the socket pdserve up holds (before, they were refused).
        for r in load.results:
            if r.outcome == "lost" and r.started_at < t0 < r.started_at + r.seconds:
                r.outcome = "cut"
    summary = summarize(load.results)
    if summary["cut"]:
        did += f" ({summary['cut']} streams in flight through it cut)"
    summary.update(
        fault=fault, did=did, fault_s=round(fault_s, 1), recovered_s=round(recovered_s, 1)
    )
    print(
        f"[chaos] {fault:<13} {did}: {summary['started']} streams, {summary['identical']} "
        f"identical, lost {summary['lost']}, duplicated {summary['duplicated']}, wrong "
        f"{summary['wrong']}, longest {summary['longest_s']} s",
        flush=True,
    )
    return summary


async def _slow_readers(url: str, model: str, cases: list[Case], pause_s: float) -> list[Result]:
    async with httpx.AsyncClient() as client:
        long_cases = sorted(cases, key=lambda c: -c.max_tokens)[:8]
        return list(
            await asyncio.gather(
                *(
                    stream_one(client, url, model, c, pause_s=pause_s, timeout_s=pause_s + 120)
                    for c in long_cases
                )
            )
        )


# ---- soak -----------------------------------------------------------------------------------


async def soak(cluster, cases: list[Case], n: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    model = cluster.served_model_name
    results: list[Result] = []
    rss: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    done = 0
    t0 = time.monotonic()

    async def one(client, i: int) -> None:
        nonlocal done
        case = rng.choice(cases)
        roll = rng.random()
        async with sem:
            if roll < 0.45:
                r = await stream_one(client, cluster.url, model, case)
            elif roll < 0.55:
                r = await stream_one(
                    client, cluster.url, model, case, cancel_after=rng.randint(1, 8)
                )
            elif roll < 0.70:
                r = await plain_one(client, cluster.url, model, case, n=rng.choice([2, 3]))
            elif roll < 0.85 and len(case.text) > 12:
                k = rng.randrange(2, len(case.text) - 4)
                r = await plain_one(client, cluster.url, model, case, stop=case.text[k : k + 3])
            else:
                r = await plain_one(client, cluster.url, model, case)
        results.append(r)
        done += 1
        if done % 500 == 0 or done == n:
            bad = sum(r.outcome not in ("identical", "cancelled") for r in results)
            print(
                f"[chaos] soak {done}/{n}  not identical {bad}  {time.monotonic() - t0:.0f} s",
                flush=True,
            )

    async def sample_rss(stop: asyncio.Event) -> None:
        while not stop.is_set():
            rss.append({"t": round(time.monotonic() - t0, 1), **rss_mib(cluster)})
            try:
                await asyncio.wait_for(stop.wait(), 5.0)
            except TimeoutError:
                pass

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(stop))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        await asyncio.gather(*(one(client, i) for i in range(n)))
    stop.set()
    await sampler
    rss.append({"t": round(time.monotonic() - t0, 1), **rss_mib(cluster)})
    summary = summarize(results)
    summary["requests"] = n
    summary["by_kind"] = dict(Counter(r.kind for r in results))
    summary["seconds"] = round(time.monotonic() - t0, 1)
    summary["rss_mib"] = rss_summary(rss)
    summary["rss_samples"] = rss
    return summary


def rss_summary(samples: list[dict]) -> dict:
    """Per process: RSS after the first 10 % of the run (warm), at the end, the largest, and
    how much it grew over the second half of the run (a worker that the drain fault had just
    restarted is still filling its caches during the first half): the largest rise from a
    sample to a later one, as a share of the lower. Memory handed back (Redis's allocator
    returned 1.8 of 10.2 MiB once in a soak) is not growth; a leak rises."""
    if not samples:
        return {}
    warm = samples[max(0, len(samples) // 10)]
    end = samples[-1]
    half = [s for s in samples if s["t"] >= end["t"] / 2]
    out = {}
    for name in end:
        if name == "t":
            continue
        out[name] = {
            "warm": round(warm.get(name, 0.0), 1),
            "end": round(end[name], 1),
            "max": round(max(s.get(name, 0.0) for s in samples), 1),
            "growth_pct": round(100 * (end[name] / warm[name] - 1), 1) if warm.get(name) else None,
            "second_half_pct": _largest_rise_pct([s.get(name, 0.0) for s in half]),
        }
    return out


def _largest_rise_pct(values: list[float]) -> float | None:
    """The largest ``(later - earlier) / earlier`` over pairs of samples in order, in percent
    (0 when the series only falls); None without a positive sample. A NaN (the RSS of a
    process that had exited when sampled) or infinite sample is skipped."""
    low = None
    rise = 0.0
    for v in values:
        if not math.isfinite(v) or v <= 0:
            continue
        if low is None or v < low:
            low = v
        rise = max(rise, (v - low) / low)
    return None if low is None else round(100 * rise, 2)


def plot_rss(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in samples[0]:
        if name != "t":
            ax.plot([s["t"] for s in samples], [s.get(name) for s in samples], label=name)
    ax.set_xlabel("soak time (s)")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("RSS of every process during the soak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- entry point ----------------------------------------------------------------------------


def make_cases(vocab: int, n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        long = i % 3 == 0  # a third take the disaggregated path (> --local-prefill-threshold)
        length = rng.randint(300, 700) if long else rng.randint(8, 60)
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        cases.append(Case(prompt, rng.choice([48, 96, 160])))
    return cases


async def expected_outputs(url: str, model: str, cases: list[Case]) -> list[Case]:
    """Each case's output, undisturbed: the oracle every later run is compared with."""
    out = []
    async with httpx.AsyncClient() as client:
        for c in cases:
            body = {
                "model": model,
                "prompt": c.prompt,
                "max_tokens": c.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            }
            r = await client.post(f"{url}/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            ch = r.json()["choices"][0]
            body.pop("return_tokens_as_token_ids")
            body.pop("logprobs")
            text = (await client.post(f"{url}/v1/completions", json=body, timeout=120)).json()[
                "choices"
            ][0]["text"]
            ids = tuple(token_ids(ch["logprobs"]))
            if len(ids) != c.max_tokens or not text:
                # ignore_eos: every output is max_tokens long. An empty oracle would pass every
                # stream (a server that sent no token ids would look identical)
                raise RuntimeError(
                    f"the undisturbed output of a {len(c.prompt)}-token prompt has {len(ids)} "
                    f"token ids (max_tokens {c.max_tokens}, ignore_eos) and "
                    f"{len(text)} characters of text: no oracle to compare streams with"
                )
            out.append(Case(c.prompt, c.max_tokens, ids, text))
    return out


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated subset of {', '.join(FAULTS)} ('' for none)",
    )
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--cases", type=int, default=24, help="distinct prompts")
    p.add_argument("--before", type=float, default=4.0, help="seconds of load before a fault")
    p.add_argument("--after", type=float, default=8.0, help="seconds of load after a fault")
    p.add_argument("--freeze", type=float, default=20.0, help="SIGSTOP length (s)")
    p.add_argument("--redis-down", type=float, default=30.0, help="Redis SIGSTOP length (s)")
    p.add_argument("--slow-read", type=float, default=30.0, help="slow readers' pause (s)")
    p.add_argument("--soak", type=int, default=10_000, help="soak requests (0: none)")
    p.add_argument("--soak-concurrency", type=int, default=16)
    p.add_argument(
        "--rss-bound",
        type=float,
        default=5.0,
        help="largest RSS growth (%%) of any process over the soak's second half (from a "
        "sample to a later one; memory handed back is not growth)",
    )
    p.add_argument("--restart-backoff", type=float, default=0.5)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument(
        "--router-arg",
        action="append",
        default=None,
        help="extra router flag (repeatable); default --stall-timeout=10, so that the slow "
        "readers' pause is several stall timeouts long",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--out", default=None, help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(main_async(args))


async def main_async(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    loop = asyncio.get_running_loop()
    router_args = args.router_arg if args.router_arg is not None else ["--stall-timeout=10"]
    cluster = await loop.run_in_executor(
        None, make_cluster, run_dir, args.model, args.worker_arg, router_args, args.restart_backoff
    )
    report: dict[str, Any] = {"run_dir": str(run_dir), "faults": [], "soak": None}
    try:
        with Supervisor(cluster) as sup:
            cfg = json.loads((Path(cluster.model) / "config.json").read_text())
            cases = make_cases(int(cfg["vocab_size"]), args.cases, args.seed)
            cases = await expected_outputs(cluster.url, cluster.served_model_name, cases)
            print(f"[chaos] {len(cases)} prompts with known outputs", flush=True)
            for fault in [f for f in args.faults.split(",") if f]:
                report["faults"].append(await run_fault(fault, cluster, sup, cases, args))
            if args.soak:
                report["soak"] = await soak(
                    cluster, cases, args.soak, args.soak_concurrency, args.seed
                )
                s = report["soak"]
                print(
                    f"[chaos] soak: {s['requests']} requests in {s['seconds']} s, "
                    f"{s['identical']} identical, {s['cancelled']} cancelled, lost "
                    f"{s['lost']}, wrong {s['wrong']}",
                    flush=True,
                )
            await asyncio.sleep(2.0)
            report["workers_end"] = await loop.run_in_executor(None, worker_stats, cluster)
            report["restarts"] = {c.name: c.restarts for c in cluster.children}
    finally:
        await loop.run_in_executor(None, cluster.stop)
    bad = sum(f["lost"] + f["duplicated"] + f["wrong"] for f in report["faults"])
    if report["soak"]:
        bad += report["soak"]["lost"] + report["soak"]["duplicated"] + report["soak"]["wrong"]
    leaks = [
        n for n, w in report["workers_end"].items() if not w["integrity_ok"] or w["used_blocks"]
    ]
    grew = []
    if report["soak"]:
        grew = [
            n
            for n, r in report["soak"]["rss_mib"].items()
            if r["second_half_pct"] is not None and r["second_half_pct"] > args.rss_bound
        ]
    report["rss_bound_pct"] = args.rss_bound
    report["ok"] = bad == 0 and not leaks and not grew
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        if report["soak"] and report["soak"]["rss_samples"]:
            png = Path(args.out).with_name(Path(args.out).stem + "_rss.png")
            plot_rss(report["soak"]["rss_samples"], png)
            print(f"wrote {args.out} and {png}")
    return 0 if report["ok"] else 1


def table(report: dict) -> str:
    rows = [
        "| fault | what | streams | identical | lost | duplicated | wrong | longest (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for f in report["faults"]:
        rows.append(
            f"| {f['fault']} | {f['did']} | {f['started']} | {f['identical']} | "
            f"{f['lost']} | {f['duplicated']} | {f['wrong']} | {f['longest_s']} |"
        )
    s = report.get("soak")
    if s:
        rows.append(
            f"| soak | {s['requests']} mixed requests | {s['started']} | "
            f"{s['identical']} (+{s['cancelled']} cancelled) | {s['lost']} | "
            f"{s['duplicated']} | {s['wrong']} | {s['longest_s']} |"
        )
    rows.append("")
    for name, w in sorted(report.get("workers_end", {}).items()):
        rows.append(
            f"{name}: integrity {'ok' if w['integrity_ok'] else w['integrity_error']}, "
            f"blocks in use {w['used_blocks']}, restarts "
            f"{report.get('restarts', {}).get(name, 0)}"
        )
    if s and s.get("rss_mib"):
        rows += [
            "",
            "| process | RSS warm (MiB) | end | max | growth over the second half (%) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, r in s["rss_mib"].items():
            rows.append(
                f"| {name} | {r['warm']} | {r['end']} | {r['max']} | {r['second_half_pct']} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve chaos", description=__doc__.split("\n\n")[0])
    add_cli_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
