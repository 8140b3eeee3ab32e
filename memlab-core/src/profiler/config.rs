//! Process-wide profiler settings: the target device, the switch that turns
//! probes off, printing at exit, the default report columns, and where
//! memlab's own output goes.
//!
//! Switches follow one rule: an explicit call (`set_enabled`, …) wins over the
//! environment whenever it is made; until then the environment variable
//! decides, parsed by [`env_flag`].

use crate::sync::LockExt;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::device::{Device, DeviceSelector};

/// The kind of target stored in `TARGET_KIND`; a CUDA target keeps its index in
/// `TARGET_INDEX`, so every `usize` index stays itself.
const AUTO: usize = 0;
const CURRENT_CUDA: usize = 1;
const CPU: usize = 2;
const CUDA: usize = 3;

crate::process::process_wide! {
    static TARGET_KIND: AtomicUsize = AtomicUsize::new(AUTO);
}
crate::process::process_wide! {
    static TARGET_INDEX: AtomicUsize = AtomicUsize::new(0);
}
crate::process::process_wide! {
    static ENABLED: Switch = Switch::new("MEMLAB_DISABLE", true);
}
crate::process::process_wide! {
    static PRINT_AT_EXIT: Switch = Switch::new("MEMLAB_PRINT_AT_EXIT", false);
}

/// Reads a boolean environment variable the one way memlab reads them all:
/// `1`, `true`, `yes`, `on` and `0`, `false`, `no`, `off`, in any case and
/// with surrounding spaces ignored. Unset or empty is `None`; anything else is
/// warned about on standard error (once per variable) and ignored.
pub fn env_flag(name: &str) -> Option<bool> {
    let value = std::env::var_os(name)?;
    let text = value.to_string_lossy();
    match parse_flag(&text) {
        Ok(flag) => flag,
        Err(()) => {
            crate::process::process_wide! {
                static WARNED: Mutex<Vec<String>> = Mutex::new(Vec::new());
            }
            let first = {
                let mut warned = WARNED.locked();
                let first = !warned.iter().any(|w| w == name);
                if first {
                    warned.push(name.to_string());
                }
                first
            };
            if first {
                crate::output::warn(&format!(
                    "memlab: ignoring {name}={text:?}: write 1, true, yes or on to turn it on, \
                     0, false, no or off to turn it off\n"
                ));
            }
            None
        }
    }
}

/// What turns a switch of the environment on ([`env_flag`]), in any case.
pub const FLAG_ON: [&str; 4] = ["1", "true", "yes", "on"];
/// What turns it off.
pub const FLAG_OFF: [&str; 4] = ["0", "false", "no", "off"];

fn parse_flag(text: &str) -> std::result::Result<Option<bool>, ()> {
    let text = text.trim().to_ascii_lowercase();
    if text.is_empty() {
        Ok(None)
    } else if FLAG_ON.contains(&text.as_str()) {
        Ok(Some(true))
    } else if FLAG_OFF.contains(&text.as_str()) {
        Ok(Some(false))
    } else {
        Err(())
    }
}

/// A boolean setting with an environment variable behind it: the variable is
/// read once, when the setting is first needed, unless a call set it before.
struct Switch {
    /// 0: not decided yet; 1: off; 2: on.
    state: AtomicU8,
    variable: &'static str,
    /// Whether the variable being on turns the setting off (`MEMLAB_DISABLE`).
    inverted: bool,
}

impl Switch {
    const fn new(variable: &'static str, inverted: bool) -> Switch {
        Switch { state: AtomicU8::new(0), variable, inverted }
    }

    fn set(&self, on: bool) {
        self.state.store(1 + u8::from(on), Ordering::Relaxed);
    }

    #[inline]
    fn get(&self, default: bool) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => self.read_env(default),
            state => state == 2,
        }
    }

    #[cold]
    fn read_env(&self, default: bool) -> bool {
        let on = env_flag(self.variable).map_or(default, |flag| flag != self.inverted);
        // A call that set the switch meanwhile wins.
        match self.state.compare_exchange(0, 1 + u8::from(on), Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => on,
            Err(state) => state == 2,
        }
    }
}

/// Sets the device that profiled functions without a `device = …` option
/// measure, for every thread (the counterpart of pytorch_memlab's
/// `set_target_gpu`). The default is [`DeviceSelector::Auto`].
pub fn set_target_device(target: DeviceSelector) {
    let kind = match target {
        DeviceSelector::Auto => AUTO,
        DeviceSelector::CurrentCuda => CURRENT_CUDA,
        DeviceSelector::Fixed(Device::Cpu) => CPU,
        DeviceSelector::Fixed(Device::Cuda(i)) => {
            TARGET_INDEX.store(i, Ordering::Relaxed);
            CUDA
        }
    };
    TARGET_KIND.store(kind, Ordering::Release);
}

/// Makes CUDA device `index` the global target: `set_target_device(Fixed(Cuda(index)))`.
pub fn set_target_gpu(index: usize) {
    set_target_device(DeviceSelector::Fixed(Device::Cuda(index)));
}

/// The global target set by [`set_target_device`].
pub fn target_device() -> DeviceSelector {
    match TARGET_KIND.load(Ordering::Acquire) {
        AUTO => DeviceSelector::Auto,
        CURRENT_CUDA => DeviceSelector::CurrentCuda,
        CPU => DeviceSelector::Fixed(Device::Cpu),
        _ => DeviceSelector::Fixed(Device::Cuda(TARGET_INDEX.load(Ordering::Relaxed))),
    }
}

/// Turns every profiled function into a plain one (`false`) or back (`true`).
/// A call that is already running keeps its state. Until this is called, the
/// environment variable `MEMLAB_DISABLE` decides (`1`/`true`/`yes`/`on`
/// turns profiling off; see [`env_flag`]); a call wins over it.
pub fn set_enabled(enabled: bool) {
    ENABLED.set(enabled);
}

/// Whether profiled functions measure (see [`set_enabled`]).
#[inline]
pub fn is_enabled() -> bool {
    ENABLED.get(true)
}

/// Whether the tables of `#[profile]` functions print when the process exits
/// (default: yes). Until this is called, `MEMLAB_PRINT_AT_EXIT` decides
/// (`0`/`false`/`no`/`off` turns it off); a call wins over it.
pub fn set_print_at_exit(print: bool) {
    PRINT_AT_EXIT.set(print);
}

pub(crate) fn print_at_exit() -> bool {
    PRINT_AT_EXIT.get(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_one_way() {
        for on in ["1", "true", "TRUE", " yes ", "On"] {
            assert_eq!(parse_flag(on), Ok(Some(true)), "{on}");
        }
        for off in ["0", "false", "No", "OFF"] {
            assert_eq!(parse_flag(off), Ok(Some(false)), "{off}");
        }
        assert_eq!(parse_flag(""), Ok(None));
        assert_eq!(parse_flag("maybe"), Err(()));
    }
}
