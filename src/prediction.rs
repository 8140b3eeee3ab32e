//! A CUDA run predicted from CPU runs of a step, shared by the tools that
//! answer "will it fit?" ([`will_it_fit`](crate::will_it_fit) and
//! [`find_batch_size`](crate::find_batch_size)'s `Budget::CudaCard`): the
//! steps under a recording until their peak is steady, then memlab-core's
//! replay of their allocations as CUDA's.

use memlab_core::events::Settings;
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
}

impl CpuSteps {
    /// Runs `step` on the CPU until its peak is steady, then predicts.
    pub(crate) fn predict(self, mut step: impl FnMut() -> Result<()>) -> Result<CudaPrediction> {
        // What lives before the first step, where memlab can name it, in the
        // order a CUDA run makes it: the weights, then the gradients (the
        // first backward pass, last layer first), then the optimizer's state
        // (its first step): where each lands decides what the steps share.
        let named = self.model.collect()?;
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
        let recording = memlab_tch::Recording::start(Settings::default().capacity(50_000_000).ops(true))?;
        // A recording already running keeps its earlier events: the steps'
        // are those from here on.
        let start_us = memlab_core::events::clock_us();
        let dropped_before = memlab_core::events::stats().dropped;
        let mut peaks: Vec<u64> = Vec::new();
        while peaks.len() < self.max_steps.max(2) {
            memlab_tch::reset_peak_stats(Device::Cpu)?;
            step()?;
            let peak = memlab_tch::device_stats(Device::Cpu)?.allocated_bytes.all.peak;
            peaks.push(u64::try_from(peak).unwrap_or(0));
            if let [.., before, last] = peaks[..] {
                if before == last {
                    break;
                }
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
        let settings =
            std::iter::once(String::new()).chain(self.settings.into_iter().filter(|s| !s.is_empty())).collect();
        let options = PredictOptions {
            capacity: self.card,
            settings,
            additions: self.additions,
            live_before,
            workspaces_after: stepped.then_some(weights),
        };
        let mut prediction = predict_cuda("the step's CPU run", &snapshot, &options)?;
        prediction.cpu_step_peaks = peaks;
        Ok(prediction)
    }
}
