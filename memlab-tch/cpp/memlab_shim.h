// The contract between memlab's C++ shim and its Rust side (memlab-tch's
// ffi.rs mirrors every item here, with compile-time checks of sizes and
// offsets on both sides). Every number that crosses the boundary is named
// here, once.
//
// Every entry point that returns `char*` returns NULL on success or a
// malloc'd error message, which the caller frees with memlab_free_error: no
// C++ exception ever crosses into Rust.
//
// libtorch versions (build.rs refuses others): the shim compiles unchanged
// against 2.11 (tch 0.24) and 2.13 (tch 0.26). What differs between their
// headers, and what memlab does about it, in one place:
// - 2.13's headers initialise bit-fields in their declaration (C++20):
//   build.rs compiles the shim as C++20 for 2.13, C++17 for 2.11;
// - 2.13's DeviceStats adds num_oom_rejections and per-pool reserved bytes
//   (reserved_bytes_by_private_pools): the shim reads the fields both have,
//   the 122 of memory_stats() in 2.11;
// - 2.13's CUDA allocator can reject a request before trying the device
//   (its throw_on_cudamalloc_oom policy, off by default) and tells a
//   separate OOM-rejection observer, which memlab does not attach: such a
//   rejection is not recorded;
// - the calls the shim makes (getDeviceStats, resetPeakStats, emptyCache,
//   getMemoryInfo, raw_deleter, the trace tracker, the OOM observer, the
//   snapshot, torch::optim's state and param_groups) are the same in both.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// What happened to a block of memory, as events report it.
enum memlab_action {
  MEMLAB_ACTION_ALLOC = 0,
  MEMLAB_ACTION_FREE_REQUESTED = 1,
  MEMLAB_ACTION_FREE_COMPLETED = 2,
  MEMLAB_ACTION_SEGMENT_ALLOC = 3,
  MEMLAB_ACTION_SEGMENT_FREE = 4,
  MEMLAB_ACTION_OOM = 5,
  // Expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  // grow and shrink by mapping and unmapping pages of one segment.
  MEMLAB_ACTION_SEGMENT_MAP = 6,
  MEMLAB_ACTION_SEGMENT_UNMAP = 7,
};

// The device of an event: a CUDA device index, or this value for the CPU.
#define MEMLAB_EVENT_DEVICE_CPU (-1)

// memlab_storage_info.device_type.
enum memlab_device_type {
  MEMLAB_DEVICE_CPU = 0,
  MEMLAB_DEVICE_CUDA = 1,
  // Any other device: this plus libtorch's DeviceType value.
  MEMLAB_DEVICE_OTHER_BASE = 100,
};

// memlab_storage_info.layout.
enum memlab_layout {
  MEMLAB_LAYOUT_STRIDED = 0,
  MEMLAB_LAYOUT_SPARSE_COO = 1,
  // CSR, CSC, BSR, BSC.
  MEMLAB_LAYOUT_SPARSE_COMPRESSED = 2,
  MEMLAB_LAYOUT_OTHER = 3,
};

// The flat record of allocator statistics (memlab-core's RawStats): nine
// stat arrays (in DeviceStats order) of three pools (all, small, large) of
// four counters (current, peak, allocated, freed), then the scalars.
enum memlab_stat_array {
  MEMLAB_STAT_ALLOCATION = 0,
  MEMLAB_STAT_SEGMENT = 1,
  MEMLAB_STAT_ACTIVE = 2,
  MEMLAB_STAT_INACTIVE_SPLIT = 3,
  MEMLAB_STAT_ALLOCATED_BYTES = 4,
  MEMLAB_STAT_RESERVED_BYTES = 5,
  MEMLAB_STAT_ACTIVE_BYTES = 6,
  MEMLAB_STAT_INACTIVE_SPLIT_BYTES = 7,
  MEMLAB_STAT_REQUESTED_BYTES = 8,
};

// The four counters of a stat, in this order in each pool's slots.
enum memlab_stat_counter {
  MEMLAB_COUNTER_CURRENT = 0,
  MEMLAB_COUNTER_PEAK = 1,
  MEMLAB_COUNTER_ALLOCATED = 2,
  MEMLAB_COUNTER_FREED = 3,
};

enum memlab_stat_slot {
  MEMLAB_STAT_POOLS = 3,
  MEMLAB_STAT_COUNTERS = 4,
  // Slot of counter 0 (current) of pool 0 (all) of an array: array * 12.
  MEMLAB_STAT_ARRAY_SLOTS = MEMLAB_STAT_POOLS * MEMLAB_STAT_COUNTERS,
  MEMLAB_SLOT_NUM_ALLOC_RETRIES = 108,
  MEMLAB_SLOT_NUM_OOMS = 109,
  // A stat of four counters, like an array's pool.
  MEMLAB_SLOT_OVERSIZE_ALLOCATIONS = 110,
  MEMLAB_SLOT_OVERSIZE_SEGMENTS = 114,
  MEMLAB_SLOT_NUM_SYNC_ALL_STREAMS = 118,
  MEMLAB_SLOT_NUM_DEVICE_ALLOC = 119,
  MEMLAB_SLOT_NUM_DEVICE_FREE = 120,
  MEMLAB_SLOT_MAX_SPLIT_SIZE = 121,
  MEMLAB_STAT_FIELDS = 122,
};

// The hook events are reported to: action (enum memlab_action), device (a
// CUDA index or MEMLAB_EVENT_DEVICE_CPU), address, size, stream (the CUDA
// stream's handle, 0 on the CPU). For MEMLAB_ACTION_OOM, `size` is the
// request and `address` what the device still had free, as in libtorch's
// trace (CUDA), or 0 (the CPU: the counting allocator saw its inner
// allocator fail, and the Rust side reads the host's free memory; libtorch's
// error then goes on to the caller). It must not throw; for
// CUDA it runs under the caching allocator's lock.
typedef void (*memlab_event_hook)(int32_t action, int32_t device, uint64_t address, uint64_t size,
                                  uint64_t stream);

// memlab_storage_info.has_storage.
enum memlab_storage_presence {
  MEMLAB_NO_GRADIENT = -1,  // asked for a gradient slot: the tensor has no gradient
  MEMLAB_NO_STORAGE = 0,    // a tensor without a storage of its own (sparse)
  MEMLAB_HAS_STORAGE = 1,
};

// What memlab knows about the storage behind a tensor.
struct memlab_storage_info {
  uint64_t storage_id;  // the StorageImpl's address
  uint64_t data_ptr;
  int64_t nbytes;
  int64_t numel;  // of the tensor, not the storage
  int64_t element_size;
  int32_t device_type;  // enum memlab_device_type
  int32_t device_index;
  int32_t layout;  // enum memlab_layout
  int32_t has_storage;  // enum memlab_storage_presence
  // 1 when the memory came from the allocator whose figures memlab reads (the
  // counting CPU allocator, the CUDA caching allocator); 0 for memory it never
  // counted (Tensor::from_blob, CPU tensors made before memlab's allocator).
  int32_t from_allocator;
  int32_t reserved;
};

// The most dimensions memlab_tensor_facts carries.
#define MEMLAB_MAX_DIMS 16

struct memlab_tensor_facts {
  struct memlab_storage_info storage;
  int32_t dtype;  // c10::ScalarType
  int32_t ndim;
  int64_t dims[MEMLAB_MAX_DIMS];  // the first MEMLAB_MAX_DIMS sizes
};

// The optimizer classes tch builds (torch::optim), found by dynamic_cast.
enum memlab_optimizer_kind {
  MEMLAB_OPTIMIZER_NONE = 0,
  MEMLAB_OPTIMIZER_ADAM = 1,
  MEMLAB_OPTIMIZER_ADAMW = 2,
  MEMLAB_OPTIMIZER_SGD = 3,
  MEMLAB_OPTIMIZER_RMSPROP = 4,
};

// The tensors of a parameter's optimizer state, by their libtorch names.
enum memlab_optimizer_slot {
  MEMLAB_STATE_NONE = -1,  // a parameter with no state yet
  MEMLAB_STATE_EXP_AVG = 0,
  MEMLAB_STATE_EXP_AVG_SQ = 1,
  MEMLAB_STATE_MAX_EXP_AVG_SQ = 2,
  MEMLAB_STATE_MOMENTUM_BUFFER = 3,
  MEMLAB_STATE_SQUARE_AVG = 4,
  MEMLAB_STATE_GRAD_AVG = 5,
};

// One parameter of an optimizer and one tensor of its state (slot
// MEMLAB_STATE_NONE and a null tensor: the parameter has no state yet).
struct memlab_optimizer_state {
  uint64_t param;  // the parameter's TensorImpl address: the state map's key
  void* tensor;    // a new at::Tensor sharing the state tensor, for tch to own
  int32_t group;   // the index of the parameter's group
  int32_t slot;    // enum memlab_optimizer_slot
};

// The state of a caching-allocator block, as libtorch's snapshot names it.
enum memlab_block_state {
  MEMLAB_BLOCK_ACTIVE_ALLOCATED = 0,     // used by a tensor
  MEMLAB_BLOCK_ACTIVE_PENDING_FREE = 1,  // freed, waiting for a stream to finish with it
  MEMLAB_BLOCK_INACTIVE = 2,             // free for reuse
};

// A segment of the CUDA caching allocator (one cudaMalloc), from its own
// snapshot; its `blocks` blocks follow the previous segments' in the block array.
struct memlab_segment {
  uint64_t address;
  uint64_t total_size;
  uint64_t requested_size;
  uint64_t allocated_size;
  uint64_t active_size;
  uint64_t stream;
  int32_t device;
  int32_t is_large;
  int32_t is_expandable;
  int32_t blocks;
};

// A block of a segment: its address is the segment's plus the sizes before it.
struct memlab_block {
  uint64_t address;
  uint64_t size;
  uint64_t requested_size;
  int32_t state;  // enum memlab_block_state
  int32_t reserved;
};

// A workspace libtorch keeps for a BLAS library on a (handle, stream): the
// buffers of `at::cuda::cublas_handle_stream_to_workspace()` and
// `cublaslt_handle_stream_to_workspace()`, allocated from the caching
// allocator and kept for the life of the handle.
enum memlab_workspace_kind {
  MEMLAB_WORKSPACE_CUBLAS = 0,
  MEMLAB_WORKSPACE_CUBLASLT = 1,
};

struct memlab_workspace {
  uint64_t address;
  uint64_t handle;
  uint64_t stream;
  int32_t device;
  int32_t kind;  // enum memlab_workspace_kind
};

// Defined by the Rust side (memlab-tch's oom.rs), called by the shim:
//
// A request the allocator could not serve, on the failing thread before the
// allocator's error is thrown (CUDA: from libtorch's out-of-memory observer,
// after the allocator let its lock go; the CPU: from the counting
// allocator). `requested` is the CUDA allocator's rounding of the request to
// the segment it tried to reserve, or the CPU's exact request; the device's
// free and total bytes are libtorch's figures (CUDA) or 0 (the CPU); `stream`
// is the failing thread's current CUDA stream (0 on the CPU). The CPU's
// failure reaches the event hook through it, not from the shim (CUDA's
// comes with libtorch's trace). Never unwinds.
void memlab_tch_on_oom(int32_t device, uint64_t requested, uint64_t device_free, uint64_t device_total,
                       uint64_t stream);

void memlab_free_error(char* error);
int32_t memlab_built_with_cuda(void);
// 1 when the CUDA parts (allocation events, the caching allocator's snapshot
// and its out-of-memory observer: memlab_cuda_events.cpp) were compiled,
// against this libtorch's CUDA headers and the CUDA runtime's.
int32_t memlab_cuda_events_built(void);

char* memlab_cuda_device_count(int64_t* out);
char* memlab_cuda_current_device(int64_t* out);
// Writes all MEMLAB_STAT_FIELDS slots.
char* memlab_cuda_stats(int64_t device, int32_t reset_peaks, int64_t* out);
char* memlab_cuda_take_accumulated_stats(int64_t device, int64_t* out);
char* memlab_cuda_empty_cache(void);
char* memlab_cuda_mem_info(int64_t device, uint64_t* free_bytes, uint64_t* total_bytes);
char* memlab_cuda_set_event_hook(memlab_event_hook hook);
// Attaches memlab's out-of-memory observer to the CUDA caching allocator
// (once for the process; it reaches every device). libtorch attaches
// observers only to an allocator that exists: `attached` is 0 while no CUDA
// memory was allocated yet (or without CUDA), 1 once the observer is on.
// Never initialises CUDA.
char* memlab_cuda_watch_ooms(int32_t* attached);
// Whether the CUDA caching allocator exists (some CUDA memory was allocated):
// 1 or 0 in `out`. Never initialises CUDA.
char* memlab_cuda_allocator_initialized(int32_t* out);
// The caching allocator's segments and blocks, all devices: the first
// `segment_capacity` segments and `block_capacity` blocks are written, and the
// counts say how many there are (call again with more room when they exceed
// the capacities).
char* memlab_cuda_snapshot(struct memlab_segment* segments, int64_t segment_capacity, int64_t* segment_count,
                           struct memlab_block* blocks, int64_t block_capacity, int64_t* block_count);

// The BLAS workspaces libtorch holds now, read from its own tables under
// their locks: at most `capacity` into `out`, their number into `*count`
// (call again with more room when it is larger). Never creates a handle and
// never waits for a lock: while another thread changes a table, an error.
char* memlab_cuda_blas_workspaces(struct memlab_workspace* out, int64_t capacity, int64_t* count);

// The CUDA caching allocator's settings as libtorch holds them (what
// PyTorch's snapshots give as `allocator_settings`), and device `device`'s
// memory fraction: `*initialized` is 0, and nothing else written, while the
// allocator does not exist yet (it is never created here). `conf` is the
// settings string libtorch parsed last (PYTORCH_ALLOC_CONF or its older
// name, or a later change at run time), owned by the caller: free it with
// memlab_free_error. At most 64 division buckets are written;
// `division_count` says how many libtorch has.
struct memlab_allocator_settings {
  char* conf;
  double garbage_collection_threshold;
  uint64_t max_split_size;
  int32_t expandable_segments;
  int32_t division_count;
  uint64_t roundup_power2_divisions[64];
  double memory_fraction;
};
char* memlab_cuda_allocator_settings(int64_t device, int32_t* initialized, struct memlab_allocator_settings* out);

// Where the copies of memlab in one process meet. A process may link memlab
// more than once (a notebook compiles each cell into a library of its own,
// with memlab inside; two plugins may each carry one): each copy has its own
// statics, but the process has one libtorch. The first copy to load registers
// an operator `memlab::process_anchor() -> int` with libtorch's dispatcher,
// which returns the address of its anchor; every later copy finds it there
// and uses the state the anchor holds instead of its own: the counting CPU
// allocator and its counters, the event hooks, the CUDA tracker and OOM
// observer (attached once), and memlab-core's table of process-wide values.
//
// The fields up to `made_by` keep their place in every version; the rest is
// laid out as `abi` says. A copy that finds an anchor of another ABI keeps
// its own state (and its Rust side warns once, naming both).
#define MEMLAB_ANCHOR_ABI 1

struct memlab_anchor {
  uint32_t abi;         // MEMLAB_ANCHOR_ABI of the copy that made it
  uint32_t size;        // sizeof(struct memlab_anchor) in that ABI
  const char* made_by;  // "memlab-tch <version>" of that copy
  // ABI 1:
  void* table;      // memlab-core's table of process-wide values; set (atomically) by the Rust side
  void* shim;       // the shim's process-wide state (its layout is part of the ABI)
  uint32_t copies;  // copies of memlab that joined, the maker included (atomic)
  uint32_t reserved;
};

// This copy's anchor: the process's, or its own when it found one of another
// ABI (or could not register one). Never NULL.
struct memlab_anchor* memlab_process_anchor(void);
// The anchor of another ABI that this copy found when it loaded (NULL when
// none): only its `abi`, `size` and `made_by` may be read.
const struct memlab_anchor* memlab_foreign_anchor(void);
// Why this copy could not look for or register the anchor when it loaded
// (a malloc'd message, freed with memlab_free_error), or NULL when it could.
char* memlab_anchor_error(void);

char* memlab_cpu_install(void);
int32_t memlab_cpu_installed(void);
int32_t memlab_cpu_installed_at_load(void);
// Write the CPU's slots only; the caller zero-initialises the record once.
char* memlab_cpu_stats(int32_t reset_peaks, int64_t* out);
char* memlab_cpu_take_accumulated_stats(int64_t* out);
void memlab_set_cpu_event_hook(memlab_event_hook hook);

// An op whose CUDA kernel allocates otherwise than its CPU kernel, as a
// RecordFunction callback sees it begin: a sum or mean (whose CUDA kernel may
// stage through a buffer) or a convolution, forward or backward (cuDNN's
// workspaces on CUDA, oneDNN's scratch on the CPU). Shapes and strides in
// elements, `ndim` entries each; stride, padding and dilation `ndim - 2`
// entries.
#define MEMLAB_OP_MAX_DIMS 8
#define MEMLAB_OP_MAX_TENSORS 4
#define MEMLAB_OP_MAX_SCALARS 8
enum memlab_op_kind {
  MEMLAB_OP_REDUCTION = 1,
  MEMLAB_OP_CONVOLUTION = 2,
  MEMLAB_OP_CONVOLUTION_BACKWARD = 3,
  // A cuBLAS call on CUDA (mm, addmm, bmm, baddbmm, addmv, mv, dot): the
  // first on a thread makes that thread's cuBLAS workspace.
  MEMLAB_OP_MATMUL = 4,
  // aten::_softmax_backward_data: on CUDA its kernel first multiplies the
  // gradient by the output into a temporary. `input`: the gradient's shape.
  MEMLAB_OP_SOFTMAX_BACKWARD = 5,
  // aten::embedding_dense_backward: on CUDA its kernel sorts the indices
  // and sums the gradient's rows per partial segment, in temporaries its
  // CPU kernel does not make. `input`: the gradient's shape; `indices`,
  // `index_element_size`, `num_weights` and `flags` as below.
  MEMLAB_OP_EMBEDDING_BACKWARD = 6,
  // Any other aten op: its name and tensor arguments only (below). Whether
  // its CUDA kernel allocates as its CPU kernel does is memlab's table's
  // question (memlab_core::ops::table).
  MEMLAB_OP_OTHER = 7,
  // Not an aten op: one of autograd's backward nodes running (its name, such
  // as "CudnnRnnBackward0", and its sequence number; no tensors). The aten
  // ops it runs are reported inside it.
  MEMLAB_OP_BACKWARD_NODE = 8,
};
// Bits of `memlab_op.flags` for an embedding backward.
#define MEMLAB_EMBEDDING_SCALE_GRAD_BY_FREQ 1
#define MEMLAB_EMBEDDING_INDICES_CONTIGUOUS 2
#define MEMLAB_EMBEDDING_GRAD_CONTIGUOUS 4
typedef struct memlab_op {
  uint64_t id;
  int32_t kind;
  int32_t ndim;
  int32_t element_size;
  // Convolutions: 1 where transposed.
  int32_t transposed;
  // Backward: bit i of its output mask (grad input, weight, bias); forward:
  // 4 where it has a bias.
  int32_t output_mask;
  // 1 where the op runs inside a backward function (autograd's thread on CUDA).
  int32_t in_backward;
  int64_t groups;
  // Reductions: bit d where dimension d is reduced.
  uint64_t reduced;
  int64_t input[MEMLAB_OP_MAX_DIMS];
  int64_t input_strides[MEMLAB_OP_MAX_DIMS];
  int64_t weight[MEMLAB_OP_MAX_DIMS];
  // Backward: the gradient of the output.
  int64_t output[MEMLAB_OP_MAX_DIMS];
  int64_t stride[MEMLAB_OP_MAX_DIMS];
  int64_t padding[MEMLAB_OP_MAX_DIMS];
  int64_t dilation[MEMLAB_OP_MAX_DIMS];
  // Embedding backward: how many indices, their element size, the table's
  // rows, and MEMLAB_EMBEDDING_* bits.
  int64_t indices;
  int64_t num_weights;
  int32_t index_element_size;
  int32_t flags;
  // Every op: its name after "aten::" (NUL-terminated, cut to 63 bytes) and
  // its tensor arguments, lists of tensors included: how many, their bytes
  // in all, and the first MEMLAB_OP_MAX_TENSORS with their element types
  // (c10::ScalarType) and shapes (ndim -1: more than MEMLAB_OP_MAX_DIMS
  // dimensions, shape not given; -2: an undefined tensor).
  char name[64];
  int32_t tensors;
  int32_t tensor_ndim[MEMLAB_OP_MAX_TENSORS];
  int32_t tensor_dtype[MEMLAB_OP_MAX_TENSORS];
  int64_t tensor_shape[MEMLAB_OP_MAX_TENSORS][MEMLAB_OP_MAX_DIMS];
  uint64_t tensor_bytes;
  // Autograd's sequence number: for an aten op, its thread's next one when
  // it began (the number of the first backward node it, or an op it calls,
  // makes); for a backward node, its own (-1 where it has none, as
  // AccumulateGrad). What links a forward op to the backward pass of it.
  int64_t sequence_nr;
  // The op's bool, int and float arguments, in order (bools as 0 and 1):
  // how many, and the first MEMLAB_OP_MAX_SCALARS of them.
  int32_t scalars;
  int32_t unused;
  double scalar[MEMLAB_OP_MAX_SCALARS];
} memlab_op;
#ifdef __cplusplus
static_assert(sizeof(memlab_op) == 968, "memlab_op's layout is memlab-tch's ffi::Op's");
static_assert(offsetof(memlab_op, name) == 520 && offsetof(memlab_op, tensor_shape) == 624 &&
                  offsetof(memlab_op, scalar) == 904,
              "memlab_op's layout is memlab-tch's ffi::Op's");
#endif

// Called on the op's thread when a watched op begins (`op`, with its `id`)
// and when it ends (`op` NULL, the same `id`); it must not throw. At an
// aten op's end, `sequence_end` is the thread's next autograd sequence
// number (the numbers from the op's `sequence_nr` up to it went to the
// backward nodes the op and the ops it called made); -1 otherwise.
typedef void (*memlab_op_hook)(const memlab_op* op, uint64_t id, int64_t sequence_end);

// Reports every aten op to `hook` from now on, on every thread, through a
// libtorch RecordFunction callback (NULL: stops): the kinds above with their
// details where their tensors have at most MEMLAB_OP_MAX_DIMS dimensions,
// every other one (or one whose details cannot be read) as
// MEMLAB_OP_OTHER.
char* memlab_watch_ops(memlab_op_hook hook);
// Runs the calling thread's ops under CPU autocast to `dtype` (a
// c10::ScalarType code), standing for CUDA's autocast on a CPU run: while
// ops are watched, each backward function the thread runs goes without it
// and the cast weights are given back at the first, as CUDA's autocast ends
// with the forward pass. `was_enabled` and `was_dtype` receive the thread's
// state before, which memlab_cpu_autocast_end restores (and gives the cast
// weights back). Not nested.
char* memlab_cpu_autocast_begin(int32_t dtype, int32_t* was_enabled, int32_t* was_dtype);
char* memlab_cpu_autocast_end(int32_t was_enabled, int32_t was_dtype);

// The calling thread's CUDA autocast: whether it is on and how deeply its
// regions nest; and that state put back after a panic inside tch::autocast
// (which does not unwind), the cache of cast weights given back where no
// region stays open. `*left` says whether the state had been left changed.
char* memlab_cuda_autocast_state(int32_t* enabled, int32_t* nesting);
char* memlab_cuda_autocast_restore(int32_t enabled, int32_t nesting, int32_t* left);
// Counts a CPU allocation (MEMLAB_ACTION_ALLOC) or free
// (MEMLAB_ACTION_FREE_REQUESTED) of `size` bytes. While a CPU event hook is
// set, the counting allocator leaves its counting to the hook, which calls
// this under the lock it records the event with: the figures then agree with
// the recorded events whenever that lock is held.
void memlab_cpu_count(int32_t action, uint64_t size);

char* memlab_tensor_storage(const void* tensor, struct memlab_storage_info* out);
char* memlab_tensor_facts(const void* tensor, struct memlab_tensor_facts* out, struct memlab_tensor_facts* grad);

// The TensorImpl address of a tensor (what optimizer states are keyed by).
char* memlab_tensor_impl(const void* tensor, uint64_t* out);

// The class of `optimizer`, a torch::optim::Optimizer* that tch built
// (MEMLAB_OPTIMIZER_NONE when it is none of the four).
char* memlab_optimizer_kind(const void* optimizer, int32_t* kind);
// Every parameter of `optimizer` with each defined tensor of its state, group
// by group: the first `capacity` entries go to `out`, and `count` says how
// many there are (call again with more room when it exceeds `capacity`; the
// handles of the entries written are the caller's either way).
char* memlab_optimizer_states(const void* optimizer, struct memlab_optimizer_state* out, int64_t capacity,
                              int64_t* count);
// How many parameters `optimizer` keeps state for (one number, no tensor
// touched): a registration reads the state again only when it changes.
char* memlab_optimizer_state_count(const void* optimizer, int64_t* count);

char* memlab_weak_tensor_new(const void* tensor, void** out);
void* memlab_weak_tensor_lock(void* weak);
int32_t memlab_weak_tensor_expired(void* weak);
void memlab_weak_tensor_free(void* weak);
// Weak references to the gradients of `n` tensors, in one call: `out[i]` is
// NULL where tensor `i` has no gradient (only leaves, and tensors that
// retain theirs, have one). The caller frees each with memlab_weak_tensor_free.
char* memlab_weak_gradients(const void* const* tensors, int64_t n, void** out);

#ifdef __cplusplus
}  // extern "C"

// The layout ffi.rs assumes; it asserts the same numbers. (`struct` names the
// type: the entry point memlab_tensor_facts hides it otherwise.)
static_assert(sizeof(memlab_storage_info) == 64, "memlab_storage_info layout");
static_assert(offsetof(memlab_storage_info, device_type) == 40, "memlab_storage_info layout");
static_assert(offsetof(memlab_storage_info, from_allocator) == 56, "memlab_storage_info layout");
static_assert(sizeof(struct memlab_tensor_facts) == 200, "memlab_tensor_facts layout");
static_assert(offsetof(struct memlab_tensor_facts, dims) == 72, "memlab_tensor_facts layout");
static_assert(sizeof(struct memlab_optimizer_state) == 24, "memlab_optimizer_state layout");
static_assert(sizeof(struct memlab_segment) == 64, "memlab_segment layout");
static_assert(offsetof(struct memlab_segment, device) == 48, "memlab_segment layout");
static_assert(sizeof(struct memlab_block) == 32, "memlab_block layout");
static_assert(offsetof(struct memlab_block, state) == 24, "memlab_block layout");
static_assert(offsetof(struct memlab_optimizer_state, group) == 16, "memlab_optimizer_state layout");
static_assert(sizeof(struct memlab_anchor) == 40, "memlab_anchor layout");
static_assert(offsetof(struct memlab_anchor, table) == 16, "memlab_anchor layout");
static_assert(offsetof(struct memlab_anchor, copies) == 32, "memlab_anchor layout");

namespace memlab {

// A malloc'd copy of `message`, for the Rust side to free with memlab_free_error.
char* error_copy(const char* message);

}  // namespace memlab

// Wrap the body of every `char*` entry point: on success it returns NULL,
// and every exception becomes a returned error message.
#define MEMLAB_TRY try {
#define MEMLAB_CATCH                                       \
  }                                                        \
  catch (const c10::Error& e) {                            \
    return memlab::error_copy(e.what_without_backtrace()); \
  }                                                        \
  catch (const std::exception& e) {                        \
    return memlab::error_copy(e.what());                   \
  }                                                        \
  catch (...) {                                            \
    return memlab::error_copy("unknown C++ exception");    \
  }                                                        \
  return nullptr;
#endif
