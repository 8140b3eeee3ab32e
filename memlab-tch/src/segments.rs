//! The CUDA caching allocator's segments and blocks, from its own snapshot:
//! what a PyTorch memory snapshot lists under `segments`.

use memlab_core::Result;

use crate::ffi;

/// What a block holds: the snapshot model's vocabulary, one for every crate.
pub use memlab_core::export::BlockState;

/// A piece of a segment.
#[derive(Clone, Debug)]
pub struct CudaBlock {
    /// Its address.
    pub address: u64,
    /// Its size (a multiple of 512 bytes).
    pub size: u64,
    /// What the tensor asked for (0 when free).
    pub requested_size: u64,
    /// What it holds.
    pub state: BlockState,
}

/// One `cudaMalloc` of the caching allocator.
#[derive(Clone, Debug)]
pub struct CudaSegment {
    /// The CUDA device.
    pub device: usize,
    /// Its address.
    pub address: u64,
    /// Its size.
    pub total_size: u64,
    /// Bytes asked for by the tensors in it.
    pub requested_size: u64,
    /// Bytes of its allocated blocks.
    pub allocated_size: u64,
    /// Bytes of its allocated blocks and those waiting for a stream.
    pub active_size: u64,
    /// The stream it serves.
    pub stream: u64,
    /// Whether it belongs to the large pool (blocks over 1 MiB).
    pub is_large: bool,
    /// Whether it is an expandable segment.
    pub is_expandable: bool,
    /// Its blocks, by address.
    pub blocks: Vec<CudaBlock>,
}

/// Every segment of the caching allocator on every device (none when CUDA
/// was never used).
pub fn cuda_segments() -> Result<Vec<CudaSegment>> {
    let mut segments: Vec<ffi::Segment> = Vec::new();
    let mut blocks: Vec<ffi::Block> = Vec::new();
    loop {
        let (mut n_segments, mut n_blocks) = (0i64, 0i64);
        // SAFETY: both vectors have room for their capacities; the shim
        // writes at most that many records and the counts.
        crate::ffi::check(unsafe {
            ffi::memlab_cuda_snapshot(
                segments.as_mut_ptr(),
                segments.capacity() as i64,
                &mut n_segments,
                blocks.as_mut_ptr(),
                blocks.capacity() as i64,
                &mut n_blocks,
            )
        })?;
        let (n_segments, n_blocks) = (n_segments.max(0) as usize, n_blocks.max(0) as usize);
        if n_segments <= segments.capacity() && n_blocks <= blocks.capacity() {
            // SAFETY: the shim initialised that many records of each.
            unsafe {
                segments.set_len(n_segments);
                blocks.set_len(n_blocks);
            }
            break;
        }
        // The allocator grew in between, or the first call only counted: ask
        // again with room to spare.
        segments.reserve_exact(n_segments + 16);
        blocks.reserve_exact(n_blocks + 64);
    }
    let mut rest = blocks.as_slice();
    let mut out = Vec::with_capacity(segments.len());
    for s in &segments {
        let (mine, others) = rest.split_at((s.blocks.max(0) as usize).min(rest.len()));
        rest = others;
        out.push(CudaSegment {
            device: s.device.max(0) as usize,
            address: s.address,
            total_size: s.total_size,
            requested_size: s.requested_size,
            allocated_size: s.allocated_size,
            active_size: s.active_size,
            stream: s.stream,
            is_large: s.is_large != 0,
            is_expandable: s.is_expandable != 0,
            blocks: mine
                .iter()
                .map(|b| CudaBlock {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested_size,
                    state: match b.state {
                        ffi::BLOCK_ACTIVE_ALLOCATED => BlockState::ActiveAllocated,
                        ffi::BLOCK_ACTIVE_PENDING_FREE => BlockState::ActivePendingFree,
                        ffi::BLOCK_INACTIVE => BlockState::Inactive,
                        // A state this memlab does not know: counted as free,
                        // as libtorch's own snapshot would if it were neither.
                        _ => BlockState::Inactive,
                    },
                })
                .collect(),
        });
    }
    Ok(out)
}

/// Which BLAS library a workspace serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkspaceKind {
    /// cuBLAS (`at::cuda::cublas_handle_stream_to_workspace()`).
    Cublas,
    /// cuBLASLt (`at::cuda::cublaslt_handle_stream_to_workspace()`).
    CublasLt,
}

impl WorkspaceKind {
    /// `cuBLAS`, `cuBLASLt`.
    pub fn name(self) -> &'static str {
        match self {
            WorkspaceKind::Cublas => "cuBLAS",
            WorkspaceKind::CublasLt => "cuBLASLt",
        }
    }
}

/// A workspace libtorch keeps for a BLAS library on one (handle, stream)
/// pair: a block of the caching allocator, kept as long as the handle.
/// libtorch makes one the first time a thread runs a matrix product on a
/// stream (the forward pass's thread and autograd's each have theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlasWorkspace {
    /// The library.
    pub kind: WorkspaceKind,
    /// The CUDA device.
    pub device: usize,
    /// The workspace's address: a block of the caching allocator.
    pub address: u64,
    /// The library's handle.
    pub handle: u64,
    /// The stream.
    pub stream: u64,
}

/// The BLAS workspaces libtorch holds now, read from its own tables (none
/// before the first matrix product on CUDA, or in a build without the CUDA
/// headers). Their sizes are the allocator's: match [`BlasWorkspace::address`]
/// with the blocks of [`cuda_segments`].
pub fn blas_workspaces() -> Result<Vec<BlasWorkspace>> {
    let mut out: Vec<ffi::Workspace> = Vec::new();
    loop {
        let mut count = 0i64;
        // SAFETY: `out` has room for its capacity; the shim writes at most
        // that many records and the count.
        crate::ffi::check(unsafe {
            ffi::memlab_cuda_blas_workspaces(out.as_mut_ptr(), out.capacity() as i64, &mut count)
        })?;
        let count = count.max(0) as usize;
        if count <= out.capacity() {
            // SAFETY: the shim initialised that many records.
            unsafe { out.set_len(count) };
            break;
        }
        out.reserve_exact(count + 4);
    }
    Ok(out
        .iter()
        .map(|w| BlasWorkspace {
            kind: match w.kind {
                ffi::WORKSPACE_CUBLAS => WorkspaceKind::Cublas,
                ffi::WORKSPACE_CUBLASLT => WorkspaceKind::CublasLt,
                // A kind this memlab does not know: libtorch lists only these two.
                _ => WorkspaceKind::Cublas,
            },
            device: w.device.max(0) as usize,
            address: w.address,
            handle: w.handle,
            stream: w.stream,
        })
        .collect())
}
