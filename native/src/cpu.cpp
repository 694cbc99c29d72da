// CPU feature detection (CPUID + XGETBV + the Linux AMX permission), kernel dispatch, the measured
// AMX/AVX-512 crossover, and NUMA-local allocation through libnuma loaded at run time.
#include <cpuid.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <random>
#include <vector>

#include "ktf/common.h"

namespace ktf {

namespace {

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

bool request_amx_permission() {
  constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) == 0 && (bitmask & (1ul << XFEATURE_XTILEDATA)))
    return true;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
  return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) == 0 && (bitmask & (1ul << XFEATURE_XTILEDATA));
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  if (!osxsave || __get_cpuid_max(0, nullptr) < 7) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  const bool tile_state = (xcr0 & (3ull << 17)) == (3ull << 17);
  __cpuid_count(7, 0, a, b, c, d);
  const bool f512 = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool vnni = c & (1u << 11), vbmi = c & (1u << 1);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
  unsigned a1 = 0, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  const bool bf16 = a1 & (1u << 5);
  f.avx512 = zmm_state && f512 && dq && bw && vl;
  f.avx512_bf16 = f.avx512 && bf16;
  f.avx512_vnni = f.avx512 && vnni;
  f.avx512_vbmi = f.avx512 && vbmi;
  // the AMX kernels dequantize and convert with AVX-512 BF16 too
  f.amx = f.avx512_bf16 && amx_tile && amx_bf16 && tile_state && request_amx_permission();
  f.amx_int8 = f.amx && amx_int8;
  // KTFLOW_NATIVE_ISA caps what is used: generic, avx512 or amx
  if (const char* cap = std::getenv("KTFLOW_NATIVE_ISA")) {
    std::string s(cap);
    if (s == "generic") f = CpuFeatures{};
    if (s == "avx512") f.amx = f.amx_int8 = false;
  }
  return f;
}

std::atomic<int> g_crossover{0};
std::once_flag g_calibrated;

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

bool& fp8_byte_tables() {
  static bool use = cpu_features().avx512_vbmi;
  return use;
}

bool path_available(Path p) {
  const CpuFeatures& f = cpu_features();
  switch (p) {
    case Path::AUTO:
    case Path::GENERIC: return true;
    case Path::AVX512: return f.avx512_bf16 && f.avx512_vnni;
    case Path::AMX: return f.amx;
  }
  return false;
}

MatmulFn matmul_for(Path path) {
  if (!path_available(path))
    throw std::runtime_error(std::string("kernel path '") + path_name(path) + "' is not available on this CPU");
  switch (path) {
    case Path::GENERIC: return generic_kernels().matmul;
    case Path::AVX512: return avx512_kernels().matmul;
    case Path::AMX: return amx_kernels().matmul;
    case Path::AUTO: break;
  }
  throw std::logic_error("matmul_for(AUTO): resolve the path first");
}

Path resolve_path(Path requested, int rows, Format fmt) {
  if (requested != Path::AUTO) return requested;
  const CpuFeatures& f = cpu_features();
  const bool avx512 = path_available(Path::AVX512);
  // quantized weights with few rows: the integer kernels read the packed bytes as they are
  if (fmt != Format::BF16 && rows <= QUANT_ROWS_MAX && avx512) return Path::AVX512;
  if (f.amx && rows >= amx_crossover()) return Path::AMX;
  if (avx512) return Path::AVX512;
  return Path::GENERIC;
}

int calibrate_amx_crossover(int k) {
  if (!path_available(Path::AMX) || !path_available(Path::AVX512)) return 0;
  const int nblocks = 16;
  PackedMatrix W;
  W.fmt = Format::BF16;
  W.n = W.np = nblocks * NB;
  W.k = W.kp = int(round_up(k, KALIGN));
  std::vector<bf16> wdata(size_t(W.np) * W.kp + 32), xdata(size_t(256) * W.kp);
  std::vector<float> y(size_t(256) * W.np);
  W.data = reinterpret_cast<bf16*>(round_up(reinterpret_cast<uintptr_t>(wdata.data()), 64));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (size_t i = 0; i < size_t(W.np) * W.kp; ++i) static_cast<bf16*>(W.data)[i] = f32_to_bf16(u(rng));
  for (auto& v : xdata) v = f32_to_bf16(u(rng));
  auto time = [&](MatmulFn fn, int m) {
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      fn(xdata.data(), W.kp, m, W, 0, nblocks, y.data(), W.np);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const MatmulFn avx = avx512_kernels().matmul, amx = amx_kernels().matmul;
  int crossover = 256;
  for (int m : {1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256}) {
    if (time(amx, m) < time(avx, m)) {
      crossover = m;
      break;
    }
  }
  g_crossover = crossover;
  return crossover;
}

int amx_crossover() {
  std::call_once(g_calibrated, [] {
    if (g_crossover.load() == 0) calibrate_amx_crossover(2048);
  });
  return g_crossover.load();
}

void set_amx_crossover(int rows) {
  std::call_once(g_calibrated, [] {});
  g_crossover = std::max(1, rows);
}

// ------------------------------------------------------------------------------------- NUMA

namespace {
struct LibNuma {
  void* (*alloc_onnode)(size_t, int) = nullptr;
  void (*free_fn)(void*, size_t) = nullptr;
  LibNuma() {
    void* h = dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    auto available = reinterpret_cast<int (*)()>(dlsym(h, "numa_available"));
    if (!available || available() < 0) return;
    alloc_onnode = reinterpret_cast<void* (*)(size_t, int)>(dlsym(h, "numa_alloc_onnode"));
    free_fn = reinterpret_cast<void (*)(void*, size_t)>(dlsym(h, "numa_free"));
    if (!alloc_onnode || !free_fn) alloc_onnode = nullptr;
  }
};
const LibNuma& libnuma() {
  static LibNuma l;
  return l;
}
}  // namespace

void* alloc_on_node(size_t bytes, int node) {
  bytes = std::max<size_t>(bytes, 64);
  if (node >= 0 && libnuma().alloc_onnode) {  // page aligned, so 64-byte aligned
    void* p = libnuma().alloc_onnode(bytes, node);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void* p = std::aligned_alloc(64, round_up(bytes, 64));
  if (!p) throw std::bad_alloc();
  return p;
}

void free_on_node(void* p, size_t bytes, int node) {
  if (!p) return;
  bytes = std::max<size_t>(bytes, 64);
  if (node >= 0 && libnuma().alloc_onnode)
    libnuma().free_fn(p, bytes);
  else
    std::free(p);
}

namespace {

constexpr size_t HUGE_PAGE = size_t(2) << 20;

// Ask for transparent huge pages over an arena of at least one huge page (KTFLOW_HUGEPAGES=0: no):
// a decode step streams every routed expert's bytes once, and with 4 KiB pages each page of the
// stream costs a TLB walk and stops the hardware prefetcher at its edge.
void advise_huge(void* p, size_t bytes) {
  static const bool on = [] {
    const char* v = std::getenv("KTFLOW_HUGEPAGES");
    return !(v && v[0] == '0');
  }();
  if (on && bytes >= HUGE_PAGE) madvise(p, bytes, MADV_HUGEPAGE);  // advice only: refused is fine
}

}  // namespace

void* alloc_pages_on_node(size_t bytes, int node) {
  bytes = round_up(std::max<size_t>(bytes, 1), 4096);
  if (node >= 0 && libnuma().alloc_onnode) {  // numa_alloc_onnode maps whole pages
    void* p = libnuma().alloc_onnode(bytes, node);
    if (!p) throw std::bad_alloc();
    advise_huge(p, bytes);
    return p;
  }
  // huge-page aligned where the arena spans huge pages, so that every one of them can be one
  const size_t align = bytes >= HUGE_PAGE ? HUGE_PAGE : 4096;
  void* p = std::aligned_alloc(align, round_up(bytes, align));
  if (!p) throw std::bad_alloc();
  advise_huge(p, bytes);
  return p;
}

void free_pages_on_node(void* p, size_t bytes, int node) {
  if (!p) return;
  bytes = round_up(std::max<size_t>(bytes, 1), 4096);
  if (node >= 0 && libnuma().alloc_onnode)
    libnuma().free_fn(p, bytes);
  else
    std::free(p);
}

}  // namespace ktf
