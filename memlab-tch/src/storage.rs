//! Storage facts of a `tch::Tensor`: which storage it views, how many bytes
//! that storage holds, where, and in what layout. Views share a storage, so
//! two tensors with the same `storage_id` occupy the memory only once.

use memlab_core::{Device, Error, Result};

use crate::ffi;

/// How a tensor lays out its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
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
    pub layout: Layout,
}

/// Storage facts of `tensor`.
pub fn storage_info(tensor: &tch::Tensor) -> Result<StorageInfo> {
    let mut raw = ffi::StorageInfo::default();
    // SAFETY: `as_ptr` is tch's pointer to the C++ at::Tensor, valid while
    // `tensor` is borrowed; the shim only reads it.
    ffi::check(unsafe { ffi::memlab_tensor_storage(tensor.as_ptr().cast(), &mut raw) })?;
    let device = match raw.device_type {
        0 => Some(Device::Cpu),
        1 => Some(Device::Cuda(raw.device_index.max(0) as usize)),
        _ => None,
    };
    let layout = match raw.layout {
        0 => Layout::Strided,
        1 => Layout::SparseCoo,
        2 => Layout::SparseCompressed,
        _ => Layout::Other,
    };
    let count = |v: i64| u64::try_from(v).map_err(|_| Error::Torch(format!("negative size {v} reported")));
    Ok(StorageInfo {
        storage_id: (raw.has_storage != 0).then_some(raw.storage_id),
        data_ptr: raw.data_ptr,
        nbytes: count(raw.nbytes)?,
        numel: count(raw.numel)?,
        element_size: count(raw.element_size)?,
        device,
        layout,
    })
}
