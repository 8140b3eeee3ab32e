//! Which aten ops allocate on CUDA as they do on the CPU: memlab's table,
//! for libtorch 2.11.
//!
//! A CUDA run predicted from a CPU run (`memlab replay --as-cuda`,
//! `memlab::will_it_fit`) replays the CPU run's allocations. That is exact
//! for an op whose CUDA kernel allocates what its CPU kernel does (its
//! outputs, and temporaries of the same sizes or none): [`Class::Same`].
//! For the ops whose CUDA kernels allocate otherwise and whose difference
//! memlab models (the kinds of [`Op`] with details: reductions'
//! staging, cuDNN's convolution workspaces, cuBLAS's workspaces, softmax's
//! and embedding's backward temporaries; and batch norm's backward pass,
//! whose CPU temporary is known from the op's name), it is
//! [`Class::Modelled`]. Every
//! other op that allocated, whether the table names it
//! ([`Class::NotModelled`]) or not, makes the prediction a range: what the op
//! may add on CUDA is bounded by a rule ([`Bound`]) from its shapes, and
//! what its CPU kernel made for itself may be missing there.
//!
//! How an op came to its class is in its entry's `why`: libtorch 2.11's
//! kernels as read, and the zoo of models measured on an H200
//! (`fixtures/zoo/`), where a model whose every op is `Same` or `Modelled`
//! was predicted within [−1 %, +2 %] of the GPU's peak.

use super::{Op, OpRecord};

/// How an op's CUDA kernel allocates, against its CPU kernel's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// As on the CPU: its outputs, and temporaries of the same sizes or none.
    Same,
    /// Otherwise, and memlab models CUDA's allocations.
    Modelled,
    /// Otherwise, and memlab does not model them: the rule of what it may add.
    NotModelled(Bound),
}

/// What an op memlab does not model may add on CUDA, at most, and the CPU
/// kernel's own temporaries (made and freed inside the op), which CUDA may
/// not make, at least.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// A workspace while the op runs, as large as its tensor arguments and
    /// the tensors it made together. The rule holds for every library
    /// workspace measured for memlab's tables but one (cuDNN's convolution
    /// workspaces took at most their input, weight and output, and 8 MiB
    /// for a weight's gradient; cuBLAS's are counted apart).
    Workspace,
    /// A workspace as above, and a reserve of the same size that the op
    /// keeps as long as the longest-lived tensor it made (cuDNN's RNN keeps
    /// its reserve space for the backward pass, as autograd keeps the op's
    /// outputs).
    WorkspaceAndReserve,
}

impl Bound {
    /// The rule, as a prediction's notes state it.
    pub fn rule(self) -> &'static str {
        match self {
            Bound::Workspace => "a workspace while it runs, up to its tensor arguments and outputs",
            Bound::WorkspaceAndReserve => {
                "a workspace while it runs and a reserve kept with its outputs, each up to its tensor arguments \
                 and outputs"
            }
        }
    }
}

/// One op of the table.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// The aten op's name, without `aten::`.
    pub name: &'static str,
    /// Its class.
    pub class: Class,
    /// Why: what its kernels allocate on each device.
    pub why: &'static str,
    /// A modelled op whose model reads its name alone, no details (its
    /// runs are recorded as [`Op::Other`]).
    pub by_name: bool,
}

const fn same(name: &'static str, why: &'static str) -> Entry {
    Entry { name, class: Class::Same, why, by_name: false }
}

const fn modelled(name: &'static str, why: &'static str) -> Entry {
    Entry { name, class: Class::Modelled, why, by_name: false }
}

/// Modelled from the op's name and the allocations inside it.
const fn modelled_by_name(name: &'static str, why: &'static str) -> Entry {
    Entry { name, class: Class::Modelled, why, by_name: true }
}

const fn not_modelled(name: &'static str, bound: Bound, why: &'static str) -> Entry {
    Entry { name, class: Class::NotModelled(bound), why, by_name: false }
}

const ELEMENTWISE: &str = "an elementwise kernel: its output only, on both devices";
const VIEW: &str = "a view or a no-op: allocates nothing itself on either device (an allocation timed to it, \
                    to the recorder's microsecond, is its neighbour's)";
const FACTORY: &str = "makes its output only, on both devices";
const COPY: &str = "a copy: its output only, on both devices";
const LAYOUT: &str = "gathers or moves elements into its output only, on both devices";
const LOSS: &str = "its output (and the reduction's, a scalar) only, on both devices";
const MATMUL: &str = "cuBLAS on CUDA: the first product on a thread makes that thread's workspace (modelled)";
const REDUCTION: &str = "CUDA's reduction may stage partial results through a buffer (modelled)";
const SDPA: &str = "CUDA runs flash, memory-efficient or cuDNN attention, each with its own logsumexp, seeds and \
                    workspace; the CPU runs its own flash kernel with per-thread scratch. Float attention without \
                    a mask or dropout is modelled as CUDA's memory-efficient kernel (`AttentionCall`)";
const RNN: &str = "CUDA runs cuDNN's RNN (a flattened weight buffer where the weights are not, a workspace, and a \
                   reserve kept for the backward pass); the CPU runs oneDNN's or per-step cells. An LSTM or GRU \
                   call whose record gives its shapes and flags is modelled (`RnnCall`), with its backward pass";

/// The table, by name. Ops that allocate nothing on either device (views,
/// in-place updates that need no temporary) are not listed: they never
/// appear among the ops that allocated.
pub const TABLE: &[Entry] = &[
    same("_adaptive_avg_pool2d", LAYOUT),
    same("_adaptive_avg_pool2d_backward", LAYOUT),
    modelled("_addmm_activation", MATMUL),
    same("_log_softmax", "its output only, on both devices"),
    same("_log_softmax_backward_data", "its output only, on both devices"),
    same("_reshape_alias", COPY),
    not_modelled("_scaled_dot_product_flash_attention_for_cpu", Bound::WorkspaceAndReserve, SDPA),
    not_modelled("_scaled_dot_product_flash_attention_for_cpu_backward", Bound::Workspace, SDPA),
    same("_softmax", "its output only, on both devices"),
    modelled("_softmax_backward_data", "CUDA multiplies the gradient by the output into a temporary first (modelled)"),
    same("_to_copy", COPY),
    same("_unsafe_view", COPY),
    same("abs", ELEMENTWISE),
    same("add", ELEMENTWISE),
    same("addcdiv", ELEMENTWISE),
    same("addcmul", ELEMENTWISE),
    modelled("addmm", MATMUL),
    modelled("addmv", MATMUL),
    same("alias", VIEW),
    same("align_to", VIEW),
    same("arange", FACTORY),
    same("as_strided", VIEW),
    modelled("baddbmm", MATMUL),
    same("bernoulli", ELEMENTWISE),
    same("binary_cross_entropy", LOSS),
    same("binary_cross_entropy_backward", LOSS),
    same("binary_cross_entropy_with_logits", LOSS),
    modelled("bmm", MATMUL),
    same("cat", LAYOUT),
    same("chunk", VIEW),
    same("clamp", ELEMENTWISE),
    same("clamp_min", ELEMENTWISE),
    same("clone", COPY),
    same("contiguous", COPY),
    modelled(
        "convolution",
        "cuDNN's workspace on CUDA (measured per shape, or ruled), oneDNN's scratch on the CPU (dropped; modelled); \
         a transposed convolution only where its shape was measured",
    ),
    modelled(
        "convolution_backward",
        "cuDNN's workspaces and the bias gradient's sum on CUDA, oneDNN's scratch on the CPU (dropped; modelled); a \
         transposed convolution only where its shape was measured",
    ),
    same("copy", COPY),
    same("cos", ELEMENTWISE),
    same("detach", VIEW),
    same("detach_copy", COPY),
    same("diagonal", VIEW),
    same("div", ELEMENTWISE),
    modelled("dot", MATMUL),
    not_modelled(
        "dropout",
        Bound::Workspace,
        "the CPU keeps a noise tensor of the input's type for the backward pass, CUDA's fused kernel a mask of one \
         byte an element",
    ),
    same("embedding", LAYOUT),
    modelled(
        "embedding_dense_backward",
        "CUDA sorts the indices and sums the gradient's rows in temporaries (modelled)",
    ),
    same("empty", FACTORY),
    same("empty_like", FACTORY),
    same("empty_strided", FACTORY),
    same("eq", ELEMENTWISE),
    same("exp", ELEMENTWISE),
    same("expand", LAYOUT),
    same("expand_as", VIEW),
    same("fill", ELEMENTWISE),
    same("flatten", VIEW),
    same("full", FACTORY),
    same("full_like", FACTORY),
    same("gather", LAYOUT),
    same("gelu", ELEMENTWISE),
    same("gelu_backward", ELEMENTWISE),
    not_modelled("gru", Bound::WorkspaceAndReserve, RNN),
    same("gt", ELEMENTWISE),
    same("index", LAYOUT),
    same("index_select", LAYOUT),
    same("lerp", ELEMENTWISE),
    same("lift_fresh", VIEW),
    same("lift_fresh_copy", COPY),
    same("linear", "calls `addmm` or `matmul`, whose entries count"),
    same("linspace", FACTORY),
    same("log", ELEMENTWISE),
    same("log_sigmoid_forward", ELEMENTWISE),
    not_modelled("lstm", Bound::WorkspaceAndReserve, RNN),
    same("lt", ELEMENTWISE),
    same("masked_fill", ELEMENTWISE),
    same("matmul", "calls `mm` or `bmm`, whose entries count"),
    same("max_pool2d_with_indices", "its output and indices, on both devices"),
    same("max_pool2d_with_indices_backward", "its output only, on both devices"),
    modelled("mean", REDUCTION),
    not_modelled("mkldnn_rnn_layer", Bound::WorkspaceAndReserve, RNN),
    not_modelled("mkldnn_rnn_layer_backward", Bound::Workspace, RNN),
    modelled("mm", MATMUL),
    same("movedim", VIEW),
    same("mse_loss", LOSS),
    same("mse_loss_backward", LOSS),
    same("mul", ELEMENTWISE),
    modelled("mv", MATMUL),
    same("narrow", VIEW),
    same("native_batch_norm", "its output and the saved mean and inverse deviation, on both devices"),
    modelled_by_name(
        "native_batch_norm_backward",
        "its three gradients, on both devices; the CPU kernel's temporary of the input's size goes (cuDNN's \
         backward makes none)",
    ),
    same("native_dropout", "its output and mask, on both devices"),
    same("native_dropout_backward", ELEMENTWISE),
    same("native_layer_norm", "its output and the saved mean and inverse deviation, on both devices"),
    same("native_layer_norm_backward", "its three gradients, on both devices"),
    same("ne", ELEMENTWISE),
    same("neg", ELEMENTWISE),
    same("new_empty", FACTORY),
    same("new_empty_strided", FACTORY),
    same("new_zeros", FACTORY),
    same("nll_loss_backward", LOSS),
    same("nll_loss_forward", LOSS),
    same("normal", ELEMENTWISE),
    same("numpy_T", VIEW),
    same("ones", FACTORY),
    same("ones_like", FACTORY),
    same("permute", VIEW),
    same("pow", ELEMENTWISE),
    same("rand", FACTORY),
    same("rand_like", FACTORY),
    same("randint", FACTORY),
    same("randint_like", FACTORY),
    same("randn", FACTORY),
    same("randn_like", FACTORY),
    same("random", ELEMENTWISE),
    same("reciprocal", ELEMENTWISE),
    same("relu", ELEMENTWISE),
    same("repeat", LAYOUT),
    same("reshape", VIEW),
    same("resolve_conj", VIEW),
    same("resolve_neg", VIEW),
    not_modelled("rnn_relu", Bound::WorkspaceAndReserve, RNN),
    not_modelled("rnn_tanh", Bound::WorkspaceAndReserve, RNN),
    same("rsqrt", ELEMENTWISE),
    same("rsub", ELEMENTWISE),
    same("scalar_tensor", FACTORY),
    not_modelled("scaled_dot_product_attention", Bound::WorkspaceAndReserve, SDPA),
    same("scatter", LAYOUT),
    same("scatter_add", LAYOUT),
    same("select", VIEW),
    same("sigmoid", ELEMENTWISE),
    same("sigmoid_backward", ELEMENTWISE),
    same("silu", ELEMENTWISE),
    same("silu_backward", ELEMENTWISE),
    same("sin", ELEMENTWISE),
    same("slice", VIEW),
    same("split", VIEW),
    same("split_with_sizes", VIEW),
    same("sqrt", ELEMENTWISE),
    same("squeeze", VIEW),
    same("stack", LAYOUT),
    same("sub", ELEMENTWISE),
    modelled("sum", REDUCTION),
    same("t", VIEW),
    same("tanh", ELEMENTWISE),
    same("tanh_backward", ELEMENTWISE),
    same("threshold_backward", ELEMENTWISE),
    same("to", "calls `_to_copy` where it copies, whose entry counts"),
    same("transpose", VIEW),
    same("tril", ELEMENTWISE),
    same("triu", ELEMENTWISE),
    same("unbind", VIEW),
    same("unflatten", VIEW),
    same("unfold", VIEW),
    same("uniform", ELEMENTWISE),
    same("unsqueeze", VIEW),
    same("view", VIEW),
    same("view_as", VIEW),
    same("where", ELEMENTWISE),
    same("zero", ELEMENTWISE),
    same("zeros", FACTORY),
    same("zeros_like", FACTORY),
];

/// The table's entry for the op named `name` (without `aten::`; an
/// in-place or out variant, `add_` or `add.out`, takes its op's entry).
pub fn entry(name: &str) -> Option<&'static Entry> {
    let base = name.split('.').next().unwrap_or(name);
    let base = base.strip_suffix('_').filter(|b| !b.is_empty() && !b.ends_with('_')).unwrap_or(base);
    TABLE.binary_search_by(|e| e.name.cmp(base)).ok().map(|i| &TABLE[i])
}

/// The class of a recorded op: a convolution's is not modelled where it is
/// transposed (the replay models those of the shapes whose cuDNN
/// workspaces were measured: `replay::cudnn_measured`); an op the table does
/// not name is not modelled, with a workspace's bound.
pub fn class_of(record: &OpRecord) -> Class {
    match &record.op {
        Op::Convolution(c) if c.transposed => Class::NotModelled(Bound::Workspace),
        // An op of a modelled kind whose details could not be read (more
        // than eight dimensions, say) is not modelled.
        // What an RNN's CPU kernels run inside it, and its backward pass,
        // are the RNN's (see `replay::rnn`).
        Op::Other if super::rnn::RnnCall::of(record).is_some() => Class::Modelled,
        // Float attention without a mask or dropout: CUDA's memory-efficient
        // kernel (see `replay::attention`).
        Op::Other if super::attention::AttentionCall::of(record).is_some() => Class::Modelled,
        // Not an op: the ops inside it are classed.
        Op::BackwardNode => Class::Same,
        Op::Other => match entry(&record.name) {
            Some(e) if e.by_name => e.class,
            Some(Entry { class: Class::Modelled, .. }) | None => Class::NotModelled(Bound::Workspace),
            Some(e) => e.class,
        },
        _ => Class::Modelled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_sorted_and_names_each_op_once() {
        for pair in TABLE.windows(2) {
            assert!(pair[0].name < pair[1].name, "{} then {}", pair[0].name, pair[1].name);
        }
    }

    #[test]
    fn variants_take_their_ops_entry_and_unknown_ops_are_not_modelled() {
        assert_eq!(entry("add_").map(|e| e.name), Some("add"));
        assert_eq!(entry("add.out").map(|e| e.name), Some("add"));
        assert_eq!(entry("_softmax").map(|e| e.name), Some("_softmax"));
        assert_eq!(entry("_to_copy").map(|e| e.name), Some("_to_copy"));
        let other = |name: &str| OpRecord { name: name.into(), ..OpRecord::new(0, 1, Op::Other) };
        assert_eq!(class_of(&other("mul_")), Class::Same);
        assert_eq!(class_of(&other("lstm")), Class::NotModelled(Bound::WorkspaceAndReserve));
        assert_eq!(class_of(&other("a_kernel_nobody_listed")), Class::NotModelled(Bound::Workspace));
        assert_eq!(class_of(&OpRecord::new(0, 1, Op::Matmul { in_backward: false })), Class::Modelled);
        // A sum whose details could not be read is not modelled.
        assert_eq!(class_of(&other("sum")), Class::NotModelled(Bound::Workspace));
        // Batch norm's backward pass is modelled from its name: it has no details.
        assert_eq!(class_of(&other("native_batch_norm_backward")), Class::Modelled);
    }
}
