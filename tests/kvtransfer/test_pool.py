"""PoolView: accepted pool objects, validation, aliasing regions, checksums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from kvt_helpers import small_geometry

from kvtransfer import PoolGeometryError
from kvtransfer.pool import PoolView, copy_region

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_typed_torch_pool_regions_alias_block_bytes(dtype):
    name = str(dtype).removeprefix("torch.")
    g = small_geometry(dtype=name)
    pool = torch.zeros(8, *g.block_shape, dtype=dtype)
    view = PoolView(pool, g)
    assert view.num_blocks == 8 and not view.is_cuda
    region = view.region(2, 3)
    assert region.nbytes == 3 * g.block_bytes
    region.buffer[:] = 7  # writes through to the tensor: no copy
    raw = pool.view(torch.uint8).reshape(8, -1)
    assert bool((raw[2:5] == 7).all()) and bool((raw[:2] == 0).all()) and bool((raw[5:] == 0).all())


def test_checksums_are_xxh3_of_each_block():
    g = small_geometry()
    pool = np.random.default_rng(0).integers(0, 256, size=4 * g.block_bytes, dtype=np.uint8)
    view = PoolView(pool, g)
    bb = g.block_bytes
    assert view.checksums(view.region(1, 3)) == [
        xxhash.xxh3_64_intdigest(pool[b * bb : (b + 1) * bb].tobytes()) for b in (1, 2, 3)
    ]


def test_corrupted_copy_flips_one_byte_per_listed_block_and_leaves_pool_alone():
    g = small_geometry()
    pool = np.random.default_rng(1).integers(0, 256, size=4 * g.block_bytes, dtype=np.uint8)
    before = pool.copy()
    view = PoolView(pool, g)
    region = view.region(0, 3)
    bad = view.corrupted_copy(region, [1])
    assert np.array_equal(pool, before)
    diff = np.flatnonzero(np.asarray(bad.buffer) != pool[: 3 * g.block_bytes])
    assert len(diff) == 1 and g.block_bytes <= diff[0] < 2 * g.block_bytes


def test_copy_region_between_pools():
    g = small_geometry()
    a = np.arange(2 * g.block_bytes, dtype=np.uint64).astype(np.uint8)
    b = np.zeros_like(a)
    va, vb = PoolView(a, g), PoolView(b, g)
    copy_region(vb.region(1, 1), va.region(0, 1))
    assert np.array_equal(b[g.block_bytes :], a[: g.block_bytes]) and not b[: g.block_bytes].any()
    with pytest.raises(ValueError):
        copy_region(vb.region(0, 2), va.region(0, 1))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda g: torch.zeros(4, *g.block_shape, dtype=torch.float16), "dtype"),
        (lambda g: torch.zeros(4, 4, 2, 32, 4, 32, dtype=torch.bfloat16), "shape"),
        (
            lambda g: torch.zeros(4, *g.block_shape, dtype=torch.bfloat16).transpose(0, 1),
            "contiguous",
        ),
        (lambda g: np.zeros(g.block_bytes + 1, dtype=np.uint8), "multiple"),
        (lambda g: np.zeros(0, dtype=np.uint8), "multiple"),
        (lambda g: [0] * 10, "torch.Tensor"),
    ],
)
def test_pool_validation(make, match):
    g = small_geometry()
    with pytest.raises(PoolGeometryError, match=match):
        PoolView(make(g), g)


def test_region_bounds():
    g = small_geometry()
    view = PoolView(np.zeros(4 * g.block_bytes, dtype=np.uint8), g)
    for first, count in ((-1, 1), (3, 2), (0, 0)):
        with pytest.raises(IndexError):
            view.region(first, count)
