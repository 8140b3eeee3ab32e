//! Storage facts of a `tch::Tensor`: which storage it views, how many bytes
//! that storage holds, where, and in what layout. Views share a storage, so
//! two tensors with the same `storage_id` occupy the memory only once.

use memlab_core::{DType, Device, Error, Result};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::ffi;

/// How a tensor lays out its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageLayout {
    /// Dense, with strides.
    Strided,
    /// Sparse COO: the memory is that of its indices and values tensors.
    SparseCoo,
    /// Compressed sparse (CSR, CSC, BSR, BSC).
    SparseCompressed,
    /// Any other layout (e.g. MKL-DNN).
    Other,
}

/// What memlab knows about the memory behind a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct StorageInfo {
    /// Identity of the storage (its address); `None` for tensors without one (sparse).
    pub storage_id: Option<u64>,
    /// Address of the storage's data.
    pub data_ptr: u64,
    /// Bytes the storage holds: the memory the tensor keeps alive, whatever its shape.
    pub nbytes: u64,
    /// Elements the tensor views.
    pub numel: u64,
    /// Bytes per element.
    pub element_size: u64,
    /// Where the storage lives; `None` for devices memlab does not measure (e.g. `meta`).
    pub device: Option<Device>,
    /// The tensor's layout.
    pub layout: StorageLayout,
    /// Whether the storage's memory came from the allocator memlab reads
    /// (the counting CPU allocator, the CUDA caching allocator). `false` for
    /// memory libtorch was handed (`Tensor::from_blob`) or CPU tensors made
    /// before memlab's allocator was installed: the allocator's figures do
    /// not include them.
    pub from_allocator: bool,
}

/// Storage facts of `tensor`.
pub fn storage_info(tensor: &tch::Tensor) -> Result<StorageInfo> {
    let mut raw = ffi::StorageInfo::default();
    // SAFETY: `as_ptr` is tch's pointer to the C++ at::Tensor, valid while
    // `tensor` is borrowed; the shim only reads it.
    ffi::check(unsafe { ffi::memlab_tensor_storage(tensor.as_ptr().cast(), &mut raw) })?;
    from_raw(&raw)
}

fn from_raw(raw: &ffi::StorageInfo) -> Result<StorageInfo> {
    let device = match raw.device_type {
        ffi::DEVICE_CPU => Some(Device::Cpu),
        ffi::DEVICE_CUDA => Some(Device::Cuda(raw.device_index.max(0) as usize)),
        _ => None,
    };
    let layout = match raw.layout {
        ffi::LAYOUT_STRIDED => StorageLayout::Strided,
        ffi::LAYOUT_SPARSE_COO => StorageLayout::SparseCoo,
        ffi::LAYOUT_SPARSE_COMPRESSED => StorageLayout::SparseCompressed,
        _ => StorageLayout::Other,
    };
    let count = |v: i64| u64::try_from(v).map_err(|_| Error::Backend(format!("negative size {v} reported")));
    Ok(StorageInfo {
        storage_id: (raw.has_storage == ffi::HAS_STORAGE).then_some(raw.storage_id),
        data_ptr: raw.data_ptr,
        nbytes: count(raw.nbytes)?,
        numel: count(raw.numel)?,
        element_size: count(raw.element_size)?,
        device,
        layout,
        from_allocator: raw.from_allocator != 0 || raw.has_storage != ffi::HAS_STORAGE,
    })
}

memlab_core::process::process_wide! {
    /// Gradient reads: every time memlab asked libtorch for a tensor's gradient.
    static GRADIENT_READS: AtomicU64 = AtomicU64::new(0);
}

/// Counts one gradient read (see [`gradient_reads`]).
pub(crate) fn count_gradient_read() {
    count_gradient_reads(1);
}

/// Counts `n` gradient reads.
pub(crate) fn count_gradient_reads(n: u64) {
    GRADIENT_READS.fetch_add(n, Ordering::Relaxed);
}

/// How many times memlab asked libtorch for a gradient since the process
/// started: tests check that an out-of-memory handler never does (reading a
/// gradient races with a backward pass on another thread). Not public API.
#[doc(hidden)]
pub fn gradient_reads() -> u64 {
    GRADIENT_READS.load(Ordering::Relaxed)
}

/// The storages of `tensor` and of its gradient, if it has one, in one call
/// into libtorch (what [`facts`] gives, without element types and shapes).
/// Reading the gradient races with a backward pass that runs on another
/// thread at the same time, as tch's own `grad()` does.
pub fn storages(tensor: &tch::Tensor) -> Result<(StorageInfo, Option<StorageInfo>)> {
    count_gradient_read();
    let (mut main, mut grad) = (ffi::TensorFacts::default(), ffi::TensorFacts::default());
    // SAFETY: `as_ptr` is tch's live at::Tensor; the shim fills both records.
    ffi::check(unsafe { ffi::memlab_tensor_facts(tensor.as_ptr().cast(), &mut main, &mut grad) })?;
    let grad = if grad.storage.has_storage != ffi::NO_GRADIENT { Some(from_raw(&grad.storage)?) } else { None };
    Ok((from_raw(&main.storage)?, grad))
}

/// Storage, element type and shape of one tensor.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The storage.
    pub info: StorageInfo,
    /// The element type.
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<i64>,
}

/// The facts of `tensor` and, with `with_grad`, of its gradient if it has
/// one, in one call into libtorch (reading the gradient races with a
/// backward pass on another thread, see [`storages`]).
pub fn facts(tensor: &tch::Tensor, with_grad: bool) -> Result<(Facts, Option<Facts>)> {
    if with_grad {
        count_gradient_read();
    }
    let (mut main, mut grad) = (ffi::TensorFacts::default(), ffi::TensorFacts::default());
    let grad_out: *mut ffi::TensorFacts = if with_grad { &mut grad } else { std::ptr::null_mut() };
    // SAFETY: `as_ptr` is tch's live at::Tensor; the shim fills both records.
    ffi::check(unsafe { ffi::memlab_tensor_facts(tensor.as_ptr().cast(), &mut main, grad_out) })?;
    let convert = |raw: &ffi::TensorFacts, shape_of: &dyn Fn() -> Vec<i64>| -> Result<Facts> {
        let ndim = raw.ndim.max(0) as usize;
        let shape = if ndim <= ffi::MAX_DIMS { raw.dims[..ndim].to_vec() } else { shape_of() };
        Ok(Facts { info: from_raw(&raw.storage)?, dtype: DType::from_code(raw.dtype), shape })
    };
    let main = convert(&main, &|| tensor.size())?;
    let grad = if with_grad && grad.storage.has_storage != ffi::NO_GRADIENT {
        Some(convert(&grad, &|| tensor.grad().size())?)
    } else {
        None
    };
    Ok((main, grad))
}

/// The element type of tch's `kind`, as memlab's reports name it (by
/// name: tch keeps `Kind`'s libtorch code to itself, and its variants
/// differ between tch releases).
pub fn dtype(kind: tch::Kind) -> DType {
    let name = format!("{kind:?}");
    DType::NAMED.into_iter().find(|d| d.as_str() == name).unwrap_or(DType::Other)
}
