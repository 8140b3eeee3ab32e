//! The gradients the walks outside an out-of-memory handler saw, held
//! weakly by their parameter (its `TensorImpl`), so that a handler names
//! them after its own model whatever names the walk that saw them gave
//! the parameter. A handler runs on whatever
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
use memlab_tch::optimizer::tensor_impl;
use memlab_tch::WeakTensor;
use tch::nn::Variables;
use tch::Tensor;

memlab_core::process::process_wide! {
    static GRADIENTS: Mutex<Option<HashMap<u64, WeakTensor>>> = Mutex::new(None);
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

/// Keeps the gradients of the variables of `store`, read in one call into
/// libtorch.
pub(super) fn remember_store(store: &Mutex<Variables>) -> Result<()> {
    let (parameters, weak) = {
        let variables = store.locked();
        let tensors: Vec<&Tensor> = variables.named_variables.values().collect();
        let weak = memlab_tch::registry::weak_gradients(&tensors)?;
        (tensors.into_iter().map(tensor_impl).collect::<Result<Vec<u64>>>()?, weak)
    };
    remember(parameters.into_iter().zip(weak).filter_map(|(parameter, weak)| weak.map(|w| (parameter, w))).collect());
    Ok(())
}

/// Keeps what a walk saw (each gradient by its parameter's `TensorImpl`),
/// in place of what earlier walks saw of the same parameters; gradients
/// that are gone drop out.
pub(super) fn remember(seen: Vec<(u64, WeakTensor)>) {
    let mut all = GRADIENTS.locked();
    let all = all.get_or_insert_with(HashMap::new);
    all.retain(|_, weak| !weak.is_gone());
    all.extend(seen);
}

/// The gradients kept, without waiting: `None` while another thread
/// updates them.
pub(super) fn now() -> Option<std::sync::MutexGuard<'static, Option<HashMap<u64, WeakTensor>>>> {
    match GRADIENTS.try_lock() {
        Ok(all) => Some(all),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}
