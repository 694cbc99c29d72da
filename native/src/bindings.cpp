// Python bindings (pybind11). Tensors cross as raw addresses with their shapes; the Python side
// (ktflow/native.py) checks dtypes, shapes and contiguity before calling in.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <atomic>
#include <tuple>
#include <random>

#include "ktf/common.h"
#include "ktf/moe.h"
#include "ktf/pool.h"
#include "ktf/queue.h"

namespace py = pybind11;
using namespace ktf;

namespace {

template <class T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

Format parse_format(const std::string& s) {
  if (s == "bf16") return Format::BF16;
  if (s == "int8") return Format::INT8;
  if (s == "int4") return Format::INT4;
  if (s == "fp8") return Format::FP8;
  throw std::invalid_argument("unknown weight format '" + s + "' (bf16, int8, int4 or fp8)");
}

SrcType parse_src(const std::string& s) {
  if (s == "float32") return SrcType::F32;
  if (s == "float16") return SrcType::F16;
  if (s == "bfloat16") return SrcType::BF16;
  if (s == "float8_e4m3fn") return SrcType::FP8;
  throw std::invalid_argument("unsupported source dtype '" + s + "' (float32, float16, bfloat16 or float8_e4m3fn)");
}

// An FP8 source's block scales from Python: (address of float32 scales, their row stride, the
// matrix's first row and column in the scales' tensor); block the checkpoint's [bn, bk].
using ScaleArg = std::tuple<uintptr_t, size_t, int, int>;
SrcScales src_scales(const ScaleArg& a, int bn, int bk) {
  SrcScales s;
  s.s = ptr<const float>(std::get<0>(a));
  s.ld = std::get<1>(a);
  s.bn = bn, s.bk = bk;
  s.row0 = std::get<2>(a), s.col0 = std::get<3>(a);
  if (bn <= 0 || bk <= 0) throw std::invalid_argument("FP8 block sizes must be positive");
  return s;
}

Path parse_path(const std::string& s) {
  if (s == "auto") return Path::AUTO;
  if (s == "generic") return Path::GENERIC;
  if (s == "avx512") return Path::AVX512;
  if (s == "amx") return Path::AMX;
  throw std::invalid_argument("unknown kernel path '" + s + "' (auto, generic, avx512 or amx)");
}

// One packed matrix on its own, for kernel tests and benchmarks.
struct PackedWeight {
  PackedMatrix m;
  PackedWeight(uintptr_t src, int n, int k, size_t ld, const std::string& dtype, const std::string& fmt, int group,
               const ScaleArg& scales, int bn, int bk) {
    const SrcScales ss = src_scales(scales, bn, bk);
    pack_matrix(m, ptr<const void>(src), ld, n, k, parse_src(dtype), parse_format(fmt), group, NB, -1,
                std::get<0>(scales) ? &ss : nullptr);
  }
  ~PackedWeight() { free_matrix(m, -1); }
  // y [M, n] (fp32, row stride ldy) = x [M, k] (bf16, row stride ldx) . W^T
  void matmul(uintptr_t x, size_t ldx, int M, uintptr_t y, size_t ldy, const std::string& path) {
    Path p = resolve_path(parse_path(path), M, m.fmt);
    MatmulFn fn = matmul_for(p);
    std::vector<bf16> xp(size_t(M) * m.kp, 0);
    for (int r = 0; r < M; ++r) std::memcpy(&xp[size_t(r) * m.kp], ptr<bf16>(x) + r * ldx, m.k * sizeof(bf16));
    std::vector<float> yp(size_t(M) * m.np);
    {
      py::gil_scoped_release nogil;
      fn(xp.data(), m.kp, M, m, 0, m.nblocks(), yp.data(), m.np);
    }
    for (int r = 0; r < M; ++r) std::memcpy(ptr<float>(y) + r * ldy, &yp[size_t(r) * m.np], m.n * sizeof(float));
  }
};

py::memoryview bytes_view(void* p, size_t n) { return py::memoryview::from_memory(p, ssize_t(n)); }

Job make_job(MoE& moe, uintptr_t x, size_t ldx, uintptr_t ids, uintptr_t weights, size_t ldr, int k0, int k1,
             int tokens, uintptr_t tokens_ptr, uintptr_t out, size_t ldo, bool out_f32, bool accumulate,
             const std::string& path, uintptr_t mask) {
  Job j;
  j.mask = ptr<const uint8_t>(mask);
  j.moe = &moe;
  j.x = ptr<const bf16>(x);
  j.ldx = ldx;
  j.ids = ptr<const int64_t>(ids);
  j.weights = ptr<const float>(weights);
  j.ldr = ldr;
  j.k0 = k0;
  j.k1 = k1;
  j.tokens = tokens;
  j.tokens_ptr = ptr<const int32_t>(tokens_ptr);
  j.out = ptr<void>(out);
  j.ldo = ldo;
  j.out_f32 = out_f32;
  j.accumulate = accumulate;
  j.path = parse_path(path);
  if (j.path != Path::AUTO) matmul_for(j.path);  // fail now if this CPU lacks it
  return j;
}

// All-thread DRAM read bandwidth: every pool thread sums its share of a buffer far larger than
// the caches (the fastest of `repeats` passes).
double stream_read_gbps(ThreadPool& pool, size_t bytes, int repeats) {
  const size_t words = bytes / 8, chunk = (1 << 20) / 8;
  std::vector<uint64_t> buf(words, 1);
  struct Ctx {
    const uint64_t* p;
    size_t words, chunk;
    std::atomic<uint64_t> sink{0};
  } ctx{buf.data(), words, chunk};
  const int tasks = int((words + chunk - 1) / chunk);
  std::vector<int> counts(pool.groups(), 0);
  for (int t = 0; t < tasks; ++t) ++counts[t % pool.groups()];
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    // group g's tasks are indices 0..counts[g]: map (group, index) to a global chunk
    struct Wrap {
      Ctx* c;
      int groups;
    } w{&ctx, pool.groups()};
    const int64_t t0 = now_ns();
    pool.run(counts, [](void* c, int g, int i) {
      auto* wr = static_cast<Wrap*>(c);
      auto* x = wr->c;
      const size_t chunk_index = size_t(i) * wr->groups + g;
      // the chunk as four streams read side by side (as a kernel reads gate and up, or several
      // weight blocks): one stream per core leaves DRAM bandwidth unused on some CPUs
      uint64_t acc[8] = {};
      const size_t lo = chunk_index * x->chunk, hi = std::min(x->words, lo + x->chunk);
      const size_t quarter = (hi - lo) / 4 / 8 * 8;
      const uint64_t* s = x->p + lo;
      for (size_t q = 0; q < quarter; q += 8)
        for (int j = 0; j < 8; j += 2) {
          acc[j] += s[q + j] + s[quarter + q + j] + s[2 * quarter + q + j] + s[3 * quarter + q + j];
          acc[j + 1] += s[q + j + 1] + s[quarter + q + j + 1] + s[2 * quarter + q + j + 1] + s[3 * quarter + q + j + 1];
        }
      for (size_t q = lo + 4 * quarter; q < hi; ++q) acc[0] += x->p[q];
      x->sink += acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    }, &w);
    best = std::min(best, double(now_ns() - t0) * 1e-9);
  }
  return double(words * 8) / best / 1e9;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "ktflow's native CPU MoE backend (see native/ and ktflow/native.py)";

  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx512"] = f.avx512;
    d["avx512_bf16"] = f.avx512_bf16;
    d["avx512_vnni"] = f.avx512_vnni;
    d["amx"] = f.amx;
    d["amx_int8"] = f.amx_int8;
    d["avx512_vbmi"] = f.avx512_vbmi;
    return d;
  });
  m.def("set_fp8_byte_tables", [](bool on) {
    if (on && !cpu_features().avx512_vbmi) throw std::invalid_argument("this CPU has no AVX-512 VBMI");
    const bool was = fp8_byte_tables();
    fp8_byte_tables() = on;
    return was;
  }, "choose the fp8 kernel's widening (byte tables: VBMI; else binary16); returns the previous choice");
  m.def("paths", [] {
    std::vector<std::string> out;
    for (Path p : {Path::GENERIC, Path::AVX512, Path::AMX})
      if (path_available(p)) out.push_back(path_name(p));
    return out;
  }, "kernel paths this CPU can run");
  m.def("amx_crossover", &amx_crossover, "rows per expert from which AMX is used (measured once)");
  m.def("set_amx_crossover", &set_amx_crossover);
  m.def("calibrate_amx_crossover", [](int k) {
    py::gil_scoped_release nogil;
    return calibrate_amx_crossover(k);
  });
  m.def("now_ns", &now_ns);
  m.def("kernel_tflops", [](const std::string& path, int M, int n, int k, const std::string& fmt, double seconds) {
    // one thread, data in cache: the matmul kernel's own throughput (n x k weights, M rows)
    std::vector<float> w(size_t(n) * k);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (float& v : w) v = u(rng);
    PackedMatrix P;
    pack_matrix(P, w.data(), k, n, k, SrcType::F32, parse_format(fmt), 0, NB, -1);
    std::vector<bf16> x(size_t(M) * P.kp);
    for (bf16& v : x) v = f32_to_bf16(u(rng));
    std::vector<float> y(size_t(M) * P.np);
    const MatmulFn fn = matmul_for(resolve_path(parse_path(path), M, P.fmt));
    double flops = 0;
    py::gil_scoped_release nogil;
    fn(x.data(), P.kp, M, P, 0, P.nblocks(), y.data(), P.np);
    const int64_t t0 = now_ns();
    int64_t t1 = t0;
    while (double(t1 - t0) < seconds * 1e9) {
      fn(x.data(), P.kp, M, P, 0, P.nblocks(), y.data(), P.np);
      flops += 2.0 * M * P.np * P.kp;
      t1 = now_ns();
    }
    free_matrix(P, -1);
    return flops / (double(t1 - t0) * 1e-9) / 1e12;
  }, py::arg("path"), py::arg("M"), py::arg("n"), py::arg("k"), py::arg("fmt") = "bf16", py::arg("seconds") = 0.2);
  m.def("stream_read_gbps", [](ThreadPool& pool, size_t bytes, int repeats) {
    py::gil_scoped_release nogil;
    return stream_read_gbps(pool, bytes, repeats);
  }, py::arg("pool"), py::arg("bytes") = size_t(2) << 30, py::arg("repeats") = 5,
     "all-thread DRAM read bandwidth (GB/s) with the pool's threads");
  m.def("submit_fn_ptr", [] { return reinterpret_cast<uintptr_t>(&ktf_submit); },
        "address of void ktf_submit(void* batch), for cudaLaunchHostFunc");
  m.def("sync_fn_ptr", [] { return reinterpret_cast<uintptr_t>(&ktf_sync); },
        "address of void ktf_sync(void* queue), for cudaLaunchHostFunc");
  m.def("wait_batch_fn_ptr", [] { return reinterpret_cast<uintptr_t>(&ktf_wait_batch); },
        "address of void ktf_wait_batch(void* batch), for cudaLaunchHostFunc");

  py::class_<ThreadPool, std::shared_ptr<ThreadPool>>(m, "Pool")
      .def(py::init<int, int, bool>(), py::arg("threads") = 0, py::arg("groups") = 0, py::arg("pin") = true)
      .def_property_readonly("threads", &ThreadPool::threads)
      .def_property_readonly("groups", &ThreadPool::groups)
      .def("group_cpus", &ThreadPool::group_cpus)
      .def("group_threads", &ThreadPool::group_threads)
      .def_property_readonly("cpus", &ThreadPool::cpus)
      .def_property(
          "spin_us", [](const ThreadPool& p) { return p.spin_ns() / 1000; },
          [](ThreadPool& p, long us) { p.set_spin_ns(us * 1000); },
          "microseconds an idle worker (and the caller awaiting a run) spins before it sleeps")
      .def("numa_node", &ThreadPool::numa_node);

  py::class_<PackedWeight>(m, "PackedWeight")
      .def(py::init<uintptr_t, int, int, size_t, const std::string&, const std::string&, int, const ScaleArg&, int,
                    int>(),
           py::arg("src"), py::arg("n"), py::arg("k"), py::arg("ld"), py::arg("dtype"), py::arg("format"),
           py::arg("group") = 0, py::arg("scales") = ScaleArg{0, 0, 0, 0}, py::arg("block_n") = FP8_GROUP,
           py::arg("block_k") = FP8_GROUP)
      .def_property_readonly("n", [](const PackedWeight& w) { return w.m.n; })
      .def_property_readonly("k", [](const PackedWeight& w) { return w.m.k; })
      .def_property_readonly("np", [](const PackedWeight& w) { return w.m.np; })
      .def_property_readonly("kp", [](const PackedWeight& w) { return w.m.kp; })
      .def_property_readonly("group", [](const PackedWeight& w) { return w.m.group; })
      .def_property_readonly("nbytes", [](const PackedWeight& w) { return w.m.data_bytes(); })
      .def("matmul", &PackedWeight::matmul);

  py::class_<MoE, std::shared_ptr<MoE>>(m, "MoE")
      .def(py::init([](std::shared_ptr<ThreadPool> pool, int experts, int hidden, int inter, const std::string& fmt,
                       int group_size, std::vector<int> groups, std::vector<uint8_t> present) {
             return std::make_shared<MoE>(pool, MoEShape{experts, hidden, inter, parse_format(fmt), group_size},
                                          groups, present);
           }),
           py::arg("pool"), py::arg("experts"), py::arg("hidden"), py::arg("inter"), py::arg("format") = "bf16",
           py::arg("group_size") = 0, py::arg("groups") = std::vector<int>{},
           py::arg("present") = std::vector<uint8_t>{})
      .def("pack",
           [](MoE& self, std::vector<int> experts, std::vector<uintptr_t> gate, std::vector<uintptr_t> up,
              std::vector<uintptr_t> down, size_t ld_gate, size_t ld_up, size_t ld_down, const std::string& dtype,
              std::vector<std::array<ScaleArg, 3>> scales, int bn, int bk) {
             if (gate.size() != experts.size() || up.size() != experts.size() || down.size() != experts.size())
               throw std::invalid_argument("pack: one gate, up and down address per expert");
             const SrcType t = parse_src(dtype);
             if (t == SrcType::FP8 && scales.size() != experts.size())
               throw std::invalid_argument("pack: FP8 experts need their gate, up and down scales each");
             std::vector<MoE::Source> src;
             for (size_t i = 0; i < experts.size(); ++i) {
               MoE::Source s{ptr<const void>(gate[i]), ptr<const void>(up[i]), ptr<const void>(down[i]), ld_gate, ld_up,
                             ld_down};
               if (t == SrcType::FP8) {
                 s.s_gate = src_scales(scales[i][0], bn, bk);
                 s.s_up = src_scales(scales[i][1], bn, bk);
                 s.s_down = src_scales(scales[i][2], bn, bk);
               }
               src.push_back(s);
             }
             py::gil_scoped_release nogil;
             self.pack(experts, src, t);
           },
           py::arg("experts"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("ld_gate"), py::arg("ld_up"),
           py::arg("ld_down"), py::arg("dtype"), py::arg("scales") = std::vector<std::array<ScaleArg, 3>>{},
           py::arg("block_n") = FP8_GROUP, py::arg("block_k") = FP8_GROUP)
      .def_property_readonly("slices",
                             [](const MoE& self) {
                               std::vector<std::tuple<int, int, int, int>> out;
                               for (auto& s : self.slices()) out.emplace_back(s.i0, s.i1, s.group, s.node);
                               return out;
                             })
      .def_property_readonly("packed_bytes", &MoE::packed_bytes)
      .def("is_packed", &MoE::packed)
      .def_property_readonly("last_phase_ns", [](MoE& m) {
        const Workspace& w = m.workspace();
        return std::vector<int64_t>(w.phase_ns, w.phase_ns + 5);
      }, "nanoseconds of the pool's last batch: route, gather, up, down, reduce")
      .def("packed_arrays",
           [](MoE& self, int slice, int expert, int which) {
             PackedMatrix& P = self.matrix(slice, expert, which);
             if (!P.data) throw std::runtime_error("expert " + std::to_string(expert) + " is not packed");
             py::object scales = py::none();
             if (P.scales) scales = bytes_view(P.scales, P.scale_count() * sizeof(float));
             return py::make_tuple(bytes_view(P.data, P.data_bytes()), scales, P.np, P.kp, P.group);
           },
           "(data bytes, scale bytes or None, np, kp, group) of one packed matrix (which: 0 gate, 1 up, 2 down)")
      .def("load_packed",
           [](MoE& self, int expert, std::vector<std::tuple<uintptr_t, size_t, uintptr_t, size_t>> parts) {
             // parts: per (slice, which) in order: (data address, bytes, scales address, bytes)
             if (parts.size() != self.slices().size() * 3)
               throw std::invalid_argument("load_packed: 3 matrices per slice expected");
             self.allocate_expert(expert);
             for (size_t s = 0; s < self.slices().size(); ++s)
               for (int which = 0; which < 3; ++which) {
                 PackedMatrix& P = self.matrix(int(s), expert, which);
                 auto [data, nbytes, scales, sbytes] = parts[s * 3 + which];
                 if (P.data_bytes() != nbytes || P.scale_count() * sizeof(float) != sbytes)
                   throw std::invalid_argument("load_packed: a cached matrix has the wrong size for this layout");
                 std::memcpy(P.data, ptr<void>(data), nbytes);
                 if (sbytes) std::memcpy(P.scales, ptr<void>(scales), sbytes);
               }
             self.mark_packed(expert);
           })
      .def("arena",
           [](MoE& self, int slice) {
             if (slice < 0 || slice >= int(self.slices().size())) throw std::out_of_range("no such slice");
             const MoE::Slice& s = self.slices()[slice];
             return py::make_tuple(reinterpret_cast<uintptr_t>(s.arena), s.arena_bytes, s.expert_stride);
           },
           "(address, bytes, expert stride) of a slice's arena: held experts in id order, one block each")
      .def("arena_block", &MoE::arena_block, "an expert's block index in every slice's arena (-1: not held)")
      .def("layout",
           [](MoE& self, int slice, int which) {
             if (slice < 0 || slice >= int(self.slices().size()) || which < 0 || which > 2)
               throw std::out_of_range("no such slice or matrix");
             const MoE::MatrixLayout& L = self.slices()[slice].layout[which];
             return py::make_tuple(L.data_offset, L.data_bytes, L.scales_offset, L.scales_bytes, L.n, L.k, L.np, L.kp,
                                   L.group);
           },
           "(data offset, data bytes, scales offset, scales bytes, n, k, np, kp, group) of matrix `which` "
           "(0 gate, 1 up, 2 down) in an expert's block of a slice's arena")
      .def("forward",
           [](MoE& self, uintptr_t x, size_t ldx, uintptr_t ids, uintptr_t weights, size_t ldr, int k0, int k1,
              int tokens, uintptr_t out, size_t ldo, bool out_f32, bool accumulate, const std::string& path,
              uintptr_t mask) {
             std::vector<Job> jobs{make_job(self, x, ldx, ids, weights, ldr, k0, k1, tokens, 0, out, ldo, out_f32,
                                            accumulate, path, mask)};
             py::gil_scoped_release nogil;
             run_jobs(self.pool(), jobs);
           },
           "synchronous forward on the calling thread and the pool (addresses; see ktflow/native.py)");

  py::class_<Queue, std::shared_ptr<Queue>>(m, "Queue")
      .def(py::init<std::shared_ptr<ThreadPool>>())
      .def("submit", [](Queue& q, Batch& b) {
        if (b.queue != &q) throw std::invalid_argument("this batch was made for another queue");
        q.submit(&b);
      })
      .def("sync", [](Queue& q) {
        py::gil_scoped_release nogil;
        q.sync();
      })
      .def_property_readonly("handle", [](Queue& q) { return reinterpret_cast<uintptr_t>(&q); })
      .def("add_ring", [](Queue& q, std::vector<std::shared_ptr<Batch>> ring) {
        std::vector<Batch*> raw;
        for (auto& b : ring) raw.push_back(b.get());
        return q.add_ring(std::move(raw));
      }, "register batches with doorbells, in the order a GPU step rings them; returns the ring's id")
      .def("arm", &Queue::arm, "one pass of the ring is coming: the dispatcher polls its doorbells in order")
      .def("disarm", [](Queue& q) {
        py::gil_scoped_release nogil;
        q.disarm();
      }, "the armed passes are not coming: drop them, end the one being polled without an error, release its "
         "done flags; returns once it has ended")
      .def("set_ring_timeout_ns", &Queue::set_ring_timeout_ns)
      .def("set_recording", &Queue::set_recording)
      .def("take_records", [](Queue& q) {
        std::vector<std::tuple<uintptr_t, int64_t, int64_t, int64_t>> out;
        for (auto& r : q.take_records())
          out.emplace_back(reinterpret_cast<uintptr_t>(r.batch), r.submitted_ns, r.started_ns, r.finished_ns);
        return out;
      });

  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def(py::init([](Queue& q) {
        auto b = std::make_shared<Batch>();
        b->queue = &q;
        return b;
      }))
      .def("add",
           [](Batch& b, MoE& moe, uintptr_t x, size_t ldx, uintptr_t ids, uintptr_t weights, size_t ldr, int k0,
              int k1, int tokens, uintptr_t tokens_ptr, uintptr_t out, size_t ldo, bool out_f32, bool accumulate,
              const std::string& path, uintptr_t mask) {
             if (&moe.pool() != &b.queue->pool()) throw std::invalid_argument("operator and queue use different pools");
             b.jobs.push_back(make_job(moe, x, ldx, ids, weights, ldr, k0, k1, tokens, tokens_ptr, out, ldo, out_f32,
                                       accumulate, path, mask));
           })
      .def_property_readonly("handle", [](Batch& b) { return reinterpret_cast<uintptr_t>(&b); })
      .def("set_done_flag", [](Batch& b, uintptr_t flag) {
        if (flag % alignof(std::atomic<uint32_t>)) throw std::invalid_argument("a done flag must be 4-byte aligned");
        b.done_flag = reinterpret_cast<std::atomic<uint32_t>*>(flag);
      }, "address of a uint32 word set to 0 at submit and 1 once the batch has run (0: none)")
      .def("set_doorbell", [](Batch& b, uintptr_t bell) {
        if (bell % alignof(std::atomic<uint32_t>)) throw std::invalid_argument("a doorbell must be 4-byte aligned");
        b.doorbell = reinterpret_cast<std::atomic<uint32_t>*>(bell);
      }, "address of a uint32 word a GPU sets to 1 to submit the batch while its ring is armed (0: none)")
      .def("wait", [](Batch& b) {
        py::gil_scoped_release nogil;
        b.queue->wait_batch(&b);
      }, "wait until this batch has run (errors stay for the queue's sync)")
      .def_property_readonly("timing", [](Batch& b) { return py::make_tuple(b.submitted_ns, b.started_ns, b.finished_ns); });
}
