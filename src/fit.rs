//! "Will it fit?" on a GPU, answered on the CPU, before the GPU run.
//!
//! ```rust,no_run
//! # fn step() -> memlab::Result<()> { Ok(()) }
//! // The model and its optimizer on the CPU, registered so that the weights
//! // made before the step count (memlab::register_var_store, register_optimizer).
//! let prediction = memlab::will_it_fit(80 << 30, || step())?;
//! println!("{prediction}"); // fits, with how much to spare, or needing how much more
//! # Ok::<(), memlab::Error>(())
//! ```
//!
//! [`will_it_fit`] runs the training step on the CPU under a recording until
//! its peak is steady (at least two steps, since Adam's state appears in the
//! first; at most [`WillItFit::max_steps`]), then replays the step's
//! allocations, in their order, through the model of libtorch's CUDA caching
//! allocator with what a CUDA run adds: the predicted peak reserved and
//! allocated, and whether the step fits a card of the given memory
//! ([`Fit`](crate::replay::Fit)). Every figure is labelled an estimate.
//!
//! The tensors a step makes are the same on the CPU and on CUDA for most
//! ops. The recording watches those whose kernels allocate otherwise
//! ([`Settings::ops`](crate::events::Settings::ops)), and the prediction
//! models them:
//! - each thread's cuBLAS workspace (and cuBLASLt's), made at its first
//!   matrix product: the caller's forward, autograd's backward (where a
//!   step ran before the steps recorded, that step made them: they live
//!   before the history, after the weights);
//! - the staging buffer of a CUDA sum or mean that splits its inputs over
//!   blocks (a bias gradient's over a batch of 1,021 rows or more), sized as
//!   libtorch 2.11's reductions size it;
//! - cuDNN's workspaces of each convolution: what an H100 and an H200
//!   allocated for the shapes and batches they were measured at, an
//!   estimate for others
//!   ([`cudnn_workspaces`](crate::replay::cudnn_workspaces)); under a card
//!   too small for one, the request fails, the allocator having given its
//!   cache back first, and libtorch walks down cuDNN's next algorithms (one
//!   taking the tensors, for the forward pass then one taking the input and
//!   weight, then one taking none) and keeps the one that ran for that
//!   shape, as the H200's searches recorded; the CPU convolutions' own
//!   scratch (oneDNN's) is left out;
//! - the product CUDA's softmax backward makes of the gradient and the
//!   output, of the softmax's size, which the CPU's does not;
//! - what CUDA's embedding backward makes to sort the indices and sum the
//!   gradient's rows per partial segment, in libtorch's order, as an H100
//!   made it at 60 shapes
//!   ([`embedding_backward_temporaries`](crate::replay::embedding_backward_temporaries));
//!   the CPU kernel's own temporaries are left out;
//! - cuDNN's LSTM and GRU in place of the CPU's (the reserve space, the
//!   workspaces, the input's copy; [`crate::replay::rnn`]), CUDA's
//!   memory-efficient attention for float32 and cuDNN's attention for
//!   halves and bfloat16 in place of the CPU's flash kernel
//!   ([`crate::replay::attention`]), as an H200 allocated them;
//! - the CUDA context and libraries outside the allocator, for the device's
//!   peak.
//!
//! The steps run with every aten op watched, and each op that allocated is
//! looked up in memlab's table of ops (`memlab_core::ops::table`): the same
//! on both devices, modelled, or not modelled. Where an op not modelled
//! ran (a transposed convolution of a shape not measured, attention with a
//! mask), or one the table does not name, the prediction is a range
//! ([`SettingPrediction::range`](crate::replay::SettingPrediction::range)):
//! at its low end those ops add nothing on CUDA and what their CPU kernels
//! made for themselves is not made there; at its high end each holds a
//! workspace of its tensor arguments and outputs while it runs, and the
//! RNNs and attention a reserve of that size as long as their outputs. The
//! ops are named with what one run may add
//! ([`CudaPrediction::unmodelled`](crate::replay::CudaPrediction::unmodelled)),
//! the verdict is "fits" only where the high end fits and "may not fit"
//! ([`Fit::MayNotFit`](crate::replay::Fit::MayNotFit)) where the card lies
//! inside the range, and a range wider than a tenth of the estimate is
//! said to be not predictable. The allocations of an op are those made
//! while it was the innermost op running, to the recorder's microsecond.
//! On an H100, the reserved peak of three models came out to the byte
//! under both settings (BENCHMARKS.md).
//!
//! What was made before the first step counts where memlab can name it: the
//! registered var stores, optimizers and tensors (or the model given to
//! [`WillItFit::of`]), and what the steps free without having made it.
//! Where the model's construction was recorded ([`record_construction`],
//! [`WillItFit::construction`]), the weights are made as a CUDA run makes
//! them, temporaries, LSTM and GRU weights flattened and all: where they
//! land decides what the steps share with them (on the zoo's RNNs, up to
//! 8 % of the peak). A step whose forward pass runs under `tch::autocast`
//! says so ([`WillItFit::autocast`]): on the CPU it would do nothing. Other
//! CPU memory (a dataset in memory, say) is left out: on a GPU run it would
//! stay on the host. The steps are the steps the closure runs, on any thread,
//! from the prediction's start.
//!
//! The steps are real: the model trains for as many steps as the prediction
//! runs (two to five by default). Each step's peak is read from a watch of
//! its own: the CPU's statistics as the program reads them are left as they
//! were. The settings are checked before the first step: a bad one is
//! refused without training.
//!
//! One prediction runs at a time in a process: the steps run under the
//! process's one recording, which a second prediction's steps would join.
//! A prediction asked for while another runs (on another thread, or a
//! `find_batch_size` with `Budget::CudaCard`) waits for it to end; one asked
//! for inside a step being predicted, on the step's own thread, is refused
//! (one asked for on a thread the step starts and waits for would wait for
//! ever: predict from outside the step). The recording sees every
//! thread of the process: what other threads allocate or free while the
//! steps run (a data loader, say) joins the prediction.
//!
//! A step that allocates nothing on the CPU is predicted too: what lived
//! before it and what CUDA adds (the context, the workspaces), said so in
//! the output.
//!
//! The largest batch that fits a card, searched on the CPU:
//! `find_batch_size(Device::Cpu, Budget::CudaCard(80 << 30), max, |batch| step(batch))`
//! (see [`find_batch_size`](crate::find_batch_size)): each try is a
//! prediction of this kind, replayed after every try before it as the
//! search's own process on the GPU would run it (on an H100 it named the
//! batch of the GPU's own search for the three models of BENCHMARKS.md).
//! It names the largest batch whose step fits outright, with the model's
//! error to spare (1 % of its peak), and, where larger ones fit with less
//! to spare or only by the allocator giving its cache back, the largest of
//! those as what may fit
//! ([`BatchSearch::largest_giving_cache_back`](crate::batch_size::BatchSearch::largest_giving_cache_back)).
//!
//! Under its device peak a step may still fit: when a request would pass
//! the card, libtorch gives its cached blocks back and tries again. The
//! model does so too, but whether the room given back serves the request
//! depends on where the driver put each segment, which the model follows
//! by a rule whose room for the libraries' code is an estimate (on an
//! H200 its replay fitted 92 such steps, 3 of which ran out); such a
//! verdict is "may not fit"
//! ([`Fit::FitsGivingCacheBack`](crate::replay::Fit::FitsGivingCacheBack)),
//! with the least card the model fits in as an estimate. A setting may
//! carry a memory fraction of the card (`per_process_memory_fraction:0.5`),
//! checked as libtorch checks it: against a new segment's whole size,
//! before expandable segments map whole pages.
//!
//! The same answer from a file: [`WillItFit::save`] writes the steps it ran
//! with what lived before them, and `memlab replay FILE --as-cuda
//! --capacity 80G` predicts from it, for any card and setting, what this
//! prediction says, without running the steps again (the zoo's entries are
//! kept so, `fixtures/zoo/steps/`, and predicted again in CI). A step
//! recorded under a [`Recording`](crate::Recording) with
//! [`Settings::ops`](crate::events::Settings::ops) and exported is
//! predicted too, without what lived before it. One recorded without
//! `Settings::ops` is not: what CUDA's kernels add and what the CPU's took
//! for themselves cannot be placed, and no bound holds, so the prediction
//! says why ([`CudaPrediction::not_predictable`]) and gives no verdict
//! ([`Fit::NotPredictable`](crate::replay::Fit::NotPredictable)).

use memlab_core::export::Construction;
use memlab_core::replay::{CudaAdditions, CudaPrediction};
use memlab_core::Result;

use crate::named::Model;
use crate::prediction::CpuSteps;

/// Runs `build`, the model's construction on the CPU (its `VarStore`, its
/// layers), under a recording, and returns what it built with what the
/// construction allocated and freed, in order, for
/// [`WillItFit::construction`].
///
/// ```rust,no_run
/// # use tch::nn;
/// let (vs, model) = memlab::record_construction(|| {
///     let vs = nn::VarStore::new(tch::Device::Cpu);
///     let model = nn::lstm(vs.root() / "lstm", 256, 512, Default::default());
///     Ok((vs, model))
/// })?;
/// # let (_, _) = (vs, model);
/// # Ok::<(), memlab::Error>(())
/// ```
///
/// Where a weight lands on the card decides what the steps share with it.
/// A prediction given the construction makes the weights as a CUDA run
/// makes them: in the order they were made, the construction's
/// temporaries in between, and each `nn::lstm`'s and `nn::gru`'s weights
/// copied into one buffer right after they are made, then freed, as tch
/// does on a CUDA `VarStore` (which the CPU does not). Without it, the
/// weights are made one after the other in the order memlab names them.
///
/// What the construction leaves alive that the prediction's model does not
/// name (a dataset read beside it, say) is left out: on a GPU run it would
/// stay on the host. The recording sees every thread of the process, as a
/// prediction's does; it takes the prediction's turn while `build` runs,
/// so `build` cannot ask for a prediction itself.
pub fn record_construction<T>(build: impl FnOnce() -> Result<T>) -> Result<(T, Construction)> {
    crate::prediction::record_construction(build)
}

/// Predicts whether a training step fits a CUDA card of `card` bytes, from
/// CPU runs of `step` (see the [module docs](self)), under libtorch's
/// default allocator settings.
pub fn will_it_fit(card: u64, step: impl FnMut() -> Result<()>) -> Result<CudaPrediction> {
    WillItFit::new(card).run(step)
}

/// [`will_it_fit`] with more to say: other allocator settings, the model,
/// how many steps at most.
#[derive(Default)]
pub struct WillItFit {
    card: Option<u64>,
    settings: Vec<String>,
    model: Option<Model>,
    additions: Option<CudaAdditions>,
    max_steps: Option<usize>,
    save: Option<std::path::PathBuf>,
    construction: Option<Construction>,
    autocast: Option<tch::Kind>,
}

impl WillItFit {
    /// A prediction for a card of `card` bytes.
    pub fn new(card: u64) -> WillItFit {
        WillItFit { card: Some(card), ..WillItFit::default() }
    }

    /// A prediction of the peaks alone, for no card in particular.
    pub fn peaks() -> WillItFit {
        WillItFit::default()
    }

    /// Also predicts under these allocator settings (`PYTORCH_CUDA_ALLOC_CONF`
    /// syntax, `expandable_segments:True`); the defaults are predicted first.
    pub fn setting(mut self, conf: impl Into<String>) -> WillItFit {
        self.settings.push(conf.into());
        self
    }

    /// Names what was made before the first step after `model` rather than
    /// the registry.
    pub fn of(mut self, model: impl Into<Model>) -> WillItFit {
        self.model = Some(model.into());
        self
    }

    /// What CUDA adds, for another card or libtorch than the default's
    /// (libtorch 2.11 on compute capability 9.0).
    pub fn additions(mut self, additions: CudaAdditions) -> WillItFit {
        self.additions = Some(additions);
        self
    }

    /// How the model's LSTM and GRU weights reach cuDNN on CUDA, which a
    /// CPU run cannot say: flattened into one buffer (the default: its
    /// `VarStore` made on CUDA, as tch's `nn::lstm` and `nn::gru` then
    /// flatten them) or copied into one at every forward pass (a model made
    /// on the CPU and moved, or cast after it was made), a buffer of the
    /// weights' size kept for the backward pass.
    pub fn rnn_weights(mut self, weights: memlab_core::replay::rnn::RnnWeights) -> WillItFit {
        let mut additions = self.additions.take().unwrap_or_default();
        additions.rnn_weights = weights;
        self.additions = Some(additions);
        self
    }

    /// The model's construction, recorded by [`record_construction`]: the
    /// weights are made as a CUDA run makes them, where they land and what
    /// holes they leave included.
    pub fn construction(mut self, construction: Construction) -> WillItFit {
        self.construction = Some(construction);
        self
    }

    /// The step's forward pass, its loss included, runs under
    /// `tch::autocast` on CUDA, casting to `kind` (`Kind::Half`, tch's; or
    /// `Kind::BFloat16`), which on a CPU run does nothing. The CPU steps
    /// then run under CPU autocast to `kind`, as CUDA's autocast would:
    /// matrix products, convolutions and attention in `kind`, what libtorch
    /// keeps in float32 (softmax, norms, losses) in float32, each weight cast
    /// once a step and the cast kept for the backward pass. Each backward
    /// function runs without it, and the cast weights are given back at the
    /// first, as CUDA's autocast ends before the backward pass; the
    /// optimizer's step runs under it, which changes nothing for the
    /// element-wise ops of libtorch's optimizers. A loss computed outside
    /// `tch::autocast` is predicted as if inside it; the ops libtorch's CPU
    /// and CUDA autocast lists differ on follow the CPU's; the step's own
    /// threads, if it starts any, run without it.
    pub fn autocast(mut self, kind: tch::Kind) -> WillItFit {
        self.autocast = Some(kind);
        self
    }

    /// Runs at most `steps` steps (default 5, at least 2) waiting for a
    /// steady peak.
    pub fn max_steps(mut self, steps: usize) -> WillItFit {
        self.max_steps = Some(steps.max(2));
        self
    }

    /// Also writes the steps' recording to `path` (a snapshot pickle), with
    /// what lived before them: `memlab replay FILE --as-cuda` predicts from
    /// it what this prediction says, and for other cards and settings,
    /// without running the steps again. Written before the prediction
    /// replays them, so a step the prediction refuses is kept too.
    pub fn save(mut self, path: impl Into<std::path::PathBuf>) -> WillItFit {
        self.save = Some(path.into());
        self
    }

    /// Runs `step` on the CPU until its peak is steady, then predicts.
    pub fn run(self, step: impl FnMut() -> Result<()>) -> Result<CudaPrediction> {
        let steps = CpuSteps {
            card: self.card,
            settings: self.settings,
            model: self.model.unwrap_or_else(Model::registered),
            additions: self.additions,
            max_steps: self.max_steps.unwrap_or(5),
            save: self.save,
            construction: self.construction,
            autocast: self.autocast.map(memlab_tch::dtype),
        };
        steps.predict(step)
    }
}
