"""The C++ CPU decode kernel (kernels/cpu_paged.py) against the torch reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_paged, reference

ROOT = Path(__file__).resolve().parents[2]

if not cpu_paged.available():  # no compiler on this machine: the engine falls back to torch
    pytest.skip("CPU paged-attention extension could not be built", allow_module_level=True)


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter at the repository root: a call that reads or writes
    out of bounds crashes that process, not the test run."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


# Tolerances: the kernel accumulates in fp32 like the reference's fp32 math, so differences come
# from the output rounding of the activation dtype.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _case(seed, dtype, kv_dtype, hq, hkv, d, bs, lens, per_head_scale=False):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // bs) for n in lens)
    nb = len(lens) * max_blocks + 7
    kv = torch.randn(nb, 2, 2, bs, hkv, d, generator=g)
    ks = vs = None
    if kv_dtype == torch.float8_e4m3fn:
        n = hkv if per_head_scale else 1
        ks = torch.rand(n, generator=g) + 0.5
        vs = torch.rand(n, generator=g) + 0.5
        kv = (
            reference.quantize_fp8(kv.view(nb, 2, 2, bs, hkv, d).reshape(-1, hkv, d), ks).view(
                nb, 2, 2, bs, hkv, d
            )
            if per_head_scale
            else (kv / ks).clamp(-448, 448).to(kv_dtype)
        )
    else:
        kv = kv.to(kv_dtype)
    tables = torch.randperm(nb, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, kv, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32), ks, vs


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float8_e4m3fn),
    ],
)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("d,bs", [(32, 16), (64, 32), (128, 16), (32, 8), (128, 8)])
def test_decode_matches_reference(dtype, kv_dtype, hq, hkv, d, bs):
    lens = [1, 2, bs - 1, bs, bs + 1, 3 * bs + 5, 777, 2049]
    q, kv, tables, lens_t, ks, vs = _case(hq * d + bs, dtype, kv_dtype, hq, hkv, d, bs, lens)
    want = reference.paged_decode_attention(q, kv, 1, tables, lens_t, d**-0.5, ks, vs)
    got = cpu_paged.paged_decode_attention(q, kv, 1, tables, lens_t, d**-0.5, ks, vs)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    "hq,hkv,d,bs", [(8, 4, 32, 16), (16, 2, 64, 32), (8, 8, 128, 16), (12, 2, 256, 16)]
)
def test_bf16_decode_is_as_close_to_fp32_attention_as_torch_bf16(hq, hkv, d, bs):
    """bf16 queries on a bf16 cache take the vdpbf16ps kernel (products exact, fp32 sums and
    softmax, P rounded to bf16 for P @ V as torch's flash SDPA does): its error against fp32
    attention is within torch's own bf16 attention's. Odd and partial lengths cover the
    last token of a group paired with a row past the end."""
    if cpu_paged._bf16_ext() is None:
        pytest.skip("this CPU has no AVX512-BF16")
    lens = [1, 2, 15, bs + 3, 333, 1025]
    q, kv, tables, lens_t, _, _ = _case(
        d + hq, torch.bfloat16, torch.bfloat16, hq, hkv, d, bs, lens
    )
    exact = reference.paged_decode_attention(q.float(), kv.float(), 1, tables, lens_t, d**-0.5)
    torch_bf16 = reference.paged_decode_attention(q, kv, 1, tables, lens_t, d**-0.5).float()
    # a V row past a sequence's end holding NaN must not reach its output (0 * NaN)
    for i, n in enumerate(lens):
        if n % bs:
            kv[tables[i, n // bs], 1, 1, n % bs :] = float("nan")
    got = cpu_paged.paged_decode_attention(q, kv, 1, tables, lens_t, d**-0.5)
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got).all())
    err, torch_err = (got.float() - exact).abs().max(), (torch_bf16 - exact).abs().max()
    assert err <= 1.5 * torch_err + 2e-3, (err, torch_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_of_a_sequence_does_not_depend_on_its_batch(dtype):
    """Few sequences are split into one work item per KV head, many into one item per
    sequence (its rows staged group by group); both give the same bits."""
    lens = [700] + [37 + 50 * i for i in range(15)]
    q, kv, tables, lens_t, _, _ = _case(11, dtype, dtype, 8, 4, 32, 16, lens)
    batch = cpu_paged.paged_decode_attention(q, kv, 1, tables, lens_t, 0.17)
    alone = cpu_paged.paged_decode_attention(q[:1], kv, 1, tables[:1], lens_t[:1], 0.17)
    assert torch.equal(batch[:1], alone)


def _shared_prefix_case(seed, dtype, bs, lens, prefix_blocks, groups, hq=8, hkv=4, d=32):
    """Tables whose first ``prefix_blocks`` blocks are those of sequence ``i % groups``'s
    group (as prefix caching hands them out), the rest each sequence's own."""
    g = torch.Generator().manual_seed(seed)
    mb = max(-(-n // bs) for n in lens)
    nb = groups * prefix_blocks + len(lens) * mb + 3
    kv = torch.randn(nb, 2, 2, bs, hkv, d, generator=g).to(dtype)
    tables = torch.zeros(len(lens), mb, dtype=torch.int32)
    own = groups * prefix_blocks
    for i, n in enumerate(lens):
        k = min(prefix_blocks, -(-n // bs))
        tables[i, :k] = torch.arange(k) + (i % groups) * prefix_blocks
        rest = mb - k
        tables[i, k:] = torch.arange(rest) + own
        own += rest
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, kv, tables, torch.tensor(lens, dtype=torch.int32)


def _decode_amx_here() -> bool:
    return bool(cpu_paged._load().decode_amx_available())


class _DecodeAmx:
    """The decode kernel's AMX shared-group step on or off for a block (restored after)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        assert cpu_paged._load().set_decode_amx(self.on) == self.on

    def __exit__(self, *exc):
        cpu_paged._load().set_decode_amx(cpu_paged.decode_uses_amx())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [8, 16])
def test_sequences_sharing_prefix_blocks_read_them_once_and_get_their_own_bits(dtype, bs):
    """Sequences whose tables begin with the same blocks go through the kernel in chunks that
    read each shared group once for every member: each still gets the same bits as alone (one
    sequence: the per-head walk, nothing shared) and the reference's values. Lengths cover a
    sequence ending inside the shared blocks, at their end, one past it, and far past it.
    (The AVX-512 step; the AMX tiles round differently: the next test.)"""
    p = 40  # shared blocks per group
    lens = [p * bs - 5, p * bs, p * bs + 1, 3, 2 * p * bs + 7] + [p * bs + 9 * i for i in range(35)]
    q, kv, tables, lens_t = _shared_prefix_case(bs + 3, dtype, bs, lens, p, groups=3)
    want = reference.paged_decode_attention(q.float(), kv.float(), 1, tables, lens_t, 0.17)
    for i, n in enumerate(lens):  # rows past an end in a sequence's own block: never read
        if n % bs and n // bs >= p:
            kv[tables[i, n // bs], 1, :, n % bs :] = float("nan")
    with_threads = torch.get_num_threads()
    with _DecodeAmx(False):
        try:
            for threads in (1, 2):  # chunks of up to 16 and of up to 10 members
                torch.set_num_threads(threads)
                batch = cpu_paged.paged_decode_attention(q, kv, 1, tables, lens_t, 0.17)
                for i in range(len(lens)):
                    alone = cpu_paged.paged_decode_attention(
                        q[i : i + 1], kv, 1, tables[i : i + 1], lens_t[i : i + 1], 0.17
                    )
                    assert torch.equal(batch[i : i + 1], alone), (threads, i, lens[i])
        finally:
            torch.set_num_threads(with_threads)
    assert bool(torch.isfinite(batch).all())
    torch.testing.assert_close(batch.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.skipif(
    not cpu_paged.available() or not _decode_amx_here(), reason="no AMX tiles on this CPU or build"
)
@pytest.mark.parametrize(
    "hq,hkv,d,prefix_blocks",
    [
        (8, 4, 32, 40),  # the small model's heads; 40 groups: whole chunks of 4
        (8, 4, 32, 3),  # one partial chunk
        (8, 1, 64, 7),  # G = 8 (a member is half a tile), 2 chunks of 32 dims, partial chunk
        (4, 2, 128, 6),  # 4 chunks of 32 dims (two passes of 4 P V slices)
    ],
)
def test_shared_groups_on_amx_tiles_match_the_walk_alone_within_bf16_rounding(
    hq, hkv, d, prefix_blocks
):
    """On a CPU with AMX, the groups of a shared prefix run on tiles for every member at once
    (16 query rows per tile, 64 keys per softmax step). Each member's output is then within
    two bf16 steps (at its row's scale) of its walk alone (the AVX-512 step, which the previous test pins bit for
    bit) and as close to the fp32 reference; sequences ending inside, at, just past and far
    past the shared blocks, 1 and 2 threads (chunks of 16 and of up to 10 members)."""
    bs = 16
    p = prefix_blocks
    lens = [p * bs - 5, p * bs, p * bs + 1, 3, 2 * p * bs + 7] + [p * bs + 9 * i for i in range(35)]
    q, kv, tables, lens_t = _shared_prefix_case(
        5, torch.bfloat16, bs, lens, p, groups=3, hq=hq, hkv=hkv, d=d
    )
    scale = d**-0.5
    want = reference.paged_decode_attention(q.float(), kv.float(), 1, tables, lens_t, scale)
    with_threads = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with _DecodeAmx(True):
                tiles = cpu_paged.paged_decode_attention(q, kv, 1, tables, lens_t, scale)
            with _DecodeAmx(False):
                walk = cpu_paged.paged_decode_attention(q, kv, 1, tables, lens_t, scale)
            assert bool(torch.isfinite(tiles).all())
            assert not torch.equal(tiles, walk)  # the tiles ran (they round differently)
            # within two bf16 steps at the scale of each head's output row (an element near 0
            # is the difference of larger terms, rounded at their scale)
            top = walk.float().abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-20)
            step = torch.exp2(torch.floor(torch.log2(top)) - 7)
            assert bool(((tiles.float() - walk.float()).abs() <= 2 * step).all()), threads
            err_tiles = (tiles.float() - want).abs().max()
            err_walk = (walk.float() - want).abs().max()
            assert err_tiles <= 1.25 * err_walk + 1e-3, (threads, err_tiles, err_walk)
    finally:
        torch.set_num_threads(with_threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_is_the_reference(dtype, slot_dtype):
    """The C++ row copies store what the reference stores, from views of a fused QKV output
    (token rows strided), padding slots skipped, other layers untouched."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, nb, t = 8, 4, 32, 16, 12, 21
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert not k.is_contiguous()
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[3, 17]] = -1
    want = torch.randn(nb, 3, 2, bs, hkv, d, generator=g).to(dtype)
    got = want.clone()
    reference.write_kv(k, v, want, 1, slots)
    cpu_paged.write_kv(k, v, got, 1, slots.to(slot_dtype))
    assert torch.equal(got, want)


def test_write_kv_refuses_a_slot_past_the_pool_and_writes_nothing():
    pool = torch.zeros(4, 1, 2, 16, 2, 32)
    key = torch.ones(3, 2, 32)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_paged.write_kv(key, key, pool, 0, torch.tensor([0, 1, 64]))
    assert not pool.any()
    with pytest.raises(RuntimeError, match="layer"):
        cpu_paged.write_kv(key, key, pool, 1, torch.tensor([0, 1, 2]))
    ext = cpu_paged._load()
    if ext is not None:  # called directly with a tensor off the CPU: refused, not read
        with pytest.raises(RuntimeError, match="CPU tensors"):
            ext.write_kv(key, key.to("meta"), pool, 0, torch.tensor([0, 1, 2]))


def test_write_kv_fp8_and_other_dtypes_take_the_reference():
    """An fp8 pool quantizes with its scales, key / value in another dtype are cast: both the
    reference's work, so the results are the reference's."""
    g = torch.Generator().manual_seed(6)
    key, value = torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([0, 7, 16, -1, 40])
    for pool, scales in (
        (torch.zeros(4, 1, 2, 16, 2, 32, dtype=torch.float8_e4m3fn), (torch.tensor([0.5]),) * 2),
        (torch.zeros(4, 1, 2, 16, 2, 32, dtype=torch.bfloat16), (None, None)),
    ):
        want, got = pool.clone(), pool.clone()
        reference.write_kv(key, value, want, 0, slots, *scales)
        cpu_paged.write_kv(key, value, got, 0, slots, *scales)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_per_head_fp8_scales():
    lens = [5, 40, 300]
    q, kv, tables, lens_t, ks, vs = _case(
        3, torch.bfloat16, torch.float8_e4m3fn, 8, 4, 32, 16, lens, per_head_scale=True
    )
    assert ks.numel() == 4
    want = reference.paged_decode_attention(q, kv, 0, tables, lens_t, 0.2, ks, vs)
    got = cpu_paged.paged_decode_attention(q, kv, 0, tables, lens_t, 0.2, ks, vs)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_mixed_batch_matches_reference():
    """Decode rows go through the kernel, prefill chunks through the reference, one output."""
    g = torch.Generator().manual_seed(9)
    bs, hkv, d = 16, 2, 32
    q_lens, ctx = [1, 37, 1, 16, 1], [50, 37, 9, 100, 300]
    nb = 128
    kv = torch.randn(nb, 1, 2, bs, hkv, d, generator=g)
    tables = torch.randperm(nb, generator=g)[: 5 * 19].view(5, 19).to(torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 8, d, generator=g)
    lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.paged_attention(q, kv, 0, tables, lens, qsl, 0.17)
    got = cpu_paged.paged_attention(q, kv, 0, tables, lens, qsl, 0.17)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bad_arguments_are_refused():
    q = torch.randn(2, 8, 32)
    kv = torch.randn(4, 1, 2, 16, 2, 32)
    tables = torch.zeros(2, 1, dtype=torch.int64)  # must be int32
    with pytest.raises(RuntimeError, match="int32"):
        cpu_paged.paged_decode_attention(
            q, kv, 0, tables, torch.tensor([1, 1], dtype=torch.int32), 1.0
        )
    with pytest.raises(RuntimeError, match="head geometry"):
        cpu_paged.paged_decode_attention(
            torch.randn(2, 3, 32), kv, 0, tables.int(), torch.tensor([1, 1], dtype=torch.int32), 1.0
        )


_BAD_DECODE = r"""
import sys, torch
from kernels import cpu_paged
dt = {"bf16": torch.bfloat16, "f32": torch.float32, "fp8": torch.float8_e4m3fn}[sys.argv[1]]
nb, L, bs, hq, hkv, d = 8, 2, 16, 8, 4, 64
g = torch.Generator().manual_seed(0)
kv = torch.randn(nb, L, 2, bs, hkv, d, generator=g).to(dt)
qt = torch.bfloat16 if dt == torch.float8_e4m3fn else dt
q = torch.randn(2, hq, d, generator=g).to(qt)
one = torch.ones(1)
def case(name, q=q, layer=0, tables=None, lens=None, ks=None, vs=None):
    if tables is None:
        tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    if lens is None:
        lens = torch.tensor([20, 30], dtype=torch.int32)
    if dt == torch.float8_e4m3fn:
        ks = one if ks is None else ks
        vs = one if vs is None else vs
    try:
        cpu_paged.paged_decode_attention(q, kv, layer, tables, lens, d**-0.5, ks, vs)
        print("ACCEPTED", name, flush=True)
    except (RuntimeError, IndexError, ValueError) as e:
        print("REFUSED", name, str(e).splitlines()[0], flush=True)
case("good")
case("block past the pool", tables=torch.tensor([[0, 1], [2, 1 << 28]], dtype=torch.int32))
case("block one past the pool", tables=torch.tensor([[0, 1], [2, nb]], dtype=torch.int32))
case("negative block", tables=torch.tensor([[-5, 1], [2, 3]], dtype=torch.int32))
case("layer past", layer=L)
case("negative layer", layer=-1)
case("fewer lens than queries", q=torch.randn(40, hq, d).to(qt),
     tables=torch.tensor([[0, 1]] * 40, dtype=torch.int32),
     lens=torch.tensor([20], dtype=torch.int32))
case("fewer tables than queries", q=torch.randn(40, hq, d).to(qt),
     tables=torch.tensor([[0, 1]], dtype=torch.int32),
     lens=torch.tensor([20] * 40, dtype=torch.int32))
case("len past the table", lens=torch.tensor([20, 2 * bs + 1], dtype=torch.int32))
case("negative len", lens=torch.tensor([20, -3], dtype=torch.int32))
if dt == torch.float8_e4m3fn:
    case("scales of 2 for 4 heads", ks=torch.ones(2), vs=torch.ones(2))
    case("float64 scales", ks=torch.ones(1, dtype=torch.float64))
    case("strided per-head scales", ks=torch.ones(8)[::2], vs=torch.ones(4))
"""


@pytest.mark.parametrize("kv", ["bf16", "f32", "fp8"])
def test_decode_refuses_bad_index_values(kv):
    """Block ids past the pool or negative, a layer out of range, fewer tables / lens than
    queries, a length past the table or negative, malformed fp8 scales: each raises, as the
    reference does, instead of reading other memory (in a child process: before these checks
    some of these calls crashed)."""
    proc = _run_child(_BAD_DECODE, kv)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert lines[0] == "ACCEPTED good", proc.stdout
    assert len(lines) == (13 if kv == "fp8" else 10), proc.stdout
    assert all(line.startswith("REFUSED") for line in lines[1:]), proc.stdout
    assert "REFUSED block past the pool block id out of range in sequence 1" in proc.stdout


_GUARDED_POOL = r"""
import ctypes, mmap, sys, torch
from kernels import cpu_paged, reference
bs, S = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
L, hkv, d, hq, nb = 2, 2, 64, 4, 16
elems = nb * L * 2 * bs * hkv * d
nbytes, page = elems * 2, mmap.PAGESIZE
assert nbytes % page == 0
m = mmap.mmap(-1, nbytes + page)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
libc = ctypes.CDLL(None)
assert libc.mprotect(ctypes.c_void_p(addr + nbytes), ctypes.c_size_t(page), 0) == 0
kv = torch.frombuffer(m, dtype=torch.bfloat16, count=elems).view(nb, L, 2, bs, hkv, d)
g = torch.Generator().manual_seed(bs)
kv.copy_(torch.randn(nb, L, 2, bs, hkv, d, generator=g).bfloat16())
tables = torch.zeros(S, 4, dtype=torch.int32)
for s in range(S):
    tables[s, :2] = torch.tensor([nb - 2, nb - 1])  # a prefix in the pool's last blocks
    tables[s, 2] = s
lens = torch.full((S,), 2 * bs + 1, dtype=torch.int32)
q = torch.randn(S, hq, d, generator=g).bfloat16()
want = reference.paged_decode_attention(q.float(), kv.float(), L - 1, tables, lens, 0.125)
got = cpu_paged.paged_decode_attention(q, kv, L - 1, tables, lens, 0.125)
print("ERR", (got.float() - want).abs().max().item(), flush=True)
"""


@pytest.mark.parametrize("bs,members", [(4, 8), (2, 8), (4, 16), (1, 8)])
def test_shared_prefix_of_small_blocks_reads_nothing_past_them(bs, members):
    """Decode over a prefix of blocks of 4 or fewer tokens shared by enough sequences to be
    prepared once for all (bf16): the pool's last blocks, last layer, right before a page
    that cannot be read. Only the group's tokens are read (the prepared gather once took 16
    rows whatever the block size: past the pool, a crash, so in a child process)."""
    proc = _run_child(_GUARDED_POOL, str(bs), str(members))
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    err = float(proc.stdout.split("ERR")[1])
    assert err < TOL[torch.bfloat16], proc.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_matches_torch_including_ties(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 32000, generator=g).to(dtype)
    x[1, 31999] = 100  # maximum in the scalar tail
    x[2, :] = 1.0  # all equal: the first index wins, as torch.argmax
    x[3, 5] = x[3, 20] = 50  # tie across vector lanes
    small = torch.randn(4, 7, generator=g).to(dtype)  # shorter than one vector
    for t in (x, small):
        assert torch.equal(cpu_paged.argmax_rows(t), t.float().argmax(dim=-1))
    assert cpu_paged.argmax_rows(x)[2].item() == 0 and cpu_paged.argmax_rows(x)[3].item() == 5


@pytest.mark.parametrize(
    "m,n,k", [(1, 32000, 256), (3, 512, 256), (16, 1376, 256), (7, 256, 704), (2, 48, 4096)]
)
def test_small_linear_matches_fp32_within_bf16_rounding(m, n, k):
    """The AVX512-BF16 small-batch linear: fp32 accumulation, one bf16 rounding at the end,
    so every output is within half a bf16 ulp (plus fp32 summation-order noise) of the exact
    product, as torch's own bf16 matmul is."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    got = cpu_paged.small_linear(x, w)
    if got is None:
        pytest.skip("this CPU has no AVX512-BF16")
    exact = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # bf16 keeps 8 significant bits: half an ulp is 2^-8 of the value, relative
    bound = exact.abs() * 2.0**-8 + 1e-3 * exact.abs().max()
    assert ((got.float() - exact).abs() <= bound).all()
    torch_err = (torch.nn.functional.linear(x, w).float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 1.5 * torch_err + 1e-6


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 32000, 256),
        (2, 768, 256),
        (3, 13, 8),
        (15, 70, 64),
        # four rows of x at a time against two weight rows, then pairs and a single row
        (4, 70, 64),
        (7, 131, 256),
        (13, 1376, 256),
        (3, 40, 1032),  # weight rows past 2 KB: no software prefetch
        # from 16 rows, the blocked path: partial panels of 16 rows, partial groups of 6 and
        # tasks of 64 weight rows; K above one block of 256 with x's panels in cache (at most
        # 1-8 MB, by the L3's size): the whole K per group of weight rows
        (16, 64, 8),
        (17, 1376, 256),
        (33, 256, 688),
        (70, 70, 64),
        (97, 131, 520),
        (200, 7, 264),
        # past 8 MB of panels: K blocks of 256 with a partial last one, chunks of 96 rows
        (2100, 9, 1000),
    ],
)
def test_avx2_linear_matches_fp32_within_bf16_rounding(m, n, k):
    """The AVX2 + FMA kernel (bf16 widened to fp32): one bf16 rounding of an fp32 sum, any M
    and N, on both of its paths (dot products of 4 weight rows x 4, 2 or 1 rows of x below 16
    rows, outer-product blocks from 16, their sums rounded 8 x 8 at a time)."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    got = cpu_paged.avx2_linear(x, w)
    if got is None:
        pytest.skip("the AVX2 + FMA kernel is not built on this CPU")
    exact = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    bound = exact.abs() * 2.0**-8 + 1e-3 * exact.abs().max()
    assert ((got.float() - exact).abs() <= bound).all()
    # nearly every output is the exact product rounded once (fp32 summation order aside)
    assert (got == exact.bfloat16()).float().mean() >= 0.99


def test_avx2_linear_whole_k_gives_the_k_blocks_bits(tmp_path):
    """The blocked path's two loop orders (whole K per group of weight rows where x's panels
    fit in cache, K blocks of 256 past that or with PDSERVE_AVX2_WHOLE_K_BYTES=0) sum every
    product in the same order: the same bits. The setting is read once per process, so the
    K-block results come from a child process."""
    import os

    if cpu_paged.avx2_linear(torch.zeros(1, 8).bfloat16(), torch.zeros(1, 8).bfloat16()) is None:
        pytest.skip("the AVX2 + FMA kernel is not built on this CPU")
    shapes = [(16, 70, 264), (33, 256, 688), (64, 131, 1032), (97, 19, 520)]
    code = (
        "import sys, torch\n"
        "from kernels import cpu_paged\n"
        "out = []\n"
        f"for m, n, k in {shapes!r}:\n"
        "    g = torch.Generator().manual_seed(m * n + k)\n"
        "    x = torch.randn(m, k, generator=g).bfloat16()\n"
        "    w = torch.randn(n, k, generator=g).bfloat16()\n"
        "    out.append(cpu_paged.avx2_linear(x, w))\n"
        "torch.save(out, sys.argv[1])\n"
    )
    results = {}
    for label, setting in (("whole", None), ("blocks", "0")):
        env = dict(os.environ)
        env.pop("PDSERVE_AVX2_WHOLE_K_BYTES", None)
        if setting is not None:
            env["PDSERVE_AVX2_WHOLE_K_BYTES"] = setting
        path = tmp_path / f"{label}.pt"
        subprocess.run(
            [sys.executable, "-c", code, str(path)], env=env, check=True, timeout=300, cwd=ROOT
        )
        results[label] = torch.load(path)
    for (m, n, k), a, b in zip(shapes, results["whole"], results["blocks"]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (m, n, k)


@pytest.mark.parametrize("m", [4, 16, 21])
def test_avx2_linear_rounds_like_torch(m):
    """The AVX2 kernel rounds its fp32 sums to bf16 as torch does, on the few-row path (4
    rows) and in the blocked path's 8 x 8 transposed blocks (16 rows; 21: partial blocks):
    ties to even, NaN, overflow to infinity. Each row's sum is exact in fp32 (two terms), so
    the result is fixed."""
    k, n = 64, 19
    x = torch.zeros(m, k)
    w = torch.zeros(n, k)
    w[:, 0] = 1.0
    w[:, 1] = torch.arange(n, dtype=torch.float32) + 1  # output column j adds (j + 1) x[:, 1]
    x[:, 0] = 1.0
    x[:, 1] = 2.0**-8  # 1 + (j + 1) 2^-8: ties between bf16 neighbours for odd j + 1
    x[1, :] = float("nan")  # a row of NaN
    x[2, 0], x[2, 1] = 3.0e38, 3.0e38  # overflows: +inf
    x[3, 0], x[3, 1] = -3.0e38, -3.0e38  # -inf
    xb, wb = x.bfloat16(), w.bfloat16()
    got = cpu_paged.avx2_linear(xb, wb)
    if got is None:
        pytest.skip("the AVX2 + FMA kernel is not built on this CPU")
    want = (xb.double() @ wb.double().T).float().bfloat16()  # exact sums, rounded once
    assert torch.isnan(got[1]).all()
    assert (got[2] == float("inf")).all() and (got[3] == float("-inf")).all()
    keep = torch.ones(m, dtype=torch.bool)
    keep[1] = False
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))
    # the ties went to even: 1 + 2^-8 -> 1, 1 + 3 2^-8 -> 1 + 2^-6
    assert got[0, 0].item() == 1.0 and got[0, 2].item() == 1.0 + 2.0**-6


def test_avx2_linear_declines_what_it_does_not_cover():
    x = torch.randn(4, 256).bfloat16()
    assert cpu_paged.avx2_linear(x.float(), torch.randn(32, 256)) is None  # fp32
    assert cpu_paged.avx2_linear(x, torch.randn(32, 256)) is None  # fp32 weight
    assert cpu_paged.avx2_linear(x[:, :250], torch.randn(32, 250).bfloat16()) is None  # K % 8
    assert cpu_paged.avx2_linear(x.unsqueeze(0), torch.randn(32, 256).bfloat16()) is None  # 3-D
    if cpu_paged.avx2_linear_available():  # no rows: an empty product, not a crash
        assert cpu_paged.avx2_linear(x[:0], torch.randn(32, 256).bfloat16()).shape == (0, 32)


def test_small_linear_declines_what_it_does_not_cover():
    x = torch.randn(4, 256).bfloat16()
    assert cpu_paged.small_linear(x.float(), torch.randn(32, 256)) is None  # fp32
    assert (
        cpu_paged.small_linear(torch.randn(64, 256).bfloat16(), torch.randn(32, 256).bfloat16())
        is None
    )  # too many rows
    assert cpu_paged.small_linear(x[:, :250], torch.randn(32, 250).bfloat16()) is None  # K % 32
    assert cpu_paged.small_linear(x, torch.randn(40, 256).bfloat16()) is None  # N % 16


@pytest.fixture(params=["avx512", "amx", "avx2"])
def prefill_isa(request, monkeypatch):
    """Each bf16 prefill tile this machine can run: AVX512-BF16 dot products, AMX tiles, fp32
    FMAs on AVX2 (built wherever the compiler targets AVX2, so AVX-512 hosts test it too)."""
    if not cpu_paged.prefill_paths_here()[request.param]:
        pytest.skip(f"no {request.param} prefill tile on this CPU or build")
    monkeypatch.setattr(cpu_paged, "_prefill_path", request.param)
    return request.param


def _needs_prefill_tile():
    if cpu_paged.prefill_path() == "sdpa":
        pytest.skip("no C++ prefill tile here")


def test_a_prefill_tile_this_build_lacks_is_refused_not_run():
    """Each entry point refuses a tile code it was not built with (or that is unknown) instead
    of returning an output no tile wrote."""
    ext = cpu_paged._load()
    if ext is None:
        pytest.skip("the C++ extension does not build here")
    here = cpu_paged.prefill_paths_here()
    g = torch.Generator().manual_seed(3)
    q, kv, tables, lens, qsl = _prefill_step(g, 16, 8, 4, 32, [20], [20], [None])
    k = torch.randn(20, 4, 32, generator=g).bfloat16()
    missing = [n for n, ok in here.items() if not ok]
    for code in [cpu_paged._PREFILL_TILE[n] for n in missing] + [3, -1]:
        with pytest.raises(RuntimeError, match="prefill tile|no AMX tiles|needs AVX"):
            ext.prefill_bf16(q, k, k, 0, 0.1, code)
        with pytest.raises(RuntimeError, match="prefill tile|no AMX tiles|needs AVX"):
            ext.paged_prefill_bf16(q, kv, 0, tables, lens, qsl, 0.1, code)


@pytest.mark.parametrize(
    "tq,offset,hq,hkv,d",
    [
        (256, 0, 8, 4, 32),  # a whole 256-token prompt, the small model's heads
        (1088, 0, 8, 4, 32),
        (100, 37, 8, 4, 32),  # a chunk after cached context: keys not a multiple of 64
        (300, 700, 16, 8, 64),
        (13, 0, 4, 4, 128),  # fewer rows than a tile, no GQA
        (1, 50, 8, 2, 32),  # one row
        (70, 0, 12, 2, 256),
    ],
)
def test_prefill_kernel_matches_fp32_attention_within_bf16_rounding(
    tq, offset, hq, hkv, d, prefill_isa
):
    """The bf16 prefill kernel (each tile): scores and softmax in fp32, P in bf16 for P @ V,
    as torch's flash SDPA does in bf16, so its error against fp32 attention is SDPA's."""
    g = torch.Generator().manual_seed(tq * 7 + offset)
    tk = tq + offset
    q = torch.randn(tq, hq, d, generator=g).bfloat16()
    k = torch.randn(tk, hkv, d, generator=g).bfloat16()
    v = torch.randn(tk, hkv, d, generator=g).bfloat16()
    scale = d**-0.5
    exact = reference._attend(q.float(), k.float(), v.float(), scale, offset)
    sdpa = reference._attend(q, k, v, scale, offset).float()
    got = cpu_paged.attend_prefill(q, k, v, scale, offset)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    err, sdpa_err = (got.float() - exact).abs().max(), (sdpa - exact).abs().max()
    assert err <= 1.5 * sdpa_err + 2e-3, (err, sdpa_err)
    # a visible key changes the row and a hidden one does not: move the first hidden key
    k2 = k.clone()
    if tq > 1:
        k2[offset + 1] += 5  # hidden from row 0 only
        again = cpu_paged.attend_prefill(q, k2, v, scale, offset)
        assert torch.equal(again[0], got[0]) and not torch.equal(again[1:], got[1:])


def test_prefill_kernel_declines_what_it_does_not_cover():
    q, k = torch.randn(8, 4, 48), torch.randn(8, 4, 48)
    ref = reference._attend(q, k, k, 0.1, 0)
    assert torch.equal(cpu_paged.attend_prefill(q, k, k, 0.1, 0), ref)  # fp32: SDPA
    qb, kb = q.bfloat16(), k.bfloat16()  # head size 48: not a multiple of 32
    assert torch.equal(
        cpu_paged.attend_prefill(qb, kb, kb, 0.1, 0), reference._attend(qb, kb, kb, 0.1, 0)
    )


def _prefill_step(g, bs, hq, hkv, d, q_lens, ctx, share, nb=None):
    """A bf16 pool whose never-written slots hold NaN, and a step of chunks: ``share[s]`` is
    the sequence whose first blocks sequence s reuses (a cached prefix) or None."""
    layers = 2
    nb = nb or sum(-(-c // bs) for c in ctx) + 9
    kv = torch.full((nb, layers, 2, bs, hkv, d), float("nan")).bfloat16()
    max_blocks = max(-(-c // bs) for c in ctx)
    free = torch.randperm(nb, generator=g).tolist()
    tables = torch.zeros(len(ctx), max_blocks, dtype=torch.int32)
    for s, c in enumerate(ctx):
        n = -(-c // bs)
        own = [free.pop() for _ in range(n)]
        if share[s] is not None:
            src, upto = share[s]
            own[:upto] = tables[src, :upto].tolist()
        tables[s, :n] = torch.tensor(own, dtype=torch.int32)
        for i, b in enumerate(own):  # write the slots this sequence's context covers
            used = min(bs, c - i * bs)
            kv[b, :, :, :used] = torch.randn(layers, 2, used, hkv, d, generator=g).bfloat16()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=g).bfloat16()
    return q, kv, tables, torch.tensor(ctx, dtype=torch.int32), qsl


@pytest.mark.parametrize("bs", [16, 32, 8])
@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 32), (16, 2, 64), (4, 4, 128)])
def test_paged_prefill_has_the_bits_of_the_gathered_kernel(bs, hq, hkv, d, prefill_isa):
    """The step's chunks in one call from the block pool (blocks shared between sequences
    packed once; partial blocks, NaN in unwritten slots, decode rows mixed in, a zero-length
    row) give exactly the output of the per-sequence loop over gathered K/V, on each tile."""
    g = torch.Generator().manual_seed(bs * 100 + hq + d)
    #           first chunk, prefix hit, hit+partial, decode, long chunk, empty, 2 rows, decode
    q_lens = [300, 64, 37, 1, 129, 0, 2, 1]
    ctx = [300, 1088, 1061, 700, 129, 5, 2, 1088]
    prefix = (1024 // bs) if bs <= 1024 else 0
    share = [None, None, (1, prefix), None, None, None, None, (1, prefix)]
    q, kv, tables, lens, qsl = _prefill_step(g, bs, hq, hkv, d, q_lens, ctx, share)
    scale = d**-0.5
    for layer in (0, 1):
        want = cpu_paged.gathered_attention(q, kv, layer, tables, lens, qsl, scale)
        got = cpu_paged.paged_attention(q, kv, layer, tables, lens, qsl, scale)
        assert not got.isnan().any()
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        # the chunks' rows come from the one-call kernel itself
        chunk_rows = torch.cat(
            [torch.arange(qsl[s], qsl[s + 1]) for s in range(len(q_lens)) if q_lens[s] > 1]
        )
        direct = cpu_paged._load().paged_prefill_bf16(
            q, kv, layer, tables, lens, qsl, scale, cpu_paged._PREFILL_TILE[prefill_isa]
        )
        assert torch.equal(direct[chunk_rows], want[chunk_rows])
    # (the torch reference's decode rows read whole blocks: its pool gets zeros for the NaN)
    exact = reference.paged_attention(
        q.float(), kv.float().nan_to_num(), 1, tables, lens, qsl, scale
    )
    assert (got.float() - exact).abs().max() < 3e-2


def test_paged_prefill_refuses_bad_tables():
    _needs_prefill_tile()
    g = torch.Generator().manual_seed(1)
    q, kv, tables, lens, qsl = _prefill_step(g, 16, 8, 4, 32, [20], [20], [None], nb=8)
    tables[0, 1] = 99  # past the pool
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_paged.paged_attention(q, kv, 0, tables, lens, qsl, 0.1)
    with pytest.raises(RuntimeError, match="bad chunk"):
        cpu_paged.paged_attention(q, kv, 0, tables[:, :1], lens, qsl, 0.1)


_BAD_PREFILL_BS8 = r"""
import sys, torch
from kernels import cpu_paged
bs, nb = 8, 8
g = torch.Generator().manual_seed(1)
kv = torch.randn(nb, 2, 2, bs, 4, 32, generator=g).bfloat16()
q = torch.randn(20, 8, 32, generator=g).bfloat16()
lens = torch.tensor([20], dtype=torch.int32)
qsl = torch.tensor([0, 20], dtype=torch.int32)
for j in (1, 2):  # the second block of the first 16-key unit, the third (a partial unit's)
    for bad in (99, 1 << 30, -(1 << 30), -1):
        tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
        tables[0, j] = bad
        try:
            cpu_paged.paged_attention(q, kv, 0, tables, lens, qsl, 0.1)
            print("ACCEPTED", j, bad, flush=True)
        except RuntimeError as e:
            print("REFUSED", j, bad, "block id out of range" in str(e), flush=True)
"""


def test_paged_prefill_checks_every_block_of_a_unit_with_small_blocks():
    """With blocks of 8 tokens a 16-key unit spans two blocks: a bad id in any block the
    context uses is refused, not only a unit's first (in a child process: past the pool by
    2**30 blocks the unchecked read crashed)."""
    _needs_prefill_tile()
    proc = _run_child(_BAD_PREFILL_BS8)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert len(lines) == 8 and all(line.endswith("True") for line in lines), proc.stdout


# ---- the fused element-wise ops against the torch ops they replace (bf16) ------------------


def _needs_bf16_ext():
    if cpu_paged._bf16_ext() is None:
        pytest.skip("this CPU has no AVX512-BF16")


def _needs_ext():
    """The fused element-wise ops run on any CPU the extension builds on (vector forms with
    AVX512-BF16, one element at a time elsewhere)."""
    if not cpu_paged.available():
        pytest.skip("the C++ extension does not build here")


def _bf16_share_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


@pytest.mark.parametrize("t,h", [(1, 256), (37, 1024), (5, 896)])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_rms_norm_is_the_torch_norm(t, h, residual):
    """Rounded where the torch ops round; only the fp32 sum's order differs, so at most the
    rare element one bf16 step apart."""
    from shared.models.llama import RMSNorm

    _needs_ext()
    g = torch.Generator().manual_seed(t * h)
    x = (torch.randn(t, h, generator=g) * 3).bfloat16()
    r = (torch.randn(t, h, generator=g) * 3).bfloat16() if residual else None
    norm = RMSNorm(h, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=g))
    norm = norm.bfloat16()
    total = x + r if residual else x
    want = norm._norm(total)
    got, got_total = cpu_paged.rms_norm(x, norm.weight, 1e-5, r)
    assert torch.equal(got_total, total)
    assert _bf16_share_equal(got, want) >= 0.99
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 8, 4, 32), (50, 14, 2, 64), (3, 32, 8, 128)])
def test_fused_rope_is_the_torch_rope(t, hq, hkv, d):
    from shared.models.llama import Rotary

    _needs_ext()
    g = torch.Generator().manual_seed(t + d)
    rot = Rotary(d, 4096, 10000.0, None)
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(t, hkv, d, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (t,), generator=g)
    want_q, want_k = rot(pos, q, k)  # no fused op set: the torch path
    got_q, got_k = cpu_paged.rope(q, k, rot.cos, rot.sin, pos)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    # views, as the model hands them (split of the fused qkv projection)
    qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1)], 1)
    qv, kv = qkv.split([hq * d, hkv * d], 1)
    got_q2, got_k2 = cpu_paged.rope(qv.view(t, hq, d), kv.view(t, hkv, d), rot.cos, rot.sin, pos)
    assert torch.equal(got_q2, want_q) and torch.equal(got_k2, want_k)


def test_fused_rope_checks_its_sin_table_and_positions():
    """Only ``cos``'s shape was checked: a shorter ``sin`` table was read past its end, and
    fewer positions than tokens read past ``positions``."""
    _needs_ext()
    q = torch.randn(4, 2, 32).bfloat16()
    cos, sin = torch.ones(64, 32), torch.ones(64, 32)
    with pytest.raises(RuntimeError, match="cos/sin"):
        cpu_paged.rope(q, q, cos, sin[:8], torch.full((4,), 60))
    with pytest.raises(RuntimeError, match="cos/sin"):
        cpu_paged.rope(q, q, cos, sin[:, :16].contiguous(), torch.arange(4))
    with pytest.raises(RuntimeError, match="positions"):
        cpu_paged.rope(q, q, cos, sin, torch.arange(2))


@pytest.mark.parametrize("t,i", [(1, 688), (64, 2816), (3, 4864)])
def test_fused_silu_mul_is_the_torch_ops(t, i):
    _needs_ext()
    g = torch.Generator().manual_seed(t * i)
    gu = (torch.randn(t, 2 * i, generator=g) * 4).bfloat16()
    gate, up = gu.split(i, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_paged.silu_mul(gu)
    assert got.shape == want.shape
    # torch's bf16 silu is not always correctly rounded (silu(5.9375) = 5.92189, above the
    # midpoint 5.921875 of bf16's 5.90625 and 5.9375, gives 5.90625): one step of silu, so at
    # most two of the product
    assert _bf16_share_equal(got, want) >= 0.99
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-6 + 1e-6).all()


def test_fused_ops_decline_fp32():
    x = torch.randn(4, 256)
    assert cpu_paged.rms_norm(x, torch.ones(256), 1e-6) is None
    assert cpu_paged.silu_mul(torch.randn(4, 64)) is None
    q = torch.randn(2, 4, 32)
    assert cpu_paged.rope(q, q, torch.ones(8, 32), torch.ones(8, 32), torch.arange(2)) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    "flags, says",
    [
        ("fpu sse2 avx avx2 fma f16c", "fp32 FMAs on AVX2"),  # Zen 2/3, Haswell to Comet Lake
        ("fpu avx2 fma avx512f avx512bw", "fp32 FMAs on AVX-512"),  # Skylake-SP, Ice Lake
        ("fpu sse2 sse4_2", "a portable C++ loop"),
    ],
)
def test_the_attention_paths_logged_without_avx512_bf16_are_the_ones_that_run(
    monkeypatch, caplog, flags, says
):
    """On an AVX2-only EPYC the worker logged "bf16 prefill attention on AVX512-BF16 dot
    products" and the same for decode: the choice between AMX and ``vdpbf16ps`` was logged
    even where neither exists. Prefill there is the AVX2 tile where the build has AVX2 (torch's
    SDPA where it has no vectors at all) and decode the extension's fp32 kernels."""
    import logging
    from types import SimpleNamespace

    from kernels import cpp_build

    avx2 = "avx2" in flags.split()
    fake = SimpleNamespace(
        decode_amx_available=lambda: False,
        set_decode_amx=lambda on: on,
        prefill_avx2_available=lambda: avx2,
    )
    monkeypatch.setattr(cpu_paged, "_bf16_ext", lambda: None)
    monkeypatch.setattr(cpu_paged, "_build", lambda: fake)
    monkeypatch.setattr(cpu_paged, "_prefill_path", None)
    monkeypatch.setattr(cpu_paged, "_decode_amx", None)
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="kernels.cpu_paged"):
        assert cpu_paged.prefill_path() == ("avx2" if avx2 else "sdpa")
        assert cpu_paged.decode_uses_amx() is False
    text = caplog.text
    assert "AVX512-BF16 dot products" not in text and "AMX tiles" not in text, text
    prefill = "fp32 FMAs on AVX2" if avx2 else "torch's SDPA"
    assert f"bf16 prefill attention on {prefill}" in text, text
    assert f"bf16 decode attention over shared prefixes on {says}" in text, text
