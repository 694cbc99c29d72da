#include "ktf/pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace ktf {

namespace {

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  if (out.empty())
    for (unsigned c = 0; c < std::max(1u, std::thread::hardware_concurrency()); ++c) out.push_back(int(c));
  return out;
}

std::vector<int> parse_cpulist(const std::string& s) {  // "0-3,8,10-11"
  std::vector<int> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part == "\n") continue;
    auto dash = part.find('-');
    int a = std::stoi(part.substr(0, dash)), b = dash == std::string::npos ? a : std::stoi(part.substr(dash + 1));
    for (int c = a; c <= b; ++c) out.push_back(c);
  }
  return out;
}

// node -> its CPUs, from sysfs (empty when the machine does not say)
std::map<int, std::vector<int>> numa_cpus() {
  std::map<int, std::vector<int>> out;
  for (int node = 0; node < 1024; ++node) {
    std::ifstream f("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
    if (!f) {
      if (node > 0 && out.empty()) break;
      if (!out.empty() && node > out.rbegin()->first + 64) break;
      continue;
    }
    std::string line;
    std::getline(f, line);
    auto cpus = parse_cpulist(line);
    if (!cpus.empty()) out[node] = cpus;
  }
  return out;
}

void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

inline void cpu_relax() { _mm_pause(); }

}  // namespace

ThreadPool::ThreadPool(int threads, int groups, bool pin) : pin_(pin) {
  const char* spin = std::getenv("KTFLOW_SPIN_US");
  set_spin_ns((spin ? std::atol(spin) : 1000) * 1000);
  std::vector<int> cpus = allowed_cpus();
  if (threads <= 0) threads = int(cpus.size());
  // the allowed CPUs of each NUMA node, in node order
  std::vector<std::pair<int, std::vector<int>>> nodes;
  for (auto& [node, list] : numa_cpus()) {
    std::vector<int> mine;
    for (int c : list)
      if (std::find(cpus.begin(), cpus.end(), c) != cpus.end()) mine.push_back(c);
    if (!mine.empty()) nodes.emplace_back(node, mine);
  }
  if (nodes.empty()) nodes.emplace_back(-1, cpus);
  const bool real = groups <= 0 || groups == int(nodes.size());
  if (groups <= 0) groups = int(nodes.size());
  if (threads < groups) threads = groups;
  if (real && nodes.size() > 1) {  // one group per node, threads spread in proportion to its CPUs
    for (auto& [node, list] : nodes) {
      group_cpus_.push_back(list);
      group_node_.push_back(node);
    }
  } else {  // virtual groups: the allowed CPUs dealt out in contiguous runs
    for (int g = 0; g < groups; ++g) {
      size_t a = cpus.size() * g / groups, b = cpus.size() * (g + 1) / groups;
      group_cpus_.emplace_back(cpus.begin() + a, b > a ? cpus.begin() + b : cpus.begin() + a + 1);
      group_node_.push_back(-1);
    }
  }
  // thread t (t = 0 is the caller) belongs to group t * groups / threads, pinned to the next CPU of it
  std::vector<size_t> used(group_cpus_.size(), 0);
  cursors_.reset(new Cursor[group_cpus_.size()]);
  for (int t = 0; t < threads; ++t) {
    int g = int(int64_t(t) * groups / threads);
    int cpu = group_cpus_[g][used[g]++ % group_cpus_[g].size()];
    cpus_.push_back(cpu);
    if (t == 0) continue;  // the caller
    worker_group_.push_back(g);
    workers_.emplace_back([this, g, cpu, pin] {
      if (pin) pin_to(cpu);
      worker_main(g, cpu);
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::group_threads(int group) const {
  return int(std::count(worker_group_.begin(), worker_group_.end(), group)) + (group == 0 ? 1 : 0);
}

void ThreadPool::work(int group) {
  const int n = groups();
  for (int j = 0; j < n; ++j) {
    const int g = (group + j) % n;
    Cursor& c = cursors_[g];
    for (int i; !failed_.load(std::memory_order_relaxed) && (i = c.next.fetch_add(1)) < c.count;) {
      try {
        fn_(ctx_, g, i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        failed_ = true;
      }
    }
  }
}

void ThreadPool::worker_main(int group, int) {
  uint64_t seen = 0;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    uint64_t g;
    int spins = 0;
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      cpu_relax();
      if (++spins % 64 == 0 &&
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() > spin_ns()) {
        std::unique_lock<std::mutex> lock(mutex_);
        const uint64_t alarm = alarm_.load();
        wake_.wait(lock, [&] { return generation_.load() != seen || alarm_.load() != alarm; });
        t0 = std::chrono::steady_clock::now();  // a task or wake(): spin again before sleeping
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    work(group);
    if (checked_in_.fetch_add(1, std::memory_order_acq_rel) + 1 == int(workers_.size())) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_all();
    }
  }
}

void ThreadPool::pin_caller() const {
  if (pin_ && !cpus_.empty()) pin_to(cpus_[0]);
}

std::vector<int> ThreadPool::cpus() const { return cpus_; }

void ThreadPool::wake() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    alarm_.fetch_add(1);
  }
  wake_.notify_all();
}

void ThreadPool::run(const std::vector<int>& counts, TaskFn fn, void* ctx) {
  std::lock_guard<std::mutex> serial(run_mutex_);
  if (int(counts.size()) != groups()) throw std::invalid_argument("ThreadPool::run: one count per group expected");
  for (int g = 0; g < groups(); ++g) {
    cursors_[g].next = 0;
    cursors_[g].count = counts[g];
  }
  fn_ = fn;
  ctx_ = ctx;
  error_ = nullptr;
  failed_ = false;
  checked_in_ = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_.notify_all();
  work(0);
  const int n = int(workers_.size());
  auto t0 = std::chrono::steady_clock::now();
  for (int spins = 0; checked_in_.load(std::memory_order_acquire) < n;) {
    cpu_relax();
    if (++spins % 64 == 0 &&
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() > spin_ns()) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return checked_in_.load() >= n; });
    }
  }
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

}  // namespace ktf
