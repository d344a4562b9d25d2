"""Wire format of the KV transfer control plane (msgpack) and of receiver addresses.

A control message is a msgpack array of operations, each a map with an ``"op"`` key, so
one network message can carry an ``open``, several ``data`` headers and a ``fin``. Bulk block
bytes never travel here: each ``data`` header announces one tagged data message (see
:func:`data_tag`) that the receiver receives straight into its pool. The full protocol is
described in ``docs/notes/kvtransfer.md``.

:func:`decode_ops` validates every field (types, ranges, sizes) and raises
:class:`ProtocolError` on anything else, so the state machines only ever see well-formed ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import msgpack

from kvtransfer.auth import NONCE_BYTES, PROOF_BYTES, TAG_KEY_BYTES, TagCipher
from kvtransfer.errors import InvalidAddressError, ProtocolError

PROTOCOL_VERSION = 2  # 2: challenge, handshake proofs, keyed data tags
#: Largest control message accepted, in bytes.
MAX_CTRL_BYTES = 16 << 20
# A receiver's control frames before the sender's hello is accepted (the challenge answer, and
# with NIXL the agent's metadata): an unauthenticated peer cannot make it buffer 16 MiB frames
# on each of up to max_connections connections.
PRE_AUTH_CTRL_BYTES = 1 << 20
#: Largest number of blocks in one transfer (the block index must fit in 24 bits of a tag).
MAX_BLOCKS_PER_TRANSFER = 1 << 20
#: Transfer numbers are per connection and wrap at this bound (24 bits of a tag).
TRANSFER_NUMBER_LIMIT = 1 << 24
#: Connection ids are assigned by the receiver and wrap at this bound (16 bits of a tag).
LINK_ID_LIMIT = 1 << 16
_MAX_STR = 4096
#: Largest ``fin`` note (the sender's own bytes for the receiver's caller).
MAX_FIN_NOTE_BYTES = 1 << 20
_U64 = (1 << 64) - 1


def data_tag(cipher: TagCipher, link_id: int, transfer_number: int, first_index: int) -> int:
    """The 64-bit UCX tag of the data message whose first block is ``first_index``.

    ``link_id`` (16 bits, unique per receiver) | a keyed permutation of ``transfer_number``
    (24 bits) | ``first_index`` (24 bits) under the connection's tag key
    (:class:`kvtransfer.auth.TagCipher`): unique per receiver while the transfer is active, and
    unguessable from any other connection (UCX matches tags across the receiver's whole worker).
    """
    return cipher.tag(link_id, transfer_number, first_index)


# ---- operations -------------------------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    """Receiver -> sender, first message on a connection: a fresh nonce to prove against."""

    nonce: bytes
    proto: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Hello:
    """Sender -> receiver, answering ``challenge``: ``proof`` = HMAC(secret, nonces, sender)."""

    geometry: dict[str, Any]
    checksums: bool
    sender_id: str
    nonce: bytes = b""
    proof: bytes = b""
    proto: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class HelloOk:
    """Receiver -> sender: handshake accepted; ``link_id`` and ``tag_key`` make every data
    tag of this connection; ``proof`` = HMAC(secret, nonces, everything above)."""

    receiver_id: str
    link_id: int
    tag_key: bytes = b""
    proof: bytes = b""
    proto: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Refuse:
    """Receiver -> sender: handshake refused; ``reason`` names both sides' values."""

    reason: str
    geometry: dict[str, Any] | None


@dataclass(frozen=True)
class Open:
    """Sender -> receiver: transfer ``x`` of ``transfer_id`` into ``dst`` (pool block ids)."""

    x: int
    transfer_id: str
    dst: list[int]


@dataclass(frozen=True)
class Data:
    """Sender -> receiver: blocks ``[index, index + count)`` follow in one tagged message."""

    x: int
    index: int
    count: int
    checksums: (
        list[int] | None
    )  # xxh3_64 of each block; None: a ``sums`` op follows, or checksums are off


@dataclass(frozen=True)
class Sums:
    """Sender -> receiver: xxh3_64 of the blocks of the data message starting at ``index``.

    Sent when the checksums of a ``data`` message were computed after it went out (the usual
    case: hashing overlaps the transfer). Always before the transfer's ``fin``.
    """

    x: int
    index: int
    checksums: list[int]


@dataclass(frozen=True)
class Fin:
    """Sender -> receiver: all ``count`` blocks of transfer ``x`` have been sent.

    ``note``: opaque bytes from the sender's caller for the receiver's (the prefill worker's
    first token(s)), handed over with the blocks so the decode side need not wait for a reply
    on another channel; empty when the caller gave none (and then absent on the wire).
    """

    x: int
    count: int
    note: bytes = b""


@dataclass(frozen=True)
class Cancel:
    """Sender -> receiver: the sender abandoned transfer ``x``."""

    x: int
    reason: str


@dataclass(frozen=True)
class Done:
    """Receiver -> sender: every block of transfer ``x`` arrived and verified."""

    x: int


@dataclass(frozen=True)
class Fail:
    """Receiver -> sender: transfer ``x`` failed on the receiver (``code`` is machine-readable).

    For ``code == "checksum"``, ``index`` is the first mismatching block index.
    """

    x: int
    code: str
    reason: str
    index: int | None = None


@dataclass(frozen=True)
class Error:
    """Either direction: a message was rejected and cannot be tied to a transfer."""

    reason: str


Op = Challenge | Hello | HelloOk | Refuse | Open | Data | Sums | Fin | Cancel | Done | Fail | Error

#: Machine-readable ``Fail.code`` values.
FAIL_CODES = (
    "checksum",
    "timeout",
    "cancelled",
    "unknown_transfer",
    "mismatch",
    "protocol",
    "closed",
)


# ---- encoding ---------------------------------------------------------------------------


def _op_to_wire(op: Op) -> dict[str, Any]:
    if isinstance(op, Challenge):
        return {"op": "challenge", "proto": op.proto, "nonce": op.nonce}
    if isinstance(op, Hello):
        return {
            "op": "hello",
            "proto": op.proto,
            "geometry": op.geometry,
            "checksums": op.checksums,
            "sender": op.sender_id,
            "nonce": op.nonce,
            "proof": op.proof,
        }
    if isinstance(op, HelloOk):
        return {
            "op": "hello_ok",
            "proto": op.proto,
            "receiver": op.receiver_id,
            "link": op.link_id,
            "tag_key": op.tag_key,
            "proof": op.proof,
        }
    if isinstance(op, Refuse):
        return {"op": "refuse", "reason": op.reason, "geometry": op.geometry}
    if isinstance(op, Open):
        return {"op": "open", "x": op.x, "id": op.transfer_id, "dst": op.dst}
    if isinstance(op, Data):
        return {"op": "data", "x": op.x, "i": op.index, "k": op.count, "ck": op.checksums}
    if isinstance(op, Sums):
        return {"op": "sums", "x": op.x, "i": op.index, "ck": op.checksums}
    if isinstance(op, Fin):
        if op.note:
            return {"op": "fin", "x": op.x, "n": op.count, "note": op.note}
        return {"op": "fin", "x": op.x, "n": op.count}
    if isinstance(op, Cancel):
        return {"op": "cancel", "x": op.x, "reason": op.reason}
    if isinstance(op, Done):
        return {"op": "done", "x": op.x}
    if isinstance(op, Fail):
        return {"op": "fail", "x": op.x, "code": op.code, "reason": op.reason, "i": op.index}
    if isinstance(op, Error):
        return {"op": "error", "reason": op.reason}
    raise TypeError(f"not a protocol op: {op!r}")


def encode_ops(ops: list[Op]) -> bytes:
    """Serialise a batch of operations into one control message."""
    return cast(bytes, msgpack.packb([_op_to_wire(op) for op in ops], use_bin_type=True))


# ---- decoding ---------------------------------------------------------------------------


def _field(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ProtocolError(f"{d.get('op')!r} op is missing field {key!r}")
    return d[key]


@overload
def _int(d: dict[str, Any], key: str, hi: int = ..., *, optional: Literal[False] = ...) -> int: ...
@overload
def _int(d: dict[str, Any], key: str, hi: int = ..., *, optional: bool) -> int | None: ...
def _int(d: dict[str, Any], key: str, hi: int = _U64, *, optional: bool = False) -> int | None:
    v = d.get(key) if optional else _field(d, key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise ProtocolError(
            f"{d.get('op')!r} op field {key!r} must be an int in [0, {hi}], got {v!r}"
        )
    return v


@overload
def _str(
    d: dict[str, Any], key: str, *, optional: Literal[False] = ..., max_len: int = ...
) -> str: ...
@overload
def _str(d: dict[str, Any], key: str, *, optional: bool, max_len: int = ...) -> str | None: ...
def _str(
    d: dict[str, Any], key: str, *, optional: bool = False, max_len: int = _MAX_STR
) -> str | None:
    v = d.get(key) if optional else _field(d, key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(
            f"{d.get('op')!r} op field {key!r} must be a string of at most {max_len} chars"
        )
    return v


@overload
def _int_list(
    d: dict[str, Any], key: str, *, max_len: int, hi: int, optional: Literal[False] = ...
) -> list[int]: ...
@overload
def _int_list(
    d: dict[str, Any], key: str, *, max_len: int, hi: int, optional: bool
) -> list[int] | None: ...
def _int_list(
    d: dict[str, Any], key: str, *, max_len: int, hi: int, optional: bool = False
) -> list[int] | None:
    v = d.get(key) if optional else _field(d, key)
    if v is None and optional:
        return None
    if not isinstance(v, list) or len(v) > max_len:
        raise ProtocolError(
            f"{d.get('op')!r} op field {key!r} must be a list of at most {max_len} ints"
        )
    for item in v:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= hi:
            raise ProtocolError(
                f"{d.get('op')!r} op field {key!r} holds {item!r}, not an int in [0, {hi}]"
            )
    return v


def _bytes(d: dict[str, Any], key: str, size: int) -> bytes:
    v = _field(d, key)
    if not isinstance(v, bytes) or len(v) != size:
        raise ProtocolError(f"{d.get('op')!r} op field {key!r} must be {size} bytes")
    return v


def _x(d: dict[str, Any]) -> int:
    return _int(d, "x", TRANSFER_NUMBER_LIMIT - 1)


def _decode_op(d: Any) -> Op:
    if not isinstance(d, dict) or not isinstance(d.get("op"), str):
        raise ProtocolError(
            f"an operation must be a map with a string 'op', got {type(d).__name__}"
        )
    kind = d["op"]
    if kind == "challenge":
        return Challenge(nonce=_bytes(d, "nonce", NONCE_BYTES), proto=_int(d, "proto", 1 << 16))
    if kind == "hello":
        geometry = _field(d, "geometry")
        if not isinstance(geometry, dict):
            raise ProtocolError("'hello' op field 'geometry' must be a map")
        checksums = _field(d, "checksums")
        if not isinstance(checksums, bool):
            raise ProtocolError("'hello' op field 'checksums' must be a bool")
        return Hello(
            geometry=geometry,
            checksums=checksums,
            sender_id=_str(d, "sender"),
            nonce=_bytes(d, "nonce", NONCE_BYTES),
            proof=_bytes(d, "proof", PROOF_BYTES),
            proto=_int(d, "proto", 1 << 16),
        )
    if kind == "hello_ok":
        return HelloOk(
            receiver_id=_str(d, "receiver"),
            link_id=_int(d, "link", LINK_ID_LIMIT - 1),
            tag_key=_bytes(d, "tag_key", TAG_KEY_BYTES),
            proof=_bytes(d, "proof", PROOF_BYTES),
            proto=_int(d, "proto", 1 << 16),
        )
    if kind == "refuse":
        geometry = d.get("geometry")
        if geometry is not None and not isinstance(geometry, dict):
            raise ProtocolError("'refuse' op field 'geometry' must be a map or nil")
        return Refuse(reason=_str(d, "reason"), geometry=geometry)
    if kind == "open":
        dst = _int_list(d, "dst", max_len=MAX_BLOCKS_PER_TRANSFER, hi=(1 << 62))
        if not dst:
            raise ProtocolError("'open' op field 'dst' must not be empty")
        return Open(x=_x(d), transfer_id=_str(d, "id"), dst=dst)
    if kind == "data":
        count = _int(d, "k", MAX_BLOCKS_PER_TRANSFER)
        if count == 0:
            raise ProtocolError("'data' op field 'k' must be at least 1")
        ck = _int_list(d, "ck", max_len=MAX_BLOCKS_PER_TRANSFER, hi=_U64, optional=True)
        if ck is not None and len(ck) != count:
            raise ProtocolError(f"'data' op carries {len(ck)} checksums for {count} blocks")
        return Data(
            x=_x(d), index=_int(d, "i", MAX_BLOCKS_PER_TRANSFER - 1), count=count, checksums=ck
        )
    if kind == "sums":
        ck = _int_list(d, "ck", max_len=MAX_BLOCKS_PER_TRANSFER, hi=_U64)
        if not ck:
            raise ProtocolError("'sums' op field 'ck' must not be empty")
        return Sums(x=_x(d), index=_int(d, "i", MAX_BLOCKS_PER_TRANSFER - 1), checksums=ck)
    if kind == "fin":
        note = d.get("note", b"")
        if not isinstance(note, bytes) or len(note) > MAX_FIN_NOTE_BYTES:
            raise ProtocolError(f"'fin' op field 'note' must be at most {MAX_FIN_NOTE_BYTES} bytes")
        return Fin(x=_x(d), count=_int(d, "n", MAX_BLOCKS_PER_TRANSFER), note=note)
    if kind == "cancel":
        return Cancel(x=_x(d), reason=_str(d, "reason"))
    if kind == "done":
        return Done(x=_x(d))
    if kind == "fail":
        code = _str(d, "code")
        return Fail(
            x=_x(d),
            code=code,
            reason=_str(d, "reason"),
            index=_int(d, "i", MAX_BLOCKS_PER_TRANSFER - 1, optional=True),
        )
    if kind == "error":
        return Error(reason=_str(d, "reason"))
    raise ProtocolError(f"unknown op {kind[:64]!r}")


def decode_ops(payload: bytes | bytearray | memoryview) -> list[Op]:
    """Parse one control message; raises :class:`ProtocolError` if anything is malformed."""
    if len(payload) > MAX_CTRL_BYTES:
        raise ProtocolError(f"control message of {len(payload)} bytes exceeds {MAX_CTRL_BYTES}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # noqa: BLE001  (msgpack raises several unrelated types on garbage)
        raise ProtocolError(
            f"control message is not valid msgpack: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(raw, list) or not raw:
        raise ProtocolError(
            f"control message must be a non-empty array of ops, got {type(raw).__name__}"
        )
    return [_decode_op(item) for item in raw]


# ---- receiver addresses -----------------------------------------------------------------


@dataclass(frozen=True)
class ReceiverAddress:
    """Where a receiver listens: opaque bytes to everyone but this module.

    ``receiver_id`` identifies the receiver *instance*: a restarted receiver on the same
    host and port has a new one, so senders detect stale addresses and stale connections.
    """

    kind: str  # "ucx" | "nixl" | "loopback"
    host: str
    port: int
    receiver_id: str

    def encode(self) -> bytes:
        return cast(
            bytes,
            msgpack.packb(
                {
                    "v": 1,
                    "kind": self.kind,
                    "host": self.host,
                    "port": self.port,
                    "receiver": self.receiver_id,
                },
                use_bin_type=True,
            ),
        )

    @classmethod
    def decode(cls, data: bytes) -> ReceiverAddress:
        """Parse :meth:`encode`'s output; raises :class:`InvalidAddressError` otherwise."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidAddressError(f"receiver address must be bytes, got {type(data).__name__}")
        try:
            d = msgpack.unpackb(bytes(data), raw=False)
        except Exception as e:  # noqa: BLE001  (as above: any msgpack failure)
            raise InvalidAddressError(f"receiver address is not valid msgpack: {e}") from None
        if not isinstance(d, dict) or d.get("v") != 1:
            raise InvalidAddressError(f"unsupported receiver address {d!r}")
        kind, host, port, rid = d.get("kind"), d.get("host"), d.get("port"), d.get("receiver")
        if (
            kind not in ("ucx", "nixl", "loopback")
            or not isinstance(host, str)
            or not host
            or isinstance(port, bool)
            or not isinstance(port, int)
            or not 0 <= port < (1 << 32)
            or not isinstance(rid, str)
        ):
            raise InvalidAddressError(f"malformed receiver address {d!r}")
        return cls(kind=kind, host=host, port=port, receiver_id=rid)

    def __str__(self) -> str:
        return f"{self.kind}://{self.host}:{self.port}/{self.receiver_id}"
