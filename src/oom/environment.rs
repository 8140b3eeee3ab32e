//! `MEMLAB_OOM_DIR=dir`: the recorder armed as the program loads, so that a
//! failure before any memlab call is reported too. The loader runs
//! [`at_load`] before `main` (or when a library that holds memlab is
//! loaded): rustc keeps every `#[used]` static of the crates a program
//! links, so the entry cannot be dropped for want of a caller.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memlab_core::{Error, Result};

use crate::named;

/// The entry the loader calls (an ELF `.init_array` entry, Mach-O's
/// `__mod_init_func`). It runs before `main`, so it must not unwind.
extern "C" fn at_load() {
    // Before anything reaches process-wide state: this entry may run before
    // the anchor's registration, and this copy must share the process's.
    memlab_core::process::provide_anchor(&memlab_tch::ANCHOR);
    let _ = std::panic::catch_unwind(|| {
        if std::env::var_os("MEMLAB_OOM_DIR").is_some() {
            arm();
        }
    });
}

#[used]
#[cfg_attr(not(target_vendor = "apple"), unsafe(link_section = ".init_array"))]
#[cfg_attr(target_vendor = "apple", unsafe(link_section = "__DATA,__mod_init_func"))]
static AT_LOAD: extern "C" fn() = at_load;

/// Arms what the variable asks for, with the defaults of
/// [`OomRecorder`](super::OomRecorder) (no watermark thread: the variable
/// alone does not start one).
fn arm() {
    if dir().is_none() {
        return;
    }
    if let Err(e) = memlab_tch::oom::reserve::set(super::DEFAULT_RESERVE) {
        memlab_core::output::warn(&format!(
            "memlab: MEMLAB_OOM_DIR: the out-of-memory reserve ({} bytes of address space) cannot be kept ({e}); \
             reports are written without it\n",
            super::DEFAULT_RESERVE
        ));
    }
    memlab_tch::oom::prepare_failure_path();
    named::gradients::keep(true);
    memlab_tch::oom::watch_cuda();
}

/// The directory `MEMLAB_OOM_DIR` names, absolute and made if missing;
/// `None` when it is unset or cannot be used, which is said once on
/// standard error (the variable is read as the program loads, before it
/// could choose where memlab's warnings go).
pub(super) fn dir() -> Option<&'static PathBuf> {
    memlab_core::process::process_wide! {
        static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    }
    DIR.get_or_init(|| {
        let raw = std::env::var_os("MEMLAB_OOM_DIR")?;
        if raw.is_empty() {
            return None;
        }
        // Absolute: a later change of the working directory must not move the reports.
        let dir = std::path::absolute(PathBuf::from(&raw)).unwrap_or_else(|_| PathBuf::from(raw));
        match usable_dir(&dir) {
            Ok(()) => Some(dir),
            Err(why) => {
                memlab_core::output::warn(&format!(
                    "memlab: ignoring MEMLAB_OOM_DIR={}: {why}; out-of-memory reports are off until \
                     memlab::OomRecorder arms them\n",
                    dir.display()
                ));
                None
            }
        }
    })
    .as_ref()
}

/// Whether reports can be written in `dir`: it exists (made if missing), is
/// a directory, and takes a file; an [`Error::Io`] that says which of these
/// failed, with the system's error, otherwise.
pub(super) fn usable_dir(dir: &Path) -> Result<()> {
    let what = |step: &str| format!("{step} {} for out-of-memory reports", dir.display());
    std::fs::create_dir_all(dir).map_err(|e| Error::io(what("create the directory"), e))?;
    let probe = dir.join(format!(".memlab-oom-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| Error::io(what("write a file in"), e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}
