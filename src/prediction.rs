//! A CUDA run predicted from CPU runs of a step, shared by the tools that
//! answer "will it fit?" ([`will_it_fit`](crate::will_it_fit) and
//! [`find_batch_size`](crate::find_batch_size)'s `Budget::CudaCard`): the
//! steps under a recording until their peak is steady, then memlab-core's
//! replay of their allocations as CUDA's.

use memlab_core::events::Action;
use memlab_core::events::Settings;
use memlab_core::export::{Construction, Made, Snapshot, TraceEntry};
use memlab_core::replay::{predict_cuda, CudaAdditions, CudaPrediction, PredictOptions};
use memlab_core::{Device, Error, Result, TensorKind};

use crate::named::Model;

/// What to predict, and from how many steps.
pub(crate) struct CpuSteps {
    /// The card's memory, if any.
    pub(crate) card: Option<u64>,
    /// Settings besides libtorch's defaults, which are predicted first.
    pub(crate) settings: Vec<String>,
    /// What names the memory made before the first step.
    pub(crate) model: Model,
    /// What CUDA adds, where not the default's.
    pub(crate) additions: Option<CudaAdditions>,
    /// The most steps run waiting for a steady peak (at least 2).
    pub(crate) max_steps: usize,
    /// Where to write the steps' recording, if anywhere.
    pub(crate) save: Option<std::path::PathBuf>,
    /// The model's construction, where recorded.
    pub(crate) construction: Option<Construction>,
    /// The type CUDA's autocast casts the forward pass to, where it runs.
    pub(crate) autocast: Option<memlab_core::DType>,
}

impl CpuSteps {
    /// Runs `step` on the CPU until its peak is steady, then predicts. The
    /// settings are checked first: a bad one is refused before any step runs.
    pub(crate) fn predict(self, step: impl FnMut() -> Result<()>) -> Result<CudaPrediction> {
        memlab_core::replay::check_settings_as(&self.settings, process_libtorch(), self.card)?;
        let _turn = Turn::take()?;
        let steps = Steps::record(self.max_steps, &self.model, self.construction.as_ref(), self.autocast, step)?;
        if let Some(path) = &self.save {
            steps.write(path, self.additions.clone())?;
        }
        self.predict_from(&steps)
    }

    /// Predicts from steps already recorded.
    pub(crate) fn predict_from(self, steps: &Steps) -> Result<CudaPrediction> {
        let settings =
            std::iter::once(String::new()).chain(self.settings.into_iter().filter(|s| !s.is_empty())).collect();
        let options = PredictOptions {
            capacity: self.card,
            settings,
            additions: self.additions,
            live_before: steps.live_before.clone(),
            workspaces_after: steps.workspaces_after,
            construction: steps.construction.clone(),
            empty_cache_at_us: steps.empty_cache_at_us,
            libtorch: process_libtorch(),
        };
        let mut prediction = predict_cuda("the step's CPU run", &steps.snapshot, &options)?;
        prediction.cpu_step_peaks = steps.peaks.clone();
        Ok(prediction)
    }
}

/// The process's one CPU-step prediction at a time. A prediction runs its
/// steps under the process's one recording and reads the CPU allocator's
/// peak: a second running beside it would add its allocations to the
/// first's history, and the first's to its own. A second waits for the
/// first to end, on any thread and in any copy of memlab in the process.
///
/// The turn is held while the user's steps run, the one place memlab waits
/// on user code while it holds something: a step that asks for a prediction
/// itself (on the same thread) is refused rather than left waiting on its
/// own turn.
pub(crate) struct Turn(());

struct Turns {
    holder: std::sync::Mutex<Option<std::thread::ThreadId>>,
    freed: std::sync::Condvar,
}

memlab_core::process::process_wide! {
    static TURNS: Turns = Turns { holder: std::sync::Mutex::new(None), freed: std::sync::Condvar::new() };
}

impl Turn {
    /// Waits for the turn.
    pub(crate) fn take() -> Result<Turn> {
        use memlab_core::sync::LockExt;
        let me = std::thread::current().id();
        let mut holder = TURNS.holder.locked();
        if *holder == Some(me) {
            return Err(Error::InvalidArgument(
                "a prediction (will_it_fit, or find_batch_size with Budget::CudaCard) was asked for inside the \
                 step of another on the same thread: predict the step from outside it"
                    .into(),
            ));
        }
        while holder.is_some() {
            holder = TURNS.freed.wait(holder).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *holder = Some(me);
        Ok(Turn(()))
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        use memlab_core::sync::LockExt;
        *TURNS.holder.locked() = None;
        TURNS.freed.notify_one();
    }
}

/// CPU steps' history, with what lived before it.
pub(crate) struct Steps {
    /// The steps' events and ops alone, the CPU's history at `cpu`.
    snapshot: Snapshot,
    cpu: usize,
    /// What lived before the steps (address and bytes, in the order a CUDA
    /// run made them), and after how many of them a step before made its
    /// cuBLAS workspaces (`PredictOptions::workspaces_after`).
    live_before: Vec<(u64, u64)>,
    workspaces_after: Option<usize>,
    /// The model's construction, where recorded: made before `live_before`.
    construction: Option<Construction>,
    /// Of them, the gradients (a step frees them before its backward pass),
    /// and when the first step freed the first of them.
    gradients: Vec<u64>,
    gradients_freed_us: Option<u64>,
    /// Where the allocator's cache was given back, when these steps follow
    /// others (`PredictOptions::empty_cache_at_us`).
    empty_cache_at_us: Option<u64>,
    /// When the first step began.
    start_us: u64,
    /// The CPU's peak allocated in each step.
    pub(crate) peaks: Vec<u64>,
}

impl Steps {
    /// Runs `step` on the CPU under a recording until its peak is steady
    /// (`max_steps` at most, at least 2).
    pub(crate) fn record(
        max_steps: usize,
        model: &Model,
        construction: Option<&Construction>,
        autocast: Option<memlab_core::DType>,
        mut step: impl FnMut() -> Result<()>,
    ) -> Result<Steps> {
        // A type autocast cannot cast to is refused before any step runs.
        drop(autocast.map(memlab_tch::ops::cpu_autocast).transpose()?);
        // What lives before the first step, where memlab can name it, in the
        // order a CUDA run makes it: the weights, then the gradients (the
        // first backward pass, last layer first), then the optimizer's state
        // (its first step): where each lands decides what the steps share.
        let named = model.collect()?;
        let storages: Vec<_> = named.storages(Device::Cpu).iter().filter(|s| s.from_allocator).collect();
        let of = |kind: TensorKind| storages.iter().filter(move |s| s.views.first().is_some_and(|v| v.kind == kind));
        let others = storages.iter().filter(|s| {
            !s.views.first().is_some_and(|v| matches!(v.kind, TensorKind::Gradient | TensorKind::OptimizerState))
        });
        let weights = others.clone().count();
        // A step ran before (there are gradients): it made the cuBLAS
        // workspaces, which then live before these steps too.
        let stepped = of(TensorKind::Gradient).next().is_some();
        let live_before: Vec<(u64, u64)> = others
            .chain(of(TensorKind::Gradient).rev())
            .chain(of(TensorKind::OptimizerState))
            .map(|s| (s.data_ptr, s.nbytes))
            .collect();
        let construction = construction.map(|c| as_predicted(c, &storages));
        let recording = memlab_tch::Recording::start(Settings::default().capacity(50_000_000).ops(true))?;
        // A recording already running keeps its earlier events: the steps'
        // are those from here on.
        let start_us = memlab_core::events::clock_us();
        let dropped_before = memlab_core::events::stats().dropped;
        let mut peaks: Vec<u64> = Vec::new();
        while peaks.len() < max_steps.max(2) {
            // Each step's peak from a watch of its own: the program's
            // figures keep theirs.
            let watch = memlab_core::profiler::PeakWatch::start(&memlab_tch::BACKEND, Device::Cpu)?;
            let autocast = autocast.map(memlab_tch::ops::cpu_autocast).transpose()?;
            step()?;
            drop(autocast);
            let (_, end) = watch.finish()?;
            let peak = end.to_device_stats().allocated_bytes.all.peak;
            peaks.push(u64::try_from(peak).unwrap_or(0));
            if let [.., before, last] = peaks[..]
                && before == last
            {
                break;
            }
        }
        // The history alone: the export need not name what the steps left alive.
        let mut snapshot = crate::capture::snapshot::capture(&Model::new())?;
        let dropped = memlab_core::events::stats().dropped.saturating_sub(dropped_before);
        drop(recording);
        for trace in &mut snapshot.device_traces {
            trace.retain(|e| e.time_us >= start_us);
        }
        if let Some(ops) = snapshot.memlab.as_mut().and_then(|m| m.ops.as_mut()) {
            ops.retain(|r| r.start_us >= start_us);
        }
        // What lived before the steps is what memlab can name (`live_before`):
        // the live set of a recording already running would add everything
        // it saw allocated, a dataset in memory included.
        snapshot.segments.clear();
        if dropped > 0 {
            return Err(Error::InvalidArgument(
                "the step made more allocation events than the recording keeps: predict from fewer steps \
                 (WillItFit::max_steps(2))"
                    .into(),
            ));
        }
        let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap_or(snapshot.device_traces.len());
        let gradients: Vec<u64> = of(TensorKind::Gradient).map(|s| s.data_ptr).collect();
        let gradients_freed_us = first_free(&snapshot, cpu, &gradients);
        Ok(Steps {
            snapshot,
            cpu,
            gradients_freed_us,
            gradients,
            live_before,
            workspaces_after: stepped.then_some(weights),
            construction,
            empty_cache_at_us: None,
            start_us,
            peaks,
        })
    }

    /// Writes the steps' history to `path` with what a prediction takes
    /// beside it, which `memlab replay --as-cuda` reads back.
    pub(crate) fn write(&self, path: &std::path::Path, additions: Option<CudaAdditions>) -> Result<()> {
        let mut snapshot = self.snapshot.clone();
        if let Some(info) = snapshot.memlab.as_mut() {
            info.prediction_inputs = Some(memlab_core::export::PredictionInputs {
                live_before: self.live_before.clone(),
                workspaces_after: self.workspaces_after,
                empty_cache_at_us: self.empty_cache_at_us,
                step_peaks: self.peaks.clone(),
                construction: self.construction.clone(),
                additions: additions
                    .map(serde_json::to_value)
                    .transpose()
                    .map_err(|e| Error::InvalidArgument(format!("what CUDA adds does not write as data: {e}")))?,
            });
        }
        snapshot.write_pickle(path)
    }

    /// These steps after `earlier`'s in one process, with the allocator's
    /// cache given back between them (what `find_batch_size` does between
    /// its tries): what lived before is what lived before `earlier`, and
    /// the blocks `earlier` left alive keep their places, holes and all.
    ///
    /// Tries may have run between the two: what `earlier` left alive that
    /// these steps did not find (its gradients, where each step frees the
    /// last step's) is freed before the cache goes back, and what these
    /// steps found that `earlier` did not leave (the last try's gradients)
    /// is made after it, in the order a step makes it. Where the try just
    /// before ran out of memory after its first step had freed the
    /// gradients (`no_gradients`), there are none: these steps' first
    /// frees of them are left out, and their backward pass makes new ones.
    pub(crate) fn after(mut self, earlier: &Steps, no_gradients: bool) -> Steps {
        let (Some(before), Some(trace)) =
            (earlier.snapshot.device_traces.get(earlier.cpu), self.snapshot.device_traces.get_mut(self.cpu))
        else {
            return self;
        };
        // What `earlier` left alive, in the order it was made.
        let mut alive: std::collections::HashMap<u64, (usize, u64)> =
            earlier.live_before.iter().enumerate().map(|(i, &(a, size))| (a, (i, size))).collect();
        for (i, e) in before.iter().enumerate() {
            match (e.action, e.addr) {
                (Action::Alloc, Some(addr)) => {
                    alive.insert(addr, (earlier.live_before.len() + i, e.size));
                }
                (Action::FreeRequested, Some(addr)) => {
                    alive.remove(&addr);
                }
                _ => {}
            }
        }
        let mut left: Vec<(usize, u64, u64)> = alive.into_iter().map(|(a, (i, size))| (i, a, size)).collect();
        left.sort_unstable();
        let left: Vec<(u64, u64)> = left.into_iter().map(|(_, a, size)| (a, size)).collect();
        let gone: std::collections::HashSet<u64> =
            if no_gradients { self.gradients.iter().copied().collect() } else { Default::default() };
        if no_gradients {
            // Each gradient's first free, before any allocation at its address.
            let mut pending = gone.clone();
            trace.retain(|e| match (e.action, e.addr) {
                (Action::FreeRequested, Some(a)) => !pending.remove(&a),
                (Action::Alloc, Some(a)) => {
                    pending.remove(&a);
                    true
                }
                _ => true,
            });
        }
        let found: std::collections::HashSet<u64> =
            self.live_before.iter().map(|&(a, _)| a).filter(|a| !gone.contains(a)).collect();
        let kept: std::collections::HashSet<u64> = left.iter().map(|&(a, _)| a).collect();
        // Freed before the cache goes back, made after it.
        let freed = left.iter().filter(|(a, _)| !found.contains(a));
        let freed_us = self.start_us.saturating_sub(1);
        let between = freed.map(|&(a, size)| TraceEntry::new(Action::FreeRequested, Some(a), size, freed_us));
        let made = self.live_before.iter().filter(|(a, _)| found.contains(a) && !kept.contains(a));
        let between: Vec<TraceEntry> = between
            .chain(made.map(|&(a, size)| TraceEntry::new(Action::Alloc, Some(a), size, self.start_us)))
            .collect();
        *trace = before.iter().cloned().chain(between).chain(trace.drain(..)).collect();
        let earlier_ops = earlier.snapshot.memlab.as_ref().and_then(|m| m.ops.as_ref());
        if let (Some(ops), Some(before)) = (self.snapshot.memlab.as_mut().and_then(|m| m.ops.as_mut()), earlier_ops) {
            *ops = before.iter().cloned().chain(ops.drain(..)).collect();
        }
        Steps {
            live_before: earlier.live_before.clone(),
            workspaces_after: earlier.workspaces_after,
            construction: earlier.construction.clone(),
            empty_cache_at_us: Some(self.start_us),
            start_us: earlier.start_us,
            ..self
        }
    }

    /// Whether a prediction of these steps that ran out of memory at
    /// `at_us` (since the history's first event) ran out after the first
    /// step had freed the gradients it found.
    pub(crate) fn ran_out_without_gradients(&self, at_us: u64) -> bool {
        let first = self.snapshot.device_traces.get(self.cpu).and_then(|t| t.first()).map_or(0, |e| e.time_us);
        self.gradients_freed_us.is_some_and(|freed| first.saturating_add(at_us) >= freed)
    }
}

/// Runs `build` under a recording: what it built, and what it allocated
/// and freed on the CPU, in order (see [`crate::record_construction`]).
pub(crate) fn record_construction<T>(build: impl FnOnce() -> Result<T>) -> Result<(T, Construction)> {
    let _turn = Turn::take()?;
    let recording = memlab_tch::Recording::start(Settings::default().capacity(10_000_000))?;
    let start_us = memlab_core::events::clock_us();
    let dropped_before = memlab_core::events::stats().dropped;
    let built = build()?;
    let snapshot = crate::capture::snapshot::capture(&Model::new())?;
    let dropped = memlab_core::events::stats().dropped.saturating_sub(dropped_before);
    drop(recording);
    if dropped > 0 {
        return Err(Error::InvalidArgument(
            "the model's construction made more allocation events than the recording keeps (10 million): \
             predict without it"
                .into(),
        ));
    }
    let cpu = snapshot.devices().iter().position(|d| d == "cpu");
    let trace = cpu.and_then(|cpu| snapshot.device_traces.get(cpu)).map(Vec::as_slice).unwrap_or_default();
    let events = trace
        .iter()
        .filter(|e| e.time_us >= start_us)
        .filter_map(|e| {
            let freed = match e.action {
                Action::Alloc => false,
                Action::FreeRequested => true,
                _ => return None,
            };
            Some(Made { address: e.addr?, bytes: e.size, freed })
        })
        .collect();
    Ok((built, Construction { events, rnns: Vec::new() }))
}

/// `construction` as a prediction takes it, by what memlab names
/// (`storages`): what it left alive unnamed is left out (a dataset made
/// beside the model stays on the host on a GPU run; a block is named where
/// a named storage of its bytes is at its address), and the weights of
/// each LSTM and GRU, known by tch's names for them (`weight_ih_l0`,
/// `bias_hh_l1_reverse`) under one path, are grouped in the order they
/// were made, where the construction made them all.
fn as_predicted(construction: &Construction, storages: &[&crate::named::Storage]) -> Construction {
    let live = construction.live();
    let named: std::collections::HashMap<u64, &crate::named::Storage> =
        storages.iter().map(|s| (s.data_ptr, *s)).collect();
    let is_named = |address: &u64, bytes: u64| named.get(address).is_some_and(|s| s.nbytes == bytes);
    let unnamed: std::collections::HashSet<u64> =
        live.iter().filter(|(a, (_, bytes))| !is_named(a, *bytes)).map(|(a, _)| *a).collect();
    // A block left alive unnamed was never made on the card.
    let events = construction
        .events
        .iter()
        .enumerate()
        .filter(|(i, e)| !(unnamed.contains(&e.address) && live.get(&e.address).is_some_and(|&(at, _)| at == *i)))
        .map(|(_, e)| *e)
        .collect();
    // Every named RNN weight, by its RNN; a group the construction did not
    // make whole is not flattened (its weights were there before it).
    let mut rnns: std::collections::BTreeMap<(&str, &str), Vec<u64>> = std::collections::BTreeMap::new();
    for s in storages {
        if let Some(rnn) = s.views.first().and_then(|v| rnn_of(&v.name)) {
            rnns.entry(rnn).or_default().push(s.data_ptr);
        }
    }
    let rnns = rnns
        .into_values()
        .filter_map(|weights| {
            let mut made: Vec<(usize, u64)> = weights
                .iter()
                .map(|a| live.get(a).filter(|_| !unnamed.contains(a)).map(|&(at, _)| (at, *a)))
                .collect::<Option<_>>()?;
            made.sort_unstable();
            Some(made.into_iter().map(|(_, address)| address).collect())
        })
        .collect();
    Construction { events, rnns }
}

/// The RNN whose weight `name` is, where it is named as tch's `nn::lstm`
/// and `nn::gru` name theirs (`rnn.weight_ih_l0`, `rnn.bias_hh_l1_reverse`;
/// a second RNN under the same path gets tch's `__N` after each name): its
/// path and that suffix.
fn rnn_of(name: &str) -> Option<(&str, &str)> {
    let (path, last) = name.rsplit_once(['.', '/']).unwrap_or(("", name));
    let (last, duplicate) = match last.rsplit_once("__") {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => (base, n),
        _ => (last, ""),
    };
    let rest = last.strip_prefix("weight_").or_else(|| last.strip_prefix("bias_"))?;
    let rest = rest.strip_prefix("ih_l").or_else(|| rest.strip_prefix("hh_l"))?;
    let layer = rest.strip_suffix("_reverse").unwrap_or(rest);
    (!layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit())).then_some((path, duplicate))
}

/// When the history at `cpu` first freed one of `addresses`.
fn first_free(snapshot: &Snapshot, cpu: usize, addresses: &[u64]) -> Option<u64> {
    let addresses: std::collections::HashSet<u64> = addresses.iter().copied().collect();
    let trace = snapshot.device_traces.get(cpu)?;
    let e = trace.iter().find(|e| e.action == Action::FreeRequested && e.addr.is_some_and(|a| addresses.contains(&a)));
    e.map(|e| e.time_us)
}

/// The allocator a prediction follows: that of the libtorch this process
/// runs, where memlab models it, else 2.11's.
pub(crate) fn process_libtorch() -> memlab_core::replay::Libtorch {
    crate::run::this_process()
        .libtorch
        .as_deref()
        .and_then(memlab_core::replay::Libtorch::of_recording)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use memlab_core::export::SnapshotInfo;

    fn event(action: Action, addr: u64, size: u64, time_us: u64) -> TraceEntry {
        TraceEntry::new(action, Some(addr), size, time_us)
    }

    fn steps(trace: Vec<TraceEntry>, live_before: Vec<(u64, u64)>, start_us: u64) -> Steps {
        let info = SnapshotInfo { devices: vec!["cpu".into()], ops: Some(Vec::new()), ..SnapshotInfo::default() };
        let snapshot =
            Snapshot { segments: Vec::new(), device_traces: vec![trace], allocator_settings: None, memlab: Some(info) };
        Steps {
            snapshot,
            cpu: 0,
            live_before,
            workspaces_after: None,
            construction: None,
            gradients: Vec::new(),
            gradients_freed_us: None,
            empty_cache_at_us: None,
            start_us,
            peaks: Vec::new(),
        }
    }

    /// tch's names for an RNN's weights, a second RNN under one path
    /// (`__N`) apart, and names that are not an RNN's.
    #[test]
    fn rnn_weights_are_known_by_tchs_names() {
        assert_eq!(rnn_of("model/lstm.weight_ih_l0"), Some(("model/lstm", "")));
        assert_eq!(rnn_of("gru.bias_hh_l1_reverse"), Some(("gru", "")));
        assert_eq!(rnn_of("model/weight_hh_l0__4"), Some(("model", "4")));
        assert_eq!(rnn_of("weight_ih_l2"), Some(("", "")));
        for other in ["fc.weight", "lstm.weight_ih_lx", "lstm.weight_ih_l", "lstm.bias_ih_l0_backward", "x__"] {
            assert_eq!(rnn_of(other), None, "{other}");
        }
    }

    /// A later try after the first: the first try's gradient (which a later
    /// step freed) is freed before the cache goes back, the gradient the
    /// later try found is made after it, and the optimizer's state the
    /// first try made keeps its place.
    #[test]
    fn a_later_try_follows_the_first_with_the_gradients_it_found() {
        let (weight, gradient, state, activation, last_gradient) = (10, 20, 30, 40, 50);
        let first = steps(
            vec![
                event(Action::Alloc, activation, 64, 100),
                event(Action::Alloc, gradient, 8, 101),
                event(Action::Alloc, state, 8, 102),
                event(Action::FreeRequested, activation, 64, 103),
            ],
            vec![(weight, 8)],
            100,
        );
        let later = steps(
            vec![event(Action::FreeRequested, last_gradient, 8, 500), event(Action::Alloc, 60, 128, 501)],
            vec![(weight, 8), (last_gradient, 8), (state, 8)],
            500,
        );
        let both = later.after(&first, false);
        assert_eq!(
            (both.live_before.clone(), both.empty_cache_at_us, both.start_us),
            (vec![(weight, 8)], Some(500), 100)
        );
        let trace: Vec<(Action, u64, u64)> =
            both.snapshot.device_traces[0].iter().map(|e| (e.action, e.addr.unwrap(), e.time_us)).collect();
        assert_eq!(
            trace[4..],
            [
                (Action::FreeRequested, gradient, 499),
                (Action::Alloc, last_gradient, 500),
                (Action::FreeRequested, last_gradient, 500),
                (Action::Alloc, 60, 501),
            ]
        );
    }

    /// After a try that ran out once its first step had freed the
    /// gradients, there are none: the later try's frees of them go, and
    /// its backward pass makes new ones. Whether a try ran out so is told
    /// by when its first step freed them.
    #[test]
    fn after_a_try_that_ran_out_without_gradients_the_next_finds_none() {
        let (weight, gradient, state, last_gradient, new_gradient) = (10, 20, 30, 50, 60);
        let first = steps(
            vec![event(Action::Alloc, gradient, 8, 100), event(Action::Alloc, state, 8, 101)],
            vec![(weight, 8)],
            100,
        );
        let mut later = steps(
            vec![
                event(Action::Alloc, 70, 64, 500),
                event(Action::FreeRequested, last_gradient, 8, 501),
                event(Action::Alloc, new_gradient, 8, 502),
            ],
            vec![(weight, 8), (last_gradient, 8), (state, 8)],
            500,
        );
        later.gradients = vec![last_gradient];
        later.gradients_freed_us = Some(501);
        let both = later.after(&first, true);
        let trace: Vec<(Action, u64, u64)> =
            both.snapshot.device_traces[0].iter().map(|e| (e.action, e.addr.unwrap(), e.time_us)).collect();
        assert_eq!(
            trace[2..],
            [(Action::FreeRequested, gradient, 499), (Action::Alloc, 70, 500), (Action::Alloc, new_gradient, 502),]
        );
        // The history begins at 100: ran out at 500 (before the free), then at 501.
        assert!(!both.ran_out_without_gradients(400));
        assert!(both.ran_out_without_gradients(401));
    }
}
