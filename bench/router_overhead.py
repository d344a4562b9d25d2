"""Router overhead: latency the router adds over calling a decode worker directly, and the
cost of one prefix-directory lookup at 1k and 100k cached blocks.

Starts a private Redis, two fake decode workers (``tests/router/fake_worker.py``: no model,
tokens are free; two so that every routed request does a real directory lookup) and a real
``pdserve router`` process, then alternates identical requests sent (a) straight to a worker's
``DecodeWorker.Generate`` over gRPC and (b) through the router's ``/v1/completions`` (SSE
streaming). Added latency = router minus direct, for the time to first token and for the whole
request, at each percentile; also the router's CPU time per request and the load average.

    .venv/bin/python bench/router_overhead.py --requests 400 --max-tokens 16

Everything runs on this machine, so client, router, workers and Redis share the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def _start(cmd: list[str], ready: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` in its own process group; with ``ready``, wait for that first line."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
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
    req = pb.GenerateRequest(request_id=f"b{random.getrandbits(48):x}", prompt_token_ids=prompt_ids,
                             sampling=pb.SamplingParams(n=1, max_tokens=max_tokens, ignore_eos=True))
    async for chunk in stub.Generate(req, timeout=30):
        if ttft is None and chunk.outputs:
            ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


async def _via_router(client, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"router answered {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith('data: {"id"') and '"choices":[{' in line:
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


async def overhead(args, model_dir: Path, redis_url: str) -> dict:
    import grpc
    import httpx

    from router.tokenizer import RouterTokenizer
    from shared.proto import pdserve_pb2 as pb
    from shared.proto import pdserve_pb2_grpc as pb_grpc

    # two decode workers, so that every routed request does a real directory lookup
    workers = [_start([sys.executable, str(ROOT / "tests/router/fake_worker.py"), "--model", MODEL,
                       "--worker-id", f"bench-d{i}", "--redis-url", redis_url, "--prefix", "bench:"],
                      ready="READY") for i in range(2)]
    ready = workers[0][1]
    port = _free_port()
    router, _ = _start([sys.executable, "-m", "shared.cli", "router", "--model", str(model_dir),
                     "--served-model-name", MODEL, "--redis-url", redis_url,
                     "--directory-prefix", "bench:", "--host", "127.0.0.1", "--port", str(port),
                     "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        worker_addr = f"127.0.0.1:{ready.split()[1]}"
        tok = RouterTokenizer.from_model_dir(model_dir)
        async with httpx.AsyncClient(timeout=30) as client:
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
            words = ["the", "a", "river", "mountain", "forest", "weather", "question", "answer",
                     "system", "prompt"]
            results = {"direct": ([], []), "router": ([], [])}
            cpu0 = None
            load0 = os.getloadavg()[0]
            for i in range(args.warmup + args.requests):
                if i == args.warmup:
                    cpu0 = _cpu_s(router.pid)
                prompt = " ".join(rng.choice(words) for _ in range(args.prompt_words)) + f" {i}"
                ids = tok.encode(prompt)
                order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
                for kind in order:
                    if kind == "direct":
                        ttft, e2e = await _direct(stub, pb, ids, args.max_tokens)
                    else:
                        ttft, e2e = await _via_router(client, url, prompt, args.max_tokens)
                    if i >= args.warmup:
                        results[kind][0].append(ttft)
                        results[kind][1].append(e2e)
            router_cpu_ms = (_cpu_s(router.pid) - cpu0) / args.requests * 1e3
            load1 = os.getloadavg()[0]
            await channel.close()
    finally:
        _stop(router)
        for w, _ in workers:
            _stop(w)
    out = {}
    for metric, k in (("ttft", 0), ("e2e", 1)):
        for p in (50, 90, 99):
            d = _pct(results["direct"][k], p)
            v = _pct(results["router"][k], p)
            out[f"{metric}_p{p}"] = {"direct_ms": d * 1e3, "router_ms": v * 1e3,
                                     "added_ms": (v - d) * 1e3}
        out[f"{metric}_mean_added_ms"] = (statistics.mean(results["router"][k])
                                          - statistics.mean(results["direct"][k])) * 1e3
    out["router_cpu_ms_per_request"] = router_cpu_ms
    out["load_average"] = [load0, load1]
    out["cpus"] = os.cpu_count()
    return out


async def lookups(redis_url: str, n_blocks: int, n_lookups: int, prompt_blocks: int) -> dict:
    """Directory lookup latency with ``n_blocks`` cached blocks spread over 4 workers."""
    from shared.directory import (
        DirectoryKeys,
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
        info = WorkerInfo(worker_id=f"w{w}", role="decode", model=MODEL, grpc=f"h:{w}",
                          block_size=16, num_blocks=n_blocks)
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
        for lease, pub in rng.sample(leases, rng.choice((1, 2))):
            pub.publish([BlockStored(tuple(chain))])
        stored += len(chain)
    client = connect_async(redis_url)
    reader = DirectoryReader(client, keys)
    live = {lease.info.worker_id: lease.generation for lease, _ in leases}
    t_hit, t_miss = [], []
    for i in range(n_lookups):
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
    await client.aclose()
    info = connect_sync(redis_url).info("memory")
    for lease, pub in leases:
        pub.clear()
        lease.deregister()
    return {"blocks": stored, "prompt_blocks": prompt_blocks,
            "hit_p50_ms": _pct(t_hit, 50) * 1e3, "hit_p99_ms": _pct(t_hit, 99) * 1e3,
            "miss_p50_ms": _pct(t_miss, 50) * 1e3, "miss_p99_ms": _pct(t_miss, 99) * 1e3,
            "redis_used_memory_mb": info["used_memory"] / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a fresh tiny model)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--lookups", type=int, default=500)
    p.add_argument("--lookup-prompt-blocks", type=int, default=128,
                   help="blocks per looked-up prompt (128 x 16 = 2048 tokens)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from shared.directory import EmbeddedRedis

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from shared.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny")
        res = {"overhead": asyncio.run(overhead(args, model_dir, server.url)),
               "lookups": [asyncio.run(lookups(server.url, n, args.lookups,
                                               args.lookup_prompt_blocks))
                           for n in (1_000, 100_000)]}
    print(f"router overhead, {args.requests} sequential requests, {args.max_tokens} tokens each "
          f"(~{args.prompt_words}-word prompts), streaming:")
    print("| metric | direct gRPC (ms) | via router (ms) | added (ms) |")
    print("|---|---:|---:|---:|")
    for k, v in res["overhead"].items():
        if isinstance(v, dict):
            print(f"| {k} | {v['direct_ms']:.2f} | {v['router_ms']:.2f} | {v['added_ms']:.2f} |")
    o = res["overhead"]
    print(f"mean added: TTFT {o['ttft_mean_added_ms']:.2f} ms, e2e {o['e2e_mean_added_ms']:.2f} ms; "
          f"router CPU {o['router_cpu_ms_per_request']:.2f} ms per request; "
          f"load average {o['load_average'][0]:.1f} -> {o['load_average'][1]:.1f} "
          f"on {o['cpus']} CPUs")
    print("\ndirectory lookup (one pipeline, a chain of "
          f"{args.lookup_prompt_blocks} blocks, 4 live workers):")
    print("| cached blocks | hit p50 (ms) | hit p99 (ms) | miss p50 (ms) | miss p99 (ms) | Redis MB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in res["lookups"]:
        print(f"| {r['blocks']:,} | {r['hit_p50_ms']:.3f} | {r['hit_p99_ms']:.3f} | "
              f"{r['miss_p50_ms']:.3f} | {r['miss_p99_ms']:.3f} | {r['redis_used_memory_mb']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
