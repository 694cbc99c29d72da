// A fork-join thread pool with worker groups (one per NUMA node, or virtual groups on one node).
// run() hands every group its own list of tasks; a group's workers take them dynamically (an
// atomic cursor), and a worker whose group has run dry helps the others. The calling thread works
// too, as a member of group 0. Workers spin for a while after a run (decode calls come every
// millisecond or so) and then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ktf {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, int group, int index);

  // threads: total including the caller (0: every CPU this process may use); groups: 0 = one per
  // NUMA node the allowed CPUs span, else that many (virtual when more than the nodes).
  ThreadPool(int threads, int groups, bool pin);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }
  int groups() const { return int(group_cpus_.size()); }
  int numa_node(int group) const { return group_node_[group]; }  // -1: allocate anywhere
  const std::vector<int>& group_cpus(int group) const { return group_cpus_[group]; }
  int group_threads(int group) const;
  // how long an idle thread (and the caller waiting for a run) spins before it sleeps; changeable
  // at any time (a CPU-only step wants the cores for its own ops between runs: 0)
  long spin_ns() const { return spin_ns_.load(std::memory_order_relaxed); }
  void set_spin_ns(long ns) { spin_ns_.store(ns < 0 ? 0 : ns, std::memory_order_relaxed); }

  // Runs task i of group g for every g < groups(), i < counts[g]; returns when all ran; rethrows
  // the first exception a task raised (the rest of that run is skipped). One run at a time.
  void run(const std::vector<int>& counts, TaskFn fn, void* ctx);
  // Sleeping workers start spinning again (for spin_ns) without a task: a caller that knows work is
  // coming shortly (a GPU step about to ring the CPU) takes their wake-up off the critical path.
  void wake();
  // Pins the calling thread to the CPU of thread 0 (the caller of run(): the queue's dispatcher),
  // where the pool pins its workers; a no-op for an unpinned pool.
  void pin_caller() const;
  std::vector<int> cpus() const;  // the CPUs of the pool's threads, the caller's first

 private:
  struct alignas(64) Cursor {
    std::atomic<int> next{0};
    int count = 0;
  };
  void worker_main(int group, int cpu);
  void work(int group);

  std::vector<std::thread> workers_;
  std::vector<int> worker_group_;
  std::vector<std::vector<int>> group_cpus_;
  std::vector<int> group_node_;
  std::unique_ptr<Cursor[]> cursors_;
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> alarm_{0};  // bumped by wake()
  std::vector<int> cpus_;           // thread t's CPU
  bool pin_ = false;
  std::atomic<int> checked_in_{0};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
  std::mutex mutex_, run_mutex_;
  std::condition_variable wake_, done_;
  std::atomic<bool> stop_{false};
  std::atomic<long> spin_ns_{0};
};

}  // namespace ktf
