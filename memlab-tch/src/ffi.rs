//! The Rust mirror of `cpp/memlab_shim.h`, the contract with the C++ shim:
//! every constant, struct and entry point, by the header's names. The layouts
//! are checked at compile time on both sides (sizes and offsets here, the
//! same numbers in the header's `static_assert`s), and the stat slots against
//! memlab-core's field table. Functions returning `*mut c_char` return null
//! on success or an error message to be freed with `memlab_free_error`.

use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of};

use memlab_core::stats::{array_index, FIELD_TABLE, N_FIELDS};

// `enum memlab_action` is memlab_core::events::Action, code for code: the
// build reads the header and checks each of its actions here.
include!(concat!(env!("OUT_DIR"), "/action_checks.rs"));

// What memlab reads of tch's private layout, beside the header it mirrors.
// `tch::nn::Optimizer` keeps libtorch's `torch::optim::Optimizer*` in a
// private field: it is three words, in an order memlab does not assume (the
// C++ object, the `Arc` of its var store's variables, the count of variables
// it has taken in; see `optimizer::classify`). Checked for these tch
// releases, whose `src/nn/optimizer.rs` is the same; the optimizer tests
// run on each (scripts/test-versions.sh). Any other release is refused with
// its name, never guessed at.

/// Words of `tch::nn::Optimizer`.
pub const TCH_OPTIMIZER_WORDS: usize = 3;
/// The tch releases whose `Optimizer` layout memlab was checked for.
pub const TCH_LAYOUT_CHECKED: [&str; 2] = ["0.24", "0.26"];

/// `MEMLAB_EVENT_DEVICE_CPU`: an event's device when it is the CPU.
pub const EVENT_DEVICE_CPU: i32 = -1;

/// `enum memlab_device_type`.
pub const DEVICE_CPU: i32 = 0;
pub const DEVICE_CUDA: i32 = 1;

/// `enum memlab_layout`.
pub const LAYOUT_STRIDED: i32 = 0;
pub const LAYOUT_SPARSE_COO: i32 = 1;
pub const LAYOUT_SPARSE_COMPRESSED: i32 = 2;

/// `enum memlab_stat_array` (the ones Rust names).
pub const STAT_ALLOCATION: usize = 0;
pub const STAT_SEGMENT: usize = 1;
pub const STAT_ACTIVE: usize = 2;
pub const STAT_ALLOCATED_BYTES: usize = 4;
pub const STAT_RESERVED_BYTES: usize = 5;
pub const STAT_ACTIVE_BYTES: usize = 6;
pub const STAT_REQUESTED_BYTES: usize = 8;

/// `enum memlab_stat_counter`.
pub const COUNTER_CURRENT: usize = 0;
pub const COUNTER_PEAK: usize = 1;
pub const COUNTER_ALLOCATED: usize = 2;
pub const COUNTER_FREED: usize = 3;

/// `enum memlab_storage_presence` (Rust tells "no gradient" and "has a storage" apart from the rest).
pub const NO_GRADIENT: i32 = -1;
pub const HAS_STORAGE: i32 = 1;

/// `enum memlab_stat_slot` (the ones Rust names).
pub const SLOT_NUM_ALLOC_RETRIES: usize = 108;
pub const SLOT_NUM_OOMS: usize = 109;
pub const SLOT_OVERSIZE_ALLOCATIONS: usize = 110;
pub const SLOT_OVERSIZE_SEGMENTS: usize = 114;
pub const SLOT_NUM_SYNC_ALL_STREAMS: usize = 118;
pub const SLOT_NUM_DEVICE_ALLOC: usize = 119;
pub const SLOT_NUM_DEVICE_FREE: usize = 120;
pub const SLOT_MAX_SPLIT_SIZE: usize = 121;
pub const STAT_FIELDS: usize = 122;

/// `struct memlab_storage_info`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct StorageInfo {
    pub storage_id: u64,
    pub data_ptr: u64,
    pub nbytes: i64,
    pub numel: i64,
    pub element_size: i64,
    pub device_type: i32,
    pub device_index: i32,
    pub layout: i32,
    pub has_storage: i32,
    pub from_allocator: i32,
    pub reserved: i32,
}

/// `memlab_event_hook`: action, device, address, size.
pub type EventHook = extern "C" fn(action: i32, device: i32, address: u64, size: u64, stream: u64);

/// `MEMLAB_OP_MAX_DIMS`: the most dimensions a watched op's tensors have.
pub const OP_MAX_DIMS: usize = 8;

/// `memlab_op`: an op a RecordFunction callback saw begin.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub id: u64,
    pub kind: i32,
    pub ndim: i32,
    pub element_size: i32,
    pub transposed: i32,
    pub output_mask: i32,
    pub in_backward: i32,
    pub groups: i64,
    pub reduced: u64,
    pub input: [i64; OP_MAX_DIMS],
    pub input_strides: [i64; OP_MAX_DIMS],
    pub weight: [i64; OP_MAX_DIMS],
    pub output: [i64; OP_MAX_DIMS],
    pub stride: [i64; OP_MAX_DIMS],
    pub padding: [i64; OP_MAX_DIMS],
    pub dilation: [i64; OP_MAX_DIMS],
    pub indices: i64,
    pub num_weights: i64,
    pub index_element_size: i32,
    pub flags: i32,
    pub name: [std::ffi::c_char; 64],
    pub tensors: i32,
    pub tensor_ndim: [i32; OP_MAX_TENSORS],
    pub tensor_dtype: [i32; OP_MAX_TENSORS],
    pub tensor_shape: [[i64; OP_MAX_DIMS]; OP_MAX_TENSORS],
    pub tensor_bytes: u64,
    pub sequence_nr: i64,
    pub scalars: i32,
    pub unused: i32,
    pub scalar: [f64; OP_MAX_SCALARS],
}

// The shim's memlab_op, field for field (memlab_shim.h asserts the same).
const _: () = assert!(size_of::<Op>() == 968);
const _: () = assert!(
    std::mem::offset_of!(Op, name) == 520
        && std::mem::offset_of!(Op, tensor_shape) == 624
        && std::mem::offset_of!(Op, scalar) == 904
);

/// `MEMLAB_OP_REDUCTION`, `MEMLAB_OP_CONVOLUTION`, `MEMLAB_OP_CONVOLUTION_BACKWARD`.
pub const OP_REDUCTION: i32 = 1;
pub const OP_CONVOLUTION: i32 = 2;
pub const OP_CONVOLUTION_BACKWARD: i32 = 3;
pub const OP_MATMUL: i32 = 4;
pub const OP_SOFTMAX_BACKWARD: i32 = 5;
pub const OP_EMBEDDING_BACKWARD: i32 = 6;
/// `MEMLAB_OP_OTHER`: any other aten op, its name and tensors only.
pub const OP_OTHER: i32 = 7;
/// `MEMLAB_OP_BACKWARD_NODE`: one of autograd's backward nodes, its name
/// and sequence number only.
pub const OP_BACKWARD_NODE: i32 = 8;
/// `MEMLAB_OP_MAX_TENSORS`: the tensor arguments an op's record details.
pub const OP_MAX_TENSORS: usize = 4;
/// `MEMLAB_OP_MAX_SCALARS`: the bool, int and float arguments it keeps.
pub const OP_MAX_SCALARS: usize = 8;
/// `MEMLAB_EMBEDDING_*`: bits of an embedding backward's `flags`.
pub const EMBEDDING_SCALE_GRAD_BY_FREQ: i32 = 1;
pub const EMBEDDING_INDICES_CONTIGUOUS: i32 = 2;
pub const EMBEDDING_GRAD_CONTIGUOUS: i32 = 4;

/// `memlab_op_hook`: an op begins (`op` set) or ends (`op` null, with the
/// thread's next autograd sequence number where it is an aten op), by id.
pub type OpHook = extern "C" fn(op: *const Op, id: u64, sequence_end: i64);

/// `MEMLAB_MAX_DIMS`: the most dimensions `TensorFacts` carries.
pub const MAX_DIMS: usize = 16;

/// `struct memlab_tensor_facts`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct TensorFacts {
    pub storage: StorageInfo,
    pub dtype: i32,
    pub ndim: i32,
    pub dims: [i64; MAX_DIMS],
}

// enum memlab_optimizer_kind
pub const OPTIMIZER_NONE: i32 = 0;
pub const OPTIMIZER_ADAM: i32 = 1;
pub const OPTIMIZER_ADAMW: i32 = 2;
pub const OPTIMIZER_SGD: i32 = 3;
pub const OPTIMIZER_RMSPROP: i32 = 4;

// enum memlab_optimizer_slot
pub const STATE_NONE: i32 = -1;
pub const STATE_EXP_AVG: i32 = 0;
pub const STATE_EXP_AVG_SQ: i32 = 1;
pub const STATE_MAX_EXP_AVG_SQ: i32 = 2;
pub const STATE_MOMENTUM_BUFFER: i32 = 3;
pub const STATE_SQUARE_AVG: i32 = 4;
pub const STATE_GRAD_AVG: i32 = 5;

/// struct memlab_optimizer_state
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OptimizerState {
    pub param: u64,
    pub tensor: *mut c_void,
    pub group: i32,
    pub slot: i32,
}

// enum memlab_block_state
pub const BLOCK_ACTIVE_ALLOCATED: i32 = 0;
pub const BLOCK_ACTIVE_PENDING_FREE: i32 = 1;
pub const BLOCK_INACTIVE: i32 = 2;

/// struct memlab_segment
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Segment {
    pub address: u64,
    pub total_size: u64,
    pub requested_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub stream: u64,
    pub device: i32,
    pub is_large: i32,
    pub is_expandable: i32,
    pub blocks: i32,
}

/// struct memlab_workspace
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Workspace {
    pub address: u64,
    pub handle: u64,
    pub stream: u64,
    pub device: i32,
    pub kind: i32,
}

/// enum memlab_workspace_kind
pub const WORKSPACE_CUBLAS: i32 = 0;
pub const WORKSPACE_CUBLASLT: i32 = 1;

/// struct memlab_block
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Block {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: i32,
    pub reserved: i32,
}

/// struct memlab_allocator_settings
#[repr(C)]
pub struct AllocatorSettings {
    pub conf: *mut c_char,
    pub garbage_collection_threshold: f64,
    pub max_split_size: u64,
    pub expandable_segments: i32,
    pub division_count: i32,
    pub roundup_power2_divisions: [u64; 64],
    pub memory_fraction: f64,
}

/// The anchor's version (MEMLAB_ANCHOR_ABI).
pub const MEMLAB_ANCHOR_ABI: u32 = 1;

/// struct memlab_anchor
#[repr(C)]
#[derive(Debug)]
pub struct MemlabAnchor {
    pub abi: u32,
    pub size: u32,
    pub made_by: *const c_char,
    pub table: *mut c_void,
    pub shim: *mut c_void,
    pub copies: u32,
    pub reserved: u32,
}

// The same numbers as the header's static_asserts.
const _: () = assert!(size_of::<MemlabAnchor>() == 40);
const _: () = assert!(offset_of!(MemlabAnchor, table) == 16);
const _: () = assert!(offset_of!(MemlabAnchor, copies) == 32);
const _: () = assert!(size_of::<StorageInfo>() == 64);
const _: () = assert!(offset_of!(StorageInfo, device_type) == 40);
const _: () = assert!(offset_of!(StorageInfo, from_allocator) == 56);
const _: () = assert!(size_of::<TensorFacts>() == 200);
const _: () = assert!(offset_of!(TensorFacts, dims) == 72);
const _: () = assert!(size_of::<OptimizerState>() == 24);
const _: () = assert!(size_of::<Segment>() == 64);
const _: () = assert!(offset_of!(Segment, device) == 48);
const _: () = assert!(size_of::<Block>() == 32);
const _: () = assert!(offset_of!(Block, state) == 24);
const _: () = assert!(offset_of!(OptimizerState, group) == 16);

/// Whether two strings are equal, at compile time.
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

// The shim's slots are memlab-core's fields of the same names.
const _: () = assert!(STAT_FIELDS == N_FIELDS);
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ALLOCATION, 0, 0)].name, "allocation.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_SEGMENT, 0, 0)].name, "segment.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ACTIVE, 0, 0)].name, "active.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ALLOCATED_BYTES, 0, 0)].name, "allocated_bytes.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_RESERVED_BYTES, 0, 0)].name, "reserved_bytes.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ACTIVE_BYTES, 0, 0)].name, "active_bytes.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_REQUESTED_BYTES, 0, 0)].name, "requested_bytes.all.current"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ACTIVE, 0, COUNTER_PEAK)].name, "active.all.peak"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ACTIVE, 0, COUNTER_ALLOCATED)].name, "active.all.allocated"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ACTIVE, 0, COUNTER_FREED)].name, "active.all.freed"));
const _: () = assert!(same(FIELD_TABLE[array_index(STAT_ACTIVE, 0, COUNTER_CURRENT)].name, "active.all.current"));
const _: () = assert!(same(FIELD_TABLE[SLOT_NUM_ALLOC_RETRIES].name, "num_alloc_retries"));
const _: () = assert!(same(FIELD_TABLE[SLOT_NUM_OOMS].name, "num_ooms"));
const _: () = assert!(same(FIELD_TABLE[SLOT_OVERSIZE_ALLOCATIONS].name, "oversize_allocations.current"));
const _: () = assert!(same(FIELD_TABLE[SLOT_OVERSIZE_SEGMENTS].name, "oversize_segments.current"));
const _: () = assert!(same(FIELD_TABLE[SLOT_NUM_SYNC_ALL_STREAMS].name, "num_sync_all_streams"));
const _: () = assert!(same(FIELD_TABLE[SLOT_NUM_DEVICE_ALLOC].name, "num_device_alloc"));
const _: () = assert!(same(FIELD_TABLE[SLOT_NUM_DEVICE_FREE].name, "num_device_free"));
const _: () = assert!(same(FIELD_TABLE[SLOT_MAX_SPLIT_SIZE].name, "max_split_size"));

extern "C" {
    pub fn memlab_free_error(error: *mut c_char);
    pub fn memlab_built_with_cuda() -> i32;
    pub fn memlab_cuda_events_built() -> i32;
    pub fn memlab_cuda_device_count(out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_current_device(out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_stats(device: i64, reset_peaks: i32, out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_take_accumulated_stats(device: i64, out: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_empty_cache() -> *mut c_char;
    pub fn memlab_cuda_mem_info(device: i64, free: *mut u64, total: *mut u64) -> *mut c_char;
    pub fn memlab_cuda_set_event_hook(hook: Option<EventHook>) -> *mut c_char;
    pub fn memlab_cuda_watch_ooms(attached: *mut i32) -> *mut c_char;
    pub fn memlab_cuda_allocator_initialized(out: *mut i32) -> *mut c_char;
    pub fn memlab_cuda_allocator_settings(
        device: i64,
        initialized: *mut i32,
        out: *mut AllocatorSettings,
    ) -> *mut c_char;
    pub fn memlab_cuda_blas_workspaces(out: *mut Workspace, capacity: i64, count: *mut i64) -> *mut c_char;
    pub fn memlab_cuda_snapshot(
        segments: *mut Segment,
        segment_capacity: i64,
        segment_count: *mut i64,
        blocks: *mut Block,
        block_capacity: i64,
        block_count: *mut i64,
    ) -> *mut c_char;
    pub fn memlab_process_anchor() -> *mut MemlabAnchor;
    pub fn memlab_foreign_anchor() -> *const MemlabAnchor;
    pub fn memlab_anchor_error() -> *mut c_char;
    pub fn memlab_cpu_install() -> *mut c_char;
    pub fn memlab_cpu_installed() -> i32;
    pub fn memlab_cpu_installed_at_load() -> i32;
    pub fn memlab_cpu_stats(reset_peaks: i32, out: *mut i64) -> *mut c_char;
    pub fn memlab_cpu_take_accumulated_stats(out: *mut i64) -> *mut c_char;
    pub fn memlab_set_cpu_event_hook(hook: Option<EventHook>);
    pub fn memlab_watch_ops(hook: Option<OpHook>) -> *mut c_char;
    pub fn memlab_cpu_autocast_begin(dtype: i32, was_enabled: *mut i32, was_dtype: *mut i32) -> *mut c_char;
    pub fn memlab_cpu_autocast_end(was_enabled: i32, was_dtype: i32) -> *mut c_char;
    pub fn memlab_cuda_autocast_state(enabled: *mut i32, nesting: *mut i32) -> *mut c_char;
    pub fn memlab_cuda_autocast_restore(enabled: i32, nesting: i32, left: *mut i32) -> *mut c_char;
    pub fn memlab_cpu_count(action: i32, size: u64);
    pub fn memlab_tensor_storage(tensor: *const c_void, out: *mut StorageInfo) -> *mut c_char;
    pub fn memlab_tensor_facts(tensor: *const c_void, out: *mut TensorFacts, grad: *mut TensorFacts) -> *mut c_char;
    pub fn memlab_tensor_impl(tensor: *const c_void, out: *mut u64) -> *mut c_char;
    pub fn memlab_optimizer_kind(optimizer: *const c_void, kind: *mut i32) -> *mut c_char;
    pub fn memlab_optimizer_states(
        optimizer: *const c_void,
        out: *mut OptimizerState,
        capacity: i64,
        count: *mut i64,
    ) -> *mut c_char;
    pub fn memlab_weak_tensor_new(tensor: *const c_void, out: *mut *mut c_void) -> *mut c_char;
    pub fn memlab_weak_tensor_lock(weak: *mut c_void) -> *mut c_void;
    pub fn memlab_weak_tensor_expired(weak: *mut c_void) -> i32;
    pub fn memlab_weak_tensor_free(weak: *mut c_void);
    pub fn memlab_weak_gradients(tensors: *const *const c_void, n: i64, out: *mut *mut c_void) -> *mut c_char;
    pub fn memlab_optimizer_state_count(optimizer: *const c_void, count: *mut i64) -> *mut c_char;
}

/// Turns a shim status into a `Result`, freeing the message.
pub fn check(status: *mut c_char) -> memlab_core::Result<()> {
    if status.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a NUL-terminated string malloc'd by the
    // shim, read once here and then handed back to it to free.
    let message = unsafe { std::ffi::CStr::from_ptr(status) }.to_string_lossy().into_owned();
    unsafe { memlab_free_error(status) };
    Err(memlab_core::Error::Backend(message))
}
