"""Fixtures for the kvtransfer tests (helpers live in kvt_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from kvt_helpers import random_pool, small_geometry

from kvtransfer import KVGeometry, LoopbackNetwork, create_receiver, create_sender


@pytest.fixture
def geometry() -> KVGeometry:
    return small_geometry()


@pytest.fixture
def loopback_pair(geometry):
    """Factory: (sender, receiver, src_pool, dst_pool) over one LoopbackNetwork; all closed after."""
    made = []

    def make(
        num_src=64,
        num_dst=64,
        sender_opts=None,
        receiver_opts=None,
        src_geometry=None,
        network=None,
        seed=1,
    ):
        net = network or LoopbackNetwork()
        g_src = src_geometry or geometry
        src = random_pool(num_src, g_src, seed)
        dst = np.zeros(num_dst * geometry.block_bytes, dtype=np.uint8)
        receiver = create_receiver("loopback", dst, geometry, network=net, **(receiver_opts or {}))
        made.append(receiver)
        sender = create_sender("loopback", src, g_src, network=net, **(sender_opts or {}))
        made.append(sender)
        return sender, receiver, src, dst

    yield make
    for endpoint in reversed(made):
        endpoint.close()


@pytest.fixture(autouse=True)
def _nixl_stays_out_of_this_process():
    """NIXL's own UCX beside ucxx's makes UCX 1.21 crash aborting a rendezvous (see
    test_nixl.py): a test that loads NIXL here fails, whichever test it is."""
    yield
    import sys

    assert "nixl_cu12" not in sys.modules, "a test loaded NIXL into the test process"
