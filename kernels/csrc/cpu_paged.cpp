#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <type_traits>
#include <unordered_map>
#include <memory>
#include <vector>
#include <cstring>

template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }

// AMX tiles for the decode kernel's shared groups (see bf16_amx_group): built where the
// compiler targets AMX-BF16 (-march=native on such a CPU), used where Linux grants the tile
// state and the process asked for them (set_decode_amx; kernels/cpu_paged.py reads
// PDSERVE_CPU_DECODE).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PD_DECODE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
// The AMX tiles' shared set-up (the prefill tile and the decode kernel's shared groups): Linux's
// permission for the tile state, and one tile configuration for both.
static bool pf_amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) PfTileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void pf_amx_configure() {
  PfTileConfig c{};
  c.palette = 1;
  auto set = [&](int t, int rows, int colsb) { c.rows[t] = uint8_t(rows); c.colsb[t] = uint16_t(colsb); };
  set(0, 16, 64);                             // Q: 16 rows x 32 dims
  set(1, 16, 64);                             // K: 16 dim pairs x 16 keys
  for (int t = 2; t < 6; ++t) set(t, 16, 64);  // S of 16 keys, or a 16-dim slice of O (fp32)
  set(6, 16, 32);                             // P: 16 rows x 16 keys (bf16)
  set(7, 8, 64);                              // V: 8 key pairs x 16 dims
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores before ldtilecfg reads it
  _tile_loadconfig(&c);
}

#define PF_S_TILE(b, expr)   \
  switch (b) {               \
    case 0: expr(2); break;  \
    case 1: expr(3); break;  \
    case 2: expr(4); break;  \
    default: expr(5); break; \
  }

// The two tile products of an attention chunk of up to 4 units of 16 keys (the prefill tile
// and the decode kernel's shared groups run the same ones). amx_scores: S = Q K^T for 16
// query rows q (bf16, D a row) against unit b's K, whose 32-dim slices are B tiles of 16 dim
// pairs x 16 keys 256 dwords apart from kb[b]; into sm, row r's 64 scores at sm + 64 r.
static inline void amx_scores(const uint16_t* q, int64_t D, const uint32_t* const* kb, int nu,
                              float* sm) {
  for (int b = 0; b < nu; ++b) {
#define PF_ZERO(t) _tile_zero(t)
    PF_S_TILE(b, PF_ZERO)
#undef PF_ZERO
  }
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(0, q + c * 32, int(D * sizeof(uint16_t)));
    for (int b = 0; b < nu; ++b) {
      _tile_loadd(1, kb[b] + c * 256, 64);
#define PF_DOT(t) _tile_dpbf16ps(t, 0, 1)
      PF_S_TILE(b, PF_DOT)
#undef PF_DOT
    }
  }
  for (int b = 0; b < nu; ++b) {
#define PF_STORE(t) _tile_stored(t, sm + b * 16, 64 * int(sizeof(float)))
    PF_S_TILE(b, PF_STORE)
#undef PF_STORE
  }
}

// amx_pv: P V from zero for the 16 rows' bf16 probabilities pm (row r's 64 at pm + 64 r)
// against unit b's V, the B tiles of 8 key pairs x 16 dims at vb[b] (a pair's row D dwords
// long, 16-dim slice j 16 dwords in); into pv, row r's D floats at pv + D r.
static inline void amx_pv(const uint16_t* pm, const uint32_t* const* vb, int nu, int64_t D,
                          float* pv) {
  const int64_t C16 = D / 16;
  for (int64_t c0 = 0; c0 < C16; c0 += 4) {  // up to 4 16-dim slices of P V at a time
    const int ns = int(std::min<int64_t>(4, C16 - c0));
    for (int j = 0; j < ns; ++j) {
#define PF_ZERO(t) _tile_zero(t)
      PF_S_TILE(j, PF_ZERO)
#undef PF_ZERO
    }
    for (int b = 0; b < nu; ++b) {
      _tile_loadd(6, pm + b * 16, 64 * int(sizeof(uint16_t)));
      for (int j = 0; j < ns; ++j) {
        _tile_loadd(7, vb[b] + (c0 + j) * 16, int(D * sizeof(uint32_t)));
#define PF_PV(t) _tile_dpbf16ps(t, 6, 7)
        PF_S_TILE(j, PF_PV)
#undef PF_PV
      }
    }
    for (int j = 0; j < ns; ++j) {
#define PF_STORE(t) _tile_stored(t, pv + (c0 + j) * 16, int(D * sizeof(float)))
      PF_S_TILE(j, PF_STORE)
#undef PF_STORE
    }
  }
}
#endif
static std::atomic<bool> g_decode_amx{false};

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef __AVX512F__
// 16 consecutive K/V elements as fp32 lanes.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// e^x for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (rel. error
// ~2e-7), times 2^n with scalef. Inputs here are <= 0 (scores minus their running max).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for 16 lanes, x <= 0: x = n + r, |r| <= 1/2, 2^r by its degree-4 Taylor polynomial
// (relative error < 6e-5), times 2^n with scalef. For the bf16 kernels' probabilities (the
// prefill tiles and bf16 decode), which are rounded to bf16 (2^-9) before P V; their sum l, and
// so each output row, is within 6e-5 of exact, well inside the bf16 rounding of the output.
static inline __m512 exp2_p4(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291076e-3f);  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

template <typename T> struct HasLoad16 : std::false_type {};
template <> struct HasLoad16<float> : std::true_type {};
template <> struct HasLoad16<at::BFloat16> : std::true_type {};
template <> struct HasLoad16<at::Half> : std::true_type {};

// Reductions of 16 vectors at once: r[i] = op over the 16 lanes of v[i] (a transpose-and-op
// tree, 15 ops instead of 16 horizontal reductions). The lane order of the tree is fixed up by
// one permute (order derived by simulating the shuffles).
template <typename Op>
static inline __m512 htree16(const __m512* v, Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    x[j] = op(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
              _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    y[k] = op(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44),
              _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  const __m512 z = op(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(perm, z);
}

// Sums of 16 vectors at once: r[i] = sum of the 16 lanes of v[i].
static inline __m512 hsum16(const __m512* v) {
  return htree16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// Row maxima of 16 vectors at once: r[i] = max of the 16 lanes of v[i] (hsum16's tree with
// max, which is exact in any order).
static inline __m512 hmax16(const __m512* v) {
  return htree16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

// The new running maxima and rescale factors of up to 16 softmax rows at once (the bf16 decode
// kernel's and the prefill tiles'): mx[r] is row r's lane-wise max of its visible raw scores
// (-inf where none), m[16] the rows' running maxima in base-2 units (score * scale * log2 e,
// c = scale * log2 e > 0, so the max of s * c is c * max(s)), updated; corr[16] set to
// 2^(m_old - m_new), the factors that rescale the rows' earlier sums. A row's first group
// finds m = -inf and gets 2^-126 (exp2_p4's floor) where exact is 0: its earlier sums are all
// 0. Lanes of unused rows hold whatever their inputs give; nothing reads them.
static inline void rows_new_max(const __m512* mx, float c, float* m, float* corr) {
  const __m512 mold = _mm512_load_ps(m);
  const __m512 mnew = _mm512_max_ps(mold, _mm512_mul_ps(hmax16(mx), _mm512_set1_ps(c)));
  _mm512_store_ps(corr, exp2_p4(_mm512_sub_ps(mold, mnew)));
  _mm512_store_ps(m, mnew);
}

// One query head's online-softmax step over a 16-token group: scores sc (lanes past the
// group's tokens masked off by valid) update the running max m and sum l; returns the group's
// probabilities (0 where masked) and sets corr, the factor that rescales the accumulators.
static inline __m512 softmax_step(__m512 sc, __mmask16 valid, float& m, float& l, float& corr) {
  const float mnew = std::max(m, _mm512_mask_reduce_max_ps(valid, sc));
  corr = std::exp(m - mnew);
  const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mnew))));
  l = l * corr + _mm512_reduce_add_ps(e);
  m = mnew;
  return e;
}

#endif  // __AVX512F__

// Asks for a group's K and V strips (``bytes`` each, V ``s_vk_bytes`` after K) to be brought
// into the cache ahead of its turn, whole rows (every KV head) in address order. The kernels
// then read the group one head at a time, every Hkv-th line of a strip per pass: straight
// from DRAM that order gets about half the rate of an in-order read, from L2 it costs nothing.
// (The group used to be copied into an L1 buffer instead: the copies were 6 % of a served
// decode worker's time, and a step over 64 sequences of 1,120 distinct tokens took 0.79x the
// time without them on one thread, 0.87x on two; see docs/benchmarks.md.)
static inline void prefetch_group(const void* rows, int64_t bytes, int64_t s_vk_bytes) {
  const char* k = static_cast<const char*>(rows);
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(k + off, 0, 2);
    __builtin_prefetch(k + s_vk_bytes + off, 0, 2);
  }
}

// The decode kernels walk a work item's sequences 16 tokens at a time (8 with 8-token
// blocks: a group never straddles two blocks, the block size being 8 or a multiple of 16).
// An item is one sequence (or one KV head of one, when there are too few sequences to keep
// every thread busy), or a chunk of sequences whose block tables begin with the same blocks
// (prefix caching gives every request with the same prompt prefix the same blocks): the walk
// then reads each group of the shared blocks once, while it is in L1, and runs every member's
// step over it before each member goes on over its own blocks. A member's arithmetic is the
// same, in the same order, as in a walk of its own (the same groups, the same online-softmax
// updates), so no output depends on which sequences share an item.
struct Member {
  const void* q;  // the query rows of heads [h0, h0 + nh): [nh][G][D], bf16 or (scaled) fp32
  const int32_t* table;
  int64_t len;
  float* acc;  // [nh][G][D]
  float* m;    // [nh][G]
  float* l;    // [nh][G]
};

struct WalkGeometry {
  int64_t BS, s_tok, s_kv, s_block, layer_off;
};

// Runs step(member, rows, ntok) over every group of the item, shared groups first, each
// shared group through group(rows, ntok) (which runs every member's step over it). ``shared``
// is a whole number of blocks, within every member's length.
template <typename KT, typename Step, typename Group>
static void walk_item(const KT* kvp, const WalkGeometry& w, Member* mem, int64_t nmem,
                      int64_t shared, bool ahead, Step&& step, Group&& group) {
  const int64_t grp = std::min<int64_t>(16, w.BS);
  auto addr = [&](const int32_t* table, int64_t base) {
    return kvp + table[base / w.BS] * w.s_block + w.layer_off + (base % w.BS) * w.s_tok;
  };
  // The group after the one at (i, base) in walk order: the shared groups, then each member's
  // own. Walks over whole rows (``ahead``) ask for it to be fetched while the current group is
  // computed on (the blocks are scattered, so the hardware prefetcher cannot guess the next one).
  auto next_of = [&](int64_t i, int64_t base) -> const KT* {
    base += grp;
    if (i < 0) {
      if (base < shared) return addr(mem[0].table, base);
      i = 0;
      base = shared;
    }
    for (; i < nmem; ++i, base = shared)
      if (base < mem[i].len) return addr(mem[i].table, base);
    return nullptr;
  };
  auto rows_at = [&](const int32_t* table, int64_t base, const KT* next) {
    if (next) prefetch_group(next, grp * w.s_tok * int64_t(sizeof(KT)), w.s_kv * int64_t(sizeof(KT)));
    return addr(table, base);
  };
  for (int64_t base = 0; base < shared; base += grp)
    group(rows_at(mem[0].table, base, ahead ? next_of(-1, base) : nullptr), grp);
  for (int64_t i = 0; i < nmem; ++i)
    for (int64_t base = shared; base < mem[i].len; base += grp) {
      const int64_t ntok = std::min<int64_t>({grp, mem[i].len - base, w.BS - base % w.BS});
      step(mem[i], rows_at(mem[i].table, base, ahead ? next_of(i, base) : nullptr), ntok);
    }
}

#ifdef __AVX512F__
// One group of one sequence, KV heads [h0, h0 + nh): scores, online softmax, P @ V. D a
// multiple of 16 (<= 256); the G query heads of a KV head share every K/V row load. Every
// head of the item is done on the group while it is in the cache (a token's K and V rows of
// all heads are adjacent, and walk_item fetches the whole group ahead). V = D / 16 and G are
// compile-time constants so the head's
// query and accumulators live in registers for a group; between groups they sit in the
// member's acc / m / l. ``s_vk``: the V rows' offset from the K rows.
template <typename KT, int V, int G>
static inline void f32_step(const Member& mb, const KT* rows, int64_t ntok, int64_t s_tok,
                            int64_t s_vk, int64_t h0, int64_t nh, const float* vscale,
                            float* sbuf) {
  constexpr int64_t D = V * 16;
  __m512 q[G * V];
  __m512 a[G * V];
  __m512 part[G * 16];  // [g][t]: per-token partial dot products of a 16-token group
  const __mmask16 valid = ntok >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ntok) - 1);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const KT* kb = rows + (h0 + hh) * D;
    const KT* vb = kb + s_vk;
    const float* qh = static_cast<const float*>(mb.q) + hh * G * D;
    float* ah = mb.acc + hh * G * D;
    float* mh = mb.m + hh * G;
    float* lh = mb.l + hh * G;
    for (int64_t i = 0; i < G * V; ++i) {
      q[i] = _mm512_loadu_ps(qh + i * 16);
      a[i] = _mm512_loadu_ps(ah + i * 16);
    }
    for (int64_t t = 0; t < 16; ++t) {
      if (t < ntok) {
        const KT* kt = kb + t * s_tok;
        __m512 kr[V];
        for (int64_t v = 0; v < V; ++v) kr[v] = load16(kt + v * 16);
        for (int64_t g = 0; g < G; ++g) {
          __m512 d = _mm512_mul_ps(q[g * V], kr[0]);
          for (int64_t v = 1; v < V; ++v) d = _mm512_fmadd_ps(q[g * V + v], kr[v], d);
          part[g * 16 + t] = d;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) part[g * 16 + t] = _mm512_setzero_ps();
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float corr;
      const __m512 e = softmax_step(hsum16(part + g * 16), valid, mh[g], lh[g], corr);
      _mm512_storeu_ps(sbuf + g * 16, e);
      const __m512 c = _mm512_set1_ps(corr);
      for (int64_t v = 0; v < V; ++v) a[g * V + v] = _mm512_mul_ps(a[g * V + v], c);
    }
    const __m512 vs = _mm512_set1_ps(vscale[hh]);
    for (int64_t t = 0; t < ntok; ++t) {
      const KT* vt = vb + t * s_tok;
      __m512 vr[V];
      for (int64_t v = 0; v < V; ++v) vr[v] = _mm512_mul_ps(load16(vt + v * 16), vs);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(sbuf[g * 16 + t]);
        for (int64_t v = 0; v < V; ++v) a[g * V + v] = _mm512_fmadd_ps(p, vr[v], a[g * V + v]);
      }
    }
    for (int64_t i = 0; i < G * V; ++i) _mm512_storeu_ps(ah + i * 16, a[i]);
  }
}

template <typename KT>
static bool f32_item_dispatch(int64_t V, int64_t G, const KT* kvp, const WalkGeometry& w,
                              Member* mem, int64_t nmem, int64_t shared, int64_t h0, int64_t nh,
                              const float* vscale, float* sbuf, bool ahead) {
  const int64_t s_vk = w.s_kv;
#define PDS_CASE(VV, GG)                                                                     \
  if (V == VV && G == GG) {                                                                  \
    auto step = [&](const Member& mb, const KT* rows, int64_t ntok) {                        \
      f32_step<KT, VV, GG>(mb, rows, ntok, w.s_tok, s_vk, h0, nh, vscale, sbuf);             \
    };                                                                                       \
    walk_item<KT>(kvp, w, mem, nmem, shared, ahead, step, [&](const KT* rows, int64_t ntok) { \
      for (int64_t i = 0; i < nmem; ++i) step(mem[i], rows, ntok);                           \
    });                                                                                      \
    return true;                                                                             \
  }
#define PDS_GROUPS(VV) PDS_CASE(VV, 1) PDS_CASE(VV, 2) PDS_CASE(VV, 4) PDS_CASE(VV, 5) \
                       PDS_CASE(VV, 6) PDS_CASE(VV, 7) PDS_CASE(VV, 8)
  PDS_GROUPS(2) PDS_GROUPS(4) PDS_GROUPS(8)
#undef PDS_GROUPS
#undef PDS_CASE
  return false;
}
#endif

#ifdef __AVX2__
// max / sum of the 8 lanes of v (the AVX2 decode step's and the AVX2 prefill tile's)
static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

static inline float hadd8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The fp32 decode step on a CPU with AVX2 but no AVX-512 (f32_step's arithmetic on 8-lane
// vectors): a 16-token group's scores as two vectors of 8, each a transpose-and-add of 8
// per-token partial-dot vectors (hsum8x8), the softmax on those two, P @ V by broadcasts.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#ifdef __F16C__
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
template <typename T> struct HasLoad8 : std::false_type {};
template <> struct HasLoad8<float> : std::true_type {};
template <> struct HasLoad8<at::BFloat16> : std::true_type {};
#ifdef __F16C__
template <> struct HasLoad8<at::Half> : std::true_type {};
#endif

// e^x for 8 lanes, x <= 0: exp512's reduction and polynomial, 2^n put in the exponent bits
// (n >= -126 after the clamp, so the biased exponent stays positive).
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// r[i] = sum of the 8 lanes of v[i], for 8 vectors at once
static inline __m256 hsum8x8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <typename KT, int V, int G>
static inline void f32_step_avx2(const Member& mb, const KT* rows, int64_t ntok, int64_t s_tok,
                                 int64_t s_vk, int64_t h0, int64_t nh, const float* vscale,
                                 float* sbuf) {
  constexpr int64_t D = V * 8;
  __m256 q[G * V];
  __m256 a[G * V];
  __m256 part[G * 16];  // [g][t]: per-token partial dot products of a 16-token group
  // lane t of half j is token 8 j + t: valid where below ntok
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 valid[2] = {
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(ntok)), lane)),
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(ntok) - 8), lane))};
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const KT* kb = rows + (h0 + hh) * D;
    const KT* vb = kb + s_vk;
    const float* qh = static_cast<const float*>(mb.q) + hh * G * D;
    float* ah = mb.acc + hh * G * D;
    float* mh = mb.m + hh * G;
    float* lh = mb.l + hh * G;
    for (int64_t i = 0; i < G * V; ++i) {
      q[i] = _mm256_loadu_ps(qh + i * 8);
      a[i] = _mm256_loadu_ps(ah + i * 8);
    }
    for (int64_t t = 0; t < 16; ++t) {
      if (t < ntok) {
        const KT* kt = kb + t * s_tok;
        __m256 kr[V];
        for (int64_t v = 0; v < V; ++v) kr[v] = load8(kt + v * 8);
        for (int64_t g = 0; g < G; ++g) {
          __m256 d = _mm256_mul_ps(q[g * V], kr[0]);
          for (int64_t v = 1; v < V; ++v) d = _mm256_fmadd_ps(q[g * V + v], kr[v], d);
          part[g * 16 + t] = d;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) part[g * 16 + t] = _mm256_setzero_ps();
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m256 s0 = _mm256_blendv_ps(ninf, hsum8x8(part + g * 16), valid[0]);
      const __m256 s1 = _mm256_blendv_ps(ninf, hsum8x8(part + g * 16 + 8), valid[1]);
      const float mnew = std::max(mh[g], hmax8(_mm256_max_ps(s0, s1)));
      const float corr = std::exp(mh[g] - mnew);
      const __m256 mv = _mm256_set1_ps(mnew);
      const __m256 e0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, mv)), valid[0]);
      const __m256 e1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, mv)), valid[1]);
      lh[g] = lh[g] * corr + hadd8(_mm256_add_ps(e0, e1));
      mh[g] = mnew;
      _mm256_storeu_ps(sbuf + g * 16, e0);
      _mm256_storeu_ps(sbuf + g * 16 + 8, e1);
      const __m256 c = _mm256_set1_ps(corr);
      for (int64_t v = 0; v < V; ++v) a[g * V + v] = _mm256_mul_ps(a[g * V + v], c);
    }
    const __m256 vs = _mm256_set1_ps(vscale[hh]);
    for (int64_t t = 0; t < ntok; ++t) {
      const KT* vt = vb + t * s_tok;
      __m256 vr[V];
      for (int64_t v = 0; v < V; ++v) vr[v] = _mm256_mul_ps(load8(vt + v * 8), vs);
      for (int64_t g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(sbuf[g * 16 + t]);
        for (int64_t v = 0; v < V; ++v) a[g * V + v] = _mm256_fmadd_ps(p, vr[v], a[g * V + v]);
      }
    }
    for (int64_t i = 0; i < G * V; ++i) _mm256_storeu_ps(ah + i * 8, a[i]);
  }
}

template <typename KT>
static bool f32_item_dispatch_avx2(int64_t V, int64_t G, const KT* kvp, const WalkGeometry& w,
                                   Member* mem, int64_t nmem, int64_t shared, int64_t h0,
                                   int64_t nh, const float* vscale, float* sbuf, bool ahead) {
  const int64_t s_vk = w.s_kv;
#define PDS_CASE(VV, GG)                                                                     \
  if (V == VV && G == GG) {                                                                  \
    auto step = [&](const Member& mb, const KT* rows, int64_t ntok) {                        \
      f32_step_avx2<KT, VV, GG>(mb, rows, ntok, w.s_tok, s_vk, h0, nh, vscale, sbuf);        \
    };                                                                                       \
    walk_item<KT>(kvp, w, mem, nmem, shared, ahead, step, [&](const KT* rows, int64_t ntok) { \
      for (int64_t i = 0; i < nmem; ++i) step(mem[i], rows, ntok);                           \
    });                                                                                      \
    return true;                                                                             \
  }
#define PDS_GROUPS(VV) PDS_CASE(VV, 1) PDS_CASE(VV, 2) PDS_CASE(VV, 4) PDS_CASE(VV, 5) \
                       PDS_CASE(VV, 6) PDS_CASE(VV, 7) PDS_CASE(VV, 8)
  PDS_GROUPS(4) PDS_GROUPS(8) PDS_GROUPS(16)
#undef PDS_GROUPS
#undef PDS_CASE
  return false;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// a + b as written: _mm512_add_ps is a plain vector add, which -ffast-math may reassociate
// into another tree (other bits); the explicitly rounded form is left as it is.
static inline __m512 add_exact(__m512 a, __m512 b) {
  return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The sum of one vector's lanes in hsum16's tree: a_j = (x_j + x_j+8) + (x_j+4 + x_j+12),
// then (a_0 + a_2) + (a_1 + a_3).
static inline float hsum_tree(__m512 x) {
  const __m512 t = add_exact(x, _mm512_shuffle_f32x4(x, x, 0xEE));
  const __m512 u = add_exact(t, _mm512_shuffle_f32x4(t, t, 0x01));
  const __m512 v = add_exact(u, _mm512_shuffle_ps(u, u, 0x0E));
  return _mm512_cvtss_f32(add_exact(v, _mm512_shuffle_ps(v, v, 0x01)));
}

// The bf16 decode kernels' online softmax, in base 2 as the prefill tiles': a row's running
// max m is kept in score x scale x log2 e units (c = scale x log2 e), so that a probability is
// one fused multiply-subtract and a 2^x (exp2_p4; P is rounded to bf16 anyway). A row's step
// over a group, s its raw scores (tokens in lanes, those past the group's end masked off by
// valid): mnew = max(m, max(s) c), corr = 2^(m - mnew), p = 2^(s c - mnew),
// l = fma(l, corr, sum(p)), the sum in hsum16's tree. bf16_softmax_row does it for one row,
// bf16_softmax_rows for up to 16 rows at once (the reductions vertical); each row gets the
// same bits either way, so no output depends on which sequences share an item.
static inline __m512 bf16_softmax_row(__m512 s, __mmask16 valid, float c, float& m, float& l,
                                      float& corr) {
  const float mnew = std::max(m, _mm512_mask_reduce_max_ps(valid, s) * c);
  corr = _mm512_cvtss_f32(exp2_p4(_mm512_set1_ps(m - mnew)));
  const __m512 p = _mm512_maskz_mov_ps(
      valid, exp2_p4(_mm512_fmsub_ps(s, _mm512_set1_ps(c), _mm512_set1_ps(mnew))));
  l = std::fma(l, corr, hsum_tree(p));
  m = mnew;
  return p;
}

// s[r]: row r's raw scores (rows >= n ignored; s is overwritten); *mp[r], *lp[r]: row r's
// running max and sum, updated; cr[r]: set to row r's rescale factor; pb[r * 16 ..]: row r's
// probabilities in bf16.
static inline void bf16_softmax_rows(__m512* s, int64_t n, __mmask16 valid, float c,
                                     float* const* mp, float* const* lp, float* cr, uint16_t* pb) {
  alignas(64) float mv[16], lv[16];
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < 16; ++r) {
    mv[r] = r < n ? *mp[r] : -INFINITY;
    lv[r] = r < n ? *lp[r] : 0.f;
    s[r] = r < n ? _mm512_mask_mov_ps(ninf, valid, s[r]) : ninf;
  }
  rows_new_max(s, c, mv, cr);
  const __m512 mnew = _mm512_load_ps(mv), cv = _mm512_set1_ps(c);
  for (int64_t r = 0; r < 16; ++r) {
    const __m512 mr = _mm512_permutexvar_ps(_mm512_set1_epi32(int(r)), mnew);
    s[r] = r < n ? _mm512_maskz_mov_ps(valid, exp2_p4(_mm512_fmsub_ps(s[r], cv, mr)))
                 : _mm512_setzero_ps();
    if (r < n)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 16), (__m256i)_mm512_cvtneps_pbh(s[r]));
  }
  _mm512_store_ps(lv, _mm512_fmadd_ps(_mm512_load_ps(lv), _mm512_load_ps(cr), hsum16(s)));
  for (int64_t r = 0; r < n; ++r) {
    *mp[r] = mv[r];
    *lp[r] = lv[r];
  }
}

// P @ V runs a chain of vdpbf16ps per accumulator (2 W per query head); with fewer than 8
// chains side by side the chains' latency, not the instructions, sets its pace, so the kernels
// below run the P @ V of this many heads (or members) together. Each accumulator's chain is
// the same either way.
template <int W, int G>
constexpr int64_t kPvRowSets = G * 2 * W >= 8 ? 1 : 8 / (G * 2 * W);

// The same step for bf16 queries and a bf16 cache, on vdpbf16ps: q . k straight from the bf16
// rows (products exact, sums in fp32, times the scale in fp32), softmax in fp32, P rounded to
// bf16 for P @ V as torch's flash SDPA does in bf16. P @ V takes two tokens per instruction:
// unpacklo / unpackhi of rows t and t + 1 pair each value with the next token's, and
// (p_t, p_t+1) is one broadcast dword, so the accumulators hold dimension d of lane
// 4k + i at 32w + 8k + i (lo) and 32w + 8k + 4 + i (hi); bf16_dim_order puts them back in
// order once the walk is done. W = D / 32.
template <int W, int G>
static inline void bf16_step(const Member& mb, const at::BFloat16* rows, int64_t ntok,
                             int64_t s_tok, int64_t s_vk, int64_t h0, int64_t nh, float c) {
  constexpr int64_t D = W * 32;
  constexpr int64_t HB = 16 / G;  // KV heads whose rows share one bf16_softmax_rows
  constexpr int64_t XP = kPvRowSets<W, G>;
  __m512bh q[G * W];
  __m512 a[XP * G * 2 * W];  // [head][g][w][lo, hi]
  __m512 part[G * 16];
  __m512 s[16];
  alignas(64) uint16_t pb[16 * 16];
  alignas(64) float cr[16];
  const __mmask16 valid = ntok >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ntok) - 1);
  for (int64_t h1 = 0; h1 < nh; h1 += HB) {
    const int64_t hn = std::min(HB, nh - h1), n = hn * G;
    // scores of every row (head h1 + r / G, query head r % G) of the block
    for (int64_t x = 0; x < hn; ++x) {
      const at::BFloat16* kb = rows + (h0 + h1 + x) * D;
      const at::BFloat16* qh = static_cast<const at::BFloat16*>(mb.q) + (h1 + x) * G * D;
      for (int64_t i = 0; i < G * W; ++i) q[i] = (__m512bh)_mm512_loadu_si512(qh + i * 32);
      for (int64_t t = 0; t < 16; ++t) {
        if (t < ntok) {
          const at::BFloat16* kt = kb + t * s_tok;
          __m512bh kr[W];
          for (int64_t w = 0; w < W; ++w) kr[w] = (__m512bh)_mm512_loadu_si512(kt + w * 32);
          for (int64_t g = 0; g < G; ++g) {
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g * W], kr[0]);
            for (int64_t w = 1; w < W; ++w) d = _mm512_dpbf16_ps(d, q[g * W + w], kr[w]);
            part[g * 16 + t] = d;
          }
        } else {
          for (int64_t g = 0; g < G; ++g) part[g * 16 + t] = _mm512_setzero_ps();
        }
      }
      for (int64_t g = 0; g < G; ++g) s[x * G + g] = hsum16(part + g * 16);
    }
    float* mh = mb.m + h1 * G;
    float* lh = mb.l + h1 * G;
    if (n >= 4) {  // the rows' reductions together (the same bits as one by one)
      float* mp[16];
      float* lp[16];
      for (int64_t r = 0; r < n; ++r) {
        mp[r] = mh + r;
        lp[r] = lh + r;
      }
      bf16_softmax_rows(s, n, valid, c, mp, lp, cr, pb);
    } else {
      for (int64_t r = 0; r < n; ++r) {
        const __m512 e = bf16_softmax_row(s[r], valid, c, mh[r], lh[r], cr[r]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 16), (__m256i)_mm512_cvtneps_pbh(e));
      }
    }
    // P @ V, XP heads at a time so that enough accumulator chains run side by side
    for (int64_t x0 = 0; x0 < hn; x0 += XP) {
      const int64_t xn = std::min(XP, hn - x0);
      for (int64_t k = 0; k < XP; ++k)
        if (k < xn)
          for (int64_t g = 0; g < G; ++g) {
            const float* ag = mb.acc + ((h1 + x0 + k) * G + g) * D;
            const __m512 cg = _mm512_set1_ps(cr[(x0 + k) * G + g]);
            for (int64_t i = 0; i < 2 * W; ++i)
              a[(k * G + g) * 2 * W + i] = _mm512_mul_ps(_mm512_loadu_ps(ag + i * 16), cg);
          }
      for (int64_t t = 0; t < ntok; t += 2) {
        const bool two = t + 1 < ntok;  // a row past the last token may hold anything
        for (int64_t k = 0; k < XP; ++k) {
          if (k >= xn) continue;
          const at::BFloat16* v0 = rows + (h0 + h1 + x0 + k) * D + s_vk + t * s_tok;
          __m512i lo[W], hi[W];
          for (int64_t w = 0; w < W; ++w) {
            const __m512i x = _mm512_loadu_si512(v0 + w * 32);
            const __m512i y =
                two ? _mm512_loadu_si512(v0 + s_tok + w * 32) : _mm512_setzero_si512();
            lo[w] = _mm512_unpacklo_epi16(x, y);
            hi[w] = _mm512_unpackhi_epi16(x, y);
          }
          for (int64_t g = 0; g < G; ++g) {
            uint32_t pair;  // (p_t, p_t+1); p past ntok is 0
            std::memcpy(&pair, pb + ((x0 + k) * G + g) * 16 + t, 4);
            const __m512bh p2 = (__m512bh)_mm512_set1_epi32(int(pair));
            for (int64_t w = 0; w < W; ++w) {
              __m512* aw = a + ((k * G + g) * W + w) * 2;
              aw[0] = _mm512_dpbf16_ps(aw[0], p2, (__m512bh)lo[w]);
              aw[1] = _mm512_dpbf16_ps(aw[1], p2, (__m512bh)hi[w]);
            }
          }
        }
      }
      for (int64_t k = 0; k < xn; ++k)
        for (int64_t i = 0; i < G * 2 * W; ++i)
          _mm512_storeu_ps(mb.acc + (h1 + x0 + k) * G * D + i * 16, a[k * G * 2 * W + i]);
    }
  }
}

// bf16_step's accumulator lanes back to dimension order, for ``n`` heads of D = 32 W.
static void bf16_dim_order(float* acc, int64_t n, int64_t W) {
  const int64_t D = 32 * W;
  std::vector<float> tmp(D);
  for (int64_t i = 0; i < n; ++i) {
    float* ag = acc + i * D;
    for (int64_t w = 0; w < W; ++w)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t k = 0; k < 4; ++k)
          for (int64_t j = 0; j < 4; ++j)
            tmp[32 * w + 8 * k + 4 * half + j] = ag[(2 * w + half) * 16 + 4 * k + j];
    std::memcpy(ag, tmp.data(), D * sizeof(float));
  }
}

// A shared group prepared once for every member: kt[hh][w][j] holds, in lane t, dword j of
// chunk w of token t's K row (dims 32w + 2j, 32w + 2j + 1): a member's scores of the 16
// tokens then come out of D / 2 broadcast-and-vdpbf16ps steps, lanes already tokens, with no
// transpose; vp[hh][pair][w][lo, hi] holds bf16_step's interleaved V rows.
template <int W>
static inline void bf16_prepare(const at::BFloat16* rows, int64_t ntok, int64_t s_tok,
                                int64_t s_vk, int64_t h0, int64_t nh, __m512i* kt, __m512i* vp) {
  constexpr int64_t D = W * 32;
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(int(s_tok / 2)));
  // only the group's ntok rows are read (lanes past it zero, never used): with blocks of 4 or
  // fewer tokens, 16 rows would run past the block and, for the pool's last one, past the pool
  const __mmask16 valid = ntok >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ntok) - 1);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int32_t* kb = reinterpret_cast<const int32_t*>(rows + (h0 + hh) * D);
    for (int64_t i = 0; i < W * 16; ++i)
      kt[hh * W * 16 + i] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, kb + i, 4);
    const at::BFloat16* vb = rows + (h0 + hh) * D + s_vk;
    for (int64_t t = 0; t < ntok; t += 2) {
      const at::BFloat16* v0 = vb + t * s_tok;
      const bool two = t + 1 < ntok;
      __m512i* out = vp + (hh * 8 + t / 2) * W * 2;
      for (int64_t w = 0; w < W; ++w) {
        const __m512i x = _mm512_loadu_si512(v0 + w * 32);
        const __m512i y = two ? _mm512_loadu_si512(v0 + s_tok + w * 32) : _mm512_setzero_si512();
        out[2 * w] = _mm512_unpacklo_epi16(x, y);
        out[2 * w + 1] = _mm512_unpackhi_epi16(x, y);
      }
    }
  }
}

// bf16_step over a prepared group for up to 16 / G members at once, with the same bits: per
// lane, the same vdpbf16ps chain over the chunks as bf16_step's per-token dot products, then
// hsum16's tree (lanes j and j + 8, then k and k + 4, then 0 + 2 and 1 + 3, then the two) as
// vertical adds; the members' rows then go through bf16_softmax_rows together (row r: member
// r / G, head r % G), whose reductions run down the rows instead of across each row's lanes.
template <int W, int G>
static inline void bf16_prepared_block(Member* mb, int64_t nm, const __m512i* kt,
                                       const __m512i* vp, int64_t ntok, int64_t nh, float c) {
  constexpr int64_t D = W * 32;
  constexpr int64_t MP = kPvRowSets<W, G>;
  __m512 a[MP * G * 2 * W];
  __m512 s[16];
  alignas(64) uint16_t pb[16 * 16];
  alignas(64) float cr[16];
  const int64_t n = nm * G;
  const __mmask16 valid = ntok >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ntok) - 1);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const __m512i* kh = kt + hh * W * 16;
    float* mp[16];
    float* lp[16];
    for (int64_t r = 0; r < n; ++r) {
      mp[r] = mb[r / G].m + hh * G + r % G;
      lp[r] = mb[r / G].l + hh * G + r % G;
    }
    for (int64_t r = 0; r < n; ++r) {
      const int32_t* qg = reinterpret_cast<const int32_t*>(
                              static_cast<const at::BFloat16*>(mb[r / G].q) + hh * G * D) +
                          (r % G) * (D / 2);
      __m512 P[16];
      for (int64_t j = 0; j < 16; ++j)
        P[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_set1_epi32(qg[j]),
                                (__m512bh)kh[j]);
      for (int64_t w = 1; w < W; ++w)
        for (int64_t j = 0; j < 16; ++j)
          P[j] = _mm512_dpbf16_ps(P[j], (__m512bh)_mm512_set1_epi32(qg[w * 16 + j]),
                                  (__m512bh)kh[w * 16 + j]);
      for (int64_t j = 0; j < 8; ++j) P[j] = add_exact(P[j], P[j + 8]);
      for (int64_t k = 0; k < 4; ++k) P[k] = add_exact(P[k], P[k + 4]);
      s[r] = add_exact(add_exact(P[0], P[2]), add_exact(P[1], P[3]));
    }
    bf16_softmax_rows(s, n, valid, c, mp, lp, cr, pb);
    // P @ V, MP members at a time so that enough accumulator chains run side by side
    for (int64_t i0 = 0; i0 < nm; i0 += MP) {
      const int64_t mn = std::min(MP, nm - i0);
      for (int64_t k = 0; k < MP; ++k)
        if (k < mn)
          for (int64_t g = 0; g < G; ++g) {
            const float* ag = mb[i0 + k].acc + (hh * G + g) * D;
            const __m512 cg = _mm512_set1_ps(cr[(i0 + k) * G + g]);
            for (int64_t j = 0; j < 2 * W; ++j)
              a[(k * G + g) * 2 * W + j] = _mm512_mul_ps(_mm512_loadu_ps(ag + j * 16), cg);
          }
      for (int64_t t = 0; t < ntok; t += 2) {
        const __m512i* vt = vp + (hh * 8 + t / 2) * W * 2;
        for (int64_t k = 0; k < MP; ++k) {
          if (k >= mn) continue;
          for (int64_t g = 0; g < G; ++g) {
            uint32_t pair;
            std::memcpy(&pair, pb + ((i0 + k) * G + g) * 16 + t, 4);
            const __m512bh p2 = (__m512bh)_mm512_set1_epi32(int(pair));
            for (int64_t w = 0; w < W; ++w) {
              __m512* aw = a + ((k * G + g) * W + w) * 2;
              aw[0] = _mm512_dpbf16_ps(aw[0], p2, (__m512bh)vt[2 * w]);
              aw[1] = _mm512_dpbf16_ps(aw[1], p2, (__m512bh)vt[2 * w + 1]);
            }
          }
        }
      }
      for (int64_t k = 0; k < mn; ++k)
        for (int64_t j = 0; j < G * 2 * W; ++j)
          _mm512_storeu_ps(mb[i0 + k].acc + hh * G * D + j * 16, a[k * G * 2 * W + j]);
    }
  }
}

#ifdef PD_DECODE_AMX
// The groups of a shared prefix on AMX tiles, for every member at once: the members' query
// rows (member i's head g is row i G + g) stacked 16 to a tile, four 16-token groups at a time
// (a chunk of 64 keys, as the prefill tiles take them). Each group is prepared as for
// bf16_prepared_block (bf16_prepare: its kt is the B tile of 16 dim pairs x 16 tokens, its vp's
// interleaved token pairs the B tile of 8 pairs x 16 dims, columns in bf16_step's accumulator
// order); per chunk, S = Q K^T on the tiles, the rows' online softmax over the 64 scores in
// base 2 (the rows' maxima and rescale factors at once, rows_new_max), and P V on the tiles,
// added into O at the next chunk's rescale (the prefill tile's order). After the last shared
// group each member's accumulator, running max and sum start from the tile's, and its own
// groups follow in bf16_step. The dot products' order is the tile's, so a member's output is
// within bf16 rounding of its walk alone, not the same bits (the AVX-512 paths keep those).
struct AmxGroupState {
  std::vector<uint16_t> qs;  // [nh][blocks][16][D] the stacked query rows
  std::vector<float> o, pv;  // [nh][blocks][16][D] in bf16_step's accumulator order
  std::vector<float> m, l;   // [nh][blocks][16] running max (base 2); [..][16][16] lane sums
  std::vector<float> s;      // [16][64] a block's scores of one chunk
  std::vector<uint16_t> pb;  // [16][64] its probabilities, bf16 (+ room to align)
  std::vector<__m512i> prep; // [4][nh] prepared groups (bf16_prepare's kt, then vp)
  int64_t done = 0;          // shared groups seen so far in this item
};

// One chunk of ``ng`` (<= 4) prepared groups for every block of rows.
static void amx_chunk(Member* mb, int64_t G, int64_t W, int64_t rows, int64_t nh, int64_t ng,
                      float c, AmxGroupState& st) {
  const int64_t D = W * 32, nblk = (rows + 15) / 16, per = 16 * D;
  const __m512i* kt[4];  // each group's prepared K, then its V (bf16_prepare)
  for (int64_t g = 0; g < ng; ++g) kt[g] = st.prep.data() + g * nh * W * 32;
  float* sm = st.s.data();
  uint16_t* pm = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(st.pb.data()) + 63) & ~uintptr_t(63));
  for (int64_t b = 0; b < nh * nblk; ++b) {
    const int64_t hh = b / nblk, r0 = (b % nblk) * 16, n = std::min<int64_t>(16, rows - r0);
    const uint32_t* kb[4];  // this KV head's K and V of each group
    const uint32_t* vb[4];
    for (int64_t g = 0; g < ng; ++g) {
      kb[g] = reinterpret_cast<const uint32_t*>(kt[g] + hh * W * 16);
      vb[g] = reinterpret_cast<const uint32_t*>(kt[g] + nh * W * 16 + hh * 8 * W * 2);
    }
    amx_scores(st.qs.data() + b * per, D, kb, int(ng), sm);
    // the rows' new maxima and rescale factors at once, then each row's probabilities
    alignas(64) float m[16], alpha[16];  // rows_new_max's aligned loads
    float* mb_ = st.m.data() + b * 16;
    std::memcpy(m, mb_, sizeof(m));
    float* l = st.l.data() + b * 256;
    __m512 mx[16];
    for (int64_t r = 0; r < 16; ++r) {
      __m512 x = _mm512_set1_ps(-INFINITY);
      if (r < n)
        for (int64_t g = 0; g < ng; ++g) x = _mm512_max_ps(x, _mm512_loadu_ps(sm + r * 64 + g * 16));
      mx[r] = x;
    }
    rows_new_max(mx, c, m, alpha);
    std::memcpy(mb_, m, sizeof(m));
    const __m512 cv = _mm512_set1_ps(c);
    float* o = st.o.data() + b * per;
    const float* pv = st.pv.data() + b * per;
    for (int64_t r = 0; r < n; ++r) {
      const __m512 mr = _mm512_set1_ps(m[r]);
      __m512 pr[4], psum = _mm512_setzero_ps();
      for (int64_t g = 0; g < 4; ++g) {
        pr[g] = g < ng ? exp2_p4(_mm512_fmsub_ps(_mm512_loadu_ps(sm + r * 64 + g * 16), cv, mr))
                       : _mm512_setzero_ps();
        psum = _mm512_add_ps(psum, pr[g]);
      }
      const __m512 av = _mm512_set1_ps(alpha[r]);
      _mm512_storeu_ps(l + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + r * 16), av, psum));
      for (int64_t j = 0; j < 2 * W; ++j) {
        float* oj = o + r * D + j * 16;
        _mm512_storeu_ps(oj, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(oj),
                                                         _mm512_loadu_ps(pv + r * D + j * 16)), av));
      }
      _mm512_store_si512(pm + r * 64, (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
      _mm512_store_si512(pm + r * 64 + 32, (__m512i)_mm512_cvtne2ps_pbh(pr[3], pr[2]));
    }
    amx_pv(pm, vb, int(ng), D, st.pv.data() + b * per);
  }
}

// The walk's shared group (rows, 16 tokens): prepared into the next slot of a chunk; a full
// chunk (or the last shared group) runs through amx_chunk.
template <int W>
static void bf16_amx_group(Member* mb, int64_t nm, int64_t G, const at::BFloat16* grows,
                           int64_t s_tok, int64_t s_vk, int64_t h0, int64_t nh, float c,
                           int64_t n_groups, AmxGroupState& st) {
  constexpr int64_t D = W * 32;
  const int64_t rows = nm * G, nblk = (rows + 15) / 16, nb = nh * nblk, per = 16 * D;
  if (st.done == 0) {
    pf_amx_configure();
    st.qs.assign(nb * per, 0);
    st.o.assign(nb * per, 0.f);
    st.pv.assign(nb * per, 0.f);
    st.l.assign(nb * 256, 0.f);
    st.m.resize(nb * 16);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t r = 0; r < 16; ++r)  // rows past the members: 0, so that nothing is NaN
        st.m[b * 16 + r] = (b % nblk) * 16 + r < rows ? -INFINITY : 0.f;
    st.s.resize(16 * 64);
    st.pb.assign(16 * 64 + 32, 0);
    st.prep.resize(4 * nh * W * 32);
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(st.qs.data() + hh * nblk * per + r * D,
                    static_cast<const at::BFloat16*>(mb[r / G].q) + (hh * G + r % G) * D,
                    D * sizeof(uint16_t));
  }
  const int64_t slot = st.done % 4;
  __m512i* kt = st.prep.data() + slot * nh * W * 32;
  bf16_prepare<W>(grows, 16, s_tok, s_vk, h0, nh, kt, kt + nh * W * 16);
  ++st.done;
  if (slot == 3 || st.done == n_groups) amx_chunk(mb, G, W, rows, nh, slot + 1, c, st);
  if (st.done < n_groups) return;
  _tile_release();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t hh = b / nblk;
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = (b % nblk) * 16 + i;
      if (r >= rows) break;
      const int64_t k = r / G, g = r % G;
      float* acc = mb[k].acc + (hh * G + g) * D;
      const float* o = st.o.data() + b * per + i * D;
      const float* pv = st.pv.data() + b * per + i * D;
      for (int64_t j = 0; j < 2 * W; ++j)
        _mm512_storeu_ps(acc + j * 16, _mm512_add_ps(_mm512_loadu_ps(o + j * 16),
                                                     _mm512_loadu_ps(pv + j * 16)));
      mb[k].m[hh * G + g] = st.m[b * 16 + i];
      mb[k].l[hh * G + g] = _mm512_reduce_add_ps(_mm512_loadu_ps(st.l.data() + b * 256 + i * 16));
    }
  }
}
#endif

// Members from which a shared group is prepared (the gathers cost about what a few members'
// per-token reductions do); fewer run bf16_step over it. Either way, the same bits.
constexpr int64_t kPrepareMembers = 4;

static bool bf16_item_dispatch(int64_t W, int64_t G, const at::BFloat16* kvp,
                               const WalkGeometry& w, Member* mem, int64_t nmem, int64_t shared,
                               int64_t h0, int64_t nh, float scale, bool ahead,
                               std::vector<__m512i>& prep) {
  const int64_t s_vk = w.s_kv;
  const float c = scale * 1.44269504088896341f;  // bf16_softmax_row's base-2 units
  bool found = false;
  if (shared > 0 && nmem >= kPrepareMembers) prep.resize(nh * W * 32);
#ifdef PD_DECODE_AMX
  // the shared groups on AMX tiles: whole 16-token groups only (16-token blocks or larger)
  const bool amx = shared > 0 && nmem >= kPrepareMembers && w.BS % 16 == 0 &&
                   g_decode_amx.load(std::memory_order_relaxed);
  static thread_local AmxGroupState amx_state;
  amx_state.done = 0;
#define PDS_AMX_GROUP(WW)                                                                    \
  if (amx) {                                                                                 \
    bf16_amx_group<WW>(mem, nmem, G, rows, w.s_tok, s_vk, h0, nh, c, shared / 16, amx_state); \
    return;                                                                                  \
  }
#else
#define PDS_AMX_GROUP(WW)
#endif
#define PDS_CASE(WW, GG)                                                                     \
  if (!found && W == WW && G == GG) {                                                        \
    auto step = [&](const Member& mb, const at::BFloat16* rows, int64_t ntok) {              \
      bf16_step<WW, GG>(mb, rows, ntok, w.s_tok, s_vk, h0, nh, c);                           \
    };                                                                                       \
    walk_item<at::BFloat16>(                                                                 \
        kvp, w, mem, nmem, shared, ahead, step, [&](const at::BFloat16* rows, int64_t ntok) { \
          if (nmem < kPrepareMembers) {                                                      \
            for (int64_t i = 0; i < nmem; ++i) step(mem[i], rows, ntok);                     \
            return;                                                                          \
          }                                                                                  \
          PDS_AMX_GROUP(WW)                                                                  \
          __m512i* kt = prep.data();                                                         \
          __m512i* vp = kt + nh * WW * 16;                                                   \
          bf16_prepare<WW>(rows, ntok, w.s_tok, s_vk, h0, nh, kt, vp);                       \
          for (int64_t i = 0; i < nmem; i += 16 / GG)                                        \
            bf16_prepared_block<WW, GG>(mem + i, std::min<int64_t>(16 / GG, nmem - i), kt,    \
                                        vp, ntok, nh, c);                                    \
        });                                                                                  \
    found = true;                                                                            \
  }
#define PDS_GROUPS(WW) PDS_CASE(WW, 1) PDS_CASE(WW, 2) PDS_CASE(WW, 4) PDS_CASE(WW, 5) \
                       PDS_CASE(WW, 6) PDS_CASE(WW, 7) PDS_CASE(WW, 8)
  PDS_GROUPS(1) PDS_GROUPS(2) PDS_GROUPS(4) PDS_GROUPS(8)
#undef PDS_GROUPS
#undef PDS_CASE
#undef PDS_AMX_GROUP
  if (found)
    for (int64_t i = 0; i < nmem; ++i) bf16_dim_order(mem[i].acc, nh * G, W);
  return found;
}
#endif

// A work item: sequences order[first .. first + count) (count > 1 only for a chunk sharing
// its first ``shared`` tokens' blocks), KV heads [h0, h0 + nh).
struct DecodeItem {
  int64_t first, count, shared, h0, cost;
};

// Sequences whose tables begin with the same full blocks, chunked: sorted by their full
// blocks, a chunk grows along the order while the tokens it saves (common prefix times
// members but one) do not shrink, up to ``max_chunk`` members. The rest are items alone.
static std::vector<DecodeItem> plan_decode_items(const int32_t* tp, const int32_t* lp,
                                                 int64_t S, int64_t MB, int64_t BS,
                                                 int64_t max_chunk, std::vector<int64_t>& order) {
  std::vector<int64_t> full(S);  // whole blocks of each sequence (all of them shared if equal)
  for (int64_t s = 0; s < S; ++s) full[s] = std::min<int64_t>(MB, lp[s] / BS);
  order.resize(S);
  for (int64_t s = 0; s < S; ++s) order[s] = s;
  auto lcp = [&](int64_t a, int64_t b) {
    const int64_t n = std::min(full[a], full[b]);
    const int32_t* ta = tp + a * MB;
    const int32_t* tb = tp + b * MB;
    int64_t j = 0;
    while (j < n && ta[j] == tb[j]) ++j;
    return j;
  };
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t j = lcp(a, b);
    const int64_t n = std::min(full[a], full[b]);
    if (j < n) return tp[a * MB + j] < tp[b * MB + j];
    return full[a] != full[b] ? full[a] < full[b] : a < b;
  });
  std::vector<DecodeItem> items;
  for (int64_t i = 0; i < S;) {
    int64_t n = 1, common = full[order[i]];
    while (i + n < S && n < max_chunk) {
      const int64_t c = std::min(common, lcp(order[i + n - 1], order[i + n]));
      if (c == 0 || c * n < common * (n - 1)) break;
      common = c;
      ++n;
    }
    const int64_t shared = n > 1 ? common * BS : 0;
    int64_t cost = shared;
    for (int64_t k = 0; k < n; ++k) cost += lp[order[i + k]] - shared;
    items.push_back({i, n, shared, 0, cost});
    i += n;
  }
  return items;
}

// q: [S, Hq, D]; kv: [NB, L, 2, BS, Hkv, D] (contiguous); tables: [S, MB] int32;
// lens: [S] int32; out: [S, Hq, D] (q's dtype). k/v scales: [1] or [Hkv] float32 (fp8 only).
template <typename QT, typename KT>
static void decode_impl(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        const float* ks, const float* vs, int64_t n_scale, at::Tensor& out) {
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t L = kv.size(1), BS = kv.size(3), Hkv = kv.size(4);
  const int64_t G = Hq / Hkv, MB = tables.size(1);
  const int64_t s_tok = Hkv * D, s_kv = BS * s_tok, s_layer = 2 * s_kv, s_block = L * s_layer;
  const QT* qp = q.data_ptr<QT>();
  const KT* kvp = kv.data_ptr<KT>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  QT* op = out.data_ptr<QT>();
  const float sc = static_cast<float>(scale);
  const WalkGeometry geo{BS, s_tok, s_kv, s_block, layer * s_layer};
  // Work items. A sequence's heads go together (one walk over its blocks, each group fetched
  // ahead of its turn) unless there are too few sequences to keep every thread busy; then each
  // head is an item of its own. Sequences sharing leading blocks go in chunks (see walk_item)
  // small enough to leave every thread two items or more, largest items first.
  const int64_t T = at::get_num_threads();
  const int64_t HC = S >= 2 * T ? Hkv : 1;
  std::vector<int64_t> order;
  std::vector<DecodeItem> items;
  if (HC == Hkv) {
    const int64_t max_chunk = std::clamp<int64_t>(S / (2 * T), 1, 16);
    items = plan_decode_items(tp, lp, S, MB, BS, max_chunk, order);
    std::stable_sort(items.begin(), items.end(),
                     [](const DecodeItem& a, const DecodeItem& b) { return a.cost > b.cost; });
  } else {
    for (int64_t s = 0; s < S; ++s) {
      order.push_back(s);
      for (int64_t h0 = 0; h0 < Hkv; ++h0) items.push_back({s, 1, 0, h0, lp[s]});
    }
  }
  int64_t max_count = 1;
  for (const DecodeItem& it : items) max_count = std::max(max_count, it.count);
  const int64_t per = HC * G * D;  // a member's query / accumulator floats
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(T, n_items), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(max_count * per), acc(max_count * per), m(max_count * HC * G),
        l(max_count * HC * G), vsc(HC), sbuf(G * std::max<int64_t>(BS, 16)), row(D);
    std::vector<Member> mem(max_count);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    std::vector<__m512i> prep;  // a shared group prepared for every member (bf16_prepare)
#endif
    // whole rows (every head of a sequence in one item): the next group fetched ahead
    const bool ahead = HC == Hkv;
    for (int64_t ii; (ii = next.fetch_add(1)) < n_items;) {
      const DecodeItem& it = items[ii];
      const int64_t h0 = it.h0 * HC, nmem = it.count;
      std::fill(m.begin(), m.begin() + nmem * HC * G, -INFINITY);
      std::fill(l.begin(), l.begin() + nmem * HC * G, 0.f);
      std::fill(acc.begin(), acc.begin() + nmem * per, 0.f);
      bool fits = true;  // every member's blocks in its table (always, for the engine's)
      for (int64_t k = 0; k < nmem; ++k) {
        const int64_t s = order[it.first + k];
        mem[k] = {nullptr, tp + s * MB, lp[s], acc.data() + k * per, m.data() + k * HC * G,
                  l.data() + k * HC * G};
        fits = fits && (lp[s] + BS - 1) / BS <= MB;
      }
      bool done = false;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<QT, at::BFloat16> && std::is_same_v<KT, at::BFloat16>) {
        if (D % 32 == 0 && (BS % 16 == 0 || BS < 16) && fits && !ks) {
          for (int64_t k = 0; k < nmem; ++k)
            mem[k].q = qp + (order[it.first + k] * Hq + h0 * G) * D;
          done = bf16_item_dispatch(D / 32, G, kvp, geo, mem.data(), nmem, it.shared, h0, HC,
                                    sc, ahead, prep);
        }
      }
#endif
      // the other kernels read the queries in fp32, scaled (and by the fp8 K scale)
      for (int64_t hh = 0; hh < HC && !done; ++hh) {
        const int64_t h = h0 + hh;
        const float kscale = ks ? ks[n_scale == 1 ? 0 : h] : 1.f;
        vsc[hh] = vs ? vs[n_scale == 1 ? 0 : h] : 1.f;
        for (int64_t k = 0; k < nmem; ++k) {
          const int64_t s = order[it.first + k];
          for (int64_t g = 0; g < G; ++g) {
            const QT* qh = qp + (s * Hq + h * G + g) * D;
            float* qg = qf.data() + k * per + (hh * G + g) * D;
            for (int64_t d = 0; d < D; ++d) qg[d] = to_f(qh[d]) * sc * kscale;
          }
          mem[k].q = qf.data() + k * per;
        }
      }
#ifdef __AVX512F__
      if constexpr (HasLoad16<KT>::value) {
        done = done || D % 16 == 0 && (BS % 16 == 0 || BS < 16) && fits &&
               f32_item_dispatch<KT>(D / 16, G, kvp, geo, mem.data(), nmem, it.shared, h0, HC,
                                     vsc.data(), sbuf.data(), ahead);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (HasLoad8<KT>::value) {
        done = done || D % 8 == 0 && (BS % 16 == 0 || BS < 16) && fits &&
               f32_item_dispatch_avx2<KT>(D / 8, G, kvp, geo, mem.data(), nmem, it.shared, h0,
                                          HC, vsc.data(), sbuf.data(), ahead);
      }
#endif
      for (int64_t k = 0; k < nmem && !done; ++k) {  // portable: each member over its blocks
        const int64_t s = order[it.first + k];
        const int64_t len = lp[s];
        const int64_t nb = (len + BS - 1) / BS;
        for (int64_t hh = 0; hh < HC; ++hh) {
          const int64_t h = h0 + hh;
          const float vscale = vsc[hh];
          const float* qh = qf.data() + k * per + hh * G * D;
          float* ah = mem[k].acc + hh * G * D;
          float* mh = mem[k].m + hh * G;
          float* lh = mem[k].l + hh * G;
          for (int64_t j = 0; j < nb && j < MB; ++j) {
            const int64_t blk = tp[s * MB + j];
            const int64_t ntok = std::min<int64_t>(BS, len - j * BS);
            const KT* kb = kvp + blk * s_block + layer * s_layer + h * D;
            const KT* vb = kb + s_kv;
            // scores: each K row is converted once and dotted with the G query heads
            for (int64_t t = 0; t < ntok; ++t) {
              const KT* kt = kb + t * s_tok;
              #pragma omp simd
              for (int64_t d = 0; d < D; ++d) row[d] = to_f(kt[d]);
              for (int64_t g = 0; g < G; ++g) {
                const float* qg = qh + g * D;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
                sbuf[g * BS + t] = dot;
              }
            }
            // online softmax update per query head
            for (int64_t g = 0; g < G; ++g) {
              float* sg = sbuf.data() + g * BS;
              float bmax = -INFINITY;
              for (int64_t t = 0; t < ntok; ++t) bmax = std::max(bmax, sg[t]);
              const float mnew = std::max(mh[g], bmax);
              const float corr = std::exp(mh[g] - mnew);
              float lsum = 0.f;
              #pragma omp simd reduction(+:lsum)
              for (int64_t t = 0; t < ntok; ++t) { sg[t] = std::exp(sg[t] - mnew); lsum += sg[t]; }
              float* ag = ah + g * D;
              #pragma omp simd
              for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
              lh[g] = lh[g] * corr + lsum;
              mh[g] = mnew;
            }
            // values: each V row converted once, accumulated into every head of the group
            for (int64_t t = 0; t < ntok; ++t) {
              const KT* vt = vb + t * s_tok;
              #pragma omp simd
              for (int64_t d = 0; d < D; ++d) row[d] = to_f(vt[d]) * vscale;
              for (int64_t g = 0; g < G; ++g) {
                const float p = sbuf[g * BS + t];
                float* ag = ah + g * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
              }
            }
          }
        }
      }
      for (int64_t k = 0; k < nmem; ++k) {
        const int64_t s = order[it.first + k];
        for (int64_t hh = 0; hh < HC; ++hh)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t i = hh * G + g;
            QT* oh = op + (s * Hq + (h0 + hh) * G + g) * D;
            const float li = mem[k].l[i];
            const float inv = li > 0.f ? 1.f / li : 0.f;
            for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<QT>(mem[k].acc[i * D + d] * inv);
          }
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                        const at::Tensor& tables, const at::Tensor& lens, double scale,
                        const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "q must be [S,Hq,D] and kv [NB,L,2,BS,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "q and kv must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "block tables and seq lens must be int32");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous(), "tables/lens must be contiguous");
  TORCH_CHECK(q.size(2) == kv.size(5) && q.size(1) % kv.size(4) == 0, "head geometry mismatch");
  const int64_t S = q.size(0), NB = kv.size(0), L = kv.size(1), BS = kv.size(3);
  TORCH_CHECK(layer >= 0 && layer < L, "layer ", layer, " out of range [0, ", L, ")");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == S && lens.dim() == 1 && lens.size(0) == S,
              "block tables must be [S, max_blocks] and seq lens [S] for S = ", S, " queries");
  // index values: O(table entries used) integer reads, each sequence's used entries only
  {
    const int32_t* tp = tables.data_ptr<int32_t>();
    const int32_t* lp = lens.data_ptr<int32_t>();
    const int64_t MB = tables.size(1);
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(lp[s] >= 0 && lp[s] <= MB * BS, "seq len ", lp[s], " of sequence ", s,
                  " out of range [0, ", MB * BS, "] (max_blocks x block size)");
      for (int64_t j = 0; j < (lp[s] + BS - 1) / BS; ++j)
        TORCH_CHECK(tp[s * MB + j] >= 0 && tp[s * MB + j] < NB,
                    "block id out of range in sequence ", s, ": ", tp[s * MB + j], " not in [0, ",
                    NB, ")");
    }
  }
  auto out = at::empty_like(q);
  const float* ks = nullptr; const float* vs = nullptr; int64_t n_scale = 1;
  if (kv.scalar_type() == at::kFloat8_e4m3fn) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "fp8 KV needs k_scale and v_scale");
    const int64_t Hkv = kv.size(4);
    for (const at::Tensor* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous() &&
                      (t->numel() == 1 || t->numel() == Hkv),
                  "k_scale/v_scale must be contiguous float32 CPU tensors of 1 or ", Hkv,
                  " (num_kv_heads) elements");
    TORCH_CHECK(k_scale->numel() == v_scale->numel(),
                "k_scale and v_scale must both be per-tensor or both per-head");
    ks = k_scale->data_ptr<float>(); vs = v_scale->data_ptr<float>(); n_scale = k_scale->numel();
  }
#define DISPATCH_KV(QT)                                                                     \
  switch (kv.scalar_type()) {                                                              \
    case at::kFloat: decode_impl<QT, float>(q, kv, layer, tables, lens, scale, ks, vs, n_scale, out); break; \
    case at::kBFloat16: decode_impl<QT, at::BFloat16>(q, kv, layer, tables, lens, scale, ks, vs, n_scale, out); break; \
    case at::kHalf: decode_impl<QT, at::Half>(q, kv, layer, tables, lens, scale, ks, vs, n_scale, out); break; \
    case at::kFloat8_e4m3fn: decode_impl<QT, c10::Float8_e4m3fn>(q, kv, layer, tables, lens, scale, ks, vs, n_scale, out); break; \
    default: TORCH_CHECK(false, "unsupported KV dtype ", kv.scalar_type());                 \
  }
  switch (q.scalar_type()) {
    case at::kFloat: DISPATCH_KV(float); break;
    case at::kBFloat16: DISPATCH_KV(at::BFloat16); break;
    case at::kHalf: DISPATCH_KV(at::Half); break;
    default: TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
  return out;
}

// y[M, N] = x[M, K] @ w[N, K]^T for bf16 x and w with few rows (decode steps: the LM head and
// the layers' projections at small batch), fp32 accumulation, bf16 output rounded to nearest
// even like torch's. AVX512-BF16 dot products of 32 pairs per instruction; 16 weight rows at a
// time (8 KB for K = 256, kept in L1 while every x row passes over them), their 16 partial-sum
// vectors reduced together by hsum16. K a multiple of 32, N a multiple of 16.
static bool bf16_gemm_supported() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M,K] and w [N,K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16 takes bf16 tensors");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "K must be a multiple of 32 and N of 16");
  auto y = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t KC = K / 32;
  at::parallel_for(0, N / 16, 8, [&](int64_t b0, int64_t b1) {
    alignas(64) float out[16];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint16_t* wb = wp + nb * 16 * K;
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = xp + m * K;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t kc = 0; kc < KC; ++kc) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + kc * 32);
          for (int j = 0; j < 16; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv,
                                      (__m512bh)_mm512_loadu_si512(wb + j * K + kc * 32));
        }
        _mm512_store_ps(out, hsum16(acc));
        at::BFloat16* yr = yp + m * N + nb * 16;
        for (int j = 0; j < 16; ++j) yr[j] = at::BFloat16(out[j]);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_bf16 needs AVX512-BF16");
#endif
}

// The same product on a CPU with AVX2 and FMA but no bf16 dot products (Zen 2/3, Haswell to
// Cascade Lake): a bf16 value is the top half of an fp32 one, so eight weights become eight
// floats by a widening load and a 16-bit shift, then fp32 FMAs. x is widened once per call
// (fp32 [M, K]); 4 weight rows at a time (2 KB for K = 256, in L1 while the x rows pass over
// them), 2 x rows per pass: 8 accumulators of 8 partial sums, reduced 4 at a time by
// hsum4_avx2. fp32 accumulation, bf16 output rounded to nearest even like torch's. K a
// multiple of 8; any M and N.
static bool avx2_gemm_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 bf16x8_f32(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// x rounded to bf16 precision (to nearest, ties to even), kept in fp32; x finite.
static inline __m256i rnd_bf16_bits_avx2(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
}

// Eight fp32 lanes as bf16, rounded as at::BFloat16 rounds (to nearest, ties to even; a NaN
// becomes 0x7FC0).
static inline __m128i f32x8_bf16_avx2(__m256 x) {
  __m256i r = _mm256_srli_epi32(rnd_bf16_bits_avx2(x), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // packus works within 128-bit lanes: [0-3 0-3 | 4-7 4-7]; quadwords 0 and 2 in order
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// y[m * ldy + j] = bf16(t[j * ldt + m]) for j < nn, m < mm: a tile of fp32 sums kept one
// weight row per row, written out as rows of y, 8 x 8 blocks transposed in registers. Reads
// whole blocks: t must hold nn rounded up to 8 rows of mm rounded up to 8 values (any value
// past nn / mm is read, never written).
static void tile_to_bf16_avx2(const float* t, int64_t ldt, int64_t nn, int64_t mm,
                              at::BFloat16* y, int64_t ldy) {
  uint16_t* yb = reinterpret_cast<uint16_t*>(y);
  for (int64_t j0 = 0; j0 < nn; j0 += 8)
    for (int64_t m0 = 0; m0 < mm; m0 += 8) {
      __m256 r[8], s[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(t + (j0 + i) * ldt + m0);
      for (int i = 0; i < 8; i += 2) {
        s[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        s[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(s[i], s[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(s[i], s[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(s[i + 1], s[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(s[i + 1], s[i + 3], 0xEE);
      }
      __m128i o[8];  // o[m]: bf16 of rows j0..j0+7 at column m0 + m
      for (int i = 0; i < 4; ++i) {
        o[i] = f32x8_bf16_avx2(_mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        o[i + 4] = f32x8_bf16_avx2(_mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
      const int64_t jn = std::min<int64_t>(8, nn - j0), mn = std::min<int64_t>(8, mm - m0);
      if (jn == 8) {
        for (int64_t i = 0; i < mn; ++i)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(yb + (m0 + i) * ldy + j0), o[i]);
      } else {
        alignas(16) uint16_t part[8];
        for (int64_t i = 0; i < mn; ++i) {
          _mm_store_si128(reinterpret_cast<__m128i*>(part), o[i]);
          std::memcpy(yb + (m0 + i) * ldy + j0, part, jn * sizeof(uint16_t));
        }
      }
    }
}

// [sum(a), sum(b), sum(c), sum(d)] of four 8-lane vectors
static inline __m128 hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// An outer-product block: R rows of a (fp32, row stride lda; R <= 6) times a k-major panel of
// 16 columns (b[k * 16 + j]) into c (fp32, R x 16, row stride ldc): per k two panel loads, R
// broadcasts and 2R FMAs into 2R accumulators that stay in registers for the whole K block;
// c starts at zero on the first K block and is read back on the next ones.
template <int R>
static inline void outer_avx2(const float* a, int64_t lda, const float* b, int64_t kc, float* c,
                              int64_t ldc, bool first) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * 16), b1 = _mm256_loadu_ps(b + k * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(v, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(v, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

static void outer_avx2_rows(int64_t rows, const float* a, int64_t lda, const float* b,
                            int64_t kc, float* c, int64_t ldc, bool first) {
  switch (rows) {
    case 6: outer_avx2<6>(a, lda, b, kc, c, ldc, first); break;
    case 5: outer_avx2<5>(a, lda, b, kc, c, ldc, first); break;
    case 4: outer_avx2<4>(a, lda, b, kc, c, ldc, first); break;
    case 3: outer_avx2<3>(a, lda, b, kc, c, ldc, first); break;
    case 2: outer_avx2<2>(a, lda, b, kc, c, ldc, first); break;
    default: outer_avx2<1>(a, lda, b, kc, c, ldc, first); break;
  }
}

// An integer setting of the AVX2 linear kernel from the environment, or dflt where unset
// (atoll; kernels/cpu_linear.py refuses a malformed value at start-up).
static int64_t avx2_env_rows(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}

// From how many rows of x linear_bf16_avx2 takes the blocked path (PDSERVE_AVX2_BLOCKED_ROWS,
// read once; default 16).
static int64_t avx2_blocked_rows() {
  static const int64_t rows = avx2_env_rows("PDSERVE_AVX2_BLOCKED_ROWS", 16);
  return rows;
}

// How many weight rows ahead linear_bf16_avx2's few-row path asks for its weights where they
// are short (K <= 1,024) (PDSERVE_AVX2_PREFETCH_ROWS, read once; default 8, two blocks of 4;
// 0: no software prefetch).
static int64_t avx2_prefetch_rows() {
  static const int64_t rows = std::max<int64_t>(0, avx2_env_rows("PDSERVE_AVX2_PREFETCH_ROWS", 8));
  return rows;
}

// Up to how many bytes of widened x panels linear_avx2_blocked takes the whole K per weight
// row group (see there): PDSERVE_AVX2_WHOLE_K_BYTES, read once; 0: never. Default a quarter
// of the L3 the OS reports, within 1-8 MB (a VM may report the whole socket's L3). Measured
// on a Zen 3 core with 32 MB of L3: 11.5 MB of panels still 0.91x the K blocks' time, 17 MB
// 1.05x, 23 MB 1.49x.
static int64_t avx2_whole_k_bytes() {
  static const int64_t bytes = [] {
    int64_t dflt = 4 << 20;
#ifdef _SC_LEVEL3_CACHE_SIZE
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) dflt = std::clamp<int64_t>(l3 / 4, 1 << 20, 8 << 20);
#endif
    return avx2_env_rows("PDSERVE_AVX2_WHOLE_K_BYTES", dflt);
  }();
  return bytes;
}

// The product for many rows of x, computed transposed (y^T = w x^T) so that both operands are
// laid out once and no horizontal sums remain: x is widened into k-major panels of 16 rows
// (xT[p][k][16], rows past M zero) once per call; each task (64 weight rows) widens a K block
// of 256 of its rows to fp32 as they are (64 KB, in L2) and meets every panel of the chunk
// (96 rows of x; a panel is 16 KB, in L1) 6 weight rows at a time (outer_avx2). Partial sums
// wait in an fp32 tile (64 x 96) until the last K block rounds them to bf16, once.
static void linear_avx2_blocked(const uint16_t* xp, const uint16_t* wp, at::BFloat16* yp,
                                int64_t M, int64_t N, int64_t K) {
  constexpr int64_t NT = 64, MC = 96, KC = 256;
  const int64_t MP = (M + 15) / 16;
  // every element is written below, each panel by the thread that fills it (no serial
  // zero-fill of the whole buffer first: only the last panel's rows past M are zeros)
  std::unique_ptr<float[]> xt(new float[static_cast<size_t>(MP * K * 16)]);
  at::parallel_for(0, MP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < 16; ++i) {
        float* dst = xt.get() + p * K * 16 + i;
        if (p * 16 + i >= M) {
          for (int64_t k = 0; k < K; ++k) dst[k * 16] = 0.f;
          continue;
        }
        const uint16_t* src = xp + (p * 16 + i) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * 16] = c10::detail::f32_from_bits(src[k]);
      }
  });
  if (K > KC && MP * K * 16 * static_cast<int64_t>(sizeof(float)) <= avx2_whole_k_bytes()) {
    // Rows of x whose panels fit in cache (avx2_whole_k_bytes: up to 8 MB, decode at any batch
    // and prefill chunks of up to 2,048 tokens at hidden 1,024) and K above one block of 256:
    // each task widens 6 weight rows over the whole K at a time (24 KB at K = 1,024, in L1)
    // right before they meet every panel, and the products run over the whole K in registers.
    // Widening a K block of 64 rows at a time (below) reads the weights in 512-byte runs
    // between the FMA phases: at 16 rows of a 1,024-wide model that path ran at 55 GFLOP/s of
    // the FMAs' ~90, this one at 66. Same order of summation either way (a K block resumes
    // from the stored partial sum), so the same bits.
    const int64_t ldt = MP * 16;
    at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> wf(static_cast<size_t>(6 * K));
      std::vector<float> tile(static_cast<size_t>(NT * ldt));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * NT, nn = std::min(NT, N - n0);
        for (int64_t j = 0; j < nn; j += 6) {
          const int64_t r = std::min<int64_t>(6, nn - j);
          for (int64_t i = 0; i < r; ++i) {
            const uint16_t* src = wp + (n0 + j + i) * K;
            float* dst = wf.data() + i * K;
            for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(dst + k, bf16x8_f32(src + k));
          }
          for (int64_t p = 0; p < MP; ++p)
            outer_avx2_rows(r, wf.data(), K, xt.get() + p * K * 16, K, tile.data() + j * ldt + p * 16,
                            ldt, true);
        }
        tile_to_bf16_avx2(tile.data(), ldt, nn, M, yp + n0, N);
      }
    });
    return;
  }
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> wf(static_cast<size_t>(NT * KC));
    std::vector<float> tile(static_cast<size_t>(NT * MC));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, nn = std::min(NT, N - n0);
      for (int64_t mc = 0; mc < M; mc += MC) {
        const int64_t mm = std::min(MC, M - mc);
        for (int64_t kc = 0; kc < K; kc += KC) {
          const int64_t kk = std::min(KC, K - kc);
          for (int64_t j = 0; j < nn; ++j) {
            const uint16_t* src = wp + (n0 + j) * K + kc;
            float* dst = wf.data() + j * KC;
            for (int64_t k = 0; k < kk; k += 8) _mm256_storeu_ps(dst + k, bf16x8_f32(src + k));
          }
          for (int64_t p = 0; p * 16 < mm; ++p) {
            const float* panel = xt.get() + ((mc / 16) + p) * K * 16 + kc * 16;
            for (int64_t j = 0; j < nn; j += 6)
              outer_avx2_rows(std::min<int64_t>(6, nn - j), wf.data() + j * KC, KC, panel, kk,
                              tile.data() + j * MC + p * 16, MC, kc == 0);
          }
        }
        tile_to_bf16_avx2(tile.data(), MC, nn, mm, yp + mc * N + n0, N);
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// One row of x (fp32) against four weight rows (bf16): the four dot products into o, each
// summed in 8 lanes along k, then hsum4_avx2. Its own function, as dot_x4_w2_avx2.
__attribute__((noinline)) static void dot_x1_w4_avx2(const float* x0, int64_t K,
                                                     const uint16_t* w0, const uint16_t* w1,
                                                     const uint16_t* w2, const uint16_t* w3,
                                                     float* o) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 u = _mm256_loadu_ps(x0 + k);
    a0 = _mm256_fmadd_ps(u, bf16x8_f32(w0 + k), a0);
    a1 = _mm256_fmadd_ps(u, bf16x8_f32(w1 + k), a1);
    a2 = _mm256_fmadd_ps(u, bf16x8_f32(w2 + k), a2);
    a3 = _mm256_fmadd_ps(u, bf16x8_f32(w3 + k), a3);
  }
  _mm_store_ps(o, hsum4_avx2(a0, a1, a2, a3));
}

// Rows 0-3 of x (fp32, row stride K) against the weight rows wa and wb (bf16): the eight dot
// products into o as [x row 0: a, b, row 1: a, b, row 2: ..., row 3: ...]. Each weight
// vector is widened once for four rows of x (the widening takes the vector pipes the FMAs
// need); each product is summed in the same order as linear_bf16_avx2's 2-row and 1-row
// blocks (8 lanes along k, then hsum4_avx2), so the same bits. Not inlined: inlined, it
// slowed the one-row block of the same loop by 4-11 % (code placement).
__attribute__((noinline)) static void dot_x4_w2_avx2(const float* x0, int64_t K,
                                                     const uint16_t* wa, const uint16_t* wb,
                                                     float* o) {
  const float* x1 = x0 + K;
  const float* x2 = x1 + K;
  const float* x3 = x2 + K;
  __m256 a0a = _mm256_setzero_ps(), a0b = a0a, a1a = a0a, a1b = a0a;
  __m256 a2a = a0a, a2b = a0a, a3a = a0a, a3b = a0a;
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 u0 = _mm256_loadu_ps(x0 + k), u1 = _mm256_loadu_ps(x1 + k);
    const __m256 u2 = _mm256_loadu_ps(x2 + k), u3 = _mm256_loadu_ps(x3 + k);
    __m256 f = bf16x8_f32(wa + k);
    a0a = _mm256_fmadd_ps(u0, f, a0a); a1a = _mm256_fmadd_ps(u1, f, a1a);
    a2a = _mm256_fmadd_ps(u2, f, a2a); a3a = _mm256_fmadd_ps(u3, f, a3a);
    f = bf16x8_f32(wb + k);
    a0b = _mm256_fmadd_ps(u0, f, a0b); a1b = _mm256_fmadd_ps(u1, f, a1b);
    a2b = _mm256_fmadd_ps(u2, f, a2b); a3b = _mm256_fmadd_ps(u3, f, a3b);
  }
  _mm256_store_ps(o, _mm256_set_m128(hsum4_avx2(a2a, a2b, a3a, a3b),
                                     hsum4_avx2(a0a, a0b, a1a, a1b)));
}
#endif

at::Tensor linear_bf16_avx2(const at::Tensor& x, const at::Tensor& w) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M,K] and w [N,K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16_avx2 takes bf16 tensors");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "K must be a multiple of 8");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (M >= avx2_blocked_rows()) {
    linear_avx2_blocked(xp, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                        y.data_ptr<at::BFloat16>(), M, N, K);
    return y;
  }
  // x widened to fp32 once: every weight block reads it again
  std::vector<float> xf(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M * K; i += 8) _mm256_storeu_ps(xf.data() + i, bf16x8_f32(xp + i));
  const float* xfp = xf.data();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // blocks of 4 weight rows, 16 blocks (64 rows) a task; within a task x passes in chunks of
  // 32 rows (32 KB of fp32 at K = 256, in L1) over the task's weight rows (in L2). Each
  // block asks for the 4 weight rows avx2_prefetch_rows() on (the block two on) as it starts:
  // at these row counts the weights stream from memory once, and one core's hardware prefetch
  // alone kept too few lines in flight (an LM head of 32,000 x 256 at one row: 8 -> 16 GB/s on
  // a Zen 3 EPYC whose one-core read bandwidth is ~20). Rows of short weight rows only (K up
  // to 1,024: 2 KB): on longer ones the hardware prefetcher does better alone (one row of x,
  // K = 2,048: 14-17 -> 16-19 GB/s without it; K = 5,632: 20-24 -> 27-29), so they get none.
  const int64_t NB = (N + 3) / 4, MC = 32;
  const int64_t ahead = K <= 1024 ? avx2_prefetch_rows() : 0;
  const char* wend = reinterpret_cast<const char*>(wp + N * K);
  at::parallel_for(0, (NB + 15) / 16, 1, [&](int64_t t0, int64_t t1) {
    alignas(16) float o0[4], o1[4];
    for (int64_t t = t0; t < t1; ++t)
    for (int64_t mc = 0; mc < M; mc += MC)
    for (int64_t nb = t * 16; nb < std::min(NB, t * 16 + 16); ++nb) {
      const int64_t mend = std::min(M, mc + MC);
      const int64_t n0 = nb * 4, nr = std::min<int64_t>(4, N - n0);
      // a partial last block reads its last row again (its results are not written)
      const uint16_t* w0 = wp + n0 * K;
      const uint16_t* w1 = wp + (n0 + std::min<int64_t>(1, nr - 1)) * K;
      const uint16_t* w2 = wp + (n0 + std::min<int64_t>(2, nr - 1)) * K;
      const uint16_t* w3 = wp + (n0 + std::min<int64_t>(3, nr - 1)) * K;
      if (mc == 0 && ahead > 0 && n0 + ahead < N)
        for (const char* p = reinterpret_cast<const char*>(w0 + ahead * K),
                        *e = std::min(wend, p + 4 * K * sizeof(uint16_t));
             p < e; p += 64)
          _mm_prefetch(p, _MM_HINT_T0);
      int64_t m = mc;
      // four rows of x at a time against two weight rows, twice (dot_x4_w2_avx2)
      for (; m + 4 <= mend; m += 4) {
        alignas(32) float q[16];  // [pair of weight rows][row of x][weight row of the pair]
        dot_x4_w2_avx2(xfp + m * K, K, w0, w1, q);
        dot_x4_w2_avx2(xfp + m * K, K, w2, w3, q + 8);
        for (int64_t j = 0; j < nr; ++j)
          for (int64_t r = 0; r < 4; ++r)
            yp[(m + r) * N + n0 + j] = at::BFloat16(q[(j / 2) * 8 + r * 2 + j % 2]);
      }
      for (; m + 2 <= mend; m += 2) {
        const float* x0 = xfp + m * K;
        const float* x1 = x0 + K;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
          __m256 f = bf16x8_f32(w0 + k);
          a00 = _mm256_fmadd_ps(u, f, a00); a10 = _mm256_fmadd_ps(v, f, a10);
          f = bf16x8_f32(w1 + k);
          a01 = _mm256_fmadd_ps(u, f, a01); a11 = _mm256_fmadd_ps(v, f, a11);
          f = bf16x8_f32(w2 + k);
          a02 = _mm256_fmadd_ps(u, f, a02); a12 = _mm256_fmadd_ps(v, f, a12);
          f = bf16x8_f32(w3 + k);
          a03 = _mm256_fmadd_ps(u, f, a03); a13 = _mm256_fmadd_ps(v, f, a13);
        }
        _mm_store_ps(o0, hsum4_avx2(a00, a01, a02, a03));
        _mm_store_ps(o1, hsum4_avx2(a10, a11, a12, a13));
        for (int64_t j = 0; j < nr; ++j) {
          yp[m * N + n0 + j] = at::BFloat16(o0[j]);
          yp[(m + 1) * N + n0 + j] = at::BFloat16(o1[j]);
        }
      }
      if (m < mend) {
        dot_x1_w4_avx2(xfp + m * K, K, w0, w1, w2, w3, o0);
        for (int64_t j = 0; j < nr; ++j) yp[m * N + n0 + j] = at::BFloat16(o0[j]);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_bf16_avx2 needs AVX2 and FMA");
#endif
}

// Causal attention of prefill chunks, bf16, on AVX512-BF16 dot products (pf_tile), AMX tiles
// (pf_tile_amx) or, on a CPU with neither, AVX2 FMAs (pf_tile_avx2). Query row i of a
// chunk sees keys <= offset + i. K and V are repacked in units of 16 consecutive keys per KV
// head: K into 16-key x 2-dim pairs (one vdpbf16ps gives 16 keys' partial scores), V into
// 2-key x 16-dim pairs (one gives 16 output dims over 2 keys); keys past the context are zero.
// Scores and the online softmax in fp32, P rounded to bf16 for P @ V (as torch's flash SDPA
// does for bf16), one bf16 rounding of the output. Rows in tiles of 8 that share every K/V
// load; keys in chunks of 64 (4 units), one running-max update per chunk; chunks past a tile's
// last visible key are skipped. D a multiple of 32, at most 256. The arithmetic of a row does
// not depend on where its units came from, so the paged entry point (several sequences, units
// packed once from the block pool and shared by every sequence whose table holds the block)
// gives the same bits as the contiguous one on the gathered K/V.
static constexpr int PF_ROWS = 8, PF_KEYS = 64, PF_MAXD = 256, PF_UNIT = 16;
static constexpr int PF_QK_ROWS = 4;  // rows of a tile whose scores are computed together
// Which tile prefill_bf16 / paged_prefill_bf16 run (the Python side passes the code; a bool
// from older callers reads as 0 / 1).
enum PfIsa : int64_t { PF_AVX512 = 0, PF_AMX = 1, PF_AVX2 = 2 };

// One unit of one KV head: 16 * D uint32 (K: D/2 pairs x 16 keys, then V: 8 key pairs x D).
// Plain C++: every tile reads this layout.
static inline void pf_pack_unit(const uint16_t* const* krow, const uint16_t* const* vrow,
                                int64_t D, uint32_t* dst) {
  const int64_t P2 = D / 2;
  for (int t = 0; t < PF_UNIT; ++t) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(krow[t]);
    for (int64_t p = 0; p < P2; ++p) dst[p * 16 + t] = row ? row[p] : 0u;
  }
  uint32_t* vd = dst + 8 * D;
  for (int t2 = 0; t2 < PF_UNIT / 2; ++t2) {
    const uint16_t* ra = vrow[2 * t2];
    const uint16_t* rb = vrow[2 * t2 + 1];
    for (int64_t d = 0; d < D; ++d)
      vd[t2 * D + d] = (ra ? uint32_t(ra[d]) : 0u) | (rb ? uint32_t(rb[d]) << 16 : 0u);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// A tile's online-softmax step over a chunk of 64 keys (4 units of 16), in three parts so that
// the rows' running maxima and rescale factors come out for every row at once (vertical
// reductions and one vector 2^x) instead of row by row (a horizontal max and a scalar exp2 per
// row and chunk, which had been a sixth of the AMX tile's time). A row's running max m is kept
// in base-2 units (score * sc * log2 e), so that each probability is one fused
// multiply-subtract and a 2^x: exp(sc * s - M) = 2^(s * c - m) with c = sc * log2 e.
//
// pf_row_max: s[b] holds the raw scores of keys j0 + 16b ..; keys past lim (where edge says
// some may be) and units b >= nu are hidden. Returns the lane-wise max of the visible scores
// (-inf where none) and sets vis[b], the visible keys' masks.
static inline __m512 pf_row_max(const __m512* s, int nu, bool edge, int64_t j0, int64_t lim,
                                __mmask16* vis) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int b = 0; b < 4; ++b) {
    if (b >= nu) { vis[b] = 0; continue; }
    vis[b] = edge ? _mm512_cmple_epi32_mask(
                        _mm512_add_epi32(iota, _mm512_set1_epi32(int(j0 + 16 * b))),
                        _mm512_set1_epi32(int(lim)))
                  : __mmask16(0xFFFF);
    mx = _mm512_mask_max_ps(mx, vis[b], mx, s[b]);
  }
  return mx;
}

// pf_row_probs: one row's probabilities pr[b] (0 for hidden keys and units b >= nu) from its
// scores, masks and new max m; the lane-wise sum l becomes l * alpha + the chunk's.
static inline void pf_row_probs(const __m512* s, int nu, const __mmask16* vis, float c, float m,
                                float alpha, __m512& l, __m512* pr) {
  const __m512 mv = _mm512_set1_ps(m), cv = _mm512_set1_ps(c);
  __m512 psum = _mm512_setzero_ps();
  for (int b = 0; b < 4; ++b) {
    pr[b] = b < nu ? _mm512_maskz_mov_ps(vis[b], exp2_p4(_mm512_fmsub_ps(s[b], cv, mv)))
                   : _mm512_setzero_ps();
    psum = _mm512_add_ps(psum, pr[b]);
  }
  l = _mm512_fmadd_ps(l, _mm512_set1_ps(alpha), psum);
}

// Rows [r0, r0 + nr) of query head hq of one chunk. q / o point at the chunk's row 0;
// unit(u) is the packed unit u of this KV head (enough of them to cover every chunk of 64
// keys up to the last visible one).
template <typename UnitFn>
static inline void pf_tile(const uint16_t* qb, uint16_t* ob, int64_t Hq, int64_t D, int64_t hq,
                           int64_t r0, int64_t nr, int64_t offset, float sc, const UnitFn& unit) {
  const int64_t P2 = D / 2, C16 = D / 16;
  alignas(64) uint32_t pb[PF_ROWS][PF_KEYS / 2] = {};  // rows past nr stay 0
  __m512 acc[PF_ROWS][PF_MAXD / 16];
  __m512 sv[PF_ROWS][4];  // a chunk's scores, between the rows' max and their probabilities
  __m512 mx[16];
  __mmask16 vis[PF_ROWS][4];
  const uint32_t* qr[PF_ROWS];
  alignas(64) float m[16], alpha[16];
  __m512 l[PF_ROWS];
  const float csc = sc * 1.44269504089f;  // scores to base-2 units
  for (int i = 0; i < 16; ++i) {
    m[i] = i < nr ? -INFINITY : 0.f;
    mx[i] = _mm512_set1_ps(-INFINITY);
  }
  for (int i = 0; i < PF_ROWS; ++i) {
    qr[i] = reinterpret_cast<const uint32_t*>(qb + ((r0 + std::min<int64_t>(i, nr - 1)) * Hq + hq) * D);
    l[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C16; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  const int64_t last = offset + r0 + nr - 1;  // the tile's last visible key
  for (int64_t ch = 0; ch * PF_KEYS <= last; ++ch) {
    const int64_t j0 = ch * PF_KEYS;
    const bool edge = j0 + PF_KEYS - 1 > offset + r0;  // some key of it hidden from row 0
    const uint32_t* ku[4];
    for (int b = 0; b < 4; ++b) ku[b] = unit(j0 / PF_UNIT + b);
    // S = Q K^T four rows at a time: each dim pair's four K vectors are loaded once for the
    // four rows, and the 16 accumulators are independent chains (one row's four alone left
    // the dot products waiting on each other's latency). Each score's sum runs over the dim
    // pairs in the same order as row by row: the same bits. Rows past nr repeat row nr - 1
    // (qr) and are not used.
    for (int i0 = 0; i0 < nr; i0 += PF_QK_ROWS) {
      __m512 s[PF_QK_ROWS][4];
      for (int i = 0; i < PF_QK_ROWS; ++i)
        for (int b = 0; b < 4; ++b) s[i][b] = _mm512_setzero_ps();
      for (int64_t p = 0; p < P2; ++p) {
        __m512bh kv[4];
        for (int b = 0; b < 4; ++b) kv[b] = (__m512bh)_mm512_loadu_si512(ku[b] + p * 16);
        for (int i = 0; i < PF_QK_ROWS; ++i) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(qr[i0 + i][p]));
          for (int b = 0; b < 4; ++b) s[i][b] = _mm512_dpbf16_ps(s[i][b], qv, kv[b]);
        }
      }
      for (int i = 0; i < PF_QK_ROWS && i0 + i < nr; ++i) {
        for (int b = 0; b < 4; ++b) sv[i0 + i][b] = s[i][b];
        mx[i0 + i] = pf_row_max(sv[i0 + i], 4, edge, j0, offset + r0 + i0 + i, vis[i0 + i]);
      }
    }
    rows_new_max(mx, csc, m, alpha);
    for (int i = 0; i < nr; ++i) {
      __m512 pr[4];
      pf_row_probs(sv[i], 4, vis[i], csc, m[i], alpha[i], l[i], pr);
      // P as bf16 pairs: lane j of cvtne2ps(b, a) is a[j] for j < 16, b[j - 16] above
      _mm512_store_si512(pb[i], (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
      _mm512_store_si512(pb[i] + 16, (__m512i)_mm512_cvtne2ps_pbh(pr[3], pr[2]));
    }
    // O = O * alpha + P V, 32 output dims of all 8 rows at a time in registers over the
    // chunk's key pairs (the accumulators stay out of memory between dot products), each
    // accumulator's sum in key order as before: the same bits. Rows past nr compute on zeros
    // (pb) and are not written out.
    const int64_t nt2 = std::min<int64_t>(PF_KEYS / 2, (last - j0) / 2 + 1);
    for (int64_t c0 = 0; c0 < C16; c0 += 2) {
      __m512 a[PF_ROWS][2];
      for (int i = 0; i < PF_ROWS; ++i) {
        const __m512 av = _mm512_set1_ps(alpha[i]);
        a[i][0] = _mm512_mul_ps(acc[i][c0], av);
        a[i][1] = _mm512_mul_ps(acc[i][c0 + 1], av);
      }
      for (int64_t t2 = 0; t2 < nt2; ++t2) {
        const uint32_t* vrow = ku[t2 / 8] + 8 * D + (t2 % 8) * D + c0 * 16;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vrow);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vrow + 16);
        for (int i = 0; i < PF_ROWS; ++i) {
          const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pb[i][t2]));
          a[i][0] = _mm512_dpbf16_ps(a[i][0], pv, v0);
          a[i][1] = _mm512_dpbf16_ps(a[i][1], pv, v1);
        }
      }
      for (int i = 0; i < PF_ROWS; ++i) {
        acc[i][c0] = a[i][0];
        acc[i][c0 + 1] = a[i][1];
      }
    }
  }
  for (int i = 0; i < nr; ++i) {
    const float inv = 1.f / _mm512_reduce_add_ps(l[i]);
    uint16_t* orow = ob + ((r0 + i) * Hq + hq) * D;
    for (int64_t c = 0; c < C16; ++c) {
      const __m256bh o16 = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c * 16), (__m256i)o16);
    }
  }
}
#endif

// The same tile on AVX2 + FMA, for CPUs without bf16 dot products (built wherever the compiler
// targets AVX2 and FMA, so AVX-512 hosts test it too). It reads pf_pack_unit's layout: a
// 32-bit word holds two bf16 values, and each is an fp32 by itself once moved to the word's
// top half (the low one: shift left 16) or its low half cleared (the high one: and
// 0xffff0000), one integer op each, no conversion. Scores in fp32 from products of bf16 values
// (exact in fp32, so only the order of the sums differs from the AVX-512 tile), the online
// softmax in base 2 as pf_tile's, P rounded to bf16 (to nearest even) for P V, O in fp32 in a
// buffer between chunks, one rounding of the output. Each K or V load serves four rows (eight
// FMAs), with 8 accumulators, 4 widened vectors and 2 broadcasts in the 16 registers.
#if defined(__AVX2__) && defined(__FMA__)
#define PF_HAVE_AVX2 1

// 2^x for 8 lanes, x <= 0: exp2_p4's reduction and polynomial, 2^n put in the exponent bits.
static inline __m256 exp2_p4_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(9.6181291076e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504108665e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022650696e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718056e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 rnd_bf16_avx2(__m256 x) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(rnd_bf16_bits_avx2(x), _mm256_set1_epi32(int(0xFFFF0000u))));
}

// The lanes of the v-th vector of a score row whose keys are visible (vis keys are), all ones.
static inline __m256 pf_vis_mask(int64_t vis, int v) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(vis - 8 * v)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// The low / high bf16 of each 32-bit word of w as fp32 lanes.
static inline __m256 pf_lo(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 pf_hi(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}

template <typename UnitFn>
static inline void pf_tile_avx2(const uint16_t* qb, uint16_t* ob, int64_t Hq, int64_t D,
                                int64_t hq, int64_t r0, int64_t nr, int64_t offset, float sc,
                                const UnitFn& unit) {
  const int64_t P2 = D / 2;
  alignas(32) float qf[PF_ROWS][PF_MAXD];  // the rows' queries in fp32
  alignas(32) float acc[PF_ROWS][PF_MAXD];  // O, unnormalised
  alignas(32) float sp[PF_ROWS][PF_KEYS];  // a chunk's scores, then its probabilities
  alignas(32) float m[PF_ROWS], alpha[PF_ROWS];
  float l[PF_ROWS];
  const float csc = sc * 1.44269504089f;  // scores to base-2 units
  const int ng = int((nr + PF_QK_ROWS - 1) / PF_QK_ROWS), nrows = ng * PF_QK_ROWS;
  for (int i = 0; i < PF_ROWS; ++i) m[i] = -1e30f;  // finite under -ffast-math: 2^(m - x) ~ 0
  // rows past nr repeat row nr - 1 (their results are not written out)
  for (int i = 0; i < nrows; ++i) {
    const uint16_t* qrow = qb + ((r0 + std::min<int64_t>(i, nr - 1)) * Hq + hq) * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(qf[i] + d, bf16x8_f32(qrow + d));
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(acc[i] + d, _mm256_setzero_ps());
    l[i] = 0.f;
  }
  const int64_t last = offset + r0 + nr - 1;  // the tile's last visible key
  for (int64_t ch = 0; ch * PF_KEYS <= last; ++ch) {
    const int64_t j0 = ch * PF_KEYS;
    const uint32_t* ku[4];
    for (int b = 0; b < 4; ++b) ku[b] = unit(j0 / PF_UNIT + b);
    const int nu = int(std::min<int64_t>(4, (last - j0) / PF_UNIT + 1));  // units with a visible key
    // S = Q K^T: four rows x one unit (16 keys) at a time, each K word vector widened once
    for (int g = 0; g < ng; ++g) {
      const float* q0 = qf[g * PF_QK_ROWS];
      for (int b = 0; b < nu; ++b) {
        __m256 s[PF_QK_ROWS][2];
        for (int i = 0; i < PF_QK_ROWS; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
        const uint32_t* kp = ku[b];
        for (int64_t p = 0; p < P2; ++p) {
          const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + p * 16));
          const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + p * 16 + 8));
          const __m256 e0 = pf_lo(w0), e1 = pf_lo(w1), o0 = pf_hi(w0), o1 = pf_hi(w1);
          for (int i = 0; i < PF_QK_ROWS; ++i) {
            const __m256 qe = _mm256_broadcast_ss(q0 + i * PF_MAXD + 2 * p);
            const __m256 qo = _mm256_broadcast_ss(q0 + i * PF_MAXD + 2 * p + 1);
            s[i][0] = _mm256_fmadd_ps(qe, e0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(qe, e1, s[i][1]);
            s[i][0] = _mm256_fmadd_ps(qo, o0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(qo, o1, s[i][1]);
          }
        }
        for (int i = 0; i < PF_QK_ROWS; ++i) {
          _mm256_store_ps(sp[g * PF_QK_ROWS + i] + b * 16, s[i][0]);
          _mm256_store_ps(sp[g * PF_QK_ROWS + i] + b * 16 + 8, s[i][1]);
        }
      }
    }
    // the online softmax in three passes, as pf_tile's: each row's max over its visible
    // scores (keys past the row's limit, or in units not computed, are hidden: only the last
    // vector a row reads can be partly so); every row's new running max and rescale factor at
    // once (one vector 2^x instead of a scalar exp2 per row); then each row's probabilities,
    // rounded to bf16 in place of its scores, 0 where hidden.
    alignas(32) float mxs[PF_ROWS];
    int nvs[PF_ROWS];
    int64_t vis[PF_ROWS];  // each row's visible keys in this chunk
    for (int i = 0; i < PF_ROWS; ++i) {
      vis[i] = offset + r0 + std::min<int64_t>(i, nr - 1) - j0 + 1;
      nvs[i] = i < nrows && vis[i] > 0 ? int(std::min<int64_t>(2 * nu, (vis[i] + 7) / 8)) : 0;
      mxs[i] = -1e30f;  // nothing visible: the running max stays
      if (nvs[i] == 0) continue;
      const float* row = sp[i];
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (int v = 0; v < nvs[i]; ++v) {
        __m256 sv = _mm256_load_ps(row + v * 8);
        if (vis[i] < 8 * (v + 1))
          sv = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv, pf_vis_mask(vis[i], v));
        mx = _mm256_max_ps(mx, sv);
      }
      mxs[i] = hmax8(mx) * csc;
    }
    {
      const __m256 mold = _mm256_load_ps(m), mnew = _mm256_max_ps(mold, _mm256_load_ps(mxs));
      // 2^-126 (exp2_p4_avx2's floor) on a row's first chunk, where its O and l are still 0
      _mm256_store_ps(alpha, exp2_p4_avx2(_mm256_sub_ps(mold, mnew)));
      _mm256_store_ps(m, mnew);
    }
    const __m256 cv = _mm256_set1_ps(csc);
    for (int i = 0; i < nrows; ++i) {
      float* row = sp[i];
      const __m256 mv = _mm256_set1_ps(m[i]);
      __m256 psum = _mm256_setzero_ps();
      for (int v = 0; v < PF_KEYS / 8; ++v) {
        __m256 pr = _mm256_setzero_ps();
        if (v < nvs[i]) {
          pr = exp2_p4_avx2(_mm256_fmsub_ps(_mm256_load_ps(row + v * 8), cv, mv));
          if (vis[i] < 8 * (v + 1)) pr = _mm256_and_ps(pr, pf_vis_mask(vis[i], v));
        }
        psum = _mm256_add_ps(psum, pr);
        _mm256_store_ps(row + v * 8, rnd_bf16_avx2(pr));
      }
      l[i] = l[i] * alpha[i] + hadd8(psum);
    }
    // O = O * alpha + P V: four rows x 16 output dims at a time over the chunk's key pairs,
    // each V word vector (two keys' values of 8 dims) widened once for the four rows
    const int64_t nt2 = std::min<int64_t>(PF_KEYS / 2, (last - j0) / 2 + 1);
    for (int g = 0; g < ng; ++g) {
      const int i0 = g * PF_QK_ROWS;
      for (int64_t c0 = 0; c0 < D; c0 += 16) {
        __m256 a[PF_QK_ROWS][2];
        for (int i = 0; i < PF_QK_ROWS; ++i) {
          const __m256 av = _mm256_set1_ps(alpha[i0 + i]);
          a[i][0] = _mm256_mul_ps(_mm256_load_ps(acc[i0 + i] + c0), av);
          a[i][1] = _mm256_mul_ps(_mm256_load_ps(acc[i0 + i] + c0 + 8), av);
        }
        for (int64_t t2 = 0; t2 < nt2; ++t2) {
          const uint32_t* vrow = ku[t2 / 8] + 8 * D + (t2 % 8) * D + c0;
          const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow));
          const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + 8));
          const __m256 e0 = pf_lo(w0), e1 = pf_lo(w1), o0 = pf_hi(w0), o1 = pf_hi(w1);
          for (int i = 0; i < PF_QK_ROWS; ++i) {
            const __m256 pe = _mm256_broadcast_ss(sp[i0 + i] + 2 * t2);
            const __m256 po = _mm256_broadcast_ss(sp[i0 + i] + 2 * t2 + 1);
            a[i][0] = _mm256_fmadd_ps(pe, e0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(pe, e1, a[i][1]);
            a[i][0] = _mm256_fmadd_ps(po, o0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(po, o1, a[i][1]);
          }
        }
        for (int i = 0; i < PF_QK_ROWS; ++i) {
          _mm256_store_ps(acc[i0 + i] + c0, a[i][0]);
          _mm256_store_ps(acc[i0 + i] + c0 + 8, a[i][1]);
        }
      }
    }
  }
  for (int i = 0; i < nr; ++i) {
    const __m256 inv = _mm256_set1_ps(1.f / l[i]);
    uint16_t* orow = ob + ((r0 + i) * Hq + hq) * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = _mm256_srli_epi32(
          rnd_bf16_bits_avx2(_mm256_mul_ps(_mm256_load_ps(acc[i] + d), inv)), 16);
      const __m256i hi = _mm256_srli_epi32(
          rnd_bf16_bits_avx2(_mm256_mul_ps(_mm256_load_ps(acc[i] + d + 8), inv)), 16);
      // packus works within 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7], put back in order
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + d), packed);
    }
  }
}
#endif

// The same tile on AMX (16 rows): S = Q K^T and O += P V as tile dot products (TDPBF16PS)
// on the packed units, which are already in the tiles' pair layout (a unit's K is the B tile
// of 16 keys for each 32-dim slice of the head, its V the B tile of 16 keys for each 16 output
// dims); scores, the online softmax and the bf16 rounding of P as in pf_tile, on AVX-512 over
// the stored score tile, with O kept in fp32 in memory between steps. Only on CPUs with AMX
// (built with -march=native there, and the kernel asks Linux for the tile state first).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PF_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
static constexpr int PF_AMX_ROWS = 16;

template <typename UnitFn>
static inline void pf_tile_amx(const uint16_t* qb, uint16_t* ob, int64_t Hq, int64_t D,
                               int64_t hq, int64_t r0, int64_t nr, int64_t offset, float sc,
                               const UnitFn& unit) {
  const int64_t C16 = D / 16;
  static_assert(PF_KEYS == 64, "amx_scores / amx_pv take rows of 64 keys");
  alignas(64) uint16_t qs[PF_AMX_ROWS * PF_MAXD];
  alignas(64) float sm[PF_AMX_ROWS * PF_KEYS];
  alignas(64) uint16_t pm[PF_AMX_ROWS * PF_KEYS];
  alignas(64) float om[PF_AMX_ROWS * PF_MAXD];
  // P V of the last chunk, added into O at the next chunk's rescale (reading it back as late
  // as that keeps AVX-512 loads from waiting on the tile stores that wrote it)
  alignas(64) float pv[PF_AMX_ROWS * PF_MAXD];
  for (int i = 0; i < PF_AMX_ROWS; ++i) {
    if (i < nr) std::memcpy(qs + i * D, qb + ((r0 + i) * Hq + hq) * D, D * sizeof(uint16_t));
    else std::memset(qs + i * D, 0, D * sizeof(uint16_t));
  }
  std::memset(om, 0, sizeof(float) * PF_AMX_ROWS * D);
  std::memset(pv, 0, sizeof(float) * PF_AMX_ROWS * D);
  std::memset(pm, 0, sizeof(pm));
  alignas(64) float m[PF_AMX_ROWS], alpha[PF_AMX_ROWS];
  __m512 l[PF_AMX_ROWS], mx[PF_AMX_ROWS];
  __mmask16 vis[PF_AMX_ROWS][4];
  const float csc = sc * 1.44269504089f;  // scores to base-2 units
  for (int i = 0; i < PF_AMX_ROWS; ++i) {
    m[i] = i < nr ? -INFINITY : 0.f;
    l[i] = _mm512_setzero_ps();
    mx[i] = _mm512_set1_ps(-INFINITY);
  }
  const int64_t last = offset + r0 + nr - 1;
  // S of chunk ch into sm (the next chunk's is computed between this one's softmax and its
  // P V, so the tile loads of P find the softmax's stores already written back)
  const uint32_t* kus[2][4];
  int nus[2];
  auto scores = [&](int64_t ch) {
    const int64_t j0 = ch * PF_KEYS;
    const int nu = int(std::min<int64_t>(4, (last - j0) / PF_UNIT + 1));  // units with a visible key
    const uint32_t** ku = kus[ch & 1];
    nus[ch & 1] = nu;
    for (int b = 0; b < nu; ++b) ku[b] = unit(j0 / PF_UNIT + b);
    amx_scores(qs, D, ku, nu, sm);
  };
  scores(0);
  for (int64_t ch = 0; ch * PF_KEYS <= last; ++ch) {
    const int64_t j0 = ch * PF_KEYS;
    const int nu = nus[ch & 1];
    const uint32_t* const* ku = kus[ch & 1];
    const bool edge = j0 + PF_KEYS - 1 > offset + r0;
    for (int i = 0; i < nr; ++i) {
      __m512 s[4];
      for (int b = 0; b < nu; ++b) s[b] = _mm512_load_ps(sm + i * PF_KEYS + 16 * b);
      mx[i] = pf_row_max(s, nu, edge, j0, offset + r0 + i, vis[i]);
    }
    rows_new_max(mx, csc, m, alpha);
    for (int i = 0; i < nr; ++i) {
      __m512 s[4], pr[4];
      for (int b = 0; b < nu; ++b) s[b] = _mm512_load_ps(sm + i * PF_KEYS + 16 * b);
      pf_row_probs(s, nu, vis[i], csc, m[i], alpha[i], l[i], pr);
      const __m512 av = _mm512_set1_ps(alpha[i]);
      float* orow = om + i * D;
      const float* prow = pv + i * D;
      for (int64_t c = 0; c < C16; ++c)
        _mm512_store_ps(orow + c * 16,
                        _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(orow + c * 16),
                                                    _mm512_load_ps(prow + c * 16)), av));
      _mm512_store_si512(pm + i * PF_KEYS, (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
      _mm512_store_si512(pm + i * PF_KEYS + 32, (__m512i)_mm512_cvtne2ps_pbh(pr[3], pr[2]));
    }
    if ((ch + 1) * PF_KEYS <= last) scores(ch + 1);
    const uint32_t* vb[4];  // each unit's V after its K (8 D dwords)
    for (int b = 0; b < nu; ++b) vb[b] = ku[b] + 8 * D;
    amx_pv(pm, vb, nu, D, pv);
  }
  for (int i = 0; i < nr; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[i]));
    uint16_t* orow = ob + ((r0 + i) * Hq + hq) * D;
    for (int64_t c = 0; c < C16; ++c) {
      const __m512 o = _mm512_add_ps(_mm512_load_ps(om + i * D + c * 16), _mm512_load_ps(pv + i * D + c * 16));
      const __m256bh o16 = _mm512_cvtneps_pbh(_mm512_mul_ps(o, inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c * 16), (__m256i)o16);
    }
  }
}
#undef PF_S_TILE
#endif

// Whether the decode kernel's AMX shared-group step was built and may run here.
static bool decode_amx_available() {
#ifdef PD_DECODE_AMX
  return pf_amx_permitted();
#else
  return false;
#endif
}

// Turns the decode kernel's AMX shared-group step on or off (off until asked); returns
// whether it is on (false where it cannot run).
static bool set_decode_amx(bool on) {
  const bool v = on && decode_amx_available();
  g_decode_amx.store(v);
  return v;
}

// Whether the AMX prefill tile was built and this process may use the tile registers.
static bool prefill_amx_available() {
#ifdef PF_HAVE_AMX
  return pf_amx_permitted();
#else
  return false;
#endif
}

// Runs fn(worker) for workers [0, n) on the threads, each thread taking the next from a shared
// counter (items sorted longest first balance); with amx, each thread configures its tiles first
// and releases them after.
template <typename Fn>
static void pf_run_items(int64_t n, bool amx, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
#ifdef PF_HAVE_AMX
    if (amx) pf_amx_configure();
#endif
    for (int64_t w = next.fetch_add(1); w < n; w = next.fetch_add(1)) fn(w);
#ifdef PF_HAVE_AMX
    if (amx) _tile_release();
#endif
  });
}

// Whether this build has the AVX2 prefill tile (pf_tile_avx2).
static bool prefill_avx2_available() {
#ifdef PF_HAVE_AVX2
  return true;
#else
  return false;
#endif
}

// Refuses a tile this CPU or build cannot run.
static void pf_check_isa(int64_t isa) {
  TORCH_CHECK(isa == PF_AVX512 || isa == PF_AMX || isa == PF_AVX2, "unknown prefill tile ", isa);
  TORCH_CHECK(isa != PF_AMX || prefill_amx_available(), "no AMX tiles on this CPU or build");
  TORCH_CHECK(isa != PF_AVX2 || prefill_avx2_available(), "no AVX2 prefill tile in this build");
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
  TORCH_CHECK(isa != PF_AVX512, "no AVX512-BF16 prefill tile in this build");
#endif
}

// One tile of rows on the chosen kernel (pf_check_isa has vouched for it).
template <typename UnitFn>
static inline void pf_tile_isa(int64_t isa, const uint16_t* qb, uint16_t* ob, int64_t Hq, int64_t D,
                               int64_t hq, int64_t r0, int64_t nr, int64_t offset, float sc,
                               const UnitFn& unit) {
#ifdef PF_HAVE_AMX
  if (isa == PF_AMX) return pf_tile_amx(qb, ob, Hq, D, hq, r0, nr, offset, sc, unit);
#endif
#ifdef PF_HAVE_AVX2
  if (isa == PF_AVX2) return pf_tile_avx2(qb, ob, Hq, D, hq, r0, nr, offset, sc, unit);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  pf_tile(qb, ob, Hq, D, hq, r0, nr, offset, sc, unit);
#endif
}

// One sequence's chunk: q [Tq, Hq, D], k / v [Tk, Hkv, D] (its whole context, contiguous).
at::Tensor prefill_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        int64_t offset, double scale, int64_t isa) {
#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || defined(PF_HAVE_AVX2)
  pf_check_isa(isa);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [Tq,Hq,D], k/v [Tk,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "prefill_bf16 takes bf16 tensors");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous inputs");
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2), Tk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D && D % 32 == 0 && D <= PF_MAXD, "head size a multiple of 32, <= 256");
  TORCH_CHECK(Hq % Hkv == 0 && offset >= 0 && offset + Tq <= Tk, "bad heads or offset");
  const int64_t G = Hq / Hkv, UW = PF_UNIT * D;
  const int64_t nunits = (Tk + PF_KEYS - 1) / PF_KEYS * (PF_KEYS / PF_UNIT);
  std::vector<uint32_t> packed(Hkv * nunits * UW);  // [h][unit][UW]
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  at::parallel_for(0, Hkv * nunits, 1, [&](int64_t w0, int64_t w1) {
    const uint16_t* kr[PF_UNIT];
    const uint16_t* vr[PF_UNIT];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = w / nunits, u = w % nunits;
      for (int t = 0; t < PF_UNIT; ++t) {
        const int64_t tok = u * PF_UNIT + t;
        kr[t] = tok < Tk ? kb + (tok * Hkv + h) * D : nullptr;
        vr[t] = tok < Tk ? vb + (tok * Hkv + h) * D : nullptr;
      }
      pf_pack_unit(kr, vr, D, packed.data() + w * UW);
    }
  });
  auto out = at::empty_like(q);
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t rows = isa == PF_AMX ? 16 : PF_ROWS, ntiles = (Tq + rows - 1) / rows;
  const float sc = float(scale);
  pf_run_items(Hq * ntiles, isa == PF_AMX, [&](int64_t w) {
    const int64_t hq = w / ntiles, r0 = (w % ntiles) * rows, nr = std::min<int64_t>(rows, Tq - r0);
    const uint32_t* base = packed.data() + (hq / G) * nunits * UW;
    auto unit = [&](int64_t u) { return base + u * UW; };
    pf_tile_isa(isa, qb, ob, Hq, D, hq, r0, nr, offset, sc, unit);
  });
  return out;
#else
  TORCH_CHECK(false, "prefill_bf16 needs AVX512-BF16 or AVX2 and FMA");
#endif
}

// Every multi-token chunk of a step at once, from the block pool: q [T, Hq, D] (sequences back
// to back, query_start_loc [S + 1]), kv [NB, L, 2, BS, Hkv, D] bf16 already holding the step's
// K/V, tables [S, max_blocks], lens [S] (context incl. the chunk). Rows of sequences with a
// single query token are left for the decode kernel (their rows of the result are undefined).
// Each 16-key unit is packed once per KV head: whole units of a block (BS a multiple of 16) are
// keyed by (block, unit) and shared by every sequence whose table holds them; a unit that runs
// past a sequence's context, or spans two blocks, is its own. Work items (sequence, query head,
// row tile) go to the threads longest first from a shared counter.
at::Tensor paged_prefill_bf16(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                              const at::Tensor& tables, const at::Tensor& lens,
                              const at::Tensor& qsl, double scale, int64_t isa) {
#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || defined(PF_HAVE_AVX2)
  pf_check_isa(isa);
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 6, "q must be [T,Hq,D] and kv [NB,L,2,BS,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16,
              "paged_prefill_bf16 takes bf16 q and KV");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "q and kv must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt &&
                  qsl.scalar_type() == at::kInt, "tables, lens, query_start_loc must be int32");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous() && qsl.is_contiguous(),
              "tables, lens, query_start_loc must be contiguous");
  const int64_t Hq = q.size(1), D = q.size(2), L = kv.size(1), BS = kv.size(3), Hkv = kv.size(4);
  const int64_t S = lens.size(0), MB = tables.size(1);
  TORCH_CHECK(kv.size(5) == D && D % 32 == 0 && D <= PF_MAXD, "head size a multiple of 32, <= 256");
  TORCH_CHECK(Hq % Hkv == 0 && qsl.size(0) == S + 1 && tables.size(0) == S, "bad geometry");
  TORCH_CHECK(layer >= 0 && layer < L, "layer out of range");
  const int64_t G = Hq / Hkv, UW = PF_UNIT * D, NB = kv.size(0);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* qp = qsl.data_ptr<int32_t>();
  const uint16_t* kvb = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  const int64_t s_blk = L * 2 * BS * Hkv * D, s_tok = Hkv * D;
  auto row_of = [&](int64_t block, int64_t part, int64_t off, int64_t h) {
    return kvb + block * s_blk + (layer * 2 + part) * BS * s_tok + off * s_tok + h * D;
  };
  // Plan: slot 0 is the zero unit; every sequence's units map to slots.
  struct Src { int64_t seq, u0; };  // a unit's first token: token u0 of sequence seq
  std::vector<Src> srcs{{-1, 0}};
  std::vector<int64_t> ctx_of{0};  // per slot: context length of its source sequence
  std::vector<std::vector<int32_t>> slots(S);
  std::unordered_map<int64_t, int32_t> shared;
  const bool whole = BS % PF_UNIT == 0;
  const int64_t upb = whole ? BS / PF_UNIT : 0;
  const int64_t rows = isa == PF_AMX ? 16 : PF_ROWS;
  struct Item { int64_t seq, hq, r0, nr, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q0 = qp[s], tq = qp[s + 1] - q0, ctx = lp[s];
    if (tq <= 1) continue;
    TORCH_CHECK(tq <= ctx && (ctx + BS - 1) / BS <= MB && q0 >= 0 && qp[s + 1] <= q.size(0),
                "bad chunk of sequence ", s);
    // every table entry the context uses (with blocks under 16 tokens a unit spans several)
    for (int64_t j = 0; j < (ctx + BS - 1) / BS; ++j)
      TORCH_CHECK(tp[s * MB + j] >= 0 && tp[s * MB + j] < NB, "block id out of range in sequence ",
                  s, ": ", tp[s * MB + j], " not in [0, ", NB, ")");
    const int64_t nunits = (ctx + PF_KEYS - 1) / PF_KEYS * (PF_KEYS / PF_UNIT);
    auto& sl = slots[s];
    sl.resize(nunits, 0);
    for (int64_t u = 0; u * PF_UNIT < ctx; ++u) {
      const int64_t t0 = u * PF_UNIT;
      const int64_t blk = tp[s * MB + t0 / BS];
      if (whole && t0 + PF_UNIT <= ctx) {
        const int64_t key = blk * upb + (t0 % BS) / PF_UNIT;
        auto it = shared.find(key);
        if (it != shared.end()) { sl[u] = it->second; continue; }
        shared.emplace(key, int32_t(srcs.size()));
      }
      sl[u] = int32_t(srcs.size());
      srcs.push_back({s, t0});
      ctx_of.push_back(ctx);
    }
    const int64_t offset = ctx - tq;
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t r0 = 0; r0 < tq; r0 += rows) {
        const int64_t nr = std::min<int64_t>(rows, tq - r0);
        items.push_back({s, hq, r0, nr, nr * (offset + r0 + nr + PF_KEYS)});
      }
  }
  auto out = at::empty_like(q);
  if (items.empty()) return out;
  const int64_t nslots = int64_t(srcs.size());
  std::vector<uint32_t> packed(nslots * Hkv * UW);  // [slot][h][UW]
  std::fill(packed.begin(), packed.begin() + Hkv * UW, 0u);
  at::parallel_for(1, nslots, 1, [&](int64_t w0, int64_t w1) {
    const uint16_t* kr[PF_UNIT];
    const uint16_t* vr[PF_UNIT];
    for (int64_t w = w0; w < w1; ++w) {
      const Src src = srcs[w];
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int t = 0; t < PF_UNIT; ++t) {
          const int64_t tok = src.u0 + t;
          if (tok >= ctx_of[w]) { kr[t] = vr[t] = nullptr; continue; }
          const int64_t blk = tp[src.seq * MB + tok / BS];
          kr[t] = row_of(blk, 0, tok % BS, h);
          vr[t] = row_of(blk, 1, tok % BS, h);
        }
        pf_pack_unit(kr, vr, D, packed.data() + (w * Hkv + h) * UW);
      }
    }
  });
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const uint16_t* qb = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float sc = float(scale);
  pf_run_items(int64_t(items.size()), isa == PF_AMX, [&](int64_t w) {
    const Item& it = items[w];
    const int64_t q0 = qp[it.seq], tq = qp[it.seq + 1] - q0, offset = lp[it.seq] - tq;
    const int32_t* sl = slots[it.seq].data();
    const uint32_t* base = packed.data() + (it.hq / G) * UW;
    auto unit = [&](int64_t u) { return base + int64_t(sl[u]) * Hkv * UW; };
    pf_tile_isa(isa, qb + q0 * Hq * D, ob + q0 * Hq * D, Hq, D, it.hq, it.r0, it.nr, offset, sc, unit);
  });
  return out;
#else
  TORCH_CHECK(false, "paged_prefill_bf16 needs AVX512-BF16 or AVX2 and FMA");
#endif
}

// Element-wise parts of a bf16 layer, each one pass instead of torch's 3-10 ops (the decode
// step of a small batch is mostly their dispatch). Every intermediate is rounded to bf16 where
// the Hugging Face reference's bf16 ops round it, so results match torch's but for the order
// of fp32 sums and the exp polynomial.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __m512 ld_bf16(const uint16_t* p) {  // load16's bf16 widening, on raw bits
  return load16(reinterpret_cast<const at::BFloat16*>(p));
}
static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 rnd_bf16(__m512 x) {  // x rounded to bf16 precision, back in fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
static inline void st_bf16(uint16_t* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, to_bf16(x)); }
#endif
static const uint16_t* u16(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
static uint16_t* u16m(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }
// The portable forms (any CPU without AVX512-BF16): one element at a time, the same roundings
// (at::BFloat16's round to nearest even, as the vector forms' conversions).
static inline float bf_f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline uint16_t f_bf(float f) { return at::BFloat16(f).x; }
static inline float bf_rnd(float f) { return bf_f(f_bf(f)); }

// RMSNorm of x [T, H] (after x += residual, rounded to bf16, when residual is given):
// w * bf16(x * rsqrt(mean(x^2) + eps)). Returns (normed, the sum) (the sum is x itself
// without a residual). H a multiple of 16.
std::vector<at::Tensor> rms_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                      const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x [T,H] bf16");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(H % 16 == 0 && w.numel() == H && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w [H] bf16, H % 16 == 0");
  const bool add = residual.has_value();
  if (add)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kBFloat16 &&
                    residual->is_contiguous(), "residual like x");
  auto out = at::empty_like(x);
  auto sum = add ? at::empty_like(x) : x;
  const uint16_t* xp = u16(x);
  const uint16_t* rp = add ? u16(*residual) : nullptr;
  const uint16_t* wp = u16(w);
  uint16_t* op = u16m(out);
  uint16_t* sp = add ? u16m(sum) : nullptr;
  const float fe = float(eps), invh = 1.f / float(H);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* xr = xp + t * H;
      uint16_t* orow = op + t * H;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) {
        __m512 v = ld_bf16(xr + i);
        if (add) {
          v = rnd_bf16(_mm512_add_ps(v, ld_bf16(rp + t * H + i)));
          st_bf16(sp + t * H + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) * invh + fe);
      const __m512 iv = _mm512_set1_ps(inv);
      const uint16_t* src = add ? sp + t * H : xr;
      for (int64_t i = 0; i < H; i += 16)
        st_bf16(orow + i, _mm512_mul_ps(ld_bf16(wp + i), rnd_bf16(_mm512_mul_ps(ld_bf16(src + i), iv))));
    }
  });
#else
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* xr = xp + t * H;
      uint16_t* orow = op + t * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        float v = bf_f(xr[i]);
        if (add) {
          v = bf_rnd(v + bf_f(rp[t * H + i]));
          sp[t * H + i] = f_bf(v);
        }
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss * invh + fe);
      const uint16_t* src = add ? sp + t * H : xr;
      for (int64_t i = 0; i < H; ++i) orow[i] = f_bf(bf_f(wp[i]) * bf_rnd(bf_f(src[i]) * inv));
    }
  });
#endif
  return {out, sum};
}

// Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] at positions [T] with fp32 cos / sin
// tables [P, D] (cast to bf16 first, as the reference does): x * c + rotate_half(x) * s, each
// product and the sum rounded to bf16. Returns new (q, k). D a multiple of 32.
std::vector<at::Tensor> rope_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                  const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [T,Hq,D], k [T,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16, "bf16 q, k");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(),
              "fp32 cos/sin [P, D], one shape");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.dim() == 1 && positions.size(0) == q.size(0),
              "int64 positions [T]");
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 32 == 0, "head size a multiple of 32");
  auto qc = q.contiguous(), kc = k.contiguous();
  auto qo = at::empty_like(qc), ko = at::empty_like(kc);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const uint16_t* qi = u16(qc);
  const uint16_t* ki = u16(kc);
  uint16_t* qw = u16m(qo);
  uint16_t* kw = u16m(ko);
  const int64_t P = cos.size(0);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const __m512 neg = _mm512_set1_ps(-1.f);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < P, "position out of the rotary table");
      for (int which = 0; which < 2; ++which) {
        const int64_t H = which ? Hk : Hq;
        const uint16_t* src = (which ? ki : qi) + t * H * D;
        uint16_t* dst = (which ? kw : qw) + t * H * D;
        for (int64_t h = 0; h < H; ++h) {
          const uint16_t* x = src + h * D;
          uint16_t* y = dst + h * D;
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 lo = ld_bf16(x + i), hi = ld_bf16(x + half + i);
            const __m512 c0 = rnd_bf16(_mm512_loadu_ps(cp + p * D + i));
            const __m512 c1 = rnd_bf16(_mm512_loadu_ps(cp + p * D + half + i));
            const __m512 s0 = rnd_bf16(_mm512_loadu_ps(snp + p * D + i));
            const __m512 s1 = rnd_bf16(_mm512_loadu_ps(snp + p * D + half + i));
            // first half: x*c - x_hi*s; second half: x_hi*c + x_lo*s
            const __m512 a0 = rnd_bf16(_mm512_mul_ps(lo, c0));
            const __m512 b0 = rnd_bf16(_mm512_mul_ps(_mm512_mul_ps(hi, neg), s0));
            const __m512 a1 = rnd_bf16(_mm512_mul_ps(hi, c1));
            const __m512 b1 = rnd_bf16(_mm512_mul_ps(lo, s1));
            st_bf16(y + i, _mm512_add_ps(a0, b0));
            st_bf16(y + half + i, _mm512_add_ps(a1, b1));
          }
        }
      }
    }
  });
#else
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < P, "position out of the rotary table");
      const float* cr = cp + p * D;
      const float* sr = snp + p * D;
      for (int which = 0; which < 2; ++which) {
        const int64_t H = which ? Hk : Hq;
        const uint16_t* src = (which ? ki : qi) + t * H * D;
        uint16_t* dst = (which ? kw : qw) + t * H * D;
        for (int64_t h = 0; h < H; ++h) {
          const uint16_t* x = src + h * D;
          uint16_t* y = dst + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float lo = bf_f(x[i]), hi = bf_f(x[half + i]);
            const float a0 = bf_rnd(lo * bf_rnd(cr[i])), b0 = bf_rnd(-hi * bf_rnd(sr[i]));
            const float a1 = bf_rnd(hi * bf_rnd(cr[half + i])), b1 = bf_rnd(lo * bf_rnd(sr[half + i]));
            y[i] = f_bf(a0 + b0);
            y[half + i] = f_bf(a1 + b1);
          }
        }
      }
    }
  });
#endif
  return {qo, ko};
}

// silu(gate) * up for gu [T, 2I] (gate columns first, as gate_up_proj lays them out):
// bf16(bf16(silu(g)) * u). I a multiple of 16.
at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kBFloat16 && gu.is_contiguous() &&
                  gu.size(1) % 32 == 0, "gu [T, 2I] bf16, I % 16 == 0");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options());
  const uint16_t* g = u16(gu);
  uint16_t* o = u16m(out);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 x = ld_bf16(g + t * 2 * I + i), u = ld_bf16(g + t * 2 * I + I + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 sl = rnd_bf16(_mm512_div_ps(x, _mm512_add_ps(one, e)));
        st_bf16(o + t * I + i, _mm512_mul_ps(sl, u));
      }
  });
#else
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const float x = bf_f(g[t * 2 * I + i]), u = bf_f(g[t * 2 * I + I + i]);
        o[t * I + i] = f_bf(bf_rnd(x / (1.f + std::exp(-x))) * u);
      }
  });
#endif
  return out;
}

// Row-wise argmax (first index of the maximum, as torch.argmax), for greedy sampling straight
// from the model-dtype logits. x: [N, V] contiguous -> [N] int64.
template <typename T>
static int64_t argmax_row(const T* row, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = -INFINITY;
#ifdef __AVX512F__
  if constexpr (HasLoad16<T>::value) {
    if (n >= 16) {
      __m512 vmax = load16(row);
      __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i cur = vidx;
      const __m512i step = _mm512_set1_epi32(16);
      for (i = 16; i + 16 <= n; i += 16) {
        cur = _mm512_add_epi32(cur, step);
        const __m512 v = load16(row + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_blend_ps(gt, vmax, v);
        vidx = _mm512_mask_blend_epi32(gt, vidx, cur);
      }
      alignas(64) float vals[16];
      alignas(64) int32_t idxs[16];
      _mm512_store_ps(vals, vmax);
      _mm512_store_si512(reinterpret_cast<__m512i*>(idxs), vidx);
      best = vals[0]; best_i = idxs[0];
      for (int k = 1; k < 16; ++k)
        if (vals[k] > best || (vals[k] == best && idxs[k] < best_i)) { best = vals[k]; best_i = idxs[k]; }
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (v > best) { best = v; best_i = i; }
  }
  return best_i;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "argmax_rows needs a contiguous [N, V] tensor");
  const int64_t N = x.size(0), V = x.size(1);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto* p) {
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row(p + r * V, V);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(x.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return out;
}

// ---- The sampling race in one pass per row ---------------------------------------------------
// A sampled row's token is argmax_i w_i / E_i, E_i ~ Exp(1) (the exponential race, which draws i
// with probability w_i / sum w). With logits l and temperature T the weights are
// w_i = exp((l_i - max l) / T); a -inf logit (a banned token) has weight 0 and is never drawn.
// The noise is E_i = -ln u_i with u_i from SplitMix64 keyed by the row's key: u_i is the
// (odd) 24-bit fraction (2 r + 1) / 2^24, r the top 23 bits of mix64(key + (i + 1) * golden),
// so u is in (0, 1) and E_i in (2^-24, 16.7). One pass: no fp32 copy of the logits, no softmax,
// no noise tensor (the torch ops took 20 ms for 64 rows of a 32,000-token vocabulary on one
// thread). A row of temperature 0 takes the argmax of x (first index of the maximum). With
// `weights`, x holds the weights themselves (>= 0, not normalised) and temps are not read.
static constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline float race_uniform(uint64_t key, int64_t i) {
  const uint64_t r = mix64(key + static_cast<uint64_t>(i + 1) * kGolden) >> 41;
  return static_cast<float>(2 * r + 1) * (1.0f / 16777216.0f);
}

// The largest value of a row (-inf for none; exact in any order), for race_row and cut_row.
template <typename T>
static float row_max(const T* x, int64_t n) {
  float mx = -INFINITY;
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (HasLoad16<T>::value) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, load16(x + i));
    mx = _mm512_reduce_max_ps(vm);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, static_cast<float>(x[i]));
  return mx;
}

// A logit's sampling weight exp((x - mx) * inv): 0 for -inf (a banned token).
static inline float logit_weight(float x, float mx, float inv) {
  return x > -INFINITY ? std::exp((x - mx) * inv) : 0.0f;
}
#ifdef __AVX512F__
static inline __m512 logit_weight16(__m512 x, __m512 vmx, __m512 vinv) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
  return _mm512_maskz_mov_ps(live, exp512(_mm512_mul_ps(_mm512_sub_ps(x, vmx), vinv)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 masked_load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __m512 masked_load16(const at::BFloat16* p, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512i mix64x8(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                         _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ull)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                         _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBull)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// u for 16 indices from their SplitMix64 counters (key + (i + 1) * golden, as race_uniform's
// values, bit for bit): lo holds lanes 0-7, hi lanes 8-15.
static inline __m512 race_uniform16(__m512i lo, __m512i hi) {
  const __m512i r = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(lo), 41))),
      _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(hi), 41)), 1);
  const __m512 odd = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(r, 1), _mm512_set1_epi32(1)));
  return _mm512_mul_ps(odd, _mm512_set1_ps(1.0f / 16777216.0f));
}

// 1 / x to fp32 precision: rcp14 and one Newton step (cheaper than a division).
static inline __m512 recip16(__m512 x) {
  const __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
}

// -ln u for u in (0, 1): u = 2^e m, m folded into [sqrt(1/2), sqrt 2), ln m = 2 atanh(t),
// t = (m - 1) / (m + 1), |t| <= 0.172, by its series to t^9 (relative error < 1e-9 before
// rounding to fp32).
static inline __m512 neg_ln16(__m512 u) {
  const __m512i bits = _mm512_castps_si512(u);
  __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127)));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffff)),
                                                 _mm512_set1_epi32(0x3f800000)));
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
  const __m512 t = _mm512_mul_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.0f)), recip16(_mm512_add_ps(m, _mm512_set1_ps(1.0f))));
  const __m512 t2 = _mm512_mul_ps(t, t);
  __m512 p = _mm512_set1_ps(1.0f / 9);
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 7));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 5));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 3));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f));
  const __m512 lnm = _mm512_mul_ps(_mm512_add_ps(t, t), p);
  return _mm512_sub_ps(_mm512_mul_ps(e, _mm512_set1_ps(-0.69314718056f)), lnm);
}

template <typename T>
static int64_t race_row(const T* row, int64_t n, float temp, uint64_t key, bool weights) {
  if (!weights && !(temp > 0.0f)) return argmax_row(row, n);
  const float mx = weights ? 0.0f : row_max(row, n);
  if (!(mx > -INFINITY)) return 0;  // nothing to draw from (NaN or every logit -inf)
  const __m512 vmx = _mm512_set1_ps(mx), vinv = _mm512_set1_ps(weights ? 1.0f : 1.0f / temp);
  __m512 best = _mm512_set1_ps(-1.0f);
  __m512i best_i = _mm512_setzero_si512();
  __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // the SplitMix64 counters of indices i .. i + 15: key + (i + 1 + lane) * golden
  const __m512i g = _mm512_set1_epi64(static_cast<long long>(kGolden));
  const __m512i step = _mm512_set1_epi64(static_cast<long long>(16 * kGolden));
  __m512i lo = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(key)),
                                _mm512_mullo_epi64(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8), g));
  __m512i hi = _mm512_add_epi64(lo, _mm512_set1_epi64(static_cast<long long>(8 * kGolden)));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = masked_load16(row + i, k);
    const __m512 u = race_uniform16(lo, hi);
    lo = _mm512_add_epi64(lo, step);
    hi = _mm512_add_epi64(hi, step);
    const __m512 w = weights
                         ? _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), x)
                         : logit_weight16(x, vmx, vinv);
    const __m512 s = _mm512_mul_ps(w, recip16(neg_ln16(u)));
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(k, s, best, _CMP_GT_OQ);
    best = _mm512_mask_blend_ps(gt, best, s);
    best_i = _mm512_mask_blend_epi32(gt, best_i, cur);
    cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16));
  }
  alignas(64) float vals[16];
  alignas(64) int32_t idxs[16];
  _mm512_store_ps(vals, best);
  _mm512_store_si512(reinterpret_cast<__m512i*>(idxs), best_i);
  float b = vals[0];
  int64_t bi = idxs[0];
  for (int k = 1; k < 16; ++k)
    if (vals[k] > b || (vals[k] == b && idxs[k] < bi)) { b = vals[k]; bi = idxs[k]; }
  return bi;
}
#else
template <typename T>
static int64_t race_row(const T* row, int64_t n, float temp, uint64_t key, bool weights) {
  if (!weights && !(temp > 0.0f)) return argmax_row(row, n);
  const float mx = weights ? 0.0f : row_max(row, n);
  if (!(mx > -INFINITY)) return 0;
  const float inv = weights ? 1.0f : 1.0f / temp;
  float b = -1.0f;
  int64_t bi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(row[i]);
    const float w = weights ? (x > 0.0f ? x : 0.0f) : logit_weight(x, mx, inv);
    const float s = w / -std::log(race_uniform(key, i));
    if (s > b) { b = s; bi = i; }
  }
  return bi;
}
#endif

// temps: [N] float32 (x holds logits), or none (x holds the weights).
at::Tensor race_rows(const at::Tensor& x, const std::optional<at::Tensor>& temps, const at::Tensor& keys) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "race_rows needs a contiguous [N, V] tensor");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == N && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "race_rows: keys must be [N] int64");
  const bool weights = !temps.has_value();
  TORCH_CHECK(weights || (temps->dim() == 1 && temps->size(0) == N && temps->scalar_type() == at::kFloat &&
                          temps->is_contiguous()),
              "race_rows: temps must be [N] float32");
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  const float* tp = weights ? nullptr : temps->data_ptr<float>();
  auto run = [&](auto* p) {
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        op[r] = race_row(p + r * V, V, weights ? 1.0f : tp[r], static_cast<uint64_t>(kp[r]), weights);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "race_rows: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// ---- The cut distributions of top-k / top-p / min-p rows ----------------------------------
// w = exp((x - max x) / T) per row (0 for a -inf logit), then, in vLLM V1's order: min-p keeps
// the tokens of at least min_p times the largest weight (which is 1), top-k those at least the
// k-th largest (its ties too), top-p the smallest set of the largest weights whose mass reaches
// p of what min-p and top-k kept (every token tied with the last one too). Each cut keeps a
// prefix of the largest weights, so its threshold is the floor of the next; each is found by
// bisection over the bit patterns of non-negative floats (ordered as integers): about 30 passes
// over the row in L2 instead of a sort. The weights are written unnormalised (the race does not
// need the sum); a temperature of 0 gives the argmax weight 1 and every other 0.
static inline int64_t cut_count_ge(const float* w, int64_t n, float t) {
  int64_t c = 0;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vt = _mm512_set1_ps(t);
  for (; i + 16 <= n; i += 16) c += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), vt, _CMP_GE_OQ));
#endif
  for (; i < n; ++i) c += w[i] >= t;
  return c;
}

static inline float cut_mass_ge(const float* w, int64_t n, float t) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef __AVX512F__
  const __m512 vt = _mm512_set1_ps(t);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(w + i);
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, vt, _CMP_GE_OQ), acc, v);
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i)
    if (w[i] >= t) s += w[i];
  return s;
}

// The largest t in [0, 1] with pred(t) (pred(0) holds, pred is monotone: true up to a point).
template <typename Pred>
static inline float cut_bisect(Pred pred) {
  uint32_t lo = 0, hi = 0x3f800001u;  // bits of 0.0f; one past the bits of 1.0f
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    float t;
    std::memcpy(&t, &mid, sizeof t);
    if (pred(t)) lo = mid; else hi = mid;
  }
  float t;
  std::memcpy(&t, &lo, sizeof t);
  return t;
}

template <typename T>
static void cut_row(const T* x, float* w, int64_t n, float temp, int64_t top_k, float top_p, float min_p) {
  const float mx = row_max(x, n);
  if (!(mx > -INFINITY)) {  // nothing to draw from: the race then takes index 0
    std::fill(w, w + n, 0.0f);
    return;
  }
  if (!(temp > 0.0f)) {
    std::fill(w, w + n, 0.0f);
    w[argmax_row(x, n)] = 1.0f;
    return;
  }
  const float inv = 1.0f / temp;
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (HasLoad16<T>::value) {
    const __m512 vmx = _mm512_set1_ps(mx), vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(w + i, logit_weight16(load16(x + i), vmx, vinv));
  }
#endif
  for (; i < n; ++i) w[i] = logit_weight(static_cast<float>(x[i]), mx, inv);
  float t = min_p > 0.0f ? min_p : 0.0f;  // the largest weight is exp(0) = 1
  if (top_k > 0 && top_k < n)
    t = std::max(t, cut_bisect([&](float c) { return cut_count_ge(w, n, c) >= top_k; }));
  if (top_p < 1.0f) {
    const float target = top_p * cut_mass_ge(w, n, t);
    const float floor = t;
    t = cut_bisect([&](float c) { return cut_mass_ge(w, n, std::max(c, floor)) >= target; });
    t = std::max(t, floor);
  }
  if (t > 0.0f)
    for (int64_t j = 0; j < n; ++j)
      if (w[j] < t) w[j] = 0.0f;
}

at::Tensor cut_rows(const at::Tensor& x, const at::Tensor& temps, const at::Tensor& top_k,
                    const at::Tensor& top_p, const at::Tensor& min_p) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "cut_rows needs a contiguous [N, V] tensor");
  const int64_t N = x.size(0), V = x.size(1);
  for (const at::Tensor* a : {&temps, &top_p, &min_p})
    TORCH_CHECK(a->dim() == 1 && a->size(0) == N && a->scalar_type() == at::kFloat && a->is_contiguous(),
                "cut_rows: temps, top_p and min_p must be [N] float32");
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == N && top_k.scalar_type() == at::kLong && top_k.is_contiguous(),
              "cut_rows: top_k must be [N] int64");
  auto out = at::empty({N, V}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  auto run = [&](auto* p) {
    at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) cut_row(p + r * V, op + r * V, V, tp[r], kp[r], pp[r], mp[r]);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "cut_rows: unsupported dtype ", x.scalar_type());
  }
  return out;
}

// ---- A projection on AMX tiles that reads its weight once for all rows ----------------------
// oneDNN's bf16 matmul blocks the rows of x by 64 and streams the whole weight again for each
// block, so a decode step's LM head (32000 x 256 at batch 128) reads it twice over, and a
// greedy step then writes [M, V] logits only to take their argmax. Here the weight is packed
// once (amx_pack_linear) into the B-tile pair layout, each thread walks its own range of
// 32-column blocks once, and every row tile of x (zero-padded to 16 rows, held in L2) meets
// each block while it is in L1. Each output is one fp32 tile accumulator over K in order,
// 32 at a time (TDPBF16PS), from zero, then rounded to bf16 (RNE): the same sums oneDNN's AMX
// kernel makes for these shapes (tests/kernels compare the two). amx_linear_bf16 writes y;
// amx_argmax_bf16 keeps, per row, the first index of the largest bf16-rounded value instead
// (argmax_rows of the y it would have written) and writes no logits.
#ifdef PF_HAVE_AMX
static void al_configure() {
  PfTileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores before ldtilecfg reads it
  _tile_loadconfig(&c);
}

static inline void al_prefetch(const uint16_t* t0, const uint16_t* t1) {
  for (int l = 0; l < 16; ++l) {
    _mm_prefetch(reinterpret_cast<const char*>(t0 + l * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t1 + l * 32), _MM_HINT_T0);
  }
}

// rows of x (padded) past which al_run takes al_blocks_kb where K is more than one slice (at
// K <= 256 a row pair's x is 16 KiB and stays in L1 through a group anyway)
constexpr int64_t AL_WALK_ROWS = 64;

// K steps [kt0, kt1) of one 32-column block (tiles b0, b1 of amx_pack_linear's layout) for
// one row pair at a0 (x rows of ``stride`` bytes; ``two``: both 16-row tiles, else the first),
// into accumulators 0-1 (and 2-3); with ``next0`` the next block's same K slices are
// prefetched along. Shared by both walks, so their sums are the same instructions in order.
static inline __attribute__((always_inline)) void al_steps(const uint16_t* a0, int64_t K,
                                                          int stride, const uint16_t* b0,
                                                          const uint16_t* b1, int64_t kt0,
                                                          int64_t kt1, bool two,
                                                          const uint16_t* next0,
                                                          const uint16_t* next1) {
  if (two) {
    for (int64_t kt = kt0; kt < kt1; ++kt) {
      if (next0 != nullptr) al_prefetch(next0 + kt * 512, next1 + kt * 512);
      _tile_loadd(4, a0 + kt * 32, stride);
      _tile_loadd(5, a0 + 16 * K + kt * 32, stride);
      _tile_loadd(6, b0 + kt * 512, 64);
      _tile_loadd(7, b1 + kt * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  } else {
    for (int64_t kt = kt0; kt < kt1; ++kt) {
      if (next0 != nullptr) al_prefetch(next0 + kt * 512, next1 + kt * 512);
      _tile_loadd(4, a0 + kt * 32, stride);
      _tile_loadd(6, b0 + kt * 512, 64);
      _tile_loadd(7, b1 + kt * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
}

// Accumulators 0-1 (and 2-3 with ``two``) zeroed, or to / from a 32 x 32 fp32 block (row
// stride 32).
static inline __attribute__((always_inline)) void al_zero(bool two) {
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

static inline __attribute__((always_inline)) void al_load(const float* c, bool two) {
  _tile_loadd(0, c, 128);
  _tile_loadd(1, c + 16, 128);
  if (two) {
    _tile_loadd(2, c + 16 * 32, 128);
    _tile_loadd(3, c + 16 * 32 + 16, 128);
  }
}

static inline __attribute__((always_inline)) void al_store(float* c, bool two) {
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// The fp32 sums of output columns [32 nb, 32 nb + 32) for every row tile of xp ([Mp, K] bf16,
// Mp a multiple of 16), for each block nb in [nb0, nb1): epi(m0, rows, n0, cb), cb a 32 x 32
// (row stride 32) fp32 block of which the first ``rows`` rows are set.
template <typename Epi>
static void al_blocks(const uint16_t* xp, int64_t Mp, int64_t K, const uint16_t* wp, int64_t nb0,
                      int64_t nb1, const Epi& epi) {
  const int64_t KT = K / 32;
  const int stride = int(K * sizeof(uint16_t));
  alignas(64) float cb[32 * 32];
  const int64_t block = 2 * KT * 512;  // bf16 values of one 32-column block
  // Past 32 rows, one block's tiles and every row of x no longer fit in L1 together, and
  // each row pair's pass reloaded x from L2 for every block. So the blocks go in groups of
  // about 256 KiB of weight (in L2 after the first pair's pass fetched them): all row pairs
  // meet a group before the next, each pair's rows staying in L1. The LM head 32000 x 256 on
  // one thread, interleaved with the previous walk in one process, same bits: 0.88x at 64
  // rows, 0.92x at 128; 32 rows and fewer walk as before. The epilogue still sees each row's
  // columns in increasing order.
  const int64_t group = std::max<int64_t>(1, (256 << 10) / (block * 2));
  for (int64_t g0 = nb0; g0 < nb1; g0 += group)
  for (int64_t m0 = 0; m0 < Mp; m0 += 32)
  for (int64_t nb = g0; nb < std::min(nb1, g0 + group); ++nb) {
    const uint16_t* b0 = wp + nb * block;
    const uint16_t* b1 = b0 + KT * 512;
    // the next block, a K slice per step of the first row pair, fetched while this one is
    // computed on (a tile load that misses to DRAM stalls the tile unit)
    const bool ahead = nb + 1 < nb1 && m0 == 0;
    const bool two = m0 + 16 < Mp;
    al_zero(two);
    al_steps(xp + m0 * K, K, stride, b0, b1, 0, KT, two, ahead ? b0 + block : nullptr,
             ahead ? b1 + block : nullptr);
    al_store(cb, two);
    epi(m0, two ? 32 : 16, nb * 32, cb);
  }
}

// al_blocks' contract for many rows (a prefill chunk): there every tile of a step came from L2
// (a row pair's 32 x K of x and the group's blocks both past L1), and the walk was bound by
// it (1.12x oneDNN's time at 2,048 rows of a 1,024-wide model's projections). Here K goes in
// slices of 256: a row pair's slice of x (16 KiB) stays in L1 while it meets every block of a
// group of 8 (the group's slice, 128 KiB, in L2 for all the pairs of a chunk of 256 rows), and
// each 32 x 32 block's fp32 sums wait in an L2 buffer between slices (stored and reloaded as
// tiles: exact). Each output is still one accumulator over K in order from zero: the same bits
// as al_blocks (tests/kernels/test_amx_linear.py). The epilogue runs per group once its sums
// are whole, each row's columns in increasing order. A 1,024-wide model's projections at
// 128-2,048 rows: 0.90-0.99x oneDNN's time with the head's streaming stores, 0.87-1.09x stored
// plainly (docs/benchmarks.md, "The layers' projections on the AMX walk").
template <typename Epi>
static void al_blocks_kb(const uint16_t* xp, int64_t Mp, int64_t K, const uint16_t* wp,
                         int64_t nb0, int64_t nb1, const Epi& epi) {
  const int64_t KT = K / 32;
  const int stride = int(K * sizeof(uint16_t));
  const int64_t block = 2 * KT * 512;
  constexpr int64_t KC = 8, group = 8, chunk = 256;  // K tiles a slice, blocks a group, rows
  at::Tensor buf = at::empty({chunk / 32 * group * 1024}, at::kFloat);  // 64-byte aligned
  float* cbuf = buf.data_ptr<float>();
  for (int64_t r0 = 0; r0 < Mp; r0 += chunk) {
    const int64_t re = std::min(Mp, r0 + chunk);
    for (int64_t g0 = nb0; g0 < nb1; g0 += group) {
      const int64_t gn = std::min(group, nb1 - g0);
      for (int64_t kc0 = 0; kc0 < KT; kc0 += KC) {
        const int64_t kce = std::min(KT, kc0 + KC);
        for (int64_t m0 = r0; m0 < re; m0 += 32) {
          const bool two = m0 + 16 < Mp;
          const uint16_t* a0 = xp + m0 * K;
          for (int64_t j = 0; j < gn; ++j) {
            const int64_t nb = g0 + j;
            const uint16_t* b0 = wp + nb * block;
            const uint16_t* b1 = b0 + KT * 512;
            float* c = cbuf + (((m0 - r0) / 32) * group + j) * 1024;
            const bool pf = m0 == r0 && j + 1 < gn;
            if (kc0 == 0) al_zero(two);
            else al_load(c, two);
            al_steps(a0, K, stride, b0, b1, kc0, kce, two, pf ? b0 + block : nullptr,
                     pf ? b1 + block : nullptr);
            al_store(c, two);
          }
        }
      }
      for (int64_t m0 = r0; m0 < re; m0 += 32)
        for (int64_t j = 0; j < gn; ++j)
          epi(m0, m0 + 16 < Mp ? 32 : 16, (g0 + j) * 32, cbuf + (((m0 - r0) / 32) * group + j) * 1024);
    }
  }
}

// Splits the column blocks [0, NB) into one contiguous range per thread: fn(t, nb0, nb1) on
// each range t of ``parts``, with the tiles configured (and released after).
template <typename Fn>
static void al_parallel(int64_t NB, int64_t parts, const Fn& fn) {
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    al_configure();
    for (int64_t t = b; t < e; ++t) fn(t, NB * t / parts, NB * (t + 1) / parts);
    _tile_release();
  });
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define AL_HAVE_DP 1
// The same walk without tiles, for CPUs with AVX512-BF16 but no AMX (AMD Zen 4, Cooper Lake):
// row p of a packed tile (nt, kt) is one 64-byte vector of 16 columns x one K pair, so
// VDPBF16PS with that pair of an x row broadcast adds both products to 16 columns' fp32 sums,
// pairs in K order from zero, as TDPBF16PS does. R rows x 32 columns of sums live in 2R
// registers while the block streams past once; x rows stay in L1.
template <int R>
static inline void dp_rows(const uint16_t* x, int64_t K, const uint16_t* b0, const uint16_t* b1,
                           const uint16_t* next0, const uint16_t* next1, float* cb) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; ++r) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
  const int64_t KT = K / 32;
  for (int64_t kt = 0; kt < KT; ++kt) {
    if (next0 != nullptr)  // the next block, a K slice per step, fetched while this one runs
      for (int l = 0; l < 16; l += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(next0 + kt * 512 + l * 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next1 + kt * 512 + l * 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next0 + kt * 512 + l * 32 + 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next1 + kt * 512 + l * 32 + 32), _MM_HINT_T0);
      }
    for (int p = 0; p < 16; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + kt * 512 + p * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + kt * 512 + p * 32);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + kt * 32 + 2 * p, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        c0[r] = _mm512_dpbf16_ps(c0[r], a, w0);
        c1[r] = _mm512_dpbf16_ps(c1[r], a, w1);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(cb + r * 32, c0[r]);
    _mm512_store_ps(cb + r * 32 + 16, c1[r]);
  }
}

static constexpr int DP_ROWS = 12;  // 24 accumulators, 2 weight vectors, 1 broadcast

// al_blocks' contract (epi(m0, rows, n0, cb) per block nb in [nb0, nb1) and group of up to 32
// rows) on dot products; xs is [M, K] bf16, not padded: rows of a group past M are not computed.
template <typename Epi>
static void dp_blocks(const uint16_t* xs, int64_t M, int64_t K, const uint16_t* wp, int64_t nb0,
                      int64_t nb1, const Epi& epi) {
  const int64_t KT = K / 32, block = 2 * KT * 512;
  alignas(64) float cb[32 * 32];
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint16_t* b0 = wp + nb * block;
    const uint16_t* b1 = b0 + KT * 512;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows = int(std::min<int64_t>(32, M - m0));
      for (int r0 = 0; r0 < rows; r0 += DP_ROWS) {
        // only the first pass over a block fetches the next one
        const bool ahead = nb + 1 < nb1 && m0 == 0 && r0 == 0;
        const uint16_t* n0 = ahead ? b0 + block : nullptr;
        const uint16_t* n1 = ahead ? b1 + block : nullptr;
        const uint16_t* x = xs + (m0 + r0) * K;
        float* c = cb + r0 * 32;
        switch (std::min(DP_ROWS, rows - r0)) {
          case 1: dp_rows<1>(x, K, b0, b1, n0, n1, c); break;
          case 2: dp_rows<2>(x, K, b0, b1, n0, n1, c); break;
          case 3: dp_rows<3>(x, K, b0, b1, n0, n1, c); break;
          case 4: dp_rows<4>(x, K, b0, b1, n0, n1, c); break;
          case 5: dp_rows<5>(x, K, b0, b1, n0, n1, c); break;
          case 6: dp_rows<6>(x, K, b0, b1, n0, n1, c); break;
          case 7: dp_rows<7>(x, K, b0, b1, n0, n1, c); break;
          case 8: dp_rows<8>(x, K, b0, b1, n0, n1, c); break;
          case 9: dp_rows<9>(x, K, b0, b1, n0, n1, c); break;
          case 10: dp_rows<10>(x, K, b0, b1, n0, n1, c); break;
          case 11: dp_rows<11>(x, K, b0, b1, n0, n1, c); break;
          default: dp_rows<12>(x, K, b0, b1, n0, n1, c); break;
        }
      }
      epi(m0, rows, nb * 32, cb);
    }
  }
}

// fp32 -> bf16 (round to nearest even, as oneDNN's vcvtneps2bf16) and back to fp32
static inline __m256i al_round_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m512 al_widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x [M, K] into a zero-padded [Mp, K] copy (Mp = M rounded up to 16)
static at::Tensor al_pad_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), Mp = (M + 15) / 16 * 16;
  if (Mp == M) return x.contiguous();
  auto xp = at::zeros({Mp, x.size(1)}, x.options());
  xp.narrow(0, 0, M).copy_(x);
  return xp;
}

// The walk of x [M, K] over the column blocks of wp on AMX tiles (x padded to 16 rows) or on
// dot products, split into ``parts`` contiguous ranges of blocks run in parallel:
// fn(t, rows, walk) per range t, rows the row count the walk covers (its epilogue's arrays),
// walk(epi) walking that range's blocks.
template <typename Fn>
static void al_run(const at::Tensor& x, const at::Tensor& wp, bool tiles, int64_t parts,
                   const Fn& fn) {
  const int64_t K = x.size(1), NB = wp.size(0) / 2;
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  if (tiles) {
#ifdef PF_HAVE_AMX
    auto xp = al_pad_rows(x);
    const int64_t Mp = xp.size(0);
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
    al_parallel(NB, parts, [&](int64_t t, int64_t nb0, int64_t nb1) {
      fn(t, Mp, [&](const auto& epi) {
        if (Mp > AL_WALK_ROWS && K > 256) al_blocks_kb(xs, Mp, K, ws, nb0, nb1, epi);
        else al_blocks(xs, Mp, K, ws, nb0, nb1, epi);
      });
    });
#endif
    return;
  }
  auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t nb0 = NB * t / parts, nb1 = NB * (t + 1) / parts;
      fn(t, M, [&](const auto& epi) { dp_blocks(xs, M, K, ws, nb0, nb1, epi); });
    }
  });
}
#endif

static void al_check(const at::Tensor& x, const at::Tensor& wp, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a bf16 [M, K] tensor");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() &&
                  wp.size(1) * 32 == x.size(1) && wp.size(2) == 512,
              "wp must be amx_pack_linear of an [N, K] weight");
  // amx_pack_linear's tile count exactly: a smaller N would leave whole 32-column blocks past
  // the output that the kernels still compute and store
  TORCH_CHECK(N > 0 && (N + 31) / 32 * 2 == wp.size(0), "N = ", N,
              " does not match wp (", wp.size(0),
              " 16-column tiles): wp must be amx_pack_linear of an [N, K] weight");
}

// Whether the AMX projection was built and this process may use the tile registers.
static bool amx_linear_available() {
#ifdef PF_HAVE_AMX
  return pf_amx_permitted();
#else
  return false;
#endif
}

// Whether the same projection on AVX512-BF16 dot products (tiles=false) was built.
static bool dp_linear_available() {
#ifdef AL_HAVE_DP
  return true;
#else
  return false;
#endif
}

static void al_check_kernel(bool tiles) {
  if (tiles) {
    TORCH_CHECK(amx_linear_available(), "no AMX tiles on this CPU or build");
  } else {
    TORCH_CHECK(dp_linear_available(), "no AVX512-BF16 in this build");
  }
}

// w [N, K] bf16 -> [NT, K / 32, 512] bf16, NT = N rounded up to 32, in 16-column tiles: tile
// (nt, kt) row p holds, for each of its 16 columns n, w[16 nt + n][32 kt + 2p .. + 1] (the B
// operand of TDPBF16PS); the columns past N are zero.
at::Tensor amx_pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be a bf16 [N, K] tensor");
  TORCH_CHECK(w.size(1) % 32 == 0, "K must be a multiple of 32");
  const int64_t N = w.size(0), K = w.size(1), NT = (N + 31) / 32 * 2, KT = K / 32;
  auto wc = w.contiguous();
  auto out = at::zeros({NT, KT, 512}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NT, 1, [&](int64_t b, int64_t e) {
    for (int64_t nt = b; nt < e; ++nt)
      for (int64_t kt = 0; kt < KT; ++kt) {
        uint16_t* t = dst + (nt * KT + kt) * 512;
        for (int64_t n = 0; n < 16 && nt * 16 + n < N; ++n) {
          const uint16_t* s = src + (nt * 16 + n) * K + kt * 32;
          for (int p = 0; p < 16; ++p) {
            t[p * 32 + n * 2] = s[2 * p];
            t[p * 32 + n * 2 + 1] = s[2 * p + 1];
          }
        }
      }
  });
  return out;
}

// y = x w^T, bf16 [M, N], for x [M, K] bf16 and wp = amx_pack_linear(w) of w [N, K]; on AMX
// tiles, or (tiles = false) on AVX512-BF16 dot products. ``stream``: whole aligned lines of y
// go past the cache (the LM head's logits, read once later); a layer's projection, whose
// output the next op reads at once, stores them plainly.
static at::Tensor al_linear(const at::Tensor& x, const at::Tensor& wp, int64_t N, bool tiles,
                            bool stream) {
  al_check(x, wp, N);
  al_check_kernel(tiles);
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
#ifdef AL_HAVE_DP
  if (M == 0) return y;
  uint16_t* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t parts = std::min<int64_t>(wp.size(0) / 2, at::get_num_threads());
  al_run(x, wp, tiles, parts, [&](int64_t, int64_t, const auto& walk) {
    walk([&](int64_t m0, int rows, int64_t n0, const float* cb) {
      // a row's 32 values as one 64-byte line: streamed past the cache where whole and aligned
      // (the logits are read once, by the sampler, after the whole matrix is written)
      const int64_t left = N - n0;
      if (left <= 0) return;  // a block wholly past N (none with al_check's N): nothing to store
      const __mmask32 keep = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1ull << left) - 1);
      for (int r = 0; r < rows && m0 + r < M; ++r) {
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(cb + r * 32 + 16),
                                                        _mm512_load_ps(cb + r * 32));
        uint16_t* dst = ys + (m0 + r) * N + n0;
        if (stream && left >= 32 && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
        else _mm512_mask_storeu_epi16(dst, keep, v);
      }
    });
    _mm_sfence();
  });
#endif
  return y;
}

at::Tensor amx_linear_bf16(const at::Tensor& x, const at::Tensor& wp, int64_t N, bool tiles) {
  return al_linear(x, wp, N, tiles, true);
}

// A layer's projection on AMX tiles (the ``amx`` linear plan): x [M, K] bf16 (any row stride
// of 1-element columns is made contiguous), wp = amx_pack_linear(w), N = w.size(0); y [M, N]
// stored plainly (in cache for the op after it).
at::Tensor amx_proj_bf16(const at::Tensor& x, const at::Tensor& wp, int64_t N) {
  return al_linear(x.contiguous(), wp, N, true, false);
}

// argmax_rows(amx_linear_bf16(x, wp, N, tiles)) without the logits: [M] int64.
at::Tensor amx_argmax_bf16(const at::Tensor& x, const at::Tensor& wp, int64_t N, bool tiles) {
  al_check(x, wp, N);
  al_check_kernel(tiles);
  const int64_t M = x.size(0);
  auto out = at::empty({M}, x.options().dtype(at::kLong));
#ifdef AL_HAVE_DP
  if (M == 0) return out;
  const int64_t NB = wp.size(0) / 2, parts = std::min<int64_t>(NB, at::get_num_threads());
  // each range's best value and index per row, merged in range order below
  std::vector<float> best(parts * M);
  std::vector<int64_t> best_i(parts * M);
  al_run(x, wp, tiles, parts, [&](int64_t t, int64_t Mp, const auto& walk) {
    const int64_t nb0 = NB * t / parts;
    // per row, 16 lanes of running maxima: lane j sees columns = j mod 16 in increasing order,
    // and a later one replaces the kept one only when strictly greater (the first index wins)
    std::vector<float> vmax(Mp * 16);
    std::vector<int32_t> vidx(Mp * 16);
    for (int64_t i = 0; i < Mp * 16; ++i) { vmax[i] = -INFINITY; vidx[i] = int32_t(nb0 * 32 + i % 16); }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    walk([&](int64_t m0, int rows, int64_t n0, const float* cb) {
      for (int h = 0; h < 2; ++h) {
        const int64_t n = n0 + 16 * h;
        if (n >= N) break;
        const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
        const __m512i cur = _mm512_add_epi32(_mm512_set1_epi32(int32_t(n)), lane);
        for (int r = 0; r < rows; ++r) {
          float* mx = vmax.data() + (m0 + r) * 16;
          int32_t* ix = vidx.data() + (m0 + r) * 16;
          const __m512 v = al_widen(al_round_bf16(_mm512_load_ps(cb + r * 32 + 16 * h)));
          const __m512 m = _mm512_loadu_ps(mx);
          const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, v, m, _CMP_GT_OQ);
          _mm512_storeu_ps(mx, _mm512_mask_blend_ps(gt, m, v));
          _mm512_storeu_si512(ix, _mm512_mask_blend_epi32(gt, _mm512_loadu_si512(ix), cur));
        }
      }
    });
    for (int64_t r = 0; r < M; ++r) {
      float b = vmax[r * 16];
      int64_t bi = vidx[r * 16];
      for (int j = 1; j < 16; ++j) {
        const float v = vmax[r * 16 + j];
        const int64_t i = vidx[r * 16 + j];
        if (v > b || (v == b && i < bi)) { b = v; bi = i; }
      }
      best[t * M + r] = b;
      best_i[t * M + r] = bi;
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float b = best[r];
    int64_t bi = best_i[r];
    for (int64_t t = 1; t < parts; ++t)
      if (best[t * M + r] > b) { b = best[t * M + r]; bi = best_i[t * M + r]; }
    op[r] = bi;
  }
#endif
  return out;
}

// This step's K and V of one layer into their slots: key / value [T, Hkv, D] in the pool's
// dtype, each token's heads contiguous (tokens any stride: views of the fused QKV output);
// slots [T] int64 or int32, slot = block * BS + offset, < 0 a padding token (skipped). Every
// slot is checked before anything is written. One row copy per token and K / V, where torch's
// indexed assignment costs a handful of small ops per layer.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv, int64_t layer,
              const at::Tensor& slots) {
  TORCH_CHECK(kv.dim() == 6 && kv.is_contiguous(), "kv must be a contiguous [NB,L,2,BS,Hkv,D] pool");
  TORCH_CHECK(kv.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  slots.device().is_cpu(), "write_kv here is for CPU tensors");
  const int64_t NB = kv.size(0), L = kv.size(1), BS = kv.size(3), Hkv = kv.size(4), D = kv.size(5);
  TORCH_CHECK(0 <= layer && layer < L, "layer ", layer, " out of range for ", L, " layers");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == Hkv &&
                  key.size(2) == D, "key and value must be [T, Hkv, D] of the pool's heads");
  TORCH_CHECK(key.scalar_type() == kv.scalar_type() && value.scalar_type() == kv.scalar_type(),
              "key and value must be in the pool's dtype");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == D && value.stride(2) == 1 &&
                  value.stride(1) == D, "each token's heads must be contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == key.size(0) && slots.is_contiguous() &&
                  (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt),
              "slots must be one contiguous int64 / int32 per token");
  const int64_t T = key.size(0), row = Hkv * D, es = kv.element_size();
  const int64_t s_kv = BS * row, s_layer = 2 * s_kv, s_block = L * s_layer;
  std::vector<int64_t> slot(T);
  for (int64_t i = 0; i < T; ++i) {
    slot[i] = slots.scalar_type() == at::kLong ? slots.data_ptr<int64_t>()[i]
                                                : slots.data_ptr<int32_t>()[i];
    TORCH_CHECK(slot[i] < NB * BS, "slot ", slot[i], " out of range for a pool of ", NB * BS);
  }
  char* pool = static_cast<char*>(kv.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t i = 0; i < T; ++i) {
    if (slot[i] < 0) continue;
    char* dst = pool + ((slot[i] / BS) * s_block + layer * s_layer + (slot[i] % BS) * row) * es;
    std::memcpy(dst, kp + i * key.stride(0) * es, row * es);
    std::memcpy(dst + s_kv * es, vp + i * value.stride(0) * es, row * es);
  }
}

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""): the packed projection
// of kernels/cpu_linear.py, called through the dispatcher (boxed: no C++ signature to match).
static at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w,
                                const c10::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The decoder layers of one decode step in one call: shared/models/llama.py's layer loop for a
// bf16 model whose projections all take one of the CPU linear plans' kernels and whose
// element-wise ops are the fused bf16 kernels above, with the same ops in the same order (so
// the same bits), minus the Python between them. ``linear`` names the projections' kernel:
// 0 oneDNN's packed primitive (the bias fused into it), 1 linear_bf16_avx2 on the plain
// weights, 2 amx_proj_bf16 on amx_pack_linear's tiles (the bias added after, as
// cpu_linear.linear does, for both; under 2 a weight left in oneDNN's packed layout, K not a
// multiple of 32, takes oneDNN's primitive as under 0). ``w`` holds 7 tensors per layer:
// input-norm weight, qkv (packed or plain), qkv bias (read only when ``qkv_bias``), o,
// post-attention-norm weight, gate_up, down; ``layers`` the pool index of each layer. Returns
// the residual stream after the last layer.
at::Tensor decode_layers_bf16(at::Tensor x, const at::Tensor& positions, at::Tensor& kv,
                              const at::Tensor& slots, const at::Tensor& tables,
                              const at::Tensor& lens, double scale, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t hq, int64_t hkv, int64_t d,
                              double eps, const std::vector<at::Tensor>& w,
                              const std::vector<int64_t>& layers, bool qkv_bias,
                              int64_t linear) {
  TORCH_CHECK(w.size() == 7 * layers.size(), "7 weights per layer");
  TORCH_CHECK(linear >= 0 && linear <= 2, "linear must be 0 (packed), 1 (avx2) or 2 (amx)");
  TORCH_CHECK(linear != 1 || avx2_gemm_supported(), "linear_bf16_avx2 was not built here");
  TORCH_CHECK(linear != 2 || amx_linear_available(), "no AMX tiles on this CPU or build");
  const int64_t t = x.size(0), qs = hq * d, ks = hkv * d;
  const c10::optional<at::Tensor> none;
  // one projection, as kernels/cpu_linear.py::linear makes it for the plan
  auto proj = [&](const at::Tensor& a, const at::Tensor& wt, const c10::optional<at::Tensor>& b) {
    // amx: a projection whose K is not a multiple of 32 keeps oneDNN's packed (opaque) weight
    if (linear == 0 || (linear == 2 && wt.is_mkldnn())) return packed_linear(a, wt, b);
    // amx: a tiled projection's N is a multiple of 32 (the caller checks), so wt's 16-column
    // tile count gives it
    at::Tensor y = linear == 2 ? amx_proj_bf16(a, wt, wt.size(0) * 16)
                               : linear_bf16_avx2(a.contiguous(), wt);
    return b.has_value() ? at::add(y, *b) : y;
  };
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor* lw = &w[7 * l];
    at::Tensor h = rms_norm_bf16(x.contiguous(), none, lw[0], eps)[0];
    at::Tensor qkv = proj(h, lw[1], qkv_bias ? c10::optional<at::Tensor>(lw[2]) : none);
    at::Tensor q = qkv.narrow(1, 0, qs).view({t, hq, d});
    at::Tensor k = qkv.narrow(1, qs, ks).view({t, hkv, d});
    at::Tensor v = qkv.narrow(1, qs + ks, ks).view({t, hkv, d});
    std::vector<at::Tensor> qk = rope_bf16(q, k, cos, sin, positions);
    write_kv(qk[1], v, kv, layers[l], slots);
    at::Tensor o = paged_decode(qk[0].contiguous(), kv, layers[l], tables, lens, scale, none, none);
    at::Tensor a = proj(o.reshape({t, qs}), lw[3], none);
    std::vector<at::Tensor> nt = rms_norm_bf16(a.contiguous(), x.contiguous(), lw[4], eps);
    at::Tensor gu = proj(nt[0], lw[5], none);
    at::Tensor m = silu_mul_bf16(gu.contiguous());
    x = at::add(nt[1], proj(m, lw[6], none));
  }
  return x;
}

// The kernels that run for a while (a whole decode step, an attention pass, a GEMM, the LM
// head) release the GIL, as torch's own operators do: the worker's event-loop thread then
// streams the previous step's tokens, answers health checks and drives KV transfers while the
// engine thread computes, instead of waiting for the call to return. They touch no Python
// object: their arguments are converted before the release and the result after it. The
// short element-wise ones keep the GIL (a hand-over would cost more than they take).
// tests/kernels/test_cpu_gil.py checks that another thread runs during each of them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_layers_bf16", &decode_layers_bf16, nogil,
        "a decode step's decoder layers in one call (bf16, packed or AVX2 projections, fused ops)");
  // the form of the builds before ``linear`` (packed projections), which the Python side calls
  // for them, so a bench's baseline extension built from older source takes the same call
  m.def(
      "decode_layers_bf16",
      [](at::Tensor x, const at::Tensor& positions, at::Tensor& kv, const at::Tensor& slots,
         const at::Tensor& tables, const at::Tensor& lens, double scale, const at::Tensor& cos,
         const at::Tensor& sin, int64_t hq, int64_t hkv, int64_t d, double eps,
         const std::vector<at::Tensor>& w, const std::vector<int64_t>& layers, bool qkv_bias) {
        return decode_layers_bf16(std::move(x), positions, kv, slots, tables, lens, scale, cos,
                                  sin, hq, hkv, d, eps, w, layers, qkv_bias, 0);
      },
      nogil, "decode_layers_bf16 with packed projections");
  m.def("paged_decode", &paged_decode, nogil, "paged decode attention (CPU)");
  m.def("decode_amx_available", &decode_amx_available,
        "whether decode attention can run shared groups on AMX tiles here");
  m.def("decode_amx_on", [] { return g_decode_amx.load(); },
        "whether decode attention runs shared groups on AMX tiles now");
  m.def("set_decode_amx", &set_decode_amx,
        "shared groups of decode attention on AMX tiles (true) or AVX-512 (false); returns the state");
  m.def("write_kv", &write_kv, "store a layer's new K / V rows into their slots (CPU)");
  m.def("argmax_rows", &argmax_rows, nogil, "row-wise argmax, first index of the maximum (CPU)");
  m.def("race_rows", &race_rows, nogil,
        "one draw per row: the exponential race over exp((x - max) / T) or weights x (CPU)");
  m.def("cut_rows", &cut_rows, nogil,
        "per row exp((x - max) / T) cut by top-k, top-p and min-p, unnormalised (CPU)");
  m.def("linear_bf16", &linear_bf16, nogil, "x @ w.T for bf16 with few rows (AVX512-BF16)");
  m.def("avx2_gemm_supported", &avx2_gemm_supported, "whether linear_bf16_avx2 was built");
  m.def("linear_bf16_avx2", &linear_bf16_avx2, nogil,
        "x @ w.T for bf16 on AVX2 + FMA (bf16 widened to fp32, fp32 FMAs)");
  m.def("prefill_bf16", &prefill_bf16, nogil,
        "causal prefill attention of one sequence, bf16 (tile 0 AVX512-BF16, 1 AMX, 2 AVX2)");
  m.def("prefill_avx2_available", &prefill_avx2_available,
        "whether the AVX2 + FMA prefill tile was built (CPUs without bf16 dot products)");
  m.def("prefill_amx_available", &prefill_amx_available,
        "whether the AMX prefill tile was built and the process may use AMX tiles");
  m.def("paged_prefill_bf16", &paged_prefill_bf16, nogil,
        "causal prefill attention of a step's multi-token chunks from the block pool, bf16");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm (after a residual add), bf16 (AVX512-BF16)");
  m.def("rope_bf16", &rope_bf16, "rotate-half RoPE of q and k, bf16 (AVX512-BF16)");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up, bf16 (AVX512-BF16, else portable)");
  m.def("amx_linear_available", &amx_linear_available,
        "whether the AMX projection was built and may use the tile registers");
  m.def("amx_pack_linear", &amx_pack_linear, "an [N, K] bf16 weight in amx_linear's tile layout");
  m.def("dp_linear_available", &dp_linear_available,
        "whether amx_linear_bf16 / amx_argmax_bf16 run without tiles (AVX512-BF16)");
  m.def("amx_proj_bf16", &amx_proj_bf16, nogil,
        "a layer's projection on AMX tiles from amx_pack_linear's layout (y stored plainly)");
  m.def("amx_linear_bf16", &amx_linear_bf16, nogil,
        "x @ w.T from the packed weight, read once (bf16; AMX tiles or AVX512-BF16)");
  m.def("amx_argmax_bf16", &amx_argmax_bf16, nogil,
        "argmax of each row of x @ w.T, without the logits (bf16; AMX tiles or AVX512-BF16)");
  m.def("bf16_gemm_supported", &bf16_gemm_supported, "whether linear_bf16 was built");
}
