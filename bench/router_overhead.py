"""Router overhead: latency the router adds over calling a decode worker directly, its CPU
cost per streamed token under many concurrent streams, and the cost of one prefix-directory
lookup at 1k and 100k cached blocks.

Starts a private Redis, two fake decode workers (``tests/router/fake_worker.py``: no model,
tokens are free; two so that every routed request does a real directory lookup) and a real
``pdserve router`` process, then:

1. sequential: alternates identical requests sent (a) straight to a worker's
   ``DecodeWorker.Generate`` over gRPC and (b) through the router's ``/v1/completions`` (SSE
   streaming). Added latency = router minus direct, for the time to first token and for the
   whole request, at each percentile; also the router's CPU time per request;
2. concurrent (``--streams``): ``--stream-requests`` streaming completions of
   ``--stream-tokens`` tokens each, ``--streams`` at a time, through the router; output tokens
   per second and the router process's CPU time per output token (``/proc``, all threads).

``--baseline-root DIR`` also starts a second router whose working directory is ``DIR`` (a tree
with another version of ``router/``, e.g. a copy of the previous commit's), against the same
workers and Redis, and interleaves it with the first in both phases, so that before/after
figures come from one run under the same load.

``--baseline-args`` gives the baseline router extra flags (alone: this tree's router with them).
``--client`` picks the HTTP client of the sequential phase: httpx, aiohttp (``vllm bench
serve``'s), or both interleaved; the direct calls use grpc's C client, so a slow Python HTTP
client's own time shows up as "added".

    .venv/bin/python bench/router_overhead.py --requests 400 --max-tokens 16
    .venv/bin/python bench/router_overhead.py --baseline-args "--directory-lookup redis" --streams 0
    .venv/bin/python bench/router_overhead.py --baseline-root /tmp/base --lookups 0

Everything runs on this machine, so client, router, workers and Redis share the CPUs.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def _start(
    cmd: list[str], ready: str | None = None, cwd: Path = ROOT
) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` in its own process group; with ``ready``, wait for that first line."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    line = ""
    if ready is not None:
        line = proc.stdout.readline()  # the fake worker prints it within seconds, or dies
        if not line.startswith(ready):
            _stop(proc)
            raise RuntimeError(f"{cmd[1]} did not start: {line!r}")
    return proc, line


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


async def _direct(stub, pb, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttft = None
    req = pb.GenerateRequest(
        request_id=f"b{random.getrandbits(48):x}",
        prompt_token_ids=prompt_ids,
        sampling=pb.SamplingParams(n=1, max_tokens=max_tokens, ignore_eos=True),
    )
    async for chunk in stub.Generate(req, timeout=30):
        if ttft is None and chunk.outputs:
            ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


def _completion_body(prompt: str, max_tokens: int) -> dict:
    """The streaming ``/v1/completions`` request every phase sends."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def _has_choice(line: str) -> bool:
    """An SSE line carrying a choice (the stream's tokens, not the usage chunk)."""
    return line.startswith('data: {"id"') and '"choices":[{' in line


async def _via_router(client, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = _completion_body(prompt, max_tokens)
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"router answered {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if ttft is None and _has_choice(line):
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


async def _via_router_aiohttp(
    session, url: str, prompt: str, max_tokens: int
) -> tuple[float, float]:
    """:func:`_via_router` with an aiohttp client (what ``vllm bench serve`` uses)."""
    body = _completion_body(prompt, max_tokens)
    t0 = time.perf_counter()
    ttft = None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"router answered {r.status}: {await r.read()!r}")
        async for raw in r.content:
            line = raw.decode()
            if ttft is None and _has_choice(line):
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


async def _stream_one(session, url: str, prompt: str, max_tokens: int) -> tuple[int, int]:
    """One streaming completion; returns the number of SSE events received and of output
    tokens (the usage chunk's ``completion_tokens``; without one, the events that carried a
    choice, a lower bound). An error event, or a stream that ends without ``data: [DONE]``,
    raises."""
    body = _completion_body(prompt, max_tokens)
    events = choices = 0
    tokens = None
    done = False
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"router answered {r.status}: {await r.text()!r}")
        async for raw in r.content:  # one line at a time
            if not raw.startswith(b"data: "):
                continue
            events += 1
            data = raw[6:].strip()
            if data == b"[DONE]":
                done = True
                continue
            # parse only what can be an error or a usage chunk (the others carry
            # "usage":null), so that the client's own CPU stays small
            if b'"error"' in data or (b'"usage"' in data and b'"usage":null' not in data):
                ev = json.loads(data)
                if "error" in ev:
                    raise RuntimeError(f"error event in the stream: {ev['error']!r}")
                if ev.get("usage"):
                    tokens = int(ev["usage"]["completion_tokens"])
                choices += bool(ev.get("choices"))
            else:
                choices += 1
    if not done:
        raise RuntimeError(f"the stream ended without data: [DONE] after {events} events")
    return events, tokens if tokens is not None else choices


async def _concurrent(url: str, pid: int, args, prompts: list[str]) -> dict:
    """``prompts`` as streaming completions, ``args.streams`` at a time; throughput and the
    router's CPU per output token."""
    import aiohttp

    sem = asyncio.Semaphore(args.streams)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def one(p: str) -> tuple[int, int]:
            async with sem:
                return await _stream_one(session, url, p, args.stream_tokens)

        load0 = os.getloadavg()[0]
        cpu0 = _cpu_s(pid)
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        cpu = _cpu_s(pid) - cpu0
    events = sum(e for e, _ in got)
    tokens = sum(t for _, t in got)  # received, not asked for
    if tokens <= 0:
        raise RuntimeError(f"{len(prompts)} streams delivered no output tokens")
    return {
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "events": events,
        "output_tokens": tokens,
        "router_cpu_us_per_token": cpu / tokens * 1e6,
        "router_cpu_ms_per_request": cpu / len(prompts) * 1e3,
        "router_cpu_util": cpu / wall,
        "load_average": [load0, os.getloadavg()[0]],
    }


async def overhead(args, model_dir: Path, redis_url: str) -> dict:
    import grpc
    import httpx

    from router.tokenizer import RouterTokenizer
    from shared.ports import free_port
    from shared.proto import pdserve_pb2 as pb
    from shared.proto import pdserve_pb2_grpc as pb_grpc

    # two decode workers, so that every routed request does a real directory lookup
    workers = [
        _start(
            [
                sys.executable,
                str(ROOT / "tests/router/fake_worker.py"),
                "--model",
                MODEL,
                "--worker-id",
                f"bench-d{i}",
                "--redis-url",
                redis_url,
                "--prefix",
                "bench:",
            ],
            ready="READY",
        )
        for i in range(2)
    ]
    ready = workers[0][1]
    roots = {"router": ROOT}
    if args.baseline_root or args.baseline_args:
        roots["baseline"] = Path(args.baseline_root or ROOT).resolve()
    routers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, root in roots.items():
            extra = args.baseline_args.split() if name == "baseline" and args.baseline_args else []
            port = free_port()
            proc, _ = _start(
                [
                    sys.executable,
                    "-m",
                    "shared.cli",
                    "router",
                    "--model",
                    str(model_dir),
                    "--served-model-name",
                    MODEL,
                    "--redis-url",
                    redis_url,
                    "--directory-prefix",
                    "bench:",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--disable-uvicorn-access-log",
                    "--uvicorn-log-level",
                    "warning",
                    *extra,
                ],
                cwd=root,
            )
            routers[name] = (proc, f"http://127.0.0.1:{port}")
        worker_addr = f"127.0.0.1:{ready.split()[1]}"
        tok = RouterTokenizer.from_model_dir(model_dir)
        async with httpx.AsyncClient(timeout=30) as client:
            for _, url in routers.values():
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if (await client.get(f"{url}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("router never became healthy")
                    await asyncio.sleep(0.2)
            channel = grpc.aio.insecure_channel(worker_addr)
            stub = pb_grpc.DecodeWorkerStub(channel)
            rng = random.Random(0)
            words = [
                "the",
                "a",
                "river",
                "mountain",
                "forest",
                "weather",
                "question",
                "answer",
                "system",
                "prompt",
            ]
            import aiohttp

            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
            )
            clients = ["httpx", "aiohttp"] if args.client == "both" else [args.client]
            # a router measured with each client: "name" (httpx) or "name@aiohttp"
            targets = {
                (name if c == "httpx" else f"{name}@{c}"): (name, c)
                for name in routers
                for c in clients
            }
            kinds = ["direct", *targets]
            results = {k: ([], []) for k in kinds}
            cpu0: dict[str, float] = {}
            load0 = os.getloadavg()[0]
            for i in range(args.warmup + args.requests if args.requests else 0):
                if i == args.warmup:
                    cpu0 = {k: _cpu_s(p.pid) for k, (p, _) in routers.items()}
                prompt = " ".join(rng.choice(words) for _ in range(args.prompt_words)) + f" {i}"
                ids = tok.encode(prompt)
                shift = i % len(kinds)  # every kind goes first equally often
                for kind in kinds[shift:] + kinds[:shift]:
                    if kind == "direct":
                        ttft, e2e = await _direct(stub, pb, ids, args.max_tokens)
                    elif targets[kind][1] == "aiohttp":
                        ttft, e2e = await _via_router_aiohttp(
                            session, routers[targets[kind][0]][1], prompt, args.max_tokens
                        )
                    else:
                        ttft, e2e = await _via_router(
                            client, routers[targets[kind][0]][1], prompt, args.max_tokens
                        )
                    if i >= args.warmup:
                        results[kind][0].append(ttft)
                        results[kind][1].append(e2e)
            n = max(1, args.requests)
            cpu_ms = {
                k: (_cpu_s(p.pid) - cpu0[k]) / n * 1e3 for k, (p, _) in routers.items() if k in cpu0
            }
            load1 = os.getloadavg()[0]
            await session.close()
            await channel.close()
        concurrent: dict[str, list[dict]] = {k: [] for k in routers}
        if args.streams and args.stream_rounds:
            prompts = [
                " ".join(rng.choice(words) for _ in range(args.prompt_words)) + f" s{i}"
                for i in range(args.stream_requests)
            ]
            for _name, (proc, url) in routers.items():  # warm-up (connections, caches)
                await _concurrent(url, proc.pid, args, prompts[: args.streams])
            names = list(routers)
            for r in range(args.stream_rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    proc, url = routers[name]
                    concurrent[name].append(await _concurrent(url, proc.pid, args, prompts))
    finally:
        for proc, _ in routers.values():
            _stop(proc)
        for w, _ in workers:
            _stop(w)
    out: dict = {
        "sequential": {},
        "concurrent": concurrent,
        "load_average": [load0, load1],
        "cpus": os.cpu_count(),
    }
    if args.requests:
        for name, (router, _client) in targets.items():
            o = {}
            for metric, k in (("ttft", 0), ("e2e", 1)):
                for p in (50, 90, 99):
                    d = _pct(results["direct"][k], p)
                    v = _pct(results[name][k], p)
                    o[f"{metric}_p{p}"] = {
                        "direct_ms": d * 1e3,
                        "router_ms": v * 1e3,
                        "added_ms": (v - d) * 1e3,
                    }
                o[f"{metric}_mean_added_ms"] = (
                    statistics.mean(results[name][k]) - statistics.mean(results["direct"][k])
                ) * 1e3
            # both clients' requests when both ran: the router's CPU per request pair
            o["router_cpu_ms_per_request"] = cpu_ms[router] / len(clients)
            out["sequential"][name] = o
    return out


async def lookups(redis_url: str, n_blocks: int, n_lookups: int, prompt_blocks: int) -> dict:
    """Directory lookup latency with ``n_blocks`` cached blocks spread over 4 workers."""
    from shared.directory import (
        DirectoryKeys,
        DirectoryMirror,
        DirectoryReader,
        KVEventPublisher,
        WorkerInfo,
        WorkerLease,
        connect_async,
        connect_sync,
    )
    from shared.hashing import block_hashes, hash_seed
    from shared.kv_events import BlockStored

    keys = DirectoryKeys(f"lk{n_blocks}:")
    seed = hash_seed(MODEL)
    rng = random.Random(n_blocks)
    leases = []
    for w in range(4):
        info = WorkerInfo(
            worker_id=f"w{w}",
            role="decode",
            model=MODEL,
            grpc=f"h:{w}",
            block_size=16,
            num_blocks=n_blocks,
        )
        lease = WorkerLease(connect_sync(redis_url), info, keys=keys, ttl_s=600)
        lease.register()
        leases.append((lease, KVEventPublisher(lease.client, lease)))
    # chains of prompt_blocks blocks; every chain cached on one or two workers
    chains = []
    stored = 0
    while stored < n_blocks:
        toks = [rng.randrange(5, 2000) for _ in range(prompt_blocks * 16)]
        chain = block_hashes(toks, 16, seed)
        chains.append(toks)
        for _lease, pub in rng.sample(leases, rng.choice((1, 2))):
            pub.publish([BlockStored(tuple(chain))])
        stored += len(chain)
    client = connect_async(redis_url)
    reader = DirectoryReader(client, keys)
    live = {lease.info.worker_id: lease.generation for lease, _ in leases}
    t_hit, t_miss = [], []
    for _ in range(n_lookups):
        toks = rng.choice(chains)
        hashes = block_hashes(toks, 16, seed)
        t0 = time.perf_counter()
        m = await reader.prefix_match(MODEL, hashes, live)
        t_hit.append(time.perf_counter() - t0)
        assert max(m.blocks.values()) == prompt_blocks
        miss = block_hashes([rng.randrange(5, 2000) for _ in range(prompt_blocks * 16)], 16, seed)
        t0 = time.perf_counter()
        m = await reader.prefix_match(MODEL, miss, live)
        t_miss.append(time.perf_counter() - t0)
        assert max(m.blocks.values()) == 0
    # the same lookups in the router's own copy (--directory-lookup mirror): its load time and
    # the in-process lookup, hit and miss
    mirror_client = connect_async(redis_url, timeout_s=5.0)
    mirror = DirectoryMirror(mirror_client, keys, MODEL)
    t0 = time.perf_counter()
    await mirror._resync()
    load_s = time.perf_counter() - t0
    m_hit, m_miss = [], []
    for _ in range(n_lookups):
        hashes = block_hashes(rng.choice(chains), 16, seed)
        t0 = time.perf_counter()
        m = mirror.prefix_match(hashes, live)
        m_hit.append(time.perf_counter() - t0)
        assert m is not None and max(m.blocks.values()) == prompt_blocks
        miss = block_hashes([rng.randrange(5, 2000) for _ in range(prompt_blocks * 16)], 16, seed)
        t0 = time.perf_counter()
        m = mirror.prefix_match(miss, live)
        m_miss.append(time.perf_counter() - t0)
        assert m is not None and max(m.blocks.values()) == 0
    await mirror_client.aclose()
    await client.aclose()
    info = connect_sync(redis_url).info("memory")
    for lease, pub in leases:
        pub.clear()
        lease.deregister()
    return {
        "blocks": stored,
        "prompt_blocks": prompt_blocks,
        "hit_p50_ms": _pct(t_hit, 50) * 1e3,
        "hit_p99_ms": _pct(t_hit, 99) * 1e3,
        "miss_p50_ms": _pct(t_miss, 50) * 1e3,
        "miss_p99_ms": _pct(t_miss, 99) * 1e3,
        "redis_used_memory_mb": info["used_memory"] / 2**20,
        "mirror_load_s": load_s,
        "mirror_hit_p50_us": _pct(m_hit, 50) * 1e6,
        "mirror_hit_p99_us": _pct(m_hit, 99) * 1e6,
        "mirror_miss_p50_us": _pct(m_miss, 50) * 1e6,
        "mirror_miss_p99_us": _pct(m_miss, 99) * 1e6,
    }


def serving_path(model_dir: Path, tokens: int = 64, requests: int = 200) -> dict:
    """The router's own per-token Python cost, in process, without sockets: a stream of
    ``tokens`` one-token ``GenerateChunk`` messages (parsed from bytes each time) through
    ``Generation`` and the completions / chat SSE formatting, best of 5 runs of ``requests``
    requests. What this leaves out (gRPC receive, the HTTP write, the event loop) is what the
    process measurements above add."""
    from router import dispatch, serving_chat, serving_completions
    from router.context import ServingContext
    from router.dashboard import LiveStats
    from router.dispatch import StreamEnd
    from router.generation import Generation
    from router.metrics import RouterMetrics
    from router.output import OutputParams
    from router.sampling import Limits
    from router.tokenizer import RouterTokenizer
    from shared.proto import pdserve_pb2 as pb

    tok = RouterTokenizer.from_model_dir(model_dir)
    ids = tok.encode("the quick brown fox jumps over the lazy dog and " * 40, False)[:tokens]
    raw = [
        pb.GenerateChunk(
            request_id="x",
            worker_id="w",
            outputs=[
                pb.SeqDelta(
                    index=0, token_ids=[t], finish_reason="length" if i == len(ids) - 1 else ""
                )
            ],
        ).SerializeToString()
        for i, t in enumerate(ids)
    ]

    class Stream:  # GenerationStream's interface, fed from the bytes above
        def __init__(self, inp) -> None:
            self.inp, self.decision, self.attempts = inp, None, 0

        def finish(self, index: int) -> None:
            pass

        async def events(self):
            seq = getattr(dispatch, "SeqOutput", None)  # None: a router version before it
            for r in raw:
                outputs = pb.GenerateChunk.FromString(r).outputs
                if seq is None:
                    yield list(outputs)
                else:  # as dispatch reads them
                    yield [seq(sd.index, sd.token_ids[:], sd.finish_reason) for sd in outputs]
            yield StreamEnd("local", "w", 0, None)

    class Dispatcher:
        pool = None

        def stream(self, inp) -> Stream:
            return Stream(inp)

    ctx = ServingContext(
        MODEL,
        tok,
        Dispatcher(),
        Limits(4096, tok.vocab_size),
        RouterMetrics(MODEL),
        600.0,
        live=LiveStats(),
    )
    params = OutputParams()

    async def one(module, usage_mode: str) -> None:
        gen = Generation(
            ctx,
            "cmpl-x",
            [ids],
            [pb.SamplingParams(max_tokens=tokens)],
            params,
            "",
            time.monotonic(),
        )
        await gen.start()

        async def close() -> None:
            await gen.aclose()

        async for _ in module._stream(ctx, gen, params, "cmpl-x", 0, usage_mode, close):
            pass

    async def run() -> dict:
        out = {}
        for name, module in (("completions", serving_completions), ("chat", serving_chat)):
            for _ in range(20):
                await one(module, "final")
            best = math.inf
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(requests):
                    await one(module, "final")
                best = min(best, (time.perf_counter() - t0) / requests / len(ids))
            out[f"{name}_us_per_token"] = best * 1e6
        return out

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a fresh tiny model)")
    p.add_argument("--requests", type=int, default=400, help="sequential pairs (0 = skip)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (0 = skip)")
    p.add_argument("--stream-requests", type=int, default=640)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--stream-rounds", type=int, default=3)
    p.add_argument(
        "--baseline-root",
        default=None,
        help="also run a router from this tree (its own router/) for comparison",
    )
    p.add_argument(
        "--baseline-args",
        default="",
        help="extra router flags of the baseline router (with no --baseline-root: this "
        "tree's router with these flags, e.g. '--directory-lookup redis')",
    )
    p.add_argument(
        "--client",
        choices=("httpx", "aiohttp", "both"),
        default="both",
        help="HTTP client of the sequential phase; 'both' interleaves the two in one run",
    )
    p.add_argument("--lookups", type=int, default=500, help="directory lookups (0 = skip)")
    p.add_argument(
        "--lookup-prompt-blocks",
        type=int,
        default=128,
        help="blocks per looked-up prompt (128 x 16 = 2048 tokens)",
    )
    p.add_argument(
        "--serving-path",
        action="store_true",
        help="only the in-process per-token cost of the serving code (no sockets)",
    )
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from shared.directory import EmbeddedRedis

    if args.serving_path:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(args.model) if args.model else None
            if model_dir is None:
                from shared.cli.tiny_model import make_tiny_model

                model_dir = make_tiny_model(Path(tmp) / "tiny")
            res = {"router": serving_path(model_dir)}
            if args.baseline_root:  # the other tree's router/, in a process of its own
                base = str(Path(args.baseline_root).resolve())
                code = (
                    f"import sys, json, pathlib; sys.path.insert(0, {base!r}); "
                    "from bench.router_overhead import serving_path; "
                    f"print(json.dumps(serving_path(pathlib.Path({str(model_dir)!r}))))"
                )
                out = subprocess.run(
                    [sys.executable, "-c", code],
                    cwd=base,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                res["baseline"] = json.loads(out.strip().splitlines()[-1])
        for name, r in res.items():
            print(
                f"{name}: serving path in process (Generation + SSE formatting, usage on, no "
                "sockets): "
                + ", ".join(
                    f"{k.removesuffix('_us_per_token')} {v:.2f} us/token" for k, v in r.items()
                )
            )
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from shared.cli.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny")
        res = {
            "overhead": asyncio.run(overhead(args, model_dir, server.url)),
            "lookups": [
                asyncio.run(lookups(server.url, n, args.lookups, args.lookup_prompt_blocks))
                for n in (1_000, 100_000)
            ]
            if args.lookups
            else [],
        }
    o = res["overhead"]
    for name, seq in o["sequential"].items():
        print(
            f"{name}: {args.requests} sequential requests, {args.max_tokens} tokens each "
            f"(~{args.prompt_words}-word prompts), streaming:"
        )
        print("| metric | direct gRPC (ms) | via router (ms) | added (ms) |")
        print("|---|---:|---:|---:|")
        for k, v in seq.items():
            if isinstance(v, dict):
                print(
                    f"| {k} | {v['direct_ms']:.2f} | {v['router_ms']:.2f} | {v['added_ms']:.2f} |"
                )
        print(
            f"mean added: TTFT {seq['ttft_mean_added_ms']:.2f} ms, e2e "
            f"{seq['e2e_mean_added_ms']:.2f} ms; router CPU "
            f"{seq['router_cpu_ms_per_request']:.2f} ms per request\n"
        )
    if o["sequential"]:
        print(
            f"load average {o['load_average'][0]:.1f} -> {o['load_average'][1]:.1f} "
            f"on {o['cpus']} CPUs\n"
        )
    for name, rounds in o["concurrent"].items():
        print(
            f"{name}: {args.stream_requests} streaming requests x {args.stream_tokens} tokens, "
            f"{args.streams} concurrent:"
        )
        print(
            "| round | output tok/s | router CPU us/token | router CPU ms/request | "
            "router CPU util | load avg |"
        )
        print("|---:|---:|---:|---:|---:|---|")
        for i, r in enumerate(rounds):
            print(
                f"| {i + 1} | {r['output_tokens_per_s']:.0f} | "
                f"{r['router_cpu_us_per_token']:.1f} | {r['router_cpu_ms_per_request']:.2f} | "
                f"{r['router_cpu_util']:.2f} | {r['load_average'][0]:.1f} -> "
                f"{r['load_average'][1]:.1f} |"
            )
        print()
    conc = {k: v for k, v in o["concurrent"].items() if v}
    for name, rounds in conc.items():
        print(
            f"{name}: median router CPU "
            f"{statistics.median(r['router_cpu_us_per_token'] for r in rounds):.1f} us/token, "
            f"median {statistics.median(r['output_tokens_per_s'] for r in rounds):.0f} "
            "output tok/s"
        )
    if "baseline" in conc and "router" in conc:
        ratios = [
            a["router_cpu_us_per_token"] / b["router_cpu_us_per_token"]
            for a, b in zip(conc["router"], conc["baseline"], strict=True)
        ]
        print(
            f"router / baseline CPU per token, round by round: median "
            f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})\n"
        )
    if res["lookups"]:
        print(
            "directory lookup (one EVALSHA, a chain of "
            f"{args.lookup_prompt_blocks} blocks, 4 live workers):"
        )
        print(
            "| cached blocks | hit p50 (ms) | hit p99 (ms) | miss p50 (ms) | miss p99 (ms) | "
            "Redis MB |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for r in res["lookups"]:
            print(
                f"| {r['blocks']:,} | {r['hit_p50_ms']:.3f} | {r['hit_p99_ms']:.3f} | "
                f"{r['miss_p50_ms']:.3f} | {r['miss_p99_ms']:.3f} | "
                f"{r['redis_used_memory_mb']:.1f} |"
            )
        print("\nthe same lookups in the router's own copy (--directory-lookup mirror):")
        print(
            "| cached blocks | load (s) | hit p50 (us) | hit p99 (us) | miss p50 (us) | miss p99 (us) |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for r in res["lookups"]:
            print(
                f"| {r['blocks']:,} | {r['mirror_load_s']:.2f} | {r['mirror_hit_p50_us']:.1f} | "
                f"{r['mirror_hit_p99_us']:.1f} | {r['mirror_miss_p50_us']:.1f} | "
                f"{r['mirror_miss_p99_us']:.1f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
