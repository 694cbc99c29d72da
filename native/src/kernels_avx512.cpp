// AVX-512 kernels (F/BW/VL/DQ + BF16 + VNNI): bf16 weights through VDPBF16PS, int8/int4 weights
// dequantized in registers and multiplied in fp32 with one scale per K group. Best for few
// tokens per expert, where the work is streaming weights from DRAM. Built with its own flags and
// only called after CPUID says the CPU has these instructions.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ktf/common.h"

namespace ktf {
namespace {

constexpr int MMAX = 8;   // tokens per register block
constexpr int CHUNK = 256;  // K values of activations converted to fp32 at a time

inline __m512 bf16x16_to_f32(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int MM>
void bf16_block(const bf16* X, size_t ldx, const bf16* w, int kp, float* Y, size_t ldy) {
  __m512 a0[MM], a1[MM];
  for (int m = 0; m < MM; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  const int pairs = kp / 2;
  for (int q = 0; q < pairs; q += 2) {
    __m512i w0 = _mm512_load_si512(w + size_t(q) * 32);
    __m512i w1 = _mm512_load_si512(w + size_t(q + 1) * 32);
    for (int m = 0; m < MM; ++m) {
      int32_t p0, p1;
      std::memcpy(&p0, X + m * ldx + 2 * q, 4);
      std::memcpy(&p1, X + m * ldx + 2 * q + 2, 4);
      a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_set1_epi32(p0), (__m512bh)w0);
      a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_set1_epi32(p1), (__m512bh)w1);
    }
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(Y + m * ldy, _mm512_add_ps(a0[m], a1[m]));
}

template <int MM>
void convert_chunk(const bf16* X, size_t ldx, int c0, int len, float (*xs)[CHUNK]) {
  for (int m = 0; m < MM; ++m)
    for (int k = 0; k < len; k += 16) _mm512_store_ps(&xs[m][k], bf16x16_to_f32(X + m * ldx + c0 + k));
}

// The shared frame of the quantized kernels: per K group, per chunk of activations converted to
// fp32, `inner(c0, len, xs, a0, a1)` accumulates the integer weights times x into two partial
// sums per row; each group's sum is then scaled by its per-row scales.
template <int MM, class Inner>
void grouped_block(const bf16* X, size_t ldx, const PackedMatrix& W, int b, float* Y, size_t ldy, Inner inner) {
  const float* sc = W.scales + size_t(b) * (W.kp / W.group) * NB;
  alignas(64) float xs[MM][CHUNK];
  __m512 tot[MM];
  for (int m = 0; m < MM; ++m) tot[m] = _mm512_setzero_ps();
  for (int g0 = 0; g0 < W.kp; g0 += W.group) {
    __m512 a0[MM], a1[MM];
    for (int m = 0; m < MM; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int c0 = g0; c0 < g0 + W.group; c0 += CHUNK) {
      const int len = std::min(CHUNK, g0 + W.group - c0);
      convert_chunk<MM>(X, ldx, c0, len, xs);
      inner(c0, len, xs, a0, a1);
    }
    __m512 s = _mm512_loadu_ps(sc + size_t(g0 / W.group) * NB);
    for (int m = 0; m < MM; ++m) tot[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), s, tot[m]);
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(Y + m * ldy, tot[m]);
}

template <int MM>
void int8_block(const bf16* X, size_t ldx, const PackedMatrix& W, int b, float* Y, size_t ldy) {
  const int8_t* w = static_cast<const int8_t*>(W.data) + size_t(b) * W.kp * NB;
  grouped_block<MM>(X, ldx, W, b, Y, ldy, [w](int c0, int len, float (*xs)[CHUNK], __m512* a0, __m512* a1) {
    for (int k = 0; k < len; k += 4) {
      __m512i w4 = _mm512_load_si512(w + size_t(c0 + k) * NB);
      __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(w4)));
      __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w4, 1)));
      __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w4, 2)));
      __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w4, 3)));
      for (int m = 0; m < MM; ++m) {
        a0[m] = _mm512_fmadd_ps(f0, _mm512_set1_ps(xs[m][k]), a0[m]);
        a1[m] = _mm512_fmadd_ps(f1, _mm512_set1_ps(xs[m][k + 1]), a1[m]);
        a0[m] = _mm512_fmadd_ps(f2, _mm512_set1_ps(xs[m][k + 2]), a0[m]);
        a1[m] = _mm512_fmadd_ps(f3, _mm512_set1_ps(xs[m][k + 3]), a1[m]);
      }
    }
  });
}

template <int MM>
void int4_block(const bf16* X, size_t ldx, const PackedMatrix& W, int b, float* Y, size_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * (W.kp / 2) * NB;
  grouped_block<MM>(X, ldx, W, b, Y, ldy, [w](int c0, int len, float (*xs)[CHUNK], __m512* a0, __m512* a1) {
    const __m512i lo_mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int k = 0; k < len; k += 8) {
      __m512i w4 = _mm512_load_si512(w + size_t(c0 + k) / 2 * NB);
      __m128i parts[4] = {_mm512_castsi512_si128(w4), _mm512_extracti32x4_epi32(w4, 1),
                          _mm512_extracti32x4_epi32(w4, 2), _mm512_extracti32x4_epi32(w4, 3)};
      for (int j = 0; j < 4; ++j) {
        __m512i v = _mm512_cvtepu8_epi32(parts[j]);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, lo_mask), eight));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight));
        for (int m = 0; m < MM; ++m) {
          a0[m] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xs[m][k + 2 * j]), a0[m]);
          a1[m] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xs[m][k + 2 * j + 1]), a1[m]);
        }
      }
    }
  });
}

// fp32 bit patterns rounded to bf16 (nearest even) in the upper half of each lane
inline __m512i round_to_bf16_bits(__m512 f) {
  __m512i u = _mm512_castps_si512(f);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
}

// 16 rows of (k, k+1) as interleaved bf16 pairs: one 64-byte row of the BF16 layout
inline void store_pair(bf16* out, __m512 even, __m512 odd) {
  __m512i e = _mm512_srli_epi32(round_to_bf16_bits(even), 16);
  __m512i o = _mm512_and_si512(round_to_bf16_bits(odd), _mm512_set1_epi32(int(0xffff0000u)));
  _mm512_store_si512(out, _mm512_or_si512(e, o));
}

}  // namespace

void dequant_block_avx512(const PackedMatrix& W, int b, bf16* out) {
  const float* sc = W.scales + size_t(b) * (W.kp / W.group) * NB;
  if (W.fmt == Format::INT8) {
    const int8_t* w = static_cast<const int8_t*>(W.data) + size_t(b) * W.kp * NB;
    for (int k = 0; k < W.kp; k += 2) {
      __m512 s = _mm512_loadu_ps(sc + size_t(k / W.group) * NB);
      __m512 e = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(w + size_t(k) * NB)))));
      __m512 o = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(w + size_t(k + 1) * NB)))));
      store_pair(out + size_t(k) * NB, e, o);
    }
  } else {
    const uint8_t* w = static_cast<const uint8_t*>(W.data) + size_t(b) * (W.kp / 2) * NB;
    const __m512i lo_mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    for (int k = 0; k < W.kp; k += 2) {
      __m512 s = _mm512_loadu_ps(sc + size_t(k / W.group) * NB);
      __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(w + size_t(k / 2) * NB)));
      __m512 e = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, lo_mask), eight)));
      __m512 o = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight)));
      store_pair(out + size_t(k) * NB, e, o);
    }
  }
}

namespace {

template <int MM>
void run_block(const bf16* X, size_t ldx, const PackedMatrix& W, const bf16* wb, int b, float* Y, size_t ldy) {
  if (wb) return bf16_block<MM>(X, ldx, wb, W.kp, Y, ldy);
  if (W.fmt == Format::INT8) return int8_block<MM>(X, ldx, W, b, Y, ldy);
  return int4_block<MM>(X, ldx, W, b, Y, ldy);
}

using BlockFn = void (*)(const bf16*, size_t, const PackedMatrix&, const bf16*, int, float*, size_t);
constexpr BlockFn kBlock[MMAX + 1] = {nullptr,        run_block<1>, run_block<2>, run_block<3>, run_block<4>,
                                      run_block<5>, run_block<6>, run_block<7>, run_block<8>};

void matmul_avx512(const bf16* X, size_t ldx, int M, const PackedMatrix& W, int nb0, int nb1, float* Y, size_t ldy) {
  // many tokens with quantized weights: dequantize each block once into bf16, reuse it for all rows
  const bool dequant = W.fmt != Format::BF16 && M > MMAX;
  thread_local std::vector<bf16, std::allocator<bf16>> scratch_store;
  bf16* scratch = nullptr;
  if (dequant) {
    scratch_store.resize(size_t(W.kp) * NB + 32);
    scratch = reinterpret_cast<bf16*>(round_up(reinterpret_cast<uintptr_t>(scratch_store.data()), 64));
  }
  for (int b = nb0; b < nb1; ++b) {
    const bf16* wb = nullptr;
    if (W.fmt == Format::BF16) {
      wb = static_cast<const bf16*>(W.data) + size_t(b) * W.kp * NB;
    } else if (dequant) {
      dequant_block_avx512(W, b, scratch);
      wb = scratch;
    }
    for (int m0 = 0; m0 < M; m0 += MMAX) {
      const int mm = std::min(MMAX, M - m0);
      kBlock[mm](X + m0 * ldx, ldx, W, wb, b, Y + m0 * ldy + size_t(b - nb0) * NB, ldy);
    }
  }
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
