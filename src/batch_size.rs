//! "Will it fit?": the largest batch size whose real training step stays
//! within a memory budget, found by trying batch sizes, with out-of-memory
//! failures caught so the process stays healthy.
//!
//! ```rust,no_run
//! let search = memlab::find_batch_size(memlab::Device::Cpu, memlab::Budget::Bytes(2 << 30), 4096, |batch| {
//!     // one real training step with `batch` samples
//!     Ok(())
//! })?;
//! println!("{search}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`find_batch_size`] binary-searches the largest
//! batch whose real step stays within a byte budget or the free CUDA memory,
//! catching out-of-memory failures so the process stays healthy; it keeps its
//! own out-of-memory panics quiet and lets every other panic reach your panic
//! hook. Its deliberate failures are neither counted nor written by the
//! out-of-memory recorder: its result says why its first failing batch failed
//! ([`BatchSearch::first_oom`], the same verdict). While one of its tries runs,
//! every failure on its device is taken as the try's, on any thread (the
//! autograd engine runs a CUDA backward pass on threads of its own).
//! With [`Budget::CudaCard`] the search needs no GPU: each try's steps run
//! on the CPU and are replayed as CUDA's ([`will_it_fit`](crate::will_it_fit)),
//! and the largest batch predicted to fit the card is the answer (an estimate).
//! A batch whose predicted peak leaves less than the model's error to spare
//! ([`MODEL_ERROR_PERCENT`]), or that fits only by the allocator giving its
//! cache back, may fit: the largest of those is named beside the answer
//! ([`BatchSearch::largest_giving_cache_back`]).
//! Each try is replayed as the search's own process would run it on the GPU:
//! after every try before it, with an empty cache between them, each try
//! that ran out cut where it did. What outlives a try (the optimizer's
//! state the first made, a try's gradients) keeps the segments it was made
//! in, holes and all.
//! [`model_size`](crate::model_size) measures what one batch takes.
//! `cargo run --release --example model_size`.
//!
//! [`find_batch_size`] is the one-line form of a [`BatchSizeSearch`], which
//! says more: [`of(model)`](BatchSizeSearch::of) names the memory the first
//! failing try's diagnosis lists ([`FirstOom::holders`]; the registry's by
//! default), and, with [`Budget::CudaCard`], what was made before each try's
//! steps.
//!
//! ```rust,no_run
//! # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! use memlab::{BatchSizeSearch, Budget, Device};
//!
//! let search = BatchSizeSearch::new(Device::Cpu, Budget::Bytes(2 << 30)).of(&vs).run(4096, |batch| {
//!     // one real training step with `batch` samples
//!     Ok(())
//! })?;
//! if let Some(oom) = &search.first_oom {
//!     println!("batch {} ran out; the largest holders: {:?}", oom.batch_size, oom.holders.largest(3));
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use serde::Serialize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use memlab_core::oom::Failure;
use memlab_core::profiler::PeakWatch;
use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::{Device, Error, Result};
use memlab_tch::BACKEND;

use crate::diagnosis::{diagnose, holders};
use crate::named::{Model, WeakModel};
use crate::prediction::{CpuSteps, Steps};
use memlab_core::oom::{Diagnosis, Holders};

/// How much memory [`find_batch_size`] may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Budget {
    /// At most this many bytes allocated above what was allocated before each try.
    Bytes(i64),
    /// What the CUDA device has free now (driver's free bytes plus the cache's
    /// unused bytes).
    FreeDeviceMemory,
    /// A CUDA card of this many bytes, searched without a GPU: each try runs
    /// its steps on the CPU and is replayed as CUDA's (see
    /// [`will_it_fit`](crate::will_it_fit)); a try fits when the step is
    /// predicted to fit the card without the allocator giving its cache
    /// back (whether that would leave room depends on the driver's placement
    /// of segments, which is not modelled: the search never names a batch
    /// that counts on it). The device given is the CPU; a try's figure is
    /// the card it is predicted to need (an estimate).
    CudaCard(u64),
}

/// What [`find_batch_size`] tried and found.
#[derive(Clone, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct BatchSearch {
    /// The largest batch size that ran within the budget (`None`: not even 1).
    /// With [`Budget::CudaCard`], predicted to fit with the model's error
    /// ([`MODEL_ERROR_PERCENT`]) to spare, without the allocator giving its
    /// cache back, and below every size that does not.
    pub largest: Option<usize>,
    /// With [`Budget::CudaCard`], where a larger batch fits the card in the
    /// model, but only by the allocator giving its cached blocks back or
    /// with less than the model's error to spare: the largest such batch,
    /// the model's own answer. An estimate that may run out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_giving_cache_back: Option<usize>,
    /// The budget in bytes.
    pub budget: i64,
    /// Every try, in the order they ran.
    pub tried: Vec<Try>,
    /// The first try that ran out of memory, and why.
    pub first_oom: Option<FirstOom>,
}

/// One try of [`find_batch_size`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Try {
    /// The batch size tried.
    pub batch_size: usize,
    /// Its peak in bytes, or why it failed.
    pub outcome: std::result::Result<i64, String>,
    /// With [`Budget::CudaCard`]: its peak is over the budget, but it fits
    /// the card in the model by the allocator giving its cache back.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fits_giving_cache_back: bool,
    /// With [`Budget::CudaCard`]: its predicted peak is within the budget
    /// by less than the model's error ([`MODEL_ERROR_PERCENT`] of it), so
    /// it may fit.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub within_error: bool,
}

/// The first try that ran out of memory.
#[derive(Clone, Debug, Serialize)]
pub struct FirstOom {
    /// Its batch size.
    pub batch_size: usize,
    /// Why it failed: the out-of-memory recorder's verdict, with its figures.
    pub diagnosis: Diagnosis,
    /// What held the device's memory then: the storages of the search's
    /// model by name (see [`BatchSizeSearch::of`]), largest first, and the
    /// bytes they leave unnamed (a search lists no sites).
    pub holders: Holders,
}

/// Finds the largest batch size in `1..=max` whose `step` stays within
/// `budget` on `device` (`BatchSizeSearch::new(device, budget).run(max,
/// step)`: see [`BatchSizeSearch`] for more), by doubling and then binary
/// search over real runs of `step` (like
/// accelerate's `find_executable_batch_size`, but measured: a try fails when
/// its peak exceeds the budget or when it panics or errs, e.g. CUDA out of
/// memory). Failures are caught and the CUDA cache emptied after each try, so
/// the process stays healthy. Any `max` works, `usize::MAX` included.
///
/// The out-of-memory panics of the tries are caught and not printed: a
/// try's panic is taken for one when the allocator reported a failure of
/// the try's device while it ran (whatever libtorch's message says), or,
/// for failures no allocator reports (cuBLAS workspaces, say), when its
/// message says memory ran out. Every other panic (of another thread, or a
/// try's panic for another reason) still reaches the panic hook that was in
/// place when the search began, which is in place again when it returns.
pub fn find_batch_size(
    device: Device,
    budget: Budget,
    max: usize,
    step: impl FnMut(usize) -> std::result::Result<(), Box<dyn std::error::Error>>,
) -> Result<BatchSearch> {
    BatchSizeSearch::new(device, budget).run(max, step)
}

/// [`find_batch_size`] with more to say: what the search names memory after
/// (see the [module docs](self)).
#[derive(Debug)]
#[must_use = "nothing is searched until `run` is called"]
pub struct BatchSizeSearch {
    device: Device,
    budget: Budget,
    model: Model,
    /// With `Budget::CudaCard`: how the step is predicted.
    prediction: Predicted,
}

/// How a search against a CUDA card predicts each try.
#[derive(Debug, Default)]
struct Predicted {
    construction: Option<memlab_core::export::Construction>,
    setting: Option<String>,
    autocast: Option<memlab_core::DType>,
}

impl BatchSizeSearch {
    /// A search on `device` within `budget`, naming memory after the registry.
    pub fn new(device: Device, budget: Budget) -> BatchSizeSearch {
        BatchSizeSearch { device, budget, model: Model::registered(), prediction: Predicted::default() }
    }

    /// Names memory after `model` (or a var store, `of(&vs)`) rather than the
    /// registry (see [`Model`]): the holders of the first try that runs out
    /// of memory ([`FirstOom::holders`], and the largest of them in its
    /// advice), and with [`Budget::CudaCard`], what was made before each
    /// try's steps (as [`WillItFit::of`](crate::WillItFit::of) does).
    pub fn of(mut self, model: impl Into<Model>) -> BatchSizeSearch {
        self.model = model.into();
        self
    }

    /// With [`Budget::CudaCard`], the model's construction, recorded by
    /// [`record_construction`](crate::record_construction): each try's
    /// weights are made as a CUDA run makes them (as
    /// [`WillItFit::construction`](crate::WillItFit::construction) does).
    pub fn construction(mut self, construction: memlab_core::export::Construction) -> BatchSizeSearch {
        self.prediction.construction = Some(construction);
        self
    }

    /// With [`Budget::CudaCard`], the allocator settings the GPU's process
    /// runs under (`PYTORCH_CUDA_ALLOC_CONF` syntax,
    /// `expandable_segments:True`): each try is predicted under them rather
    /// than libtorch's defaults. A memory fraction among them
    /// (`per_process_memory_fraction:0.5`) is of the card: the allocator's
    /// limit is then that share of it, checked as libtorch checks it. A
    /// setting libtorch would refuse is refused before the first try.
    pub fn setting(mut self, conf: impl Into<String>) -> BatchSizeSearch {
        self.prediction.setting = Some(conf.into());
        self
    }

    /// With [`Budget::CudaCard`], the step's forward pass runs under
    /// `tch::autocast` on CUDA, casting to `kind`: each try's CPU steps run
    /// under CPU autocast as [`WillItFit::autocast`](crate::WillItFit::autocast)
    /// runs them.
    pub fn autocast(mut self, kind: tch::Kind) -> BatchSizeSearch {
        self.prediction.autocast = Some(memlab_tch::dtype(kind));
        self
    }

    /// Searches `1..=max` with `step` as [`find_batch_size`] does. Fails
    /// before any try when an optimizer of the model could not be read.
    pub fn run(
        self,
        max: usize,
        mut step: impl FnMut(usize) -> std::result::Result<(), Box<dyn std::error::Error>>,
    ) -> Result<BatchSearch> {
        let BatchSizeSearch { device, budget, model, prediction } = self;
        // Walked at a try's failure, inside the allocator, as the
        // out-of-memory recorder walks its model: without waiting for a lock.
        let named = Arc::new(model.downgrade()?);
        let budget = match budget {
            Budget::Bytes(b) => b,
            Budget::CudaCard(card) => {
                if device != Device::Cpu {
                    return Err(Error::InvalidArgument(
                        "Budget::CudaCard searches on the CPU: give Device::Cpu and a step that runs there".to_string(),
                    ));
                }
                let settings: Vec<String> = prediction.setting.iter().cloned().collect();
                memlab_core::replay::check_settings_as(&settings, crate::prediction::process_libtorch(), Some(card))?;
                if let Some(dtype) = prediction.autocast {
                    drop(memlab_tch::ops::cpu_autocast(dtype)?);
                }
                // One prediction at a time in the process, for the whole search.
                let _turn = crate::prediction::Turn::take()?;
                let _quiet = quiet_oom_panics::install();
                let mut searched = Searched::default();
                return search(i64::try_from(card).unwrap_or(i64::MAX), max, |n| {
                    predicted_need(card, &model, &prediction, &mut step, n, &mut searched)
                });
            }
            Budget::FreeDeviceMemory => match device {
                Device::Cuda(i) => {
                    let (free, _) = memlab_tch::cuda_mem_info(i)?;
                    let s = memlab_tch::device_stats(device)?;
                    free as i64 + s.reserved_bytes.all.current - s.allocated_bytes.all.current
                }
                Device::Cpu => {
                    return Err(Error::InvalidArgument(
                        "FreeDeviceMemory is a CUDA budget; give the CPU a Budget::Bytes".to_string(),
                    ));
                }
            },
        };
        let _quiet = quiet_oom_panics::install();
        search(budget, max, |n| {
            let (outcome, oom) = try_once(device, &named, &mut step, n);
            (outcome, oom, None)
        })
    }
}

/// What a try's first out-of-memory failure was: why, and what held the memory.
type Diagnosed = (Diagnosis, Holders);

/// One try's outcome, what ran out in it, and whether it only may fit.
type Tried = (std::result::Result<i64, String>, Option<Diagnosed>, Option<MayFit>);

/// Why a predicted try only may fit the card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MayFit {
    /// It fits in the model only by the allocator giving its cache back.
    GivingCacheBack,
    /// Its predicted peak is within the card by less than the model's
    /// error ([`MODEL_ERROR_PERCENT`] of it).
    WithinError,
}

/// How far under a GPU's peak reserved a prediction may fall, in percent:
/// the band will-it-fit holds to on the zoo of models it was measured on
/// ([−1 %, +2 %]; all 102 zoo entries lie in it). A batch whose predicted
/// peak leaves less than this to spare is named as one that may fit, not
/// as fitting.
pub const MODEL_ERROR_PERCENT: u64 = 1;

/// The search itself: doubling, then halving the gap, over `try_n`'s
/// outcomes (a figure within `budget` fits). Where some tries fit only by
/// the allocator giving its cache back, the search finds the largest of
/// those too: it doubles and halves the gap over them, then halves the gap
/// between the largest that fits outright and the least that does not,
/// each size tried once.
fn search(budget: i64, max: usize, mut try_n: impl FnMut(usize) -> Tried) -> Result<BatchSearch> {
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    let mut search =
        BatchSearch { largest: None, largest_giving_cache_back: None, budget, tried: Vec::new(), first_oom: None };
    // The sizes known to fit outright, and the least known not to.
    let (outright, not_outright) = (RefCell::new(Vec::new()), Cell::new(usize::MAX));
    let mut known: HashMap<usize, (bool, bool)> = HashMap::new();
    // (fits outright, fits at all) for size `n`.
    let mut run = |n: usize| -> (bool, bool) {
        if let Some(&k) = known.get(&n) {
            return k;
        }
        let (outcome, oom, may) = try_n(n);
        if search.first_oom.is_none() {
            search.first_oom = oom.map(|(diagnosis, holders)| FirstOom { batch_size: n, diagnosis, holders });
        }
        let may = may.filter(|_| outcome.is_ok());
        let fits = matches!(outcome, Ok(peak) if peak <= budget) && may.is_none();
        search.tried.push(Try {
            batch_size: n,
            outcome,
            fits_giving_cache_back: may == Some(MayFit::GivingCacheBack),
            within_error: may == Some(MayFit::WithinError),
        });
        if fits {
            outright.borrow_mut().push(n);
        } else {
            not_outright.set(not_outright.get().min(n));
        }
        known.insert(n, (fits, fits || may.is_some()));
        (fits, fits || may.is_some())
    };
    // Double from 1 until a try fails, so that nothing far above the answer
    // is tried (on the CPU a too-large try is not an error but a swap storm);
    // then halve the gap. `fails` is the smallest size known to fail, if any.
    let (mut fits, mut fails) = (0usize, None::<usize>);
    let mut n = 1;
    while n <= max {
        if !run(n).1 {
            fails = Some(n);
            break;
        }
        fits = n;
        if n == max {
            break;
        }
        n = n.saturating_mul(2).min(max);
    }
    if let Some(mut fails) = fails {
        while fails - fits > 1 {
            let n = fits + (fails - fits) / 2;
            if run(n).1 {
                fits = n;
            } else {
                fails = n;
            }
        }
    }
    // Those that fit only giving cache back: the largest that fits outright
    // below them. A size that fits outright above one that does not (the
    // layout's luck at one batch) is not counted on: the search goes on
    // below the least that does not.
    // (`usize::MAX`: none failed, or only the largest size there is.)
    let least_failed = not_outright.get();
    let below = outright.borrow().iter().copied().filter(|&n| least_failed == usize::MAX || n < least_failed).max();
    let (mut low, mut high) = (below.unwrap_or(0), least_failed.min(fits.saturating_add(1)));
    while high > low.saturating_add(1) {
        let n = low + (high - low) / 2;
        if run(n).0 {
            low = n;
        } else {
            high = n;
        }
    }
    search.largest = (low > 0).then_some(low);
    search.largest_giving_cache_back = (fits > low).then_some(fits);
    Ok(search)
}

/// What a search on the CPU keeps between its tries: the history of the
/// tries so far as the search's process on the GPU would have run them.
#[derive(Default)]
struct Searched {
    tries: Option<Steps>,
}

/// One try against a CUDA card, on the CPU: the least card the step at
/// batch `n` is predicted to need (its device peak where that fits), or why
/// it could not be predicted.
///
/// A try is predicted as the search's process would run it: after every
/// try before it, with the cache given back between them (as a search on
/// the GPU does). Each try's blocks that outlive it (the first try's
/// optimizer state, made among its temporaries; the last try's gradients)
/// keep the segments they were made in, holes and all, for the tries after.
/// A try predicted to run out is cut where it ran out, what its failed step
/// held given back ([`Steps::ran_out_at`]).
fn predicted_need(
    card: u64,
    model: &Model,
    prediction: &Predicted,
    step: &mut impl FnMut(usize) -> std::result::Result<(), Box<dyn std::error::Error>>,
    n: usize,
    search: &mut Searched,
) -> Tried {
    use memlab_core::replay::Fit;
    // A try that panics (the host out of memory at a large batch, a shape
    // bug) fails, as a GPU try would; its panic is reported as usual unless
    // it says memory ran out. Where CUDA is there, `tch::autocast` turns its
    // autocast on even for a CPU step, and leaves it on if the step panics.
    let autocast = memlab_tch::ops::CudaAutocast::now();
    let predicted = catch_unwind(AssertUnwindSafe(|| {
        quiet_oom_panics::trying(u64::MAX, || {
            let cpu = CpuSteps {
                card: Some(card),
                settings: prediction.setting.iter().cloned().collect(),
                model: model.clone(),
                additions: None,
                max_steps: 3,
                save: None,
                construction: None,
                autocast: None,
            };
            let (construction, autocast) = (prediction.construction.as_ref(), prediction.autocast);
            let steps = Steps::record(cpu.max_steps, &cpu.model, construction, autocast, || {
                step(n).map_err(|e| Error::InvalidArgument(format!("the step at batch {n} failed: {e}")))
            })?;
            let steps = match search.tries.take() {
                Some(earlier) => steps.after(&earlier),
                None => steps,
            };
            let predicted = cpu.predict_from(&steps);
            // The process goes on from where this try left it.
            let ran_out = match &predicted {
                Ok(p) => match p.settings.last().and_then(|s| s.fit.as_ref()) {
                    Some(Fit::DoesNotFit { at_us, .. } | Fit::NoCard { at_us, .. }) => Some(*at_us),
                    _ => None,
                },
                Err(_) => None,
            };
            search.tries = Some(match ran_out {
                Some(at_us) => steps.ran_out_at(at_us),
                None => steps,
            });
            predicted
        })
    }))
    .unwrap_or_else(|panic| {
        let message = panic_message(&*panic).unwrap_or("a panic");
        Err(Error::InvalidArgument(format!("the step at batch {n} panicked: {message}")))
    });
    if let Ok(autocast) = autocast {
        let _ = autocast.restore();
    }
    // The setting asked for comes after libtorch's defaults.
    let mut may = None;
    let need = predicted.map_err(|e| e.to_string()).and_then(|p| {
        let s = p.settings.last().ok_or("the prediction has no setting")?;
        may = match s.fit {
            Some(Fit::FitsGivingCacheBack { .. }) => Some(MayFit::GivingCacheBack),
            Some(Fit::Fits { spare }) if spare < (s.peak_reserved * MODEL_ERROR_PERCENT).div_ceil(100) => {
                Some(MayFit::WithinError)
            }
            _ => None,
        };
        Ok(match &s.fit {
            Some(Fit::Fits { .. }) | None => s.peak_device,
            // It fits only if the cache given back leaves room, which the
            // driver's placement decides: over the budget, marked so.
            Some(Fit::FitsGivingCacheBack { .. }) => s.peak_device.max(card + 1),
            Some(Fit::DoesNotFit { needing, .. }) => card + needing.max(&1),
            // The card lies inside the range: over the budget (its high end,
            // or under a fraction of the card, just over the card), so that
            // the search never names a batch that may run out.
            Some(Fit::MayNotFit { .. }) => s.range.map_or(s.peak_device, |r| r.high.device).max(card + 1),
            // No card holds it: the most any figure can say.
            Some(Fit::NoCard { .. }) => u64::MAX,
            // The steps' recording watches its ops: never so here.
            Some(Fit::NotPredictable) => return Err(p.not_predictable.clone().unwrap_or_default()),
        })
    });
    (need.map(|b| i64::try_from(b).unwrap_or(i64::MAX)), None, may)
}

/// Keeps the panics of a batch search's own out-of-memory tries from being
/// printed. While searches run, the panic hook is a wrapper that passes every
/// panic on to the hook that was in place before, except an out-of-memory
/// panic raised on a thread while it runs a try; when the last search ends,
/// that hook is put back. Panics of every other thread, and of a search's
/// thread outside its tries, are reported as always.
mod quiet_oom_panics {
    use memlab_core::sync::LockExt;
    use std::cell::Cell;
    use std::panic::PanicHookInfo;
    use std::sync::{Arc, Mutex};

    type Hook = Arc<dyn Fn(&PanicHookInfo<'_>) + Send + Sync>;

    thread_local! {
        /// The ticket of the try this thread runs (0: none).
        static TRYING: Cell<u64> = const { Cell::new(0) };
    }

    /// The searches running, and the hook that was in place before the first.
    static SEARCHES: Mutex<(usize, Option<Hook>)> = Mutex::new((0, None));

    /// The wrapper is in place while the guard lives.
    pub(super) struct Installed(());

    pub(super) fn install() -> Installed {
        let mut searches = SEARCHES.locked();
        if searches.0 == 0 {
            let previous: Hook = Arc::from(std::panic::take_hook());
            let passed = previous.clone();
            std::panic::set_hook(Box::new(move |info| {
                let ticket = TRYING.try_with(Cell::get).unwrap_or(0);
                if !(ticket != 0 && (memlab_core::oom::try_failed(ticket) || is_oom(info))) {
                    passed(info);
                }
            }));
            searches.1 = Some(previous);
        }
        searches.0 += 1;
        Installed(())
    }

    impl Drop for Installed {
        fn drop(&mut self) {
            let mut searches = SEARCHES.locked();
            searches.0 -= 1;
            if searches.0 == 0
                && let Some(previous) = searches.1.take()
            {
                drop(std::panic::take_hook());
                std::panic::set_hook(Box::new(move |info| previous(info)));
            }
        }
    }

    /// Marks the calling thread as running the try with `ticket` while `f` runs.
    pub(super) fn trying<R>(ticket: u64, f: impl FnOnce() -> R) -> R {
        struct Reset(u64);
        impl Drop for Reset {
            fn drop(&mut self) {
                let _ = TRYING.try_with(|t| t.set(self.0));
            }
        }
        let _reset = Reset(TRYING.try_with(|t| t.replace(ticket)).unwrap_or(0));
        f()
    }

    fn is_oom(info: &PanicHookInfo<'_>) -> bool {
        super::is_out_of_memory(super::panic_message(info.payload()).unwrap_or(""))
    }
}

/// Whether a failure message says memory ran out (libtorch's CUDA message,
/// and those of CUDA libraries that fail outside its allocator).
fn is_out_of_memory(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("out of memory") || lower.contains("outofmemory") || lower.contains("failed to allocate")
}

/// One try: its peak or why it failed, and the diagnosis of its first
/// out-of-memory failure, with the holders named after `model` (kept
/// quiet: not counted, written or printed).
fn try_once(
    device: Device,
    model: &Arc<WeakModel>,
    step: &mut impl FnMut(usize) -> std::result::Result<(), Box<dyn std::error::Error>>,
    n: usize,
) -> (std::result::Result<i64, String>, Option<Diagnosed>) {
    let _ = memlab_tch::empty_cache();
    let watch = match PeakWatch::start(&BACKEND, device) {
        Ok(watch) => watch,
        Err(e) => return (Err(e.to_string()), None),
    };
    memlab_tch::oom::watch_cuda();
    let model = model.clone();
    let first_failure = move |failure: &Failure| {
        let holders = holders(failure.device, &model.now(), false);
        (diagnose(failure, Some(&holders)).0, holders)
    };
    let autocast = memlab_tch::ops::CudaAutocast::now();
    let (ran, oom) = memlab_core::oom::quietly(device, first_failure, |ticket| {
        quiet_oom_panics::trying(ticket, || catch_unwind(AssertUnwindSafe(|| step(n))))
    });
    // A try that failed inside `tch::autocast` left it on, and its cast
    // weights cached, for every later try: put back as the try found it.
    if let Ok(autocast) = autocast {
        let _ = autocast.restore();
    }
    let measured = watch.finish().map_err(|e| e.to_string());
    let _ = memlab_tch::empty_cache();
    (outcome(ran, measured), oom)
}

type Ran = std::thread::Result<std::result::Result<(), Box<dyn std::error::Error>>>;
type Measured = std::result::Result<(memlab_core::RawStats, memlab_core::RawStats), String>;

fn outcome(ran: Ran, measured: Measured) -> std::result::Result<i64, String> {
    match ran {
        Ok(Ok(())) => {
            let (start, end) = measured?;
            Ok(end.to_device_stats().allocated_bytes.all.peak - start.to_device_stats().allocated_bytes.all.current)
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(panic_message(&*panic).unwrap_or("the step panicked").to_string()),
    }
}

/// A panic's message, where its payload is one (`panic!` with a string).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied())
}

displayed_as_text!(BatchSearch);

impl Render for BatchSearch {
    fn document(&self) -> Document {
        let mut doc = Document::new();
        match self.largest {
            Some(n) => doc.heading(format!("largest batch size within {}: {n}", Cell::bytes(self.budget))),
            None => doc.heading(format!("no batch size fits within {}", Cell::bytes(self.budget))),
        };
        if let Some(n) = self.largest_giving_cache_back {
            doc.line(format!(
                "Up to {n} may fit: the model fits it, but with less than its error ({MODEL_ERROR_PERCENT} % of \
                 the peak) to spare or only by the allocator giving its cached blocks back (an estimate)."
            ));
        }
        let mut table = Table::new(vec![
            Column::new("batch", Layout::Figure).min_width(7),
            Column::new("peak", Layout::Figure).min_width(9),
            Column::new("outcome", Layout::Text).max_width(100),
        ]);
        for Try { batch_size: n, outcome, fits_giving_cache_back, within_error } in &self.tried {
            match outcome {
                Ok(peak) => {
                    let outcome = match (*peak <= self.budget, fits_giving_cache_back, within_error) {
                        (true, _, true) => "within the budget, by less than the model's error: may fit",
                        (true, ..) => "within the budget",
                        (false, true, _) => "over the budget; may fit giving cache back",
                        (false, ..) => "over the budget",
                    };
                    table.row([Cell::count(*n), Cell::bytes(*peak), Cell::text(outcome)])
                }
                Err(e) => {
                    // libtorch's messages run on with a C++ stack trace; the first sentence says it.
                    let first = e.split(['\n']).next().unwrap_or("").split("\\n").next().unwrap_or("");
                    let short: String = first.chars().take(160).collect();
                    table.row([Cell::count(*n), Cell::Empty, Cell::text(format!("failed: {short}"))])
                }
            };
        }
        doc.table(table);
        if let Some(FirstOom { batch_size: n, diagnosis: why, .. }) = &self.first_oom {
            doc.blank();
            doc.line(format!("Batch {n} ran out of memory on {}. Verdict: {}.", why.device, why.verdict.title()));
            doc.indented(2, why.advice.clone());
        }
        doc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A try that fits outright (`Some(true)`), only giving cache back
    /// (`Some(false)`) or not at all (`None`), against a budget of 100.
    fn tried(fits: Option<bool>) -> Tried {
        match fits {
            Some(true) => (Ok(100), None, None),
            Some(false) => (Ok(101), None, Some(MayFit::GivingCacheBack)),
            None => (Ok(200), None, None),
        }
    }

    /// Batch 13 fits outright where 5 to 12 fit only giving cache back (the
    /// layout's luck at one size, as a predicted recommender showed): the
    /// outright answer stays below the least that does not fit outright.
    #[test]
    fn a_size_that_fits_outright_above_one_that_does_not_is_not_counted_on() {
        let search = search(100, 64, |n| {
            tried(match n {
                1..=4 | 13 => Some(true),
                5..=12 => Some(false),
                _ => None,
            })
        })
        .unwrap();
        assert_eq!((search.largest, search.largest_giving_cache_back), (Some(4), Some(13)));
    }

    /// A size predicted within the budget by less than the model's error
    /// may fit: not named as fitting, but as what may.
    #[test]
    fn a_size_within_the_models_error_of_the_budget_only_may_fit() {
        let search = search(100, 64, |n| match n {
            1..=20 => (Ok(90), None, None),
            21..=24 => (Ok(100), None, Some(MayFit::WithinError)),
            _ => (Ok(200), None, None),
        })
        .unwrap();
        assert_eq!((search.largest, search.largest_giving_cache_back), (Some(20), Some(24)));
        let text = search.to_string();
        assert!(text.contains("within the budget, by less than the model's error: may fit"), "{text}");
        assert!(text.contains("Up to 24 may fit: the model fits it, but with less than its error"), "{text}");
    }
}
