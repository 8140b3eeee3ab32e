//! The ops of a recorded run, as memlab saw them begin and end. A
//! recording with [`Settings::ops`](crate::events::Settings::ops) keeps, in
//! its snapshot, every aten op that allocated (innermost: [`crate::export::ops::that_allocate`])
//! with its name and tensor arguments, and with their details the ops whose
//! CUDA kernels allocate otherwise than their CPU kernels in ways memlab
//! models: sums and means (a CUDA reduction may stage its partial results
//! through a buffer), convolutions (cuDNN's workspaces on CUDA, oneDNN's
//! scratch on the CPU), matrix products (the first on a thread makes its
//! cuBLAS workspace), softmax's backward pass (a temporary product on
//! CUDA) and an embedding's (a sort and partial sums on CUDA). A CUDA run
//! predicted from a CPU one (`memlab replay --as-cuda`) models what each
//! would allocate on CUDA, and [`table`] says which ops it does not model.

pub mod attention;
pub mod rnn;
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
    /// Autograd's sequence number: an aten op's thread's next one when it
    /// began (the number of the first backward node it, or an op it calls,
    /// makes); a backward node's ([`Op::BackwardNode`]) own, where it has
    /// one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<u64>,
    /// A forward op's thread's next sequence number when it ended: the
    /// backward nodes numbered from [`sequence`](Self::sequence) up to this
    /// one are the backward pass of this op and the ops it called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_end: Option<u64>,
    /// The op's bool, int and float arguments in order (bools as 0 and 1),
    /// the first eight: an RNN's layers and directions, say.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scalars: Vec<Scalar>,
}

/// A bool, int or float argument of an op, as a float (bools as 0 and 1).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Scalar(pub f64);

impl PartialEq for Scalar {
    fn eq(&self, other: &Scalar) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for Scalar {}

impl OpRecord {
    /// An op of `kind` from `start_us` to `end_us`, without a name or tensors.
    pub fn new(start_us: u64, end_us: u64, op: Op) -> OpRecord {
        OpRecord {
            start_us,
            end_us,
            op,
            name: String::new(),
            tensors: None,
            sequence: None,
            sequence_end: None,
            scalars: Vec::new(),
        }
    }

    /// The backward nodes of `ops` that make this forward op's backward
    /// pass (of it and of the ops it called), by their sequence numbers;
    /// none where either was recorded without them.
    pub fn backward_nodes<'a>(&self, ops: &'a [OpRecord]) -> impl Iterator<Item = &'a OpRecord> {
        let range = match (self.sequence, self.sequence_end) {
            (Some(first), Some(end)) if !matches!(self.op, Op::BackwardNode) => first..end,
            _ => 0..0,
        };
        ops.iter().filter(move |r| matches!(r.op, Op::BackwardNode) && r.sequence.is_some_and(|s| range.contains(&s)))
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
    /// Not an aten op: one of autograd's backward nodes (`name`: its own,
    /// `CudnnRnnBackward0` say), inside which the aten ops of the backward
    /// pass of a forward op run. Linked to that op by
    /// [`OpRecord::sequence`].
    BackwardNode,
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

    /// Bytes of the input, the weight and the output (0 for a shape not known).
    pub fn bytes(&self) -> (u64, u64, u64) {
        // A shape not known (a transposed convolution's forward output) has none.
        let bytes = |shape: &[i64]| {
            (!shape.is_empty())
                .then(|| {
                    shape.iter().try_fold(u64::from(self.element_size), |a, &n| a.checked_mul(u64::try_from(n).ok()?))
                })
                .flatten()
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
