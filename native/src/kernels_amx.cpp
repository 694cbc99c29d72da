// AMX kernels: bf16 tile matmul (TDPBF16PS) for many tokens per expert, where the work is matrix
// throughput. Int8/int4 weights are dequantized block by block to bf16 (AVX-512) and then go
// through the same tiles. Tiles: C 0-3 (2 token blocks x 2 output blocks), A 4-5, B 6-7.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "ktf/common.h"

// This file's functions are compiled for these instructions by a pragma placed after every
// #include, not by compiler flags for the whole file: the inline functions and templates the
// headers define (std::vector's growth, ktf/common.h's helpers) must keep the baseline ISA, since
// the linker keeps one copy of each for the whole module, and a copy built with these flags would
// run on every CPU (an illegal instruction on one without them).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c,amx-tile,amx-bf16,amx-int8"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c,amx-tile,amx-bf16,amx-int8")
#endif

namespace ktf {

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// C (fp32, stride ldc floats) = A rows [16 * NM] x B blocks [16 * NN] over K length kn, added to
// what C holds when `add` (the previous K chunks).
template <int NM, int NN>
void tiles(const bf16* A, size_t lda, const bf16* B0, const bf16* B1, int kn, float* C, size_t ldc, bool add) {
  const size_t cs = ldc * sizeof(float);
  if (add) {
    _tile_loadd(0, C, cs);
    if constexpr (NN == 2) _tile_loadd(1, C + 16, cs);
    if constexpr (NM == 2) {
      _tile_loadd(2, C + 16 * ldc, cs);
      if constexpr (NN == 2) _tile_loadd(3, C + 16 * ldc + 16, cs);
    }
  } else {
    _tile_zero(0);
    if constexpr (NN == 2) _tile_zero(1);
    if constexpr (NM == 2) {
      _tile_zero(2);
      if constexpr (NN == 2) _tile_zero(3);
    }
  }
  const size_t stride = lda * sizeof(bf16);
  for (int k = 0; k < kn; k += 32) {
    _tile_loadd(4, A + k, stride);
    _tile_loadd(6, B0 + size_t(k) * NB, 64);
    if constexpr (NN == 2) _tile_loadd(7, B1 + size_t(k) * NB, 64);
    if constexpr (NM == 2) _tile_loadd(5, A + 16 * lda + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NN == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NM == 2) {
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NN == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, cs);
  if constexpr (NN == 2) _tile_stored(1, C + 16, cs);
  if constexpr (NM == 2) {
    _tile_stored(2, C + 16 * ldc, cs);
    if constexpr (NN == 2) _tile_stored(3, C + 16 * ldc + 16, cs);
  }
}

using TileFn = void (*)(const bf16*, size_t, const bf16*, const bf16*, int, float*, size_t, bool);
constexpr TileFn kTiles[2][2] = {{tiles<1, 1>, tiles<1, 2>}, {tiles<2, 1>, tiles<2, 2>}};

// K chunk: the chunk of every token row (rows x 1 KiB) stays in L2 while the output blocks go by,
// a pair of blocks' chunk (32 KiB) in L1 while the token rows go by.
constexpr int KC = 512;

void matmul_amx(const bf16* X, size_t ldx, int M, const PackedMatrix& W, int nb0, int nb1, float* Y, size_t ldy) {
  configure_tiles();
  const size_t block = size_t(W.kp) * NB;  // bf16 elements per output block
  thread_local std::vector<bf16> wstore, xstore;
  thread_local std::vector<float> cstore;
  const bf16* wbase;
  if (W.fmt == Format::BF16) {
    wbase = static_cast<const bf16*>(W.data) + nb0 * block;
  } else {  // dequantize the blocks once, reuse them for every token block
    wstore.resize((nb1 - nb0) * block + 32);
    bf16* w = reinterpret_cast<bf16*>(round_up(reinterpret_cast<uintptr_t>(wstore.data()), 64));
    for (int b = nb0; b < nb1; ++b) dequant_block_avx512(W, b, w + (b - nb0) * block);
    wbase = w;
  }
  const int nblocks = nb1 - nb0, cols = nblocks * NB;
  // token rows in whole tiles: the tail (M % 32 rows) goes through a zero-padded copy, its
  // results through cstore [32][cols]
  const int full = M / 32 * 32;
  const int tail = M - full;
  const int nm_tail = tail > 16 ? 2 : 1;
  const bf16* xt = nullptr;
  if (tail) {
    xstore.assign(32 * size_t(W.kp), 0);
    for (int r = 0; r < tail; ++r) std::memcpy(&xstore[r * size_t(W.kp)], X + (full + r) * ldx, W.kp * sizeof(bf16));
    xt = xstore.data();
    cstore.resize(32 * size_t(cols));
  }
  for (int k0 = 0; k0 < W.kp; k0 += KC) {
    const int kn = std::min(KC, W.kp - k0);
    for (int b = 0; b < nblocks; b += 2) {
      const int nn = std::min(2, nblocks - b);
      const bf16* B0 = wbase + b * block + size_t(k0) * NB;
      const bf16* B1 = nn == 2 ? B0 + block : B0;
      for (int m = 0; m < full; m += 32)
        kTiles[1][nn - 1](X + m * ldx + k0, ldx, B0, B1, kn, Y + m * ldy + b * NB, ldy, k0 > 0);
      if (tail) kTiles[nm_tail - 1][nn - 1](xt + k0, W.kp, B0, B1, kn, cstore.data() + b * NB, cols, k0 > 0);
    }
  }
  for (int r = 0; r < tail; ++r) std::memcpy(Y + (full + r) * ldy, &cstore[size_t(r) * cols], cols * sizeof(float));
  _tile_release();
}

}  // namespace

Kernels amx_kernels() { return Kernels{matmul_amx}; }

}  // namespace ktf

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
