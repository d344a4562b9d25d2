"""The one-pass projection (kernels/csrc/cpu_paged.cpp, ``amx_linear_bf16`` /
``amx_argmax_bf16``) on AMX tiles (``tiles``) and on AVX512-BF16 dot products (``dp``): the
product within bf16 rounding, the same bits as oneDNN's packed primitive on these shapes, each
row's output independent of the other rows, and a fused argmax that is exactly ``argmax_rows``
of the logits it would have written (first index on ties, across threads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_linear, cpu_paged

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["tiles", "dp"])
def tiles(request) -> bool:
    """Each test runs on both kernels, where this CPU and build have them."""
    if request.param == "tiles" and not cpu_paged.amx_linear_available():
        pytest.skip("no AMX tiles on this CPU or build")
    if request.param == "dp" and not cpu_paged.dp_linear_available():
        pytest.skip("no AVX512-BF16 in this build")
    return request.param == "tiles"


def _case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + m * n + k)
    return torch.randn(m, k, generator=g).bfloat16(), (
        torch.randn(n, k, generator=g) * 0.1
    ).bfloat16()


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(32000, 256), (1000, 64), (37, 32), (4099, 896)])
def test_the_product_within_bf16_rounding_and_its_argmax(m, n, k, tiles):
    x, w = _case(m, n, k)
    packed = cpu_paged.amx_pack(w)
    assert packed.shape == ((n + 31) // 32 * 2, k // 32, 512)
    y = cpu_paged.amx_linear(x, packed, n, tiles)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    exact = x.float() @ w.float().T
    bound = exact.abs() * 2.0**-8 + 2e-3 * exact.abs().max()
    assert ((y.float() - exact).abs() <= bound).all()
    assert torch.equal(cpu_paged.amx_argmax(x, packed, n, tiles), cpu_paged.argmax_rows(y))


@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_the_same_bits_as_onednn_for_an_lm_head_shape(m, tiles):
    """K = 256 (the bench model's head): one accumulator over K in order from zero (a tile's, or
    a dot product's) makes oneDNN's sums (its AMX kernel's, or its AVX512-BF16 one's on a CPU
    without AMX), so a model's logits do not change when its head moves here."""
    if not cpu_linear.onednn_bf16():
        pytest.skip("no oneDNN bf16 on this CPU")
    if not tiles and cpu_paged.amx_linear_available():
        # oneDNN adds on AMX here; the dot products match its AVX512-BF16 kernel, which is what
        # oneDNN runs on the CPUs that take this path (no AMX)
        pytest.skip("oneDNN runs on AMX tiles on this CPU")
    x, w = _case(m, 32000, 256, seed=1)
    got = cpu_paged.amx_linear(x, cpu_paged.amx_pack(w), 32000, tiles)
    assert torch.equal(got, cpu_linear.packed_linear(x, cpu_linear.pack(w), None))


def test_each_rows_output_does_not_depend_on_the_others(tiles):
    x, w = _case(70, 3000, 128, seed=2)
    packed = cpu_paged.amx_pack(w)
    whole = cpu_paged.amx_linear(x, packed, 3000, tiles)
    for i in (0, 15, 16, 69):
        assert torch.equal(cpu_paged.amx_linear(x[i : i + 1], packed, 3000, tiles)[0], whole[i])
        assert int(cpu_paged.amx_argmax(x[i : i + 1], packed, 3000, tiles)[0]) == int(
            cpu_paged.argmax_rows(whole[i : i + 1])[0]
        )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,n,k", [(300, 200, 2816), (65, 1000, 1056), (530, 96, 256)])
def test_many_rows_take_the_k_slices_with_the_bits_of_the_row_pairs_walk(m, n, k, threads):
    """Past 64 rows the tiles walk K in slices of 256, the fp32 sums waiting between slices
    (``al_blocks_kb``); up to 64 rows the row pairs walk the whole K (``al_blocks``). Each
    output is the same one accumulator over K in order either way: the rows in slices of 64
    give the same bits, through the partial K slice (K = 1,056, 2,816), the partial column
    block and group (N = 200, 1,000), the second chunk of 256 rows and an odd row tile (65,
    530); the fused argmax and the plainly stored layer projection (``amx_proj``) too."""
    if not cpu_paged.amx_linear_available():
        pytest.skip("no AMX tiles on this CPU or build")
    x, w = _case(m, n, k, seed=3)
    packed = cpu_paged.amx_pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = cpu_paged.amx_linear(x, packed, n, True)
        pieces = torch.cat(
            [cpu_paged.amx_linear(x[i : i + 64], packed, n, True) for i in range(0, m, 64)]
        )
        assert torch.equal(whole, pieces)
        assert torch.equal(cpu_paged.amx_proj(x, packed, n), whole)
        assert torch.equal(cpu_paged.amx_argmax(x, packed, n, True), cpu_paged.argmax_rows(whole))
    finally:
        torch.set_num_threads(before)
    exact = x.float() @ w.float().T
    bound = exact.abs() * 2.0**-8 + 2e-3 * exact.abs().max()
    assert ((whole.float() - exact).abs() <= bound).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_ties_go_to_the_first_index_within_and_across_thread_ranges(threads, tiles):
    """Equal logits: copies of one weight row at columns in the same 16-column lane, in other
    lanes, and in the other thread's half of the columns; the first copy must win."""
    n, k = 2048, 64
    x, w = _case(20, n, k, seed=3)
    w[:, :] = w * 0.01  # small logits elsewhere
    top = torch.ones(k, dtype=torch.bfloat16)
    first = 37
    for col in (first, first + 16, first + 3, n - 5, n // 2 + 1):
        w[col] = top
    x = x.abs() + 0.5  # every row prefers the copies
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = cpu_paged.amx_pack(w)
        got = cpu_paged.amx_argmax(x.bfloat16(), packed, n, tiles)
        logits = cpu_paged.amx_linear(x.bfloat16(), packed, n, tiles)
    finally:
        torch.set_num_threads(old)
    assert (got == first).all()
    assert torch.equal(got, logits.float().argmax(-1))


def test_bad_arguments_are_errors_not_crashes(tiles):
    x, w = _case(4, 64, 64)
    packed = cpu_paged.amx_pack(w)
    with pytest.raises(RuntimeError, match="amx_pack_linear"):
        cpu_paged.amx_linear(x, packed, 65, tiles)  # more columns than packed
    with pytest.raises(RuntimeError, match="amx_pack_linear"):
        cpu_paged.amx_linear(torch.zeros(4, 96, dtype=torch.bfloat16), packed, 64, tiles)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_paged.amx_pack(torch.zeros(8, 48, dtype=torch.bfloat16))
    assert cpu_paged.amx_argmax(x[:0], packed, 64, tiles).shape == (0,)
    # fewer columns than packed: whole 32-column blocks past N would be computed and stored
    # past the output (a heap overflow), so in a child process that a crash cannot take down
    code = (
        "import sys, torch\n"
        "from kernels import cpu_paged\n"
        "tiles = sys.argv[1] == '1'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = torch.randn(2000, 64, generator=g).bfloat16()\n"
        "x = torch.randn(64, 64, generator=g).bfloat16()\n"
        "packed = cpu_paged.amx_pack(w)\n"
        "for fn in (cpu_paged.amx_linear, cpu_paged.amx_argmax):\n"
        "    for n in (1, 16, 32, 1000, 1952):\n"
        "        try:\n"
        "            fn(x, packed, n, tiles)\n"
        "            print('ACCEPTED', n, flush=True)\n"
        "        except RuntimeError as e:\n"
        "            print('REFUSED', n, 'amx_pack_linear' in str(e), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "1" if tiles else "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.split("\n").count("REFUSED 16 True") == 2, proc.stdout
    assert proc.stdout.count("REFUSED") == 10, proc.stdout
    # N from the packed weight's last 32-column block: accepted, the same columns
    assert torch.equal(
        cpu_paged.amx_linear(x, cpu_paged.amx_pack(w[:40]), 40, tiles),
        cpu_paged.amx_linear(x, packed, 64, tiles)[:, :40],
    )
