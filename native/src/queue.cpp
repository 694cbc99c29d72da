#include "ktf/queue.h"

#include <immintrin.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace ktf {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Queue::Queue(std::shared_ptr<ThreadPool> pool) : pool_(std::move(pool)) {
  dispatcher_ = std::thread([this] {
    pool_->pin_caller();  // the dispatcher runs the pool's thread 0 (the caller of its runs): on that thread's CPU
    dispatch();
  });
}

Queue::~Queue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    stopping_ = true;
  }
  work_.notify_all();
  dispatcher_.join();
}

void Queue::submit(Batch* b) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    b->submitted_ns = now_ns();
    if (b->done_flag) b->done_flag->store(0, std::memory_order_relaxed);  // before it can run
    pending_.push_back(b);
    pending_count_.fetch_add(1, std::memory_order_release);
    ++b->submits;
    ++in_flight_;
  }
  work_.notify_one();
}

int Queue::add_ring(std::vector<Batch*> ring) {
  for (Batch* b : ring)
    if (!b || b->queue != this || !b->doorbell) throw std::invalid_argument("a ring holds this queue's batches with doorbells");
  std::lock_guard<std::mutex> lock(mutex_);
  rings_.push_back(std::move(ring));
  return int(rings_.size()) - 1;
}

void Queue::arm(int ring) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ring < 0 || ring >= int(rings_.size())) throw std::invalid_argument("no such ring");
    armed_.push_back(ring);
    armed_count_.fetch_add(1, std::memory_order_release);
  }
  work_.notify_one();
  // the step's first doorbell comes after the graph's launch and its first layer's GPU work: wake
  // the workers now, so that no task pays their wake-up (the gap between steps outlasts their spin)
  pool_->wake();
}

void Queue::disarm() {
  std::unique_lock<std::mutex> lock(mutex_);
  armed_.clear();
  armed_count_.store(0, std::memory_order_release);
  disarmed_.fetch_add(1, std::memory_order_acq_rel);
  idle_.wait(lock, [&] { return !in_ring_; });  // the pass being polled has ended: no batch of it runs later
}

void Queue::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return in_flight_ == 0; });
}

void Queue::wait_batch(const Batch* b) {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return b->finishes == b->submits; });
}

void Queue::sync() {
  std::exception_ptr e;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return in_flight_ == 0; });
    std::swap(e, error_);
  }
  if (e) std::rethrow_exception(e);
}

void Queue::set_recording(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  recording_ = on;
  records_.clear();
}

std::vector<BatchRecord> Queue::take_records() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BatchRecord> out;
  out.swap(records_);
  return out;
}

void Queue::dispatch() {
  for (;;) {
    // spin before sleeping: decode submits every millisecond or so
    const auto t0 = std::chrono::steady_clock::now();
    for (int spins = 0; pending_count_.load(std::memory_order_acquire) == 0 &&
                        armed_count_.load(std::memory_order_acquire) == 0;
         ++spins) {
      _mm_pause();
      if (spins % 64 == 0 && std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                                     .count() > pool_->spin_ns())
        break;
    }
    Batch* b = nullptr;
    int ring = -1;
    uint64_t armed_at = 0;  // disarm() calls before the pass was taken (a later one ends it)
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [&] { return stop_ || !pending_.empty() || !armed_.empty(); });
      if (!pending_.empty()) {
        b = pending_.front();
        pending_.pop_front();
        pending_count_.fetch_sub(1, std::memory_order_relaxed);
      } else if (!armed_.empty()) {
        ring = armed_.front();  // taken now: a disarm() while it runs drops only the passes after it
        armed_at = disarmed_.load(std::memory_order_acquire);
        armed_.pop_front();
        armed_count_.fetch_sub(1, std::memory_order_relaxed);
        in_ring_ = true;
      } else {
        return;  // stopping, and everything submitted has run
      }
    }
    if (b) {
      run(b);
      continue;
    }
    run_ring(ring, armed_at);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_ring_ = false;
    }
    idle_.notify_all();
  }
}

void Queue::run(Batch* b) {
  std::exception_ptr err;
  b->started_ns = now_ns();
  try {
    run_jobs(*pool_, b->jobs);
  } catch (...) {
    err = std::current_exception();
  }
  b->finished_ns = now_ns();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (err && !error_) error_ = err;
    if (recording_) records_.push_back({b, b->submitted_ns, b->started_ns, b->finished_ns});
    ++b->finishes;
    --in_flight_;
    if (b->done_flag) b->done_flag->store(1, std::memory_order_release);  // outputs are written
  }
  idle_.notify_all();
}

void Queue::run_ring(int ring, uint64_t armed_at) {
  const std::vector<Batch*>& batches = rings_[ring];  // rings are only appended to: the reference stays valid
  for (size_t i = 0; i < batches.size(); ++i) {
    Batch* b = batches[i];
    const int64_t t0 = now_ns();
    // disarmed: no batch of the pass runs from here, rung or not
    bool dropped = disarmed_.load(std::memory_order_acquire) != armed_at, rung = !dropped;
    for (int spins = 0; rung && b->doorbell->load(std::memory_order_acquire) == 0; ++spins) {
      _mm_pause();
      if (spins % 1024 == 0 && disarmed_.load(std::memory_order_acquire) != armed_at) {
        rung = false;
        dropped = true;
        break;
      }
      if (spins % 1024 == 0 && (stopping_.load(std::memory_order_relaxed) || now_ns() - t0 > ring_timeout_ns_)) {
        rung = false;
        break;
      }
    }
    if (!rung) {  // release a GPU waiting on the rest, and (unless disarmed) say why at the next sync
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_ && !dropped)
        error_ = std::make_exception_ptr(std::runtime_error(
            "a GPU step did not ring CPU task " + std::to_string(i) + " of " + std::to_string(batches.size()) +
            " within " + std::to_string(ring_timeout_ns_ / 1'000'000) + " ms (the step failed or was never launched)"));
      for (size_t j = i; j < batches.size(); ++j)
        if (batches[j]->done_flag) batches[j]->done_flag->store(1, std::memory_order_release);
      break;
    }
    b->doorbell->store(0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      b->submitted_ns = now_ns();
      ++b->submits;
      ++in_flight_;
    }
    run(b);
  }
}

}  // namespace ktf

extern "C" void ktf_submit(void* batch) {
  auto* b = static_cast<ktf::Batch*>(batch);
  b->queue->submit(b);
}

extern "C" void ktf_sync(void* queue) { static_cast<ktf::Queue*>(queue)->wait(); }

extern "C" void ktf_wait_batch(void* batch) {
  auto* b = static_cast<ktf::Batch*>(batch);
  b->queue->wait_batch(b);
}
