//! Every aten op libtorch runs, as the shim's RecordFunction callback
//! reports it while an [`OpWatch`] lives: its name and tensor arguments,
//! and for the ops whose CUDA kernels memlab models (sums, means,
//! convolutions, …: see [`memlab_core::ops`]) what their kernels size
//! their buffers by.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use memlab_core::ops::{Convolution, EmbeddingBackward, Op, OpRecord, Reduction, Scalar, TensorArg, TensorArgs};
use memlab_core::sync::LockExt;
use memlab_core::DType;
use memlab_core::Result;

use crate::ffi;

/// The most ops kept (about 300 bytes each); older ones go first.
const KEEP: usize = 1 << 18;

/// The watches alive, and what they saw.
struct Watched {
    watches: usize,
    ops: VecDeque<OpRecord>,
    /// How many ops were ever pushed, so that an index stays valid as old ones go.
    pushed: usize,
    /// Ops begun and not yet ended: their id, and their index in `pushed`'s count.
    open: HashMap<u64, usize>,
}

memlab_core::process::process_wide! {
    static WATCH: Mutex<Watched> =
        Mutex::new(Watched { watches: 0, ops: VecDeque::new(), pushed: 0, open: HashMap::new() });
}

/// Reports the ops libtorch runs, on every thread, while it lives. Each op
/// then costs a RecordFunction callback (its arguments boxed for it).
#[derive(Debug)]
#[must_use = "the ops are watched only while the watch lives"]
pub struct OpWatch(());

/// Starts watching every aten op.
pub fn watch_ops() -> Result<OpWatch> {
    let mut watch = WATCH.locked();
    if watch.watches == 0 {
        // SAFETY: registers a callback the shim calls with a valid op or null.
        ffi::check(unsafe { ffi::memlab_watch_ops(Some(on_op)) })?;
        watch.ops.clear();
        watch.open.clear();
    }
    watch.watches += 1;
    Ok(OpWatch(()))
}

impl OpWatch {
    /// The ops that began at or after `since_us` on the recorder's clock
    /// (`memlab_core::events::clock_us`), in the order they began.
    pub fn since(&self, since_us: u64) -> Vec<OpRecord> {
        WATCH.locked().ops.iter().filter(|r| r.start_us >= since_us).cloned().collect()
    }
}

/// What the live watches saw (`None` while none lives): what a snapshot of
/// a recording with [`Settings::ops`](memlab_core::events::Settings::ops)
/// carries.
pub fn watched() -> Option<Vec<OpRecord>> {
    let watch = WATCH.locked();
    (watch.watches > 0).then(|| watch.ops.iter().cloned().collect())
}

impl Drop for OpWatch {
    fn drop(&mut self) {
        let mut watch = WATCH.locked();
        watch.watches -= 1;
        if watch.watches == 0 {
            // SAFETY: removes the callback; no argument is read.
            let _ = ffi::check(unsafe { ffi::memlab_watch_ops(None) });
            watch.ops = VecDeque::new();
            watch.open = HashMap::new();
        }
    }
}

/// The calling thread's ops under CPU autocast, standing for CUDA's on a
/// CPU run, while it lives ([`cpu_autocast`]). It ends on the thread that
/// began it.
#[derive(Debug)]
#[must_use = "the thread runs under autocast only while the guard lives"]
pub struct CpuAutocast {
    was_enabled: i32,
    was_dtype: i32,
    _thread: std::marker::PhantomData<*const ()>,
}

/// Runs the calling thread's ops under CPU autocast to `dtype` (`Half` or
/// `BFloat16`) until the guard drops: matrix products, convolutions and
/// attention in `dtype`, the ops libtorch keeps in float32 (softmax, norms,
/// losses) in float32, weights cast once per step and the casts kept, as
/// CUDA's autocast does where a CPU run of `tch::autocast` does nothing.
/// While ops are watched ([`watch_ops`]), each backward function runs
/// without it and the cast weights are given back at the first, as CUDA's
/// autocast ends with the forward pass. Guards are not nested.
pub fn cpu_autocast(dtype: DType) -> Result<CpuAutocast> {
    if !matches!(dtype, DType::Half | DType::BFloat16) {
        return Err(memlab_core::Error::InvalidArgument(format!(
            "autocast to {dtype}: CUDA's autocast casts to Half (tch's) or BFloat16"
        )));
    }
    let code = DType::NAMED.iter().position(|&d| d == dtype).unwrap_or(0) as i32;
    let (mut was_enabled, mut was_dtype) = (0, 0);
    // SAFETY: two valid out-pointers; the shim catches every exception.
    ffi::check(unsafe { ffi::memlab_cpu_autocast_begin(code, &mut was_enabled, &mut was_dtype) })?;
    Ok(CpuAutocast { was_enabled, was_dtype, _thread: std::marker::PhantomData })
}

impl Drop for CpuAutocast {
    fn drop(&mut self) {
        // SAFETY: restores what memlab_cpu_autocast_begin read on this thread.
        let _ = ffi::check(unsafe { ffi::memlab_cpu_autocast_end(self.was_enabled, self.was_dtype) });
    }
}

/// The calling thread's CUDA autocast as a step found it, to put back after
/// the step panics: `tch::autocast` does not unwind, so a panic inside it
/// (a CUDA out-of-memory error) leaves autocast on for everything the
/// thread runs after, and the cast weights it cached alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaAutocast {
    enabled: i32,
    nesting: i32,
}

impl CudaAutocast {
    /// The calling thread's state now.
    pub fn now() -> Result<CudaAutocast> {
        let (mut enabled, mut nesting) = (0, 0);
        // SAFETY: two valid out-pointers; the shim catches every exception.
        ffi::check(unsafe { ffi::memlab_cuda_autocast_state(&mut enabled, &mut nesting) })?;
        Ok(CudaAutocast { enabled, nesting })
    }

    /// Whether autocast is on.
    pub fn enabled(&self) -> bool {
        self.enabled != 0
    }

    /// How many autocast regions are open.
    pub fn nesting(&self) -> i32 {
        self.nesting
    }

    /// Puts this state back on the calling thread: closes the regions a
    /// panic left open, giving the cache of cast weights back where none
    /// stays open, and sets autocast on or off as it was. Whether anything
    /// had been left changed.
    pub fn restore(&self) -> Result<bool> {
        let mut left = 0;
        // SAFETY: a valid out-pointer; the shim catches every exception.
        ffi::check(unsafe { ffi::memlab_cuda_autocast_restore(self.enabled, self.nesting, &mut left) })?;
        Ok(left != 0)
    }
}

/// The op the shim reported, as memlab-core's: its kind with its details,
/// else [`Op::Other`].
fn op_of(raw: &ffi::Op) -> Op {
    if raw.kind == ffi::OP_BACKWARD_NODE {
        return Op::BackwardNode;
    }
    details_of(raw).unwrap_or(Op::Other)
}

/// The op's bool, int and float arguments the shim kept, in order.
fn scalars_of(raw: &ffi::Op) -> Vec<Scalar> {
    let kept = usize::try_from(raw.scalars).unwrap_or(0).min(ffi::OP_MAX_SCALARS);
    raw.scalar[..kept].iter().map(|&v| Scalar(v)).collect()
}

/// The op's name and tensor arguments.
fn name_and_tensors(raw: &ffi::Op) -> (String, TensorArgs) {
    // SAFETY: the shim NUL-terminates the name within its 64 bytes.
    let name = unsafe { std::ffi::CStr::from_ptr(raw.name.as_ptr()) }.to_string_lossy().into_owned();
    let count = u32::try_from(raw.tensors).unwrap_or(0);
    let first = (0..ffi::OP_MAX_TENSORS.min(count as usize))
        .map(|i| {
            let ndim = raw.tensor_ndim[i];
            let dtype = (ndim != -2).then(|| DType::from_code(raw.tensor_dtype[i]));
            let shape = usize::try_from(ndim)
                .ok()
                .filter(|&n| n <= ffi::OP_MAX_DIMS)
                .map(|n| raw.tensor_shape[i][..n].to_vec());
            TensorArg { dtype, shape }
        })
        .collect();
    (name, TensorArgs { count, bytes: raw.tensor_bytes, first })
}

/// The details of an op of a kind memlab models, where they can be read.
fn details_of(raw: &ffi::Op) -> Option<Op> {
    if raw.kind == ffi::OP_MATMUL {
        return Some(Op::Matmul { in_backward: raw.in_backward != 0 });
    }
    let n = usize::try_from(raw.ndim).ok().filter(|&n| n > 0 && n <= ffi::OP_MAX_DIMS)?;
    let element_size = u32::try_from(raw.element_size).ok()?;
    let spatial = n.checked_sub(2);
    Some(match raw.kind {
        ffi::OP_SOFTMAX_BACKWARD => Op::SoftmaxBackward { shape: raw.input[..n].to_vec(), element_size },
        ffi::OP_EMBEDDING_BACKWARD => Op::EmbeddingBackward(EmbeddingBackward {
            indices: u64::try_from(raw.indices).ok()?,
            index_size: u32::try_from(raw.index_element_size).ok()?,
            rows: u64::try_from(raw.num_weights).ok()?,
            width: u64::try_from(raw.input[n - 1]).ok()?,
            element_size,
            scale_grad_by_freq: raw.flags & ffi::EMBEDDING_SCALE_GRAD_BY_FREQ != 0,
            indices_contiguous: raw.flags & ffi::EMBEDDING_INDICES_CONTIGUOUS != 0,
            grad_contiguous: raw.flags & ffi::EMBEDDING_GRAD_CONTIGUOUS != 0,
        }),
        ffi::OP_REDUCTION => Op::Reduction(Reduction {
            shape: raw.input[..n].to_vec(),
            strides: raw.input_strides[..n].to_vec(),
            element_size,
            reduced: raw.reduced,
        }),
        ffi::OP_CONVOLUTION | ffi::OP_CONVOLUTION_BACKWARD => {
            let spatial = spatial.filter(|&s| s > 0)?;
            let backward = raw.kind == ffi::OP_CONVOLUTION_BACKWARD;
            let (input, weight) = (raw.input[..n].to_vec(), raw.weight[..n].to_vec());
            let (stride, padding, dilation) =
                (raw.stride[..spatial].to_vec(), raw.padding[..spatial].to_vec(), raw.dilation[..spatial].to_vec());
            let output = if backward {
                raw.output[..n].to_vec()
            } else if raw.transposed != 0 {
                Vec::new()
            } else {
                Convolution::forward_output(&input, &weight, &stride, &padding, &dilation)?
            };
            Op::Convolution(Convolution {
                backward,
                input,
                weight,
                output,
                stride,
                padding,
                dilation,
                transposed: raw.transposed != 0,
                groups: raw.groups,
                element_size,
                output_mask: u8::try_from(raw.output_mask & 7).unwrap_or(0),
            })
        }
        ffi::OP_OTHER => return None,
        _ => return None,
    })
}

/// The shim's callback: runs on the op's thread, and never unwinds.
extern "C" fn on_op(op: *const ffi::Op, id: u64, sequence_end: i64) {
    let _ = std::panic::catch_unwind(|| {
        let at = memlab_core::events::clock_us();
        // SAFETY: the shim passes a valid op for the call's duration, or null.
        let op = unsafe { op.as_ref() }.map(|raw| {
            let (name, tensors) = name_and_tensors(raw);
            let mut record = OpRecord::new(at, at, op_of(raw));
            record.name = name;
            record.tensors = (raw.kind != ffi::OP_BACKWARD_NODE).then_some(tensors);
            record.sequence = u64::try_from(raw.sequence_nr).ok();
            record.scalars = scalars_of(raw);
            record
        });
        let mut watch = WATCH.locked();
        if watch.watches == 0 {
            return;
        }
        match op {
            Some(record) => {
                if watch.ops.len() == KEEP {
                    watch.ops.pop_front();
                }
                let index = watch.pushed;
                watch.pushed += 1;
                watch.open.insert(id, index);
                watch.ops.push_back(record);
            }
            None => {
                if let Some(index) = watch.open.remove(&id) {
                    let first = watch.pushed - watch.ops.len();
                    if let Some(record) = index.checked_sub(first).and_then(|i| watch.ops.get_mut(i)) {
                        record.end_us = at;
                        record.sequence_end = u64::try_from(sequence_end).ok();
                    }
                }
            }
        }
    });
}
