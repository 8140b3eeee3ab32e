//! What the CUDA kernels of a CPU run's watched ops ([`crate::ops`]) would
//! allocate that the CPU kernels do not, and the other way round: a
//! reduction's staging buffer (exact, as libtorch 2.11 sizes it: see
//! [`super::reduction`]), cuDNN's workspaces of a convolution (an
//! estimate), softmax's and an embedding's backward temporaries, and
//! oneDNN's scratch of the CPU convolution, which a CUDA run never makes.

use std::collections::HashMap;

use crate::events::Action;
use crate::export::TraceEntry;
use crate::ops::table::{Bound, Class};
use crate::ops::{Convolution, EmbeddingBackward, Op, OpRecord};

use super::attention;
use super::reduction::{staging, ReductionDevice};
use super::rnn::{input_copy, reserve, workspace, Found, RnnWeights};
use super::Libtorch;
use crate::ops::attention::{AttentionCall, AttentionOp};
use crate::ops::rnn::RnnCall;

/// What the prediction changed of a CPU history for its watched ops.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelsModelled {
    /// Sums and means watched (a convolution's bias gradient counts too).
    pub reductions: usize,
    /// Of them, those whose CUDA kernel stages through a buffer.
    pub staged: usize,
    /// The largest staging buffer, in bytes.
    pub largest_staging: u64,
    /// Convolutions watched, forward and backward.
    pub convolutions: usize,
    /// The cuDNN workspaces added for them.
    pub workspaces: usize,
    /// Of them, those measured at their shape and batch, on an H100 or an
    /// H200 (the others are estimates; see [`cudnn_workspaces`]).
    pub measured_workspaces: usize,
    /// The largest of them, in bytes.
    pub largest_workspace: u64,
    /// The CPU convolutions' own scratch allocations left out (oneDNN's).
    pub cpu_scratch: usize,
    /// Their bytes, in all.
    pub cpu_scratch_bytes: u64,
    /// Softmax backward passes watched: CUDA's makes a temporary product
    /// of the gradient's size in each, added.
    #[serde(default)]
    pub softmax_backwards: usize,
    /// The largest of those products, in bytes.
    #[serde(default)]
    pub largest_softmax_product: u64,
    /// Embedding backward passes watched: CUDA's sorts the indices and
    /// sums the gradient per partial segment, in temporaries added
    /// ([`embedding_backward_temporaries`]).
    #[serde(default)]
    pub embedding_backwards: usize,
    /// The largest of their temporaries, in bytes.
    #[serde(default)]
    pub largest_embedding_temporary: u64,
    /// LSTM and GRU calls watched: cuDNN's RNN replaces what the CPU's
    /// kernels made in them and in their backward passes ([`super::rnn`]).
    #[serde(default)]
    pub rnns: usize,
    /// Of their workspaces, those estimated (not measured at their shape).
    #[serde(default)]
    pub rnn_workspaces_estimated: usize,
    /// The largest reserve space kept for a backward pass, in bytes.
    #[serde(default)]
    pub largest_rnn_reserve: u64,
    /// Attention kernels watched (forward and backward) that CUDA runs as
    /// memory-efficient attention ([`super::attention`]).
    #[serde(default)]
    pub attentions: usize,
    /// The largest of their backward passes' workspaces, in bytes.
    #[serde(default)]
    pub largest_attention_workspace: u64,
    /// Attention kernels watched (forward and backward) in halves or
    /// bfloat16, which CUDA runs as cuDNN's attention
    /// ([`super::attention`]).
    #[serde(default)]
    pub cudnn_attentions: usize,
}

/// A kernel's scratch, allocated right after an event: freed at once, or
/// by a later temporary of the same op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Temporary {
    /// The event's index.
    pub(super) after: usize,
    pub(super) bytes: u64,
    /// A cuDNN workspace, which the kernel does without where it cannot be
    /// had (libtorch then tries the next algorithm, which needs less).
    pub(super) soft: Option<Soft>,
    pub(super) life: Life,
}

/// How long a temporary lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Life {
    /// Allocated and freed at once.
    Instant,
    /// Allocated, and kept until the temporary that closes this number.
    Opens(u32),
    /// Not an allocation: the free of the temporary that opened this
    /// number (of the same bytes).
    Closes(u32),
}

/// A cuDNN workspace's place among the convolutions: libtorch keeps the
/// algorithm it settled on per shape and pass, and reuses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Soft {
    /// The shape and pass (one number per distinct one in the history).
    pub(super) key: usize,
    /// What the next algorithms take where this one cannot be had
    /// ([`Workspace::fallbacks`]).
    pub(super) fallbacks: [u64; 2],
}

/// How a CPU trace changes: which of its events go, and what temporaries
/// (bytes) are allocated and freed right after which of its events.
pub(super) struct Plan {
    /// Per event of the trace: left out.
    pub(super) dropped: Vec<bool>,
    /// In event order.
    pub(super) temporaries: Vec<Temporary>,
    /// After which event the first matrix product outside backward functions
    /// allocated, and the first inside them: where the CUDA run's threads
    /// (the caller's, autograd's) make their cuBLAS workspaces.
    pub(super) first_matmul: [Option<usize>; 2],
    /// After which event the first product through cuBLASLt (`addmm`,
    /// `_addmm_activation`: a bias added in the product) allocated: where
    /// cuBLASLt's workspace is made.
    pub(super) first_lt: Option<usize>,
    pub(super) modelled: KernelsModelled,
}

/// cuDNN's workspaces for `conv` on CUDA under `libtorch`, in the order it
/// asks for them (forward: one; backward: the input's gradient's, then the
/// weight's).
///
/// cuDNN picks an algorithm per shape and device, and each algorithm its
/// workspace, so no formula gives them all. For the shapes measured with the
/// version's cuDNN (its [`KernelTables::cudnn`](super::KernelTables), for
/// 2.11 [`H100_MEASURED`], from `examples/cudnn_workspaces.rs`), they are
/// what it allocated; for others, an estimate ruled from those measurements:
///
/// - forward, fewer than 16 input channels a group, or a 1 x 1 kernel at
///   stride 1: none (at most a few hundred bytes);
/// - the input's gradient, fewer than 8 input channels, or 1 x 1 at stride 1:
///   none;
/// - the weight's gradient, fewer than 4 input channels and a kernel of at
///   most 3: none;
/// - otherwise the input, output and weight in the layout the tensor cores
///   read (their sum and 147 bytes: what most shapes took), and for the
///   weight's gradient 8 MiB more, for its split reduction (measured 1 to 9
///   MiB; one shape took 764 MiB).
///
/// The default allocator's reserved peak is sensitive to these sizes (a
/// workspace a few bytes larger may no longer fit a cached block): where a
/// shape is estimated, so is the figure, more loosely than elsewhere.
///
/// A shape measured at another batch takes what it took there, the input
/// and output (where the workspace held them) grown to this batch: an
/// estimate, which the H100 bore out at batches 1,024 and 1,120 for the
/// conv net's larger shapes but for one forward pass (1 MiB more at 1,024).
///
/// Where a workspace cannot be had, libtorch tries cuDNN's next algorithms
/// until one runs ([`Workspace::fallbacks`]). The H200's batch searches
/// recorded 229 and 176 failed requests for the zoo's ResNet and 211 for
/// its U-Net (`fixtures/zoo/searches/`), nearly all of them workspaces:
/// below the first, the walk took an algorithm
/// holding the input, output and weight (and 147 bytes), then for a
/// forward pass one holding the input and weight (and 16 bytes), then
/// algorithms taking a few KiB at most (counted as none).
pub fn cudnn_workspaces(conv: &Convolution, libtorch: Libtorch) -> Vec<Workspace> {
    let batch = conv.input.first().copied().unwrap_or(0);
    let nearest = nearest_measured(conv, libtorch);
    let (input, weight, mut output) = conv.bytes();
    // A transposed convolution's forward op does not carry its output's
    // size: the measured shape's, at this batch.
    if let (Some(m), true) = (nearest, conv.transposed && output == 0) {
        output = m.output_bytes(batch);
    }
    // The walk down cuDNN's list that the H200's searches recorded: an
    // algorithm taking the tensors (and 147 bytes), then for the forward
    // pass one taking the input and weight (and 16 bytes), each where
    // smaller than the ones before it; then one taking none.
    let fallbacks = |computing: Computing, bytes: u64| {
        let tensors = input + output + weight + 147;
        let tensors = if tensors < bytes { tensors } else { 0 };
        let direct = input + weight + 16;
        let below = if tensors > 0 { tensors } else { bytes };
        match computing {
            Computing::Output if direct < below => [tensors, direct],
            _ => [tensors, 0],
        }
    };
    // Transposed shapes not measured are not modelled (the op table says so).
    if output == 0 || (conv.transposed && nearest.is_none()) {
        return Vec::new();
    }
    let backward = conv.backward;
    let wanted = |computing: Computing| match computing {
        Computing::Output => !backward,
        Computing::InputGradient => backward && conv.output_mask & 1 != 0,
        Computing::WeightGradient => backward && conv.output_mask & 2 != 0,
    };
    let all = [Computing::Output, Computing::InputGradient, Computing::WeightGradient];
    // The shape measured at this batch, else at the nearest other: the
    // tensors' part of each workspace grows with the batch, the rest stays.
    if let Some(m) = nearest.filter(|_| batch > 0) {
        let (input0, output0) = (input / batch as u64 * m.n as u64, output / batch as u64 * m.n as u64);
        return all
            .into_iter()
            .filter(|&c| wanted(c))
            .map(|computing| {
                let at = m.bytes(computing);
                let bytes = if at >= input0 + output0 + weight {
                    at - input0 - output0 + input + output
                } else if at >= input0 + weight {
                    at - input0 + input
                } else {
                    at
                };
                Workspace { computing, bytes, measured: m.n == batch, fallbacks: fallbacks(computing, bytes) }
            })
            .filter(|w| w.bytes > 0)
            .collect();
    }
    let channels = conv.input.get(1).copied().unwrap_or(0) / conv.groups.max(1);
    let largest_kernel = conv.weight.iter().skip(2).copied().max().unwrap_or(1);
    let pointwise = largest_kernel == 1 && conv.stride.iter().all(|&s| s == 1);
    let each = input + output + weight + 147;
    all.into_iter()
        .filter(|&c| wanted(c))
        .filter_map(|computing| {
            let bytes = match computing {
                Computing::Output if channels < 16 || pointwise => return None,
                Computing::InputGradient if channels < 8 || pointwise => return None,
                Computing::WeightGradient if channels < 4 && largest_kernel <= 3 => return None,
                Computing::WeightGradient => each + (8 << 20),
                _ => each,
            };
            Some(Workspace { computing, bytes, measured: false, fallbacks: fallbacks(computing, bytes) })
        })
        .collect()
}

/// The shape of `conv` measured with `libtorch`'s cuDNN at the batch
/// nearest its own, if any.
fn nearest_measured(conv: &Convolution, libtorch: Libtorch) -> Option<&'static Measured> {
    let batch = conv.input.first().copied().unwrap_or(0);
    libtorch
        .kernels()
        .cudnn
        .iter()
        .flat_map(|table| table.iter())
        .filter(|m| m.same_shape(conv))
        .min_by_key(|m| m.n.abs_diff(batch))
}

/// Whether cuDNN's workspaces for `conv`'s shape were measured (at some
/// batch) with `libtorch`'s cuDNN: a transposed convolution is modelled
/// only then.
pub fn cudnn_measured(conv: &Convolution, libtorch: Libtorch) -> bool {
    nearest_measured(conv, libtorch).is_some()
}

/// One of a convolution's cuDNN workspaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workspace {
    /// What it serves.
    pub computing: Computing,
    /// Its bytes.
    pub bytes: u64,
    /// Measured (on an H100 or an H200) for this shape at this batch, not
    /// estimated.
    pub measured: bool,
    /// Where these bytes cannot be had, the workspaces of the algorithms
    /// libtorch 2.11 walks to, largest first (0: none there): it tries
    /// cuDNN's next algorithms in the heuristics' order, each asking for its
    /// own workspace, and runs the first that gets one, so only those
    /// smaller than every one before them count. Below them, one that takes
    /// none. Estimates from the walks the H200 recorded.
    pub fallbacks: [u64; 2],
}

/// What an H100 or an H200 allocated for a 2-d float convolution (no
/// dilation, one group; padding half the kernel but where the table says)
/// with libtorch 2.11's cuDNN: each shape of
/// `examples/cudnn_workspaces.rs`, 0 where none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Measured {
    /// Batch.
    pub n: i64,
    /// Input channels.
    pub c_in: i64,
    /// Output channels.
    pub c_out: i64,
    /// Height and width.
    pub h: i64,
    /// Kernel size, both ways.
    pub k: i64,
    /// Stride, both ways.
    pub stride: i64,
    /// Padding, both ways.
    pub padding: i64,
    /// A transposed convolution's output padding, both ways (0 otherwise).
    pub output_padding: i64,
    /// A transposed convolution (its weight is input channels first).
    pub transposed: bool,
    /// The forward pass's workspace.
    pub forward: u64,
    /// The input's gradient's.
    pub input_grad: u64,
    /// The weight's gradient's.
    pub weight_grad: u64,
}

impl Measured {
    /// The output's height (= width).
    fn output_size(&self) -> i64 {
        match self.transposed {
            true => (self.h - 1) * self.stride - 2 * self.padding + self.k + self.output_padding,
            false => (self.h + 2 * self.padding - self.k) / self.stride + 1,
        }
    }

    /// The output's bytes at `batch`.
    fn output_bytes(&self, batch: i64) -> u64 {
        let size = self.output_size();
        [batch, self.c_out, size, size]
            .into_iter()
            .try_fold(4u64, |bytes, n| bytes.checked_mul(u64::try_from(n).ok()?))
            .unwrap_or(0)
    }

    /// The same convolution but for the batch. A transposed one's output
    /// size tells its output padding; its forward op does not carry the
    /// output, and any is taken then (each kernel, stride and padding of
    /// the grid was measured with one).
    fn same_shape(&self, conv: &Convolution) -> bool {
        let (h, k, s, p) = (self.h, self.k, self.stride, self.padding);
        let weight = match self.transposed {
            true => [self.c_in, self.c_out, k, k],
            false => [self.c_out, self.c_in, k, k],
        };
        let output_size = self.output_size();
        conv.element_size == 4
            && conv.groups == 1
            && conv.transposed == self.transposed
            && conv.input.get(1..) == Some(&[self.c_in, h, h][..])
            && conv.weight == weight
            && conv.stride == [s, s]
            && conv.padding == [p, p]
            && conv.dilation == [1, 1]
            && (!self.transposed
                || conv.output.is_empty()
                || conv.output.get(2..) == Some(&[output_size, output_size][..]))
    }

    fn bytes(&self, computing: Computing) -> u64 {
        match computing {
            Computing::Output => self.forward,
            Computing::InputGradient => self.input_grad,
            Computing::WeightGradient => self.weight_grad,
        }
    }
}

/// The shapes measured on an H100 (NVIDIA H100 80GB HBM3, libtorch 2.11.0,
/// 2026-11-26): see [`Measured`].
#[rustfmt::skip]
pub const H100_MEASURED: &[Measured] = &[
    Measured { n: 256, c_in: 3, c_out: 64, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 0, input_grad: 0, weight_grad: 0 },
    Measured { n: 256, c_in: 64, c_out: 128, h: 32, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 67403792, input_grad: 201621651, weight_grad: 205882079 },
    Measured { n: 256, c_in: 128, c_out: 256, h: 16, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 101843091, input_grad: 101843091, weight_grad: 110101159 },
    Measured { n: 512, c_in: 3, c_out: 64, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 0, input_grad: 0, weight_grad: 0 },
    Measured { n: 512, c_in: 64, c_out: 128, h: 32, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 134512656, input_grad: 402948243, weight_grad: 407208671 },
    Measured { n: 512, c_in: 128, c_out: 256, h: 16, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 202506387, input_grad: 202506387, weight_grad: 210764455 },
    Measured { n: 64, c_in: 4, c_out: 64, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 0, input_grad: 0, weight_grad: 71930000 },
    Measured { n: 64, c_in: 8, c_out: 64, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 0, input_grad: 75516051, weight_grad: 76750992 },
    Measured { n: 64, c_in: 16, c_out: 64, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 16814096, input_grad: 49020928, weight_grad: 86392976 },
    Measured { n: 64, c_in: 32, c_out: 32, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 67145875, input_grad: 67145875, weight_grad: 71160983 },
    Measured { n: 64, c_in: 64, c_out: 64, h: 56, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 102908051, input_grad: 102908051, weight_grad: 104972967 },
    Measured { n: 64, c_in: 64, c_out: 64, h: 56, k: 1, stride: 1, padding: 0, output_padding: 0, transposed: false, forward: 400, input_grad: 400, weight_grad: 1048576 },
    Measured { n: 64, c_in: 64, c_out: 256, h: 56, k: 1, stride: 1, padding: 0, output_padding: 0, transposed: false, forward: 400, input_grad: 0, weight_grad: 4194704 },
    Measured { n: 64, c_in: 128, c_out: 128, h: 28, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 51970195, input_grad: 51970195, weight_grad: 60228263 },
    Measured { n: 64, c_in: 128, c_out: 256, h: 28, k: 3, stride: 2, padding: 1, output_padding: 0, transposed: false, forward: 48103855, input_grad: 39714963, weight_grad: 43254367 },
    Measured { n: 64, c_in: 256, c_out: 256, h: 14, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 36438447, input_grad: 28049424, weight_grad: 35127903 },
    Measured { n: 64, c_in: 256, c_out: 512, h: 14, k: 1, stride: 1, padding: 0, output_padding: 0, transposed: false, forward: 400, input_grad: 400, weight_grad: 33554432 },
    Measured { n: 64, c_in: 512, c_out: 512, h: 7, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 22282256, input_grad: 22282256, weight_grad: 30933743 },
    Measured { n: 128, c_in: 64, c_out: 128, h: 32, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 33849360, input_grad: 100958224, weight_grad: 105218783 },
    Measured { n: 128, c_in: 128, c_out: 64, h: 32, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 100958355, input_grad: 100958355, weight_grad: 864026624 },
    Measured { n: 128, c_in: 256, c_out: 128, h: 16, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 57803315, input_grad: 51511443, weight_grad: 59769511 },
    Measured { n: 32, c_in: 96, c_out: 96, h: 64, k: 3, stride: 1, padding: 1, output_padding: 0, transposed: false, forward: 100995219, input_grad: 100995219, weight_grad: 109253287 },
    Measured { n: 32, c_in: 3, c_out: 32, h: 224, k: 7, stride: 2, padding: 3, output_padding: 0, transposed: false, forward: 0, input_grad: 0, weight_grad: 80106128 },
    Measured { n: 16, c_in: 64, c_out: 64, h: 128, k: 5, stride: 1, padding: 2, output_padding: 0, transposed: false, forward: 134627475, input_grad: 35651584, weight_grad: 136676103 },
];

/// What a convolution's workspace serves: cuDNN asks for it once it has
/// allocated that tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Computing {
    /// The forward output.
    Output,
    /// The input's gradient.
    InputGradient,
    /// The weight's gradient.
    WeightGradient,
}

/// The plan for `trace` (one device's events, in order) and the ops watched
/// while it was recorded.
pub(super) fn plan(
    trace: &[TraceEntry],
    ops: &[OpRecord],
    device: ReductionDevice,
    rnn_weights: RnnWeights,
    libtorch: Libtorch,
    side: Option<Side>,
) -> Plan {
    let mut plan = Plan {
        dropped: vec![false; trace.len()],
        temporaries: Vec::new(),
        first_matmul: [None, None],
        first_lt: None,
        modelled: KernelsModelled::default(),
    };
    if trace.is_empty() {
        return plan;
    }
    let freed_at = freed_at(trace);
    let window = |r: &OpRecord| window(trace, r);
    // After which event a temporary goes: the `nth` allocation the op kept
    // (counting from 1), else its last one, else the last event before it ended.
    let after = |r: &OpRecord, kept: &[usize], nth: usize| -> usize {
        kept.get(nth.saturating_sub(1))
            .or(kept.last())
            .copied()
            .unwrap_or_else(|| window(r).end.saturating_sub(1).min(trace.len() - 1))
    };
    let stage = |plan: &mut Plan, reduction: &crate::ops::Reduction, at: usize| {
        plan.modelled.reductions += 1;
        if let Some((buffer, semaphores)) = staging(reduction, device).filter(|s| s.0 > 0) {
            plan.modelled.staged += 1;
            plan.modelled.largest_staging = plan.modelled.largest_staging.max(buffer);
            plan.temporaries.push(Temporary { after: at, bytes: buffer, soft: None, life: Life::Instant });
            plan.temporaries.push(Temporary { after: at, bytes: semaphores, soft: None, life: Life::Instant });
        }
    };
    // The RNNs and attention kernels first: what ran inside them (and inside
    // an RNN's backward pass) is theirs, and no other op's model applies
    // there.
    let rnns = rnn_runs(ops);
    let covered = covered_by_models(ops, &rnns);
    let modelled_apart = |r: &OpRecord| covered.iter().any(|&(start, end)| start <= r.start_us && r.start_us <= end);
    for (k, run) in rnns.iter().enumerate() {
        model_rnn(&mut plan, trace, &freed_at, run, RNN_LIVES + RNN_LIVES_EACH * k as u32, rnn_weights, side);
    }
    for (k, (r, call)) in attention_kernels(ops).into_iter().enumerate() {
        model_attention(&mut plan, trace, &freed_at, r, &call, ATTENTION_LIVES + 8 * k as u32);
    }
    // An element-wise op on tensors of two types (a float32 residual plus a
    // half output, under autocast) converts the other operand first on the
    // CPU (`_to_copy` inside it, freed before it ends); CUDA's kernels
    // convert as they read: the copy goes.
    promotion_copies(&mut plan.dropped, trace, ops, &freed_at);
    // libtorch's cache of algorithms: one key per shape and pass.
    type Key<'a> = (&'a [i64], &'a [i64], &'a [i64], &'a [i64], &'a [i64], i64, u32, Computing);
    let mut keys: std::collections::HashMap<Key<'_>, usize> = std::collections::HashMap::new();
    // Convolutions first: their CPU scratch goes before other ops keep what is left.
    // The CPU kernel's own temporaries (allocated and freed inside the op)
    // go: the allocations the op keeps, and the bytes that went.
    // Those in `made_on_both` are the CUDA kernel's too: neither kept nor gone.
    let cpu_own = |dropped: &mut [bool], r: &OpRecord, made_on_both: &[usize]| -> (Vec<usize>, Vec<u64>) {
        let range = window(r);
        let (mut kept, mut gone) = (Vec::new(), Vec::new());
        for i in range.clone() {
            if trace[i].action != Action::Alloc || dropped[i] || made_on_both.contains(&i) {
                continue;
            }
            if freed_at[i] < range.end {
                dropped[i] = true;
                dropped[freed_at[i]] = true;
                gone.push(trace[i].size);
            } else {
                kept.push(i);
            }
        }
        (kept, gone)
    };
    // Batch norm's backward pass on the CPU makes a temporary of the
    // input's size and frees it before it ends; cuDNN's makes none.
    for r in ops.iter().filter(|r| r.name == "native_batch_norm_backward" && !modelled_apart(r)) {
        let (_, scratch) = cpu_own(&mut plan.dropped, r, &[]);
        plan.modelled.cpu_scratch += scratch.len();
        plan.modelled.cpu_scratch_bytes += scratch.iter().sum::<u64>();
    }
    for r in ops.iter().filter(|r| !modelled_apart(r)) {
        let Op::Convolution(conv) = &r.op else { continue };
        // A gradient handed back by a concatenation's backward pass is a
        // view, not contiguous: both devices' kernels copy it first (a
        // `clone` inside the op). That copy is no CPU kernel's scratch.
        let copies: Vec<usize> = ops
            .iter()
            .filter(|c| conv.backward && c.name == "clone" && r.start_us <= c.start_us && c.end_us <= r.end_us)
            .flat_map(&window)
            .collect();
        let (kept, scratch) = cpu_own(&mut plan.dropped, r, &copies);
        plan.modelled.cpu_scratch += scratch.len();
        plan.modelled.cpu_scratch_bytes += scratch.iter().sum::<u64>();
        plan.modelled.convolutions += 1;
        // cuDNN asks for a workspace once it has allocated the tensor it
        // computes: after the kept allocation of that tensor's size.
        let (input_bytes, weight_bytes, output_bytes) = conv.bytes();
        for (nth, Workspace { computing, bytes, measured, fallbacks }) in
            cudnn_workspaces(conv, libtorch).into_iter().enumerate()
        {
            plan.modelled.workspaces += 1;
            plan.modelled.measured_workspaces += usize::from(measured);
            plan.modelled.largest_workspace = plan.modelled.largest_workspace.max(bytes);
            let size = match computing {
                Computing::Output => output_bytes,
                Computing::InputGradient => input_bytes,
                Computing::WeightGradient => weight_bytes,
            };
            let made = kept.iter().copied().find(|&i| trace[i].size == size);
            let at = made.unwrap_or_else(|| after(r, &kept, nth + 1));
            let c = conv;
            let shape =
                (&*c.input, &*c.weight, &*c.stride, &*c.padding, &*c.dilation, c.groups, c.element_size, computing);
            let next_key = keys.len();
            let key = *keys.entry(shape).or_insert(next_key);
            let soft = Some(Soft { key, fallbacks });
            plan.temporaries.push(Temporary { after: at, bytes, soft, life: Life::Instant });
        }
        if let Some(sum) = conv.bias_gradient_sum() {
            stage(&mut plan, &sum, after(r, &kept, kept.len()));
        }
    }
    // A sum inside a convolution is the convolution's own (its bias's
    // gradient, on some CPU paths), which the convolution's model covers.
    let convolutions: Vec<(u64, u64)> =
        ops.iter().filter(|r| matches!(r.op, Op::Convolution(_))).map(|r| (r.start_us, r.end_us)).collect();
    for r in ops.iter().filter(|r| !modelled_apart(r)) {
        let Op::Reduction(reduction) = &r.op else { continue };
        if convolutions.iter().any(|&(start, end)| start <= r.start_us && r.start_us <= end) {
            continue;
        }
        let kept: Vec<usize> =
            window(r).filter(|&i| trace[i].action == Action::Alloc && !plan.dropped[i]).take(1).collect();
        stage(&mut plan, reduction, after(r, &kept, 1));
    }
    for r in ops.iter().filter(|r| !modelled_apart(r)) {
        let Op::SoftmaxBackward { shape, element_size } = &r.op else { continue };
        // After the gradient it computes, which the op allocates first.
        let kept: Vec<usize> =
            window(r).filter(|&i| trace[i].action == Action::Alloc && !plan.dropped[i]).take(1).collect();
        let elements = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?));
        let bytes = elements.and_then(|n| n.checked_mul(u64::from(*element_size))).unwrap_or(0);
        plan.modelled.softmax_backwards += 1;
        plan.modelled.largest_softmax_product = plan.modelled.largest_softmax_product.max(bytes);
        plan.temporaries.push(Temporary { after: after(r, &kept, 1), bytes, soft: None, life: Life::Instant });
    }
    for (nth, r) in ops.iter().filter(|r| matches!(r.op, Op::EmbeddingBackward(_))).enumerate() {
        let Op::EmbeddingBackward(e) = &r.op else { continue };
        // The CPU kernel's own temporaries go; CUDA's come before and
        // after the table's gradient, which both keep.
        let (kept, _) = cpu_own(&mut plan.dropped, r, &[]);
        let gradient = e.rows.saturating_mul(e.width).saturating_mul(u64::from(e.element_size));
        let output = kept.iter().position(|&i| trace[i].size == gradient).unwrap_or(0);
        let at = after(r, &kept, output + 1);
        // Each op's lives numbered apart from the others'.
        let apart = |n: u32| n + EMBEDDING_LIVES * nth as u32;
        let (before, after_output) = embedding_backward_temporaries(e);
        plan.modelled.embedding_backwards += 1;
        // An output that is the history's first event: all after it.
        for (steps, entry) in [(before, at.saturating_sub(1)), (after_output, at)] {
            for (life, bytes) in steps {
                plan.modelled.largest_embedding_temporary = plan.modelled.largest_embedding_temporary.max(bytes);
                let life = match life {
                    Life::Instant => Life::Instant,
                    Life::Opens(n) => Life::Opens(apart(n)),
                    Life::Closes(n) => Life::Closes(apart(n)),
                };
                plan.temporaries.push(Temporary { after: entry, bytes, soft: None, life });
            }
        }
    }
    for r in ops.iter().filter(|r| !modelled_apart(r)) {
        let Op::Matmul { in_backward } = r.op else { continue };
        // After the product's output: cuBLAS is called once it is there.
        let output: Vec<usize> =
            window(r).filter(|&i| trace[i].action == Action::Alloc && !plan.dropped[i]).take(1).collect();
        let slot = &mut plan.first_matmul[usize::from(in_backward)];
        if slot.is_none() {
            *slot = Some(after(r, &output, 1));
        }
        // (A record without a name, from before names were recorded, may
        // have been one.)
        if plan.first_lt.is_none() && matches!(r.name.as_str(), "addmm" | "_addmm_activation" | "") {
            plan.first_lt = Some(after(r, &output, 1));
        }
    }
    if let Some(side) = side {
        bound(&mut plan, trace, ops, &freed_at, side);
    }
    plan.temporaries.sort_by_key(|t| t.after);
    plan
}

/// Which end of a prediction's range a history is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    /// The ops memlab does not model add nothing on CUDA, and their CPU
    /// kernels' own temporaries are not made there.
    Low,
    /// Each op memlab does not model adds what its rule bounds.
    High,
}

/// An op memlab does not model, as a prediction's range counts it: the
/// runs of one op, by name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Unmodelled {
    /// The aten op (`lstm`), or a convolution that memlab does not model
    /// (`convolution (transposed)`).
    pub name: String,
    /// How many times it ran.
    pub runs: u64,
    /// What one run may add on CUDA at most, by its rule: the largest of
    /// its runs', in bytes.
    pub may_add: u64,
    /// What its CPU kernel made and freed for itself in one run, at most,
    /// which CUDA may not make, in bytes.
    pub cpu_own: u64,
    /// The rule ([`crate::ops::table::Bound::rule`]).
    pub rule: String,
}

/// The outermost runs of the ops memlab does not model (an op inside
/// another is the outer one's, and one inside an op whose CUDA kernel
/// memlab models with its details, a convolution's oneDNN kernel say, is
/// that op's), each with its bound's rule.
fn unmodelled_runs(ops: &[OpRecord]) -> Vec<(&OpRecord, Bound)> {
    let covered = covered_by_models(ops, &rnn_runs(ops));
    let ops: Vec<&OpRecord> =
        ops.iter().filter(|r| !covered.iter().any(|&(s, e)| s <= r.start_us && r.start_us <= e)).collect();
    let mut runs: Vec<(&OpRecord, Bound)> = Vec::new();
    let mut order: Vec<&OpRecord> = ops;
    order.sort_by_key(|r| r.start_us);
    let mut outer_end: Option<u64> = None;
    let mut modelled_end: Option<u64> = None;
    for r in order {
        let end = r.end_us.max(r.start_us);
        let inside = |outer: Option<u64>| outer.is_some_and(|outer| r.start_us <= outer);
        let class = class_of(r);
        if class == Class::Modelled && !matches!(r.op, Op::Other | Op::Matmul { .. }) && !inside(modelled_end) {
            modelled_end = Some(end);
        }
        let Class::NotModelled(bound) = class else { continue };
        if inside(outer_end) || inside(modelled_end) {
            continue;
        }
        outer_end = Some(end);
        runs.push((r, bound));
    }
    runs
}

/// The class of a recorded op ([`crate::ops::table::class_of`]), a
/// transposed convolution's modelled where cuDNN's workspaces for its
/// shape were measured.
fn class_of(record: &OpRecord) -> Class {
    match &record.op {
        Op::Convolution(c) if c.transposed && cudnn_measured(c, Libtorch::V2_11) => Class::Modelled,
        _ => crate::ops::table::class_of(record),
    }
}

/// The name a prediction gives an op memlab does not model.
fn unmodelled_name(r: &OpRecord) -> String {
    match &r.op {
        Op::Convolution(c) => format!("convolution{} (transposed)", if c.backward { "_backward" } else { "" }),
        _ if r.name.is_empty() => "an op without a name".to_string(),
        _ => r.name.clone(),
    }
}

/// The runs of ops memlab does not model in `trace`, by name, in the order
/// each first ran.
pub fn unmodelled(trace: &[TraceEntry], ops: &[OpRecord]) -> Vec<Unmodelled> {
    let freed_at = freed_at(trace);
    let mut out: Vec<Unmodelled> = Vec::new();
    for (r, bound) in unmodelled_runs(ops) {
        let (own, each) = bounds_of(trace, r, &freed_at);
        let may_add = match bound {
            Bound::Workspace => each,
            Bound::WorkspaceAndReserve => each.saturating_mul(2),
        };
        let name = unmodelled_name(r);
        match out.iter_mut().find(|u| u.name == name) {
            Some(u) => {
                u.runs += 1;
                u.may_add = u.may_add.max(may_add);
                u.cpu_own = u.cpu_own.max(own);
            }
            None => out.push(Unmodelled { name, runs: 1, may_add, cpu_own: own, rule: bound.rule().to_string() }),
        }
    }
    out
}

/// One run's CPU-own bytes (made and freed inside it), and what each of
/// its rule's blocks may take on CUDA: its tensor arguments' and outputs'
/// bytes.
fn bounds_of(trace: &[TraceEntry], r: &OpRecord, freed_at: &[usize]) -> (u64, u64) {
    let range = window(trace, r);
    let (mut own, mut kept) = (0u64, 0u64);
    for i in range.clone().filter(|&i| trace[i].action == Action::Alloc) {
        if freed_at[i] < range.end {
            own = own.saturating_add(trace[i].size);
        } else {
            kept = kept.saturating_add(trace[i].size);
        }
    }
    let arguments = match (&r.tensors, &r.op) {
        (Some(t), _) => t.bytes,
        (None, Op::Convolution(c)) => c.bytes().0.saturating_add(c.bytes().1),
        (None, _) => 0,
    };
    (own, arguments.saturating_add(kept))
}

/// Lives numbered from here are the range's, apart from the kernels'.
const RANGE_LIVES: u32 = 1 << 30;

/// Changes `plan` for one end of the range: at the low end, the CPU
/// kernels' own temporaries of the ops memlab does not model go; at the
/// high end, each run holds a workspace of its rule's size while it runs
/// and, with a reserve, one more kept until its longest-lived output is
/// freed (for the rest of the history where one never is).
fn bound(plan: &mut Plan, trace: &[TraceEntry], ops: &[OpRecord], freed_at: &[usize], side: Side) {
    let mut life = RANGE_LIVES;
    for (r, bound) in unmodelled_runs(ops) {
        let range = window(trace, r);
        match side {
            Side::Low => {
                for i in range.clone() {
                    if trace[i].action == Action::Alloc && !plan.dropped[i] && freed_at[i] < range.end {
                        plan.dropped[i] = true;
                        plan.dropped[freed_at[i]] = true;
                    }
                }
            }
            Side::High => {
                let (_, bytes) = bounds_of(trace, r, freed_at);
                if bytes == 0 || trace.is_empty() {
                    continue;
                }
                let first = range.start.saturating_sub(1).min(trace.len() - 1);
                let last = range.end.saturating_sub(1).max(first).min(trace.len() - 1);
                let mut hold = |after_open: usize, after_close: Option<usize>| {
                    life += 1;
                    plan.temporaries.push(Temporary { after: after_open, bytes, soft: None, life: Life::Opens(life) });
                    if let Some(after) = after_close {
                        plan.temporaries.push(Temporary { after, bytes, soft: None, life: Life::Closes(life) });
                    }
                };
                hold(first, Some(last));
                if bound == Bound::WorkspaceAndReserve {
                    let outputs =
                        range.clone().filter(|&i| trace[i].action == Action::Alloc && freed_at[i] >= range.end);
                    // No output made inside it: the reserve goes with the op.
                    let freed = match outputs.map(|i| freed_at[i]).max() {
                        None => Some(last),
                        Some(f) => (f != usize::MAX).then_some(f),
                    };
                    hold(first, freed);
                }
            }
        }
    }
}

/// The times whose allocations a model of its own replaces: each RNN call
/// and its backward pass, each attention kernel memlab models, and the
/// `scaled_dot_product_attention` that ran one.
fn covered_by_models(ops: &[OpRecord], rnns: &[RnnRun<'_>]) -> Vec<(u64, u64)> {
    let mut covered: Vec<(u64, u64)> = rnns.iter().flat_map(|run| run.spans()).collect();
    let kernels: Vec<(u64, u64)> =
        attention_kernels(ops).iter().map(|(r, _)| (r.start_us, r.end_us.max(r.start_us))).collect();
    let dispatch = ops
        .iter()
        .filter(|r| r.name == "scaled_dot_product_attention")
        .filter(|r| kernels.iter().any(|&(start, _)| r.start_us <= start && start <= r.end_us.max(r.start_us)));
    covered.extend(dispatch.map(|r| (r.start_us, r.end_us.max(r.start_us))));
    covered.extend(kernels);
    covered
}

/// The CPU's flash attention kernels (forward and backward) that CUDA runs
/// as memory-efficient attention ([`AttentionCall::of`]).
fn attention_kernels(ops: &[OpRecord]) -> Vec<(&OpRecord, AttentionCall)> {
    ops.iter().filter_map(|r| AttentionCall::of(r).filter(|c| c.op != AttentionOp::Dispatch).map(|c| (r, c))).collect()
}

/// Where the attention kernels' lives are numbered: 8 each.
const ATTENTION_LIVES: u32 = 1 << 28;

/// What CUDA's attention allocates for one of the CPU's flash kernels, in
/// place of the CPU kernel's own scratch, as an H200 allocated it
/// ([`super::attention`]). Memory-efficient attention (float32): forward,
/// its logsumexp padded to 32 steps (living as the CPU's did); backward,
/// after the three gradients, a temporary of the query's size, two row sums
/// and a workspace. cuDNN's (halves and bfloat16): forward, a seed and an
/// offset kept as long as the logsumexp and 256 bytes at once; backward, a
/// temporary after the gradients.
fn model_attention(
    plan: &mut Plan,
    trace: &[TraceEntry],
    freed_at: &[usize],
    r: &OpRecord,
    call: &AttentionCall,
    base: u32,
) {
    if trace.is_empty() {
        return;
    }
    let last = trace.len() - 1;
    let range = window(trace, r);
    let allocations: Vec<usize> =
        range.clone().filter(|&i| trace[i].action == Action::Alloc && !plan.dropped[i]).collect();
    let drop = |plan: &mut Plan, i: usize| {
        plan.dropped[i] = true;
        if freed_at[i] != usize::MAX {
            plan.dropped[freed_at[i]] = true;
        }
    };
    // The CPU kernel's scratch, made and freed inside it.
    for &i in allocations.iter().filter(|&&i| freed_at[i] < range.end) {
        drop(plan, i);
    }
    let outlive: Vec<usize> = allocations.iter().copied().filter(|&i| freed_at[i] >= range.end).collect();
    let push = |plan: &mut Plan, after: usize, bytes: u64, life: Life| {
        plan.temporaries.push(Temporary { after: after.min(last), bytes, soft: None, life });
    };
    // After the op's last allocation it keeps, else its last event.
    let at = outlive.last().copied().unwrap_or_else(|| range.end.saturating_sub(1));
    match call.op {
        AttentionOp::CpuForward if call.cudnn() => {
            // The output and logsumexp as the CPU's; the seed and offset
            // live as the logsumexp does (autograd keeps all three for the
            // backward pass), and 256 bytes come and go.
            let lse = attention::cpu_logsumexp(call);
            let kept = outlive.iter().rev().find(|&&i| trace[i].size == lse).map(|&i| freed_at[i]);
            for n in [base, base + 1] {
                push(plan, at, attention::CUDNN_SEED, Life::Opens(n));
            }
            push(plan, at, attention::CUDNN_FORWARD_TEMPORARY, Life::Instant);
            // Without the logsumexp found, they go with the op's end; where
            // the CPU never freed it, they are never freed either (a batch
            // search's next try then gives them back before its own part).
            let freed = match kept {
                Some(usize::MAX) => None,
                Some(f) => Some(f),
                None => Some(range.end.saturating_sub(1)),
            };
            for n in [base, base + 1] {
                if let Some(freed) = freed {
                    push(plan, freed, attention::CUDNN_SEED, Life::Closes(n));
                }
            }
        }
        AttentionOp::CpuBackward if call.cudnn() => {
            push(plan, at, attention::cudnn_backward_temporary(call), Life::Instant);
        }
        AttentionOp::CpuForward => {
            let (cpu, cuda) = (attention::cpu_logsumexp(call), attention::logsumexp(call));
            let found = outlive.iter().rev().find(|&&i| trace[i].size == cpu).copied();
            if let Some(i) = found.filter(|_| cpu != cuda) {
                drop(plan, i);
                push(plan, i.saturating_sub(1), cuda, Life::Opens(base));
                if freed_at[i] != usize::MAX {
                    push(plan, freed_at[i], cuda, Life::Closes(base));
                }
            }
        }
        AttentionOp::CpuBackward => {
            let (query, delta, workspace) = (call.query_bytes(), attention::delta(call), attention::workspace(call));
            plan.modelled.largest_attention_workspace = plan.modelled.largest_attention_workspace.max(workspace);
            push(plan, at, query, Life::Opens(base + 1));
            push(plan, at, delta, Life::Opens(base + 2));
            push(plan, at, delta, Life::Opens(base + 3));
            push(plan, at, delta, Life::Closes(base + 2));
            push(plan, at, query, Life::Closes(base + 1));
            push(plan, at, workspace, Life::Opens(base + 4));
            push(plan, at, delta, Life::Closes(base + 3));
            push(plan, at, workspace, Life::Closes(base + 4));
        }
        AttentionOp::Dispatch => return,
    }
    if call.cudnn() {
        plan.modelled.cudnn_attentions += 1;
    } else {
        plan.modelled.attentions += 1;
    }
}

/// Where the RNNs' lives are numbered: each run takes the next
/// [`RNN_LIVES_EACH`], apart from the embeddings' and the range's.
const RNN_LIVES: u32 = 1 << 29;
const RNN_LIVES_EACH: u32 = 32;

/// An LSTM or GRU call memlab models, with its backward pass.
struct RnnRun<'a> {
    record: &'a OpRecord,
    call: RnnCall,
    /// From the first of its backward nodes' start to the last's end.
    backward: Option<(u64, u64)>,
    /// Backward nodes of other ops that ran in that time.
    foreign: Vec<(u64, u64)>,
    /// Where bidirectional, the `add` after its backward pass, before the
    /// next node: autograd summing the input's gradients of the CPU's two
    /// directions, where cuDNN gives one.
    accumulation: Option<(u64, u64)>,
}

impl RnnRun<'_> {
    /// The times that are the RNN's: its call, and its backward pass.
    fn spans(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        std::iter::once((self.record.start_us, self.record.end_us.max(self.record.start_us))).chain(self.backward)
    }
}

/// The outermost LSTM and GRU calls memlab can read ([`RnnCall::of`]), each
/// with its backward pass: the backward nodes numbered from its sequence
/// number up to the one after it.
fn rnn_runs(ops: &[OpRecord]) -> Vec<RnnRun<'_>> {
    let mut runs: Vec<RnnRun<'_>> = Vec::new();
    let mut order: Vec<&OpRecord> = ops.iter().collect();
    order.sort_by_key(|r| r.start_us);
    for r in order {
        if runs.last().is_some_and(|last| r.start_us <= last.record.end_us) {
            continue;
        }
        let Some(call) = RnnCall::of(r) else { continue };
        let nodes: Vec<&OpRecord> = r.backward_nodes(ops).collect();
        let backward = nodes.iter().map(|n| n.start_us).min().zip(nodes.iter().map(|n| n.end_us.max(n.start_us)).max());
        // Other ops' nodes: numbered outside the call's numbers.
        let ours = r.sequence.zip(r.sequence_end).map_or(0..0, |(first, end)| first..end);
        let foreign = match backward {
            Some((start, end)) => ops
                .iter()
                .filter(|n| matches!(n.op, Op::BackwardNode) && start <= n.start_us && n.start_us <= end)
                .filter(|n| n.sequence.is_some_and(|s| !ours.contains(&s)))
                .map(|n| (n.start_us, n.end_us.max(n.start_us)))
                .collect(),
            None => Vec::new(),
        };
        // Only between the pass and the next backward node of the same
        // pass: with none after it, the `add` would be another's.
        let accumulation = backward.filter(|_| call.directions == 2).and_then(|(_, end)| {
            let next = ops
                .iter()
                .filter(|n| matches!(n.op, Op::BackwardNode) && n.start_us > end)
                .map(|n| n.start_us)
                .min()?;
            ops.iter()
                .filter(|o| o.name == "add" && o.start_us > end && o.end_us.max(o.start_us) < next)
                .map(|o| (o.start_us, o.end_us.max(o.start_us)))
                .min()
        });
        runs.push(RnnRun { record: r, call, backward, foreign, accumulation });
    }
    runs
}

/// What cuDNN's RNN allocates for `run` on CUDA, in place of what the CPU
/// made inside the call and inside its backward pass (libtorch 2.11's
/// `_cudnn_rnn` and `_cudnn_rnn_backward`, in the order an H200's recording
/// shows):
///
/// - the call: a contiguous copy of a batch-first input, the weights'
///   buffer where they are not flattened, the output and final states, the
///   workspace and the reserve space, then the workspace and the copy
///   freed. The output and states live as the CPU's did, the output at
///   least until the backward pass ends (it reads the output); the reserve
///   and the weights' buffer until the backward pass ends (or the call,
///   without one).
/// - the backward pass: zeros for the final states' gradients where the
///   states were not used, copies of the input and of the output's
///   gradient, the gradients of the input and initial states, a workspace;
///   then a copy of the input, the weights' flat gradient and a workspace.
///   The input's gradient lives as the CPU's did (bidirectional, as the sum
///   of its two directions' did, which is not made); the weights' gradient as
///   the CPU's weight gradients did (kept where they were, freed with the
///   last where they were freed).
#[allow(clippy::too_many_arguments)]
fn model_rnn(
    plan: &mut Plan,
    trace: &[TraceEntry],
    freed_at: &[usize],
    run: &RnnRun<'_>,
    base: u32,
    weights: RnnWeights,
    side: Option<Side>,
) {
    if trace.is_empty() {
        return;
    }
    let call = &run.call;
    let last = trace.len() - 1;
    let forward = window(trace, run.record);
    let kept = |i: usize| trace[i].action == Action::Alloc && !plan.dropped[i];
    let forward_allocations: Vec<usize> = forward.clone().filter(|&i| kept(i)).collect();
    // The CPU's outputs: the last allocations of their sizes that outlive the call.
    let mut taken: Vec<usize> = Vec::new();
    let mut last_of = |size: u64| {
        let found = forward_allocations
            .iter()
            .rev()
            .copied()
            .find(|&i| trace[i].size == size && freed_at[i] >= forward.end && !taken.contains(&i));
        taken.extend(found);
        found
    };
    let output = last_of(call.output_bytes());
    let states: Vec<Option<usize>> = (0..call.states()).map(|_| last_of(call.state_bytes())).collect();
    let backward = run.backward.map(|(start, end)| {
        let from = trace.partition_point(|e| e.time_us < start);
        let to = trace.partition_point(|e| e.time_us <= end);
        from..to
    });
    let foreign = |i: usize| run.foreign.iter().any(|&(s, e)| s <= trace[i].time_us && trace[i].time_us <= e);
    let backward_allocations: Vec<usize> =
        backward.clone().map(|b| b.filter(|&i| kept(i) && !foreign(i)).collect()).unwrap_or_default();
    let outlive: Vec<usize> = match &backward {
        Some(b) => backward_allocations.iter().copied().filter(|&i| freed_at[i] >= b.end).collect(),
        None => Vec::new(),
    };
    // The input's gradient goes on to the layer below, soon freed; the
    // weights' gradients are kept or freed last.
    let input_gradient =
        outlive.iter().copied().filter(|&i| trace[i].size == call.input_bytes()).min_by_key(|&i| freed_at[i]);
    let weight_gradients_freed =
        outlive.iter().copied().filter(|&i| Some(i) != input_gradient).map(|i| freed_at[i]).max();
    // cuDNN's backward pass reads the input the call was given, which
    // autograd keeps until the pass ends; the CPU's kernels keep copies of
    // their own instead, and may free the input sooner. The input: the
    // latest allocation of its size live when the call began.
    let input = (0..forward.start)
        .rev()
        .find(|&i| {
            kept(i) && trace[i].size == call.input_bytes() && freed_at[i] != usize::MAX && freed_at[i] >= forward.end
        })
        .filter(|&i| backward.as_ref().is_some_and(|b| freed_at[i] < b.end));
    // The sum of the CPU's two directions' input gradients: the one that
    // goes on to the layer below, which cuDNN's input gradient is instead.
    let summed = run.accumulation.filter(|_| input_gradient.is_some()).and_then(|(start, end)| {
        let from = trace.partition_point(|e| e.time_us < start);
        (from..trace.len())
            .take_while(|&i| trace[i].time_us <= end)
            .find(|&i| kept(i) && trace[i].size == call.input_bytes())
    });
    for &i in forward_allocations.iter().chain(&backward_allocations).chain(&input).chain(&summed) {
        plan.dropped[i] = true;
        if freed_at[i] != usize::MAX {
            plan.dropped[freed_at[i]] = true;
        }
    }
    let ws = workspace(call);
    let ws_bytes = match (ws.found, side) {
        (Found::Estimated { low, .. }, Some(Side::Low)) => low,
        (Found::Estimated { high, .. }, Some(Side::High)) => high,
        _ => ws.bytes,
    };
    plan.modelled.rnns += 1;
    plan.modelled.rnn_workspaces_estimated += usize::from(matches!(ws.found, Found::Estimated { .. }));
    plan.modelled.largest_rnn_reserve = plan.modelled.largest_rnn_reserve.max(reserve(call));
    let mut push = |after: usize, bytes: u64, life: Life| {
        plan.temporaries.push(Temporary { after: after.min(last), bytes, soft: None, life });
    };
    let (copy, buffer) =
        (input_copy(call), if weights == RnnWeights::CopiedEachStep { call.weight_bytes() } else { 0 });
    // Lives: 0 copy, 1 weights' buffer, 2 output, 3–4 states, 5 workspace,
    // 6 reserve; backward: 7–8 zeros, 9 copy, 10 gradient copy, 11 input's
    // gradient, 12–13 states' gradients, 14 workspace, 15 copy, 16 weights'
    // gradient, 17 workspace; 18 the input, kept to the backward pass's end.
    if let (Some(i), Some(b)) = (input, &backward) {
        push(i.saturating_sub(1), trace[i].size, Life::Opens(base + 18));
        push(b.end.saturating_sub(1), trace[i].size, Life::Closes(base + 18));
    }
    let at = forward.start.saturating_sub(1);
    let call_end = forward.end.saturating_sub(1).max(at);
    let lives = |n: u32| base + n;
    push(at, copy, Life::Opens(lives(0)));
    push(at, buffer, Life::Opens(lives(1)));
    push(at, call.output_bytes(), Life::Opens(lives(2)));
    for n in 0..call.states() as u32 {
        push(at, call.state_bytes(), Life::Opens(lives(3 + n)));
    }
    push(at, ws_bytes, Life::Opens(lives(5)));
    push(at, reserve(call), Life::Opens(lives(6)));
    push(at, ws_bytes, Life::Closes(lives(5)));
    push(at, copy, Life::Closes(lives(0)));
    // The output and states are freed where the CPU's were; the output no
    // sooner than the backward pass ends, which reads it (autograd keeps it
    // for `_cudnn_rnn_backward`, where the CPU's kernels keep their own).
    let close_as = |cpu: Option<usize>| match cpu {
        Some(i) => (freed_at[i] != usize::MAX).then_some(freed_at[i]),
        None => Some(call_end),
    };
    let mut closes: Vec<(usize, u64, u32)> = Vec::new();
    if let Some(after) = close_as(output) {
        let after = backward.as_ref().map_or(after, |b| after.max(b.end.saturating_sub(1)));
        closes.push((after, call.output_bytes(), lives(2)));
    }
    for (n, state) in states.iter().enumerate() {
        if let Some(after) = close_as(*state) {
            closes.push((after, call.state_bytes(), lives(3 + n as u32)));
        }
    }
    match &backward {
        None => {
            closes.push((call_end, reserve(call), lives(6)));
            closes.push((call_end, buffer, lives(1)));
        }
        Some(b) => {
            let (start, end) = (b.start.saturating_sub(1), b.end.saturating_sub(1));
            let grad_copy = if copy > 0 { call.output_bytes() } else { 0 };
            // A state the program did not use has no gradient: zeros for it.
            let unused: Vec<u32> = (0..call.states() as u32)
                .filter(|&n| states[n as usize].is_none_or(|i| freed_at[i] < b.start))
                .collect();
            for &n in &unused {
                push(start, call.state_bytes(), Life::Opens(lives(7 + n)));
            }
            push(start, copy, Life::Opens(lives(9)));
            push(start, grad_copy, Life::Opens(lives(10)));
            push(start, call.input_bytes(), Life::Opens(lives(11)));
            for n in 0..call.states() as u32 {
                push(start, call.state_bytes(), Life::Opens(lives(12 + n)));
            }
            push(start, ws_bytes, Life::Opens(lives(14)));
            push(start, ws_bytes, Life::Closes(lives(14)));
            push(start, grad_copy, Life::Closes(lives(10)));
            push(start, copy, Life::Closes(lives(9)));
            push(start, copy, Life::Opens(lives(15)));
            push(start, call.weight_bytes(), Life::Opens(lives(16)));
            push(start, ws_bytes, Life::Opens(lives(17)));
            push(start, ws_bytes, Life::Closes(lives(17)));
            push(start, copy, Life::Closes(lives(15)));
            for n in 0..call.states() as u32 {
                closes.push((end, call.state_bytes(), lives(12 + n)));
            }
            for &n in &unused {
                closes.push((end, call.state_bytes(), lives(7 + n)));
            }
            closes.push((end, reserve(call), lives(6)));
            closes.push((end, buffer, lives(1)));
            match summed.or(input_gradient) {
                Some(i) if freed_at[i] != usize::MAX => closes.push((freed_at[i], call.input_bytes(), lives(11))),
                Some(_) => {}
                None => closes.push((end, call.input_bytes(), lives(11))),
            }
            match weight_gradients_freed {
                Some(usize::MAX) => {}
                Some(f) => closes.push((f, call.weight_bytes(), lives(16))),
                None => closes.push((end, call.weight_bytes(), lives(16))),
            }
        }
    }
    for (after, bytes, n) in closes {
        push(after, bytes, Life::Closes(n));
    }
}

/// A kernel's temporaries in the order it makes and frees them: each one's
/// life and bytes.
pub type KernelSteps = Vec<(Life, u64)>;

/// Room for the lives one [`embedding_backward_temporaries`] numbers (0
/// to 12): each op's take the next.
const EMBEDDING_LIVES: u32 = 16;

/// What CUDA's embedding backward (libtorch 2.11, `Embedding.cu` and
/// `EmbeddingBackwardKernel.cu`) allocates besides the table's gradient, in
/// order: those before the gradient, and those after it, each with its
/// life (numbers 0 to 12, local to the op) and bytes.
///
/// Up to 3,072 indices (without `scale_grad_by_freq`) the kernel needs no
/// more than contiguous copies of its inputs. Above, it sorts the indices
/// with their positions (CUB's radix sort) and sums the gradient's rows per
/// partial segment of at most 10 equal indices: `min(indices, rows) +
/// indices / 10` rows of the table's width, in the accumulation type
/// (`float` for half types). The sizes of CUB's own temporaries follow
/// rules fitted to an H100's allocations at 2,048 to 4,000,000 indices of
/// both index types (exact at every count measured), but for the
/// exclusive scan's, measured at up to 13,568 distinct indices.
pub fn embedding_backward_temporaries(e: &EmbeddingBackward) -> (KernelSteps, KernelSteps) {
    let align = |bytes: u64| bytes.div_ceil(256).saturating_mul(256);
    let (n, s) = (e.indices, u64::from(e.index_size));
    let index_bytes = n.saturating_mul(s);
    let (mut before, mut after) = (Vec::new(), Vec::new());
    // `indices_.contiguous()` and `grad_.contiguous()` first, freed last.
    let mut copies = Vec::new();
    if !e.indices_contiguous {
        copies.push((0, index_bytes));
    }
    if !e.grad_contiguous {
        let elements = n.saturating_mul(e.width);
        copies.push((1, elements.saturating_mul(u64::from(e.element_size))));
    }
    before.extend(copies.iter().map(|&(id, bytes)| (Life::Opens(id), bytes)));
    let close_copies =
        |after: &mut KernelSteps| after.extend(copies.iter().rev().map(|&(id, b)| (Life::Closes(id), b)));
    if n <= 3072 && !e.scale_grad_by_freq {
        close_copies(&mut after);
        return (before, after);
    }
    // Indices of 8 bytes, else of 4: CUB's tiles differ.
    let wide = s >= 8;
    // The sorted indices, their positions, and the positions' range, sorted
    // by CUB (alternate buffers, then a histogram and a look-back per tile;
    // one tile below its limit, where it asks for a byte).
    let (single_tile, base, tile) = if wide { (2304, 16_895, 4608) } else { (4864, 8703, 6528) };
    let radix = if n <= single_tile { 1 } else { 2 * align(index_bytes) + base + 1024 * n.div_ceil(tile) };
    before.extend([(Life::Opens(2), index_bytes), (Life::Opens(3), index_bytes), (Life::Opens(4), index_bytes)]);
    before.extend([(Life::Instant, radix), (Life::Closes(4), index_bytes)]);
    if e.scale_grad_by_freq {
        // The count per index, from two scans by key.
        before.extend([(Life::Opens(5), index_bytes), (Life::Instant, 1279), (Life::Instant, 1279)]);
    }
    // The segments' offsets and count; CUB's unique-by-key (a look-back
    // per tile) through a temporary copy of the keys.
    let unique = 511 + align(16 * (n.div_ceil(if wide { 4480 } else { 7168 }) + 32));
    after.extend([(Life::Opens(6), index_bytes), (Life::Opens(7), 8), (Life::Opens(8), index_bytes)]);
    after.extend([(Life::Instant, unique), (Life::Closes(8), index_bytes)]);
    // Partial segments per segment and their offsets (an exclusive scan),
    // their count, each partial segment's start, and the partial sums.
    let segments = n.min(e.rows).saturating_mul(s);
    let partials = n.min(e.rows).saturating_add(n / 10);
    let accumulated = if e.element_size >= 8 { 8 } else { 4 };
    let sums = partials.saturating_mul(e.width).saturating_mul(accumulated);
    let scan = if wide { 1279 } else { 1023 };
    after.extend([(Life::Opens(9), segments), (Life::Opens(10), segments), (Life::Instant, scan)]);
    after.extend([(Life::Opens(11), 8), (Life::Opens(12), partials.saturating_mul(s)), (Life::Instant, sums)]);
    // Freed as they go out of scope: the last made first.
    after.extend([
        (Life::Closes(12), partials.saturating_mul(s)),
        (Life::Closes(11), 8),
        (Life::Closes(10), segments),
        (Life::Closes(9), segments),
        (Life::Closes(7), 8),
        (Life::Closes(6), index_bytes),
    ]);
    if e.scale_grad_by_freq {
        after.push((Life::Closes(5), index_bytes));
    }
    after.extend([(Life::Closes(3), index_bytes), (Life::Closes(2), index_bytes)]);
    close_copies(&mut after);
    (before, after)
}

/// What each watched op of a recorded history allocated and freed before it
/// ended (its kernels' scratch: on CUDA, cuDNN's workspaces and the
/// reductions' staging buffers; on the CPU, oneDNN's scratch), in bytes, in
/// the order allocated: how the models above are checked against a CUDA run.
pub fn scratch_of_ops(trace: &[TraceEntry], ops: &[OpRecord]) -> Vec<(OpRecord, Vec<u64>)> {
    let freed_at = freed_at(trace);
    ops.iter()
        .map(|r| {
            let range = window(trace, r);
            let scratch = range
                .clone()
                .filter(|&i| trace[i].action == Action::Alloc && freed_at[i] < range.end)
                .map(|i| trace[i].size)
                .collect();
            (r.clone(), scratch)
        })
        .collect()
}

/// Per event of `trace`: for an allocation, the index of its free
/// (`usize::MAX` where it is never freed).
fn freed_at(trace: &[TraceEntry]) -> Vec<usize> {
    let mut freed_at = vec![usize::MAX; trace.len()];
    let mut open: HashMap<u64, usize> = HashMap::new();
    for (i, e) in trace.iter().enumerate() {
        match (e.action, e.addr) {
            (Action::Alloc, Some(addr)) => {
                open.insert(addr, i);
            }
            (Action::FreeRequested, Some(addr)) => {
                if let Some(a) = open.remove(&addr) {
                    freed_at[a] = i;
                }
            }
            _ => {}
        }
    }
    freed_at
}

/// The events of `trace` from the op's start to its end: a range of indices.
/// The element-wise ops whose CPU kernels copy an operand of another type
/// before they run, where CUDA's convert it as they read it.
const PROMOTING: &[&str] = &["add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_"];

/// Marks dropped the CPU's promotion copies: what a `_to_copy` made inside
/// one of [`PROMOTING`] and freed before that op ended.
fn promotion_copies(dropped: &mut [bool], trace: &[TraceEntry], ops: &[OpRecord], freed_at: &[usize]) {
    // The copies by start, each promoting op's found by bisection: a step
    // runs tens of thousands of ops.
    let mut copies: Vec<&OpRecord> = ops.iter().filter(|c| c.name == "_to_copy").collect();
    copies.sort_by_key(|c| c.start_us);
    for r in ops.iter().filter(|r| matches!(r.op, Op::Other) && PROMOTING.contains(&r.name.as_str())) {
        let outer = window(trace, r);
        let end = r.end_us.max(r.start_us);
        let from = copies.partition_point(|c| c.start_us < r.start_us);
        let to = copies.partition_point(|c| c.start_us <= end);
        for c in &copies[from..to.max(from)] {
            for i in window(trace, c).filter(|&i| outer.contains(&i)) {
                if trace[i].action == Action::Alloc && !dropped[i] && freed_at[i] < outer.end {
                    dropped[i] = true;
                    dropped[freed_at[i]] = true;
                }
            }
        }
    }
}

fn window(trace: &[TraceEntry], r: &OpRecord) -> std::ops::Range<usize> {
    let from = trace.partition_point(|e| e.time_us < r.start_us);
    let to = trace.partition_point(|e| e.time_us <= r.end_us.max(r.start_us));
    from..to
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Reduction;

    fn event(action: Action, addr: u64, size: u64, time_us: u64) -> TraceEntry {
        TraceEntry::new(action, Some(addr), size, time_us)
    }

    /// A float32 residual plus a half output under autocast: the CPU's
    /// `add` copies the half operand to float32 first (a `_to_copy` inside
    /// it, freed before it ends), which CUDA's kernel does not; its output
    /// stays, and so does a cast outside any element-wise op.
    #[test]
    fn an_element_wise_ops_promotion_copy_is_the_cpus_alone() {
        let (copy, output, cast) = (1 << 40, 2 << 40, 3 << 40);
        let trace = vec![
            event(Action::Alloc, copy, 4 << 20, 11),
            event(Action::Alloc, output, 4 << 20, 13),
            event(Action::FreeRequested, copy, 4 << 20, 14),
            event(Action::Alloc, cast, 2 << 20, 25),
            event(Action::FreeRequested, output, 4 << 20, 30),
            event(Action::FreeRequested, cast, 2 << 20, 31),
        ];
        let op = |name: &str, start, end| OpRecord { name: name.into(), ..OpRecord::new(start, end, Op::Other) };
        let ops = vec![op("add", 10, 20), op("_to_copy", 11, 12), op("_to_copy", 25, 26)];
        let plan = plan(&trace, &ops, ReductionDevice::H100, RnnWeights::Flattened, Libtorch::V2_11, None);
        assert_eq!(plan.dropped, [true, false, true, false, false, false]);
    }

    fn conv(backward: bool, n: i64, c_in: i64, c_out: i64, h: i64, k: i64, output_mask: u8) -> Convolution {
        let (stride, padding, dilation) = (vec![1, 1], vec![k / 2, k / 2], vec![1, 1]);
        let input = vec![n, c_in, h, h];
        let weight = vec![c_out, c_in, k, k];
        let output = Convolution::forward_output(&input, &weight, &stride, &padding, &dilation).unwrap();
        Convolution {
            backward,
            input,
            weight,
            output,
            stride,
            padding,
            dilation,
            transposed: false,
            groups: 1,
            element_size: 4,
            output_mask,
        }
    }

    fn record(start_us: u64, end_us: u64, op: Op) -> OpRecord {
        OpRecord::new(start_us, end_us, op)
    }

    /// Forward: the CPU convolution's scratch (allocated and freed inside
    /// it) goes, its output stays, and the measured workspace comes right
    /// after the output. Backward: each workspace after the gradient it
    /// serves, whatever order the CPU made them in, and the bias gradient's
    /// sum stages after the last.
    #[test]
    fn the_cpu_scratch_goes_and_each_workspace_follows_the_tensor_it_serves() {
        let forward = conv(false, 256, 64, 128, 32, 3, 4);
        let backward = conv(true, 256, 64, 128, 32, 3, 7);
        let (input, weight, output) = forward.bytes();
        use Action::{Alloc, FreeRequested as Free};
        let trace = vec![
            event(Alloc, 1, output, 10),
            event(Alloc, 2, 999, 11),
            event(Free, 2, 999, 12),
            event(Alloc, 3, 7, 20),
            event(Alloc, 4, weight, 30),
            event(Alloc, 5, 512, 31),
            event(Alloc, 6, input, 32),
            event(Alloc, 7, 4096, 33),
            event(Free, 7, 4096, 34),
        ];
        let ops = [
            record(10, 12, Op::Convolution(forward)),
            record(30, 34, Op::Convolution(backward)),
            record(20, 20, Op::Reduction(Reduction { shape: vec![8], strides: vec![1], element_size: 4, reduced: 1 })),
        ];
        let plan = plan(&trace, &ops, ReductionDevice::H100, RnnWeights::Flattened, Libtorch::V2_11, None);
        assert_eq!(plan.dropped, [false, true, true, false, false, false, false, true, true]);
        let measured = H100_MEASURED.iter().find(|m| m.n == 256 && m.c_in == 64).unwrap();
        let bias_sum = staging(&conv(true, 256, 64, 128, 32, 3, 7).bias_gradient_sum().unwrap(), ReductionDevice::H100);
        let (buffer, semaphores) = bias_sum.unwrap();
        let temporaries: Vec<(usize, u64, bool)> =
            plan.temporaries.iter().map(|t| (t.after, t.bytes, t.soft.is_some())).collect();
        assert_eq!(
            temporaries,
            [
                (0, measured.forward, true),
                (4, measured.weight_grad, true),
                (6, measured.input_grad, true),
                (6, buffer, false),
                (6, semaphores, false)
            ]
        );
        let m = &plan.modelled;
        assert_eq!((m.convolutions, m.workspaces, m.measured_workspaces), (2, 3, 3));
        assert_eq!((m.cpu_scratch, m.cpu_scratch_bytes), (2, 999 + 4096));
        // The sum over 8 elements stages nothing; the bias gradient's does.
        assert_eq!((m.reductions, m.staged), (2, 1));
    }

    /// A transposed convolution's backward pass handed a gradient that a
    /// concatenation's backward pass cut out (a view): both devices copy it
    /// contiguous first (a `clone` inside the op, freed before it ends), as
    /// the U-Net's H200 run showed. The copy stays; the CPU kernel's own
    /// scratch beside it goes.
    #[test]
    fn a_convolutions_contiguous_copy_of_its_gradient_is_no_cpu_scratch() {
        let backward = conv(true, 8, 64, 32, 64, 3, 3);
        let (input, weight, output) = backward.bytes();
        use Action::{Alloc, FreeRequested as Free};
        let trace = vec![
            event(Alloc, 1, output, 10),
            event(Alloc, 2, input, 12),
            event(Alloc, 3, weight, 13),
            event(Alloc, 4, 4096, 14),
            event(Free, 4, 4096, 15),
            event(Free, 1, output, 16),
        ];
        let clone = OpRecord { name: "clone".into(), ..record(10, 11, Op::Other) };
        let ops = [record(9, 17, Op::Convolution(backward)), clone];
        let plan = plan(&trace, &ops, ReductionDevice::H100, RnnWeights::Flattened, Libtorch::V2_11, None);
        assert_eq!(plan.dropped, [false, false, false, true, true, false]);
        assert_eq!((plan.modelled.cpu_scratch, plan.modelled.cpu_scratch_bytes), (1, 4096));
    }

    /// The first product outside backward functions and the first inside
    /// them place the two threads' cuBLAS workspaces, after the product's
    /// output; a sum inside a convolution is the convolution's own.
    #[test]
    fn the_first_products_of_each_pass_place_the_cublas_workspaces() {
        use Action::Alloc;
        let trace = vec![
            event(Alloc, 1, 64, 5),
            event(Alloc, 2, 4096, 10),
            event(Alloc, 3, 4096, 20),
            event(Alloc, 4, 4096, 40),
            event(Alloc, 5, 4096, 50),
        ];
        let big_sum = Reduction { shape: vec![4096, 4096], strides: vec![4096, 1], element_size: 4, reduced: 1 };
        let ops = [
            record(10, 11, Op::Matmul { in_backward: false }),
            record(20, 21, Op::Matmul { in_backward: false }),
            record(39, 41, Op::Matmul { in_backward: true }),
            record(45, 60, Op::Convolution(conv(true, 2, 3, 4, 8, 3, 3))),
            record(50, 50, Op::Reduction(big_sum)),
        ];
        let plan = plan(&trace, &ops, ReductionDevice::H100, RnnWeights::Flattened, Libtorch::V2_11, None);
        assert_eq!(plan.first_matmul, [Some(1), Some(3)]);
        assert_eq!(plan.modelled.reductions, 0, "the sum inside the convolution is not counted twice");
    }

    /// Each softmax backward pass gets CUDA's product of the gradient and
    /// the output, the gradient's size, right after the gradient it
    /// computes (as an H100 allocated it: 111,149,056 bytes for a
    /// transformer's attention of 53 x 8 x 256 x 256 floats).
    #[test]
    fn a_softmax_backward_gets_cudas_product_after_its_gradient() {
        use Action::Alloc;
        let trace = vec![event(Alloc, 1, 64, 5), event(Alloc, 2, 111_149_056, 10), event(Alloc, 3, 4096, 20)];
        let ops = [record(9, 12, Op::SoftmaxBackward { shape: vec![53, 8, 256, 256], element_size: 4 })];
        let plan = plan(&trace, &ops, ReductionDevice::H100, RnnWeights::Flattened, Libtorch::V2_11, None);
        let temporaries: Vec<(usize, u64, bool)> =
            plan.temporaries.iter().map(|t| (t.after, t.bytes, t.soft.is_some())).collect();
        assert_eq!(temporaries, [(1, 111_149_056, false)]);
        assert_eq!((plan.modelled.softmax_backwards, plan.modelled.largest_softmax_product), (1, 111_149_056));
    }

    /// CUDA's embedding backward, modelled: every allocation and free an
    /// H100 made, in order, at 60 shapes
    /// (`fixtures/fit/embedding_backward_h100.jsonl`, from
    /// `scripts/embedding_backward_h100.py`), and where CUB's radix sort
    /// turns from one tile to many (found by bisection on the H100).
    #[test]
    fn the_embedding_backward_makes_what_the_h100_made() {
        let path = format!("{}/../fixtures/fit/embedding_backward_h100.jsonl", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(path).unwrap();
        let events = |e: &EmbeddingBackward| {
            let (before, after) = embedding_backward_temporaries(e);
            let sign = |life: &Life| if matches!(life, Life::Closes(_)) { "-" } else { "+" };
            let step = |(life, bytes): &(Life, u64)| match life {
                Life::Instant => format!("+{bytes} -{bytes}"),
                _ => format!("{}{bytes}", sign(life)),
            };
            let output = format!("+{}", e.rows * e.width * u64::from(e.element_size));
            before
                .iter()
                .map(step)
                .chain(std::iter::once(output))
                .chain(after.iter().map(step))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut checked = 0;
        for line in text.lines() {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let e: EmbeddingBackward = serde_json::from_value(row.clone()).unwrap();
            assert_eq!(events(&e), row["events"].as_str().unwrap(), "{e:?}");
            checked += 1;
        }
        assert_eq!(checked, 60);
        // The radix sort's temporary at either side of one tile.
        let radix = |indices: u64, index_size: u32| {
            let e = EmbeddingBackward {
                indices,
                index_size,
                rows: 8192,
                width: 64,
                element_size: 4,
                scale_grad_by_freq: true,
                indices_contiguous: true,
                grad_contiguous: true,
            };
            embedding_backward_temporaries(&e).0[3].1
        };
        assert_eq!([radix(2304, 8), radix(2305, 8), radix(4864, 4), radix(4865, 4)], [1, 55_295, 1, 49_151]);
    }

    /// In a history, the CPU kernel's own temporaries go and CUDA's come
    /// before and after the table's gradient; the temporaries that live
    /// across others are numbered apart per op.
    #[test]
    fn an_embedding_backward_gets_cudas_temporaries_around_its_gradient() {
        use Action::{Alloc, FreeRequested as Free};
        let e = EmbeddingBackward {
            indices: 4096,
            index_size: 8,
            rows: 100,
            width: 16,
            element_size: 4,
            scale_grad_by_freq: false,
            indices_contiguous: false,
            grad_contiguous: true,
        };
        let trace = vec![
            event(Alloc, 1, 64, 5),
            event(Alloc, 2, 32_768, 10),
            event(Alloc, 3, 6400, 11),
            event(Free, 2, 32_768, 12),
            event(Alloc, 4, 6400, 20),
            event(Alloc, 5, 32_768, 21),
            event(Alloc, 6, 6400, 22),
            event(Free, 5, 32_768, 23),
        ];
        let ops = [record(10, 12, Op::EmbeddingBackward(e.clone())), record(21, 23, Op::EmbeddingBackward(e.clone()))];
        let plan = plan(&trace, &ops, ReductionDevice::H100, RnnWeights::Flattened, Libtorch::V2_11, None);
        assert_eq!(plan.dropped, [false, true, false, true, false, true, false, true]);
        let (before, after) = embedding_backward_temporaries(&e);
        let of = |t: &[Temporary], at: usize| {
            t.iter().filter(|t| t.after == at).map(|t| (t.life, t.bytes)).collect::<Vec<_>>()
        };
        let renumbered = |steps: &[(Life, u64)], by: u32| {
            steps
                .iter()
                .map(|&(life, bytes)| match life {
                    Life::Opens(n) => (Life::Opens(n + by), bytes),
                    Life::Closes(n) => (Life::Closes(n + by), bytes),
                    Life::Instant => (Life::Instant, bytes),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(of(&plan.temporaries, 1), before);
        assert_eq!(of(&plan.temporaries, 2), after);
        assert_eq!(of(&plan.temporaries, 5), renumbered(&before, 16));
        assert_eq!(of(&plan.temporaries, 6), renumbered(&after, 16));
        assert_eq!(plan.modelled.embedding_backwards, 2);
        // The radix sort's: two buffers of 4,096 indices, CUB's histograms
        // and one look-back tile.
        assert_eq!(plan.modelled.largest_embedding_temporary, 2 * 32_768 + 16_895 + 1024);
    }

    /// Shapes neither GPU was measured on are estimated by the rule; those
    /// one was are what it allocated, and say so.
    #[test]
    fn workspaces_are_measured_where_the_shape_was_and_ruled_elsewhere() {
        // 48 channels: in no table.
        let ruled = conv(false, 8, 48, 48, 30, 3, 4);
        let (i, w, o) = ruled.bytes();
        let each = i + w + o + 147;
        let only = |c: &Convolution| {
            cudnn_workspaces(c, Libtorch::V2_11)
                .into_iter()
                .map(|w| (w.computing, w.bytes, w.measured))
                .collect::<Vec<_>>()
        };
        assert_eq!(only(&ruled), [(Computing::Output, each, false)]);
        assert_eq!(
            only(&conv(true, 8, 48, 48, 30, 3, 7)),
            [(Computing::InputGradient, each, false), (Computing::WeightGradient, each + (8 << 20), false)]
        );
        assert_eq!(only(&conv(false, 8, 8, 48, 30, 3, 4)), [], "fewer than 16 channels forward");
        assert_eq!(only(&conv(true, 8, 3, 48, 30, 3, 2)), [], "3 channels, 3 x 3");
        let pointwise = conv(true, 8, 48, 48, 30, 1, 3);
        assert_eq!(only(&pointwise).iter().map(|w| w.0).collect::<Vec<_>>(), [Computing::WeightGradient]);
        let measured = conv(false, 512, 128, 256, 16, 3, 4);
        assert_eq!(only(&measured), [(Computing::Output, 202_506_387, true)]);
        // The H200's grid, at its batch.
        assert_eq!(only(&conv(false, 8, 64, 64, 32, 3, 4)), [(Computing::Output, 2_244_624, true)]);
        // What the H100 allocated at batches 1,024 and 1,120 (the conv net's
        // batch search under a memory fraction, on the whole card where
        // nothing ran out): the H200's grid measured the first to the byte,
        // and estimates the second from its batch 1,024, whose forward pass
        // took 1,048,656 bytes more than at 512 or 1,120 beside its tensors:
        // that much over there; the gradients' as the H100 allocated them.
        assert_eq!(only(&conv(false, 1024, 64, 128, 32, 3, 4)), [(Computing::Output, 268_730_384, true)]);
        assert_eq!(only(&conv(false, 1120, 128, 256, 16, 3, 4)), [(Computing::Output, 442_630_371, false)]);
        assert_eq!(
            only(&conv(true, 1120, 128, 256, 16, 3, 7)),
            [(Computing::InputGradient, 441_581_715, false), (Computing::WeightGradient, 449_839_783, false)]
        );
        assert_eq!(only(&conv(true, 1024, 128, 256, 16, 3, 7))[1], (Computing::WeightGradient, 412_091_047, true));
    }

    /// Below a workspace that cannot be had, the walk the H200 recorded in
    /// the ResNet's search at batch 101 (256 channels, 16 × 16, 3 × 3): the
    /// forward pass asked for 63,177,363 bytes, then the tensors' algorithm
    /// (55,312,531), then the input and weight's (28,835,856), which ran;
    /// the gradients went down to none.
    #[test]
    fn a_workspace_falls_back_as_cudnns_list_was_walked() {
        let (input, weight) = (101 * 256 * 16 * 16 * 4, 256 * 256 * 9 * 4);
        let forward = cudnn_workspaces(&conv(false, 101, 256, 256, 16, 3, 0), Libtorch::V2_11);
        assert_eq!(forward.len(), 1);
        assert_eq!((forward[0].bytes, forward[0].measured), (63_177_363, true));
        assert_eq!(forward[0].fallbacks, [55_312_531, 28_835_856]);
        assert_eq!(2 * input + weight + 147, 55_312_531);
        assert_eq!(input + weight + 16, 28_835_856);
        let backward = cudnn_workspaces(&conv(true, 101, 256, 256, 16, 3, 3), Libtorch::V2_11);
        let bytes: Vec<(Computing, u64, [u64; 2])> =
            backward.iter().map(|w| (w.computing, w.bytes, w.fallbacks)).collect();
        assert_eq!(
            bytes,
            [
                // The first is the tensors' algorithm already: none below it.
                (Computing::InputGradient, 55_312_531, [0, 0]),
                (Computing::WeightGradient, 62_390_879, [55_312_531, 0]),
            ]
        );
        // A shape measured at no batch: the estimate holds the tensors
        // already, so only the input and weight's algorithm lies below it.
        let c = conv(false, 8, 24, 40, 20, 3, 0);
        let (input, weight, output) = c.bytes();
        let estimated = cudnn_workspaces(&c, Libtorch::V2_11);
        assert_eq!(estimated.len(), 1);
        assert!(!estimated[0].measured);
        assert_eq!(estimated[0].bytes, input + output + weight + 147);
        assert_eq!(estimated[0].fallbacks, [0, input + weight + 16]);
    }

    /// The H200's tables are the measurements committed beside them
    /// (fixtures/cudnn/convolution_h200.jsonl, the example's `--grid`, and
    /// convolution_dense_h200.jsonl, its `--grid dense`): each pass's one
    /// allocation but the copy of the loss's broadcast gradient that a
    /// backward pass makes first, row by row.
    #[test]
    fn the_h200_tables_are_the_committed_measurements() {
        use super::super::cudnn_h200::{H200_DENSE, H200_GRID};
        for (file, table) in [("convolution_h200", H200_GRID), ("convolution_dense_h200", H200_DENSE)] {
            let path = format!("{}/../fixtures/cudnn/{file}.jsonl", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(path).unwrap();
            let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            assert_eq!(rows.len(), table.len(), "{file}");
            for (r, m) in rows.iter().zip(table) {
                let int = |key: &str| r[key].as_i64().unwrap();
                let transposed = r["transposed"].as_bool().unwrap_or(false);
                let (k, s) = (int("k"), int("stride"));
                let p = r.get("padding").map_or(k / 2, |p| p.as_i64().unwrap());
                let op = if transposed { int("output_padding") } else { 0 };
                let shape = (int("n"), int("c_in"), int("c_out"), int("h"), k, s, p, op, transposed);
                assert_eq!(
                    shape,
                    (m.n, m.c_in, m.c_out, m.h, m.k, m.stride, m.padding, m.output_padding, m.transposed)
                );
                let pass = |key: &str, backward: bool| {
                    let sizes: Vec<u64> = r[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
                    let sizes = match sizes.split_first() {
                        Some((&first, rest)) if backward && first == m.output_bytes(m.n) => rest.to_vec(),
                        _ => sizes,
                    };
                    assert!(sizes.len() <= 1, "{r}");
                    sizes.first().copied().unwrap_or(0)
                };
                assert_eq!(
                    (pass("forward", false), pass("input_grad", true), pass("weight_grad", true)),
                    (m.forward, m.input_grad, m.weight_grad),
                    "{r}"
                );
            }
        }
    }

    /// A transposed convolution of a shape the grid measured is modelled
    /// as the H200 ran it; of another, not (the op table says so).
    #[test]
    fn transposed_convolutions_are_modelled_where_their_shape_was_measured() {
        // The U-Net's up-convolution of examples/zoo.rs at batch 16: 64
        // channels to 32, kernel 2, stride 2, from 64 × 64 to 128 × 128.
        let up = |backward: bool, n: i64, c_in: i64, output: Vec<i64>| Convolution {
            backward,
            input: vec![n, c_in, 64, 64],
            weight: vec![c_in, 32, 2, 2],
            output,
            stride: vec![2, 2],
            padding: vec![0, 0],
            dilation: vec![1, 1],
            transposed: true,
            groups: 1,
            element_size: 4,
            output_mask: if backward { 3 } else { 0 },
        };
        let only = |c: &Convolution| {
            cudnn_workspaces(c, Libtorch::V2_11).into_iter().map(|w| (w.computing, w.bytes)).collect::<Vec<_>>()
        };
        // The forward op does not carry its output: the measured shape's.
        assert_eq!(only(&up(false, 16, 64, vec![])), [(Computing::Output, 50_364_432)]);
        // Backward: no workspace for the input's gradient, one for the weight's.
        let backward = up(true, 16, 64, vec![16, 32, 128, 128]);
        assert_eq!(only(&backward), [(Computing::WeightGradient, 51_085_671)]);
        assert!(cudnn_measured(&backward, Libtorch::V2_11));
        let record = OpRecord::new(0, 1, Op::Convolution(backward));
        assert_eq!(class_of(&record), crate::ops::table::Class::Modelled);
        // 48 channels in: never measured, not modelled, no workspace.
        let unmeasured = up(true, 16, 48, vec![16, 32, 128, 128]);
        assert!(only(&unmeasured).is_empty() && !cudnn_measured(&unmeasured, Libtorch::V2_11));
        let record = OpRecord::new(0, 1, Op::Convolution(unmeasured));
        assert!(matches!(class_of(&record), crate::ops::table::Class::NotModelled(_)));
    }

    /// The table is the measurement committed beside it
    /// (fixtures/fit/cudnn_workspaces_h100.jsonl, the example's `--json`):
    /// forward, the workspace; backward, after each copy of the output's
    /// gradient (the example's loss makes it a broadcast), the workspace of
    /// that call if any, the bias gradient's staging aside.
    #[test]
    fn the_h100_table_is_the_committed_measurement() {
        let path = format!("{}/../fixtures/fit/cudnn_workspaces_h100.jsonl", env!("CARGO_MANIFEST_DIR"));
        let rows: Vec<serde_json::Value> =
            std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let mut checked = 0;
        for m in H100_MEASURED {
            let of = |op: &str| {
                rows.iter()
                    .find(|r| {
                        r["op"] == op
                            && [
                                ("n", m.n),
                                ("c_in", m.c_in),
                                ("c_out", m.c_out),
                                ("h", m.h),
                                ("k", m.k),
                                ("stride", m.stride),
                            ]
                            .iter()
                            .all(|(key, v)| r[key] == *v)
                    })
                    .unwrap_or_else(|| panic!("{m:?}: no {op} row"))
            };
            let sizes = |r: &serde_json::Value| -> Vec<u64> {
                r["measured"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
            };
            assert_eq!(m.forward, sizes(of("forward")).first().copied().unwrap_or(0), "{m:?}");
            let backward = of("backward");
            let output = backward["output"].as_u64().unwrap();
            let staged: Vec<u64> = rows
                .iter()
                .filter(|r| {
                    r["op"] == "sum" && r["n"] == m.n && r["c_in"] == m.c_in && r["c_out"] == m.c_out && r["h"] == m.h
                })
                .flat_map(sizes)
                .collect();
            let mut calls: Vec<Vec<u64>> = Vec::new();
            for size in sizes(backward) {
                if size == output {
                    calls.push(Vec::new());
                } else if let Some(call) = calls.last_mut() {
                    call.push(size);
                }
            }
            let workspace = |call: Option<&Vec<u64>>| {
                call.and_then(|c| c.iter().copied().find(|s| !staged.contains(s))).unwrap_or(0)
            };
            assert_eq!((m.input_grad, m.weight_grad), (workspace(calls.first()), workspace(calls.get(1))), "{m:?}");
            checked += 1;
        }
        assert_eq!(checked, 24);
    }

    /// What each op allocated and freed before it ended is its scratch; what
    /// it kept is not.
    #[test]
    fn an_ops_scratch_is_what_it_freed_before_it_ended() {
        use Action::{Alloc, FreeRequested as Free};
        let trace = vec![
            event(Alloc, 1, 100, 10),
            event(Alloc, 2, 200, 11),
            event(Free, 2, 200, 12),
            event(Alloc, 3, 300, 13),
            event(Free, 1, 100, 30),
            event(Free, 3, 300, 31),
        ];
        let ops = [record(10, 14, Op::Matmul { in_backward: false }), record(30, 31, Op::Matmul { in_backward: true })];
        let scratch: Vec<Vec<u64>> = scratch_of_ops(&trace, &ops).into_iter().map(|(_, s)| s).collect();
        assert_eq!(scratch, [vec![200], vec![]]);
    }
}
