"""Factories for paged-KV kernel tests: pools, shuffled block tables, packed query chunks.

Every pool is built so that a kernel reading the wrong memory shows up as a large error:
blocks not owned by any sequence, the unused tail of each sequence's last block, and the other
layers of the pool are filled with large "poison" values (finite, so the torch reference, which
multiplies masked positions by zero, stays finite).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference as ref
from kernels.fp8_scales import compute_kv_scales

FP8 = torch.float8_e4m3fn
POISON = 300.0

# Kernel-vs-reference tolerances (atol, rtol) by the query/compute dtype. fp8 pools use the
# tolerance of their query dtype: kernel and reference dequantize to bit-identical values, so the
# only differences are accumulation order and the rounding of probabilities before P @ V.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class PagedCase:
    """One attention problem: packed queries over a paged pool with shuffled block tables."""

    query: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [NB, L, 2, BS, Hkv, D]
    layer: int
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    scale: float
    k_scale: torch.Tensor | None  # [1] or [Hkv] float32 (fp8 pools)
    v_scale: torch.Tensor | None

    def attention_args(self) -> tuple:
        return (
            self.query,
            self.kv_cache,
            self.layer,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.k_scale,
            self.v_scale,
        )

    def decode_args(self) -> tuple:
        return (
            self.query,
            self.kv_cache,
            self.layer,
            self.block_tables,
            self.seq_lens,
            self.scale,
            self.k_scale,
            self.v_scale,
        )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_case(
    seq_lens: list[int],
    q_lens: list[int] | None = None,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    kv_dtype: torch.dtype | None = None,
    per_head_scale: bool = False,
    num_layers: int = 2,
    layer: int = 1,
    spare_blocks: int = 3,
    table_pad: int = 2,
    seed: int = 0,
) -> PagedCase:
    """Build a case whose context is already written into the pool (``q_lens`` default: 1).

    Blocks are assigned from a random permutation of the pool, so every sequence spans
    non-contiguous, out-of-order blocks; block tables carry at least ``table_pad`` extra columns
    naming an unowned (poisoned) block past the last used one.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    q_lens = q_lens if q_lens is not None else [1] * len(seq_lens)
    assert len(q_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    blocks_per_seq = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + table_pad
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + table_pad
    tables = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    pos = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = perm[pos : pos + nb].to(torch.int32)
        tables[s, nb:] = int(perm[-1])  # padding columns name an unowned (poisoned) block
        pos += nb

    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    # per-head magnitudes differ so that per-head fp8 scales matter
    head_mag = torch.linspace(0.25, 1.5, num_kv_heads).view(1, 1, 1, 1, -1, 1)
    values = torch.randn(shape, generator=gen) * head_mag  # [NB, L, 2, BS, Hkv, D] fp32
    poison = torch.full(shape, POISON)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)  # slots holding real context
    for s, n in enumerate(seq_lens):
        slots = torch.arange(n)
        owned[tables[s, slots // block_size].long(), slots % block_size] = True
    keep = owned.view(num_blocks, 1, 1, block_size, 1, 1).expand(shape).clone()
    keep[:, [i for i in range(num_layers) if i != layer]] = False
    values = torch.where(keep, values, poison)

    k_scale = v_scale = None
    if kv_dtype == FP8:
        real = values[:, layer].transpose(1, 2)[owned]  # [n_ctx, 2, Hkv, D]
        k_scale, v_scale = compute_kv_scales(real[:, 0], real[:, 1], per_head=per_head_scale)
        kv_cache = torch.empty(shape, dtype=FP8)
        kv_cache[:, :, 0] = ref.quantize_fp8(values[:, :, 0], k_scale)
        kv_cache[:, :, 1] = ref.quantize_fp8(values[:, :, 1], v_scale)
    else:
        kv_cache = values.to(kv_dtype)

    total_q = sum(q_lens)
    query = torch.randn(total_q, num_heads, head_dim, generator=gen).to(dtype)  # [T, Hq, D]
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return PagedCase(
        query=query,
        kv_cache=kv_cache,
        layer=layer,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        scale=head_dim**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    """Compare with the per-dtype tolerance; the message reports the worst error."""
    atol, rtol = TOLERANCES[dtype]
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all(), f"{what}: non-finite output"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: max abs err {err.max().item():.3g} (atol {atol}, rtol {rtol}); worst at flat "
        f"index {worst}: got {a.flatten()[worst].item():.6g}, "
        f"expected {e.flatten()[worst].item():.6g}"
    )
