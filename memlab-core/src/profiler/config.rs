//! Process-wide profiler settings: the target device, the switch that turns
//! probes off, printing at exit, and the default report columns.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::report::Column;
use crate::{Device, DeviceSelector, Result};

const AUTO: usize = 0;
const CURRENT_CUDA: usize = 1;
const CPU: usize = 2;
const CUDA_BASE: usize = 3;

static TARGET: AtomicUsize = AtomicUsize::new(AUTO);
static ENABLED: AtomicBool = AtomicBool::new(true);
static PRINT_AT_EXIT: AtomicBool = AtomicBool::new(true);
static COLUMNS: Mutex<Option<Vec<Column>>> = Mutex::new(None);
static OUTPUT: Mutex<Output> = Mutex::new(Output::Stdout);

/// Where memlab prints the tables it prints by itself (`profile_every` and at exit).
pub enum Output {
    /// Standard output (the default).
    Stdout,
    /// Standard error.
    Stderr,
    /// A function that receives each rendered table, e.g. to log it.
    Sink(Box<dyn Fn(&str) + Send>),
}

/// Sets where memlab prints the tables it prints by itself.
pub fn set_output(output: Output) {
    *OUTPUT.lock().unwrap_or_else(|e| e.into_inner()) = output;
}

/// Prints `text` to the output chosen with [`set_output`]. Best effort: a
/// closed stream must not turn a profiled call into a panic, least of all
/// while unwinding.
pub fn emit(text: &str) {
    use std::io::Write;
    if text.is_empty() {
        return;
    }
    match &*OUTPUT.lock().unwrap_or_else(|e| e.into_inner()) {
        Output::Stdout => drop(std::io::stdout().lock().write_all(text.as_bytes())),
        Output::Stderr => drop(std::io::stderr().lock().write_all(text.as_bytes())),
        Output::Sink(f) => f(text),
    }
}

/// Sets the device that profiled functions without a `device = …` option
/// measure, for every thread (the counterpart of pytorch_memlab's
/// `set_target_gpu`). The default is [`DeviceSelector::Auto`].
pub fn set_target_device(target: DeviceSelector) {
    let code = match target {
        DeviceSelector::Auto => AUTO,
        DeviceSelector::CurrentCuda => CURRENT_CUDA,
        DeviceSelector::Fixed(Device::Cpu) => CPU,
        DeviceSelector::Fixed(Device::Cuda(i)) => CUDA_BASE + i,
    };
    TARGET.store(code, Ordering::Relaxed);
}

/// Makes CUDA device `index` the global target: `set_target_device(Fixed(Cuda(index)))`.
pub fn set_target_gpu(index: usize) {
    set_target_device(DeviceSelector::Fixed(Device::Cuda(index)));
}

/// The global target set by [`set_target_device`].
pub fn target_device() -> DeviceSelector {
    match TARGET.load(Ordering::Relaxed) {
        AUTO => DeviceSelector::Auto,
        CURRENT_CUDA => DeviceSelector::CurrentCuda,
        CPU => DeviceSelector::Fixed(Device::Cpu),
        n => DeviceSelector::Fixed(Device::Cuda(n - CUDA_BASE)),
    }
}

/// Turns every profiled function into a plain one (`false`) or back (`true`).
/// A call that is already running keeps its state. The environment variable
/// `MEMLAB_DISABLE=1` turns profiling off from the start.
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// Whether profiled functions measure (see [`set_enabled`]).
pub fn is_enabled() -> bool {
    static FROM_ENV: std::sync::Once = std::sync::Once::new();
    FROM_ENV.call_once(|| {
        if std::env::var_os("MEMLAB_DISABLE").is_some_and(|v| v != "0" && !v.is_empty()) {
            ENABLED.store(false, Ordering::Relaxed);
        }
    });
    ENABLED.load(Ordering::Relaxed)
}

/// Whether the tables of `#[profile]` functions print when the process exits
/// (default: yes; `MEMLAB_PRINT_AT_EXIT=0` also turns it off).
pub fn set_print_at_exit(print: bool) {
    PRINT_AT_EXIT.store(print, Ordering::Relaxed);
}

pub(crate) fn print_at_exit() -> bool {
    PRINT_AT_EXIT.load(Ordering::Relaxed) && std::env::var_os("MEMLAB_PRINT_AT_EXIT").is_none_or(|v| v != "0")
}

/// Sets the columns of every report that does not choose its own: names of
/// `torch.cuda.memory_stats()` keys (`reserved_bytes.large_pool.peak`, …) or
/// `increment`, `increment_total`, `hits`.
pub fn set_default_columns<S: AsRef<str>>(names: &[S]) -> Result<()> {
    let columns = names.iter().map(|n| n.as_ref().parse()).collect::<Result<Vec<Column>>>()?;
    *COLUMNS.lock().unwrap_or_else(|e| e.into_inner()) = Some(columns);
    Ok(())
}

/// The columns reports use by default.
pub fn default_columns() -> Vec<Column> {
    COLUMNS.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(Column::defaults)
}
