//! Where the copies of memlab in one process meet (`struct memlab_anchor` in
//! the shim's header): the shim finds the process's anchor through libtorch's
//! dispatcher when the copy loads, and shares the counting allocator, the
//! hooks and the CUDA attachments through it; memlab-core's table of
//! process-wide values hangs from the same anchor.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use memlab_core::process::{Anchor, TableAbi};

use crate::ffi;

fn slot() -> &'static AtomicPtr<TableAbi> {
    // SAFETY: the shim's anchor is never null and never freed; its `table`
    // field is touched only here, atomically, by every copy's Rust side.
    unsafe {
        let anchor = ffi::memlab_process_anchor();
        AtomicPtr::from_ptr(std::ptr::addr_of_mut!((*anchor).table).cast::<*mut TableAbi>())
    }
}

fn problem() -> Option<String> {
    if let Some(foreign) = foreign_anchor() {
        return Some(format!(
            "memlab: another memlab in this process ({foreign}) shares its state through an anchor this copy \
             (memlab-tch {}, anchor ABI {}) cannot read; this copy keeps its own state and leaves CPU counting to \
             the other: build every part of the program with one memlab version",
            env!("CARGO_PKG_VERSION"),
            ffi::MEMLAB_ANCHOR_ABI,
        ));
    }
    // SAFETY: no arguments; a non-null result is the shim's malloc'd message.
    ffi::check(unsafe { ffi::memlab_anchor_error() }).err().map(|e| {
        format!(
            "memlab: could not look for other copies of memlab in this process through libtorch's dispatcher \
             ({e}); if memlab is linked more than once, each copy reports apart"
        )
    })
}

/// This copy's anchor, for code that runs as the copy loads
/// ([`memlab_core::process::provide_anchor`]); registered for everyone else.
pub static ANCHOR: Anchor = Anchor { slot, problem };

memlab_core::inventory::submit! { Anchor { slot, problem } }

/// The anchor of another ABI found when this copy loaded: who made it and its ABI.
fn foreign_anchor() -> Option<String> {
    // SAFETY: the shim returns null or an anchor whose fixed fields may be read.
    let foreign = unsafe { ffi::memlab_foreign_anchor().as_ref() }?;
    let made_by = if foreign.made_by.is_null() {
        "an unknown version".to_string()
    } else {
        // SAFETY: `made_by` is a NUL-terminated string of the maker's, never freed.
        unsafe { CStr::from_ptr(foreign.made_by) }.to_string_lossy().into_owned()
    };
    Some(format!("{made_by}, anchor ABI {}", foreign.abi))
}

/// How many copies of memlab share this process's state, this one included:
/// 1 for a program that links memlab once; in a notebook, one per cell
/// library that was loaded since memlab's first.
pub fn copies() -> u32 {
    // SAFETY: as in `slot`; `copies` is only changed atomically by the shim.
    unsafe {
        let anchor = ffi::memlab_process_anchor();
        AtomicU32::from_ptr(std::ptr::addr_of_mut!((*anchor).copies)).load(Ordering::Relaxed)
    }
}
