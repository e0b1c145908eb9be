// Quantized-weight matmul for the CPU (int4 / int8 codes with per-group scales), called from JAX
// through the XLA FFI.
//
// Why native: XLA:CPU has no int4 x int8 dot; the pure-XLA paths unpack or dequantize the codes
// into a new array every step (docs/performance.md, "CPU int4 weights"), so an int4 weight costs
// the time of a float one. This loop reads each code byte once per call, unpacks nibbles in
// registers and multiplies them with int8 activations (AVX-512 VNNI vpdpbusd, as llama.cpp).
//
//   w[k, n] = s[G, n] (u[k, n] - z) + b[G, n]   (u unsigned codes, z a static zero point)
//   y[m, n] = sx[m] sum_G s[G, n] (sum_{k in G} u[k, n] xq[m, k] - z sum_{k in G} xq[m, k])
//             + sum_G b[G, n] sum_{k in G} x[m, k]
// Activations are quantized per row here: x ~ sx (x1 + x2 / 254) with x1, x2 int8 ("limbs":
// 1 = W4A8, x1 only; 2 = 16-bit fixed point per row, the W8A16 limb scheme of
// jaxserve/quantization/linear.py). Both limbs go through the same unpacked codes.
//
// Layout (jaxserve/quantization/cpu_packed.py packs it): outputs in tiles of 16 (one register
// of int32 lanes); codes [N/16, K/8, 64] uint8 for 4 bits, byte 4 j + b of octet o holding
// u[16 t + j, 8 o + b] | u[16 t + j, 8 o + 4 + b] << 4; [N/16, K/4, 64] for 8 bits, byte 4 j + b
// of quad o holding u[16 t + j, 4 o + b]. scales, bias [N/16, K/g, 16] float32.
// Work items are ranges of output tiles, shared by the calling thread and XLA's intra-op pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLimb = 254;     // second-limb scale (linear.py's LIMB)
constexpr int kRows = 4;       // rows sharing one pass over a tile's codes
constexpr int kTilesPerItem = 4;

struct Problem {
  const float* x;          // [M, K]
  const uint8_t* codes;    // see the layout above
  const float* scales;     // [N/16, G, 16]
  const float* bias;       // [N/16, G, 16] or null
  float* out;              // [M, N16 * 16]
  int64_t m, k, tiles, groups, group;
  int bits, zero, limbs;
  // Per row: quantized limbs [M, limbs, K] int8, sx [M], per-group zero-point correction
  // z (sum x1 + sum x2 / 254) [M, G] and float sums [M, G].
  std::vector<int8_t> xq;
  std::vector<float> sx, corr, xsum;
};

// Per-row activation quantization, bit-exact to the numpy/XLA reference: IEEE single ops in
// this order, round half to even, no contraction into fused multiply-adds.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
void quantize_rows(Problem& p) {
  const int64_t m = p.m, k = p.k, g = p.group;
  p.xq.assign(size_t(m * p.limbs * k), 0);
  p.sx.assign(size_t(m), 1.0f);
  p.corr.assign(size_t(m * p.groups), 0.0f);
  p.xsum.assign(size_t(m * p.groups), 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    const float* x = p.x + r * k;
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
    float sx = amax / 127.0f;
    if (sx == 0.0f) sx = 1.0f;
    p.sx[r] = sx;
    int8_t* x1 = p.xq.data() + r * p.limbs * k;
    int8_t* x2 = x1 + k;
    for (int64_t i = 0; i < k; ++i) {
      const float u = x[i] / sx;
      const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(u)));
      x1[i] = int8_t(q);
      if (p.limbs == 2) {
        const float res = (u - q) * float(kLimb);
        x2[i] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(res))));
      }
    }
    for (int64_t grp = 0; grp < p.groups; ++grp) {
      int32_t s1 = 0, s2 = 0;
      float xs = 0.0f;
      for (int64_t i = grp * g; i < (grp + 1) * g; ++i) {
        s1 += x1[i];
        if (p.limbs == 2) s2 += x2[i];
        xs += x[i];
      }
      p.corr[r * p.groups + grp] = float(p.zero) * (float(s1) + float(s2) / float(kLimb));
      p.xsum[r * p.groups + grp] = xs;
    }
  }
}
#pragma GCC pop_options

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [r0, r0 + R) against output tile t; LIMBS, BITS compile-time.
template <int R, int LIMBS, int BITS>
void tile_rows(const Problem& p, int64_t t, int64_t r0) {
  const int64_t k = p.k, g = p.group;
  const int64_t chunk_k = BITS == 4 ? 8 : 4;  // inputs per 64-byte chunk
  const uint8_t* codes = p.codes + t * (k / chunk_k) * 64;
  const float* sc = p.scales + t * p.groups * 16;
  const float* bs = p.bias ? p.bias + t * p.groups * 16 : nullptr;
  const int8_t* xr[R][LIMBS];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < LIMBS; ++l) xr[r][l] = p.xq.data() + ((r0 + r) * LIMBS + l) * k;
  __m512 facc[R];
  for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512 inv_limb = _mm512_set1_ps(1.0f / float(kLimb));
  for (int64_t grp = 0; grp < p.groups; ++grp) {
    __m512i iacc[R][LIMBS];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < LIMBS; ++l) iacc[r][l] = _mm512_setzero_si512();
    const int64_t k0 = grp * g;
    for (int64_t kk = k0; kk < k0 + g; kk += chunk_k) {
      const __m512i w = _mm512_loadu_si512(codes + (kk / chunk_k) * 64);
      if constexpr (BITS == 4) {
        const __m512i lo = _mm512_and_si512(w, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < LIMBS; ++l) {
            iacc[r][l] = _mm512_dpbusd_epi32(iacc[r][l], lo, bcast4(xr[r][l] + kk));
            iacc[r][l] = _mm512_dpbusd_epi32(iacc[r][l], hi, bcast4(xr[r][l] + kk + 4));
          }
      } else {
        for (int r = 0; r < R; ++r)
          for (int l = 0; l < LIMBS; ++l)
            iacc[r][l] = _mm512_dpbusd_epi32(iacc[r][l], w, bcast4(xr[r][l] + kk));
      }
    }
    const __m512 s = _mm512_loadu_ps(sc + grp * 16);
    const __m512 b = bs ? _mm512_loadu_ps(bs + grp * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 d = _mm512_cvtepi32_ps(iacc[r][0]);
      if constexpr (LIMBS == 2)
        d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][1]), inv_limb, d);
      const float c = p.corr[(r0 + r) * p.groups + grp];
      d = _mm512_sub_ps(d, _mm512_set1_ps(c));
      facc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(p.sx[r0 + r])), facc[r]);
      if (bs) facc[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(p.xsum[(r0 + r) * p.groups + grp]),
                                        facc[r]);
    }
  }
  const int64_t n16 = p.tiles * 16;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.out + (r0 + r) * n16 + t * 16, facc[r]);
}

template <int LIMBS, int BITS>
void run_tiles(const Problem& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t r = 0;
    for (; r + kRows <= p.m; r += kRows) tile_rows<kRows, LIMBS, BITS>(p, t, r);
    switch (p.m - r) {
      case 3: tile_rows<3, LIMBS, BITS>(p, t, r); break;
      case 2: tile_rows<2, LIMBS, BITS>(p, t, r); break;
      case 1: tile_rows<1, LIMBS, BITS>(p, t, r); break;
      default: break;
    }
  }
}
#else
constexpr bool kVnni = false;

// Portable loop (machines without AVX-512 VNNI): the same sums, one lane at a time.
template <int LIMBS, int BITS>
void run_tiles(const Problem& p, int64_t t0, int64_t t1) {
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
          acc += p.scales[(t * p.groups + grp) * 16 + j] * (d * p.sx[r]);
          if (p.bias) acc += p.bias[(t * p.groups + grp) * 16 + j] * p.xsum[r * p.groups + grp];
        }
        p.out[r * n16 + t * 16 + j] = acc;
      }
    }
  }
}
#endif

using TileFn = void (*)(const Problem&, int64_t, int64_t);

TileFn pick(int limbs, int bits) {
  if (limbs == 1 && bits == 4) return run_tiles<1, 4>;
  if (limbs == 2 && bits == 4) return run_tiles<2, 4>;
  if (limbs == 1 && bits == 8) return run_tiles<1, 8>;
  if (limbs == 2 && bits == 8) return run_tiles<2, 8>;
  return nullptr;
}

// Items shared by the caller and pool tasks (as cpu_attention.cc): a task that starts after the
// work ran out does nothing; the caller waits only for items already claimed.
struct Shared {
  Problem problem;
  TileFn fn;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    int64_t ran = 0;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      const int64_t t0 = i * kTilesPerItem;
      fn(problem, t0, std::min(problem.tiles, t0 + kTilesPerItem));
      ++ran;
    }
    if (ran && done.fetch_add(ran) + ran == items) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> bias,
                ffi::ResultBuffer<ffi::F32> out, int32_t bits, int32_t zero, int32_t limbs) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 3 || sd.size() != 3 || cd[2] != 64 || sd[2] != 16 ||
      cd[0] != sd[0])
    return ffi::Error::InvalidArgument(
        "expected x [M, K], codes [N/16, K/c, 64], scales [N/16, G, 16]");
  TileFn fn = pick(limbs, bits);
  if (!fn) return ffi::Error::InvalidArgument("bits must be 4 or 8 and limbs 1 or 2");
  const int64_t m = xd[0], k = xd[1], chunk_k = bits == 4 ? 8 : 4;
  if (cd[1] * chunk_k != k || sd[1] == 0 || k % sd[1] != 0 || (k / sd[1]) % chunk_k != 0)
    return ffi::Error::InvalidArgument("codes or scales do not match K = " + std::to_string(k));
  const bool has_bias = bias.element_count() != 0;
  if (has_bias && bias.element_count() != scales.element_count())
    return ffi::Error::InvalidArgument("bias must be empty or shaped like scales");
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  p.x = x.typed_data();
  p.codes = codes.typed_data();
  p.scales = scales.typed_data();
  p.bias = has_bias ? bias.typed_data() : nullptr;
  p.out = out->typed_data();
  p.m = m;
  p.k = k;
  p.tiles = cd[0];
  p.groups = sd[1];
  p.group = k / sd[1];
  p.bits = bits;
  p.zero = zero;
  p.limbs = limbs;
  if (m == 0 || p.tiles == 0) return ffi::Error::Success();
  quantize_rows(p);
  shared->fn = fn;
  shared->items = (p.tiles + kTilesPerItem - 1) / kTilesPerItem;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == shared->items; });
  return ffi::Error::Success();
}

}  // namespace

// 1 where the library was built with the VNNI loop, 0 for the portable one (ctypes query).
extern "C" int jaxserve_quant_matmul_vnni() { return kVnni ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [N/16, K/c, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N/16, G, 16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias: like scales, or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N/16 * 16]
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("zero")
                                  .Attr<int32_t>("limbs"));
