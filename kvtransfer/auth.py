"""Who may talk to a receiver, and data tags nobody else can guess.

* **Handshake proofs.** Every process of a cluster knows the cluster secret. On accept the
  receiver sends a fresh ``challenge`` nonce; the sender's ``hello`` carries its own nonce and
  an HMAC-SHA256 over both nonces, keyed by the secret; the receiver's ``hello_ok`` carries an
  HMAC over both nonces and everything else it says (link id, tag key), so each side proves it
  holds the secret without sending it, and a recorded handshake cannot be replayed (the nonces
  are new each time). A cluster without a secret uses the empty key: every member agrees, and
  anyone who reaches the port can join (the worker logs a warning at start-up).
* **Data tags.** UCX matches tagged messages across the whole worker, not per connection, so a
  tag must be something only the two ends of its connection can compute. Each connection gets a
  random 128-bit tag key in ``hello_ok``; the low 48 bits of a tag are a keyed permutation (a
  four-round Feistel network over blake2b) of ``transfer number | block index``, the high 16
  bits the connection's link id. Tags stay unique per receiver (a permutation per link id), and
  a peer without the key cannot aim a message at another connection's posted receive.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 16
TAG_KEY_BYTES = 16
PROOF_BYTES = 32
_HALF_BITS = 24
_HALF_MASK = (1 << _HALF_BITS) - 1
_ROUNDS = 4


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_tag_key() -> bytes:
    return secrets.token_bytes(TAG_KEY_BYTES)


def proof(secret: bytes | None, label: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``label`` and ``parts`` (each length-prefixed), keyed by ``secret``."""
    mac = hmac.new(secret or b"", b"pdserve-kv/" + label.encode(), hashlib.sha256)
    for p in parts:
        mac.update(len(p).to_bytes(4, "little"))
        mac.update(p)
    return mac.digest()


def proof_ok(expected: bytes, got: bytes | None) -> bool:
    return got is not None and hmac.compare_digest(expected, got)


def hello_proof(secret: bytes | None, challenge: bytes, nonce: bytes, sender_id: str) -> bytes:
    """The sender's proof in ``hello``: the receiver's challenge, its own nonce, its id."""
    return proof(secret, "hello", challenge, nonce, sender_id.encode())


def hello_ok_proof(
    secret: bytes | None,
    nonce: bytes,
    challenge: bytes,
    receiver_id: str,
    link_id: int,
    tag_key: bytes,
) -> bytes:
    """The receiver's proof in ``hello_ok``: both nonces and everything else it says."""
    return proof(
        secret,
        "hello_ok",
        nonce,
        challenge,
        receiver_id.encode(),
        link_id.to_bytes(2, "little"),
        tag_key,
    )


class TagCipher:
    """The data tags of one connection (see the module docstring)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if len(key) != TAG_KEY_BYTES:
            raise ValueError(f"a tag key has {TAG_KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    def _round(self, i: int, half: int) -> int:
        h = hashlib.blake2b(half.to_bytes(3, "little") + bytes((i,)), key=self._key, digest_size=3)
        return int.from_bytes(h.digest(), "little")

    def tag(self, link_id: int, transfer_number: int, first_index: int) -> int:
        """``link_id`` (16 bits) | permuted(``transfer_number`` (24) | ``first_index`` (24))."""
        left, right = transfer_number & _HALF_MASK, first_index & _HALF_MASK
        for i in range(_ROUNDS):
            left, right = right, left ^ self._round(i, right)
        return (link_id << 48) | (left << _HALF_BITS) | right
