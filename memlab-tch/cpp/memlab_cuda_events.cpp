// CUDA allocation events for memlab: a trace tracker attached to libtorch's
// caching allocator that forwards every event to a hook set from Rust.
//
// Trackers only reach device allocators that exist, and the caching allocator
// creates them on the first CUDA allocation; attaching therefore makes that
// allocation happen first. A tracker cannot be detached: the hook can be
// cleared, after which the tracker does nothing. Trackers run under the
// allocator's lock: the hook must not call back into libtorch.
//
// Built only when the CUDA headers are found (memlab's scripts install them).

#include "memlab_shim.h"
#include "memlab_state.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <tuple>

#ifdef MEMLAB_BLAS_WORKSPACES
// libtorch's BLAS workspace tables, declared as ATen/cuda/CUDAContextLight.h
// declares them (build.rs checks that it does, word for word): that header
// cannot be included, as it pulls in cuSPARSE's, which need CUDA's C++
// library headers.
namespace at::cuda {
struct WorkspaceMapWithMutex {
  std::map<std::tuple<void*, void*>, at::DataPtr> map;
  std::shared_mutex mutex;
};
WorkspaceMapWithMutex& cublas_handle_stream_to_workspace();
WorkspaceMapWithMutex& cublaslt_handle_stream_to_workspace();
}  // namespace at::cuda
#endif

namespace {

using memlab::state;

// memlab's action (enum memlab_action); -1 = not forwarded.
int32_t action_code(c10::CachingDeviceAllocator::TraceEntry::Action action) {
  using A = c10::CachingDeviceAllocator::TraceEntry::Action;
  switch (action) {
    case A::ALLOC:
      return MEMLAB_ACTION_ALLOC;
    case A::FREE_REQUESTED:
      return MEMLAB_ACTION_FREE_REQUESTED;
    case A::FREE_COMPLETED:
      return MEMLAB_ACTION_FREE_COMPLETED;
    case A::SEGMENT_ALLOC:
      return MEMLAB_ACTION_SEGMENT_ALLOC;
    case A::SEGMENT_FREE:
      return MEMLAB_ACTION_SEGMENT_FREE;
    case A::SEGMENT_MAP:
      return MEMLAB_ACTION_SEGMENT_MAP;
    case A::SEGMENT_UNMAP:
      return MEMLAB_ACTION_SEGMENT_UNMAP;
    case A::OOM:
      return MEMLAB_ACTION_OOM;
    default:
      return -1;
  }
}

void forward(const c10::CachingDeviceAllocator::TraceEntry& entry) {
  memlab_event_hook hook = state().cuda_hook.load(std::memory_order_relaxed);
  int32_t code = action_code(entry.action_);
  if (hook != nullptr && code >= 0) {
    hook(code, static_cast<int32_t>(entry.device_), static_cast<uint64_t>(entry.addr_),
         static_cast<uint64_t>(entry.size_), reinterpret_cast<uint64_t>(entry.stream_));
  }
}

}  // namespace

extern "C" char* memlab_cuda_allocator_initialized(int32_t* out) {
  MEMLAB_TRY
  *out = c10::getDeviceAllocator(c10::DeviceType::CUDA)->initialized() ? 1 : 0;
  MEMLAB_CATCH
}

extern "C" char* memlab_cuda_watch_ooms(int32_t* attached) {
  MEMLAB_TRY
  *attached = 0;
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  if (!allocator->initialized()) {
    return nullptr;
  }
  // Once for the process: one observer, so one report per failure however
  // many copies of memlab watch.
  auto& st = state();
  std::lock_guard<std::mutex> one_at_a_time(st.attaching);
  if (!st.oom_observer_attached.load()) {
    // libtorch calls observers on the failing thread after its allocator let
    // the lock go, then throws its OutOfMemoryError. `alloc_size` is the
    // rounded size of the segment it tried to reserve.
    c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver(
        [](int64_t device, size_t alloc_size, size_t device_total, size_t device_free) {
          uint64_t stream = 0;
          try {
            stream = reinterpret_cast<uint64_t>(
                c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
          } catch (...) {
          }
          memlab_tch_on_oom(static_cast<int32_t>(device), alloc_size, device_free, device_total, stream);
        });
    st.oom_observer_attached.store(true);
  }
  *attached = 1;
  MEMLAB_CATCH
}

extern "C" char* memlab_cuda_snapshot(struct memlab_segment* segments, int64_t segment_capacity,
                                      int64_t* segment_count, struct memlab_block* blocks, int64_t block_capacity,
                                      int64_t* block_count) {
  MEMLAB_TRY
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  if (!allocator->initialized()) {
    *segment_count = 0;
    *block_count = 0;
    return nullptr;
  }
  // Segments only: memlab's own history stands in for libtorch's traces.
  const auto info = c10::cuda::CUDACachingAllocator::snapshot({0, 0}, false);
  int64_t n_segments = 0;
  int64_t n_blocks = 0;
  for (const auto& seg : info.segments) {
    if (n_segments < segment_capacity) {
      segments[n_segments] = {static_cast<uint64_t>(seg.address),
                              static_cast<uint64_t>(seg.total_size),
                              static_cast<uint64_t>(seg.requested_size),
                              static_cast<uint64_t>(seg.allocated_size),
                              static_cast<uint64_t>(seg.active_size),
                              reinterpret_cast<uint64_t>(seg.stream),
                              static_cast<int32_t>(seg.device),
                              seg.is_large ? 1 : 0,
                              seg.is_expandable ? 1 : 0,
                              static_cast<int32_t>(seg.blocks.size())};
    }
    ++n_segments;
    uint64_t address = static_cast<uint64_t>(seg.address);
    for (const auto& b : seg.blocks) {
      if (n_blocks < block_capacity) {
        int32_t state = b.allocated ? MEMLAB_BLOCK_ACTIVE_ALLOCATED
                                    : (b.active ? MEMLAB_BLOCK_ACTIVE_PENDING_FREE : MEMLAB_BLOCK_INACTIVE);
        blocks[n_blocks] = {address, static_cast<uint64_t>(b.size), static_cast<uint64_t>(b.requested_size), state, 0};
      }
      ++n_blocks;
      address += static_cast<uint64_t>(b.size);
    }
  }
  *segment_count = n_segments;
  *block_count = n_blocks;
  MEMLAB_CATCH
}

extern "C" char* memlab_cuda_blas_workspaces(struct memlab_workspace* out, int64_t capacity, int64_t* count) {
  MEMLAB_TRY
#ifndef MEMLAB_BLAS_WORKSPACES
  // This libtorch declares its tables otherwise: none is read.
  (void)out;
  (void)capacity;
  *count = 0;
  return nullptr;
#else
  int64_t n = 0;
  bool busy = false;
  auto read = [&](at::cuda::WorkspaceMapWithMutex& table, int32_t kind) {
    // Never wait: a thread making a workspace holds the table's lock while
    // the allocator serves it, and an out-of-memory observer on that thread
    // may be what asks.
    std::shared_lock<std::shared_mutex> lock(table.mutex, std::try_to_lock);
    if (!lock.owns_lock()) {
      busy = true;
      return;
    }
    for (const auto& [key, data] : table.map) {
      if (data.get() == nullptr) {
        continue;
      }
      if (n < capacity) {
        out[n] = {reinterpret_cast<uint64_t>(data.get()), reinterpret_cast<uint64_t>(std::get<0>(key)),
                  reinterpret_cast<uint64_t>(std::get<1>(key)), static_cast<int32_t>(data.device().index()), kind};
      }
      ++n;
    }
  };
  read(at::cuda::cublas_handle_stream_to_workspace(), MEMLAB_WORKSPACE_CUBLAS);
  read(at::cuda::cublaslt_handle_stream_to_workspace(), MEMLAB_WORKSPACE_CUBLASLT);
  *count = n;
  if (busy) {
    return memlab::error_copy("libtorch was making a BLAS workspace: its table could not be read now");
  }
#endif
  MEMLAB_CATCH
}

extern "C" char* memlab_cuda_allocator_settings(int64_t device, int32_t* initialized,
                                                struct memlab_allocator_settings* out) {
  MEMLAB_TRY
  *initialized = 0;
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  if (!allocator->initialized()) {
    return nullptr;
  }
  // The snapshot's config_metadata is what PyTorch writes as a snapshot's
  // `allocator_settings` (torch/csrc/cuda/Module.cpp, 2.11).
  const auto config = c10::cuda::CUDACachingAllocator::snapshot({0, 0}, false).config_metadata;
  out->garbage_collection_threshold = config.garbage_collection_threshold;
  out->max_split_size = static_cast<uint64_t>(config.max_split_size);
  out->expandable_segments = config.expandable_segments ? 1 : 0;
  out->division_count = static_cast<int32_t>(config.roundup_power2_divisions.size());
  for (size_t i = 0; i < config.roundup_power2_divisions.size() && i < 64; ++i) {
    out->roundup_power2_divisions[i] = static_cast<uint64_t>(config.roundup_power2_divisions[i]);
  }
  out->memory_fraction = c10::cuda::CUDACachingAllocator::getMemoryFraction(static_cast<c10::DeviceIndex>(device));
  out->conf = memlab::error_copy(config.last_allocator_settings.c_str());
  *initialized = 1;
  MEMLAB_CATCH
}

extern "C" char* memlab_cuda_set_event_hook(memlab_event_hook hook) {
  MEMLAB_TRY
  auto& st = state();
  std::lock_guard<std::mutex> one_at_a_time(st.attaching);
  if (hook != nullptr && !st.tracker_attached.load()) {
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    if (!allocator->initialized()) {
      // The first CUDA allocation creates the per-device allocators. Its
      // 2 MiB segment goes back at once: the allocator then holds nothing
      // the history does not show, and a replay of it starts where it did.
      at::empty({1}, at::TensorOptions().device(c10::DeviceType::CUDA));
      allocator->emptyCache();
    }
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&forward);
    st.tracker_attached.store(true);
  }
  st.cuda_hook.store(hook);
  MEMLAB_CATCH
}
