#include "ktf/moe.h"
#include "ktf/queue.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

namespace ktf {

// ------------------------------------------------------------------------------------- packing

namespace {

inline float load_src(const void* p, size_t i, SrcType t) {
  switch (t) {
    case SrcType::F32: return static_cast<const float*>(p)[i];
    case SrcType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case SrcType::BF16: return bf16_to_f32(static_cast<const bf16*>(p)[i]);
    case SrcType::FP8: return e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);  // the caller scales it
  }
  return 0.f;
}

size_t src_bytes(SrcType t) { return t == SrcType::F32 ? 4 : t == SrcType::FP8 ? 1 : 2; }

// Whether n source values from element i on are all finite: the exponent bits tested as integers
// (all ones: an infinity or a NaN; e4m3's only non-finite pattern is S.1111.111), an OR over the
// row the compiler vectorizes.
template <typename U>
inline bool bits_finite(const void* p, size_t i, int n, U exponent) {
  const U* v = static_cast<const U*>(p) + i;
  U any = 0;
  for (int k = 0; k < n; ++k) any |= U((v[k] & exponent) == exponent);
  return !any;
}
inline bool row_finite(const void* p, size_t i, int n, SrcType t) {
  switch (t) {
    case SrcType::F32: return bits_finite<uint32_t>(p, i, n, 0x7f800000u);
    case SrcType::F16: return bits_finite<uint16_t>(p, i, n, 0x7c00);
    case SrcType::BF16: return bits_finite<uint16_t>(p, i, n, 0x7f80);
    case SrcType::FP8: return bits_finite<uint8_t>(p, i, n, 0x7f);
  }
  return true;
}

// Source row r of W [n, k] as float (FP8: times its block scales) into row[0, k).
void load_row(float* row, const void* src, size_t ld, SrcType type, const SrcScales* ss, int r, int k) {
  for (int c = 0; c < k; ++c) row[c] = load_src(src, size_t(r) * ld + c, type);
  if (type == SrcType::FP8)
    for (int c = 0; c < k; ++c) row[c] *= ss->at(r, c);
}

// Rows [r0, r1) (whole blocks) of W [n, k] into P. Returns the first source element that is
// not finite (FP8: after scaling) as row * k + column (packing reads every value anyway), or -1.
int64_t pack_rows(PackedMatrix& P, const void* src, size_t ld, SrcType type, const SrcScales* ss, int r0, int r1) {
  if (type == SrcType::FP8 && !ss) throw std::invalid_argument("an FP8 source needs its block scales");
  // FP8 into FP8 over the same column blocks: the checkpoint's bytes and scales as they are
  const bool copy = P.fmt == Format::FP8 && type == SrcType::FP8 && ss->bk == P.group && ss->col0 % ss->bk == 0;
  std::vector<float> row(P.kp, 0.f);
  const float qmax = P.fmt == Format::INT8 ? 127.f : P.fmt == Format::INT4 ? 7.f : E4M3_MAX;
  int64_t bad = -1;
  for (int r = r0; r < r1; ++r) {
    const int b = r / NB, j = r % NB;
    if (r < P.n) {
      bool finite = row_finite(src, size_t(r) * ld, P.k, type);
      if (type == SrcType::FP8)
        for (int c = 0; c < P.k && finite; c += ss->bk) finite = std::isfinite(ss->at(r, c));
      if (!copy || !finite) load_row(row.data(), src, ld, type, ss, r, P.k);
      if (!finite && bad < 0)
        for (int k = 0; k < P.k; ++k)
          if (!std::isfinite(row[k])) {
            bad = int64_t(r) * P.k + k;
            break;
          }
    } else if (!copy) {
      std::fill(row.begin(), row.end(), 0.f);
    }
    if (P.fmt == Format::BF16) {
      bf16* d = static_cast<bf16*>(P.data);
      for (int k = 0; k < P.kp; ++k) d[bf16_index(P.kp, r, k)] = f32_to_bf16(row[k]);
      continue;
    }
    uint8_t* d = static_cast<uint8_t*>(P.data);
    float* scales = P.scales + size_t(b) * (P.kp / P.group) * NB + j;
    if (copy) {
      const auto* s8 = static_cast<const uint8_t*>(src) + size_t(r) * ld;
      for (int k = 0; k < P.kp; ++k) d[fp8_index(P.kp, r, k)] = r < P.n && k < P.k ? s8[k] : 0;
      for (int g0 = 0; g0 < P.kp; g0 += P.group) scales[size_t(g0 / P.group) * NB] = r < P.n && g0 < P.k ? ss->at(r, g0) : 1.f;
      continue;
    }
    for (int g0 = 0; g0 < P.kp; g0 += P.group) {
      float amax = 0.f;
      for (int k = g0; k < g0 + P.group; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float s = amax > 0.f ? amax / qmax : 1.f;
      scales[size_t(g0 / P.group) * NB] = s;
      for (int k = g0; k < g0 + P.group; ++k) {
        if (P.fmt == Format::FP8) {
          d[fp8_index(P.kp, r, k)] = f32_to_e4m3(row[k] / s);
          continue;
        }
        const int q = std::clamp(int(std::nearbyint(row[k] / s)), -int(qmax), int(qmax));
        if (P.fmt == Format::INT8) {
          d[int8_index(P.kp, r, k)] = uint8_t(q + INT8_BIAS);
        } else {
          uint8_t& byte = d[int4_index(P.kp, r, k)];
          const uint8_t v = uint8_t(q + INT4_BIAS);
          byte = int4_high(k) ? uint8_t((byte & 0x0f) | (v << 4)) : uint8_t((byte & 0xf0) | v);
        }
      }
    }
  }
  return bad;
}

// P's fields for W [n, k] in `fmt`; its memory is placed by the caller.
void shape_matrix(PackedMatrix& P, int n, int k, Format fmt, int group, int n_align) {
  P.fmt = fmt;
  P.n = n;
  P.k = k;
  P.np = int(round_up(std::max(n, 1), n_align));
  P.kp = padded_k(k, fmt, group);
  P.group = fmt == Format::BF16 ? 0 : effective_group(fmt, group) ? effective_group(fmt, group) : P.kp;
}

void allocate(PackedMatrix& P, int n, int k, Format fmt, int group, int n_align, int node) {
  shape_matrix(P, n, k, fmt, group, n_align);
  P.data = alloc_on_node(P.data_bytes(), node);
  std::memset(P.data, 0, P.data_bytes());
  P.scales = P.scale_count() ? static_cast<float*>(alloc_on_node(P.scale_count() * sizeof(float), node)) : nullptr;
}

constexpr size_t PAGE = 4096, MATRIX_ALIGN = 256;

}  // namespace

int effective_group(Format fmt, int group) {
  if (fmt == Format::BF16) return 0;
  if ((fmt == Format::INT4 || fmt == Format::FP8) && group == 0) group = FP8_GROUP;
  if (group != 0 && group % KALIGN != 0)
    throw std::invalid_argument("quantization group size must be a multiple of 32, got " + std::to_string(group));
  return group;
}

int padded_k(int k, Format fmt, int group) {
  const int g = effective_group(fmt, group);
  return int(round_up(std::max(k, 1), g ? g : KALIGN));
}

void pack_matrix(PackedMatrix& P, const void* src, size_t ld, int n, int k, SrcType type, Format fmt, int group,
                 int n_align, int node, const SrcScales* scales) {
  if (type == SrcType::FP8 && !scales) throw std::invalid_argument("an FP8 source needs its block scales");
  allocate(P, n, k, fmt, group, n_align, node);
  int64_t bad;
  try {
    bad = pack_rows(P, src, ld, type, scales, 0, P.np);
  } catch (...) {
    free_matrix(P, node);
    throw;
  }
  if (bad >= 0) {
    free_matrix(P, node);
    throw std::domain_error("non-finite value at [" + std::to_string(bad / k) + ", " + std::to_string(bad % k) + "]");
  }
}

void free_matrix(PackedMatrix& P, int node) {
  free_on_node(P.data, P.data_bytes(), node);
  if (P.scales) free_on_node(P.scales, P.scale_count() * sizeof(float), node);
  P.data = nullptr;
  P.scales = nullptr;
}

// ------------------------------------------------------------------------------------- workspace

void* Workspace::reserve(size_t bytes) {
  bytes = round_up(std::max<size_t>(bytes, 64), 1 << 16);
  if (bytes > bytes_) {
    std::free(data_);
    data_ = nullptr;
    bytes_ = 0;
    data_ = std::aligned_alloc(64, bytes);  // untouched: pages land where the tasks first write them
    if (!data_) throw std::bad_alloc();
    bytes_ = bytes;
  }
  return data_;
}

Workspace::~Workspace() { std::free(data_); }

std::shared_ptr<Workspace> Workspace::of(const ThreadPool& pool) {
  static std::mutex mutex;
  static std::map<const ThreadPool*, std::weak_ptr<Workspace>> registry;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = registry.begin(); it != registry.end();)  // pools whose operators are all gone
    it = it->second.expired() ? registry.erase(it) : std::next(it);
  std::shared_ptr<Workspace> w = registry[&pool].lock();
  if (!w) {
    w = std::make_shared<Workspace>();
    registry[&pool] = w;
  }
  return w;
}

// ------------------------------------------------------------------------------------- MoE

MoE::MoE(std::shared_ptr<ThreadPool> pool, MoEShape shape, std::vector<int> groups, std::vector<uint8_t> present)
    : pool_(std::move(pool)), shape_(shape), present_(std::move(present)) {
  if (shape_.experts <= 0 || shape_.hidden <= 0 || shape_.inter <= 0)
    throw std::invalid_argument("MoE: experts, hidden and inter must be positive");
  if (present_.empty()) present_.assign(shape_.experts, 1);
  if (int(present_.size()) != shape_.experts) throw std::invalid_argument("MoE: present mask needs one entry per expert");
  packed_.assign(shape_.experts, 0);
  if (groups.empty())
    for (int g = 0; g < pool_->groups(); ++g) groups.push_back(g);
  for (int g : groups)
    if (g < 0 || g >= pool_->groups())
      throw std::invalid_argument("MoE: pool group " + std::to_string(g) + " does not exist (the pool has " +
                                  std::to_string(pool_->groups()) + ")");
  // intermediate slices with boundaries on whole 32-row blocks (FP8: whole groups, so a slice of
  // the down matrix's columns starts on a checkpoint block); uneven sizes allowed, empty ones dropped
  const int G = int(groups.size()), I = shape_.inter;
  const int align = shape_.fmt == Format::FP8 ? effective_group(shape_.fmt, shape_.group_size) : KALIGN;
  for (int s = 0; s < G; ++s) {
    int a = std::min(I, int(round_up(size_t(I) * s / G, align)));
    int b = s + 1 == G ? I : std::min(I, int(round_up(size_t(I) * (s + 1) / G, align)));
    if (b <= a) continue;
    Slice sl{a, b, padded_k(b - a, shape_.fmt, shape_.group_size), groups[s], pool_->numa_node(groups[s]), {}, {}, {}};
    sl.gate.resize(shape_.experts);
    sl.up.resize(shape_.experts);
    sl.down.resize(shape_.experts);
    slices_.push_back(std::move(sl));
  }
  block_.assign(shape_.experts, -1);
  int held = 0;
  for (int e = 0; e < shape_.experts; ++e)
    if (present_[e]) block_[e] = held++;
  // one arena per slice: gate/up rows padded to the down product's padded K (their output is its input)
  for (Slice& sl : slices_) {
    const int n = sl.i1 - sl.i0, H = shape_.hidden;
    const int dims[3][3] = {{n, H, sl.kp}, {n, H, sl.kp}, {H, n, NB}};  // n, k, n_align per matrix
    size_t at = 0;
    for (int w = 0; w < 3; ++w) {
      PackedMatrix P;
      shape_matrix(P, dims[w][0], dims[w][1], shape_.fmt, shape_.group_size, dims[w][2]);
      MatrixLayout& L = sl.layout[w];
      L.n = P.n, L.k = P.k, L.np = P.np, L.kp = P.kp, L.group = P.group;
      L.data_offset = at;
      L.data_bytes = P.data_bytes();
      at = round_up(at + L.data_bytes, MATRIX_ALIGN);
      L.scales_offset = at;
      L.scales_bytes = P.scale_count() * sizeof(float);
      at = round_up(at + L.scales_bytes, MATRIX_ALIGN);
    }
    sl.expert_stride = at;
    sl.arena_bytes = round_up(std::max<size_t>(at * held, 1), PAGE);
    sl.arena = static_cast<uint8_t*>(alloc_pages_on_node(sl.arena_bytes, sl.node));
  }
  workspace_ = Workspace::of(*pool_);
}

MoE::~MoE() {
  for (Slice& s : slices_) free_pages_on_node(s.arena, s.arena_bytes, s.node);
}

PackedMatrix& MoE::matrix(int slice, int expert, int which) {
  if (slice < 0 || slice >= int(slices_.size()) || expert < 0 || expert >= shape_.experts || which < 0 || which > 2)
    throw std::out_of_range("MoE::matrix: no such slice/expert/matrix");
  Slice& s = slices_[slice];
  return which == 0 ? s.gate[expert] : which == 1 ? s.up[expert] : s.down[expert];
}

size_t MoE::packed_bytes() const {
  size_t total = 0;
  for (const Slice& s : slices_)
    for (int e = 0; e < shape_.experts; ++e)
      if (s.gate[e].data)
        for (const MatrixLayout& L : s.layout) total += L.data_bytes + L.scales_bytes;
  return total;
}

namespace {
struct PackWork {
  PackedMatrix* P;
  const void* src;
  size_t ld;
  SrcScales scales;  // FP8 sources: offset to the slice
  int r0, r1;
  int expert = 0, which = 0, i0 = 0;  // for the error: which matrix, and the slice's first row
  int64_t bad = -1;                    // set by the task: its first non-finite element, or -1
};
struct PackCtx {
  std::vector<std::vector<PackWork>> lists;
  SrcType type;
};
void pack_task(void* ctx, int group, int i) {
  auto* c = static_cast<PackCtx*>(ctx);
  PackWork& w = c->lists[group][i];
  w.bad = pack_rows(*w.P, w.src, w.ld, c->type, &w.scales, w.r0, w.r1);
}
}  // namespace

void MoE::allocate_expert(int e) {
  if (e < 0 || e >= shape_.experts || !present_[e])
    throw std::invalid_argument("expert " + std::to_string(e) + " is not held by this operator");
  for (Slice& s : slices_) {
    uint8_t* block = s.arena + size_t(block_[e]) * s.expert_stride;
    std::memset(block, 0, s.expert_stride);
    PackedMatrix* mats[3] = {&s.gate[e], &s.up[e], &s.down[e]};
    for (int w = 0; w < 3; ++w) {
      const MatrixLayout& L = s.layout[w];
      PackedMatrix& P = *mats[w];
      P.fmt = shape_.fmt, P.n = L.n, P.k = L.k, P.np = L.np, P.kp = L.kp, P.group = L.group;
      P.data = block + L.data_offset;
      P.scales = L.scales_bytes ? reinterpret_cast<float*>(block + L.scales_offset) : nullptr;
    }
  }
  packed_[e] = 0;
}

void MoE::pack(const std::vector<int>& experts, const std::vector<Source>& sources, SrcType type) {
  if (experts.size() != sources.size()) throw std::invalid_argument("MoE::pack: one source per expert");
  PackCtx ctx;
  ctx.type = type;
  ctx.lists.resize(pool_->groups());
  for (size_t x = 0; x < experts.size(); ++x) {
    const int e = experts[x];
    if (e < 0 || e >= shape_.experts || !present_[e])
      throw std::invalid_argument("MoE::pack: expert " + std::to_string(e) + " is not held by this operator");
    const Source& src = sources[x];
    if (type == SrcType::FP8 && (!src.s_gate.s || !src.s_up.s || !src.s_down.s))
      throw std::invalid_argument("MoE::pack: expert " + std::to_string(e) + " is FP8 without its block scales");
    allocate_expert(e);
    for (Slice& s : slices_) {
      const auto* g = static_cast<const char*>(src.gate);
      const auto* u = static_cast<const char*>(src.up);
      const auto* d = static_cast<const char*>(src.down);
      const size_t es = src_bytes(type);
      SrcScales sg = src.s_gate, su = src.s_up, sd = src.s_down;  // the slice's rows (gate, up), columns (down)
      sg.row0 += s.i0, su.row0 += s.i0, sd.col0 += s.i0;
      const PackWork items[3] = {{&s.gate[e], g + size_t(s.i0) * src.ld_gate * es, src.ld_gate, sg, 0, 0, e, 0, s.i0},
                                 {&s.up[e], u + size_t(s.i0) * src.ld_up * es, src.ld_up, su, 0, 0, e, 1, s.i0},
                                 {&s.down[e], d + size_t(s.i0) * es, src.ld_down, sd, 0, 0, e, 2, s.i0}};
      for (const PackWork& it : items)
        for (int r = 0; r < it.P->np; r += 256) {
          PackWork w = it;
          w.r0 = r;
          w.r1 = std::min(it.P->np, r + 256);
          ctx.lists[s.group].push_back(w);
        }
    }
  }
  std::vector<int> counts;
  for (auto& l : ctx.lists) counts.push_back(int(l.size()));
  pool_->run(counts, pack_task, &ctx);
  // the first non-finite source value, by expert order (the tensor and index in the source's
  // own coordinates: gate/up [inter, hidden] rows from the slice's i0, down [hidden, inter] columns)
  const PackWork* first = nullptr;
  for (const auto& list : ctx.lists)
    for (const PackWork& w : list)
      if (w.bad >= 0 && (!first || w.expert < first->expert || (w.expert == first->expert && w.which < first->which)))
        first = &w;
  if (first) {
    const int k = first->P->k;
    int64_t r = first->bad / k, c = first->bad % k;
    if (first->which == 2) c += first->i0; else r += first->i0;
    static const char* names[3] = {"gate", "up", "down"};
    for (int e : experts) packed_[e] = 0;
    throw std::domain_error("expert " + std::to_string(first->expert) + " " + names[first->which] +
                            ": non-finite value at [" + std::to_string(r) + ", " + std::to_string(c) + "]");
  }
  for (int e : experts) packed_[e] = 1;
}

// ------------------------------------------------------------------------------------- forward

namespace {

struct ExpertRows {
  int expert, row0, rows;
  const bf16* x = nullptr;  // its input rows (the gathered block, or the token's own row)
  size_t ldx = 0;
};

struct JobState {
  Job* job;
  MoE* moe;
  int T = 0, H = 0, hp = 0;
  size_t ldxg = 0;           // row stride of the gathered rows (hp plus a cache line: no 4 KiB aliasing)
  std::vector<size_t> ldh;   // per slice: row stride of h
  bf16* xg = nullptr;        // gathered rows [R][ldxg]          (in the pool's workspace)
  std::vector<bf16*> h;      // per slice: SiLU products [R][ldh]
  std::vector<float*> part;  // per slice: partial outputs [R][hp]
  std::vector<ExpertRows> experts;  // active experts, rows contiguous in the gathered block
  std::vector<int> row_token;
  std::vector<float> row_weight;
  std::vector<int> token_row0, token_rows;  // CSR: token t's rows
};

enum class Kind : uint8_t { Gather, Up, Down, Reduce };

struct Task {
  int job, slice, expert, nb0, nb1;  // expert: index into JobState::experts (-1: not per expert)
  int c0 = 0, c1 = 0;                // reduce: output columns
  int r0 = 0, r1 = 0;                // gather, up, down: the expert's rows r0..r1-1 (of its er.rows)
  Kind kind = Kind::Gather;
};

// Rows of one expert per task at most: an expert many tokens picked (a long prompt through a
// skewed router: 1800 rows where the mean is 128) is cut into even runs of rows, so it is not one
// thread's work while the others wait; 256 rows still read each weight block once per 256 rows.
constexpr int ROW_RUN = 256;
inline int row_runs(int rows) { return std::max(1, (rows + ROW_RUN - 1) / ROW_RUN); }
inline int row_run(int rows) { return std::min(rows, int(round_up(size_t((rows + row_runs(rows) - 1) / row_runs(rows)), 16))); }

// What the up, down and reduce tasks of one pool run wait on, and when each kind's last task ended.
// A down task waits for every up task of its (job, slice, expert); a reduce task for every down task
// of its job. Each group's list holds its up tasks, then its down tasks, then its reduce tasks, and
// a worker claims a list's tasks in order, so a task only ever waits on tasks already claimed, by
// threads that never wait on it: the run cannot deadlock, and a failed task stops the waiters.
struct Dependencies {
  std::vector<size_t> key0;                          // per job: its first (slice, expert) counter
  std::unique_ptr<std::atomic<int>[]> ups_left;      // per (job, slice, expert)
  std::unique_ptr<std::atomic<int>[]> downs_left;    // per job
  std::atomic<int> left[3] = {};                     // up, down, reduce tasks not yet finished
  std::atomic<int64_t> end_ns[3] = {};               // when the last of each kind finished
  std::atomic<bool> failed{false};
};

struct PhaseCtx {
  std::vector<JobState>* states;
  std::vector<std::vector<Task>> lists;
  Dependencies* deps = nullptr;  // set for the fused up/down/reduce run
};

// The up-task counter a down task of `tk`'s (job, slice, expert) waits on.
inline size_t up_key(const Dependencies& d, const std::vector<JobState>& states, const Task& tk) {
  return d.key0[tk.job] + size_t(tk.slice) * states[tk.job].experts.size() + tk.expert;
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

void route(JobState& st) {
  Job& j = *st.job;
  MoE& m = *st.moe;
  const int E = m.shape().experts;
  const auto& present = m.present();
  std::vector<int> count(E, 0);
  for (int t = 0; t < st.T; ++t)
    for (int s = j.k0; s < j.k1; ++s) {
      const int64_t id = j.ids[size_t(t) * j.ldr + s];
      if (id == -1) continue;
      if (id < 0 || id >= E)
        throw std::out_of_range("expert id " + std::to_string(id) + " at token " + std::to_string(t) + ", pick " +
                                std::to_string(s) + " is outside [0, " + std::to_string(E) + ")");
      if (present[id] && (!j.mask || j.mask[id])) ++count[id];
    }
  std::vector<int> start(E, 0);
  int R = 0;
  for (int e = 0; e < E; ++e)
    if (count[e]) {
      st.experts.push_back({e, R, count[e], nullptr, 0});
      start[e] = R;
      R += count[e];
    }
  st.row_token.assign(R, 0);
  st.row_weight.assign(R, 0.f);
  st.token_row0.assign(st.T + 1, 0);
  st.token_rows.assign(R, 0);
  std::vector<int> fill = start;
  for (int t = 0; t < st.T; ++t) {
    st.token_row0[t + 1] = st.token_row0[t];
    for (int s = j.k0; s < j.k1; ++s) {
      const int64_t id = j.ids[size_t(t) * j.ldr + s];
      if (id < 0 || !present[id] || (j.mask && !j.mask[id])) continue;
      const int r = fill[id]++;
      st.row_token[r] = t;
      st.row_weight[r] = j.weights[size_t(t) * j.ldr + s];
      st.token_rows[st.token_row0[t + 1]++] = r;
    }
  }
}

// tasks of a phase go to the list of the pool group that owns their slice
struct TaskRef {
  const Task& tk;
  JobState& st;
};
inline TaskRef task_at(void* ctx, int group, int i) {  // a phase function's task and its job
  auto* c = static_cast<PhaseCtx*>(ctx);
  const Task& tk = c->lists[group][i];
  return {tk, (*c->states)[tk.job]};
}

void gather_task(void* ctx, int group, int i) {
  const auto [tk, st] = task_at(ctx, group, i);
  const ExpertRows& er = st.experts[tk.expert];
  for (int r = er.row0 + tk.r0; r < er.row0 + tk.r1; ++r) {
    bf16* dst = st.xg + size_t(r) * st.ldxg;
    std::memcpy(dst, st.job->x + size_t(st.row_token[r]) * st.job->ldx, size_t(st.H) * sizeof(bf16));
    std::fill(dst + st.H, dst + st.hp, bf16(0));
  }
}

void up_task(void* ctx, int group, int i) {
  const auto [tk, st] = task_at(ctx, group, i);
  MoE& m = *st.moe;
  const ExpertRows& er = st.experts[tk.expert];
  const MoE::Slice& sl = m.slices()[tk.slice];
  const PackedMatrix& G = sl.gate[er.expert];
  const PackedMatrix& U = sl.up[er.expert];
  const int cols = (tk.nb1 - tk.nb0) * NB, rows = tk.r1 - tk.r0;
  const bf16* x = er.x + size_t(tk.r0) * er.ldx;
  thread_local std::vector<float> yg, yu;
  yg.resize(size_t(rows) * cols);
  yu.resize(size_t(rows) * cols);
  const MatmulFn mm = matmul_for(resolve_path(st.job->path, rows, m.shape().fmt));
  mm(x, er.ldx, rows, G, tk.nb0, tk.nb1, yg.data(), cols);
  mm(x, er.ldx, rows, U, tk.nb0, tk.nb1, yu.data(), cols);
  const bool vector = cpu_features().avx512_bf16;
  for (int r = 0; r < rows; ++r) {
    bf16* h = st.h[tk.slice] + size_t(er.row0 + tk.r0 + r) * st.ldh[tk.slice] + tk.nb0 * NB;
    const float* g = &yg[size_t(r) * cols];
    const float* u = &yu[size_t(r) * cols];
    // h is bf16, as the reference computes SiLU(gate) * up in the activation dtype
    if (vector) {
      silu_mul_bf16_avx512(g, u, h, cols);
      continue;
    }
    for (int c2 = 0; c2 < cols; ++c2) h[c2] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(f32_to_bf16(g[c2]))))) *
                                                          bf16_to_f32(f32_to_bf16(u[c2])));
  }
}

void down_task(void* ctx, int group, int i) {
  const auto [tk, st] = task_at(ctx, group, i);
  MoE& m = *st.moe;
  const ExpertRows& er = st.experts[tk.expert];
  const MoE::Slice& sl = m.slices()[tk.slice];
  const PackedMatrix& D = sl.down[er.expert];
  const size_t ldh = st.ldh[tk.slice];
  const int row0 = er.row0 + tk.r0, rows = tk.r1 - tk.r0;
  const MatmulFn mm = matmul_for(resolve_path(st.job->path, rows, m.shape().fmt));
  float* y = st.part[tk.slice] + size_t(row0) * st.hp + tk.nb0 * NB;
  mm(st.h[tk.slice] + size_t(row0) * ldh, ldh, rows, D, tk.nb0, tk.nb1, y, st.hp);
}

void reduce_task(void* ctx, int group, int i) {
  const auto [tk, st] = task_at(ctx, group, i);
  const Job& j = *st.job;
  MoE& m = *st.moe;
  const int c0 = tk.c0, n = tk.c1 - tk.c0;
  thread_local std::vector<float> acc;
  acc.resize(n);
  for (int t = tk.nb0; t < tk.nb1; ++t) {
    const size_t o = size_t(t) * j.ldo + c0;
    if (j.accumulate) {
      if (j.out_f32)
        std::memcpy(acc.data(), static_cast<const float*>(j.out) + o, n * sizeof(float));
      else
        for (int x = 0; x < n; ++x) acc[x] = bf16_to_f32(static_cast<const bf16*>(j.out)[o + x]);
    } else {
      std::fill(acc.begin(), acc.end(), 0.f);
    }
    for (size_t s = 0; s < m.slices().size(); ++s)
      for (int q = st.token_row0[t]; q < st.token_row0[t + 1]; ++q) {
        const int r = st.token_rows[q];
        const float w = st.row_weight[r];
        const float* y = st.part[s] + size_t(r) * st.hp + c0;
        for (int x = 0; x < n; ++x) acc[x] += w * y[x];
      }
    if (j.out_f32)
      std::memcpy(static_cast<float*>(j.out) + o, acc.data(), n * sizeof(float));
    else
      for (int x = 0; x < n; ++x) static_cast<bf16*>(j.out)[o + x] = f32_to_bf16(acc[x]);
  }
}

// Spins until `counter` reaches zero (the tasks it counts are claimed and running on other
// threads): true, or false when a task of the run failed (the waiter is skipped; the pool rethrows
// the failure itself).
bool await_zero(const std::atomic<int>& counter, const Dependencies& d) {
  while (counter.load(std::memory_order_acquire) > 0) {
    if (d.failed.load(std::memory_order_relaxed)) return false;
    _mm_pause();
  }
  return true;
}

void finished(Dependencies& d, int kind) {
  if (d.left[kind].fetch_sub(1, std::memory_order_acq_rel) == 1) d.end_ns[kind].store(now_ns());
}

// One task of the fused run: up, then down (after its expert's up tasks), then reduce (after its
// job's down tasks).
void fused_task(void* ctx, int group, int i) {
  auto* c = static_cast<PhaseCtx*>(ctx);
  Dependencies& d = *c->deps;
  const Task& tk = c->lists[group][i];
  try {
    const size_t key = tk.expert >= 0 ? up_key(d, *c->states, tk) : 0;
    switch (tk.kind) {
      case Kind::Up:
        up_task(ctx, group, i);
        d.ups_left[key].fetch_sub(1, std::memory_order_acq_rel);
        finished(d, 0);
        break;
      case Kind::Down:
        if (!await_zero(d.ups_left[key], d)) return;
        down_task(ctx, group, i);
        d.downs_left[tk.job].fetch_sub(1, std::memory_order_acq_rel);
        finished(d, 1);
        break;
      case Kind::Reduce:
        if (!await_zero(d.downs_left[tk.job], d)) return;
        reduce_task(ctx, group, i);
        finished(d, 2);
        break;
      case Kind::Gather:
        throw std::logic_error("gather task in the fused run");
    }
  } catch (...) {
    d.failed.store(true);
    throw;
  }
}

double weight_bytes(Format f) { return f == Format::BF16 ? 2.0 : f == Format::INT4 ? 0.5 : 1.0; }

// One task per (job, slice, expert, run of at most ROW_RUN of its rows, run of output blocks of
// `which` matrix), on the slice's group; `matrices` of that shape are read per block (gate and up:
// 2). A task reads about 1/8 of its group's per-thread share of the phase's weights (so the
// dynamic claiming evens out the threads' finish), between 32 KiB and 512 KiB, and at least one
// block per 32 rows of its run (many rows: the rows are then not re-read for every few blocks),
// but never so many blocks that the group gets fewer than two tasks per thread (a few experts
// with many rows each: a long prompt's CPU share of a split layer).
void plan_block_tasks(ThreadPool& pool, std::vector<JobState>& states, PhaseCtx& ctx,
                      std::vector<PackedMatrix> MoE::Slice::*which, int matrices, Kind kind) {
  auto block_bytes = [&](const MoE& m, const PackedMatrix& W) {
    return NB * double(W.kp) * weight_bytes(m.shape().fmt) * matrices;
  };
  std::vector<double> target(pool.groups(), 0.0);
  std::vector<int> blocks(pool.groups(), 0);
  for (JobState& st : states)
    for (const MoE::Slice& sl : st.moe->slices())
      for (const ExpertRows& er : st.experts) {
        const PackedMatrix& W = (sl.*which)[er.expert];
        target[sl.group] += W.nblocks() * block_bytes(*st.moe, W);
        blocks[sl.group] += W.nblocks() * row_runs(er.rows);
      }
  for (int g = 0; g < pool.groups(); ++g)
    target[g] = std::clamp(target[g] / (8.0 * pool.group_threads(g)), 32.0 * 1024, 512.0 * 1024);
  for (size_t q = 0; q < states.size(); ++q) {
    MoE& m = *states[q].moe;
    for (size_t s = 0; s < m.slices().size(); ++s)
      for (size_t a = 0; a < states[q].experts.size(); ++a) {
        const ExpertRows& er = states[q].experts[a];
        const PackedMatrix& W = (m.slices()[s].*which)[er.expert];
        const int group = m.slices()[s].group, run = row_run(er.rows);
        int nbt = std::max({1, int(target[group] / block_bytes(m, W)), (run + 31) / 32});
        nbt = std::min({nbt, W.nblocks(), std::max(1, blocks[group] / (2 * pool.group_threads(group)))});
        for (int r = 0; r < er.rows; r += run)
          for (int b = 0; b < W.nblocks(); b += nbt)
            ctx.lists[group].push_back(
                {int(q), int(s), int(a), b, std::min(W.nblocks(), b + nbt), 0, 0, r, std::min(er.rows, r + run), kind});
      }
  }
}

// Runs the phase's tasks on the pool; on the calling thread alone when `small` (a pool run costs
// a few microseconds of wake-up and barrier).
void run_phase(ThreadPool& pool, PhaseCtx& ctx, ThreadPool::TaskFn fn, bool small = false) {
  std::vector<int> counts;
  size_t total = 0;
  for (auto& l : ctx.lists) {
    counts.push_back(int(l.size()));
    total += l.size();
  }
  if (small) {
    for (int g = 0; g < int(ctx.lists.size()); ++g)
      for (int i = 0; i < counts[g]; ++i) fn(&ctx, g, i);
  } else if (total) {
    pool.run(counts, fn, &ctx);
  }
  for (auto& l : ctx.lists) l.clear();
}

}  // namespace

void run_jobs(ThreadPool& pool, std::vector<Job>& jobs) {
  if (jobs.empty()) return;
  int64_t stamp[6];
  stamp[0] = now_ns();
  std::vector<JobState> states(jobs.size());
  for (size_t q = 0; q < jobs.size(); ++q) {
    Job& j = jobs[q];
    if (!j.moe) throw std::invalid_argument("job without an operator");
    if (&j.moe->pool() != &pool) throw std::invalid_argument("job's operator belongs to another thread pool");
    JobState& st = states[q];
    st.job = &j;
    st.moe = j.moe;
    st.T = j.tokens_ptr ? *j.tokens_ptr : j.tokens;
    if (st.T < 0) throw std::invalid_argument("negative token count");
    st.H = j.moe->shape().hidden;
    st.hp = padded_k(st.H, j.moe->shape().fmt, j.moe->shape().group_size);  // the gate/up K
    if (j.k0 < 0 || j.k1 < j.k0 || size_t(j.k1) > j.ldr) throw std::invalid_argument("bad routing column range");
    route(st);
    for (const ExpertRows& er : st.experts)
      if (!j.moe->packed(er.expert))
        throw std::runtime_error("expert " + std::to_string(er.expert) + " was routed to but never packed");
    st.ldxg = size_t(st.hp) + 32;
    for (const MoE::Slice& sl : j.moe->slices()) st.ldh.push_back(size_t(sl.kp) + 32);
  }
  // every job's scratch, carved from the pool's workspace (held for the whole batch)
  Workspace& ws = jobs[0].moe->workspace();
  std::lock_guard<std::mutex> busy(ws.busy);
  size_t bytes = 0;
  auto carve = [&bytes](size_t n) {
    const size_t at = bytes;
    bytes = round_up(bytes + n, 64);
    return at;
  };
  std::vector<size_t> at;  // offsets: per job xg, then per slice h and part
  for (JobState& st : states) {
    const size_t R = st.row_token.size();
    at.push_back(carve(R * st.ldxg * sizeof(bf16)));
    for (size_t s = 0; s < st.ldh.size(); ++s) {
      at.push_back(carve(R * st.ldh[s] * sizeof(bf16)));
      at.push_back(carve(R * st.hp * sizeof(float)));
    }
  }
  auto* base = static_cast<uint8_t*>(ws.reserve(bytes));
  size_t next = 0;
  for (JobState& st : states) {
    st.xg = reinterpret_cast<bf16*>(base + at[next++]);
    for (size_t s = 0; s < st.ldh.size(); ++s) {
      st.h.push_back(reinterpret_cast<bf16*>(base + at[next++]));
      st.part.push_back(reinterpret_cast<float*>(base + at[next++]));
    }
  }
  PhaseCtx ctx{&states, std::vector<std::vector<Task>>(pool.groups())};
  // gather: one task per (job, expert) with more than one row; a single row is read where it is
  // when no K padding has to be added to it
  size_t gather_bytes = 0;
  for (size_t q = 0; q < states.size(); ++q) {
    JobState& st = states[q];
    for (size_t a = 0; a < st.experts.size(); ++a) {
      ExpertRows& er = st.experts[a];
      if (er.rows == 1 && st.H == st.hp) {
        er.x = st.job->x + size_t(st.row_token[er.row0]) * st.job->ldx;
        er.ldx = st.job->ldx;
        continue;
      }
      er.x = st.xg + size_t(er.row0) * st.ldxg;
      er.ldx = st.ldxg;
      gather_bytes += size_t(er.rows) * st.hp * sizeof(bf16);
      const int run = row_run(er.rows);
      for (int r = 0; r < er.rows; r += run)
        ctx.lists[st.moe->slices()[a % st.moe->slices().size()].group].push_back(
            {int(q), 0, int(a), 0, 0, 0, 0, r, std::min(er.rows, r + run)});
    }
  }
  stamp[1] = now_ns();
  run_phase(pool, ctx, gather_task, gather_bytes <= (64 << 10));
  stamp[2] = now_ns();
  // up: (job, slice, expert, output blocks of gate/up); down: (job, slice, expert, output columns);
  // reduce: token ranges, with fewer tokens than threads each token's columns in pieces as well.
  // All three in one pool run (see Dependencies): no barrier between the phases, so threads done
  // with the up tasks go on with the down tasks of the experts whose up tasks are done, and the
  // reduce follows without another wake-up.
  plan_block_tasks(pool, states, ctx, &MoE::Slice::gate, 2, Kind::Up);
  plan_block_tasks(pool, states, ctx, &MoE::Slice::down, 1, Kind::Down);
  for (size_t q = 0; q < states.size(); ++q) {
    const JobState& st = states[q];
    const int T = st.T, per = std::max(1, std::min(64, T / (4 * pool.threads()) + 1));
    const int pieces = T >= pool.threads() ? 1 : (pool.threads() + T - 1) / T;
    const int width = int(round_up((st.H + pieces - 1) / pieces, 16));
    for (int t = 0, n = 0; t < T; t += per)
      for (int c = 0; c < st.H; c += width, ++n)
        ctx.lists[n % pool.groups()].push_back(
            {int(q), 0, -1, t, std::min(T, t + per), c, std::min(st.H, c + width), 0, 0, Kind::Reduce});
  }
  Dependencies deps;
  size_t keys = 0;
  for (const JobState& st : states) {
    deps.key0.push_back(keys);
    keys += st.moe->slices().size() * st.experts.size();
  }
  deps.ups_left.reset(new std::atomic<int>[std::max<size_t>(keys, 1)]());
  deps.downs_left.reset(new std::atomic<int>[states.size()]());
  int left[3] = {0, 0, 0};
  for (const auto& list : ctx.lists)
    for (const Task& tk : list) {
      if (tk.kind == Kind::Up) deps.ups_left[up_key(deps, states, tk)]++;
      if (tk.kind == Kind::Down) deps.downs_left[tk.job]++;
      ++left[int(tk.kind) - int(Kind::Up)];
    }
  for (int k = 0; k < 3; ++k) {
    deps.left[k] = left[k];
    deps.end_ns[k] = stamp[2];
  }
  ctx.deps = &deps;
  run_phase(pool, ctx, fused_task);
  // the phases as they overlapped: up until its last task ended, down from there to the end of its
  // last task, reduce from there to the end of the run
  stamp[5] = now_ns();
  stamp[3] = std::clamp(deps.end_ns[0].load(), stamp[2], stamp[5]);
  stamp[4] = std::clamp(deps.end_ns[1].load(), stamp[3], stamp[5]);
  for (int i = 0; i < 5; ++i) ws.phase_ns[i] = stamp[i + 1] - stamp[i];
}

}  // namespace ktf
