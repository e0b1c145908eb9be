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

// w [K, N]: output tiles of kCols columns; rows [r0, r0 + R) against tile [n0, n0 + kCols).
constexpr int kVecs = 2;               // zmm registers per tile row
constexpr int kCols = 16 * kVecs;
constexpr int kMaxRows = 8;            // R kVecs accumulators <= 16 registers
constexpr int kPrefetchRows = 8;       // software prefetch distance, in weight rows

template <int R, typename WT>
void kn_rows(const Problem& p, int64_t n0, int64_t r0) {
  const WT* w = static_cast<const WT*>(p.w);
  const int64_t n = p.n, k = p.k;
  __mmask16 mask[kVecs];
  for (int v = 0; v < kVecs; ++v) mask[v] = lanes(std::max<int64_t>(0, n - n0 - 16 * v));
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  const float* x = p.x + r0 * k;
  for (int64_t kk = 0; kk < k; ++kk) {
    const WT* row = w + kk * n + n0;
    // Rows of the weight are N apart: past the hardware prefetcher's reach within a page.
    if (kk + kPrefetchRows < k)
      for (int b = 0; b < int(sizeof(WT)) * kCols; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * n) + b, _MM_HINT_T0);
    __m512 wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = load16(row + 16 * v, mask[v]);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + kk]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v)
      _mm512_mask_storeu_ps(p.out + (r0 + r) * n + n0 + 16 * v, mask[v], acc[r][v]);
}

// w [N, K]: blocks of kOuts outputs (weight rows), dot products along K, reduced at the end.
constexpr int kOuts = 4;
constexpr int kMaxRowsT = 4;           // R kOuts accumulators <= 16 registers

template <int R, typename WT>
void nk_rows(const Problem& p, int64_t n0, int64_t r0) {
  const WT* w = static_cast<const WT*>(p.w) + n0 * p.k;
  const int64_t k = p.k;
  const int outs = int(std::min<int64_t>(kOuts, p.n - n0));
  __m512 acc[R][kOuts];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kOuts; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* x = p.x + r0 * k;
  for (int64_t kk = 0; kk < k; kk += 16) {
    const __mmask16 mask = lanes(k - kk);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * k + kk);
    for (int j = 0; j < kOuts; ++j) {
      if (j >= outs) break;
      const __m512 wv = load16(w + j * k + kk, mask);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < outs; ++j) p.out[(r0 + r) * p.n + n0 + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// Rows in balanced blocks of at most MAX (9 rows: 5 + 4, not 8 + 1).
template <int MAX, template <int, typename> class Rows, typename WT>
void all_rows(const Problem& p, int64_t n0) {
  const int64_t blocks = (p.m + MAX - 1) / MAX;
  for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
    const int64_t r = (p.m - r0 + (blocks - b) - 1) / (blocks - b);
    switch (r) {
      case 1: Rows<1, WT>::run(p, n0, r0); break;
      case 2: Rows<2, WT>::run(p, n0, r0); break;
      case 3: Rows<3, WT>::run(p, n0, r0); break;
      case 4: Rows<4, WT>::run(p, n0, r0); break;
      case 5: if constexpr (MAX >= 5) Rows<5, WT>::run(p, n0, r0); break;
      case 6: if constexpr (MAX >= 6) Rows<6, WT>::run(p, n0, r0); break;
      case 7: if constexpr (MAX >= 7) Rows<7, WT>::run(p, n0, r0); break;
      case 8: if constexpr (MAX >= 8) Rows<8, WT>::run(p, n0, r0); break;
      default: break;
    }
    r0 += r;
  }
}

template <int R, typename WT>
struct KnRows { static void run(const Problem& p, int64_t n0, int64_t r0) { kn_rows<R, WT>(p, n0, r0); } };
template <int R, typename WT>
struct NkRows { static void run(const Problem& p, int64_t n0, int64_t r0) { nk_rows<R, WT>(p, n0, r0); } };

// Outputs per work item: one tile for w [K, N] (a 576-wide layer splits into 18 items);
// 64 weight rows (16 blocks) for w [N, K].
constexpr int64_t kItemKn = kCols;
constexpr int64_t kItemNk = 64;

template <typename WT, bool T>
void run_outputs(const Problem& p, int64_t n0, int64_t n1) {
  if constexpr (T) {
    for (int64_t j = n0; j < n1; j += kOuts) all_rows<kMaxRowsT, NkRows, WT>(p, j);
  } else {
    for (int64_t j = n0; j < n1; j += kCols) all_rows<kMaxRows, KnRows, WT>(p, j);
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
