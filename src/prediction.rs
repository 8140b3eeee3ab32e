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
            empty_cache_at_us: steps.empty_cache_at_us.clone(),
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
    /// Where the allocator's cache was given back, when these steps follow
    /// others (`PredictOptions::empty_cache_at_us`).
    empty_cache_at_us: Vec<u64>,
    /// When each step ended.
    step_ends_us: Vec<u64>,
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
        let (mut peaks, mut step_ends_us): (Vec<u64>, Vec<u64>) = (Vec::new(), Vec::new());
        while peaks.len() < max_steps.max(2) {
            // Each step's peak from a watch of its own: the program's
            // figures keep theirs.
            let watch = memlab_core::profiler::PeakWatch::start(&memlab_tch::BACKEND, Device::Cpu)?;
            let autocast = autocast.map(memlab_tch::ops::cpu_autocast).transpose()?;
            step()?;
            drop(autocast);
            let (_, end) = watch.finish()?;
            step_ends_us.push(memlab_core::events::clock_us());
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
        Ok(Steps {
            snapshot,
            cpu,
            live_before,
            workspaces_after: stepped.then_some(weights),
            construction,
            empty_cache_at_us: Vec::new(),
            step_ends_us,
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
                empty_cache_at_us: self.empty_cache_at_us.clone(),
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

    /// These steps after `earlier` in one process, with the allocator's
    /// cache given back between them (what `find_batch_size` does between
    /// its tries): what lived before is what lived before `earlier`, and
    /// the blocks `earlier` left alive keep their places, holes and all.
    ///
    /// `earlier` may be several tries already joined so, the last of them
    /// cut where it ran out ([`Steps::ran_out_at`]). What it left alive
    /// that these steps did not find (a try's gradients, where a later step
    /// freed them) is freed before the cache goes back. What these steps
    /// found that it did not leave (gradients a try that ran out did not
    /// keep) is not there: their first frees are left out, and the steps'
    /// backward pass makes new ones.
    pub(crate) fn after(mut self, earlier: &Steps) -> Steps {
        let (Some(before), Some(trace)) =
            (earlier.snapshot.device_traces.get(earlier.cpu), self.snapshot.device_traces.get_mut(self.cpu))
        else {
            return self;
        };
        // What `earlier` left alive, in the order it was made.
        let mut alive: std::collections::HashMap<u64, usize> =
            earlier.live_before.iter().enumerate().map(|(i, &(a, _))| (a, i)).collect();
        let mut sizes: std::collections::HashMap<u64, u64> = earlier.live_before.iter().copied().collect();
        for (i, e) in before.iter().enumerate() {
            match (e.action, e.addr) {
                (Action::Alloc, Some(addr)) => {
                    alive.insert(addr, earlier.live_before.len() + i);
                    sizes.insert(addr, e.size);
                }
                (Action::FreeRequested, Some(addr)) => {
                    alive.remove(&addr);
                }
                _ => {}
            }
        }
        let found: std::collections::HashSet<u64> = self.live_before.iter().map(|&(a, _)| a).collect();
        // Found here, not left there: each one's first free goes, before
        // any allocation at its address.
        let mut gone: std::collections::HashSet<u64> =
            found.iter().copied().filter(|a| !alive.contains_key(a)).collect();
        // The first of those frees: where these steps' first step frees
        // the gradients it found (libtorch's `zero_grad`).
        let zero_grad = trace
            .iter()
            .find(|e| e.action == Action::FreeRequested && e.addr.is_some_and(|a| gone.contains(&a)))
            .map(|e| e.time_us);
        trace.retain(|e| match (e.action, e.addr) {
            (Action::FreeRequested, Some(a)) => !gone.remove(&a),
            (Action::Alloc, Some(a)) => {
                gone.remove(&a);
                true
            }
            _ => true,
        });
        // Left there, not found here: freed before the cache goes back; or,
        // where a try that ran out kept gradients these steps did not find
        // (they found others), freed where these steps free the gradients.
        // They then live on into these steps, whose CPU run had freed their
        // addresses and may allocate there first: they keep addresses of
        // their own from their allocation on.
        let mut freed: Vec<(usize, u64)> =
            alive.iter().filter(|(a, _)| !found.contains(a)).map(|(&a, &i)| (i, a)).collect();
        freed.sort_unstable();
        let (freed_us, tag) = match zero_grad {
            Some(us) => (us, KEPT),
            None => (self.start_us.saturating_sub(1), 0),
        };
        let mut before = before.clone();
        if tag != 0 {
            let mut left: std::collections::HashSet<u64> = freed.iter().map(|&(_, a)| a).collect();
            for e in before.iter_mut().rev().filter(|e| e.action == Action::Alloc) {
                if let Some(a) = e.addr.filter(|a| left.remove(a)) {
                    e.addr = Some(a | tag);
                }
            }
        }
        let frees =
            freed.iter().map(|&(_, a)| TraceEntry::new(Action::FreeRequested, Some(a | tag), sizes[&a], freed_us));
        let rest = trace.split_off(trace.iter().position(|e| e.time_us >= freed_us).unwrap_or(trace.len()));
        *trace = before.into_iter().chain(trace.drain(..)).chain(frees).chain(rest).collect();
        let earlier_ops = earlier.snapshot.memlab.as_ref().and_then(|m| m.ops.as_ref());
        if let (Some(ops), Some(before)) = (self.snapshot.memlab.as_mut().and_then(|m| m.ops.as_mut()), earlier_ops) {
            *ops = before.iter().cloned().chain(ops.drain(..)).collect();
        }
        let mut empty_cache_at_us = earlier.empty_cache_at_us.clone();
        empty_cache_at_us.push(self.start_us);
        Steps {
            live_before: earlier.live_before.clone(),
            workspaces_after: earlier.workspaces_after,
            construction: earlier.construction.clone(),
            empty_cache_at_us,
            start_us: earlier.start_us,
            ..self
        }
    }

    /// These steps as a process runs them that ran out of memory at `at_us`
    /// (since the history's first event, as a prediction's
    /// [`Fit`](memlab_core::replay::Fit) says): the last part's history up
    /// to the failing request, then, as the failed step unwinds, every
    /// block that part made and still held freed, except the gradients:
    /// what outlived a step that ended before it, and what the failed step
    /// made before it failed that outlived the step on the CPU (autograd
    /// gives each parameter its gradient as the backward pass makes it);
    /// the next try's first step frees them ([`Steps::after`]).
    pub(crate) fn ran_out_at(mut self, at_us: u64) -> Steps {
        let Some(trace) = self.snapshot.device_traces.get_mut(self.cpu) else { return self };
        let Some(first) = trace.first().map(|e| e.time_us) else { return self };
        let failed = first.saturating_add(at_us);
        let part = self.empty_cache_at_us.last().copied().unwrap_or(0);
        // A failure before these steps is not theirs (the prediction counts
        // only the last part's).
        if failed < part {
            return self;
        }
        // The last step that ended before the failure, and the end of the
        // step that failed (the CPU ran it to its end).
        let ended = self.step_ends_us.iter().copied().filter(|&end| end < failed).max();
        let failing_end = self.step_ends_us.iter().copied().filter(|&end| end >= failed).min();
        // What the failed step made before it failed and kept past its end
        // on the CPU: gradients, which autograd had given their tensors.
        let mut kept: std::collections::HashSet<(u64, u64)> = std::collections::HashSet::new();
        if let Some(end) = failing_end {
            let mut made: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
            for e in trace.iter().take_while(|e| e.time_us <= end) {
                match (e.action, e.addr) {
                    (Action::Alloc, Some(a)) if e.time_us < failed && ended.is_none_or(|s| e.time_us > s) => {
                        made.insert(a, e.time_us);
                    }
                    (Action::FreeRequested, Some(a)) => {
                        made.remove(&a);
                    }
                    _ => {}
                }
            }
            kept.extend(made);
        }
        trace.retain(|e| e.time_us < failed);
        let mut held: std::collections::HashMap<u64, (usize, TraceEntry)> = std::collections::HashMap::new();
        for (i, e) in trace.iter().enumerate() {
            match (e.action, e.addr) {
                (Action::Alloc, Some(a)) if e.time_us >= part => {
                    held.insert(a, (i, e.clone()));
                }
                (Action::FreeRequested, Some(a)) => {
                    held.remove(&a);
                }
                _ => {}
            }
        }
        let mut unwound: Vec<(usize, TraceEntry)> = held
            .into_values()
            .filter(|(_, e)| ended.is_none_or(|end| e.time_us > end))
            .filter(|(_, e)| !e.addr.is_some_and(|a| kept.contains(&(a, e.time_us))))
            .collect();
        unwound.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        trace.extend(unwound.into_iter().map(|(_, e)| TraceEntry {
            action: Action::FreeRequested,
            time_us: failed,
            ..e
        }));
        // Ops still running when it failed end there.
        if let Some(ops) = self.snapshot.memlab.as_mut().and_then(|m| m.ops.as_mut()) {
            ops.retain(|r| r.start_us < failed);
            for r in ops.iter_mut() {
                r.end_us = r.end_us.min(failed);
            }
        }
        self.step_ends_us.retain(|&end| end < failed);
        self
    }
}

/// The bit that sets apart the address of a block a failed try kept, once
/// the next try's CPU run may use its address again: above every CPU
/// address (user space ends below 2^57) and below the replay's own
/// workspaces (2^62).
const KEPT: u64 = 1 << 61;

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
            empty_cache_at_us: Vec::new(),
            step_ends_us: Vec::new(),
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

    fn actions(steps: &Steps) -> Vec<(Action, u64, u64)> {
        steps.snapshot.device_traces[0].iter().map(|e| (e.action, e.addr.unwrap(), e.time_us)).collect()
    }

    /// Tries joined in one process: each later try finds the blocks the
    /// tries before it left (the first try's optimizer state keeps its
    /// place), what they left that it did not find is freed before the
    /// cache goes back, and the cache goes back before each.
    #[test]
    fn tries_follow_each_other_with_what_each_left() {
        let (weight, gradient, state, activation, second_gradient) = (10, 20, 30, 40, 50);
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
        let second = steps(
            vec![event(Action::FreeRequested, gradient, 8, 300), event(Action::Alloc, second_gradient, 8, 301)],
            vec![(weight, 8), (gradient, 8), (state, 8)],
            300,
        );
        let both = second.after(&first);
        assert_eq!(
            (both.live_before.clone(), both.empty_cache_at_us.clone(), both.start_us),
            (vec![(weight, 8)], vec![300], 100)
        );
        // A third try found only the state: the second's gradient is freed
        // before its cache goes back.
        let third = steps(vec![event(Action::Alloc, 60, 128, 500)], vec![(weight, 8), (state, 8)], 500);
        let all = third.after(&both);
        assert_eq!(all.empty_cache_at_us, vec![300, 500]);
        assert_eq!(
            actions(&all)[4..],
            [
                (Action::FreeRequested, gradient, 300),
                (Action::Alloc, second_gradient, 301),
                (Action::FreeRequested, second_gradient, 499),
                (Action::Alloc, 60, 500),
            ]
        );
    }

    /// A try that ran out is cut at its failing request, and what its
    /// failed step held is freed there, the gradients kept: those of the
    /// step it finished, or, once its failed step freed them, those the
    /// failed step made before it failed. The next try found gradients
    /// that a try that ran out did not keep: its frees of them go, its
    /// backward pass makes new ones, and those the try kept are freed
    /// where its first step frees the gradients.
    #[test]
    fn a_try_that_ran_out_leaves_its_gradients() {
        let (weight, old_gradient, gradient, activation, late, new_gradient) = (10, 20, 30, 40, 45, 60);
        let first = steps(vec![event(Action::Alloc, old_gradient, 8, 100)], vec![(weight, 8)], 100);
        let failed = |second_step: Vec<TraceEntry>| {
            let mut trace = vec![
                // Its first step: frees the first try's gradient, makes its own.
                event(Action::FreeRequested, old_gradient, 8, 300),
                event(Action::Alloc, gradient, 8, 301),
            ];
            trace.extend(second_step);
            let mut failed = steps(trace, vec![(weight, 8), (old_gradient, 8)], 300);
            failed.step_ends_us = vec![302, 307];
            failed.after(&first)
        };
        // Its second step runs out in the forward pass: the first's gradient stays.
        let forward = failed(vec![
            event(Action::Alloc, activation, 64, 303),
            event(Action::Alloc, late, 128, 304),
            event(Action::FreeRequested, late, 128, 305),
            event(Action::FreeRequested, activation, 64, 305),
        ])
        .ran_out_at(304 - 100);
        assert_eq!(
            actions(&forward)[1..],
            [
                (Action::FreeRequested, old_gradient, 300),
                (Action::Alloc, gradient, 301),
                (Action::Alloc, activation, 303),
                (Action::FreeRequested, activation, 304),
            ]
        );
        // In the backward pass, after it freed that gradient and made one
        // of its own: that one stays.
        let backward = failed(vec![
            event(Action::FreeRequested, gradient, 8, 303),
            event(Action::Alloc, activation, 64, 303),
            event(Action::Alloc, new_gradient, 8, 304),
            event(Action::Alloc, late, 128, 305),
            event(Action::FreeRequested, late, 128, 306),
            event(Action::FreeRequested, activation, 64, 306),
        ])
        .ran_out_at(305 - 100);
        assert_eq!(
            actions(&backward)[3..],
            [
                (Action::FreeRequested, gradient, 303),
                (Action::Alloc, activation, 303),
                (Action::Alloc, new_gradient, 304),
                (Action::FreeRequested, activation, 305),
            ]
        );
        // The CPU ran the first failed try to its end: the next finds the
        // gradient its last step made, which the process does not hold.
        let next = steps(
            vec![
                event(Action::Alloc, 70, 64, 500),
                event(Action::FreeRequested, new_gradient, 8, 501),
                event(Action::Alloc, new_gradient, 8, 502),
            ],
            vec![(weight, 8), (new_gradient, 8)],
            500,
        );
        let all = next.after(&forward);
        // The kept gradient, at an address of its own from its allocation on.
        assert_eq!(actions(&all)[2], (Action::Alloc, gradient | KEPT, 301));
        assert_eq!(
            actions(&all)[5..],
            [
                (Action::Alloc, 70, 500),
                (Action::FreeRequested, gradient | KEPT, 501),
                (Action::Alloc, new_gradient, 502)
            ]
        );
    }

    /// The op that was running when a try ran out is kept, ending where
    /// the try failed (what it allocates is told by it: a CPU-only
    /// scratch must not come back as CUDA's); the ops after it go.
    #[test]
    fn the_op_running_when_a_try_ran_out_ends_there() {
        use memlab_core::ops::{Op, OpRecord};
        let op = |name: &str, start_us, end_us| OpRecord {
            start_us,
            end_us,
            op: Op::Other,
            name: name.into(),
            tensors: None,
            sequence: None,
            sequence_end: None,
            scalars: Vec::new(),
        };
        let mut failed = steps(
            vec![
                event(Action::Alloc, 40, 64, 100),
                event(Action::Alloc, 41, 128, 103),
                event(Action::FreeRequested, 41, 128, 104),
                event(Action::FreeRequested, 40, 64, 105),
            ],
            Vec::new(),
            100,
        );
        failed.step_ends_us = vec![107];
        failed.snapshot.memlab.as_mut().unwrap().ops =
            Some(vec![op("before", 100, 101), op("running", 102, 106), op("after", 104, 105)]);
        let cut = failed.ran_out_at(103 - 100);
        let ops = cut.snapshot.memlab.as_ref().unwrap().ops.as_ref().unwrap();
        let ops: Vec<_> = ops.iter().map(|r| (r.name.as_str(), r.start_us, r.end_us)).collect();
        assert_eq!(ops, [("before", 100, 101), ("running", 102, 103)]);
    }

    /// A gradient a failed try kept is freed where the next try frees its
    /// gradients; the next try's CPU run had freed its address and may
    /// allocate there first: it keeps an address of its own, never two
    /// blocks at one address.
    #[test]
    fn a_kept_gradient_is_freed_before_its_address_is_used_again() {
        let (weight, kept, found) = (10, 20, 30);
        let chain = steps(vec![event(Action::Alloc, kept, 8, 100)], vec![(weight, 8)], 100);
        let next = steps(
            vec![
                event(Action::Alloc, kept, 64, 500),
                event(Action::FreeRequested, found, 8, 501),
                event(Action::Alloc, found, 8, 502),
            ],
            vec![(weight, 8), (found, 8)],
            500,
        );
        let all = next.after(&chain);
        assert_eq!(
            actions(&all),
            [
                (Action::Alloc, kept | KEPT, 100),
                (Action::Alloc, kept, 500),
                (Action::FreeRequested, kept | KEPT, 501),
                (Action::Alloc, found, 502)
            ]
        );
    }
}
