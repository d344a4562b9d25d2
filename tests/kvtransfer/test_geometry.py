"""KVGeometry: sizes, normalisation, validation, comparison and wire form."""

from __future__ import annotations

import pytest
from kvt_helpers import small_geometry

from kvtransfer import KVGeometry, ProtocolError

pytestmark = pytest.mark.unit


def test_small_model_block_is_32_kib():
    g = small_geometry()
    assert g.block_shape == (4, 2, 16, 4, 32)
    assert g.block_bytes == 4 * 2 * 16 * 4 * 32 * 2 == 32768


@pytest.mark.parametrize(
    "name,canonical,size",
    [
        ("bfloat16", "bfloat16", 2),
        ("torch.float16", "float16", 2),
        ("half", "float16", 2),
        ("fp8", "float8_e4m3fn", 1),
        ("fp8_e4m3", "float8_e4m3fn", 1),
        ("float8_e5m2", "float8_e5m2", 1),
        ("float", "float32", 4),
    ],
)
def test_dtype_aliases_normalise(name, canonical, size):
    g = small_geometry(dtype=name)
    assert g.dtype == canonical
    assert g.block_bytes == 4 * 2 * 16 * 4 * 32 * size
    assert g == small_geometry(dtype=canonical)


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "int4"),
        ("layout", "head_major"),
        ("block_size", 0),
        ("num_layers", -1),
        ("head_dim", 2.5),
        ("num_kv_heads", True),
        ("model", ""),
    ],
)
def test_invalid_geometry_raises_value_error(field, value):
    with pytest.raises(ValueError):
        small_geometry(**{field: value})


def test_mismatches_name_both_values():
    a = small_geometry()
    b = small_geometry(dtype="fp8", block_size=32)
    diffs = a.mismatches(b, local="sender", remote="receiver")
    assert diffs == [
        "dtype (sender=bfloat16, receiver=float8_e4m3fn)",
        "block_size (sender=16, receiver=32)",
    ]
    assert a.mismatches(small_geometry()) == []


def test_wire_round_trip_and_rejection():
    g = small_geometry(dtype="fp8")
    assert KVGeometry.from_wire(g.to_wire()) == g
    bad = g.to_wire() | {"head_dim": "32"}
    with pytest.raises(ProtocolError, match="head_dim"):
        KVGeometry.from_wire(bad)
    with pytest.raises(ProtocolError):
        KVGeometry.from_wire({"model": "x"})
    with pytest.raises(ProtocolError):
        KVGeometry.from_wire([1, 2])


def test_geometry_is_frozen_and_keyword_only():
    g = small_geometry()
    with pytest.raises(AttributeError):
        g.block_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        KVGeometry("m", "bfloat16", "block_major_v1", 16, 4, 4, 32)  # type: ignore[misc]
