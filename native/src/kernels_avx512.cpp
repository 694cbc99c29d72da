// AVX-512 kernels (F/BW/VL/DQ + BF16 + VNNI): bf16 weights through VDPBF16PS; int8/int4 weights
// with few rows through VPDPBUSD on the packed bytes against activations quantized to int8 per
// (row, K group); fp8 weights with few rows widened to bf16 in registers (exactly) and through
// VDPBF16PS against the bf16 activations, scaled per group; with many rows, int8/int4/fp8
// dequantized block by block to bf16. Best for few tokens per
// expert, where the work is streaming weights from DRAM. Compiled for these instructions (the
// pragma below) and only called after CPUID says the CPU has them.
#include <immintrin.h>

// GCC 12's _mm512_extracti32x4_epi32 starts from a self-initialised undefined vector that its own
// -Wuninitialized then reports at every inlined use.
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ktf/common.h"

// This file's functions are compiled for these instructions by a pragma placed after every
// #include, not by compiler flags for the whole file: the inline functions and templates the
// headers define (std::vector's growth, ktf/common.h's helpers) must keep the baseline ISA, since
// the linker keeps one copy of each for the whole module, and a copy built with these flags would
// run on every CPU (an illegal instruction on one without them).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c")
#endif

namespace ktf {
namespace {

constexpr int MMAX = QUANT_ROWS_MAX;  // tokens per register block
// Software prefetch 4 KiB ahead along a weight stream: on the 16-core Xeon host it took int4
// decode from 54-68% to 85-92% of DRAM bandwidth (the hardware prefetcher alone falls behind on
// the short per-task streams); bf16 and int8 unchanged within the run-to-run noise.
constexpr int PF_BYTES = 4096;
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + PF_BYTES, _MM_HINT_T0); }

inline __m512 bf16x16_to_f32_lanes(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 bf16x16_to_f32(const bf16* p) { return bf16x16_to_f32_lanes(_mm256_loadu_si256((const __m256i*)p)); }

// a[m] += the bf16 dot products of K pairs (k, k+1) and (k+2, k+3) of row m of X with the
// 16 rows' pairs in w0 and w1 (two accumulators: the two VDPBF16PS chains run side by side)
template <int MM>
__attribute__((always_inline)) inline void dot_pairs(__m512* a0, __m512* a1, const bf16* X, size_t ldx, int k,
                                                     __m512i w0, __m512i w1) {
  for (int m = 0; m < MM; ++m) {
    int32_t p0, p1;
    std::memcpy(&p0, X + m * ldx + k, 4);
    std::memcpy(&p1, X + m * ldx + k + 2, 4);
    a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_set1_epi32(p0), (__m512bh)w0);
    a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_set1_epi32(p1), (__m512bh)w1);
  }
}

template <int MM>
void bf16_block(const bf16* X, size_t ldx, const bf16* w, int kp, float* Y, size_t ldy) {
  __m512 a0[MM], a1[MM];
  for (int m = 0; m < MM; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  const int pairs = kp / 2;
  for (int q = 0; q < pairs; q += 2) {
    __m512i w0 = _mm512_load_si512(w + size_t(q) * 32);
    __m512i w1 = _mm512_load_si512(w + size_t(q + 1) * 32);
    prefetch(w + size_t(q) * 32);
    prefetch(w + size_t(q + 1) * 32);
    dot_pairs<MM>(a0, a1, X, ldx, 2 * q, w0, w1);
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(Y + m * ldy, _mm512_add_ps(a0[m], a1[m]));
}

// ---- quantized weights, few rows: int8 activations through VPDPBUSD

// Activation rows quantized for the integer products: per (row, weight group) a symmetric int8
// scale, and per (row, span) the sum of the int8 values (spans split a group every 2048 K so the
// int32 sums cannot overflow: 2048 * 255 * 127 < 2^31).
constexpr int SPAN = 2048;

struct QuantRows {
  int groups = 0, spans_per_group = 0;
  const int8_t* q = nullptr;  // [M][ldq]
  size_t ldq = 0;
  const float* scale = nullptr;   // [M][groups]
  const int32_t* qsum = nullptr;  // [M][groups * spans_per_group]
};

QuantRows quantize_rows(const bf16* X, size_t ldx, int M, const PackedMatrix& W) {
  thread_local std::vector<int8_t> qstore;
  thread_local std::vector<float> sstore;
  thread_local std::vector<int32_t> sumstore;
  QuantRows r;
  r.groups = W.kp / W.group;
  r.spans_per_group = (W.group + SPAN - 1) / SPAN;
  r.ldq = size_t(W.kp) + 64;
  qstore.resize(size_t(M) * r.ldq);
  sstore.resize(size_t(M) * r.groups);
  sumstore.resize(size_t(M) * r.groups * r.spans_per_group);
  for (int m = 0; m < M; ++m) {
    const bf16* x = X + m * ldx;
    int8_t* q = qstore.data() + m * r.ldq;
    for (int g = 0; g < r.groups; ++g) {
      const int g0 = g * W.group, g1 = g0 + W.group;
      __m512 amax = _mm512_setzero_ps();
      for (int k = g0; k < g1; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_f32(x + k)));
      const float a = _mm512_reduce_max_ps(amax);
      sstore[size_t(m) * r.groups + g] = a / 127.f;
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      for (int sp = 0; sp < r.spans_per_group; ++sp) {
        const int s0 = g0 + sp * SPAN, s1 = std::min(g1, s0 + SPAN);
        __m512i sum = _mm512_setzero_si512();
        for (int k = s0; k < s1; k += 16) {
          const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_f32(x + k), inv));  // nearest even
          _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtsepi32_epi8(i));
          sum = _mm512_add_epi32(sum, i);
        }
        sumstore[(size_t(m) * r.groups + g) * r.spans_per_group + sp] = _mm512_reduce_add_epi32(sum);
      }
    }
  }
  r.q = qstore.data();
  r.scale = sstore.data();
  r.qsum = sumstore.data();
  return r;
}

inline __m512i x4(const int8_t* q) {  // four int8 activations broadcast to every 32-bit lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

// Y[m, 16 rows of block b] for MM quantized rows: per span, integer dot products of the biased
// unsigned weights with the int8 activations (two accumulators), the bias taken out with the
// activations' sum; per group, scaled by the weight scales times the row's activation scale.
template <int MM, bool INT4>
void quant_block(const QuantRows& xq, const PackedMatrix& W, int b, float* Y, size_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * W.kp * NB / (INT4 ? 2 : 1);
  const float* sc = W.scales + size_t(b) * xq.groups * NB;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const int bias = INT4 ? INT4_BIAS : INT8_BIAS;
  __m512 tot[MM];
  for (int m = 0; m < MM; ++m) tot[m] = _mm512_setzero_ps();
  for (int g = 0; g < xq.groups; ++g) {
    __m512 gsum[MM];
    for (int m = 0; m < MM; ++m) gsum[m] = _mm512_setzero_ps();
    for (int sp = 0; sp < xq.spans_per_group; ++sp) {
      const int s0 = g * W.group + sp * SPAN, s1 = std::min((g + 1) * W.group, s0 + SPAN);
      __m512i a0[MM], a1[MM];
      for (int m = 0; m < MM; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
      for (int k = s0; k < s1; k += 8) {
        __m512i w0, w1;
        if constexpr (INT4) {  // one 64-byte octet: low nibbles k..k+3, high nibbles k+4..k+7
          const __m512i v = _mm512_load_si512(w + size_t(k) * 8);
          prefetch(w + size_t(k) * 8);
          w0 = _mm512_and_si512(v, nib);
          w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        } else {  // two 64-byte quads
          w0 = _mm512_load_si512(w + size_t(k) * 16);
          w1 = _mm512_load_si512(w + size_t(k) * 16 + 64);
          prefetch(w + size_t(k) * 16);
          prefetch(w + size_t(k) * 16 + 64);
        }
        for (int m = 0; m < MM; ++m) {
          const int8_t* q = xq.q + m * xq.ldq + k;
          a0[m] = _mm512_dpbusd_epi32(a0[m], w0, x4(q));
          a1[m] = _mm512_dpbusd_epi32(a1[m], w1, x4(q + 4));
        }
      }
      for (int m = 0; m < MM; ++m) {
        const int32_t corr = bias * xq.qsum[(size_t(m) * xq.groups + g) * xq.spans_per_group + sp];
        const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(a0[m], a1[m]), _mm512_set1_epi32(corr));
        gsum[m] = _mm512_add_ps(gsum[m], _mm512_cvtepi32_ps(a));
      }
    }
    const __m512 ws = _mm512_loadu_ps(sc + size_t(g) * NB);
    for (int m = 0; m < MM; ++m)
      tot[m] = _mm512_fmadd_ps(gsum[m], _mm512_mul_ps(ws, _mm512_set1_ps(xq.scale[size_t(m) * xq.groups + g])), tot[m]);
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(Y + m * ldy, tot[m]);
}

// ---- fp8 weights, few rows: widened to bf16 in registers

// 32 e4m3 bytes -> 32 bf16 holding the same values times 2^-8, in the same order, exactly: the
// byte's exponent and mantissa bits placed into a binary16's (whose exponent bias is 8 more, and
// whose subnormals cover e4m3's), the sign moved to bit 15, then binary16 -> fp32 -> bf16 (every
// e4m3 value times 2^-8 is a bf16). The 2^8 goes into the group scale. NaN bytes are refused at
// packing, so none reach here.
inline __m512i e4m3x32_to_bf16(__m256i v) {
  __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(v), 7);  // sign at bit 14, e4m3 bits 6..0 at 13..7
  h = _mm512_add_epi16(h, _mm512_and_si512(h, _mm512_set1_epi16(0x4000)));  // sign bit 14 -> 15
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
constexpr float FP8_UNSCALE = 256.f;  // the 2^8 e4m3x32_to_bf16 leaves out

// Y[m, 16 rows of block b] for MM bf16 rows: per group, bf16 dot products (two accumulators) of
// the widened weights with the activations, then times the rows' group scales.
template <int MM>
void fp8_block(const bf16* X, size_t ldx, const PackedMatrix& W, int b, float* Y, size_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * W.kp * NB;
  const float* sc = W.group_scales(b);
  __m512 tot[MM];
  for (int m = 0; m < MM; ++m) tot[m] = _mm512_setzero_ps();
  for (int g0 = 0; g0 < W.kp; g0 += W.group) {
    __m512 a0[MM], a1[MM];
    for (int m = 0; m < MM; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int k = g0; k < g0 + W.group; k += 4) {  // 64 bytes: K pairs k/2 and k/2 + 1 of 16 rows
      const __m512i v = _mm512_load_si512(w + size_t(k) * NB);
      prefetch(w + size_t(k) * NB);
      const __m512i w0 = e4m3x32_to_bf16(_mm512_castsi512_si256(v));
      const __m512i w1 = e4m3x32_to_bf16(_mm512_extracti64x4_epi64(v, 1));
      dot_pairs<MM>(a0, a1, X, ldx, k, w0, w1);
    }
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sc + size_t(g0 / W.group) * NB), _mm512_set1_ps(FP8_UNSCALE));
    for (int m = 0; m < MM; ++m) tot[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), s, tot[m]);
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(Y + m * ldy, tot[m]);
}

// The same through byte tables (AVX-512 VBMI): VPERMT2B looks up the low and the high byte of each
// weight's bf16 in two 128-entry tables indexed by the byte's low 7 bits (it ignores bit 7, the
// sign, which is then ORed in), and two more VPERMT2B interleave them into words: 5 instructions
// for 64 weights (exact: every e4m3 value is a bf16), against 12 for the binary16 route above.
struct Fp8Tables {
  __m512i lo0, lo1, hi0, hi1;  // bf16 bytes of codes 0-63 (x0) and 64-127 (x1)
  __m512i words0, words1;      // interleave: word i of words0 = (lo[i], hi[i]), of words1 = (lo[32 + i], hi[32 + i])
};
const Fp8Tables& fp8_tables() {
  static const Fp8Tables t = [] {
    alignas(64) uint8_t b[6][64];
    for (int c = 0; c < 128; ++c) {
      const bf16 h = c == 0x7f ? 0 : f32_to_bf16(e4m3_to_f32(uint8_t(c)));  // 0x7f (NaN) never packed
      b[c / 64][c % 64] = uint8_t(h & 0xff);
      b[2 + c / 64][c % 64] = uint8_t(h >> 8);
    }
    for (int i = 0; i < 32; ++i) {
      b[4][2 * i] = uint8_t(i), b[4][2 * i + 1] = uint8_t(64 + i);
      b[5][2 * i] = uint8_t(32 + i), b[5][2 * i + 1] = uint8_t(96 + i);
    }
    Fp8Tables r;
    __m512i* v[6] = {&r.lo0, &r.lo1, &r.hi0, &r.hi1, &r.words0, &r.words1};
    for (int i = 0; i < 6; ++i) *v[i] = _mm512_load_si512(b[i]);
    return r;
  }();
  return t;
}

template <int MM>
__attribute__((target("avx512vbmi"))) void fp8_block_lut(const bf16* X, size_t ldx, const PackedMatrix& W, int b,
                                                          float* Y, size_t ldy) {
  const Fp8Tables& t = fp8_tables();
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * W.kp * NB;
  const float* sc = W.group_scales(b);
  __m512 tot[MM];
  for (int m = 0; m < MM; ++m) tot[m] = _mm512_setzero_ps();
  for (int g0 = 0; g0 < W.kp; g0 += W.group) {
    __m512 a0[MM], a1[MM];
    for (int m = 0; m < MM; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int k = g0; k < g0 + W.group; k += 4) {  // 64 bytes: K pairs k/2 and k/2 + 1 of 16 rows
      const __m512i v = _mm512_load_si512(w + size_t(k) * NB);
      prefetch(w + size_t(k) * NB);
      const __m512i lo = _mm512_permutex2var_epi8(t.lo0, v, t.lo1);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, v, t.hi1), v, sign, 0xf8);
      const __m512i w0 = _mm512_permutex2var_epi8(lo, t.words0, hi);
      const __m512i w1 = _mm512_permutex2var_epi8(lo, t.words1, hi);
      dot_pairs<MM>(a0, a1, X, ldx, k, w0, w1);
    }
    const __m512 s = _mm512_loadu_ps(sc + size_t(g0 / W.group) * NB);
    for (int m = 0; m < MM; ++m) tot[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), s, tot[m]);
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(Y + m * ldy, tot[m]);
}

// ---- dequantization into the BF16 layout (many rows: the blocks are then reused by every row)

// One quad (16 rows x 4 K of biased unsigned values, row scales s) -> two K pairs of the BF16
// layout at out and out + 32.
inline void quad_to_bf16(__m512i v, __m512i bias, __m512 s, bf16* out) {
  const __m512i rows4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 f[4];
  const __m128i part[4] = {_mm512_castsi512_si128(v), _mm512_extracti32x4_epi32(v, 1), _mm512_extracti32x4_epi32(v, 2),
                           _mm512_extracti32x4_epi32(v, 3)};
  for (int c = 0; c < 4; ++c) {  // rows 4c..4c+3, their 4 K each
    const __m512 sc = _mm512_permutexvar_ps(_mm512_add_epi32(rows4, _mm512_set1_epi32(4 * c)), s);
    f[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(part[c]), bias)), sc);
  }
  // 32-bit lanes of lo: (row r, pair 0), (row r, pair 1) for rows 0-7; hi: rows 8-15
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
  const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  _mm512_store_si512(out, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_store_si512(out + 32, _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi));
}

}  // namespace

void dequant_block_avx512(const PackedMatrix& W, int b, bf16* out) {
  const float* sc = W.group_scales(b);
  if (W.fmt == Format::FP8) {  // pairs of 16 rows: lanes (row r, k) (row r, k + 1), rows 0-7 then 8-15
    const __m512i r2 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * W.kp * NB;
    for (int g0 = 0; g0 < W.kp; g0 += W.group) {
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sc + size_t(g0 / W.group) * NB), _mm512_set1_ps(FP8_UNSCALE));
      const __m512 s_lo = _mm512_permutexvar_ps(r2, s), s_hi = _mm512_permutexvar_ps(_mm512_add_epi32(r2, _mm512_set1_epi32(8)), s);
      for (int k = g0; k < g0 + W.group; k += 2) {  // one K pair of 16 rows: 32 bytes -> 32 bf16
        const __m512i h = (__m512i)e4m3x32_to_bf16(_mm256_load_si256((const __m256i*)(w + size_t(k) * NB)));
        const __m512 lo = _mm512_mul_ps(bf16x16_to_f32_lanes(_mm512_castsi512_si256(h)), s_lo);
        const __m512 hi = _mm512_mul_ps(bf16x16_to_f32_lanes(_mm512_extracti64x4_epi64(h, 1)), s_hi);
        _mm512_store_si512(out + size_t(k) * NB, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    return;
  }
  const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * W.kp * NB / (W.fmt == Format::INT4 ? 2 : 1);
  if (W.fmt == Format::INT8) {
    const __m512i bias = _mm512_set1_epi32(INT8_BIAS);
    for (int k = 0; k < W.kp; k += 4)
      quad_to_bf16(_mm512_load_si512(w + size_t(k) * 16), bias, _mm512_loadu_ps(sc + size_t(k / W.group) * NB),
                   out + size_t(k) * NB);
    return;
  }
  const __m512i bias = _mm512_set1_epi32(INT4_BIAS), nib = _mm512_set1_epi8(0x0f);
  for (int k = 0; k < W.kp; k += 8) {
    const __m512i v = _mm512_load_si512(w + size_t(k) * 8);
    const __m512 s = _mm512_loadu_ps(sc + size_t(k / W.group) * NB);
    quad_to_bf16(_mm512_and_si512(v, nib), bias, s, out + size_t(k) * NB);
    quad_to_bf16(_mm512_and_si512(_mm512_srli_epi16(v, 4), nib), bias, s, out + size_t(k + 4) * NB);
  }
}

namespace {

template <int... MM>
struct Tables {
  using Bf16Fn = void (*)(const bf16*, size_t, const bf16*, int, float*, size_t);
  using QuantFn = void (*)(const QuantRows&, const PackedMatrix&, int, float*, size_t);
  static constexpr Bf16Fn bf16[] = {nullptr, bf16_block<MM>...};
  static constexpr QuantFn int8[] = {nullptr, quant_block<MM, false>...};
  static constexpr QuantFn int4[] = {nullptr, quant_block<MM, true>...};
  using Fp8Fn = void (*)(const ktf::bf16*, size_t, const PackedMatrix&, int, float*, size_t);
  static constexpr Fp8Fn fp8[] = {nullptr, fp8_block<MM>...};
  static constexpr Fp8Fn fp8_lut[] = {nullptr, fp8_block_lut<MM>...};
};
using Blocks = Tables<1, 2, 3, 4, 5, 6, 7, 8>;  // indexed by rows, 1..MMAX

void matmul_avx512(const bf16* X, size_t ldx, int M, const PackedMatrix& W, int nb0, int nb1, float* Y, size_t ldy) {
  if (W.fmt == Format::FP8 && M <= MMAX) {  // few rows: the bytes widened in registers
    const auto fn = (fp8_byte_tables() ? Blocks::fp8_lut : Blocks::fp8)[M];
    for (int b = nb0; b < nb1; ++b) fn(X, ldx, W, b, Y + size_t(b - nb0) * NB, ldy);
    return;
  }
  if (W.fmt != Format::BF16 && M <= MMAX) {  // few rows: integer products on the packed bytes
    const QuantRows xq = quantize_rows(X, ldx, M, W);
    const auto fn = (W.fmt == Format::INT8 ? Blocks::int8 : Blocks::int4)[M];
    for (int b = nb0; b < nb1; ++b) fn(xq, W, b, Y + size_t(b - nb0) * NB, ldy);
    return;
  }
  // many rows with quantized weights: dequantize each block once into bf16, reuse it for all rows
  thread_local std::vector<bf16> scratch_store;
  bf16* scratch = nullptr;
  if (W.fmt != Format::BF16) {
    scratch_store.resize(size_t(W.kp) * NB + 32);
    scratch = reinterpret_cast<bf16*>(round_up(reinterpret_cast<uintptr_t>(scratch_store.data()), 64));
  }
  for (int b = nb0; b < nb1; ++b) {
    const bf16* wb = static_cast<const bf16*>(W.data) + size_t(b) * W.kp * NB;
    if (scratch) {
      dequant_block_avx512(W, b, scratch);
      wb = scratch;
    }
    for (int m0 = 0; m0 < M; m0 += MMAX) {
      const int mm = std::min(MMAX, M - m0);
      Blocks::bf16[mm](X + m0 * ldx, ldx, wb, W.kp, Y + m0 * ldy + size_t(b - nb0) * NB, ldy);
    }
  }
}

// fp32 bit patterns rounded to bf16 (nearest even) in the upper half of each lane
inline __m512i round_to_bf16_bits(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
}

// exp(x) for x in [-87, 87]: 2^n * p(r), r = x - n ln2, p a degree-6 polynomial (rel err ~1e-7)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
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

inline __m512 round_bf16(__m512 f) {  // f rounded to bf16 precision, kept as fp32
  return _mm512_castsi512_ps(_mm512_and_si512(round_to_bf16_bits(f), _mm512_set1_epi32(int(0xffff0000u))));
}

}  // namespace

// h = bf16(bf16(silu(bf16(g))) * bf16(u)): the activation-dtype rounding of the reference
void silu_mul_bf16_avx512(const float* g, const float* u, bf16* h, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gb = round_bf16(_mm512_loadu_ps(g + i));
    const __m512 s = round_bf16(_mm512_div_ps(gb, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gb)))));
    const __m512 prod = _mm512_mul_ps(s, round_bf16(_mm512_loadu_ps(u + i)));
    _mm256_storeu_si256((__m256i*)(h + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_bits(prod), 16)));
  }
  for (; i < n; ++i) {
    const float gb = bf16_to_f32(f32_to_bf16(g[i]));
    const float s = bf16_to_f32(f32_to_bf16(gb / (1.f + std::exp(-gb))));
    h[i] = f32_to_bf16(s * bf16_to_f32(f32_to_bf16(u[i])));
  }
}

Kernels avx512_kernels() { return Kernels{matmul_avx512}; }

}  // namespace ktf

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
