"""Prefill + decode workers as real processes: gRPC, UCX over loopback, a real Redis."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import grpc
import pytest
import redis

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.hashing import block_hashes, hash_seed
from shared.proto import pdserve_pb2 as pb
from tests.cluster_utils import (
    channel_to,
    decode_stub,
    generate,
    make_cluster,
    prefill_stub,
    wait_until,
)
from tests.engine.helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(tiny_llama, tmp_path_factory.mktemp("svc"))
    c.start_redis()
    workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
    c.wait_ready(workers)
    yield c
    c.stop()


def _stats(address: str, role: str, integrity: bool = True) -> pb.WorkerStats:
    with channel_to(address) as ch:
        stub = decode_stub(ch) if role == "decode" else prefill_stub(ch)
        return stub.Stats(pb.StatsRequest(check_integrity=integrity), timeout=10)


def test_disaggregated_greedy_matches_transformers(cluster, tiny_llama):
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    prompts = random_prompts(21, lengths=[1, 7, 16, 17, 50, 129, 300, 511])
    ref = hf_greedy(tiny_llama, prompts, 12)
    before = _stats(d_addr, "decode")
    with channel_to(d_addr) as ch:
        stub = decode_stub(ch)
        with cf.ThreadPoolExecutor(8) as pool:  # submitted together: batched on both workers
            futs = [
                pool.submit(generate, stub, f"g{i}", p, p_addr, max_tokens=12, ignore_eos=True)
                for i, p in enumerate(prompts)
            ]
            results = [f.result() for f in futs]
    for (tokens, final), want, p in zip(results, ref, prompts):
        assert tokens[0] == want
        assert final.timings.path == "disagg"
        assert final.usage.prompt_tokens == len(p) and final.usage.completion_tokens == 12
    after = _stats(d_addr, "decode")
    assert after.kv_transfer_bytes > before.kv_transfer_bytes
    assert after.prefill_fallbacks == before.prefill_fallbacks
    # each first token came with its transfer's end, not with the Prefill call's reply
    assert after.remote_prefills_noted - before.remote_prefills_noted == len(prompts)
    assert after.integrity_ok and _stats(p_addr, "prefill").integrity_ok


def test_seeded_sampling_matches_colocated_engine(cluster, tiny_llama):
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    prompt = random_prompts(22, lengths=[90])[0]
    params = dict(temperature=0.9, top_p=0.95, seed=77, max_tokens=20, ignore_eos=True, n=2)
    with channel_to(d_addr) as ch:
        tokens, _ = generate(decode_stub(ch), "seeded", prompt, p_addr, **params)
    llm = LLM(str(tiny_llama), num_gpu_blocks_override=256)
    local = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params))[0]
    assert tokens[0] == local.outputs[0].token_ids
    assert tokens[1] == local.outputs[1].token_ids


def test_second_turn_transfers_only_new_blocks(cluster, tiny_llama):
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    turn1 = random_prompts(23, lengths=[160])[0]
    with channel_to(d_addr) as ch:
        stub = decode_stub(ch)
        out1, fin1 = generate(stub, "turn1", turn1, p_addr, max_tokens=8, ignore_eos=True)
        assert fin1.timings.blocks_transferred == 10
        turn2 = turn1 + out1[0] + random_prompts(24, lengths=[40])[0]
        before = _stats(d_addr, "decode").kv_transfer_bytes
        out2, fin2 = generate(stub, "turn2", turn2, p_addr, max_tokens=8, ignore_eos=True)
        moved = _stats(d_addr, "decode").kv_transfer_bytes - before
    # D keeps turn 1's 10 full prompt blocks cached; turn 2 (208 tokens = 13 blocks) needs 3 more.
    assert fin2.timings.path == "disagg"
    assert fin2.timings.blocks_transferred == 13 - 10
    assert fin2.usage.cached_tokens >= 160
    block_bytes = moved // fin2.timings.blocks_transferred
    assert moved == fin2.timings.transfer_bytes and block_bytes * 3 == moved
    assert out2[0] == hf_greedy(tiny_llama, [turn2], 8)[0]


def test_bad_grpc_input_gets_clear_status(cluster):
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    with channel_to(d_addr) as ch:
        stub = decode_stub(ch)
        cases = [
            (pb.GenerateRequest(request_id="e1", prompt_token_ids=[]), "empty"),
            (
                pb.GenerateRequest(request_id="e2", prompt_token_ids=[5] * 5000),
                "maximum context length",
            ),
            (
                pb.GenerateRequest(
                    request_id="e3",
                    prompt_token_ids=[5, 6],
                    sampling=pb.SamplingParams(temperature=-1),
                ),
                "temperature",
            ),
            (
                pb.GenerateRequest(
                    request_id="e4", prompt_token_ids=[5, 6], sampling=pb.SamplingParams(top_p=1.5)
                ),
                "top_p",
            ),
            (pb.GenerateRequest(request_id="", prompt_token_ids=[5]), "request_id"),
            (pb.GenerateRequest(request_id="e5", prompt_token_ids=[999999]), "token ids"),
        ]
        for req, words in cases:
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(req, timeout=10))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, ei.value)
            assert words in ei.value.details()
        tokens, _ = generate(stub, "after-bad", [5, 6, 7], p_addr, max_tokens=3, ignore_eos=True)
        assert len(tokens[0]) == 3
    with channel_to(p_addr) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            prefill_stub(ch).Prefill(
                pb.PrefillRequest(
                    request_id="p1",
                    prompt_token_ids=[5] * 40,
                    first_block_index=0,
                    dst_block_ids=[1],
                ),
                timeout=10,
            )
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "destination" in ei.value.details()
    assert _stats(d_addr, "decode").integrity_ok


def test_decode_cancel_midstream_leaks_nothing(cluster):
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    prompt = random_prompts(25, lengths=[700])[0]
    with channel_to(d_addr) as ch:
        stub = decode_stub(ch)
        call = stub.Generate(
            pb.GenerateRequest(
                request_id="cancel-me",
                prompt_token_ids=prompt,
                prefill_address=p_addr,
                sampling=pb.SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
            ),
            timeout=60,
        )
        got = 0
        for chunk in call:
            got += sum(len(d.token_ids) for d in chunk.outputs)
            if got >= 5:
                call.cancel()
                break
    for addr, role in ((d_addr, "decode"), (p_addr, "prefill")):
        s = wait_until(
            lambda addr=addr, role=role: (
                lambda st: st if st.used_blocks == 0 and st.running == 0 else None
            )(_stats(addr, role)),
            what=f"{role} to release every block",
        )
        assert s.integrity_ok, s.integrity_error
        if role == "prefill":
            assert s.pending_sends == 0


@pytest.mark.parametrize("when", ["decoding", "prefilling"])
def test_decode_abort_whole_ends_the_stream_normally_and_leaks_nothing(cluster, when):
    """The router's way to end a request whose client left (``Abort(whole=True)``): the stream
    ends with status OK and no further chunk (a read in flight completes normally), and the
    request is gone from both workers, mid-decode or while its prompt is still on P."""
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    prompt = random_prompts(27 if when == "decoding" else 28, lengths=[700])[0]
    rid = f"leave-{when}"
    with channel_to(d_addr) as ch:
        stub = decode_stub(ch)
        call = stub.Generate(
            pb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                prefill_address=p_addr,
                sampling=pb.SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
            ),
            timeout=60,
        )
        got = 0
        chunks = iter(call)
        if when == "decoding":
            while got < 5:
                got += sum(len(d.token_ids) for d in next(chunks).outputs)
        reply = wait_until(
            lambda: (lambda r: r if r.aborted else None)(
                stub.Abort(pb.AbortRequest(request_id=rid, whole=True), timeout=5)
            ),
            what="the decode worker to know the request",
        )
        assert reply.aborted == 1
        rest = list(chunks)  # ends (status OK: an error status would raise here)
        assert not any(c.finished for c in rest)
        assert call.code() == grpc.StatusCode.OK
    for addr, role in ((d_addr, "decode"), (p_addr, "prefill")):
        stats = wait_until(
            lambda addr=addr, role=role: (
                lambda st: st if st.used_blocks == 0 and st.running == 0 else None
            )(_stats(addr, role)),
            what=f"{role} to release every block",
        )
        assert stats.integrity_ok, stats.integrity_error


def test_directory_reflects_caches(cluster, tiny_llama):
    r = redis.Redis.from_url(cluster.redis_url)
    prompt = random_prompts(26, lengths=[96])[0]
    p_addr, d_addr = cluster.ready["prefill-0"]["grpc"], cluster.ready["decode-0"]["grpc"]
    with channel_to(d_addr) as ch:
        generate(decode_stub(ch), "dir", prompt, p_addr, max_tokens=4, ignore_eos=True)
    seed = hash_seed(cluster.served_model_name)
    hashes = block_hashes(prompt, 16, seed)
    assert len(hashes) == 6

    def holders(h):
        return {
            m.decode().rsplit(":", 1)[0]
            for m in r.smembers(f"pds:blk:{cluster.served_model_name}:{h.hex()}")
        }

    wait_until(
        lambda: all({"prefill-0", "decode-0"} <= holders(h) for h in hashes),
        what="both workers in the directory for every prompt block",
    )
    assert r.exists("pds:worker:prefill-0") and r.exists("pds:worker:decode-0")


def test_nixl_transport_disaggregated_greedy_matches_transformers(tiny_llama, tmp_path):
    """The same disaggregated path with the KV read by the decode worker over NIXL."""
    c = make_cluster(tiny_llama, tmp_path, "--kv-transport", "nixl")
    c.start_redis()
    try:
        workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
        c.wait_ready(workers)
        p_addr, d_addr = c.ready["prefill-0"]["grpc"], c.ready["decode-0"]["grpc"]
        prompts = random_prompts(22, lengths=[1, 16, 17, 129, 511])
        ref = hf_greedy(tiny_llama, prompts, 8)
        with channel_to(d_addr) as ch:
            stub = decode_stub(ch)
            results = [
                generate(stub, f"n{i}", p, p_addr, max_tokens=8, ignore_eos=True)
                for i, p in enumerate(prompts)
            ]
        for (tokens, final), want in zip(results, ref):
            assert tokens[0] == want
            assert final.timings.path == "disagg"
        st = _stats(d_addr, "decode")
        assert st.kv_transfer_bytes > 0 and st.prefill_fallbacks == 0 and st.integrity_ok
        assert st.remote_prefills_noted == len(prompts)  # the fin's note over NIXL's control too
        log = (tmp_path / "decode-0.log").read_text()
        assert "KV transfer: nixl receiver at nixl://" in log, log
    finally:
        c.stop()


def test_without_kv_checksums_the_prefill_call_succeeds(tiny_llama, tmp_path):
    """``--no-kv-checksums``: the transfer handles hold no checksum per block, and the Prefill
    reply carries none (it raised building them, after the transfer had succeeded; before the
    first token came with the transfer, every such request fell back to a local prefill)."""
    c = make_cluster(tiny_llama, tmp_path, "--worker-arg=--no-kv-checksums")
    c.start_redis()
    try:
        workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
        c.wait_ready(workers)
        p_addr, d_addr = c.ready["prefill-0"]["grpc"], c.ready["decode-0"]["grpc"]
        prompt = random_prompts(23, lengths=[129])[0]
        want = hf_greedy(tiny_llama, [prompt], 6)[0]
        with channel_to(d_addr) as ch:
            tokens, final = generate(
                decode_stub(ch), "nock", prompt, p_addr, max_tokens=6, ignore_eos=True
            )
        assert tokens[0] == want and final.timings.path == "disagg"
        assert _stats(d_addr, "decode").prefill_fallbacks == 0
        c.stop()  # (the call ends after the stream: its error, if any, is in P's log by now)
        log = (tmp_path / "prefill-0.log").read_text()
        assert "Exception calling application" not in log and "Traceback" not in log, log
    finally:
        c.stop()


def test_prefill_killed_midprefill_falls_back(tiny_llama, tmp_path):
    """A dying prefill worker costs a local prefill, not the request; then its lease expires."""
    c = make_cluster(tiny_llama, tmp_path, "--max-num-batched-tokens", "16", "--max-num-seqs", "8")
    c.start_redis()
    try:
        workers = [c.spawn_worker("prefill", 0), c.spawn_worker("decode", 0)]
        c.wait_ready(workers)
        p_addr, d_addr = c.ready["prefill-0"]["grpc"], c.ready["decode-0"]["grpc"]
        prompt = random_prompts(27, lengths=[3000])[0]
        want = hf_greedy(tiny_llama, [prompt], 10)[0]
        victim = workers[0].proc
        with channel_to(d_addr) as ch, cf.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            fut = pool.submit(
                generate, decode_stub(ch), "killed", prompt, p_addr, max_tokens=10, ignore_eos=True
            )
            with channel_to(p_addr) as pch:  # kill as soon as P is computing the prompt
                pstub = prefill_stub(pch)
                wait_until(
                    lambda: pstub.Stats(pb.StatsRequest(), timeout=5).running > 0,
                    interval=0.005,
                    what="prefill to start",
                )
            os.killpg(victim.pid, signal.SIGKILL)
            tokens, final = fut.result(timeout=120)
            elapsed = time.monotonic() - t0
        assert tokens[0] == want
        assert final.timings.path == "fallback"
        assert elapsed < 60
        st = _stats(d_addr, "decode")
        assert st.prefill_fallbacks == 1 and st.integrity_ok
        # The dead worker's transfer settled: no block stays pinned for it.
        wait_until(
            lambda: _stats(d_addr, "decode").used_blocks == 0,
            timeout=10,
            what="the decode worker's blocks to be released",
        )
        r = redis.Redis.from_url(c.redis_url)
        wait_until(
            lambda: not r.exists("pds:worker:prefill-0"),
            timeout=10,
            what="the dead worker's lease to expire",
        )
    finally:
        c.stop()
