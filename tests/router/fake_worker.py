"""A fake DecodeWorker (gRPC) for router tests: deterministic tokens, a real Redis lease.

Token ``pos`` of sample ``index`` is a pure function of (prompt, index, pos, seed), so a request
resumed on another fake worker continues exactly as the undisturbed one would, like greedy or
seeded sampling on a real engine. Honours ``max_tokens``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``n``, ``logprobs``, ``prompt_logprobs`` and ``resume``; cancellation stops generation.
Registers in Redis with ``shared.directory`` and publishes the prompt's full blocks after
"prefill" (LRU-evicting past ``--num-blocks``). Test controls: ``--token-delay``,
``--first-token-delay``, ``--report-waiting``, ``--die-after-tokens`` (SIGKILL itself after
sending that many tokens in total), ``--stall-after-tokens`` (hang instead),
``--fail-requests K --fail-code CODE`` (abort the first K calls before any token,
``--fail-delay`` seconds after they arrive).

Run: ``python tests/router/fake_worker.py --redis-url URL --model NAME --worker-id ID``;
prints ``READY <port>`` once serving and registered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import struct
import sys
import threading
from collections import OrderedDict

import grpc
import xxhash
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.directory import (
    DirectoryKeys,
    KVEventPublisher,
    WorkerInfo,
    WorkerLease,
    WorkerLoad,
    connect_sync,
)
from shared.hashing import block_hashes, hash_seed
from shared.kv_events import BlockRemoved, BlockStored
from shared.proto import pdserve_pb2 as pb
from shared.proto import pdserve_pb2_grpc as pb_grpc
from shared.proto.mux import GenerateMuxMixin

FIRST_NORMAL_ID = 5  # the tiny model's special tokens are ids 0..4
EOS_ID = 1
EOS_PERIOD = 97  # about one token in 97 is EOS


def prompt_key(prompt: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(prompt)}I", *prompt))


def fake_token(key: int, index: int, pos: int, seed: int, vocab: int) -> tuple[int, int]:
    """(token id, 64-bit hash) of sample ``index`` at output position ``pos``."""
    h = xxhash.xxh3_64_intdigest(struct.pack("<QIIq", key, index, pos, seed))
    if (h >> 32) % EOS_PERIOD == 0:
        return EOS_ID, h
    return FIRST_NORMAL_ID + h % (vocab - FIRST_NORMAL_ID), h


def fake_logprob(token: int, h: int, k: int, vocab: int) -> pb.TokenLogprob:
    lp = -0.01 - ((h >> 40) % 1000) / 250.0
    top = [pb.TopLogprob(token_id=token, logprob=lp)]
    for j in range(1, k):
        other = FIRST_NORMAL_ID + (h >> (j % 13)) % (vocab - FIRST_NORMAL_ID)
        top.append(pb.TopLogprob(token_id=other, logprob=lp - 0.5 * j))
    return pb.TokenLogprob(logprob=lp, rank=1, top=top[:k])


def fake_prompt_logprobs(prompt: list[int], k: int, vocab: int) -> list[pb.TokenLogprob]:
    """What the fake worker sends for ``prompt_logprobs`` k: per prompt token after the
    first, a logprob and rank from a hash of (position, token), and k other tokens."""
    out = []
    for p, tok in enumerate(prompt[1:], 1):
        h = xxhash.xxh3_64_intdigest(struct.pack("<II", p, tok))
        lp = -0.5 - (h % 1000) / 100.0
        top = [
            pb.TopLogprob(
                token_id=FIRST_NORMAL_ID + (h >> j) % (vocab - FIRST_NORMAL_ID), logprob=-0.1 * j
            )
            for j in range(1, k + 1)
        ]
        out.append(pb.TokenLogprob(logprob=lp, rank=2 + h % 50, top=top))
    return out


def expected_output(
    prompt: list[int],
    *,
    max_tokens: int,
    vocab: int,
    index: int = 0,
    seed: int = 0,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
) -> tuple[list[int], str]:
    """The tokens and finish reason an undisturbed fake worker produces."""
    key = prompt_key(prompt)
    out: list[int] = []
    for pos in range(max_tokens):
        tok, _ = fake_token(key, index, pos, seed, vocab)
        out.append(tok)
        if len(out) >= min_tokens and ((tok == EOS_ID and not ignore_eos) or tok in stop_token_ids):
            return out, "stop"
    return out, "length"


class FakeDecodeWorker(GenerateMuxMixin, pb_grpc.DecodeWorkerServicer):
    def __init__(self, args: argparse.Namespace, publisher: KVEventPublisher | None) -> None:
        self.args = args
        self.publisher = publisher
        self.running = 0
        self.ending: dict[str, asyncio.Event] = {}  # Abort(whole) ends that stream
        self.queries = 0
        self.hits = 0
        self.tokens_sent = 0
        self.failures_left = args.fail_requests
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.lock = threading.Lock()

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            free_blocks=self.args.num_blocks - len(self.cache),
            running=self.running,
            waiting=self.args.report_waiting,
        )

    def _cache_prompt(self, hashes: list[bytes]) -> int:
        """Insert the prompt's blocks (LRU); returns how many leading blocks were cached."""
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cache:
            hit += 1
        stored, removed = [], []
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.args.num_blocks:
            removed.append(self.cache.popitem(last=False)[0])
        events = ([BlockStored(tuple(stored))] if stored else []) + (
            [BlockRemoved(tuple(removed))] if removed else []
        )
        if events and self.publisher is not None:
            threading.Thread(target=self.publisher.publish, args=(events,), daemon=True).start()
        return hit

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        a = self.args
        if self.failures_left > 0:
            self.failures_left -= 1
            await asyncio.sleep(a.fail_delay)
            await context.abort(getattr(grpc.StatusCode, a.fail_code), "injected failure")
        self.queries += 1
        self.running += 1
        ending = self.ending[request.request_id] = asyncio.Event()
        try:
            prompt = list(request.prompt_token_ids)
            sp = request.sampling
            if request.resume and sp.HasField("prompt_logprobs"):
                print("prompt_logprobs asked on a resume", file=sys.stderr, flush=True)
            n = max(1, sp.n)
            max_tokens = (
                sp.max_tokens if sp.HasField("max_tokens") else a.max_model_len - len(prompt)
            )
            seed = sp.seed if sp.HasField("seed") else 0
            k = sp.logprobs if sp.HasField("logprobs") else None
            stop_ids = set(sp.stop_token_ids)
            key = prompt_key(prompt)
            # as the engine: a resumed sample's prompt is the prompt plus the tokens it had
            cached_ids = (
                prompt + list(request.resume[0].token_ids) if n == 1 and request.resume else prompt
            )
            hashes = block_hashes(
                cached_ids, a.block_size, hash_seed(a.model, request.cache_salt or None)
            )
            cached_blocks = self._cache_prompt(hashes)
            self.hits += cached_blocks > 0
            pos = [0] * n
            ended = {r.index for r in request.resume if r.finished}
            for r in request.resume:
                pos[r.index] = len(r.token_ids)
            live = {i for i in range(n) if pos[i] < max_tokens and i not in ended}
            if a.first_token_delay:
                await asyncio.sleep(a.first_token_delay)
            cached = min(cached_blocks * a.block_size, len(cached_ids) - 1)
            first = True
            while live:
                if ending.is_set():
                    return
                chunk = pb.GenerateChunk(request_id=request.request_id, worker_id=a.worker_id)
                if sp.HasField("prompt_logprobs") and not request.resume and pos == [0] * n:
                    chunk.prompt_logprobs.extend(
                        fake_prompt_logprobs(prompt, sp.prompt_logprobs, a.vocab_size)
                    )
                for i in sorted(live):
                    tok, h = fake_token(key, i, pos[i], seed, a.vocab_size)
                    pos[i] += 1
                    sd = pb.SeqDelta(index=i, token_ids=[tok])
                    if k is not None:
                        sd.logprobs.append(fake_logprob(tok, h, k, a.vocab_size))
                    if pos[i] >= sp.min_tokens and tok == EOS_ID and not sp.ignore_eos:
                        sd.finish_reason = "stop"
                    elif pos[i] >= sp.min_tokens and tok in stop_ids:
                        sd.finish_reason, sd.stop_token_id = "stop", tok
                    elif pos[i] >= max_tokens:
                        sd.finish_reason = "length"
                    if sd.finish_reason:
                        live.discard(i)
                    chunk.outputs.append(sd)
                if first and live:  # as the decode worker: the first tokens' chunk has usage
                    chunk.usage.CopyFrom(pb.Usage(prompt_tokens=len(prompt), cached_tokens=cached))
                first = False
                await context.write(chunk)
                self.tokens_sent += len(chunk.outputs)
                if a.die_after_tokens and self.tokens_sent >= a.die_after_tokens:
                    await asyncio.sleep(0.05)  # let the chunk leave the socket
                    os.kill(os.getpid(), signal.SIGKILL)
                if a.stall_after_tokens and self.tokens_sent >= a.stall_after_tokens:
                    await asyncio.Event().wait()  # hang (until the caller cancels)
                if live and a.token_delay:
                    await asyncio.sleep(a.token_delay)
            total = sum(pos)
            await context.write(
                pb.GenerateChunk(
                    request_id=request.request_id,
                    worker_id=a.worker_id,
                    finished=True,
                    usage=pb.Usage(
                        prompt_tokens=len(prompt),
                        completion_tokens=total,
                        cached_tokens=cached,
                    ),
                    timings=pb.Timings(path="disagg" if request.prefill_address else "local"),
                )
            )
        finally:
            self.running -= 1
            if self.ending.get(request.request_id) is ending:
                del self.ending[request.request_id]

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        """``whole``: end that request's stream now, normally (as the real decode worker)."""
        ev = self.ending.get(request.request_id)
        if ev is None or not request.whole:
            return pb.AbortReply(aborted=0)
        ev.set()
        return pb.AbortReply(aborted=1)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        load = self.load()
        return pb.WorkerStats(
            worker_id=self.args.worker_id,
            role="decode",
            num_blocks=self.args.num_blocks,
            free_blocks=load.free_blocks,
            running=self.running,
            waiting=load.waiting,
            integrity_ok=True,
            prefix_cache_queries=self.queries,
            prefix_cache_hits=self.hits,
        )


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    lease = publisher = None
    if args.redis_url:
        info = WorkerInfo(
            worker_id=args.worker_id,
            role="decode",
            model=args.model,
            grpc=f"127.0.0.1:{port}",
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
        )
        lease = WorkerLease(
            connect_sync(args.redis_url),
            info,
            keys=DirectoryKeys(args.prefix),
            ttl_s=args.lease_ttl,
        )
        publisher = KVEventPublisher(lease.client, lease)
    worker = FakeDecodeWorker(args, publisher)
    pb_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if lease is not None:
        lease.register(worker.load())
        lease.start(worker.load, interval_s=args.lease_ttl / 3)
        # like the real services: an idle publish now and then retries whatever a Redis outage
        # left pending and republishes after a lease loss (new generation)
        stop_publishing = threading.Event()

        def idle_publish() -> None:
            while not stop_publishing.wait(args.lease_ttl / 3):
                publisher.publish([])

        threading.Thread(target=idle_publish, daemon=True).start()
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if lease is not None:
        stop_publishing.set()
        publisher.clear()
        lease.deregister()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", default=None)
    p.add_argument("--prefix", default="pds:", help="directory key prefix")
    p.add_argument("--model", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--lease-ttl", type=float, default=3.0)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--first-token-delay", type=float, default=0.0)
    p.add_argument("--report-waiting", type=int, default=0)
    p.add_argument("--die-after-tokens", type=int, default=0)
    p.add_argument("--stall-after-tokens", type=int, default=0)
    p.add_argument("--fail-requests", type=int, default=0)
    p.add_argument("--fail-code", default="UNAVAILABLE")
    p.add_argument("--fail-delay", type=float, default=0.0, help="seconds before each failure")
    args = p.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
