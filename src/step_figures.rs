//! What a step took, measured the same way for the step logger and the
//! notebook's per-cell lines: the figures (RAM, the CPU allocator's, the
//! GPU's, the time), their renderings, and the measurement itself, which
//! starts on one thread and may finish on another. A shared layer: both
//! tools import it, it imports neither.

use serde::Serialize;
use std::time::{Duration, Instant};

use memlab_core::profiler::PeakWatch;
use memlab_core::render::{Cell, Column, Document, Layout, Render, Table};
use memlab_core::Device;

use memlab_tch::BACKEND;

use memlab_tch::sampler::{latest_driver_memory, sampled_process_memory, sampled_rss, StepWindow};

/// General RAM figures of one step, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RamFigures {
    /// Resident set after minus before.
    pub consumed: i64,
    /// How far the resident set peaked above its level after the step.
    pub peaked: i64,
    /// Resident set after the step.
    pub used: u64,
    /// The machine's memory.
    pub total: u64,
    /// Whether `peaked` is exact (the kernel's high-water mark) or sampled.
    pub peak_exact: bool,
    /// Whether `consumed` and `used` come from the background thread's
    /// readings (at most one sampling period old) instead of readings at the
    /// step's two ends (see [`StepLogger::exact_ram`](crate::StepLogger::exact_ram)).
    pub sampled: bool,
}

impl RamFigures {
    /// How the figures were read, for the printed forms.
    fn label(&self) -> &'static str {
        match (self.sampled, self.peak_exact) {
            (true, _) => "  (sampled)",
            (false, false) => "  (peak sampled)",
            (false, true) => "",
        }
    }
}

/// Figures of the CPU tensors of one step, in bytes: libtorch's CPU
/// allocator as memlab's counting allocator sees it, exact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CpuFigures {
    /// Allocated bytes after minus before.
    pub consumed: i64,
    /// How far allocated bytes peaked above their level after the step.
    pub peaked: i64,
    /// Allocated bytes after the step.
    pub used: i64,
}

/// GPU figures of one step, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GpuFigures {
    /// The CUDA device.
    pub device: usize,
    /// Allocated bytes after minus before (libtorch's allocator, exact).
    pub consumed: i64,
    /// How far allocated bytes peaked above their level after the step (exact).
    pub peaked: i64,
    /// Allocated bytes after the step.
    pub used: i64,
    /// Reserved (cached) bytes after the step.
    pub reserved: i64,
    /// The device's memory, from the driver (0 without one).
    pub total: u64,
    /// Device-wide use from the driver (all processes and contexts) at the
    /// end of the step: the background thread's latest reading, taken at most
    /// one sampling period (1 ms by default) before the step ended, so that
    /// a step pays no driver call of its own.
    pub driver_used: Option<u64>,
    /// How far device-wide use peaked above `driver_used`, sampled during the step.
    pub driver_peaked: Option<u64>,
    /// This process's GPU memory, from NVML, when NVML lists it: the
    /// background thread's latest reading, at most 100 ms old.
    pub process_used: Option<u64>,
}

/// What one logged step measured.
#[derive(Clone, Debug, Default, Serialize)]
#[non_exhaustive]
pub struct StepData {
    /// The step's label.
    pub label: String,
    /// General RAM.
    pub ram: RamFigures,
    /// The CPU tensors, when memlab counts libtorch's CPU allocator (its
    /// default; see `memlab::stats`).
    pub cpu: Option<CpuFigures>,
    /// The GPU, when CUDA is available.
    pub gpu: Option<GpuFigures>,
    /// Wall time of the step.
    pub time: Duration,
}

/// How a step is measured: the settings [`StepLogger`](crate::StepLogger) and the per-cell
/// logger share.
#[derive(Clone, Copy, Debug)]
pub(crate) struct How {
    pub exact_ram: bool,
    pub exact_ram_peak: bool,
    pub clear_cache: bool,
    pub sample_every: Duration,
}

impl Default for How {
    fn default() -> How {
        How { exact_ram: false, exact_ram_peak: false, clear_cache: false, sample_every: Duration::from_millis(1) }
    }
}

/// A step being measured, from [`Measure::start`] to [`Measure::finish`],
/// which may run on different threads.
pub(crate) struct Measure {
    how: How,
    exact_ram_peak: bool,
    gpu: Option<usize>,
    ram_before: u64,
    cpu_watch: Option<PeakWatch>,
    gpu_watch: Option<PeakWatch>,
    sampler: StepWindow,
    started: Instant,
}

impl Measure {
    /// Starts measuring: the figures before the step, the allocators' peaks
    /// watched from now, the background samples begun.
    pub(crate) fn start(how: &How) -> Measure {
        let gpu = match memlab_tch::auto_device() {
            Device::Cuda(i) => Some(i),
            Device::Cpu => None,
        };
        if how.clear_cache {
            let _ = memlab_tch::empty_cache();
        }
        let exact_ram_peak = how.exact_ram_peak && reset_rss_peak();
        let ram_before = read_rss(how.exact_ram);
        let cpu_watch = PeakWatch::start(&BACKEND, Device::Cpu).ok();
        let gpu_watch = gpu.and_then(|i| PeakWatch::start(&BACKEND, Device::Cuda(i)).ok());
        let sampler = StepWindow::start(gpu, ram_before, how.sample_every);
        Measure { how: *how, exact_ram_peak, gpu, ram_before, cpu_watch, gpu_watch, sampler, started: Instant::now() }
    }

    /// The time since the start.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Ends the measurement of a step of `time` called `label`.
    pub(crate) fn finish(self, label: &str, time: Duration) -> StepData {
        let (sampled_rss_peak, sampled_driver_peak) = self.sampler.stop();
        let ram_after = read_rss(self.how.exact_ram);
        let ram_peak = if self.exact_ram_peak { rss_peak().max(ram_after) } else { sampled_rss_peak.max(ram_after) };
        let ram = RamFigures {
            consumed: ram_after as i64 - self.ram_before as i64,
            peaked: ram_peak.saturating_sub(ram_after) as i64,
            used: ram_after,
            total: total_ram(),
            peak_exact: self.exact_ram_peak,
            sampled: !self.how.exact_ram,
        };
        let cpu = self.cpu_watch.and_then(|watch| watch.finish().ok()).map(|(start, end)| {
            let (before, after) = (start.allocated_bytes(), end.allocated_bytes());
            CpuFigures {
                consumed: after.current - before.current,
                peaked: after.peak - after.current,
                used: after.current,
            }
        });
        let gpu = match (self.gpu, self.gpu_watch) {
            (Some(index), Some(watch)) => watch.finish().ok().map(|(start, end)| {
                let (before, after, reserved) = (start.allocated_bytes(), end.allocated_bytes(), end.reserved_bytes());
                let driver = latest_driver_memory(index);
                GpuFigures {
                    device: index,
                    consumed: after.current - before.current,
                    peaked: after.peak - after.current,
                    used: after.current,
                    reserved: reserved.current,
                    total: driver.map_or(0, |d| d.total),
                    driver_used: driver.map(|d| d.used()),
                    driver_peaked: driver.map(|d| sampled_driver_peak.saturating_sub(d.used())),
                    process_used: sampled_process_memory(),
                }
            }),
            _ => None,
        };
        StepData { label: label.to_string(), ram, cpu, gpu, time }
    }
}

/// The resident set: read now, or the background thread's latest reading.
fn read_rss(exact: bool) -> u64 {
    if exact {
        rss()
    } else {
        sampled_rss().unwrap_or_else(rss)
    }
}

impl StepData {
    /// The one-line form.
    pub fn compact_line(&self) -> String {
        let mut line = format!(
            "{}: {} | RAM {} ^{} ={} of {}",
            self.label,
            Cell::Duration(self.time),
            Cell::signed_bytes(self.ram.consumed),
            Cell::bytes(self.ram.peaked),
            Cell::bytes(self.ram.used),
            Cell::bytes(self.ram.total)
        );
        line += self.ram.label();
        if let Some(c) = &self.cpu {
            line += &format!(
                " | CPU tensors {} ^{} ={}",
                Cell::signed_bytes(c.consumed),
                Cell::bytes(c.peaked),
                Cell::bytes(c.used)
            );
        }
        if let Some(g) = &self.gpu {
            line += &format!(
                " | GPU {} ^{} ={} of {}",
                Cell::signed_bytes(g.consumed),
                Cell::bytes(g.peaked),
                Cell::bytes(g.used),
                Cell::bytes(g.total)
            );
        }
        line.push('\n');
        line
    }
}

displayed_as_text!(StepData);

impl Render for StepData {
    /// ipygpulogger's layout: a row of labels, then one row of figures for
    /// the RAM and one for the GPU.
    fn document(&self) -> Document {
        let figure = || Column::new("", Layout::Figure).min_width(8);
        let mut table = Table::new(vec![
            Column::new("", Layout::Text),
            figure(),
            figure(),
            figure(),
            figure(),
            Column::new("", Layout::Text),
        ]);
        table.row([
            Cell::text("RAM:"),
            Cell::text("Consumed"),
            Cell::text("Peak over end"),
            Cell::text("Used"),
            Cell::text("Total"),
            Cell::text(format!("in {} ({})", Cell::Duration(self.time), self.label)),
        ]);
        table.row([
            Cell::text("Gen:"),
            Cell::bytes(self.ram.consumed),
            Cell::bytes(self.ram.peaked),
            Cell::bytes(self.ram.used),
            Cell::bytes(self.ram.total),
            Cell::text(self.ram.label().trim_start()),
        ]);
        if let Some(c) = &self.cpu {
            table.row([
                Cell::text("CPU:"),
                Cell::bytes(c.consumed),
                Cell::bytes(c.peaked),
                Cell::bytes(c.used),
                Cell::text(""),
                Cell::text("(tensors, libtorch's CPU allocator)"),
            ]);
        }
        match &self.gpu {
            Some(g) => {
                table.row([
                    Cell::text("GPU:"),
                    Cell::bytes(g.consumed),
                    Cell::bytes(g.peaked),
                    Cell::bytes(g.used),
                    Cell::bytes(g.total),
                    Cell::text(format!(
                        "(cuda:{}, libtorch's allocator; reserved {})",
                        g.device,
                        Cell::bytes(g.reserved)
                    )),
                ]);
                if let (Some(used), Some(peaked)) = (g.driver_used, g.driver_peaked) {
                    table.note(format!(
                        "     driver (sampled): device-wide {} used, peaked {} above{}",
                        Cell::bytes(used),
                        Cell::bytes(peaked),
                        g.process_used.map(|p| format!("; this process {} (NVML)", Cell::bytes(p))).unwrap_or_default()
                    ));
                }
            }
            None => {
                table.note("GPU: no CUDA device");
            }
        }
        let mut doc = Document::new();
        doc.table(table);
        doc
    }
}

/// The process's resident set in bytes (0 where /proc is not there).
pub fn rss() -> u64 {
    memlab_tch::resident_set()
}

/// The host's memory: what the kernel could still give (`MemAvailable`) and
/// its total, in bytes (`None` where /proc is not there).
pub fn host_memory() -> Option<(u64, u64)> {
    memlab_tch::host_memory()
}

/// The resident set's high-water mark (VmHWM) in bytes.
fn rss_peak() -> u64 {
    status_kib("VmHWM:") * 1024
}

/// Resets the kernel's resident-set high-water mark; false where not allowed.
fn reset_rss_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn total_ram() -> u64 {
    static TOTAL: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TOTAL.get_or_init(|| host_memory().map_or(0, |(_, total)| total))
}

fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
}
