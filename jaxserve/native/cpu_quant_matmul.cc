// Quantized-weight matmul for the CPU (int4 / int8 codes with per-group scales), called from JAX
// through the XLA FFI.
//
// Why native: XLA:CPU has no int4 x int8 dot; the pure-XLA paths unpack or dequantize the codes
// into a new array every step (docs/performance.md, "CPU int4 weights"), so an int4 weight costs
// the time of a float one. This loop reads each code byte once per call, unpacks nibbles in
// registers and multiplies them with int8 activations (AVX-512 VNNI vpdpbusd, as llama.cpp).
//
//   w[k, n] = s[G, n] (u[k, n] - z) + b[G, n]   (u unsigned codes, z a static zero point,
//   b = o + c s from the stored offsets o and a static shift c, in float32 here)
//   y[m, n] = sx[m] sum_G s[G, n] (sum_{k in G} u[k, n] xq[m, k] - z sum_{k in G} xq[m, k])
//             + sum_G b[G, n] sum_{k in G} x[m, k]
// Activations are quantized per row here: x ~ sx (x1 + x2 / 254) with x1, x2 int8 ("limbs":
// 1 = W4A8, x1 only; 2 = 16-bit fixed point per row, the W8A16 limb scheme of
// jaxserve/quantization/linear.py). Both limbs go through the same unpacked codes.
//
// Layout (jaxserve/quantization/cpu_packed.py packs it): outputs in tiles of 16 (one register
// of int32 lanes); codes [N/16, K/8, 64] uint8 for 4 bits, byte 4 j + b of octet o holding
// u[16 t + j, 8 o + b] | u[16 t + j, 8 o + 4 + b] << 4; [N/16, K/4, 64] for 8 bits, byte 4 j + b
// of quad o holding u[16 t + j, 4 o + b]. scales, offsets [N/16, K/g, 16] float32 or float16
// (GGUF's d and m are float16: stored as in the file, a quarter of the bytes of the codes).
// Work items are ranges of output tiles, shared by the calling thread and XLA's intra-op pool
// (cpu_work.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <immintrin.h>

#include "cpu_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLimb = 254;     // second-limb scale (linear.py's LIMB)
constexpr int kTilesPerItem = 4;
constexpr int kPrefetch = 4096;  // software prefetch distance on the code stream, bytes
constexpr int64_t kMinSplitBytes = 96 << 10;  // below: one thread (see Impl)

struct Problem {
  const float* x;          // [M, K]
  const uint8_t* codes;    // see the layout above
  const void* scales;      // [N/16, G, 16] float32 or float16 (ST)
  const void* offsets;     // like scales, or null
  float* out;              // [M, N16 * 16]
  int64_t m, k, tiles, groups, group;
  int bits, zero, shift, limbs;
  // Per row: quantized limbs [M, limbs, K] int8, sx [M], per-group zero-point correction
  // z (sum x1 + sum x2 / 254) [M, G] and float sums [M, G].
  std::vector<int8_t> xq;
  std::vector<float> sx, corr, xsum;
};

// Per-row activation quantization, bit-exact to the numpy/XLA reference: IEEE single ops in
// this order (x / sx, round half to even, clamp; the residual (u - q) * 254 likewise), never
// contracted into fused multiply-adds. Vectorized where AVX-512 is present.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
inline float clamp127(float v) { return v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v); }

void quantize_rows(Problem& p) {
  const int64_t m = p.m, k = p.k, g = p.group;
  p.xq.resize(size_t(m * p.limbs * k));
  p.sx.resize(size_t(m));
  p.corr.resize(size_t(m * p.groups));
  p.xsum.resize(size_t(m * p.groups));
  for (int64_t r = 0; r < m; ++r) {
    const float* x = p.x + r * k;
    int8_t* x1 = p.xq.data() + r * p.limbs * k;
    int8_t* x2 = x1 + k;
    int64_t i = 0;
    float amax = 0.0f;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < k; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    float sx = amax / 127.0f;
    if (sx == 0.0f) sx = 1.0f;
    p.sx[r] = sx;
    i = 0;
#if defined(__AVX512F__)
    const __m512 vsx = _mm512_set1_ps(sx), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 limb = _mm512_set1_ps(float(kLimb));
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (; i + 16 <= k; i += 16) {
      const __m512 u = _mm512_div_ps(_mm512_loadu_ps(x + i), vsx);
      const __m512 q = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(u, kNearest)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(x1 + i),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
      if (p.limbs == 2) {
        const __m512 res = _mm512_mul_ps(_mm512_sub_ps(u, q), limb);
        const __m512 q2 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(res, kNearest)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(x2 + i),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q2)));
      }
    }
#endif
    for (; i < k; ++i) {
      const float u = x[i] / sx;
      const float q = clamp127(std::nearbyint(u));
      x1[i] = int8_t(q);
      if (p.limbs == 2) x2[i] = int8_t(clamp127(std::nearbyint((u - q) * float(kLimb))));
    }
    for (int64_t grp = 0; grp < p.groups; ++grp) {
      int32_t s1 = 0, s2 = 0;
      float xs = 0.0f;
      for (int64_t j = grp * g; j < (grp + 1) * g; ++j) {
        s1 += x1[j];
        if (p.limbs == 2) s2 += x2[j];
        xs += x[j];
      }
      p.corr[r * p.groups + grp] = float(p.zero) * (float(s1) + float(s2) / float(kLimb));
      p.xsum[r * p.groups + grp] = xs;
    }
  }
}
#pragma GCC pop_options

// The tile loop is written once against 16-lane vectors (simd:: below): one AVX-512 register,
// or a pair of AVX2 ones. Which build a machine loads is chosen at start-up
// (jaxserve/native/__init__.py, ISA_BUILDS).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXSERVE_QMM_SIMD 1
constexpr int kIsa = 2;  // AVX-512 VNNI: vpdpbusd, as llama.cpp
constexpr int kRows = 4;  // rows sharing one pass over a tile's codes

namespace simd {
using I = __m512i;  // 16 int32 lanes (or 64 code bytes)
using F = __m512;   // 16 float lanes
inline I izero() { return _mm512_setzero_si512(); }
inline I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline I low_nibbles(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
inline I high_nibbles(I w) {
  return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
}
inline I bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// acc[j] += sum_b w[4 j + b] x[4 j + b], w unsigned bytes, x signed (exact in int32).
// kSmall: every w < 16 (nibbles); the AVX2 form needs it to stay exact, this one does not.
template <bool kSmall>
inline I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline F fzero() { return _mm512_setzero_ps(); }
inline F fset1(float v) { return _mm512_set1_ps(v); }
inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline F load_scales(const uint16_t* p) {  // float16
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
}  // namespace simd

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXSERVE_QMM_SIMD 1
constexpr int kIsa = 1;  // AVX2: vpmaddubsw + vpmaddwd for the 4-byte dot products
constexpr int kRows = 2;  // 16 ymm registers: 2 rows x 2 limbs x 2 halves of accumulators

namespace simd {
struct I { __m256i lo, hi; };  // output columns 0-7 and 8-15
struct F { __m256 lo, hi; };
inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline __m256i low4(__m256i w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
inline __m256i high4(__m256i w) {
  return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F));
}
inline I low_nibbles(I w) { return {low4(w.lo), low4(w.hi)}; }
inline I high_nibbles(I w) { return {high4(w.lo), high4(w.hi)}; }
inline I bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
// vpmaddubsw saturates its int16 pair sums: exact while w < 16 (2 * 15 * 127 < 32767), so
// full bytes go through as two nibbles, 16 * dot(high) + dot(low).
template <bool kSmall>
inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kSmall)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(high4(w), x), _mm256_set1_epi16(16));
  const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low4(w), x), ones);
  return _mm256_add_epi32(acc, _mm256_add_epi32(hi, lo));
}
template <bool kSmall>
inline I dot(I acc, I w, I x) {
  return {dot8<kSmall>(acc.lo, w.lo, x.lo), dot8<kSmall>(acc.hi, w.hi, x.hi)};
}
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F cvt(I v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline F fmadd(F a, F b, F c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F fmul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F fsub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F load_scales(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F load_scales(const uint16_t* p) {  // float16
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, F v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
}  // namespace simd
#endif

#if defined(JAXSERVE_QMM_SIMD)
// Rows [r0, r0 + R) against output tile t; LIMBS, BITS, the scale type ST compile-time.
template <int R, int LIMBS, int BITS, typename ST>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  using namespace simd;
  const int64_t k = p.k, g = p.group;
  const int64_t chunk_k = BITS == 4 ? 8 : 4;  // inputs per 64-byte chunk
  const uint8_t* codes = p.codes + t * (k / chunk_k) * 64;
  const ST* sc = static_cast<const ST*>(p.scales) + t * p.groups * 16;
  const ST* bs = p.offsets ? static_cast<const ST*>(p.offsets) + t * p.groups * 16 : nullptr;
  const F shift = fset1(float(p.shift));
  const int8_t* xr[R][LIMBS];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < LIMBS; ++l) xr[r][l] = p.xq.data() + ((r0 + r) * LIMBS + l) * k;
  F facc[R];
  for (int r = 0; r < R; ++r) facc[r] = fzero();
  const F inv_limb = fset1(1.0f / float(kLimb));
  for (int64_t grp = 0; grp < p.groups; ++grp) {
    I iacc[R][LIMBS];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < LIMBS; ++l) iacc[r][l] = izero();
    const int64_t k0 = grp * g;
    for (int64_t kk = k0; kk < k0 + g; kk += chunk_k) {
      const uint8_t* at = codes + (kk / chunk_k) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetch, _MM_HINT_T0);
      const I w = load(at);
      if constexpr (BITS == 4) {
        const I lo = low_nibbles(w), hi = high_nibbles(w);
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < LIMBS; ++l) {
            iacc[r][l] = dot<true>(iacc[r][l], lo, bcast4(xr[r][l] + kk));
            iacc[r][l] = dot<true>(iacc[r][l], hi, bcast4(xr[r][l] + kk + 4));
          }
      } else {
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < LIMBS; ++l)
            iacc[r][l] = dot<false>(iacc[r][l], w, bcast4(xr[r][l] + kk));
      }
    }
    const F s = load_scales(sc + grp * 16);
    const F b = bs ? fmadd(s, shift, load_scales(bs + grp * 16)) : fzero();
    for (int r = 0; r < R; ++r) {
      F d = cvt(iacc[r][0]);
      if constexpr (LIMBS == 2) d = fmadd(cvt(iacc[r][1]), inv_limb, d);
      d = fsub(d, fset1(p.corr[(r0 + r) * p.groups + grp]));
      facc[r] = fmadd(s, fmul(d, fset1(p.sx[r0 + r])), facc[r]);
      if (bs) facc[r] = fmadd(b, fset1(p.xsum[(r0 + r) * p.groups + grp]), facc[r]);
    }
  }
  const int64_t n16 = p.tiles * 16;
  for (int r = 0; r < R; ++r) store(p.out + (r0 + r) * n16 + t * 16, facc[r]);
}

template <int LIMBS, int BITS, typename ST>
void run_tiles(const Problem& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t r = 0;
    for (; r + kRows <= p.m; r += kRows) tile_rows<kRows, LIMBS, BITS, ST>(p, t, r);
    switch (p.m - r) {
      case 3: tile_rows<3, LIMBS, BITS, ST>(p, t, r); break;
      case 2: tile_rows<2, LIMBS, BITS, ST>(p, t, r); break;
      case 1: tile_rows<1, LIMBS, BITS, ST>(p, t, r); break;
      default: break;
    }
  }
}
#else
constexpr int kIsa = 0;
constexpr int kRows = 1;

inline float scale_at(const float* p, int64_t i) { return p[i]; }
inline float scale_at(const uint16_t* p, int64_t i) {  // float16 -> float32
  const uint32_t h = p[i], sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, f = h & 0x3FF;
  float v;
  if (e == 0) {
    v = std::ldexp(float(f), -24);
  } else if (e == 31) {
    v = f ? NAN : INFINITY;
  } else {
    const uint32_t bits = ((e + 112) << 23) | (f << 13);
    std::memcpy(&v, &bits, 4);
  }
  return sign ? -v : v;
}

// Portable loop (machines without AVX2): the same sums, one lane at a time.
template <int LIMBS, int BITS, typename ST>
void run_tiles(const Problem& p, int64_t t0, int64_t t1) {
  const ST* scales = static_cast<const ST*>(p.scales);
  const ST* offsets = static_cast<const ST*>(p.offsets);
  const int64_t k = p.k, g = p.group, chunk_k = BITS == 4 ? 8 : 4, n16 = p.tiles * 16;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* codes = p.codes + t * (k / chunk_k) * 64;
    for (int64_t r = 0; r < p.m; ++r) {
      for (int j = 0; j < 16; ++j) {
        float acc = 0.0f;
        for (int64_t grp = 0; grp < p.groups; ++grp) {
          float d = 0.0f;
          for (int l = 0; l < LIMBS; ++l) {
            const int8_t* xq = p.xq.data() + (r * LIMBS + l) * k;
            int32_t dot = 0;
            for (int64_t kk = grp * g; kk < (grp + 1) * g; ++kk) {
              const int64_t o = kk / chunk_k, b = kk % chunk_k;
              int32_t u;
              if (BITS == 4) {
                const uint8_t byte = codes[o * 64 + 4 * j + (b & 3)];
                u = b < 4 ? byte & 0xF : byte >> 4;
              } else {
                u = codes[o * 64 + 4 * j + b];
              }
              dot += u * xq[kk];
            }
            d += l == 0 ? float(dot) : float(dot) / float(kLimb);
          }
          d -= p.corr[r * p.groups + grp];
          const int64_t at = (t * p.groups + grp) * 16 + j;
          const float s = scale_at(scales, at);
          acc += s * (d * p.sx[r]);
          if (offsets)
            acc += (scale_at(offsets, at) + float(p.shift) * s) * p.xsum[r * p.groups + grp];
        }
        p.out[r * n16 + t * 16 + j] = acc;
      }
    }
  }
}
#endif

using TileFn = void (*)(const Problem&, int64_t, int64_t);

template <typename ST>
TileFn pick(int limbs, int bits) {
  if (limbs == 1 && bits == 4) return run_tiles<1, 4, ST>;
  if (limbs == 2 && bits == 4) return run_tiles<2, 4, ST>;
  if (limbs == 1 && bits == 8) return run_tiles<1, 8, ST>;
  if (limbs == 2 && bits == 8) return run_tiles<2, 8, ST>;
  return nullptr;
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::ResultBuffer<ffi::F32> out,
                int32_t bits, int32_t zero, int32_t shift, int32_t limbs, int32_t layer) {
  auto xd = x.dimensions(), cd_all = codes.dimensions(), sd_all = scales.dimensions();
  // Weights stacked over the layers ([L, ...]) are read in place at `layer`: an XLA slice of
  // a parameter handed to a custom call would be a copy, and one buffer per layer and array
  // costs the step's dispatch microseconds each (docs/performance.md).
  const bool stacked = cd_all.size() == 4;
  if (xd.size() != 2 || cd_all.size() != sd_all.size() || (cd_all.size() != 3 && !stacked))
    return ffi::Error::InvalidArgument(
        "expected x [M, K], codes [(L,) N/16, K/c, 64], scales [(L,) N/16, G, 16]");
  const int64_t num_layers = stacked ? cd_all[0] : 1;
  if (stacked && sd_all[0] != num_layers)
    return ffi::Error::InvalidArgument("codes and scales have different layer counts");
  if (layer < 0 || layer >= num_layers)
    return ffi::Error::InvalidArgument("layer " + std::to_string(layer) + " is out of range [0, " +
                                       std::to_string(num_layers) + ")");
  auto cd = cd_all.last(3), sd = sd_all.last(3);
  if (cd[2] != 64 || sd[2] != 16 || cd[0] != sd[0])
    return ffi::Error::InvalidArgument(
        "expected x [M, K], codes [(L,) N/16, K/c, 64], scales [(L,) N/16, G, 16]");
  const ffi::DataType st = scales.element_type();
  if (st != ffi::DataType::F32 && st != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("scales must be float32 or float16");
  TileFn fn = st == ffi::DataType::F32 ? pick<float>(limbs, bits) : pick<uint16_t>(limbs, bits);
  if (!fn) return ffi::Error::InvalidArgument("bits must be 4 or 8 and limbs 1 or 2");
  const int64_t m = xd[0], k = xd[1], chunk_k = bits == 4 ? 8 : 4;
  if (cd[1] * chunk_k != k || sd[1] == 0 || k % sd[1] != 0 || (k / sd[1]) % chunk_k != 0)
    return ffi::Error::InvalidArgument("codes or scales do not match K = " + std::to_string(k));
  const bool has_offsets = offsets.element_count() != 0;
  if (has_offsets && (offsets.element_count() != scales.element_count() ||
                      offsets.element_type() != st))
    return ffi::Error::InvalidArgument("offsets must be empty or shaped and typed like scales");
  const int64_t layer_codes = cd[0] * cd[1] * cd[2];
  const int64_t layer_scale_bytes =
      sd[0] * sd[1] * sd[2] * (st == ffi::DataType::F32 ? 4 : 2);
  Problem p;
  p.x = x.typed_data();
  p.codes = codes.typed_data() + layer * layer_codes;
  p.scales = static_cast<const char*>(scales.untyped_data()) + layer * layer_scale_bytes;
  p.offsets = has_offsets
                  ? static_cast<const char*>(offsets.untyped_data()) + layer * layer_scale_bytes
                  : nullptr;
  p.out = out->typed_data();
  p.m = m;
  p.k = k;
  p.tiles = cd[0];
  p.groups = sd[1];
  p.group = k / sd[1];
  p.bits = bits;
  p.zero = zero;
  p.shift = shift;
  p.limbs = limbs;
  if (m == 0 || p.tiles == 0) return ffi::Error::Success();
  quantize_rows(p);
  const int64_t items = (p.tiles + kTilesPerItem - 1) / kTilesPerItem;
  // Waking a pool thread costs microseconds: small products run on the calling thread.
  const int64_t bytes = layer_codes * std::max<int64_t>(1, m / kRows);
  jaxserve::run_items(pool, items, bytes >= kMinSplitBytes, [&p, fn](int64_t i) {
    const int64_t t0 = i * kTilesPerItem;
    fn(p, t0, std::min(p.tiles, t0 + kTilesPerItem));
  });
  return ffi::Error::Success();
}

}  // namespace

// The tile loop this library was built with (ctypes query): 2 AVX-512 VNNI, 1 AVX2, 0 the
// portable loop.
extern "C" int jaxserve_quant_matmul_isa() { return kIsa; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [(L,) N/16, K/c, 64]
                                  .Arg<ffi::AnyBuffer>()  // scales [(L,) N/16, G, 16] f32 / f16
                                  .Arg<ffi::AnyBuffer>()  // offsets: like scales, or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N/16 * 16]
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("zero")
                                  .Attr<int32_t>("shift")
                                  .Attr<int32_t>("limbs")
                                  .Attr<int32_t>("layer"));  // 0 unless stacked
