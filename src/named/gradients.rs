//! The gradients the walks outside an out-of-memory handler saw, held
//! weakly by the full name of their parameter. A handler runs on whatever
//! thread failed, possibly while the autograd engine writes gradients on
//! another: asking libtorch for a parameter's gradient then races with it
//! (as plain tch would), so the handler names gradients from here instead.
//! A gradient replaced since (a step after `zero_grad`, which sets them to
//! none) is gone from here, and is counted among the unnamed bytes.

use memlab_core::sync::LockExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use memlab_core::Result;
use memlab_tch::WeakTensor;
use tch::nn::Variables;
use tch::Tensor;

memlab_core::process::process_wide! {
    static GRADIENTS: Mutex<Option<HashMap<String, WeakTensor>>> = Mutex::new(None);
}
memlab_core::process::process_wide! {
    /// Set while the out-of-memory recorder is armed (by a call or by
    /// `MEMLAB_OOM_DIR`).
    static KEEP: AtomicBool = AtomicBool::new(false);
}

/// Keeps the gradients walks see from now on, or stops (and forgets
/// them): the out-of-memory recorder asks for them while it is armed.
pub(crate) fn keep(on: bool) {
    KEEP.store(on, Ordering::Relaxed);
    if !on {
        *GRADIENTS.locked() = None;
    }
}

/// Whether walks keep the gradients they see: while the recorder is armed.
pub(super) fn kept() -> bool {
    KEEP.load(Ordering::Relaxed)
}

/// Keeps the gradients of the variables of `store` (named `prefix.name`),
/// read in one call into libtorch.
pub(super) fn remember_store(prefix: &str, store: &Mutex<Variables>) -> Result<()> {
    let (names, weak) = {
        let variables = store.locked();
        let (names, tensors): (Vec<&String>, Vec<&Tensor>) = variables.named_variables.iter().unzip();
        let weak = memlab_tch::registry::weak_gradients(&tensors)?;
        let full =
            |name: &str| if prefix.is_empty() { format!("{name}.grad") } else { format!("{prefix}.{name}.grad") };
        (names.into_iter().map(|n| full(n)).collect::<Vec<_>>(), weak)
    };
    remember(names.into_iter().zip(weak).filter_map(|(name, weak)| weak.map(|w| (name, w))).collect());
    Ok(())
}

/// Keeps what a walk saw, in place of what earlier walks saw under the
/// same names; gradients that are gone drop out.
pub(super) fn remember(seen: Vec<(String, WeakTensor)>) {
    let mut all = GRADIENTS.locked();
    let all = all.get_or_insert_with(HashMap::new);
    all.retain(|_, weak| !weak.is_gone());
    all.extend(seen);
}

/// The gradients kept, without waiting: `None` while another thread
/// updates them.
pub(super) fn now() -> Option<std::sync::MutexGuard<'static, Option<HashMap<String, WeakTensor>>>> {
    match GRADIENTS.try_lock() {
        Ok(all) => Some(all),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}
