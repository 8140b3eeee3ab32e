// memlab's C++ shim over libtorch: allocator statistics for CUDA (through the
// caching allocator's DeviceAllocator interface) and for the CPU (through a
// counting allocator that wraps libtorch's own), and storage facts of tensors.
// memlab_shim.h declares everything shared with Rust.

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/core/Tensor.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "memlab_shim.h"
#include "memlab_state.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cctype>
#include <cstdio>
#include <exception>
#include <string>
#include <unordered_set>
#include <vector>

#ifdef MEMLAB_WITH_CUDA
// Declared here rather than through ATen/cuda headers, which need the CUDA
// toolkit's headers. Referencing one symbol of libtorch_cuda keeps the library
// linked under --as-needed; without it libtorch never registers its CUDA
// backend and every program sees "no CUDA".
namespace at::cuda {
int warp_size();
}
#endif

char* memlab::error_copy(const char* message) {
  size_t n = std::strlen(message);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) {
    std::memcpy(out, message, n + 1);
  }
  return out;
}

namespace {

using memlab::error_copy;

// The first slot of pool `pool` of stat array `array` (see memlab_stat_slot).
constexpr int slot(int array, int pool) {
  return (array * MEMLAB_STAT_POOLS + pool) * MEMLAB_STAT_COUNTERS;
}

void put_stat(int64_t* out, int index, const c10::CachingAllocator::Stat& s) {
  out[index + MEMLAB_COUNTER_CURRENT] = s.current;
  out[index + MEMLAB_COUNTER_PEAK] = s.peak;
  out[index + MEMLAB_COUNTER_ALLOCATED] = s.allocated;
  out[index + MEMLAB_COUNTER_FREED] = s.freed;
}

void put_array(int64_t* out, int array, const c10::CachingAllocator::StatArray& a) {
  for (int pool = 0; pool < MEMLAB_STAT_POOLS; ++pool) {
    put_stat(out, slot(array, pool), a[pool]);
  }
}

void flatten(const c10::CachingDeviceAllocator::DeviceStats& s, int64_t* out) {
  put_array(out, MEMLAB_STAT_ALLOCATION, s.allocation);
  put_array(out, MEMLAB_STAT_SEGMENT, s.segment);
  put_array(out, MEMLAB_STAT_ACTIVE, s.active);
  put_array(out, MEMLAB_STAT_INACTIVE_SPLIT, s.inactive_split);
  put_array(out, MEMLAB_STAT_ALLOCATED_BYTES, s.allocated_bytes);
  put_array(out, MEMLAB_STAT_RESERVED_BYTES, s.reserved_bytes);
  put_array(out, MEMLAB_STAT_ACTIVE_BYTES, s.active_bytes);
  put_array(out, MEMLAB_STAT_INACTIVE_SPLIT_BYTES, s.inactive_split_bytes);
  put_array(out, MEMLAB_STAT_REQUESTED_BYTES, s.requested_bytes);
  out[MEMLAB_SLOT_NUM_ALLOC_RETRIES] = s.num_alloc_retries;
  out[MEMLAB_SLOT_NUM_OOMS] = s.num_ooms;
  put_stat(out, MEMLAB_SLOT_OVERSIZE_ALLOCATIONS, s.oversize_allocations);
  put_stat(out, MEMLAB_SLOT_OVERSIZE_SEGMENTS, s.oversize_segments);
  out[MEMLAB_SLOT_NUM_SYNC_ALL_STREAMS] = s.num_sync_all_streams;
  out[MEMLAB_SLOT_NUM_DEVICE_ALLOC] = s.num_device_alloc;
  out[MEMLAB_SLOT_NUM_DEVICE_FREE] = s.num_device_free;
  out[MEMLAB_SLOT_MAX_SPLIT_SIZE] = s.max_split_size;
}

// ---------------------------------------------------------------------------
// The counting CPU allocator.
//
// With an event hook set (memlab_set_cpu_event_hook), every allocation and
// free is also reported to it; without, the check is one relaxed load.
//
// Each block is taken from the wrapped allocator with a 64-byte header in
// front (64 keeps libtorch's alignment) that records the size asked for and
// how to give the block back. The figures count the bytes tensors asked for;
// the header is memlab's own cost and is not counted.

constexpr size_t kHeader = 64;

struct Header {
  size_t size;
  void* context;
  c10::DeleterFnPtr deleter;
};
static_assert(sizeof(Header) <= kHeader, "header fits its slot");

using memlab::state;

// Counts one allocation or free. While a hook is set, the hook counts it
// (memlab_cpu_count), under the lock with which it records the event, so
// that the counters agree with the recorded events whenever that lock is
// held; without a hook the counters move at once.
template <typename Count>
void count_and_report(Count count, int32_t action, uint64_t address, uint64_t size) {
  if (memlab_event_hook hook = state().cpu_hook.load(std::memory_order_relaxed)) {
    hook(action, MEMLAB_EVENT_DEVICE_CPU, address, size, 0);
  } else {
    count();
  }
}

void counting_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  Header h = *header;
  count_and_report(
      [&] {
        state().bytes.sub(static_cast<int64_t>(h.size));
        state().blocks.sub(1);
      },
      MEMLAB_ACTION_FREE_REQUESTED, reinterpret_cast<uint64_t>(data), h.size);
  if (h.deleter != nullptr) {
    h.deleter(h.context);
  }
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::Allocator* inner = nullptr;

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &counting_delete, cpu};
    }
    c10::DataPtr block;
    std::exception_ptr failed;
    try {
      // A request so large that the header would wrap the size around fails
      // as the inner allocator fails: it can never be served.
      TORCH_CHECK(n <= SIZE_MAX - kHeader, "DefaultCPUAllocator: can't allocate memory: you tried to allocate ", n,
                  " bytes.");
      block = inner->allocate(n + kHeader);
    } catch (...) {
      failed = std::current_exception();
    }
    if (failed) {
      state().ooms.fetch_add(1, std::memory_order_relaxed);
      // The request failed for lack of memory: say so (outside the handler,
      // with the error kept), then let libtorch's error go on to the caller
      // unchanged. memlab_tch_on_oom records the failure as an event: it
      // first gives back the reserve that recording and reporting use.
      memlab_tch_on_oom(MEMLAB_EVENT_DEVICE_CPU, n, 0, 0, 0);
      std::rethrow_exception(failed);
    }
    char* base = static_cast<char*>(block.get());
    c10::DeleterFnPtr deleter = block.get_deleter();
    void* context = block.release_context();
    new (base) Header{n, context, deleter};
    char* data = base + kHeader;
    count_and_report(
        [&] {
          state().bytes.add(static_cast<int64_t>(n));
          state().blocks.add(1);
        },
        MEMLAB_ACTION_ALLOC, reinterpret_cast<uint64_t>(data), n);
    return {data, data, &counting_delete, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &counting_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// This copy's anchor and state: the process's, or its own.
memlab_anchor* g_anchor = nullptr;
memlab::State* g_state = nullptr;
// An anchor of another ABI found at load, and why looking for one failed.
const memlab_anchor* g_foreign = nullptr;
const char* g_anchor_error = nullptr;

// Beside a memlab of another anchor ABI, which counts CPU memory (or chose
// not to), this copy installs no allocator of its own: chained, each would
// count the other's headers. The error that says so; NULL otherwise.
char* beside_foreign() {
  if (g_foreign == nullptr) {
    return nullptr;
  }
  std::string message = std::string("another memlab (") + g_foreign->made_by + ", anchor ABI " +
                        std::to_string(g_foreign->abi) + ") keeps the CPU allocator of this process; this one (" +
                        MEMLAB_MADE_BY + ", anchor ABI " + std::to_string(MEMLAB_ANCHOR_ABI) +
                        ") cannot share its figures: build every part of the program with one memlab version";
  return error_copy(message.c_str());
}

// Installs the process's counting allocator (made, never destroyed, by the
// copy that made the anchor: libtorch may free CPU tensors during its own
// teardown) as libtorch's CPU allocator, wrapping the one in place.
char* install_counting_allocator() {
  MEMLAB_TRY
  if (char* beside = beside_foreign()) {
    return beside;
  }
  auto& st = state();
  std::lock_guard<std::mutex> one_at_a_time(st.installing);
  if (st.installed.load()) {
    return nullptr;
  }
  // Of the maker's copy; the anchor's ABI fixes its layout.
  auto* counting = static_cast<CountingCpuAllocator*>(st.counting);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != counting) {
    counting->inner = current;
    c10::SetCPUAllocator(counting, /*priority=*/0);
  }
  if (c10::GetCPUAllocator() != counting) {
    st.declined.store(true);
    return error_copy(
        "another CPU allocator with a higher priority is registered with libtorch; "
        "memlab cannot count CPU tensors while it is in place");
  }
  st.installed.store(true);
  MEMLAB_CATCH
}

// Reads a boolean environment variable the way memlab's Rust side does
// (memlab_core::profiler::env_flag): 1/true/yes/on, 0/false/no/off, any case,
// spaces around ignored. Returns -1 when unset or empty, and also for anything
// else, after a warning on stderr.
int env_flag(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) {
    return -1;
  }
  std::string text(raw);
  auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && blank(text.back())) text.pop_back();
  size_t start = 0;
  while (start < text.size() && blank(text[start])) ++start;
  text = text.substr(start);
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (text.empty()) return -1;
  if (text == "1" || text == "true" || text == "yes" || text == "on") return 1;
  if (text == "0" || text == "false" || text == "no" || text == "off") return 0;
  // Read while the program loads, before any Rust code could have chosen
  // where memlab's warnings go: standard error is the only place there is.
  std::fprintf(stderr,
               "memlab: ignoring %s=\"%s\": write 1, true, yes or on to turn it on, "
               "0, false, no or off to turn it off\n",
               name, raw);
  return -1;
}

// ---------------------------------------------------------------------------
// The anchor (see struct memlab_anchor in memlab_shim.h).

// The kernel of memlab::process_anchor, registered by the copy that made the
// process's anchor: that anchor's address.
int64_t process_anchor_address() {
  return reinterpret_cast<int64_t>(g_anchor);
}

void make_own_anchor() {
  auto* st = new memlab::State();
  st->counting = new CountingCpuAllocator();
  g_anchor = new memlab_anchor{MEMLAB_ANCHOR_ABI, sizeof(memlab_anchor), MEMLAB_MADE_BY, nullptr, st, 1, 0};
  g_state = st;
}

// Keeps this copy loaded for the rest of the process, whatever dlclose says
// later. Once a copy has met the others, they run its code: the counting
// allocator the first copy installs in libtorch, and every process-wide
// value any copy makes or sets (an output sink, a thread-local's accessor)
// holds functions of the copy that made it. The loader's own pins do not
// last (a thread-local's destructor holds a library only while its thread
// lives), so the copy pins itself: dlopen of its own file with
// RTLD_NODELETE. A program's executable is never unloaded; for it the
// call finds nothing to pin and does nothing.
void pin_this_copy() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&pin_this_copy), &info) != 0 && info.dli_fname != nullptr) {
    // The handle is kept on purpose: the copy is never closed.
    (void)dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
  }
}

// Finds the process's anchor through libtorch's dispatcher, or makes one and
// registers it there. Runs while this copy loads, under the loader's lock, so
// two copies never meet here at once.
void meet() {
  pin_this_copy();
  try {
    auto found = c10::Dispatcher::singleton().findSchema({"memlab::process_anchor", ""});
    if (found.has_value()) {
      auto* other = reinterpret_cast<memlab_anchor*>(found->typed<int64_t()>().call());
      if (other != nullptr && other->abi == MEMLAB_ANCHOR_ABI && other->size == sizeof(memlab_anchor)) {
        __atomic_fetch_add(&other->copies, 1, __ATOMIC_RELAXED);
        g_anchor = other;
        g_state = static_cast<memlab::State*>(other->shim);
        return;
      }
      g_foreign = other;
      make_own_anchor();
      return;
    }
    make_own_anchor();
    // Tests play a memlab of another ABI with this variable: the anchor
    // registered here then claims that version.
    if (const char* abi = std::getenv("MEMLAB_TEST_ANCHOR_ABI")) {
      g_anchor->abi = static_cast<uint32_t>(std::strtoul(abi, nullptr, 10));
    }
    // Never destroyed: destroying it would take the operator away again.
    auto* library = new torch::Library(torch::Library::FRAGMENT, "memlab", std::nullopt, __FILE__, __LINE__);
    library->def("process_anchor() -> int", &process_anchor_address);
  } catch (const std::exception& e) {
    if (g_anchor == nullptr) {
      make_own_anchor();
    }
    g_anchor_error = error_copy(e.what());
  } catch (...) {
    if (g_anchor == nullptr) {
      make_own_anchor();
    }
    g_anchor_error = error_copy("unknown C++ exception");
  }
}

// Meets the other copies once. The loader runs this copy's initializers in
// an order of its own: Rust's (MEMLAB_OOM_DIR's) may come first and reach the
// anchor before g_loaded below runs, so every way in comes through here.
// Before the copy's code can run on another thread, the loader has run it.
void ensure_met() {
  if (g_anchor == nullptr) {
    meet();
  }
}

// When this copy loads (before main for a program, in dlopen for a plugin):
// meet the other copies, then, for the copy that made the state, install the
// counting allocator before any tensor exists, so that every CPU tensor is
// counted. MEMLAB_CPU_ALLOCATOR=0 (or false/no/off) opts out;
// memlab_cpu_install can still install it later, and counts only what is
// allocated after that.
const bool g_loaded = [] {
  ensure_met();
  if (__atomic_load_n(&g_anchor->copies, __ATOMIC_RELAXED) > 1 || g_foreign != nullptr) {
    // A copy that joined (the maker decided), or one beside a memlab of
    // another ABI (which counts, or decided not to).
    return true;
  }
  if (env_flag("MEMLAB_CPU_ALLOCATOR") == 0) {
    std::strncat(g_state->turned_off_with, std::getenv("MEMLAB_CPU_ALLOCATOR"), memlab::kTurnedOffWith);
    return true;
  }
  char* error = install_counting_allocator();
  std::free(error);
  g_state->installed_at_load.store(error == nullptr);
  return true;
}();

}  // namespace

memlab::State& memlab::state() {
  if (__builtin_expect(g_state == nullptr, 0)) {
    ensure_met();
  }
  return *g_state;
}

namespace {

// The CUDA allocator is registered once, when libtorch_cuda loads; looking it
// up once spares every probe a dynamic_cast.
c10::DeviceAllocator* cuda_allocator() {
  static c10::DeviceAllocator* const allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
  return allocator;
}

bool cuda_registered() {
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA);
}

}  // namespace

extern "C" {

void memlab_free_error(char* error) {
  std::free(error);
}

// 1 when memlab was built against a libtorch with CUDA (and keeps it linked).
int32_t memlab_built_with_cuda() {
#ifdef MEMLAB_WITH_CUDA
  // Taking the address is enough for the linker; the volatile read keeps the
  // reference from being optimised away.
  void* volatile keep = reinterpret_cast<void*>(&at::cuda::warp_size);
  return keep != nullptr ? 1 : 0;
#else
  return 0;
#endif
}

int32_t memlab_cuda_events_built() {
#ifdef MEMLAB_CUDA_EVENTS
  return 1;
#else
  return 0;
#endif
}

char* memlab_cuda_device_count(int64_t* out) {
  MEMLAB_TRY
  *out = cuda_registered() ? c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount() : 0;
  MEMLAB_CATCH
}

char* memlab_cuda_current_device(int64_t* out) {
  MEMLAB_TRY
  TORCH_CHECK(cuda_registered(), "libtorch has no CUDA backend in this process");
  *out = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  MEMLAB_CATCH
}

char* memlab_cuda_stats(int64_t device, int32_t reset_peaks, int64_t* out) {
  MEMLAB_TRY
  std::memset(out, 0, sizeof(int64_t) * MEMLAB_STAT_FIELDS);
  TORCH_CHECK(cuda_registered(), "libtorch has no CUDA backend in this process");
  auto* allocator = cuda_allocator();
  // Before the first CUDA allocation the caching allocator holds nothing.
  if (!allocator->initialized()) {
    return nullptr;
  }
  auto index = static_cast<c10::DeviceIndex>(device);
  flatten(allocator->getDeviceStats(index), out);
  if (reset_peaks != 0) {
    allocator->resetPeakStats(index);
  }
  MEMLAB_CATCH
}

// Sets the running totals of `device` to zero and writes what they held into
// `out` (all 122 fields, as memlab_cuda_stats does). The caching allocator
// reads and resets under its own lock in two calls: an allocation between
// them is counted in neither.
char* memlab_cuda_take_accumulated_stats(int64_t device, int64_t* out) {
  MEMLAB_TRY
  std::memset(out, 0, sizeof(int64_t) * MEMLAB_STAT_FIELDS);
  TORCH_CHECK(cuda_registered(), "libtorch has no CUDA backend in this process");
  auto* allocator = cuda_allocator();
  if (allocator->initialized()) {
    auto index = static_cast<c10::DeviceIndex>(device);
    flatten(allocator->getDeviceStats(index), out);
    allocator->resetAccumulatedStats(index);
  }
  MEMLAB_CATCH
}

char* memlab_cuda_empty_cache() {
  MEMLAB_TRY
  TORCH_CHECK(cuda_registered(), "libtorch has no CUDA backend in this process");
  auto* allocator = cuda_allocator();
  if (allocator->initialized()) {
    allocator->emptyCache();
  }
  MEMLAB_CATCH
}

char* memlab_cuda_mem_info(int64_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  MEMLAB_TRY
  TORCH_CHECK(cuda_registered(), "libtorch has no CUDA backend in this process");
  auto info = cuda_allocator()->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
  *free_bytes = info.first;
  *total_bytes = info.second;
  MEMLAB_CATCH
}

char* memlab_cpu_install() {
  return install_counting_allocator();
}

int32_t memlab_cpu_installed() {
  return state().installed.load() ? 1 : 0;
}

int32_t memlab_cpu_installed_at_load() {
  return state().installed_at_load.load() ? 1 : 0;
}

struct memlab_anchor* memlab_process_anchor() {
  ensure_met();
  return g_anchor;
}

const struct memlab_anchor* memlab_foreign_anchor() {
  return g_foreign;
}

char* memlab_anchor_error() {
  return g_anchor_error == nullptr ? nullptr : error_copy(g_anchor_error);
}

namespace {

char* cpu_missing() {
  if (char* beside = beside_foreign()) {
    return beside;
  }
  if (state().declined.load()) {
    return error_copy("another CPU allocator with a higher priority is registered with libtorch");
  }
  std::string message = std::string("it was turned off with MEMLAB_CPU_ALLOCATOR=\"") + state().turned_off_with +
                        "\"; call memlab::install_cpu_allocator() or unset the variable";
  return error_copy(message.c_str());
}

// Every CPU block is its own system allocation, in use until freed: the block
// counts serve allocation, segment and active; the byte counts serve
// allocated, reserved, active and requested bytes (the CPU has no cache).
void put_cpu(int64_t* out, const int64_t* blocks, const int64_t* bytes) {
  for (int array : {MEMLAB_STAT_ALLOCATION, MEMLAB_STAT_SEGMENT, MEMLAB_STAT_ACTIVE}) {
    std::memcpy(out + slot(array, 0), blocks, sizeof(int64_t) * MEMLAB_STAT_COUNTERS);
  }
  for (int array : {MEMLAB_STAT_ALLOCATED_BYTES, MEMLAB_STAT_RESERVED_BYTES, MEMLAB_STAT_ACTIVE_BYTES,
                    MEMLAB_STAT_REQUESTED_BYTES}) {
    std::memcpy(out + slot(array, 0), bytes, sizeof(int64_t) * MEMLAB_STAT_COUNTERS);
  }
  out[MEMLAB_SLOT_NUM_DEVICE_ALLOC] = blocks[MEMLAB_COUNTER_ALLOCATED];
  out[MEMLAB_SLOT_NUM_DEVICE_FREE] = blocks[MEMLAB_COUNTER_FREED];
}

}  // namespace

// Writes the CPU fields only; the caller zero-initialises the record once.
char* memlab_cpu_stats(int32_t reset_peaks, int64_t* out) {
  auto& st = state();
  if (!st.installed.load()) {
    return cpu_missing();
  }
  bool reset = reset_peaks != 0;
  int64_t blocks[4];
  int64_t bytes[4];
  st.blocks.read(blocks, reset);
  st.bytes.read(bytes, reset);
  put_cpu(out, blocks, bytes);
  out[MEMLAB_SLOT_NUM_OOMS] = st.ooms.load(std::memory_order_relaxed);
  return nullptr;
}

void memlab_cpu_count(int32_t action, uint64_t size) {
  const auto bytes = static_cast<int64_t>(size);
  auto& st = state();
  if (action == MEMLAB_ACTION_ALLOC) {
    st.bytes.add(bytes);
    st.blocks.add(1);
  } else if (action == MEMLAB_ACTION_FREE_REQUESTED) {
    st.bytes.sub(bytes);
    st.blocks.sub(1);
  }
}

// Sets the CPU's running totals to zero; writes what they held into the CPU
// fields of `out` (levels and peaks read zero there).
char* memlab_cpu_take_accumulated_stats(int64_t* out) {
  auto& st = state();
  if (!st.installed.load()) {
    return cpu_missing();
  }
  int64_t blocks[4];
  int64_t bytes[4];
  st.blocks.take_accumulated(blocks);
  st.bytes.take_accumulated(bytes);
  put_cpu(out, blocks, bytes);
  out[MEMLAB_SLOT_NUM_OOMS] = st.ooms.exchange(0, std::memory_order_relaxed);
  return nullptr;
}

// Reports every CPU allocation and free to `hook` (NULL: to nobody). The hook
// must not throw.
void memlab_set_cpu_event_hook(memlab_event_hook hook) {
  state().cpu_hook.store(hook);
}

}  // extern "C"

namespace {

std::atomic<memlab_op_hook> op_hook{nullptr};
std::atomic<uint64_t> next_op_id{1};
std::mutex op_watch_lock;
at::CallbackHandle op_watch = 0;

// The op's id, for its end callback, and whether it is a backward node.
struct OpContext : at::ObserverContext {
  explicit OpContext(uint64_t id, bool backward_node = false) : id(id), backward_node(backward_node) {}
  uint64_t id;
  bool backward_node;
};

// How deep this thread is in backward functions' records.
thread_local int backward_depth = 0;

bool is_matmul(const char* op_name) {
  static const char* const names[] = {"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "addbmm",
                                      "_addmm_activation"};
  for (const char* name : names) {
    if (std::strcmp(op_name, name) == 0) {
      return true;
    }
  }
  return false;
}

// Copies up to MEMLAB_OP_MAX_DIMS of `values` into `out`; false if more.
bool copy_dims(c10::IntArrayRef values, int64_t* out) {
  if (values.size() > MEMLAB_OP_MAX_DIMS) {
    return false;
  }
  std::copy(values.begin(), values.end(), out);
  return true;
}

// A list of ints as an argument gives it: an int list, or a generic list of ints.
bool int_list(const c10::IValue& value, int64_t* out, int32_t* count) {
  std::vector<int64_t> values;
  if (value.isIntList()) {
    values = value.toIntVector();
  } else if (value.isList()) {
    for (const c10::IValue& v : value.toListRef()) {
      if (!v.isInt()) {
        return false;
      }
      values.push_back(v.toInt());
    }
  } else {
    return false;
  }
  *count = static_cast<int32_t>(values.size());
  return copy_dims(values, out);
}

// A sum or mean: its input and reduced dimensions.
bool reduction(c10::ArrayRef<const c10::IValue> inputs, memlab_op* op) {
  if (inputs.empty() || !inputs[0].isTensor()) {
    return false;
  }
  const at::Tensor& input = inputs[0].toTensor();
  if (!input.defined() || input.dim() == 0 || !copy_dims(input.sizes(), op->input) ||
      !copy_dims(input.strides(), op->input_strides)) {
    return false;
  }
  const int64_t ndim = input.dim();
  op->kind = MEMLAB_OP_REDUCTION;
  op->ndim = static_cast<int32_t>(ndim);
  op->element_size = static_cast<int32_t>(input.element_size());
  int64_t dims[MEMLAB_OP_MAX_DIMS];
  int32_t count = 0;
  if (inputs.size() > 1 && int_list(inputs[1], dims, &count)) {
    for (int32_t i = 0; i < count; i++) {
      const int64_t d = dims[i] < 0 ? dims[i] + ndim : dims[i];
      if (d >= 0 && d < ndim) {
        op->reduced |= uint64_t{1} << static_cast<uint64_t>(d);
      }
    }
  }
  if (op->reduced == 0) {
    // No list (or an empty one): every dimension.
    op->reduced = (uint64_t{1} << ndim) - 1;
  }
  return true;
}

// aten::_softmax_backward_data(grad_output, output, dim, input_dtype): the
// gradient's shape and element size.
bool softmax_backward(c10::ArrayRef<const c10::IValue> inputs, memlab_op* op) {
  if (inputs.empty() || !inputs[0].isTensor()) {
    return false;
  }
  const at::Tensor& grad = inputs[0].toTensor();
  if (!grad.defined() || !copy_dims(grad.sizes(), op->input)) {
    return false;
  }
  op->kind = MEMLAB_OP_SOFTMAX_BACKWARD;
  op->ndim = static_cast<int32_t>(grad.dim());
  op->element_size = static_cast<int32_t>(grad.element_size());
  return true;
}

// aten::embedding_dense_backward(grad_output, indices, num_weights,
// padding_idx, scale_grad_by_freq): the gradient's shape and element size,
// the indices' count, element size and layout, the table's rows.
bool embedding_backward(c10::ArrayRef<const c10::IValue> inputs, memlab_op* op) {
  if (inputs.size() < 5 || !inputs[0].isTensor() || !inputs[1].isTensor() || !inputs[2].isInt() ||
      !inputs[4].isBool()) {
    return false;
  }
  const at::Tensor& grad = inputs[0].toTensor();
  const at::Tensor& indices = inputs[1].toTensor();
  if (!grad.defined() || !indices.defined() || grad.dim() == 0 || !copy_dims(grad.sizes(), op->input)) {
    return false;
  }
  op->kind = MEMLAB_OP_EMBEDDING_BACKWARD;
  op->ndim = static_cast<int32_t>(grad.dim());
  op->element_size = static_cast<int32_t>(grad.element_size());
  op->indices = indices.numel();
  op->index_element_size = static_cast<int32_t>(indices.element_size());
  op->num_weights = inputs[2].toInt();
  op->flags = (inputs[4].toBool() ? MEMLAB_EMBEDDING_SCALE_GRAD_BY_FREQ : 0) |
              (indices.is_contiguous() ? MEMLAB_EMBEDDING_INDICES_CONTIGUOUS : 0) |
              (grad.is_contiguous() ? MEMLAB_EMBEDDING_GRAD_CONTIGUOUS : 0);
  return true;
}

// aten::convolution(input, weight, bias, stride, padding, dilation,
// transposed, output_padding, groups), or aten::convolution_backward(
// grad_output, input, weight, bias_sizes, stride, padding, dilation,
// transposed, output_padding, groups, output_mask).
bool convolution(c10::ArrayRef<const c10::IValue> inputs, bool backward, memlab_op* op) {
  const size_t shift = backward ? 1 : 0;
  if (inputs.size() < 9 + 2 * shift) {
    return false;
  }
  for (size_t i = 0; i < 2 + shift; i++) {
    if (!inputs[i].isTensor() || !inputs[i].toTensor().defined()) {
      return false;
    }
  }
  const at::Tensor& input = inputs[shift].toTensor();
  const at::Tensor& weight = inputs[shift + 1].toTensor();
  if (input.dim() < 3 || weight.dim() != input.dim() || !copy_dims(input.sizes(), op->input) ||
      !copy_dims(input.strides(), op->input_strides) || !copy_dims(weight.sizes(), op->weight)) {
    return false;
  }
  if (backward && !copy_dims(inputs[0].toTensor().sizes(), op->output)) {
    return false;
  }
  int32_t count = 0;
  // Read to check the arguments are what the schema says, not reported.
  int64_t output_padding[MEMLAB_OP_MAX_DIMS];
  const size_t at = 3 + shift;
  if (!int_list(inputs[at], op->stride, &count) || !int_list(inputs[at + 1], op->padding, &count) ||
      !int_list(inputs[at + 2], op->dilation, &count) || !inputs[at + 3].isBool() ||
      !int_list(inputs[at + 4], output_padding, &count) || !inputs[at + 5].isInt()) {
    return false;
  }
  op->kind = backward ? MEMLAB_OP_CONVOLUTION_BACKWARD : MEMLAB_OP_CONVOLUTION;
  op->ndim = static_cast<int32_t>(input.dim());
  op->element_size = static_cast<int32_t>(input.element_size());
  op->transposed = inputs[at + 3].toBool() ? 1 : 0;
  op->groups = inputs[at + 5].toInt();
  if (backward) {
    if (inputs.size() < 11 || !inputs[10].isBoolList()) {
      return false;
    }
    const c10::List<bool> mask = inputs[10].toBoolList();
    for (size_t i = 0; i < mask.size() && i < 3; i++) {
      if (mask.get(i)) {
        op->output_mask |= 1 << i;
      }
    }
  } else if (inputs[2].isTensor() && inputs[2].toTensor().defined()) {
    op->output_mask = 4;  // with a bias
  }
  return true;
}

// Every op's name (after "aten::") and tensor arguments, lists included.
void name_and_tensors(const char* op_name, c10::ArrayRef<const c10::IValue> inputs, memlab_op* op) {
  std::strncpy(op->name, op_name, sizeof(op->name) - 1);
  auto add = [op](const at::Tensor& t) {
    const int32_t i = op->tensors++;
    // A sparse or nested tensor has no strided sizes and no nbytes(): it is
    // counted, without its bytes or shape.
    const bool strided = t.defined() && t.layout() == at::kStrided && !t.is_nested();
    if (strided) {
      op->tensor_bytes += static_cast<uint64_t>(t.nbytes());
    }
    if (i >= MEMLAB_OP_MAX_TENSORS) {
      return;
    }
    if (!t.defined()) {
      op->tensor_ndim[i] = -2;
      return;
    }
    op->tensor_dtype[i] = static_cast<int32_t>(t.scalar_type());
    op->tensor_ndim[i] =
        strided && copy_dims(t.sizes(), op->tensor_shape[i]) ? static_cast<int32_t>(t.dim()) : -1;
  };
  for (const c10::IValue& value : inputs) {
    if (value.isTensor()) {
      add(value.toTensor());
    } else if (value.isList()) {
      for (const c10::IValue& element : value.toListRef()) {
        if (element.isTensor()) {
          add(element.toTensor());
        }
      }
    } else if (value.isBool() || value.isInt() || value.isDouble()) {
      const int32_t i = op->scalars++;
      if (i < MEMLAB_OP_MAX_SCALARS) {
        op->scalar[i] = value.isBool()  ? (value.toBool() ? 1.0 : 0.0)
                        : value.isInt() ? static_cast<double>(value.toInt())
                                        : value.toDouble();
      }
    }
  }
}

// Whether this thread runs its step under CPU autocast standing for CUDA's
// (memlab_cpu_autocast_begin; a CPU backward pass runs on the thread that
// asks for it): its backward functions run without it, and its cast weights
// are given back at the first (libtorch keeps one cache for all threads,
// so it is cleared once a step).
thread_local int autocast_steps = 0;
thread_local bool autocast_cache_given_back = false;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  memlab_op_hook hook = op_hook.load(std::memory_order_acquire);
  if (hook == nullptr) {
    return nullptr;
  }
  try {
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION && autocast_steps > 0 &&
        at::autocast::is_autocast_enabled(at::kCPU)) {
      // CUDA's autocast ends with the forward pass (tch's autocast gives
      // its cast weights back as it ends); autograd restores the thread's
      // state after the node.
      at::autocast::set_autocast_enabled(at::kCPU, false);
      if (!autocast_cache_given_back) {
        at::autocast::clear_cache();
        autocast_cache_given_back = true;
      }
    }
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
      backward_depth++;
      memlab_op node{};
      node.kind = MEMLAB_OP_BACKWARD_NODE;
      const char* name = fn.name();
      std::strncpy(node.name, name == nullptr ? "" : name, sizeof(node.name) - 1);
      node.sequence_nr = fn.seqNr();
      node.in_backward = 1;
      node.id = next_op_id.fetch_add(1, std::memory_order_relaxed);
      hook(&node, node.id, -1);
      return std::make_unique<OpContext>(node.id, true);
    }
    const char* name = fn.name();
    if (name == nullptr || std::strncmp(name, "aten::", 6) != 0) {
      return nullptr;
    }
    const char* op_name = name + 6;
    memlab_op op{};
    bool known = false;
    if (std::strcmp(op_name, "sum") == 0 || std::strcmp(op_name, "mean") == 0) {
      known = reduction(fn.inputs(), &op);
    } else if (std::strcmp(op_name, "convolution") == 0) {
      known = convolution(fn.inputs(), false, &op);
    } else if (std::strcmp(op_name, "convolution_backward") == 0) {
      known = convolution(fn.inputs(), true, &op);
    } else if (std::strcmp(op_name, "_softmax_backward_data") == 0) {
      known = softmax_backward(fn.inputs(), &op);
    } else if (std::strcmp(op_name, "embedding_dense_backward") == 0) {
      known = embedding_backward(fn.inputs(), &op);
    } else if (is_matmul(op_name)) {
      op.kind = MEMLAB_OP_MATMUL;
      known = true;
    }
    if (!known) {
      op = memlab_op{};
      op.kind = MEMLAB_OP_OTHER;
    }
    name_and_tensors(op_name, fn.inputs(), &op);
    // The thread's next number: the first any backward node the op (or an
    // op it calls) makes takes.
    op.sequence_nr = static_cast<int64_t>(at::sequence_number::peek());
    op.in_backward = backward_depth > 0 ? 1 : 0;
    op.id = next_op_id.fetch_add(1, std::memory_order_relaxed);
    hook(&op, op.id, -1);
    return std::make_unique<OpContext>(op.id);
  } catch (...) {
    // An op the callback cannot read is not reported.
    return nullptr;
  }
}

void on_op_end(const at::RecordFunction&, at::ObserverContext* context) {
  if (context == nullptr) {
    return;
  }
  const OpContext* op = static_cast<OpContext*>(context);
  const uint64_t id = op->id;
  if (op->backward_node) {
    backward_depth--;
  }
  memlab_op_hook hook = op_hook.load(std::memory_order_acquire);
  if (hook != nullptr) {
    hook(nullptr, id, op->backward_node ? -1 : static_cast<int64_t>(at::sequence_number::peek()));
  }
}

}  // namespace

extern "C" {

char* memlab_watch_ops(memlab_op_hook hook) {
  try {
    std::lock_guard<std::mutex> guard(op_watch_lock);
    op_hook.store(hook, std::memory_order_release);
    if (hook != nullptr && op_watch == 0) {
      // Every thread's ops: a CUDA backward pass runs on autograd's device threads.
      op_watch = at::addGlobalCallback(
          at::RecordFunctionCallback(on_op_start, on_op_end)
                                          .needsInputs(true)
                                          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    } else if (hook == nullptr && op_watch != 0) {
      at::removeCallback(op_watch);
      op_watch = 0;
    }
    return nullptr;
  } catch (const std::exception& e) {
    return error_copy(e.what());
  } catch (...) {
    return error_copy("libtorch refused memlab's op callback");
  }
}

// The calling thread's CUDA autocast as tch::autocast leaves it: whether it
// is on, and how deeply autocast regions nest (read by going one deeper and
// back).
char* memlab_cuda_autocast_state(int32_t* enabled, int32_t* nesting) {
  try {
    *enabled = at::autocast::is_autocast_enabled(at::kCUDA) ? 1 : 0;
    *nesting = at::autocast::increment_nesting() - 1;
    at::autocast::decrement_nesting();
    return nullptr;
  } catch (const std::exception& e) {
    return error_copy(e.what());
  } catch (...) {
    return error_copy("libtorch refused to tell its autocast state");
  }
}

// Puts the calling thread's CUDA autocast back as memlab_cuda_autocast_state
// read it: tch::autocast does not unwind, so a panic inside it leaves autocast
// on, one level deeper, and its cast weights cached. The regions left open
// are closed, and where none stays open the cache is given back, as the
// outermost region's end would have. `*left` says whether any was.
char* memlab_cuda_autocast_restore(int32_t enabled, int32_t nesting, int32_t* left) {
  try {
    int now = at::autocast::increment_nesting() - 1;
    at::autocast::decrement_nesting();
    *left = (now > nesting || (at::autocast::is_autocast_enabled(at::kCUDA) ? 1 : 0) != enabled) ? 1 : 0;
    while (now > nesting) {
      now = at::autocast::decrement_nesting();
      if (now == 0) {
        at::autocast::clear_cache();
      }
    }
    at::autocast::set_autocast_enabled(at::kCUDA, enabled != 0);
    return nullptr;
  } catch (const std::exception& e) {
    return error_copy(e.what());
  } catch (...) {
    return error_copy("libtorch refused to restore its autocast state");
  }
}

char* memlab_cpu_autocast_begin(int32_t dtype, int32_t* was_enabled, int32_t* was_dtype) {
  try {
    *was_enabled = at::autocast::is_autocast_enabled(at::kCPU) ? 1 : 0;
    *was_dtype = static_cast<int32_t>(at::autocast::get_autocast_dtype(at::kCPU));
    at::autocast::set_autocast_dtype(at::kCPU, static_cast<c10::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(at::kCPU, true);
    autocast_steps++;
    autocast_cache_given_back = false;
    return nullptr;
  } catch (const std::exception& e) {
    return error_copy(e.what());
  } catch (...) {
    return error_copy("libtorch refused CPU autocast");
  }
}

char* memlab_cpu_autocast_end(int32_t was_enabled, int32_t was_dtype) {
  try {
    autocast_steps--;
    at::autocast::clear_cache();
    autocast_cache_given_back = false;
    at::autocast::set_autocast_enabled(at::kCPU, was_enabled != 0);
    at::autocast::set_autocast_dtype(at::kCPU, static_cast<c10::ScalarType>(was_dtype));
    return nullptr;
  } catch (const std::exception& e) {
    return error_copy(e.what());
  } catch (...) {
    return error_copy("libtorch refused to end CPU autocast");
  }
}

#ifndef MEMLAB_CUDA_EVENTS
char* memlab_cuda_allocator_initialized(int32_t* out) {
  *out = 0;
  return nullptr;
}

char* memlab_cuda_watch_ooms(int32_t* attached) {
  // Without the CUDA runtime headers (or without CUDA) no observer can be
  // attached; the Rust side says so where it matters.
  *attached = 0;
  return nullptr;
}

char* memlab_cuda_set_event_hook(memlab_event_hook hook) {
  if (hook == nullptr) {
    return nullptr;
  }
  return error_copy(
#ifdef MEMLAB_WITH_CUDA
      "memlab was built without the CUDA runtime headers, so it cannot observe CUDA allocations: "
      "`pip install nvidia-cuda-crt==13.0.88` into torch's environment (scripts/env.sh does) and rebuild"
#else
      "this libtorch has no CUDA"
#endif
  );
}

char* memlab_cuda_allocator_settings(int64_t, int32_t* initialized, struct memlab_allocator_settings*) {
  // Without the CUDA runtime headers the allocator's settings cannot be
  // read; a snapshot then goes without them, and its replay says so.
  *initialized = 0;
  return nullptr;
}

char* memlab_cuda_blas_workspaces(struct memlab_workspace*, int64_t, int64_t* count) {
  // Without the CUDA headers libtorch's tables cannot be read; none is
  // listed, and the reporter's rest stays unnamed.
  *count = 0;
  return nullptr;
}

char* memlab_cuda_snapshot(struct memlab_segment*, int64_t, int64_t* segment_count, struct memlab_block*, int64_t,
                           int64_t* block_count) {
  *segment_count = 0;
  *block_count = 0;
#ifdef MEMLAB_WITH_CUDA
  return error_copy(
      "memlab was built without the CUDA runtime headers, so it cannot read the caching allocator's segments: "
      "`pip install nvidia-cuda-crt==13.0.88` into torch's environment (scripts/env.sh does) and rebuild");
#else
  return nullptr;
#endif
}
#endif


namespace {

void fill_storage(const at::Tensor& t, memlab_storage_info* out) {
  std::memset(out, 0, sizeof *out);
  out->numel = t.numel();
  out->element_size = static_cast<int64_t>(t.element_size());
  const auto device = t.device();
  switch (device.type()) {
    case c10::DeviceType::CPU:
      out->device_type = MEMLAB_DEVICE_CPU;
      break;
    case c10::DeviceType::CUDA:
      out->device_type = MEMLAB_DEVICE_CUDA;
      break;
    default:
      out->device_type = MEMLAB_DEVICE_OTHER_BASE + static_cast<int32_t>(device.type());
  }
  out->device_index = device.has_index() ? device.index() : 0;
  switch (t.layout()) {
    case c10::kStrided:
      out->layout = MEMLAB_LAYOUT_STRIDED;
      break;
    case c10::kSparse:
      out->layout = MEMLAB_LAYOUT_SPARSE_COO;
      break;
    case c10::kSparseCsr:
    case c10::kSparseCsc:
    case c10::kSparseBsr:
    case c10::kSparseBsc:
      out->layout = MEMLAB_LAYOUT_SPARSE_COMPRESSED;
      break;
    default:
      out->layout = MEMLAB_LAYOUT_OTHER;
  }
  if (t.has_storage()) {
    const auto& storage = t.storage();
    out->has_storage = MEMLAB_HAS_STORAGE;
    out->storage_id = reinterpret_cast<uint64_t>(storage.unsafeGetStorageImpl());
    out->nbytes = static_cast<int64_t>(storage.nbytes());
    out->data_ptr = reinterpret_cast<uint64_t>(storage.data());
    c10::DeleterFnPtr deleter = storage.data_ptr().get_deleter();
    c10::DeleterFnPtr counted = nullptr;
    if (device.type() == c10::DeviceType::CPU) {
      // The process's counting allocator is the first copy's, and its
      // tensors carry that copy's deleter, whichever copy asks: libtorch's
      // allocator says which (a call through this copy's own class would
      // answer with this copy's deleter).
      c10::Allocator* current = c10::GetCPUAllocator();
      c10::Allocator* process = static_cast<CountingCpuAllocator*>(state().counting);
      counted = current == process ? current->raw_deleter() : &counting_delete;
    } else if (device.type() == c10::DeviceType::CUDA && cuda_registered()) {
      counted = cuda_allocator()->raw_deleter();
    }
    // An allocator that does not say how it frees cannot be told apart: count it.
    out->from_allocator = (counted == nullptr || deleter == counted || storage.nbytes() == 0) ? 1 : 0;
  }
}

void fill_facts(const at::Tensor& t, struct memlab_tensor_facts* out) {
  fill_storage(t, &out->storage);
  out->dtype = static_cast<int32_t>(t.scalar_type());
  out->ndim = static_cast<int32_t>(t.dim());
  for (int32_t i = 0; i < out->ndim && i < MEMLAB_MAX_DIMS; ++i) {
    out->dims[i] = t.size(i);
  }
}

}  // namespace

char* memlab_tensor_storage(const void* tensor, memlab_storage_info* out) {
  MEMLAB_TRY
  TORCH_CHECK(tensor != nullptr, "null tensor");
  const auto& t = *static_cast<const at::Tensor*>(tensor);
  TORCH_CHECK(t.defined(), "the tensor is undefined (it holds no data)");
  fill_storage(t, out);
  MEMLAB_CATCH
}

// Storage, dtype and shape of a tensor and, with `grad` non-null, of its
// gradient (grad->storage.has_storage = MEMLAB_NO_GRADIENT when it has none), in one call:
// the reporter's cost is dominated by crossings into libtorch.
char* memlab_tensor_facts(const void* tensor, struct memlab_tensor_facts* out, struct memlab_tensor_facts* grad) {
  MEMLAB_TRY
  TORCH_CHECK(tensor != nullptr, "null tensor");
  const auto& t = *static_cast<const at::Tensor*>(tensor);
  TORCH_CHECK(t.defined(), "the tensor is undefined (it holds no data)");
  fill_facts(t, out);
  if (grad != nullptr) {
    // Only leaves (and tensors that retain theirs) have gradients; asking a
    // non-leaf makes libtorch print a warning every time.
    const bool has_grad_field = t.is_leaf() || t.retains_grad();
    const at::Tensor g = has_grad_field ? t.grad() : at::Tensor();
    if (g.defined()) {
      fill_facts(g, grad);
    } else {
      std::memset(grad, 0, sizeof *grad);
      grad->storage.has_storage = MEMLAB_NO_GRADIENT;
    }
  }
  MEMLAB_CATCH
}

char* memlab_tensor_impl(const void* tensor, uint64_t* out) {
  MEMLAB_TRY
  TORCH_CHECK(tensor != nullptr, "null tensor");
  *out = reinterpret_cast<uint64_t>(static_cast<const at::Tensor*>(tensor)->unsafeGetTensorImpl());
  MEMLAB_CATCH
}

namespace {

int32_t optimizer_kind(const torch::optim::Optimizer* o) {
  if (dynamic_cast<const torch::optim::AdamW*>(o) != nullptr) return MEMLAB_OPTIMIZER_ADAMW;
  if (dynamic_cast<const torch::optim::Adam*>(o) != nullptr) return MEMLAB_OPTIMIZER_ADAM;
  if (dynamic_cast<const torch::optim::SGD*>(o) != nullptr) return MEMLAB_OPTIMIZER_SGD;
  if (dynamic_cast<const torch::optim::RMSprop*>(o) != nullptr) return MEMLAB_OPTIMIZER_RMSPROP;
  return MEMLAB_OPTIMIZER_NONE;
}

// The defined tensors of one parameter's state, with their slots.
std::vector<std::pair<int32_t, at::Tensor>> state_tensors(const torch::optim::OptimizerParamState* s) {
  std::vector<std::pair<int32_t, at::Tensor>> out;
  auto add = [&](int32_t slot, const at::Tensor& t) {
    if (t.defined()) out.emplace_back(slot, t);
  };
  if (auto a = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
    add(MEMLAB_STATE_EXP_AVG, a->exp_avg());
    add(MEMLAB_STATE_EXP_AVG_SQ, a->exp_avg_sq());
    add(MEMLAB_STATE_MAX_EXP_AVG_SQ, a->max_exp_avg_sq());
  } else if (auto a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
    add(MEMLAB_STATE_EXP_AVG, a->exp_avg());
    add(MEMLAB_STATE_EXP_AVG_SQ, a->exp_avg_sq());
    add(MEMLAB_STATE_MAX_EXP_AVG_SQ, a->max_exp_avg_sq());
  } else if (auto m = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
    add(MEMLAB_STATE_MOMENTUM_BUFFER, m->momentum_buffer());
  } else if (auto r = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
    add(MEMLAB_STATE_SQUARE_AVG, r->square_avg());
    add(MEMLAB_STATE_MOMENTUM_BUFFER, r->momentum_buffer());
    add(MEMLAB_STATE_GRAD_AVG, r->grad_avg());
  } else {
    TORCH_CHECK(false, "an optimizer state of a kind memlab does not know");
  }
  return out;
}

}  // namespace

char* memlab_optimizer_kind(const void* optimizer, int32_t* kind) {
  MEMLAB_TRY
  TORCH_CHECK(optimizer != nullptr, "null optimizer");
  *kind = optimizer_kind(static_cast<const torch::optim::Optimizer*>(optimizer));
  MEMLAB_CATCH
}

char* memlab_optimizer_states(const void* optimizer, struct memlab_optimizer_state* out, int64_t capacity,
                              int64_t* count) {
  MEMLAB_TRY
  TORCH_CHECK(optimizer != nullptr, "null optimizer");
  auto* o = static_cast<const torch::optim::Optimizer*>(optimizer);
  TORCH_CHECK(optimizer_kind(o) != MEMLAB_OPTIMIZER_NONE, "not an optimizer tch builds (Adam, AdamW, SGD, RMSprop)");
  const auto& state = o->state();
  // Collected first, so nothing is handed out when an exception leaves halfway.
  std::vector<memlab_optimizer_state> entries;
  std::vector<at::Tensor> tensors;
  const auto& groups = o->param_groups();
  // A tensor a var store holds under two names (tied weights) is two
  // parameters to tch but one state to libtorch: each is listed once.
  std::unordered_set<void*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      void* key = p.unsafeGetTensorImpl();
      if (!seen.insert(key).second) {
        continue;
      }
      const uint64_t param = reinterpret_cast<uint64_t>(key);
      auto found = state.find(key);
      auto parts = found == state.end() ? std::vector<std::pair<int32_t, at::Tensor>>{} : state_tensors(found->second.get());
      if (parts.empty()) {
        entries.push_back({param, nullptr, static_cast<int32_t>(g), MEMLAB_STATE_NONE});
        tensors.emplace_back();
      }
      for (auto& [slot, t] : parts) {
        entries.push_back({param, nullptr, static_cast<int32_t>(g), slot});
        tensors.push_back(t);
      }
    }
  }
  *count = static_cast<int64_t>(entries.size());
  for (size_t i = 0; i < entries.size() && static_cast<int64_t>(i) < capacity; ++i) {
    out[i] = entries[i];
    if (tensors[i].defined()) {
      out[i].tensor = new at::Tensor(tensors[i]);
    }
  }
  MEMLAB_CATCH
}

char* memlab_optimizer_state_count(const void* optimizer, int64_t* count) {
  MEMLAB_TRY
  TORCH_CHECK(optimizer != nullptr, "null optimizer");
  *count = static_cast<int64_t>(static_cast<const torch::optim::Optimizer*>(optimizer)->state().size());
  MEMLAB_CATCH
}

// Weak references to tensors, for registries that must not keep a model alive.
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

char* memlab_weak_tensor_new(const void* tensor, void** out) {
  MEMLAB_TRY
  const auto& t = *static_cast<const at::Tensor*>(tensor);
  TORCH_CHECK(t.defined(), "cannot register an undefined tensor");
  *out = new WeakTensor(t.getIntrusivePtr());
  MEMLAB_CATCH
}

// A new strong at::Tensor (for tch to own), or NULL when the tensor is gone.
void* memlab_weak_tensor_lock(void* weak) {
  try {
    auto strong = static_cast<WeakTensor*>(weak)->lock();
    if (!strong) {
      return nullptr;
    }
    return new at::Tensor(std::move(strong));
  } catch (...) {
    return nullptr;
  }
}

int32_t memlab_weak_tensor_expired(void* weak) {
  return static_cast<WeakTensor*>(weak)->expired() ? 1 : 0;
}

void memlab_weak_tensor_free(void* weak) {
  delete static_cast<WeakTensor*>(weak);
}

char* memlab_weak_gradients(const void* const* tensors, int64_t n, void** out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = nullptr;
  }
  MEMLAB_TRY
  for (int64_t i = 0; i < n; ++i) {
    const auto& t = *static_cast<const at::Tensor*>(tensors[i]);
    if (!t.defined() || !(t.is_leaf() || t.retains_grad())) {
      continue;
    }
    const at::Tensor& g = t.grad();
    if (g.defined()) {
      out[i] = new WeakTensor(g.getIntrusivePtr());
    }
  }
  MEMLAB_CATCH
}

}  // extern "C"
