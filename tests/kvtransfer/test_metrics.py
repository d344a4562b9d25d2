"""TransferMetrics: plain counters and Prometheus series on an injected registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer import TransferMetrics

pytestmark = pytest.mark.unit


def test_counters_and_prometheus_exposition():
    registry = CollectorRegistry()
    m = TransferMetrics(registry)
    m.add_bytes("send", 4096)
    m.transfer_done("send", 0.02)
    m.transfer_failed("recv", "checksum")
    m.checksum_mismatches("recv", 2)
    assert (m.send.bytes_total, m.send.transfers_total, m.recv.failures_total) == (4096, 1, 1)
    assert m.recv.checksum_mismatches_total == 2
    text = generate_latest(registry).decode()
    assert 'pdserve:kv_transfer_bytes_total{direction="send"} 4096.0' in text
    assert 'pdserve:kv_transfer_seconds_count{direction="send"} 1.0' in text
    assert 'pdserve:kv_transfer_failures_total{direction="recv",reason="checksum"} 1.0' in text
    assert 'pdserve:kv_transfer_checksum_mismatches_total{direction="recv"} 2.0' in text


def test_no_global_registration_and_duplicate_registry_rejected():
    TransferMetrics()  # no registry: plain counters only, registers nothing anywhere
    TransferMetrics()
    registry = CollectorRegistry()
    TransferMetrics(registry)
    with pytest.raises(ValueError):
        TransferMetrics(registry)


def test_bad_labels_rejected():
    m = TransferMetrics()
    with pytest.raises(ValueError):
        m.add_bytes("sideways", 1)
    with pytest.raises(ValueError):
        m.transfer_failed("send", "gremlins")
