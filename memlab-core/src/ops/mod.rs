//! The ops of a recorded run, as memlab saw them begin and end. A
//! recording with [`Settings::ops`](crate::events::Settings::ops) keeps, in
//! its snapshot, every aten op that allocated (innermost: [`that_allocate`])
//! with its name and tensor arguments, and with their details the ops whose
//! CUDA kernels allocate otherwise than their CPU kernels in ways memlab
//! models: sums and means (a CUDA reduction may stage its partial results
//! through a buffer), convolutions (cuDNN's workspaces on CUDA, oneDNN's
//! scratch on the CPU), matrix products (the first on a thread makes its
//! cuBLAS workspace), softmax's backward pass (a temporary product on
//! CUDA) and an embedding's (a sort and partial sums on CUDA). A CUDA run
//! predicted from a CPU one (`memlab replay --as-cuda`) models what each
//! would allocate on CUDA, and [`table`] says which ops it does not model.

pub mod table;

use serde::{Deserialize, Serialize};

/// One op: when it began and ended on the recorder's clock (microseconds,
/// the traces' clock), and what it was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    /// When it began.
    pub start_us: u64,
    /// When it ended (its start where the end was not seen).
    pub end_us: u64,
    /// The op.
    pub op: Op,
    /// The aten op's name without `aten::` (`addmm`, `_to_copy`); empty in
    /// recordings made before memlab kept every op's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Its tensor arguments, where the recording kept them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensors: Option<TensorArgs>,
}

impl OpRecord {
    /// An op of `kind` from `start_us` to `end_us`, without a name or tensors.
    pub fn new(start_us: u64, end_us: u64, op: Op) -> OpRecord {
        OpRecord { start_us, end_us, op, name: String::new(), tensors: None }
    }
}

/// An op's tensor arguments (lists of tensors counted one by one).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorArgs {
    /// How many.
    pub count: u32,
    /// Their bytes in all (elements times element size, views as their
    /// elements).
    pub bytes: u64,
    /// The first four, in order.
    pub first: Vec<TensorArg>,
}

/// One tensor argument.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorArg {
    /// Its element type; `None` for an undefined tensor.
    pub dtype: Option<crate::DType>,
    /// Its sizes; `None` for an undefined tensor or one of more than eight
    /// dimensions.
    pub shape: Option<Vec<i64>>,
}

/// An op memlab watches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Op {
    /// A sum or mean over some dimensions.
    Reduction(Reduction),
    /// A convolution, forward or backward.
    Convolution(Convolution),
    /// A matrix product (`mm`, `addmm`, `bmm`, …): on CUDA a cuBLAS call,
    /// the first of which on a thread makes that thread's cuBLAS workspace.
    Matmul {
        /// Inside a backward function: on CUDA, autograd's device thread.
        in_backward: bool,
    },
    /// A softmax's backward pass (`_softmax_backward_data`), whose CUDA
    /// kernel first multiplies the gradient by the softmax's output into a
    /// temporary of the gradient's size (libtorch 2.11's `SoftMax.cu`); the
    /// CPU kernel makes none.
    SoftmaxBackward {
        /// The gradient's sizes.
        shape: Vec<i64>,
        /// Bytes per element.
        element_size: u32,
    },
    /// An embedding's backward pass (`embedding_dense_backward`), whose CUDA
    /// kernel sorts the indices and sums the gradient's rows in temporaries
    /// the CPU kernel does not make.
    EmbeddingBackward(EmbeddingBackward),
    /// Any other aten op: its [`OpRecord::name`] and tensors say what it
    /// was, and [`table`] whether its CUDA kernel allocates as its CPU
    /// kernel does.
    Other,
}

/// An embedding's backward pass: what its CUDA kernel sizes its
/// temporaries by.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbeddingBackward {
    /// How many indices (tokens) the forward pass looked up.
    pub indices: u64,
    /// Bytes per index (8 for `int64`, 4 for `int32`).
    pub index_size: u32,
    /// The table's rows (`num_weights`).
    pub rows: u64,
    /// The table's width: the gradient's last dimension.
    pub width: u64,
    /// Bytes per element of the gradient.
    pub element_size: u32,
    /// `scale_grad_by_freq`: the kernel counts each index too.
    pub scale_grad_by_freq: bool,
    /// The indices are contiguous (else the kernel copies them first).
    pub indices_contiguous: bool,
    /// The gradient is contiguous (else the kernel copies it first).
    pub grad_contiguous: bool,
}

/// One reduction's input: shape and strides in elements (dimension 0
/// slowest for a contiguous tensor), element size, and a bit per reduced
/// dimension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reduction {
    /// The input's sizes.
    pub shape: Vec<i64>,
    /// The input's strides, in elements.
    pub strides: Vec<i64>,
    /// Bytes per element.
    pub element_size: u32,
    /// Bit d set: dimension d is reduced.
    pub reduced: u64,
}

/// A convolution (`aten::convolution`) or its backward pass
/// (`aten::convolution_backward`): the shapes cuDNN sizes its workspaces by.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Convolution {
    /// The backward pass, not the forward one.
    pub backward: bool,
    /// The input's shape: batch, channels, then the spatial dimensions.
    pub input: Vec<i64>,
    /// The weight's shape.
    pub weight: Vec<i64>,
    /// The backward pass's gradient of the output (its shape); forward: the
    /// output's shape, computed from the others.
    pub output: Vec<i64>,
    /// Per spatial dimension.
    pub stride: Vec<i64>,
    /// Per spatial dimension.
    pub padding: Vec<i64>,
    /// Per spatial dimension.
    pub dilation: Vec<i64>,
    /// A transposed convolution.
    pub transposed: bool,
    /// Groups.
    pub groups: i64,
    /// Bytes per element.
    pub element_size: u32,
    /// Backward: which gradients it makes (bit 0 the input's, 1 the
    /// weight's, 2 the bias's); forward: bit 2 where it adds a bias.
    pub output_mask: u8,
}

impl Convolution {
    /// The forward output's shape from the input, weight, stride, padding
    /// and dilation (a transposed convolution's is not computed: `None`).
    pub fn forward_output(
        input: &[i64],
        weight: &[i64],
        stride: &[i64],
        padding: &[i64],
        dilation: &[i64],
    ) -> Option<Vec<i64>> {
        let spatial = input.len().checked_sub(2)?;
        if weight.len() != input.len() || [stride.len(), padding.len(), dilation.len()].iter().any(|&n| n != spatial) {
            return None;
        }
        let mut out = vec![input[0], weight[0]];
        for d in 0..spatial {
            let extent = dilation[d] * (weight[d + 2] - 1) + 1;
            let size = (input[d + 2] + 2 * padding[d] - extent).checked_div(stride[d])? + 1;
            out.push(size.max(0));
        }
        Some(out)
    }

    /// Bytes of the input, the weight and the output.
    pub fn bytes(&self) -> (u64, u64, u64) {
        let bytes = |shape: &[i64]| {
            shape.iter().try_fold(u64::from(self.element_size), |a, &n| a.checked_mul(u64::try_from(n).ok()?))
        };
        (bytes(&self.input).unwrap_or(0), bytes(&self.weight).unwrap_or(0), bytes(&self.output).unwrap_or(0))
    }

    /// The gradient of the bias a backward pass makes, as the sum CUDA runs
    /// for it (cuDNN makes no bias gradient: libtorch sums the output's
    /// gradient over every dimension but the channels).
    pub fn bias_gradient_sum(&self) -> Option<Reduction> {
        if !self.backward || self.output_mask & 4 == 0 || self.output.len() < 3 {
            return None;
        }
        let mut strides = vec![1i64; self.output.len()];
        for d in (0..self.output.len() - 1).rev() {
            strides[d] = strides[d + 1] * self.output[d + 1];
        }
        let reduced = ((1u64 << self.output.len()) - 1) & !2;
        Some(Reduction { shape: self.output.clone(), strides, element_size: self.element_size, reduced })
    }
}

/// The ops that only make memory for their caller (`empty`, `empty_like`,
/// …): an allocation inside one belongs to the op that called it, where one
/// did.
const ALLOCATION_PRIMITIVES: [&str; 6] =
    ["empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_"];

/// For each event of `trace` (one device's history, in time order), the
/// index in `ops` of the innermost op running when it happened, if any: of
/// the ops whose window holds the event's time, the one that began last
/// (ties: the one recorded last, since an op's record comes before those of
/// the ops it calls), passing over an op that only makes memory for the op
/// that called it (`empty`). Ops are taken to nest, as they do on one
/// thread.
pub fn innermost(trace: &[crate::export::TraceEntry], ops: &[OpRecord]) -> Vec<Option<usize>> {
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_by_key(|&i| (ops[i].start_us, i));
    let end = |i: usize| ops[i].end_us.max(ops[i].start_us);
    let (mut next, mut open): (usize, Vec<usize>) = (0, Vec::new());
    trace
        .iter()
        .map(|e| {
            while next < order.len() && ops[order[next]].start_us <= e.time_us {
                let op = order[next];
                open.retain(|&o| end(o) >= ops[op].start_us);
                open.push(op);
                next += 1;
            }
            open.retain(|&o| end(o) >= e.time_us);
            let primitive = |o: &&usize| ALLOCATION_PRIMITIVES.contains(&ops[**o].name.as_str());
            open.iter().rev().find(|o| !primitive(o)).or(open.last()).copied()
        })
        .collect()
}

/// The ops of `ops` worth keeping with `traces`: those of the kinds memlab
/// models, each other op that allocated, innermost, on some device's
/// history, and each op the [`table`] names as not modelled during which
/// anything was allocated (its kernel may call others that allocate, as
/// the CPU's RNNs do). What a recording's snapshot carries.
pub fn that_allocate(ops: Vec<OpRecord>, traces: &[Vec<crate::export::TraceEntry>]) -> Vec<OpRecord> {
    use crate::events::Action;
    let mut allocated = vec![false; ops.len()];
    let mut times: Vec<u64> = Vec::new();
    for trace in traces {
        for (e, op) in trace.iter().zip(innermost(trace, &ops)) {
            if e.action == Action::Alloc {
                times.push(e.time_us);
                if let Some(op) = op {
                    allocated[op] = true;
                }
            }
        }
    }
    times.sort_unstable();
    for (r, allocated) in ops.iter().zip(allocated.iter_mut()) {
        let named = matches!(table::entry(&r.name), Some(e) if matches!(e.class, table::Class::NotModelled(_)));
        if named && !*allocated {
            let from = times.partition_point(|&t| t < r.start_us);
            *allocated = times.get(from).is_some_and(|&t| t <= r.end_us.max(r.start_us));
        }
    }
    ops.into_iter()
        .zip(allocated)
        .filter(|(r, allocated)| *allocated || !matches!(r.op, Op::Other))
        .map(|(r, _)| r)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Action;
    use crate::export::TraceEntry;

    fn op(name: &str, start_us: u64, end_us: u64) -> OpRecord {
        OpRecord { name: name.into(), ..OpRecord::new(start_us, end_us, Op::Other) }
    }

    /// `linear` (10–20) calls `t` (11, allocating nothing) and `addmm`
    /// (12–15); `relu` (30–31) comes after; `sum` (40–41) allocates
    /// nothing but is of a kind memlab models.
    #[test]
    fn an_allocation_belongs_to_the_innermost_op_and_only_allocating_ops_are_kept() {
        let ops = vec![
            op("linear", 10, 20),
            op("t", 11, 11),
            op("addmm", 12, 15),
            op("empty", 13, 13),
            op("relu", 30, 31),
            OpRecord::new(40, 41, Op::Matmul { in_backward: false }),
            op("empty", 60, 60),
        ];
        let event = |action, time_us| TraceEntry::new(action, Some(time_us), 64, time_us);
        let trace = vec![
            event(Action::Alloc, 5),
            event(Action::Alloc, 13),
            event(Action::Alloc, 18),
            event(Action::FreeRequested, 30),
            event(Action::Alloc, 31),
            event(Action::Alloc, 50),
            event(Action::Alloc, 60),
        ];
        // addmm's output, made through `empty`, is addmm's; an `empty` no op
        // called is its own.
        assert_eq!(innermost(&trace, &ops), vec![None, Some(2), Some(0), Some(4), Some(4), None, Some(6)]);
        let kept: Vec<String> = that_allocate(ops, &[trace]).into_iter().map(|r| r.name).collect();
        assert_eq!(
            kept,
            ["linear", "addmm", "relu", "", "empty"],
            "`t` made nothing; the product is kept for its kind"
        );
    }
}
