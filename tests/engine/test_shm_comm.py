"""The shared-memory TP collectives (shared/engine/shm_comm.py) between real processes: sums and
gathers equal torch's in rank order on every rank, bitwise the same on all ranks, over many
back-to-back calls (the double-buffered slots are reused), tensors larger than a slot through
gloo, and a bounded wait when a peer never comes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster_utils import free_port

WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
rank, size, port, out, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
from shared.engine.shm_comm import ShmComm, CommTimeoutError
comm = ShmComm(f"pdserve-test-{port}", rank, size, dist.group.WORLD)
if mode == "timeout":
    if rank == 0:
        try:
            comm.all_reduce(torch.ones(4))
            res = {"raised": None}
        except CommTimeoutError as e:
            res = {"raised": str(e)}
        json.dump(res, open(out, "w"))
    dist.barrier()  # rank 1 never joins the collective: it waits for rank 0 here
    sys.exit(0)
results = []
for i in range(300):
    g = torch.Generator().manual_seed(1000 * i + rank)
    n = [1, 7, 256, 4096, 70000][i % 5]  # 70000 fp32 = 280 KB > the 0.25 MiB slot: gloo
    dtype = [torch.float32, torch.bfloat16][i % 2]
    x = torch.randn(3, n, generator=g).to(dtype)
    if i % 3 == 2:
        y = comm.all_gather_last(x)
    else:
        y = comm.all_reduce(x.clone())
    results.append([i, y.float().sum().item(), y.float().abs().sum().item(), list(y.shape)])
json.dump(results, open(out, "w"))
"""


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
    for i, total, abs_total, shape in per_rank[0]:
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
        if n <= 4096 or i % 3 == 2:  # through the slots: exactly torch's rank-order sum
            assert total == want.float().sum().item(), i
            assert abs_total == want.float().abs().sum().item(), i
        else:  # gloo's own summation order
            assert abs(abs_total - want.float().abs().sum().item()) <= 1e-2 * abs_total


def test_a_peer_that_never_comes_is_a_bounded_wait(tmp_path):
    (rank0,) = _run(2, tmp_path, "timeout", {"PDSERVE_SHM_TIMEOUT_S": "1"})  # rank 0 writes
    assert rank0["raised"] and "missed collective 1" in rank0["raised"]


def test_nothing_is_left_in_dev_shm(tmp_path):
    before = set(os.listdir("/dev/shm"))
    _run(2, tmp_path)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("pdserve")}
