// Native tests without Python, built with AddressSanitizer + UndefinedBehaviorSanitizer by
// `make native-test` (part of `make test`): kernels and the fused MoE against a double-precision
// reference on every path this CPU has, the thread pool under many small runs and exceptions, the
// queue (errors surface at sync, C entry points, shutdown with work pending).
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ktf/common.h"
#include "ktf/moe.h"
#include "ktf/pool.h"
#include "ktf/queue.h"

#include <thread>

using namespace ktf;

static int failures = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      ++failures;                                          \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                   \
      std::fprintf(stderr, "\n");                          \
    }                                                      \
  } while (0)

static std::vector<bf16> random_bf16(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  return v;
}

static double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

static double tol(Format f) {
  return f == Format::BF16 ? 1e-2 : f == Format::INT8 ? 3e-2 : f == Format::FP8 ? 6e-2 : 0.3;
}

// Every e4m3 code decodes and re-encodes to itself (NaN aside), and rounding between two codes
// goes to the nearer (ties to the even code).
static void test_e4m3() {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) {
      CHECK(std::isnan(e4m3_to_f32(uint8_t(b))), "e4m3 %#x is NaN", b);
      continue;
    }
    const float v = e4m3_to_f32(uint8_t(b));
    CHECK(f32_to_e4m3(v) == b, "e4m3 %#x -> %g -> %#x", b, v, f32_to_e4m3(v));
    if ((b & 0x7f) < 0x7e) {
      const float next = e4m3_to_f32(uint8_t(b + 1)), mid = (v + next) / 2;
      const int even = (b & 1) ? b + 1 : b;
      CHECK(f32_to_e4m3(mid) == even, "e4m3 midpoint of %#x: %#x", b, f32_to_e4m3(mid));
      CHECK(f32_to_e4m3(std::nextafter(mid, v)) == b, "e4m3 just below the midpoint of %#x", b);
    }
  }
  CHECK(f32_to_e4m3(1e6f) == 0x7e && f32_to_e4m3(-1e6f) == 0xfe, "e4m3 saturates at 448");
}

static void test_matmul(Path path, Format fmt, int group) {
  std::mt19937 rng(7);
  const int n = 100, k = 200;
  auto w = random_bf16(size_t(n) * k, rng, 1.f);
  PackedMatrix P;
  pack_matrix(P, w.data(), k, n, k, SrcType::BF16, fmt, group, NB, -1);
  for (int M : {1, 3, 8, 9, 17, 40}) {
    auto x = random_bf16(size_t(M) * P.kp, rng, 1.f);
    for (int r = 0; r < M; ++r)
      for (int c = k; c < P.kp; ++c) x[size_t(r) * P.kp + c] = 0;
    std::vector<float> y(size_t(M) * P.np);
    matmul_for(path)(x.data(), P.kp, M, P, 0, P.nblocks(), y.data(), P.np);
    std::vector<double> got, ref;
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < n; ++c) {
        double acc = 0;
        for (int q = 0; q < k; ++q) acc += double(bf16_to_f32(x[size_t(r) * P.kp + q])) * bf16_to_f32(w[size_t(c) * k + q]);
        ref.push_back(acc);
        got.push_back(y[size_t(r) * P.np + c]);
      }
    const double e = rel_err(got, ref);
    CHECK(e < tol(fmt), "matmul %s %s group %d M %d: rel err %g", path_name(path), format_name(fmt), group, M, e);
  }
  free_matrix(P, -1);
}

struct Experts {
  int E, H, I;
  std::vector<bf16> gate, up, down;
};

static Experts make_experts(int E, int H, int I, std::mt19937& rng) {
  return {E, H, I, random_bf16(size_t(E) * I * H, rng, 1.f / std::sqrt(float(H))),
          random_bf16(size_t(E) * I * H, rng, 1.f / std::sqrt(float(H))),
          random_bf16(size_t(E) * H * I, rng, 1.f / std::sqrt(float(I)))};
}

static std::vector<double> reference(const Experts& x, const std::vector<bf16>& in, const std::vector<int64_t>& ids,
                                     const std::vector<float>& wts, int T, int k, int k0, int k1,
                                     const std::vector<uint8_t>& present) {
  std::vector<double> out(size_t(T) * x.H, 0.0), h(x.I);
  for (int t = 0; t < T; ++t)
    for (int s = k0; s < k1; ++s) {
      const int64_t e = ids[size_t(t) * k + s];
      if (e < 0 || !present[e]) continue;
      for (int i = 0; i < x.I; ++i) {
        double g = 0, u = 0;
        for (int c = 0; c < x.H; ++c) {
          const double v = bf16_to_f32(in[size_t(t) * x.H + c]);
          g += v * bf16_to_f32(x.gate[(size_t(e) * x.I + i) * x.H + c]);
          u += v * bf16_to_f32(x.up[(size_t(e) * x.I + i) * x.H + c]);
        }
        h[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int c = 0; c < x.H; ++c) {
        double acc = 0;
        for (int i = 0; i < x.I; ++i) acc += h[i] * bf16_to_f32(x.down[(size_t(e) * x.H + c) * x.I + i]);
        out[size_t(t) * x.H + c] += wts[size_t(t) * k + s] * acc;
      }
    }
  return out;
}

// A job over x [T, H] bf16 with routing [T, k] (columns k0..k), into out [T, H] fp32.
static Job fp32_job(MoE& moe, const std::vector<bf16>& x, const std::vector<int64_t>& ids,
                    const std::vector<float>& wts, int k, int k0, std::vector<float>& out) {
  Job j;
  j.moe = &moe;
  j.x = x.data();
  j.ldx = moe.shape().hidden;
  j.ids = ids.data();
  j.weights = wts.data();
  j.ldr = k;
  j.k0 = k0;
  j.k1 = k;
  j.tokens = int(ids.size()) / k;
  j.out = out.data();
  j.out_f32 = true;
  j.ldo = moe.shape().hidden;
  return j;
}

static void test_moe(std::shared_ptr<ThreadPool> pool, int T, int k, int E, Path path, Format fmt, int group,
                     std::vector<int> groups, std::mt19937& rng) {
  const int H = 200, I = 72;
  Experts x = make_experts(E, H, I, rng);
  std::vector<uint8_t> present(E, 1);
  present[1] = 0;
  MoE moe(pool, MoEShape{E, H, I, fmt, group}, groups, present);
  std::vector<int> held;
  std::vector<MoE::Source> src;
  for (int e = 0; e < E; ++e)
    if (present[e]) {
      held.push_back(e);
      src.push_back({&x.gate[size_t(e) * I * H], &x.up[size_t(e) * I * H], &x.down[size_t(e) * H * I], size_t(H),
                     size_t(H), size_t(I)});
    }
  moe.pack(held, src, SrcType::BF16);
  auto in = random_bf16(size_t(T) * H, rng, 1.f);
  std::vector<int64_t> ids(size_t(T) * k);
  std::vector<float> wts(size_t(T) * k);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (int t = 0; t < T; ++t) {
    std::vector<int64_t> perm(E);
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int s = 0; s < k; ++s) {
      ids[size_t(t) * k + s] = perm[s];
      wts[size_t(t) * k + s] = u(rng);
    }
  }
  if (T > 1) ids[0] = -1;
  const int k0 = k > 2 ? 1 : 0;
  std::vector<float> out(size_t(T) * H, 0.f);
  std::vector<Job> jobs{fp32_job(moe, in, ids, wts, k, k0, out)};
  Job& j = jobs[0];
  j.path = path;
  bool routed = false;  // some pick in columns k0.. names a held expert
  for (int t = 0; t < T; ++t)
    for (int s = k0; s < k; ++s) routed |= ids[size_t(t) * k + s] >= 0 && present[ids[size_t(t) * k + s]];
  run_jobs(*pool, jobs);
  // with work, the overlapped phases still end in order: the last up task, then the last down task
  const int64_t* ph = moe.workspace().phase_ns;
  CHECK(!routed || (ph[2] > 0 && ph[3] > 0), "moe phases: up %lld ns, down %lld ns", (long long)ph[2],
        (long long)ph[3]);
  auto ref = reference(x, in, ids, wts, T, k, k0, k, present);
  std::vector<double> got(out.begin(), out.end());
  const double e = rel_err(got, ref);
  CHECK(e < tol(fmt), "moe T %d k %d E %d %s %s group %d slices %zu: rel err %g", T, k, E, path_name(path),
        format_name(fmt), group, moe.slices().size(), e);
  // accumulate: a second run adds the same again
  j.accumulate = true;
  run_jobs(*pool, jobs);
  for (size_t i = 0; i < got.size(); ++i) got[i] = out[i] / 2.0;
  CHECK(rel_err(got, ref) < tol(fmt), "moe accumulate: rel err %g", rel_err(got, ref));
  // a mask computes only the experts it names (the others' picks are skipped like ids of -1)
  std::vector<uint8_t> mask(E, 0), both(E, 0);
  for (int e = 0; e < E; e += 2) mask[e] = 1;
  for (int e = 0; e < E; ++e) both[e] = mask[e] && present[e];
  std::fill(out.begin(), out.end(), 0.f);
  j.accumulate = false;
  j.mask = mask.data();
  run_jobs(*pool, jobs);
  auto masked = reference(x, in, ids, wts, T, k, k0, k, both);
  got.assign(out.begin(), out.end());
  CHECK(rel_err(got, masked) < tol(fmt), "moe with an expert mask: rel err %g", rel_err(got, masked));
  // a task that fails (here: a kernel path this CPU lacks, in every up task) fails the run with its
  // own error, and the down and reduce tasks waiting on it are skipped rather than left spinning
  if (routed && !path_available(Path::AMX)) {
    j.path = Path::AMX;
    j.mask = nullptr;
    bool raised = false;
    try {
      run_jobs(*pool, jobs);
    } catch (const std::runtime_error& err) {
      raised = std::string(err.what()).find("not available") != std::string::npos;
    }
    CHECK(raised, "moe T %d k %d E %d %s: a failing up task did not fail the run with its own error", T, k, E,
          format_name(fmt));
    j.path = path;
  }
  // every held expert's matrices lie in its slice's arena: block arena_block(e), at the layout's offsets
  for (const MoE::Slice& sl : moe.slices()) {
    CHECK(reinterpret_cast<uintptr_t>(sl.arena) % 4096 == 0 && sl.arena_bytes % 4096 == 0, "arena is page aligned");
    for (int e = 0; e < E; ++e) {
      if (!present[e]) {
        CHECK(moe.arena_block(e) == -1, "expert %d is not held but has a block", e);
        continue;
      }
      const uint8_t* block = sl.arena + size_t(moe.arena_block(e)) * sl.expert_stride;
      const PackedMatrix* mats[3] = {&sl.gate[e], &sl.up[e], &sl.down[e]};
      for (int w = 0; w < 3; ++w) {
        const MoE::MatrixLayout& L = sl.layout[w];
        CHECK(static_cast<const uint8_t*>(mats[w]->data) == block + L.data_offset && mats[w]->data_bytes() == L.data_bytes,
              "expert %d matrix %d data is not where the layout says", e, w);
        CHECK(L.scales_bytes == 0 || reinterpret_cast<const uint8_t*>(mats[w]->scales) == block + L.scales_offset,
              "expert %d matrix %d scales are not where the layout says", e, w);
        CHECK(block + L.scales_offset + L.scales_bytes <= sl.arena + sl.arena_bytes, "expert %d overruns the arena", e);
      }
    }
  }
}

static void test_pool_stress(std::shared_ptr<ThreadPool> pool) {
  std::atomic<long> sum{0};
  for (int run = 0; run < 2000; ++run) {
    std::vector<int> counts(pool->groups(), 0);
    for (int g = 0; g < pool->groups(); ++g) counts[g] = (run * 7 + g) % 13;
    long want = 0;
    for (int c : counts) want += long(c) * (c - 1) / 2;
    sum = 0;
    pool->run(counts, [](void* ctx, int, int i) { static_cast<std::atomic<long>*>(ctx)->fetch_add(i); }, &sum);
    CHECK(sum == want, "pool run %d: sum %ld, want %ld", run, sum.load(), want);
  }
  bool threw = false;
  try {
    pool->run(std::vector<int>(pool->groups(), 50), [](void*, int, int i) {
      if (i == 17) throw std::runtime_error("task 17 failed");
    }, nullptr);
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()) == "task 17 failed";
  }
  CHECK(threw, "a task's exception reaches the caller of run()");
  sum = 0;
  pool->run(std::vector<int>(pool->groups(), 3), [](void* ctx, int, int) { static_cast<std::atomic<long>*>(ctx)->fetch_add(1); }, &sum);
  CHECK(sum == 3 * pool->groups(), "the pool works after an exception");
  // wake() between runs, and from another thread during them, neither loses a run nor runs one twice
  std::atomic<bool> stop{false};
  std::thread waker([&] {
    while (!stop.load()) pool->wake();
  });
  for (int run = 0; run < 500; ++run) {
    if (run % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // past the spin: asleep
    sum = 0;
    pool->run(std::vector<int>(pool->groups(), 5), [](void* ctx, int, int) { static_cast<std::atomic<long>*>(ctx)->fetch_add(1); }, &sum);
    CHECK(sum == 5 * pool->groups(), "run %d beside wake(): %ld tasks ran, want %d", run, sum.load(), 5 * pool->groups());
  }
  stop = true;
  waker.join();
}

// A ring of batches submitted by doorbells, as a captured GPU step rings them: a thread plays the
// GPU (clear the done flag, ring, wait for the flag), the dispatcher polls the armed ring in order.
static void test_doorbells(Queue& q, Job good, Job bad, std::vector<float>& out, const std::vector<double>& ref) {
  std::atomic<uint32_t> bells[3] = {{0}, {0}, {0}}, done[3] = {{1}, {1}, {1}};
  Batch a{&q, {good}}, b{&q, {good}}, c{&q, {good}};
  Batch* ring[3] = {&a, &b, &c};
  for (int i = 0; i < 3; ++i) ring[i]->doorbell = &bells[i], ring[i]->done_flag = &done[i];
  const int id = q.add_ring({&a, &b, &c});
  std::fill(out.begin(), out.end(), 0.f);
  const int steps = 40;
  for (int s = 0; s < steps; ++s) {
    q.arm(id);
    std::thread gpu([&] {
      for (int i = 0; i < 3; ++i) {
        done[i].store(0, std::memory_order_relaxed);
        bells[i].store(1, std::memory_order_release);
        while (done[i].load(std::memory_order_acquire) != 1) _mm_pause();
      }
    });
    gpu.join();
  }
  q.sync();
  std::vector<double> got(out.begin(), out.end());
  for (auto& v : got) v /= 3.0 * steps;
  CHECK(rel_err(got, ref) < 1e-2, "doorbell-submitted runs accumulate: rel err %g", rel_err(got, ref));
  CHECK(a.submits == uint64_t(steps) && c.finishes == uint64_t(steps), "every ring was run once per step");
  CHECK(bells[0] == 0 && bells[2] == 0, "the dispatcher clears a doorbell it answers");
  // a pass the GPU stops ringing: the error surfaces at sync and the rest of the done flags are set
  q.set_ring_timeout_ns(20'000'000);
  q.arm(id);
  done[0] = done[1] = done[2] = 0;
  bells[0].store(1, std::memory_order_release);
  while (done[2].load(std::memory_order_acquire) != 1) _mm_pause();
  bool threw = false;
  try {
    q.sync();
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()).find("did not ring CPU task 1 of 3") != std::string::npos;
  }
  CHECK(threw && done[1] == 1, "an unrung doorbell ends the pass with an error and releases its done flags");
  // a failing batch rung from the GPU: its flag is set, its error surfaces at sync
  Batch broken{&q, {bad}};
  std::atomic<uint32_t> bell{0}, flag{0};
  broken.doorbell = &bell, broken.done_flag = &flag;
  const int one = q.add_ring({&broken});
  q.arm(one);
  bell.store(1, std::memory_order_release);
  while (flag.load(std::memory_order_acquire) != 1) _mm_pause();
  threw = false;
  try {
    q.sync();
  } catch (const std::out_of_range&) {
    threw = true;
  }
  CHECK(threw, "a doorbell-submitted batch's error surfaces at sync");
  q.set_ring_timeout_ns(30'000'000'000);
}

static void test_queue(std::shared_ptr<ThreadPool> pool, std::mt19937& rng) {
  const int E = 4, H = 64, I = 32, T = 3, k = 2;
  Experts x = make_experts(E, H, I, rng);
  MoE moe(pool, MoEShape{E, H, I, Format::BF16, 0}, {}, {});
  std::vector<int> held{0, 1, 2, 3};
  std::vector<MoE::Source> src;
  for (int e = 0; e < E; ++e)
    src.push_back({&x.gate[size_t(e) * I * H], &x.up[size_t(e) * I * H], &x.down[size_t(e) * H * I], size_t(H), size_t(H),
                   size_t(I)});
  moe.pack(held, src, SrcType::BF16);
  auto in = random_bf16(size_t(T) * H, rng, 1.f);
  std::vector<int64_t> ids{0, 1, 2, 3, 1, 2}, bad{0, 9, 2, 3, 1, 2};
  std::vector<float> wts{0.5f, 0.5f, 1.f, 0.2f, 0.3f, 0.7f};
  std::vector<float> out(size_t(T) * H, 0.f);
  int32_t tokens = T;
  auto job = [&](const std::vector<int64_t>& which) {
    Job j = fp32_job(moe, in, which, wts, k, 0, out);
    j.tokens_ptr = &tokens;
    j.accumulate = true;
    return j;
  };
  {
    auto owner = std::make_unique<Queue>(pool);
    Queue& q = *owner;
    Batch good{&q, {job(ids)}}, broken{&q, {job(bad)}};
    for (int i = 0; i < 500; ++i) ktf_submit(&good);  // the C entry points, as a CUDA stream calls them
    ktf_sync(&q);
    auto ref = reference(x, in, ids, wts, T, k, 0, k, std::vector<uint8_t>(E, 1));
    std::vector<double> got(out.begin(), out.end());
    for (auto& v : got) v /= 500.0;
    CHECK(rel_err(got, ref) < 1e-2, "500 queued runs accumulate: rel err %g", rel_err(got, ref));
    q.submit(&broken);
    q.submit(&good);
    bool threw = false;
    try {
      q.sync();
    } catch (const std::out_of_range& e) {
      threw = std::string(e.what()).find("expert id 9") != std::string::npos;
    }
    CHECK(threw, "a failing job's error surfaces at sync");
    q.sync();  // reported once
    Batch first{&q, {job(ids)}}, second{&q, {job(ids)}};
    for (int i = 0; i < 20; ++i) {
      ktf_submit(&first);
      ktf_submit(&second);
      ktf_wait_batch(&first);  // as a captured graph's wait node calls it
      const int64_t done_first = int64_t(first.finishes), sub_first = int64_t(first.submits),
                    done_second = int64_t(second.finishes);
      CHECK(done_first == sub_first, "wait_batch returns once its batch has run (%lld of %lld)", (long long)done_first,
            (long long)sub_first);
      CHECK(done_second <= i + 1, "a later batch never runs before an earlier one");
    }
    q.sync();
    CHECK(second.finishes == second.submits, "every submission of the second batch ran");
    std::atomic<uint32_t> flag{7};
    first.done_flag = &flag;
    for (int i = 0; i < 50; ++i) {
      ktf_submit(&second);
      ktf_submit(&first);
      while (flag.load(std::memory_order_acquire) != 1) _mm_pause();  // as a stream's wait-value node polls it
      CHECK(first.finishes == first.submits, "the done flag is set only once its batch has run");
    }
    first.done_flag = nullptr;
    broken.done_flag = &flag;
    q.submit(&broken);
    while (flag.load(std::memory_order_acquire) != 1) _mm_pause();  // a failed batch sets it too: nothing hangs
    try {
      q.sync();
    } catch (const std::out_of_range&) {
    }
    first.done_flag = broken.done_flag = nullptr;
    test_doorbells(q, job(ids), job(bad), out, ref);
    for (int i = 0; i < 200; ++i) q.submit(&good);
    owner.reset();  // destroying the queue with work pending finishes that work and stops
  }
}

int main() {
  const CpuFeatures& f = cpu_features();
  std::printf("cpu: avx512 %d bf16 %d vnni %d amx %d\n", f.avx512, f.avx512_bf16, f.avx512_vnni, f.amx);
  std::vector<Path> paths{Path::GENERIC};
  if (path_available(Path::AVX512)) paths.push_back(Path::AVX512);
  if (path_available(Path::AMX)) paths.push_back(Path::AMX);
  const std::pair<Format, int> formats[] = {{Format::BF16, 0}, {Format::INT8, 0}, {Format::INT8, 64}, {Format::INT4, 32},
                                            {Format::INT4, 0}, {Format::FP8, 0}, {Format::FP8, 32}};
  test_e4m3();
  for (Path p : paths)
    for (auto [fmt, group] : formats) test_matmul(p, fmt, group);
  if (cpu_features().avx512_vbmi && path_available(Path::AVX512)) {  // the fp8 kernel's other widening
    fp8_byte_tables() = false;
    test_matmul(Path::AVX512, Format::FP8, 0);
    fp8_byte_tables() = true;
  }
  auto pool = std::make_shared<ThreadPool>(0, 2, true);  // two groups: virtual on a one-node machine
  std::mt19937 rng(11);
  const int Ts[] = {1, 2, 7, 16, 33, 130};
  const int ks[] = {1, 2, 6, 8};
  int n = 0;
  for (Path p : paths)
    for (auto [fmt, group] : formats)
      for (int T : Ts) {
        const int k = ks[n++ % 4];
        test_moe(pool, T, k, k + 4, p, fmt, group, n % 2 ? std::vector<int>{0} : std::vector<int>{}, rng);
      }
  test_moe(pool, 600, 8, 16, Path::AUTO, Format::BF16, 0, {}, rng);
  test_pool_stress(pool);
  test_queue(pool, rng);
  test_pool_stress(std::make_shared<ThreadPool>(3, 3, false));
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("native tests passed\n");
  return 0;
}
