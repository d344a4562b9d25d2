"""KV transfer between prefill and decode workers of different TP sizes (real worker processes,
their rank processes on gloo, UCX between the workers): the decode worker's greedy tokens equal
one colocated TP 1 engine's, and the transfer moves exactly the prompt's canonical blocks.
A rank killed mid-request ends its worker (NOT_SERVING, exit 1) in bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.proto import pdserve_pb2 as pb
from tests.cluster_utils import channel_to, decode_stub, generate, make_cluster
from tests.engine.helpers import random_prompts

pytestmark = pytest.mark.integration

MAX_NEW = 10
TP2 = ["--tensor-parallel-size", "2"]
TP4 = ["--tensor-parallel-size", "4"]  # the tiny model's 2 KV heads: replicated on 4 ranks
# the tiny model's canonical block: 2 layers x (K, V) x 16 slots x 2 KV heads x 32 dims x fp32
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = make_cluster(tiny_llama, tmp_path_factory.mktemp("tp"), prefill=3, decode=2)
    c.start_redis()
    workers = [
        c.spawn_worker("prefill", 0),
        c.spawn_worker("prefill", 1, TP2),
        c.spawn_worker("prefill", 2, TP4),
        c.spawn_worker("decode", 0),
        c.spawn_worker("decode", 1, TP2),
    ]
    c.wait_ready(workers)
    yield c
    c.stop()


def _reference(model_dir, prompts):
    llm = LLM(str(model_dir), max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [(0, 1), (1, 0), (1, 1), (0, 0), (2, 1), (2, 0)],
    ids=[
        "P-tp1_to_D-tp2",
        "P-tp2_to_D-tp1",
        "P-tp2_to_D-tp2",
        "P-tp1_to_D-tp1",
        "P-tp4_to_D-tp2",
        "P-tp4_to_D-tp1",
    ],
)
def test_disaggregated_across_tp_sizes_matches_one_rank(cluster, tiny_llama, prefill, decode):
    # prompts of their own per pairing: nothing in any pool's prefix cache yet
    prompts = random_prompts(seed=40 + 2 * prefill + decode, lengths=[20, 47, 64, 130, 333])
    ref = _reference(tiny_llama, prompts)
    p_addr = cluster.ready[f"prefill-{prefill}"]["grpc"]
    with channel_to(cluster.ready[f"decode-{decode}"]["grpc"]) as ch:
        stub = decode_stub(ch)
        for i, (prompt, want) in enumerate(zip(prompts, ref)):
            tokens, final = generate(
                stub,
                f"tp-{prefill}{decode}-{i}",
                prompt,
                prefill_address=p_addr,
                max_tokens=MAX_NEW,
                ignore_eos=True,
            )
            assert final.timings.path == "disagg"
            assert tokens[0] == want, f"prompt {i} ({len(prompt)} tokens)"
            blocks = final.timings.blocks_transferred
            assert blocks == -(-len(prompt) // 16)  # every block of the prompt, the last partial
            assert final.timings.transfer_bytes == blocks * BLOCK_BYTES


def _children(worker_pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(worker_pid)], capture_output=True, text=True, check=False
    )
    return [int(p) for p in out.stdout.split()]


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's rank processes (not, e.g., Python's resource tracker)."""
    pids = []
    for pid in _children(worker_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_child_main" in cmdline:
            pids.append(pid)
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its parent's wait
        return f.read().split(") ", 1)[1][0] != "Z"


def test_a_killed_rank_ends_its_worker_in_bounded_time(tiny_llama, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = make_cluster(tiny_llama, tmp_path / "run", prefill=0, decode=1)
    c.start_redis()
    try:
        (worker,) = [c.spawn_worker("decode", 0, TP2)]
        c.wait_ready([worker])
        addr = c.ready["decode-0"]["grpc"]
        (rank1,) = _rank_pids(worker.proc.pid)
        children = _children(worker.proc.pid)
        with channel_to(addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest()).status == 1  # SERVING
            stream = decode_stub(ch).Generate(
                pb.GenerateRequest(
                    request_id="doomed",
                    prompt_token_ids=random_prompts(seed=50, lengths=[40])[0],
                    sampling=pb.SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True),
                ),
                timeout=60,
            )
            next(stream)  # the first chunk: the request is decoding on both ranks
            t0 = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert time.monotonic() - t0 < 15, "the stream outlived the rank by 15 s"
        assert worker.proc.wait(timeout=20) == 1, "the worker must exit non-zero"
        assert time.monotonic() - t0 < 25
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "the worker left processes behind"
    finally:
        c.stop()
