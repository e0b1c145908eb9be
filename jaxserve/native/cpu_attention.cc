// Ragged paged attention for the CPU, called from JAX through the XLA FFI.
//
// Why native: XLA:CPU runs the pure-XLA path (jaxserve/runtime/attention.py) as gathers and
// batched dots over tiles of a few dozen keys, and pays per-op overhead far above the bytes and
// flops the step needs (docs/performance.md). This loop reads each row's pages once, in place.
//
// Semantics are those of PagedMeta's page-table layout (jaxserve/runtime/kv_cache.py): row r's
// queries are the flat tokens [query_start[r], query_start[r + 1]) at positions
// context_lens[r] - q_len + i, and query i sees the row's keys at positions <= its own.
// Flat tokens of no row get zeros. Work items are (row, KV head, block of kQueryBlock queries),
// taken from a shared counter by the calling thread and by tasks on XLA's intra-op pool.
//
// Key and value rows are read in place, widened to float32 in registers. Items of few query
// vectors (decode) score each key row directly (scores_rows); longer ones transpose each key tile
// once for all their queries (scores_transposed).
//
// int8 cache (a second target, jaxserve/runtime/kv_quant.py): int8 codes plus float32 scales
// [L, N, BS, K], one per (token, KV head): a key's scale multiplies its scores, a value's its
// softmax weights (the transposed key tile is dequantized as it is written).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kKeyTile = 16;     // keys scored together: one AVX-512 register of f32 lanes
constexpr int kQueryBlock = 16;  // queries of one row in one work item
constexpr float kMask = -1e30f;  // finite, as attention.py's MASK_VALUE

// 16 float lanes (GCC/Clang vector extensions: one AVX-512 register, or two AVX2 ones).
typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads
typedef int32_t I16 __attribute__((vector_size(64)));
const V16 kLanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

typedef uint16_t U16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int8_t S8x16 __attribute__((vector_size(16), aligned(1)));

// 16 consecutive elements as float32 lanes: float32, bfloat16 (bits, widened exactly), int8.
inline V16 load16(const float* p) { return *reinterpret_cast<const V16u*>(p); }
inline V16 load16(const uint16_t* p) {
  const U32x16 w = __builtin_convertvector(*reinterpret_cast<const U16x16*>(p), U32x16) << 16;
  V16 f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}
inline V16 load16(const int8_t* p) {
#if defined(__AVX512F__)  // GCC 12 scalarizes the portable form (a move per lane)
  return (V16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
  return __builtin_convertvector(*reinterpret_cast<const S8x16*>(p), V16);
#endif
}
// Horizontal max and sum in four shuffle steps (halves, quarters, pairs, neighbours).
#define JS_SWAP(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
inline V16 vmax(V16 a, V16 b) { return a > b ? a : b; }
inline float hmax(V16 x) {
  x = vmax(x, JS_SWAP(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = vmax(x, JS_SWAP(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = vmax(x, JS_SWAP(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = vmax(x, JS_SWAP(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}
inline float hsum(V16 x) {
  x += JS_SWAP(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += JS_SWAP(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += JS_SWAP(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += JS_SWAP(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}
#undef JS_SWAP
// exp(x) for x <= 0 (scores minus their running max): 2^n * 2^f, n = round(x log2 e),
// |f| <= 1/2, 2^f by its degree-6 Taylor series (relative error ~1e-7). Inputs below -87
// (where float32 exp underflows) give ~1e-38, which the softmax sums treat as 0.
inline V16 vexp(V16 x) {
  x = x < -87.0f ? V16{} - 87.0f : x;
  const V16 t = x * 1.4426950408889634f;
  const V16 nf = __builtin_convertvector(__builtin_convertvector(t + (t < 0 ? -0.5f : 0.5f), I16), V16);
  const V16 f = (t - nf) * 0.6931471805599453f;
  V16 p = 1.0f / 720 + f * 0;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const I16 bits = (__builtin_convertvector(nf, I16) + 127) << 23;
  V16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float to_f32(float x) { return x; }
inline float to_f32(int8_t x) { return float(x); }
inline float to_f32(uint16_t bits) {  // bfloat16: the high half of a float32
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* query_start;   // [R + 1]
  const int32_t* context_lens;  // [R]
  const int32_t* page_table;    // [R, max_blocks]
  float* out;                   // [T, H, Dh]
  const float* k_scale;         // int8 cache: [L, N, BS, K]; else null
  const float* v_scale;
  int64_t layer, num_blocks, block_size, kv_heads, heads, head_dim, max_blocks;
  float scale;
};

struct Item {
  int32_t row, kv_head, first_query;
};

// Query vectors scored together against one key tile: each key row is loaded once for all of
// them, and their accumulators stay in registers (4 vectors x 16 lanes per head-dim chunk).
constexpr int kVecs = 4;

// Online-softmax update and PV of query vectors [v0, v0 + kVecs) for one key tile, given their
// scores sc[u] (lanes over the tile's keys); vrows[s]: the tile's value rows (Dh elements each,
// read in place), times vscale[s] where not null (an int8 cache: folded into the weights).
// visible[u]: keys of the tile vector u sees (<= 0: none).
// NU: the group's vectors that are not padding (u >= NU: skipped, never read back).
template <int NU, typename VT>
inline void softmax_pv_n(int64_t dh, int64_t v0, const int32_t* visible, const V16* sc,
                         const VT* const* vrows, const float* vscale, float* acc, float* m,
                         float* l) {
  V16 pr[NU];
  float corr[NU];
  int32_t span = 0;
  for (int u = 0; u < NU; ++u) {
    const int64_t vi = v0 + u;
    const I16 live = kLanes < float(visible[u]);  // lanes of keys vector u sees
    const V16 s = live ? sc[u] : V16{} + kMask;
    const float m_new = std::max(m[vi], hmax(s));
    corr[u] = std::exp(m[vi] - m_new);
    pr[u] = live ? vexp(s - m_new) : V16{};
    l[vi] = l[vi] * corr[u] + hsum(pr[u]);
    m[vi] = m_new;
    span = std::max(span, visible[u]);
  }
  if (vscale)
    for (int u = 0; u < NU; ++u) pr[u] *= load16(vscale);
  for (int64_t c = 0; c < dh; c += 16) {
    V16 a[NU];
    for (int u = 0; u < NU; ++u) a[u] = load16(acc + (v0 + u) * dh + c) * corr[u];
    for (int32_t s = 0; s < span; ++s) {
      const V16 vv = load16(vrows[s] + c);
      for (int u = 0; u < NU; ++u) a[u] += pr[u][s] * vv;
    }
    for (int u = 0; u < NU; ++u) {
      std::memcpy(acc + (v0 + u) * dh + c, &a[u], sizeof a[u]);
    }
  }
}

template <typename VT>
inline void softmax_pv(int64_t nu, int64_t dh, int64_t v0, const int32_t* visible, const V16* sc,
                       const VT* const* vrows, const float* vscale, float* acc, float* m,
                       float* l) {
  static_assert(kVecs == 4, "one case per live vector count");
  switch (nu) {
    case 1: return softmax_pv_n<1>(dh, v0, visible, sc, vrows, vscale, acc, m, l);
    case 2: return softmax_pv_n<2>(dh, v0, visible, sc, vrows, vscale, acc, m, l);
    case 3: return softmax_pv_n<3>(dh, v0, visible, sc, vrows, vscale, acc, m, l);
    default: return softmax_pv_n<4>(dh, v0, visible, sc, vrows, vscale, acc, m, l);
  }
}

// Scores of query vectors [v0, v0 + kVecs) against one tile of keys kt `[Dh, kKeyTile]`
// (transposed: one broadcast query element times a register of 16 keys per step).
inline void scores_transposed(int64_t dh, int64_t v0, const float* qv, const float* kt, V16* sc) {
  const float* qr[kVecs];
  for (int u = 0; u < kVecs; ++u) qr[u] = qv + (v0 + u) * dh, sc[u] = V16{};
  for (int64_t d = 0; d < dh; ++d) {
    const V16 kd = load16(kt + d * kKeyTile);
    for (int u = 0; u < kVecs; ++u) sc[u] += qr[u][d] * kd;
  }
}

// Adds pairs of vectors a, b holding partial sums of keys in runs of 2w lanes (a's keys, then
// b's) into one vector holding them in runs of w lanes: lanes [0, w) of each run of 2w plus
// lanes [w, 2w), interleaving a's runs and b's.
#define JS_PAIR_ADD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
inline V16 fold8(V16 a, V16 b) {
  return JS_PAIR_ADD(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         JS_PAIR_ADD(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline V16 fold4(V16 a, V16 b) {
  return JS_PAIR_ADD(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         JS_PAIR_ADD(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline V16 fold2(V16 a, V16 b) {
  return JS_PAIR_ADD(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         JS_PAIR_ADD(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline V16 fold1(V16 a, V16 b) {
  return JS_PAIR_ADD(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         JS_PAIR_ADD(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef JS_PAIR_ADD

// Scores of query vector q against one tile of key rows (Dh floats each, not transposed): per
// key a register of lane-wise partial products, then a tree of shuffles and adds turns the 16
// registers into one whose lane j is key j's score. For few query vectors (decode) this beats
// transposing the tile, which costs a scalar move per key element whatever the query count.
template <typename KT>
inline V16 scores_rows(int64_t dh, const float* q, const KT* const* krows) {
  V16 p[kKeyTile];
  for (int j = 0; j < kKeyTile; ++j) {
    V16 s = load16(q) * load16(krows[j]);
    for (int64_t c = 16; c < dh; c += 16) s += load16(q + c) * load16(krows[j] + c);
    p[j] = s;
  }
  V16 h[8], w[4], t[2];
  for (int i = 0; i < 8; ++i) h[i] = fold8(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) w[i] = fold4(h[2 * i], h[2 * i + 1]);
  for (int i = 0; i < 2; ++i) t[i] = fold2(w[2 * i], w[2 * i + 1]);
  return fold1(t[0], t[1]);
}

// Query vectors up to which an item scores key rows in place (scores_rows) instead of
// transposing each key tile first: decode items have G (the query heads per KV head) vectors.
constexpr int64_t kRowsMaxVecs = 8;

template <typename T>
inline void prefetch_row(const T* p, int64_t dh) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < int64_t(dh * sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

// One work item: queries [first_query, first_query + n) of `row` (n <= kQueryBlock), the G query
// heads of `kv_head`, over the keys the last of them sees, in tiles of kKeyTile keys. Query
// vector i * G + j is query i's head j of the group; vectors past n * G (rounding up to kVecs)
// are zero padding that sees no key.
template <typename QT, typename KT>
void attend_item(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t g = p.heads / p.kv_heads, dh = p.head_dim;
  const int32_t q0 = p.query_start[it.row], q_len = p.query_start[it.row + 1] - q0;
  const int32_t ctx = p.context_lens[it.row];
  const int32_t n = std::min<int32_t>(kQueryBlock, q_len - it.first_query);
  const int32_t base = ctx - q_len + it.first_query;  // position of the item's first query
  const int64_t nv = int64_t(n) * g;
  const int64_t nvp = (nv + kVecs - 1) / kVecs * kVecs;
  scratch.assign(size_t(nvp * dh * 2 + nvp * 2 + dh * kKeyTile), 0.0f);
  float* qv = scratch.data();   // [nvp, Dh], scaled
  float* acc = qv + nvp * dh;   // [nvp, Dh]
  float* m = acc + nvp * dh;    // [nvp]
  float* l = m + nvp;           // [nvp]
  float* kt = l + nvp;          // [Dh, kKeyTile]: keys transposed, lanes over keys
  const QT* q = static_cast<const QT*>(p.q);
  for (int64_t vi = 0; vi < nv; ++vi) {
    const int64_t i = vi / g, j = vi % g;
    const QT* src = q + ((int64_t(q0 + it.first_query + i) * p.heads) + it.kv_head * g + j) * dh;
    for (int64_t d = 0; d < dh; ++d) qv[vi * dh + d] = to_f32(src[d]) * p.scale;
  }
  std::fill(m, m + nvp, kMask);
  const KT* kc = static_cast<const KT*>(p.k);
  const KT* vc = static_cast<const KT*>(p.v);
  const int32_t* table = p.page_table + int64_t(it.row) * p.max_blocks;
  const int32_t key_end = base + n;  // keys [0, key_end) are seen by some query of the item
  const bool in_rows = nvp <= kRowsMaxVecs;
  constexpr bool kInt8 = std::is_same_v<KT, int8_t>;
  auto row_at = [&](int32_t pos) {  // element offset of key `pos`'s row (this head, layer)
    const int64_t blk = table[pos / p.block_size], off = pos % p.block_size;
    return (((p.layer * p.num_blocks + blk) * p.block_size + off) * p.kv_heads + it.kv_head) * dh;
  };
  for (int32_t s0 = 0; s0 < key_end; s0 += kKeyTile) {
    const int32_t ns = std::min<int32_t>(kKeyTile, key_end - s0);
    // The next tile's rows are in pages the hardware prefetcher cannot guess.
    for (int32_t pos = s0 + kKeyTile; pos < std::min(s0 + 2 * kKeyTile, key_end); ++pos) {
      const int64_t at = row_at(pos);
      prefetch_row(kc + at, dh);
      prefetch_row(vc + at, dh);
    }
    const KT* krows[kKeyTile];
    const KT* vrows[kKeyTile];  // read in place, whatever the cache dtype
    alignas(64) float kscale[kKeyTile], vscale[kKeyTile];  // int8: per (token, head)
    for (int32_t j = 0; j < kKeyTile; ++j) {  // lanes past the context repeat the last key
      const int64_t at = row_at(s0 + std::min(j, ns - 1));
      krows[j] = kc + at;
      vrows[j] = vc + at;
      if constexpr (kInt8) kscale[j] = p.k_scale[at / dh], vscale[j] = p.v_scale[at / dh];
    }
    if (!in_rows) {
      for (int64_t d = 0; d < dh; ++d) {  // transposed: written in order, read from 16 rows
        if constexpr (kInt8) {  // dequantized: codes * (token, head) scale
          for (int32_t j = 0; j < kKeyTile; ++j)
            kt[d * kKeyTile + j] = to_f32(krows[j][d]) * kscale[j];
        } else {
          for (int32_t j = 0; j < kKeyTile; ++j) kt[d * kKeyTile + j] = to_f32(krows[j][d]);
        }
      }
    }
    for (int64_t v0 = 0; v0 < nvp; v0 += kVecs) {
      int32_t visible[kVecs];
      int32_t any = 0;
      for (int u = 0; u < kVecs; ++u) {  // causal: query i sees keys at positions <= its own
        const int64_t vi = v0 + u;
        visible[u] = vi < nv ? std::min<int32_t>(ns, base + int32_t(vi / g) - s0 + 1) : 0;
        any = std::max(any, visible[u]);
      }
      if (any <= 0) continue;
      V16 sc[kVecs];
      if (in_rows) {
        for (int u = 0; u < kVecs; ++u) {
          sc[u] = visible[u] > 0 ? scores_rows(dh, qv + (v0 + u) * dh, krows) : V16{};
          if constexpr (kInt8) sc[u] *= load16(kscale);
        }
      } else {
        scores_transposed(dh, v0, qv, kt, sc);
      }
      softmax_pv(std::min<int64_t>(kVecs, nv - v0), dh, v0, visible, sc, vrows,
                 kInt8 ? vscale : nullptr, acc, m, l);
    }
  }
  for (int64_t vi = 0; vi < nv; ++vi) {
    const int64_t i = vi / g, j = vi % g;
    float* dst = p.out + ((int64_t(q0 + it.first_query + i) * p.heads) + it.kv_head * g + j) * dh;
    const float inv = 1.0f / std::max(l[vi], 1e-30f);
    for (int64_t d = 0; d < dh; ++d) dst[d] = acc[vi * dh + d] * inv;
  }
}

// Items shared by the caller and pool tasks. A task that starts after the work ran out does
// nothing; the caller waits only for items already claimed, so it never waits on a task the
// pool has not started (the pool's threads may all be busy, e.g. in another such call).
struct Shared {
  Problem problem;
  std::vector<Item> items;
  void (*fn)(const Problem&, const Item&, std::vector<float>&);
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    std::vector<float> scratch;
    int64_t ran = 0;
    for (int64_t i; (i = next.fetch_add(1)) < int64_t(items.size());) {
      fn(problem, items[i], scratch);
      ++ran;
    }
    if (ran && done.fetch_add(ran) + ran == int64_t(items.size())) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

template <typename QT, typename KT>
void run_item(const Problem& p, const Item& it, std::vector<float>& scratch) {
  attend_item<QT, KT>(p, it, scratch);
}

using ItemFn = void (*)(const Problem&, const Item&, std::vector<float>&);

ItemFn pick(ffi::DataType q, ffi::DataType kv) {
  using D = ffi::DataType;
  if (q == D::F32 && kv == D::F32) return run_item<float, float>;
  if (q == D::F32 && kv == D::BF16) return run_item<float, uint16_t>;
  if (q == D::BF16 && kv == D::F32) return run_item<uint16_t, float>;
  if (q == D::BF16 && kv == D::BF16) return run_item<uint16_t, uint16_t>;
  return nullptr;
}

ItemFn pick_int8(ffi::DataType q) {
  using D = ffi::DataType;
  if (q == D::F32) return run_item<float, int8_t>;
  if (q == D::BF16) return run_item<uint16_t, int8_t>;
  return nullptr;
}

// k_scale/v_scale: an int8 cache's scales [L, N, BS, K], or null (float caches).
ffi::Error Run(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               const float* k_scale, const float* v_scale, ffi::Buffer<ffi::S32> layer,
               ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> context_lens,
               ffi::Buffer<ffi::S32> page_table, ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument(
        "expected q [T, H, Dh], k/v [L, N, BS, K, Dh], table [R, M]; got ranks " +
        std::to_string(qd.size()) + ", " + std::to_string(kd.size()) + ", " +
        std::to_string(td.size()));
  ItemFn fn;
  if (k_scale) {
    if (k.element_type() != ffi::DataType::S8)
      return ffi::Error::InvalidArgument("the int8 target takes an int8 cache");
    fn = pick_int8(q.element_type());
    if (!fn) return ffi::Error::InvalidArgument("q must be float32 or bfloat16");
  } else {
    fn = pick(q.element_type(), k.element_type());
    if (!fn) return ffi::Error::InvalidArgument(
        "q and the cache must be float32 or bfloat16 (an int8 cache: the int8 target)");
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p = Problem{q.untyped_data(), k.untyped_data(), v.untyped_data(), query_start.typed_data(),
              context_lens.typed_data(), page_table.typed_data(), out->typed_data(),
              k_scale, v_scale,
              layer.typed_data()[0], kd[1], kd[2], kd[3], qd[1], qd[2], td[1], scale};
  if (kd[4] != qd[2] || qd[1] % kd[3] != 0 || qd[2] % 16 != 0)
    return ffi::Error::InvalidArgument(
        "head_dim (a multiple of 16) or head counts of q and the cache disagree");
  std::fill(p.out, p.out + qd[0] * qd[1] * qd[2], 0.0f);
  const int64_t rows = td[0];
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t q_len = p.query_start[r + 1] - p.query_start[r];
    for (int32_t first = 0; first < q_len; first += kQueryBlock)
      for (int32_t h = 0; h < p.kv_heads; ++h) shared->items.push_back({r, h, first});
  }
  if (shared->items.empty()) return ffi::Error::Success();
  shared->fn = fn;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), int64_t(shared->items.size()) - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == int64_t(shared->items.size()); });
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> query_start,
                ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> page_table,
                ffi::ResultBuffer<ffi::F32> out, float scale) {
  return Run(pool, q, k, v, nullptr, nullptr, layer, query_start, context_lens, page_table, out,
             scale);
}

ffi::Error ImplInt8(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> query_start,
                    ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> page_table,
                    ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto kd = k.dimensions(), sd = k_scale.dimensions(), vd = v_scale.dimensions();
  bool ok = kd.size() == 5 && sd.size() == 4 && vd.size() == 4;
  for (size_t i = 0; ok && i < 4; ++i) ok = sd[i] == kd[i] && vd[i] == kd[i];
  if (!ok)
    return ffi::Error::InvalidArgument("int8 cache scales must be [L, N, BS, K], the cache's "
                                       "shape less head_dim");
  return Run(pool, q, k, v, k_scale.typed_data(), v_scale.typed_data(), layer, query_start,
             context_lens, page_table, out, scale);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q [T, H, Dh]
                                  .Arg<ffi::AnyBuffer>()  // k cache [L, N, BS, K, Dh]
                                  .Arg<ffi::AnyBuffer>()  // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table [R, M]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, Dh]
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionInt8, ImplInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q [T, H, Dh]
                                  .Arg<ffi::AnyBuffer>()  // k codes [L, N, BS, K, Dh] int8
                                  .Arg<ffi::AnyBuffer>()  // v codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales [L, N, BS, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table [R, M]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, Dh]
                                  .Attr<float>("scale"));
