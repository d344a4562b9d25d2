"""Control-message encoding, strict decoding, addresses and tags."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer import InvalidAddressError, ProtocolError
from kvtransfer.protocol import (
    Cancel,
    Challenge,
    Data,
    Done,
    Error,
    Fail,
    Fin,
    Hello,
    HelloOk,
    Open,
    ReceiverAddress,
    Refuse,
    Sums,
    data_tag,
    decode_ops,
    encode_ops,
)

pytestmark = pytest.mark.unit

ALL_OPS = [
    Challenge(b"n" * 16),
    Hello({"model": "m"}, True, "abc", b"n" * 16, b"p" * 32),
    HelloOk("rid", 7, b"k" * 16, b"p" * 32),
    Refuse("no", {"model": "m"}),
    Refuse("no", None),
    Open(3, "req-1", [5, 6, 9]),
    Data(3, 0, 2, [1, (1 << 64) - 1]),
    Data(3, 2, 1, None),
    Sums(3, 2, [7]),
    Fin(3, 3),
    Fin(4, 1, b"\x08\x01 first token"),
    Cancel(3, "bye"),
    Done(3),
    Fail(3, "checksum", "bad", 1),
    Fail(4, "timeout", "late"),
    Error("what"),
]


def test_every_op_round_trips_in_one_message():
    assert decode_ops(encode_ops(ALL_OPS)) == ALL_OPS


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"\xc1", "msgpack"),
        (msgpack.packb({"op": "done", "x": 1}), "array"),
        (msgpack.packb([]), "non-empty"),
        (msgpack.packb([{"op": "launch"}]), "unknown op"),
        (msgpack.packb([{"x": 1}]), "'op'"),
        (msgpack.packb([{"op": "done"}]), "missing field 'x'"),
        (msgpack.packb([{"op": "done", "x": -1}]), "'x'"),
        (msgpack.packb([{"op": "done", "x": 1 << 30}]), "'x'"),
        (msgpack.packb([{"op": "done", "x": True}]), "'x'"),
        (msgpack.packb([{"op": "data", "x": 1, "i": 0, "k": 0, "ck": None}]), "'k'"),
        (msgpack.packb([{"op": "data", "x": 1, "i": 0, "k": 2, "ck": [1]}]), "checksums"),
        (msgpack.packb([{"op": "data", "x": 1, "i": 0, "k": 1, "ck": ["a"]}]), "'ck'"),
        (msgpack.packb([{"op": "open", "x": 1, "id": "r", "dst": []}]), "empty"),
        (msgpack.packb([{"op": "sums", "x": 1, "i": 0, "ck": []}]), "empty"),
        (msgpack.packb([{"op": "open", "x": 1, "id": 5, "dst": [1]}]), "'id'"),
        (
            msgpack.packb(
                [{"op": "hello", "geometry": [], "checksums": True, "sender": "s", "proto": 1}]
            ),
            "geometry",
        ),
        (msgpack.packb([{"op": "done", "x": 1}, "junk"]), "map"),
        (msgpack.packb([{"op": "fin", "x": 1, "n": 1, "note": "text"}]), "'note'"),
        (msgpack.packb([{"op": "fin", "x": 1, "n": 1, "note": b"x" * (1 << 20 | 1)}]), "'note'"),
    ],
)
def test_malformed_messages_raise_protocol_error(payload, match):
    with pytest.raises(ProtocolError, match=match):
        decode_ops(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_only_ever_raise_protocol_error(payload):
    try:
        ops = decode_ops(payload)
    except ProtocolError:
        return
    assert isinstance(ops, list) and ops


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=8),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
        max_leaves=12,
    )
)
def test_arbitrary_msgpack_structures_only_ever_raise_protocol_error(obj):
    try:
        decode_ops(msgpack.packb([obj]))
    except ProtocolError:
        pass


def test_address_round_trip_and_errors():
    a = ReceiverAddress("ucx", "10.0.0.5", 41000, "0123abcd")
    assert ReceiverAddress.decode(a.encode()) == a
    assert str(a) == "ucx://10.0.0.5:41000/0123abcd"
    for bad in (
        b"",
        b"\x00\x01",
        msgpack.packb({"v": 2}),
        msgpack.packb({"v": 1, "kind": "tcp"}),
        "text",
    ):
        with pytest.raises(InvalidAddressError):
            ReceiverAddress.decode(bad)  # type: ignore[arg-type]


def test_data_tags_are_unique_per_link_and_unguessable_without_the_key():
    from kvtransfer.auth import TagCipher

    key_a, key_b = TagCipher(b"a" * 16), TagCipher(b"b" * 16)
    cases = [(x, i) for x in (0, 1, 2, (1 << 24) - 1) for i in (0, 1, 2, (1 << 24) - 1)]
    tags = {data_tag(key_a, link, x, i) for link in (1, 2) for x, i in cases}
    assert len(tags) == 2 * len(cases)  # a permutation per link: no collisions
    assert all(t >> 48 in (1, 2) and t < 1 << 64 for t in tags)
    # the old, guessable layout is not what goes on the wire, and another key gives other tags
    plain = {(1 << 48) | (x << 24) | i for x, i in cases}
    assert not plain & {data_tag(key_a, 1, x, i) for x, i in cases}
    assert not {data_tag(key_a, 1, x, i) for x, i in cases} & {
        data_tag(key_b, 1, x, i) for x, i in cases
    }
    assert data_tag(key_a, 1, 2, 3) == data_tag(TagCipher(b"a" * 16), 1, 2, 3)  # both ends agree
