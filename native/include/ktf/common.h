// Shared definitions of ktflow's native CPU MoE backend: bf16 helpers, packed weight matrices and
// the per-ISA kernel table. No torch, no Python here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ktf {

using bf16 = uint16_t;

inline float bf16_to_f32(bf16 h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}

float f16_to_f32(uint16_t h);

inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// Packed weight formats. The layouts (NB = 16 output rows per block, K padded to KALIGN) put the
// K neighbours a dot-product instruction consumes together in one 32-bit lane, 16 rows side by
// side, so one 64-byte load feeds one VDPBF16PS / VPDPBUSD and the blocks are AMX B tiles:
//   BF16: bf16  [np/16][kp/2][16][2]   K pairs
//   INT8: uint8 [np/16][kp/4][16][4]   K quads, value + 128 (symmetric, |q| <= 127)
//   INT4: uint8 [np/16][kp/8][16][4]   K octets: byte i of a row holds k = 8q + i in its low
//                                      nibble and k = 8q + 4 + i in its high one, value + 8
//   FP8:  uint8 [np/16][kp/2][16][2]   K pairs of e4m3 bytes (the BF16 layout, one byte each), so
//                                      32 bytes widen to one VDPBF16PS operand in place
// The unsigned bias lets VPDPBUSD multiply weights (unsigned) by int8 activations (signed); it is
// taken out with the activations' sum. scales: float [np/16][kp/group][16] (INT8, INT4, FP8); an
// FP8 weight is e4m3(byte) * scale, its groups the checkpoint's 128-column blocks.
enum class Format : int { BF16 = 0, INT8 = 1, INT4 = 2, FP8 = 3 };
// FP8 sources are e4m3 bytes with block scales beside them (SrcScales)
enum class SrcType : int { F32 = 0, F16 = 1, BF16 = 2, FP8 = 3 };

constexpr int NB = 16;
constexpr int KALIGN = 32;

const char* format_name(Format f);

// Element (n, k) of a packed matrix with padded K kp: index of its bf16 / byte, and for INT4
// whether it is the high nibble.
inline size_t bf16_index(int kp, int n, int k) {
  return ((size_t(n / NB) * (kp / 2) + k / 2) * NB + n % NB) * 2 + (k & 1);
}
inline size_t int8_index(int kp, int n, int k) {
  return ((size_t(n / NB) * (kp / 4) + k / 4) * NB + n % NB) * 4 + (k & 3);
}
inline size_t int4_index(int kp, int n, int k) {
  return ((size_t(n / NB) * (kp / 8) + k / 8) * NB + n % NB) * 4 + (k & 3);
}
inline bool int4_high(int k) { return (k & 4) != 0; }
inline size_t fp8_index(int kp, int n, int k) { return bf16_index(kp, n, k); }
constexpr int INT8_BIAS = 128, INT4_BIAS = 8;
constexpr int FP8_GROUP = 128;     // default FP8 group: the published 128 x 128 blocks
constexpr float E4M3_MAX = 448.f;  // largest finite e4m3 value

// e4m3 (the "fn" variant: no infinities, S.1111.111 is NaN) to float, exactly.
inline float e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if ((b & 0x7f) == 0x7f) {
    uint32_t nan = 0x7fc00000u;
    std::memcpy(&v, &nan, 4);
  } else {
    v = e ? float(8 + m) * float(1 << e) / 1024.f : float(m) / 512.f;  // (1 + m/8) 2^(e-7), m/8 2^-6
  }
  return b & 0x80 ? -v : v;
}
// float to the nearest e4m3 (ties to even), saturating at +-448; NaN stays NaN.
uint8_t f32_to_e4m3(float f);

// The block scales of an FP8 source matrix: element (r, c) of the matrix is
// e4m3(src[r, c]) * s[(row0 + r) / bn * ld + (col0 + c) / bk], (row0, col0) where the matrix
// starts in the checkpoint tensor the scales belong to (a slice of its rows or columns).
struct SrcScales {
  const float* s = nullptr;
  size_t ld = 0;
  int bn = FP8_GROUP, bk = FP8_GROUP;
  int row0 = 0, col0 = 0;
  float at(int r, int c) const { return s[size_t(row0 + r) / bn * ld + size_t(col0 + c) / bk]; }
};

struct PackedMatrix {  // y = W x with W [n, k]
  Format fmt = Format::BF16;
  int n = 0, k = 0;    // logical
  int np = 0, kp = 0;  // padded: np % 16 == 0, kp % 32 == 0 and kp % group == 0
  int group = 0;       // quantization group along K (INT8/INT4); kp for per-channel
  void* data = nullptr;
  float* scales = nullptr;

  int nblocks() const { return np / NB; }
  size_t data_bytes() const;
  size_t scale_count() const { return fmt == Format::BF16 ? 0 : size_t(np) * (kp / group); }
  const float* group_scales(int b) const { return scales + size_t(b) * (kp / group) * NB; }  // block b's
};

// Which kernel family runs a matmul.
enum class Path : int { AUTO = 0, GENERIC = 1, AVX512 = 2, AMX = 3 };
const char* path_name(Path p);

// Y[m, 16*(b - nb0) + j] = sum_k X[m, k] * W[16*b + j, k]  for m < M, nb0 <= b < nb1 (fp32 out).
// X holds M rows of kp bf16 (zero beyond W.k), row stride ldx elements. Y row stride ldy floats.
using MatmulFn = void (*)(const bf16* X, size_t ldx, int M, const PackedMatrix& W, int nb0, int nb1, float* Y,
                          size_t ldy);

// One ISA's kernels (each in its own translation unit, compiled with its own flags).
struct Kernels {
  MatmulFn matmul = nullptr;  // nullptr: not built or not supported here
};

Kernels generic_kernels();
// Block b of an INT8/INT4/FP8 matrix dequantized into the BF16 layout at `out` (AVX-512; the AMX
// kernels use it too)
void dequant_block_avx512(const PackedMatrix& W, int b, bf16* out);
// AVX-512 epilogue of the up product: h = bf16(bf16(silu(bf16(g))) * bf16(u)), n values
void silu_mul_bf16_avx512(const float* g, const float* u, bf16* h, int n);
Kernels avx512_kernels();
Kernels amx_kernels();

// Runtime CPU features (CPUID + OS state); AMX only once the Linux tile permission is granted.
struct CpuFeatures {
  bool avx512 = false;  // F, BW, VL, DQ + OS ZMM state
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
  bool amx = false;  // AMX-TILE + AMX-BF16 + OS permission for tile data
  bool amx_int8 = false;
  bool avx512_vbmi = false;  // byte permutes (VPERMT2B): the fp8 kernel's table lookups
};
const CpuFeatures& cpu_features();

// Whether the AVX-512 fp8 kernel widens e4m3 through byte tables (VBMI; default where the CPU has
// it) or through binary16 conversions; settable so tests run both.
bool& fp8_byte_tables();

// The matmul of `path` (AUTO resolves to the best this CPU has for M rows); throws when the path
// is not available on this CPU.
MatmulFn matmul_for(Path path);
bool path_available(Path p);
// Rows up to which the AVX-512 kernels multiply INT8/INT4 weights as integers (int8 activations).
constexpr int QUANT_ROWS_MAX = 8;
Path resolve_path(Path requested, int rows, Format fmt);

// Rows at and above which AMX beats AVX-512 on this machine (measured once, see calibrate()).
int amx_crossover();
void set_amx_crossover(int rows);
int calibrate_amx_crossover(int k);


// 64-byte aligned allocation on a NUMA node (node < 0 or no libnuma: the calling thread's).
void* alloc_on_node(size_t bytes, int node);
void free_on_node(void* p, size_t bytes, int node);
// Page-aligned, page-padded allocation on a NUMA node (a range that can be pinned on its own).
void* alloc_pages_on_node(size_t bytes, int node);
void free_pages_on_node(void* p, size_t bytes, int node);

}  // namespace ktf
