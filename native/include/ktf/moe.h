// The fused MoE operator: packed experts (split over the pool's groups by intermediate slices,
// NUMA tensor parallel) and the forward pass over jobs. One forward:
//   route   tokens grouped by expert (skipping ids of -1 and experts not held here)
//   gather  each expert's token rows copied into one block (padded to whole tiles)
//   up      task (slice, expert, output blocks): gate and up for those rows, SiLU(gate) * up
//   down    task (slice, output columns): every expert's down product for those columns, scaled
//           by the routing weight and summed into the slice's fp32 partial output
//   reduce  the slices' partial outputs summed into the output (added to it with `accumulate`)
// The kernel of every matmul is chosen by the rows it has (AVX-512 for few, AMX for many).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "ktf/common.h"
#include "ktf/pool.h"

namespace ktf {

struct MoEShape {
  int experts = 0, hidden = 0, inter = 0;
  Format fmt = Format::BF16;
  int group_size = 0;  // INT8: 0 = per output channel; INT4, FP8: 0 = 128
};

class MoE;

// Scratch memory of run_jobs (gathered rows, SiLU products, partial outputs), shared by every
// operator of one pool: a model's layers run one batch at a time, so one buffer that grows to the
// largest batch seen serves them all. Lock `busy` for the whole batch.
class Workspace {
 public:
  std::mutex busy;
  // nanoseconds of the last batch's phases: route (and scratch), gather, up, down, reduce (up, down
  // and reduce run as one overlapped pool run: up until its last task ended, down from there until
  // its last task ended, reduce the rest)
  int64_t phase_ns[5] = {};
  void* reserve(size_t bytes);  // 64-byte aligned; contents undefined; invalidates older pointers
  ~Workspace();
  // the workspace of `pool` (created with its first operator, freed with its last)
  static std::shared_ptr<Workspace> of(const ThreadPool& pool);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// One forward call: x [T, H] bf16 (row stride ldx); ids [T, ldr] int64 and weights [T, ldr] fp32
// of which columns [k0, k1) are used; out [T, H] bf16 or fp32 (row stride ldo).
struct Job {
  MoE* moe = nullptr;
  const bf16* x = nullptr;
  size_t ldx = 0;
  const int64_t* ids = nullptr;
  const float* weights = nullptr;
  size_t ldr = 0;
  int k0 = 0, k1 = 0;
  int tokens = 0;
  const int32_t* tokens_ptr = nullptr;  // when set, the token count is read here at run time
  void* out = nullptr;
  bool out_f32 = false;
  size_t ldo = 0;
  bool accumulate = false;
  Path path = Path::AUTO;
  const uint8_t* mask = nullptr;  // when set, only experts e with mask[e] != 0 are computed
};

class MoE {
 public:
  // groups: the pool groups that hold an intermediate slice each (empty: all of them)
  MoE(std::shared_ptr<ThreadPool> pool, MoEShape shape, std::vector<int> groups, std::vector<uint8_t> present);
  ~MoE();
  MoE(const MoE&) = delete;
  MoE& operator=(const MoE&) = delete;

  // Pack expert e from row-major sources: gate, up [inter, hidden] and down [hidden, inter] with
  // row strides in elements; FP8 sources with their block scales (SrcScales, in the coordinates
  // of these matrices: the slices' offsets are added here). An FP8 source packed as FP8 whose
  // column blocks are the format's groups keeps its bytes and scales as they are. Runs on the
  // pool; e must be present.
  struct Source {
    const void* gate;
    const void* up;
    const void* down;
    size_t ld_gate, ld_up, ld_down;
    SrcScales s_gate = {}, s_up = {}, s_down = {};
  };
  void pack(const std::vector<int>& experts, const std::vector<Source>& sources, SrcType type);
  // (Re)allocate expert e's matrices in every slice, zeroed, with the packer's shapes.
  void allocate_expert(int e);

  // Where one packed matrix of an expert lies in its slice's arena, relative to the expert's block.
  struct MatrixLayout {
    size_t data_offset = 0, data_bytes = 0, scales_offset = 0, scales_bytes = 0;
    int n = 0, k = 0, np = 0, kp = 0, group = 0;
  };
  // A slice's experts live in one page-aligned arena (so it can be pinned for GPU copies as one
  // range): the held experts in id order, `expert_stride` bytes apart, each block holding gate,
  // up and down (data, then scales) at the offsets of `layout`.
  struct Slice {
    int i0, i1;  // intermediate rows [i0, i1)
    int kp;      // padded length of those rows: the down product's K, the gate/up outputs' length
    int group;   // pool group that computes it
    int node;    // NUMA node its memory lives on (-1: any)
    std::vector<PackedMatrix> gate, up, down;
    MatrixLayout layout[3];
    size_t expert_stride = 0;
    uint8_t* arena = nullptr;
    size_t arena_bytes = 0;
  };
  const MoEShape& shape() const { return shape_; }
  const std::vector<Slice>& slices() const { return slices_; }
  const std::vector<uint8_t>& present() const { return present_; }
  PackedMatrix& matrix(int slice, int expert, int which);  // which: 0 gate, 1 up, 2 down
  // Position of expert e's block in each slice's arena (its rank among the held experts), -1 if not held.
  int arena_block(int expert) const { return block_[expert]; }
  bool packed(int expert) const { return packed_[expert] != 0; }
  void mark_packed(int expert) { packed_[expert] = 1; }
  ThreadPool& pool() { return *pool_; }
  size_t packed_bytes() const;

  Workspace& workspace() { return *workspace_; }

 private:
  std::shared_ptr<ThreadPool> pool_;
  std::shared_ptr<Workspace> workspace_;
  MoEShape shape_;
  std::vector<uint8_t> present_, packed_;
  std::vector<int> block_;
  std::vector<Slice> slices_;
};

// Run jobs together (their tasks share each phase); throws on bad input (expert id out of range).
void run_jobs(ThreadPool& pool, std::vector<Job>& jobs);

// Pack one matrix W [n, k] (row stride ld; FP8: with `scales`) into `fmt` on `node`. Allocates
// P's buffers.
void pack_matrix(PackedMatrix& P, const void* src, size_t ld, int n, int k, SrcType type, Format fmt, int group,
                 int n_align, int node, const SrcScales* scales = nullptr);
void free_matrix(PackedMatrix& P, int node);
// The quantization group `group` means for `fmt` (0: per channel; int4 and fp8 default to 128),
// and the padded K of a matrix with k columns (a multiple of 32 and of the group).
int effective_group(Format fmt, int group);
int padded_k(int k, Format fmt, int group);

}  // namespace ktf
