"""The shared-memory TP collectives (shared/engine/shm_comm.py) between real processes: sums and
gathers (through ``Shard``, as the model calls them) equal torch's in rank order on every rank,
bitwise the same on all ranks, over many back-to-back calls (the double-buffered slots are
reused), tensors larger than a slot through gloo, and a bounded wait when a peer never comes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster_utils import free_port

WORKER = r"""
import hashlib, json, os, sys
import torch, torch.distributed as dist
rank, size, port, out, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
from shared.engine.shm_comm import ShmBroadcast, ShmComm, CommTimeoutError
comm = ShmComm(f"pdserve-test-{port}", rank, size, dist.group.WORLD)
if mode == "peer_dies":
    if rank == 1:
        os._exit(0)  # gone before the collective
    import time
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
        res = {"raised": None}
    except Exception as e:
        res = {"raised": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0}
    json.dump(res, open(out, "w"))
    os._exit(0)  # the gloo group has lost rank 1: no clean teardown
if mode == "broadcast":
    import time
    chan = ShmBroadcast(f"pdserve-test-{port}-ctl", rank, size, dist.group.WORLD)
    got = []
    for i in range(500):
        big = i % 97 == 5  # 3 MB: over the 1 MiB buffer, through gloo
        msg = ("step", i, list(range(i % 50)), "x" * (3_000_000 if big else i))
        if rank == 0:
            chan.send(msg)
        else:
            if i % 50 == 0:
                time.sleep(0.05)  # a slow reader: the writer must wait, not overwrite
            m = chan.recv()
            got.append([m[1], m[2] == list(range(i % 50)), len(m[3])])
    json.dump(got, open(out, "w"))
    os._exit(0)  # no gloo teardown at interpreter exit (it can abort the process)
if mode == "timeout":
    if rank == 0:
        try:
            comm.all_reduce(torch.ones(4))
            res = {"raised": None}
        except CommTimeoutError as e:
            res = {"raised": str(e)}
        json.dump(res, open(out, "w"))
    dist.barrier()  # rank 1 never joins the collective: it waits for rank 0 here
    os._exit(0)
from shared.models.sharding import Shard
shard = Shard(tp_size=size, tp_rank=rank, group=dist.group.WORLD, comm=comm)  # as the model uses it
results = []
for i in range(300):
    g = torch.Generator().manual_seed(1000 * i + rank)
    n = [1, 7, 256, 4096, 70000][i % 5]  # 70000 fp32 = 280 KB > the 0.25 MiB slot: gloo
    dtype = [torch.float32, torch.bfloat16][i % 2]
    x = torch.randn(3, n, generator=g).to(dtype)
    if i % 3 == 2:
        y = shard.all_gather_last(x)
    else:
        y = shard.all_reduce(x.clone())
    digest = hashlib.sha256(y.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    results.append([i, digest, y.float().abs().sum().item(), list(y.shape)])
json.dump(results, open(out, "w"))
os._exit(0)
"""


def _digest(t) -> str:
    import hashlib

    import torch

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _run(size: int, tmp_path, mode: str = "ops", env_extra: dict | None = None) -> list:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PDSERVE_SHM_SLOT_MB="0.25")
    env.update(env_extra or {})
    outs = [tmp_path / f"r{r}.json" for r in range(size)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(size), str(port), str(outs[r]), mode],
            env=env,
        )
        for r in range(size)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return [json.loads(o.read_text()) for o in outs if o.exists()]


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_match_torch_on_every_rank(tmp_path, size):
    import torch

    per_rank = _run(size, tmp_path)
    assert len(per_rank) == size
    assert all(r == per_rank[0] for r in per_rank[1:]), "ranks disagree"
    for i, digest, abs_total, shape in per_rank[0]:
        n = [1, 7, 256, 4096, 70000][i % 5]
        dtype = [torch.float32, torch.bfloat16][i % 2]
        xs = [
            torch.randn(3, n, generator=torch.Generator().manual_seed(1000 * i + r)).to(dtype)
            for r in range(size)
        ]
        if i % 3 == 2:
            want = torch.cat(xs, dim=-1)
        else:
            want = xs[0] + xs[1]
            for x in xs[2:]:
                want = want + x
        assert shape == list(want.shape)
        if n <= 4096 or i % 3 == 2:  # the slots (or a gather): exactly torch's rank-order sum
            assert digest == _digest(want), i
        else:  # gloo's own summation order
            assert abs(abs_total - want.float().abs().sum().item()) <= 1e-2 * abs_total


def test_a_peer_that_never_comes_is_a_bounded_wait(tmp_path):
    (rank0,) = _run(2, tmp_path, "timeout", {"PDSERVE_SHM_TIMEOUT_S": "1"})  # rank 0 writes
    assert rank0["raised"] and "missed collective 1" in rank0["raised"]


def test_nothing_is_left_in_dev_shm(tmp_path):
    before = set(os.listdir("/dev/shm"))
    _run(2, tmp_path)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("pdserve")}


def test_control_messages_arrive_in_order_whole_and_once(tmp_path):
    """ShmBroadcast: 500 messages to 2 readers, one slow now and then, a few larger than the
    buffer (through gloo): each reader sees every message once, in order, intact."""
    writer, *readers = _run(3, tmp_path, "broadcast", {"PDSERVE_SHM_CONTROL_MB": "1"})
    want = [[i, True, 3_000_000 if i % 97 == 5 else i] for i in range(500)]
    assert writer == [] and readers == [want, want]


def test_a_peer_that_exited_fails_the_wait_at_once(tmp_path):
    """A dead peer is noticed by its pid, long before the wait's timeout (60 s here)."""
    (rank0,) = _run(2, tmp_path, "peer_dies", {"PDSERVE_SHM_TIMEOUT_S": "60"})
    assert rank0["raised"].startswith("PeerDiedError: rank process")
    assert rank0["after_s"] < 5
