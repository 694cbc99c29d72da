// The asynchronous CPU queue. submit() only enqueues a batch of MoE jobs and returns; one
// dispatcher thread runs the batches in order on the thread pool; sync() waits until everything
// submitted so far has run and rethrows the first error a batch raised. Both also exist as plain
// C functions taking a context pointer (ktf_submit(batch), ktf_sync(queue)), the shape
// cudaLaunchHostFunc calls, so a CUDA stream (or a captured graph) can drive the queue.
//
// A batch may carry a done flag: a 32-bit word (in pinned memory a GPU can read) that submit sets
// to 0 and the dispatcher sets to 1 once the batch has run, failed or not, after its outputs are
// written. A CUDA stream can wait on it (cuStreamWaitValue32) without a host function. Like the
// pool's workers, the dispatcher spins for a while (KTFLOW_SPIN_US) before it sleeps, so a
// submit during decode starts without a wake-up.
//
// A batch may also carry a doorbell: a pinned 32-bit word a GPU sets to 1 with a stream
// write-value operation, which submits the batch with no host function at all. The batches a
// captured step rings are registered once, in the order it rings them, as a ring (add_ring);
// before each launch of that step the host arms the ring (arm), and the dispatcher then polls the
// ring's doorbells in order, spinning: each one it finds rung it clears and runs as a submission
// (the GPU clears the batch's done flag itself, before it rings). A doorbell not rung within
// the ring timeout ends the pass: the error surfaces at the next sync, and the done flags of the
// batches not run are set, so a GPU waiting on them goes on rather than hanging.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ktf/moe.h"
#include "ktf/pool.h"

namespace ktf {

class Queue;

// A prepared batch: its jobs run together each time it is submitted (pointers stay valid: the
// caller keeps the buffers alive; a job may read its token count through tokens_ptr).
struct Batch {
  Queue* queue = nullptr;
  std::vector<Job> jobs;
  // timestamps (steady clock, ns) of the latest run
  int64_t submitted_ns = 0, started_ns = 0, finished_ns = 0;
  // times submitted and times finished (written under the queue's mutex): wait_batch waits for equality
  std::atomic<uint64_t> submits{0}, finishes{0};
  // optional: 0 from submit until the batch has run, then 1 (see above)
  std::atomic<uint32_t>* done_flag = nullptr;
  // optional: set to 1 by a GPU to submit the batch while its ring is armed (see above)
  std::atomic<uint32_t>* doorbell = nullptr;
};

struct BatchRecord {
  const Batch* batch;
  int64_t submitted_ns, started_ns, finished_ns;
};

class Queue {
 public:
  explicit Queue(std::shared_ptr<ThreadPool> pool);
  ~Queue();  // finishes what was submitted, then stops; never waits for anything else
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  void submit(Batch* b);  // never blocks on work
  void sync();            // waits, then rethrows the first error since the last sync
  void wait();            // waits; errors stay for the next sync (for C callers)
  void wait_batch(const Batch* b);  // waits until every submission of b has run (not later batches)
  int add_ring(std::vector<Batch*> ring);  // batches with doorbells, in ringing order; returns its id
  void arm(int ring);                      // one pass of that ring is coming: poll its doorbells
  // The passes armed are not coming (the host failed to launch what rings them): drop those not
  // started, end the one being polled before its next batch (rung or not) without an error, and
  // set the done flags of its batches not run. Returns once that pass has ended: no batch of the
  // abandoned passes runs after it (the caller then clears the doorbells a GPU may still ring).
  // Every ring of this queue is disarmed.
  void disarm();
  void set_ring_timeout_ns(int64_t ns) { ring_timeout_ns_ = ns; }
  ThreadPool& pool() { return *pool_; }
  std::vector<BatchRecord> take_records();  // run times since the last call
  void set_recording(bool on);

 private:
  void dispatch();
  void run(Batch* b);        // runs a submitted batch, records it, sets its done flag
  void run_ring(int ring, uint64_t armed_at);  // one armed pass over a ring's doorbells (armed_at: see disarm)
  std::shared_ptr<ThreadPool> pool_;
  std::mutex mutex_;
  std::condition_variable work_, idle_;
  std::deque<Batch*> pending_;
  std::atomic<int> pending_count_{0};  // pending_.size(), read by the spinning dispatcher without the mutex
  std::deque<std::vector<Batch*>> rings_;  // a deque: add_ring never moves a ring being polled
  std::deque<int> armed_;                // rings armed, in order
  std::atomic<int> armed_count_{0};      // armed_.size(), read like pending_count_
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> disarmed_{0};    // counts disarm() calls: a pass polled across one ends
  bool in_ring_ = false;                 // the dispatcher is in a pass (mutex_; disarm waits for it to end)
  int64_t ring_timeout_ns_ = 30'000'000'000;  // 30 s
  int in_flight_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  bool recording_ = false;
  std::vector<BatchRecord> records_;
  std::thread dispatcher_;
};

int64_t now_ns();

}  // namespace ktf

extern "C" {
// ctx: a ktf::Batch*; enqueues it on its queue
void ktf_submit(void* batch);
// ctx: a ktf::Queue*; waits for everything submitted to it
void ktf_sync(void* queue);
// ctx: a ktf::Batch*; waits until that batch has run (batches submitted after it may still run)
void ktf_wait_batch(void* batch);
}
