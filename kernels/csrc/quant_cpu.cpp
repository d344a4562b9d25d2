// Weight-only quantized matmul for the CPU: y[M, N] = x[M, K] (bf16) @ W.T, W given as 4- or
// 8-bit codes with a scale (and optionally a zero point) per group of input features.
//
// Layout (built once at load by kernels/quant_cpu.py): 16 output channels x 2 input features
// per step, the pair layout of vdpbf16ps, so each fp32 lane accumulates one output channel and
// no horizontal sum is needed. Codes are stored signed (c - 2^(bits-1)): 8-bit as int8
// [N/16][K/2][16][2], 4-bit as one byte per (channel, pair) [N/16][K/2][16], low nibble = even
// feature, high nibble = odd, holding c (0..15), mapped to bf16(c - 8) through a vpermw table.
// Signed codes are exact in bf16, products are exact in fp32, and the group's scale is applied
// to the fp32 group sum:  y[m, n] = sum_g s[g, n] * (sum_{k in g} x[m, k] c'[n, k])
//                                  + zs[g, n] * sum_{k in g} x[m, k],   zs = -(z - 2^(b-1)) s
// (the second term only for asymmetric schemes). Each weight step is converted once per tile
// of up to MR rows of x and reused across them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

bool supported() {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr int MR = 8;
constexpr int64_t PREFETCH = 1024;  // bytes ahead of the weight stream

static inline __m512bh load_w8(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Two pairs' worth of 4-bit codes (64) from 32 bytes: byte i = word i of pair p (low nibble)
// | word i of pair p + 1 (high nibble).
static inline void load_w4x2(const uint8_t* p, __m512i table, __m512bh& w0, __m512bh& w1) {
  const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(z, _mm512_set1_epi16(0x0F)), table);
  w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(z, 4), table);
}

static inline __m512bh xpair(const uint16_t* x, int64_t k) {
  return (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + k));
}

// One tile: ROWS rows of x against COLS consecutive 16-channel blocks (blk_bytes apart), so each
// converted weight vector serves ROWS rows and each broadcast of x serves COLS blocks. The
// per-group sums live in registers (acc); the scaled result accumulates in `res` (memory,
// touched once per group).
template <int BITS, int ROWS, int COLS>
static void tile(const uint16_t* x, int64_t K, const uint8_t* wblk, int64_t blk_bytes,
                 const float* scales, const float* zs, const float* xsum, int64_t G,
                 int64_t gsize, int64_t N, int64_t n0, at::BFloat16* y, __m512i table) {
  alignas(64) float res[ROWS][COLS][16];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) _mm512_store_ps(res[r][c], _mm512_setzero_ps());
  // Few rows: a second set of accumulators for the odd pair, so 2 x ROWS x COLS dot-product
  // chains run independently (one chain per accumulator is bound by vdpbf16ps's latency).
  constexpr bool DUAL = ROWS <= 4;
  __m512 acc[ROWS][COLS], acc2[DUAL ? ROWS : 1][COLS];
  // bytes per group: 8-bit 32 per pair, 4-bit 32 per two pairs
  const int64_t gbytes = BITS == 8 ? (gsize / 2) * 32 : (gsize / 4) * 32;
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
    if constexpr (DUAL)
      for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < COLS; ++c) acc2[r][c] = _mm512_setzero_ps();
    const uint8_t* wp = wblk + g * gbytes;
    const int64_t k0 = g * gsize;
    // 4 features (two pairs, 64 bytes of 8-bit or 32 bytes of 4-bit codes) per step
    const int64_t step_bytes = BITS == 8 ? 64 : 32;
    for (int64_t q = 0; q < gsize / 4; ++q) {
      __m512bh w0[COLS], w1[COLS];
      for (int c = 0; c < COLS; ++c) {
        const uint8_t* src = wp + c * blk_bytes + q * step_bytes;
        _mm_prefetch((const char*)(src + PREFETCH), _MM_HINT_T0);
        if constexpr (BITS == 8) {
          w0[c] = load_w8((const int8_t*)src);
          w1[c] = load_w8((const int8_t*)(src + 32));
        } else {
          load_w4x2(src, table, w0[c], w1[c]);
        }
      }
      const int64_t k = k0 + 4 * q;
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh xa = xpair(x + r * K, k), xb = xpair(x + r * K, k + 2);
        for (int c = 0; c < COLS; ++c) {
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xa, w0[c]);
          if constexpr (DUAL) acc2[r][c] = _mm512_dpbf16_ps(acc2[r][c], xb, w1[c]);
          else acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, w1[c]);
        }
      }
    }
    for (int c = 0; c < COLS; ++c) {
      const __m512 s = _mm512_loadu_ps(scales + g * N + n0 + 16 * c);
      const __m512 z = zs != nullptr ? _mm512_loadu_ps(zs + g * N + n0 + 16 * c) : s;
      for (int r = 0; r < ROWS; ++r) {
        __m512 a = acc[r][c];
        if constexpr (DUAL) a = _mm512_add_ps(a, acc2[r][c]);
        __m512 v = _mm512_fmadd_ps(a, s, _mm512_load_ps(res[r][c]));
        if (zs != nullptr) v = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * G + g]), z, v);
        _mm512_store_ps(res[r][c], v);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(res[r][c]));
      _mm256_storeu_si256((__m256i*)(y + r * N + n0 + 16 * c), b);
    }
}

template <int BITS, int COLS>
static void tile_rows(int64_t rows, const uint16_t* x, int64_t K, const uint8_t* wblk,
                      int64_t blk_bytes, const float* scales, const float* zs, const float* xsum,
                      int64_t G, int64_t gsize, int64_t N, int64_t n0, at::BFloat16* y,
                      __m512i table) {
  switch (rows) {
#define PDS_ROWS(R)                                                                     \
  case R:                                                                               \
    tile<BITS, R, COLS>(x, K, wblk, blk_bytes, scales, zs, xsum, G, gsize, N, n0, y, table); \
    break;
    PDS_ROWS(1) PDS_ROWS(2) PDS_ROWS(3) PDS_ROWS(4) PDS_ROWS(5) PDS_ROWS(6) PDS_ROWS(7)
    PDS_ROWS(8)
#undef PDS_ROWS
    default: TORCH_CHECK(false, "tile of ", rows, " rows");
  }
}
#endif

// x: [M, K] bf16; packed: uint8 (layout above); scales, zs: [G, N] fp32 (zs may be empty).
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& zs, int64_t bits, int64_t group_size, int64_t N) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bf16 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(N % 16 == 0 && K % group_size == 0 && group_size % 4 == 0, "bad shapes");
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == G && scales.size(1) == N,
              "scales must be fp32 [G, N]");
  const bool asym = zs.numel() > 0;
  const int64_t blk_bytes = bits == 8 ? (K / 2) * 32 : (K / 4) * 32;  // per 16 channels
  TORCH_CHECK(packed.numel() == (N / 16) * blk_bytes, "packed has the wrong size");
  auto y = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> xsum;
  if (asym) {
    xsum.assign(M * G, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        const at::BFloat16* row = x.data_ptr<at::BFloat16>() + m * K + g * group_size;
        for (int64_t k = 0; k < group_size; ++k) s += static_cast<float>(row[k]);
        xsum[m * G + g] = s;
      }
  }
  alignas(64) uint16_t tbl[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>((i & 15) - 8);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    tbl[i] = static_cast<uint16_t>(u >> 16);  // exact: small integers
  }
  const __m512i table = _mm512_load_si512(tbl);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = asym ? zs.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t NB = N / 16;
  // work items: pairs of 16-channel blocks (a lone last block when NB is odd)
  const int64_t items = (NB + 1) / 2;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t nb = 2 * it;
      const bool pair = nb + 1 < NB;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int64_t rows = std::min<int64_t>(MR, M - m0);
        const float* xs = asym ? xsum.data() + m0 * G : nullptr;
        const uint8_t* wb = pp + nb * blk_bytes;
        const uint16_t* xr = xp + m0 * K;
        at::BFloat16* yr = yp + m0 * N;
        if (bits == 8) {
          if (pair) tile_rows<8, 2>(rows, xr, K, wb, blk_bytes, sp, zp, xs, G, group_size, N, nb * 16, yr, table);
          else tile_rows<8, 1>(rows, xr, K, wb, blk_bytes, sp, zp, xs, G, group_size, N, nb * 16, yr, table);
        } else {
          if (pair) tile_rows<4, 2>(rows, xr, K, wb, blk_bytes, sp, zp, xs, G, group_size, N, nb * 16, yr, table);
          else tile_rows<4, 1>(rows, xr, K, wb, blk_bytes, sp, zp, xs, G, group_size, N, nb * 16, yr, table);
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "quant_gemm needs AVX512-BF16");
#endif
}

// quant_gemm releases the GIL while it runs, as torch's GEMMs do (see cpu_paged.cpp).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_gemm", &quant_gemm, py::call_guard<py::gil_scoped_release>(), "x @ W.T for 4/8-bit grouped weights, bf16 (AVX512-BF16)");
  m.def("supported", &supported, "whether quant_gemm was built");
}
