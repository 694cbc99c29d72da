// Portable kernels: plain C++ that is correct on any x86-64 CPU (and the reference the ISA
// kernels are tested against). Compiled with the baseline flags only.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ktf/common.h"

namespace ktf {

const char* format_name(Format f) {
  switch (f) {
    case Format::BF16: return "bf16";
    case Format::INT8: return "int8";
    case Format::INT4: return "int4";
    case Format::FP8: return "fp8";
  }
  return "?";
}

const char* path_name(Path p) {
  switch (p) {
    case Path::AUTO: return "auto";
    case Path::GENERIC: return "generic";
    case Path::AVX512: return "avx512";
    case Path::AMX: return "amx";
  }
  return "?";
}

size_t PackedMatrix::data_bytes() const {
  size_t elems = size_t(np) * kp;
  switch (fmt) {
    case Format::BF16: return elems * 2;
    case Format::INT8: return elems;
    case Format::INT4: return elems / 2;
    case Format::FP8: return elems;
  }
  return 0;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint8_t f32_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= E4M3_MAX) return sign | 0x7e;
  if (a < 1.f / 64) return sign | uint8_t(std::nearbyint(a * 512.f));  // subnormal steps of 2^-9 (8 -> 2^-6)
  int e;
  std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): exponent e - 1
  int m = int(std::nearbyint(std::ldexp(a, 1 - e) * 8.f)) - 8;  // 3-bit mantissa, 8 when it rounds up
  int code = (e - 1 + 7) * 8 + m;  // m == 8 carries into the exponent
  return sign | uint8_t(std::min(code, 0x7e));
}

// Weight (n, k) of a packed matrix as float (0 in the padding).
static inline float packed_at(const PackedMatrix& W, int n, int k) {
  if (W.fmt == Format::BF16) return bf16_to_f32(static_cast<const bf16*>(W.data)[bf16_index(W.kp, n, k)]);
  const float s = W.scales[(size_t(n / NB) * (W.kp / W.group) + k / W.group) * NB + n % NB];
  const uint8_t* d = static_cast<const uint8_t*>(W.data);
  if (W.fmt == Format::INT8) return s * float(int(d[int8_index(W.kp, n, k)]) - INT8_BIAS);
  if (W.fmt == Format::FP8) return s * e4m3_to_f32(d[fp8_index(W.kp, n, k)]);
  const uint8_t byte = d[int4_index(W.kp, n, k)];
  return s * float(int(int4_high(k) ? byte >> 4 : byte & 15) - INT4_BIAS);
}

static void matmul_generic(const bf16* X, size_t ldx, int M, const PackedMatrix& W, int nb0, int nb1, float* Y,
                           size_t ldy) {
  std::vector<float> w(W.kp), x(size_t(M) * W.kp);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < W.kp; ++k) x[size_t(m) * W.kp + k] = bf16_to_f32(X[m * ldx + k]);
  for (int b = nb0; b < nb1; ++b)
    for (int j = 0; j < NB; ++j) {
      for (int k = 0; k < W.kp; ++k) w[k] = packed_at(W, b * NB + j, k);
      for (int m = 0; m < M; ++m) {
        const float* xm = &x[size_t(m) * W.kp];
        float acc = 0.f;
        for (int k = 0; k < W.kp; ++k) acc += xm[k] * w[k];
        Y[m * ldy + (b - nb0) * NB + j] = acc;
      }
    }
}

Kernels generic_kernels() { return Kernels{matmul_generic}; }

}  // namespace ktf
