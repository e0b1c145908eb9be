// Float-weight matmul for few rows on the CPU (float32 or bfloat16 weights, float32
// activations and accumulation), called from JAX through the XLA FFI.
//
// Why native: at a handful of rows (decode, a speculative verify step) a linear is a stream of
// its weight. XLA:CPU's float32 dot packs the weight for its GEMM on every call once there is
// more than one row, and its bfloat16 product is a slow matrix-vector kernel at one row
// (docs/performance.md, "Native float matmul"). This loop reads each weight byte once per
// call and multiplies it into all M rows; bfloat16 is widened to float32 in registers (exact:
// the 16 bits shifted left), so a bfloat16 weight costs half the bytes of a float32 one.
//
//   y[m, n] = sum_k x[m, k] w[k, n]   (w [K, N]: the dense kernels, transposed = 0)
//   y[m, n] = sum_k x[m, k] w[n, k]   (w [N, K]: the tied LM head x @ E^T, transposed = 1)
//
// The weight keeps its stored layout (XLA's dot reads the same array at many rows). Work items
// are ranges of outputs, shared by the calling thread and XLA's intra-op pool (cpu_work.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include <immintrin.h>

#include "cpu_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinSplitBytes = 96 << 10;  // below: one thread (see Impl)

// Loops over registers unrolled before GCC decides where arrays of them live: otherwise the
// accumulators are stored to the stack on every step.
#define JAXSERVE_UNROLL _Pragma("GCC unroll 16")

struct Problem {
  const float* x;  // [M, K]
  const void* w;   // [K, N] or [N, K], float32 or bfloat16 (uint16 bits)
  float* out;      // [M, N]
  int64_t m, k, n;
};

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bfloat16 -> float32, exact
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kAvx512 = true;

// Sixteen weights from p (the lanes in `mask`, zeros elsewhere), as float32.
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// w [K, N]: rows [r0, r0 + R) against the V * 16 columns from n0 over weight rows [k0, k1),
// all R rows in one pass (R V accumulators <= 16 registers): up to 8 rows take 32 columns a
// pass, up to 16 rows 16 columns. An item of kItemKn columns walks the weight in blocks of
// kBlockK rows, left to right across its tiles within each: each weight line is read from
// memory once per call, in runs the hardware prefetcher follows, and the software prefetch
// fetches the next block (rows N apart would otherwise wait on memory one by one).
constexpr int kCols = 32;              // columns per tile
constexpr int64_t kBlockK = 32;        // weight rows per block (and the prefetch distance)

template <int R, int V, typename WT>
void kn_rows(const Problem& p, int64_t n0, int64_t r0, int64_t k0, int64_t k1) {
  const WT* w = static_cast<const WT*>(p.w);
  const int64_t n = p.n, k = p.k;
  __mmask16 mask[V];
  for (int v = 0; v < V; ++v) mask[v] = lanes(std::max<int64_t>(0, n - n0 - 16 * v));
  float* out = p.out + r0 * n + n0;
  __m512 acc[R][V];
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int v = 0; v < V; ++v)
      acc[r][v] = k0 == 0 ? _mm512_setzero_ps()
                          : _mm512_maskz_loadu_ps(mask[v], out + r * n + 16 * v);
  const float* x = p.x + r0 * k;
  const bool prefetch = k1 + kBlockK <= k;
  for (int64_t kk = k0; kk < k1; ++kk) {
    const WT* row = w + kk * n + n0;
    if (prefetch)
      for (int b = 0; b < int(sizeof(WT)) * 16 * V; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kBlockK * n) + b, _MM_HINT_T0);
    __m512 wv[V];
    JAXSERVE_UNROLL for (int v = 0; v < V; ++v) wv[v] = load16(row + 16 * v, mask[v]);
    JAXSERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + kk]);
      JAXSERVE_UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(out + r * n + 16 * v, mask[v], acc[r][v]);
}

template <int R, typename WT>
void kn_item(const Problem& p, int64_t n0, int64_t n1, int64_t r0) {
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    const int64_t k1 = std::min(p.k, k0 + kBlockK);
    for (int64_t j = n0; j < n1; j += kCols) {
      if constexpr (R <= 8) {
        kn_rows<R, 2, WT>(p, j, r0, k0, k1);
      } else {
        kn_rows<R, 1, WT>(p, j, r0, k0, k1);
        if (j + 16 < p.n) kn_rows<R, 1, WT>(p, j + 16, r0, k0, k1);
      }
    }
  }
}

template <typename WT>
void kn_all_rows(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < p.m; r0 += 16) {
    switch (std::min<int64_t>(16, p.m - r0)) {
#define JAXSERVE_ROWS(R) case R: kn_item<R, WT>(p, n0, n1, r0); break;
      JAXSERVE_ROWS(1) JAXSERVE_ROWS(2) JAXSERVE_ROWS(3) JAXSERVE_ROWS(4)
      JAXSERVE_ROWS(5) JAXSERVE_ROWS(6) JAXSERVE_ROWS(7) JAXSERVE_ROWS(8)
      JAXSERVE_ROWS(9) JAXSERVE_ROWS(10) JAXSERVE_ROWS(11) JAXSERVE_ROWS(12)
      JAXSERVE_ROWS(13) JAXSERVE_ROWS(14) JAXSERVE_ROWS(15) JAXSERVE_ROWS(16)
#undef JAXSERVE_ROWS
      default: break;
    }
  }
}

// w [N, K]: blocks of OUTS outputs (weight rows), dot products along K, reduced at the end.
constexpr int kOuts = 4;
constexpr int kMaxRowsT = 4;           // R OUTS accumulators <= 16 registers

template <int R, int OUTS, typename WT>
void nk_rows(const Problem& p, int64_t n0, int64_t r0) {
  const WT* w = static_cast<const WT*>(p.w) + n0 * p.k;
  const int64_t k = p.k, n = p.n;
  const float* x = p.x + r0 * k;
  __m512 acc[R][OUTS];
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int j = 0; j < OUTS; ++j) acc[r][j] = _mm512_setzero_ps();
  // The next block's weight rows, a block ahead: at several rows the dot products take long
  // enough per block for memory to idle between the hardware prefetcher's streams.
  const bool prefetch = n0 + 2 * OUTS <= n;
  for (int64_t kk = 0; kk < k; kk += 16) {
    const __mmask16 mask = lanes(k - kk);
    if (prefetch)
      JAXSERVE_UNROLL for (int j = 0; j < OUTS; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (OUTS + j) * k + kk), _MM_HINT_T0);
    __m512 xv[R];
    JAXSERVE_UNROLL for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * k + kk);
    JAXSERVE_UNROLL for (int j = 0; j < OUTS; ++j) {
      const __m512 wv = load16(w + j * k + kk, mask);
      JAXSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  float* out = p.out + r0 * n + n0;
  JAXSERVE_UNROLL for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL for (int j = 0; j < OUTS; ++j) out[r * n + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int R, typename WT>
void nk_block(const Problem& p, int64_t n0, int64_t r0) {
  switch (std::min<int64_t>(kOuts, p.n - n0)) {
    case 4: nk_rows<R, 4, WT>(p, n0, r0); break;
    case 3: nk_rows<R, 3, WT>(p, n0, r0); break;
    case 2: nk_rows<R, 2, WT>(p, n0, r0); break;
    case 1: nk_rows<R, 1, WT>(p, n0, r0); break;
    default: break;
  }
}

// Rows in balanced blocks of at most kMaxRowsT (9 rows: 3 + 3 + 3, not 4 + 4 + 1).
template <typename WT>
void nk_all_rows(const Problem& p, int64_t n0) {
  const int64_t blocks = (p.m + kMaxRowsT - 1) / kMaxRowsT;
  for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
    const int64_t r = (p.m - r0 + (blocks - b) - 1) / (blocks - b);
    switch (r) {
      case 1: nk_block<1, WT>(p, n0, r0); break;
      case 2: nk_block<2, WT>(p, n0, r0); break;
      case 3: nk_block<3, WT>(p, n0, r0); break;
      case 4: nk_block<4, WT>(p, n0, r0); break;
      default: break;
    }
    r0 += r;
  }
}

// Outputs per work item: 4 tiles for w [K, N] (a 576-wide layer splits into 5 items, a
// 1536-wide one into 12); 64 weight rows (16 blocks) for w [N, K].
constexpr int64_t kItemKn = 4 * kCols;
constexpr int64_t kItemNk = 64;

template <typename WT, bool T>
void run_outputs(const Problem& p, int64_t n0, int64_t n1) {
  if constexpr (T) {
    for (int64_t j = n0; j < n1; j += kOuts) nk_all_rows<WT>(p, j);
  } else {
    kn_all_rows<WT>(p, n0, n1);
  }
}
#else
constexpr bool kAvx512 = false;
constexpr int64_t kItemKn = 32;
constexpr int64_t kItemNk = 64;

// Portable loop (machines without AVX-512): the same float32 sums, one output at a time.
template <typename WT, bool T>
void run_outputs(const Problem& p, int64_t n0, int64_t n1) {
  const WT* w = static_cast<const WT*>(p.w);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t j = n0; j < n1; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < p.k; ++kk)
        acc += p.x[r * p.k + kk] * widen(T ? w[j * p.k + kk] : w[kk * p.n + j]);
      p.out[r * p.n + j] = acc;
    }
}
#endif

using OutputsFn = void (*)(const Problem&, int64_t, int64_t);

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                ffi::ResultBuffer<ffi::F32> out, int32_t transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("expected x [M, K] and a 2-D weight");
  const bool t = transposed != 0;
  const int64_t m = xd[0], k = xd[1], n = t ? wd[0] : wd[1];
  if ((t ? wd[1] : wd[0]) != k)
    return ffi::Error::InvalidArgument("the weight's " + std::string(t ? "[N, K]" : "[K, N]") +
                                       " does not match K = " + std::to_string(k));
  const ffi::DataType wt = w.element_type();
  OutputsFn fn = nullptr;
  if (wt == ffi::DataType::F32) fn = t ? run_outputs<float, true> : run_outputs<float, false>;
  if (wt == ffi::DataType::BF16)
    fn = t ? run_outputs<uint16_t, true> : run_outputs<uint16_t, false>;
  if (!fn) return ffi::Error::InvalidArgument("the weight must be float32 or bfloat16");
  if (m == 0 || n == 0) return ffi::Error::Success();
  Problem p{x.typed_data(), w.untyped_data(), out->typed_data(), m, k, n};
  if (k == 0) {
    std::fill(p.out, p.out + m * n, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t per_item = t ? kItemNk : kItemKn;
  const int64_t items = (n + per_item - 1) / per_item;
  const int64_t bytes = int64_t(w.size_bytes());
  jaxserve::run_items(pool, items, bytes * m >= kMinSplitBytes, [&p, fn, per_item](int64_t i) {
    fn(p, i * per_item, std::min(p.n, (i + 1) * per_item));
  });
  return ffi::Error::Success();
}

}  // namespace

// 1 where the library was built with the AVX-512 loops, 0 for the portable one (ctypes query).
extern "C" int jaxserve_float_matmul_avx512() { return kAvx512 ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFloatMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, N] / [N, K] f32 / bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("transposed"));
