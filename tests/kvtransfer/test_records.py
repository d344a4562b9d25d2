"""Pure bookkeeping: run coalescing (sender) and header / fin validation (receiver)."""

from __future__ import annotations

import collections

import pytest

from kvtransfer.inbound import InboundTransfer
from kvtransfer.outbound import take_run
from kvtransfer.protocol import Data

pytestmark = pytest.mark.unit


def runs(pairs, dst, max_blocks):
    pending = collections.deque(pairs)
    out = []
    while pending:
        out.append(take_run(pending, dst, max_blocks))
    return out


def test_runs_follow_source_position_and_destination_together():
    dst = [10, 11, 12, 20, 21, 22, 23]
    pairs = [(5, 0), (6, 1), (7, 2), (8, 3), (9, 4), (30, 5), (31, 6)]
    # break at position 3 (destination jumps 12 -> 20) and at position 5 (source jumps 9 -> 30)
    assert runs(pairs, dst, 64) == [(5, 0, 3), (8, 3, 2), (30, 5, 2)]
    assert runs(pairs, dst, 2) == [(5, 0, 2), (7, 2, 1), (8, 3, 2), (30, 5, 2)]


def test_out_of_order_queueing_is_not_merged_backwards():
    dst = [0, 1, 2, 3]
    assert runs([(2, 2), (3, 3), (0, 0), (1, 1)], dst, 64) == [(2, 2, 2), (0, 0, 2)]


def test_header_and_fin_validation():
    t = InboundTransfer("t", [4, 5, 6, 9], 1.0)
    assert t.header_problem(Data(0, 0, 3, None)) is None
    assert "not adjacent" in t.header_problem(Data(0, 2, 2, None))
    assert "outside" in t.header_problem(Data(0, 3, 2, None))
    t.seen[0:3] = b"\x01\x01\x01"
    assert "overlap" in t.header_problem(Data(0, 2, 1, None))
    assert "after 3 of 4" in t.fin_problem(3, need_checksums=False)
    assert "before all 4 blocks" in t.fin_problem(4, need_checksums=False)
    t.seen[3] = 1
    assert t.fin_problem(4, need_checksums=False) is None
