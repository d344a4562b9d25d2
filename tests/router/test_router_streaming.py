"""The per-token streaming path, piece by piece, without processes: the short path of
``SampleOutput.add`` against the general one, the hand-formatted SSE chunks against JSON, the
lock-free ITL histogram against ``prometheus_client``'s, the timer watchdog, and the SSE
response's disconnect handling and last write."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router import serving_chat, serving_completions
from router.context import ServingContext
from router.dashboard import LiveStats
from router.dispatch import SeqOutput, StreamEnd, _Watchdog
from router.generation import Generation
from router.metrics import _ITL_BUCKETS, LoopHistogram, RouterMetrics
from router.output import OutputParams, SampleOutput
from router.sampling import Limits
from router.sse import SSE_DONE, DisconnectWatch, SSEResponse
from router.tokenizer import RouterTokenizer
from shared.proto import pdserve_pb2 as pb

EOS = 1
TRICKY = 'plain "quoted" back\\slash\nnew\tline 日本語😀 \u2028 </s> end'


@pytest.fixture(scope="module")
def tok(tiny_model) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(tiny_model)


# ---- SampleOutput: the one-token short path does what the general path does ---------------


def feed(tok, params, tokens, finish, finish_apart):
    """One token per delta, the finish with the last token or in an empty delta after it;
    returns (text, token ids, streamed text, finish reason)."""
    s = SampleOutput(0, tok, params)
    streamed = []
    deltas = [[t] for t in tokens] + ([[]] if finish_apart else [])
    for i, ids in enumerate(deltas):
        lps = [pb.TokenLogprob(logprob=-1.0)] * len(ids) if params.logprobs is not None else ()
        s.add(ids, lps, finish if i == len(deltas) - 1 else "")
        if (d := s.take()) is not None:
            streamed.append(d.text)
        if s.finished:
            break
    return s.text, s.token_ids, "".join(streamed), s.finish_reason


@pytest.mark.parametrize("seed", range(8))
def test_short_path_matches_the_general_path(tok, seed):
    rng = random.Random(seed)
    tokens = tok.encode(TRICKY * 2, add_special_tokens=False)
    for _ in range(6):  # EOS ids in the middle: held back, then shown (generation went on)
        tokens.insert(rng.randrange(len(tokens)), EOS)
    finish = rng.choice(["length", "stop"])
    if seed % 2:  # ends on the EOS that ended it: held until the finish says so, never shown
        tokens.append(EOS)
        finish = "stop"
    base = {"terminal_ids": frozenset({EOS}), "skip_special_tokens": rng.random() < 0.5}
    for apart in (False, True):
        plain = feed(tok, OutputParams(**base), tokens, finish, apart)  # the short path
        general = feed(tok, OutputParams(**base, logprobs=0), tokens, finish, apart)  # never
        assert plain == general
        assert plain[2] == plain[0]  # everything accounted was streamed


def test_deltas_carry_token_entries_only_when_logprobs_were_asked(tok):
    tokens = tok.encode("one two three", add_special_tokens=False)
    for params, want in ((OutputParams(), 0), (OutputParams(logprobs=1), 1)):
        s = SampleOutput(0, tok, params)
        s.add(tokens[:1])
        assert len(s.take().tokens) == want


# ---- SSE chunks: the hand-formatted ones are the JSON the general path writes --------------


class _FakeStream:
    def __init__(self, inp, deltas):
        self.inp, self.decision, self.attempts, self._deltas = inp, None, 0, deltas
        self.cached_tokens = 3  # known with the first tokens, as its StreamEnd reports it

    def finish(self, index: int) -> None:
        pass

    async def events(self):
        for d in self._deltas:
            yield d
        yield StreamEnd("local", "w0", 3, None)


class _FakeDispatcher:
    def __init__(self, deltas):
        self.deltas = deltas

    def stream(self, inp):
        return _FakeStream(inp, self.deltas)


def run_stream(tok, module, deltas, n=1, usage_mode="", **out):
    params = OutputParams(n=n, **out)
    ctx = ServingContext(
        "tiny",
        tok,
        _FakeDispatcher(deltas),
        Limits(4096, tok.vocab_size),
        RouterMetrics("tiny"),
        60.0,
        live=LiveStats(),
    )
    gen = Generation(
        ctx, "req-1", [[5, 6, 7]], [pb.SamplingParams(n=n)], params, "", time.monotonic()
    )

    async def go() -> list[str]:
        await gen.start()

        async def close() -> None:
            await gen.aclose()

        return [c async for c in module._stream(ctx, gen, params, "req-1", 17, usage_mode, close)]

    writes = asyncio.run(go())
    events = [e for w in writes for e in w.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == SSE_DONE.strip()
    return writes, [json.loads(e[6:]) for e in events[:-1]]


class _PacedStream(_FakeStream):
    """One token every ``gap`` seconds after ``offset`` (real sleeps: gaps are never shorter)."""

    def __init__(self, inp, offset, gap, count):
        super().__init__(inp, [])
        self.offset, self.gap, self.count = offset, gap, count

    async def events(self):
        await asyncio.sleep(self.offset)
        for k in range(self.count):
            if k:
                await asyncio.sleep(self.gap)
            yield [SeqOutput(0, [100 + k], "length" if k == self.count - 1 else "")]
        yield StreamEnd("local", "w0", 0, None)


class _RecordingLive(LiveStats):
    def __init__(self):
        super().__init__()
        self.ttfts: list[float] = []
        self.itls: list[float] = []

    def output(self, tokens, ttft_s=None, itl_s=None):
        super().output(tokens, ttft_s, itl_s)
        self.ttfts += [] if ttft_s is None else [ttft_s]
        self.itls += [] if itl_s is None else [itl_s]


def test_inter_token_latency_is_per_prompt_in_a_batched_request(tok):
    # two prompts in one completion request, each a token per 50 ms, 25 ms apart: one shared
    # "last token" time read their interleaved events' 25 ms gaps as every sequence's ITL
    started: list[_PacedStream] = []

    class Dispatcher:
        def stream(self, inp):
            started.append(_PacedStream(inp, 0.025 * len(started), 0.05, 8))
            return started[-1]

    live = _RecordingLive()
    metrics = RouterMetrics("tiny")
    ctx = ServingContext(
        "tiny", tok, Dispatcher(), Limits(4096, tok.vocab_size), metrics, 60.0, live=live
    )
    sp = pb.SamplingParams(n=1)
    gen = Generation(
        ctx, "req-b", [[5, 6, 7], [5, 6, 8]], [sp, sp], OutputParams(n=1), "", time.monotonic()
    )

    async def go():
        await gen.start()
        async for _ in gen.steps():
            pass

    asyncio.run(go())
    assert len(live.ttfts) == 1  # the request's first token, once
    assert len(live.itls) == 2 * 7  # each prompt's 7 gaps
    # asyncio.sleep(0.05) is never shorter; but start() hands out the first tokens once every
    # prompt has one, so prompt 0's first gap (from then) is ~25 ms
    assert sorted(live.itls)[1] >= 0.045, live.itls
    text = metrics.render().decode()
    assert 'pdserve:router_inter_token_latency_seconds_count{model_name="tiny"} 14.0' in text


def test_generation_tokens_are_counted_as_they_stream(tok):
    # counted only when a request ended: a client that left mid-stream counted none, and
    # long generations showed as bursts in rate()
    metrics = RouterMetrics("tiny")
    deltas = [[SeqOutput(0, [100 + k], "")] for k in range(6)]
    ctx = ServingContext(
        "tiny", tok, _FakeDispatcher(deltas), Limits(4096, tok.vocab_size), metrics, 60.0
    )
    gen = Generation(
        ctx, "req-g", [[5, 6, 7]], [pb.SamplingParams(n=1)], OutputParams(n=1), "", time.monotonic()
    )

    def counted() -> float:
        return metrics.registry.get_sample_value(
            "pdserve:router_generation_tokens_total", {"model_name": "tiny"}
        )

    async def go() -> list[float]:
        await gen.start()
        seen = []
        steps = gen.steps()
        async for _ in steps:
            seen.append(counted())
            if len(seen) == 4:
                break  # the client left
        await steps.aclose()
        await gen.aclose()
        return seen

    assert asyncio.run(go()) == [1.0, 2.0, 3.0, 4.0]
    assert counted() == 4.0


def token_deltas(tok, text, n=1):
    ids = tok.encode(text, add_special_tokens=False)
    out = [[SeqOutput(i, [t]) for i in range(n)] for t in ids]
    out[-1] = [SeqOutput(i, [ids[-1]], "length") for i in range(n)]
    return out


@pytest.mark.parametrize("usage_mode", ["", "final", "continuous"])
def test_completion_chunks_are_exact_json(tok, usage_mode):
    _, chunks = run_stream(
        tok,
        serving_completions,
        token_deltas(tok, TRICKY),
        usage_mode=usage_mode,
        skip_special_tokens=False,
    )
    body = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in body) == TRICKY
    for c in body:
        assert c["id"] == "req-1" and c["object"] == "text_completion" and c["created"] == 17
        assert set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        assert ("usage" in c) == bool(usage_mode)
        assert (c.get("usage") is not None) == (usage_mode == "continuous")
    assert [c["choices"][0]["finish_reason"] for c in body][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])


def test_chat_chunks_are_exact_json_and_role_goes_with_the_first_content(tok):
    writes, chunks = run_stream(
        tok, serving_chat, token_deltas(tok, TRICKY), usage_mode="final", skip_special_tokens=False
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert writes[0].count("data: ") == 2  # role chunk + first content, one write
    body = [c for c in chunks[1:] if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == TRICKY
    assert body[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_n_samples_of_one_message_are_separate_events_in_one_write(tok):
    writes, chunks = run_stream(tok, serving_completions, token_deltas(tok, "a b c", n=2), n=2)
    assert sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert all(w.count("data: ") == 2 for w in writes[:-1])  # one write per worker message


# ---- metrics -------------------------------------------------------------------------------


def test_loop_histogram_exposition_matches_prometheus_client():
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("x_seconds", "doc", ["model_name"], buckets=_ITL_BUCKETS, registry=r1)
    ref = ref.labels("m")
    fast = LoopHistogram("x_seconds", "doc", {"model_name": "m"}, _ITL_BUCKETS, r2)
    rng = random.Random(0)
    for v in [rng.expovariate(50) for _ in range(2000)] + list(_ITL_BUCKETS) + [0.0, 1e6]:
        ref.observe(v)
        fast.observe(v)
    a = [x for x in generate_latest(r1).decode().splitlines() if "_created{" not in x]
    b = [x for x in generate_latest(r2).decode().splitlines() if "_created{" not in x]
    assert a == b
    assert b"x_seconds_created{" in generate_latest(r2)


# ---- the dispatch watchdog -----------------------------------------------------------------


class _Call:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_watchdog_fires_at_the_deadline_and_on_a_stall():
    async def go():
        late = _Watchdog(_Call(), time.monotonic() + 0.05, stall_s=10.0)
        stalled = _Watchdog(_Call(), time.monotonic() + 10.0, stall_s=0.05)
        fed = _Watchdog(_Call(), time.monotonic() + 10.0, stall_s=1.0)
        stalled.first_output()
        fed.first_output()
        for _ in range(8):  # fed keeps producing output
            await asyncio.sleep(0.02)
            fed.last = time.monotonic()
        for dog in (late, stalled, fed):
            dog.stop()
        return late, stalled, fed

    late, stalled, fed = asyncio.run(go())
    assert (late.why, late.call.cancelled) == ("deadline", True)
    assert (stalled.why, stalled.call.cancelled) == ("stall", True)
    assert (fed.why, fed.call.cancelled) == ("", False)


# ---- SSEResponse: disconnects and the last write -------------------------------------------


def sse_run(events, disconnect_after_start: bool = False, disconnect_at_first_send=False):
    """Drive an SSEResponse by hand; returns (ASGI messages sent, log of closes)."""
    log: list[str] = []
    sent: list[dict] = []

    async def go():
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def body():
            try:
                for e in events:
                    yield e
                    await asyncio.sleep(0)
            finally:
                log.append("iterator closed")

        async def send(message):
            sent.append(message)
            if disconnect_at_first_send and message["type"] == "http.response.body":
                gone.set()
                await asyncio.sleep(0.01)  # the watcher runs

        async def on_close():
            log.append("on_close")

        watch = DisconnectWatch(receive)
        await watch.guard(asyncio.sleep(0))
        if disconnect_after_start:  # gone while the response is being handed over
            gone.set()
            await asyncio.sleep(0.01)
        await SSEResponse(body(), on_close, {}, watch=watch)({"type": "http"}, receive, send)
        return asyncio.current_task().cancelling()

    cancelling = asyncio.run(go())
    assert cancelling == 0  # the handler's task was never left cancelled
    return sent, log


def test_done_event_ends_the_body_after_the_iterator_closed():
    sent, log = sse_run(["data: 1\n\n", "data: 2\n\n", "data: x\n\n" + SSE_DONE])
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert [m["more_body"] for m in bodies] == [True, True, False]
    assert bodies[-1]["body"].endswith(SSE_DONE.encode())
    assert log[0] == "iterator closed"


def test_disconnect_during_handover_sends_nothing_and_closes():
    sent, log = sse_run(["data: 1\n\n", SSE_DONE], disconnect_after_start=True)
    assert sent == [] and log == ["on_close"]  # the iterator never started


def test_disconnect_mid_stream_stops_and_closes():
    sent, log = sse_run(
        [f"data: {i}\n\n" for i in range(50)] + [SSE_DONE], disconnect_at_first_send=True
    )
    assert len([m for m in sent if m["type"] == "http.response.body"]) < 10
    assert "on_close" in log and "iterator closed" in log
