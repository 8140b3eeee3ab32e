// The shim's process-wide state: one per process however many copies of
// memlab are loaded (see struct memlab_anchor in memlab_shim.h). The copy
// that made the anchor made this too; every copy that joined reaches it
// through memlab::state(). Its layout is part of MEMLAB_ANCHOR_ABI: a change
// here is a new ABI version.
#pragma once

#include "memlab_shim.h"

#include <atomic>
#include <cstdint>
#include <mutex>

namespace memlab {

// Four counters of one quantity (bytes or blocks) of the counting CPU allocator.
struct Counter {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> freed{0};

  void add(int64_t n) {
    int64_t now = current.fetch_add(n, std::memory_order_relaxed) + n;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
    allocated.fetch_add(n, std::memory_order_relaxed);
  }
  void sub(int64_t n) {
    current.fetch_sub(n, std::memory_order_relaxed);
    freed.fetch_add(n, std::memory_order_relaxed);
  }
  // Reads the four counters; with `reset`, the peak restarts from the level.
  void read(int64_t* out, bool reset) {
    int64_t level = current.load(std::memory_order_relaxed);
    out[MEMLAB_COUNTER_CURRENT] = level;
    out[MEMLAB_COUNTER_PEAK] = peak.load(std::memory_order_relaxed);
    if (reset) {
      // A plain store, not an exchange: a block allocated and freed again
      // between the load and the store would be missed, which is the same
      // window libtorch's CUDA allocator has between reading and resetting.
      peak.store(level, std::memory_order_relaxed);
    }
    out[MEMLAB_COUNTER_ALLOCATED] = allocated.load(std::memory_order_relaxed);
    out[MEMLAB_COUNTER_FREED] = freed.load(std::memory_order_relaxed);
  }
  // Sets the running totals to zero and returns, in their slots of `out`,
  // what they held: nothing counted in between is lost.
  void take_accumulated(int64_t* out) {
    out[MEMLAB_COUNTER_CURRENT] = 0;
    out[MEMLAB_COUNTER_PEAK] = 0;
    out[MEMLAB_COUNTER_ALLOCATED] = allocated.exchange(0, std::memory_order_relaxed);
    out[MEMLAB_COUNTER_FREED] = freed.exchange(0, std::memory_order_relaxed);
  }
};

// The longest MEMLAB_CPU_ALLOCATOR value kept for the error that quotes it.
constexpr size_t kTurnedOffWith = 120;

struct State {
  // The counting CPU allocator's figures.
  Counter bytes;
  Counter blocks;
  // Requests the inner allocator could not serve (the CPU's `num_ooms`).
  std::atomic<int64_t> ooms{0};
  // Where CPU allocations and frees are reported (NULL: nowhere).
  std::atomic<memlab_event_hook> cpu_hook{nullptr};
  // The process's one counting allocator (a CountingCpuAllocator made by the
  // anchor's maker), whether it is libtorch's CPU allocator, whether one of
  // higher priority kept it out, and whether it went in as the program loaded.
  void* counting = nullptr;
  std::atomic<bool> installed{false};
  std::atomic<bool> declined{false};
  std::atomic<bool> installed_at_load{false};
  // The value of MEMLAB_CPU_ALLOCATOR that turned counting off at load
  // (empty when it was not turned off), for the error that says so.
  char turned_off_with[kTurnedOffWith + 1] = {};
  // Installs of the counting allocator, one at a time.
  std::mutex installing;
  // Where CUDA events are reported, and whether the caching allocator's trace
  // tracker and OOM observer (which cannot be detached) are attached.
  std::atomic<memlab_event_hook> cuda_hook{nullptr};
  std::atomic<bool> tracker_attached{false};
  std::atomic<bool> oom_observer_attached{false};
  // Attachments to the CUDA caching allocator, one at a time.
  std::mutex attaching;
};

// The process's state (set when this copy loads, before anything reads it).
State& state();

}  // namespace memlab
