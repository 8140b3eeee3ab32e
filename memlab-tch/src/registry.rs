//! The models and tensors memlab knows by name: registered once, held weakly,
//! found by the reporter, Courtesy and the monitors without being passed around.
//! A dropped model simply disappears from the registry.

use memlab_core::sync::LockExt;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use memlab_core::Result;
use tch::nn::{VarStore, Variables};
use tch::Tensor;

use crate::ffi;

/// A weak reference to a tensor: it does not keep the tensor's memory alive.
pub struct WeakTensor(*mut c_void);

// SAFETY: the handle is a heap-allocated c10::weak_intrusive_ptr, whose
// reference counts are atomic; it is only read through the shim.
unsafe impl Send for WeakTensor {}
// SAFETY: as above: `lock` and `expired` only read it.
unsafe impl Sync for WeakTensor {}

impl WeakTensor {
    /// A weak reference to `tensor`.
    pub fn new(tensor: &Tensor) -> Result<WeakTensor> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: `as_ptr` is tch's live at::Tensor; the shim writes the handle.
        ffi::check(unsafe { ffi::memlab_weak_tensor_new(tensor.as_ptr().cast(), &mut handle) })?;
        Ok(WeakTensor(handle))
    }

    /// The tensor, if it is still alive (a new handle to the same tensor).
    pub fn upgrade(&self) -> Option<Tensor> {
        // SAFETY: the handle is valid until drop; the shim returns a new
        // heap-allocated at::Tensor, whose ownership tch takes.
        let strong = unsafe { ffi::memlab_weak_tensor_lock(self.0) };
        (!strong.is_null()).then(|| unsafe { Tensor::from_ptr(strong.cast()) })
    }

    /// Whether the tensor is gone.
    pub fn is_gone(&self) -> bool {
        // SAFETY: the handle is valid until drop.
        unsafe { ffi::memlab_weak_tensor_expired(self.0) != 0 }
    }
}

impl Drop for WeakTensor {
    fn drop(&mut self) {
        // SAFETY: the handle came from memlab_weak_tensor_new and is freed once.
        unsafe { ffi::memlab_weak_tensor_free(self.0) }
    }
}

impl std::fmt::Debug for WeakTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_gone() { "WeakTensor(gone)" } else { "WeakTensor(alive)" })
    }
}

/// Weak references to the gradients of `tensors`, in one call into libtorch
/// (`None` where a tensor has none). Reading a gradient races with a backward
/// pass on another thread, as tch's own `grad()` does.
pub fn weak_gradients(tensors: &[&Tensor]) -> Result<Vec<Option<WeakTensor>>> {
    crate::storage::count_gradient_reads(tensors.len() as u64);
    let pointers: Vec<*const c_void> = tensors.iter().map(|t| t.as_ptr() as *const c_void).collect();
    let mut out = vec![std::ptr::null_mut(); tensors.len()];
    // SAFETY: `pointers` are tch's live at::Tensors; the shim writes one
    // handle (or NULL) per tensor into `out`, which has room for them all.
    let status = unsafe { ffi::memlab_weak_gradients(pointers.as_ptr(), pointers.len() as i64, out.as_mut_ptr()) };
    // Every handle written is owned from here on, even on an error.
    let weak: Vec<Option<WeakTensor>> = out.into_iter().map(|h| (!h.is_null()).then_some(WeakTensor(h))).collect();
    ffi::check(status)?;
    Ok(weak)
}

/// A registered var store, held weakly.
#[derive(Clone, Debug)]
pub struct WeakVarStore {
    /// The name it was registered under.
    pub name: String,
    /// Its variables, while the var store lives.
    pub variables: Weak<Mutex<Variables>>,
}

enum Entry {
    VarStore(WeakVarStore),
    Tensor {
        name: String,
        tensor: WeakTensor,
    },
    /// A tensor of a registered optimizer's state (`fc.weight.exp_avg`).
    State {
        name: String,
        tensor: WeakTensor,
    },
}

impl Entry {
    fn is_gone(&self) -> bool {
        match self {
            Entry::VarStore(vs) => vs.variables.strong_count() == 0,
            Entry::Tensor { tensor, .. } | Entry::State { tensor, .. } => tensor.is_gone(),
        }
    }
}

memlab_core::process::process_wide! {
    static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
}

memlab_core::process::process_wide! {
    /// Whether any optimizer state was registered since the registry was last
    /// cleared: lets the walks that run on every dispose scope skip a second
    /// lock of the registry in the usual case of none.
    static HAS_STATES: AtomicBool = AtomicBool::new(false);
}

/// The registry, without the entries whose model or tensor is gone.
fn entries() -> MutexGuard<'static, Vec<Entry>> {
    let mut entries = REGISTRY.locked();
    entries.retain(|e| !e.is_gone());
    entries
}

/// The registry if no other thread holds it now (for code that must not
/// wait, such as an out-of-memory handler); entries that are gone are left
/// for the next caller to sweep.
fn entries_now() -> Option<MutexGuard<'static, Vec<Entry>>> {
    match REGISTRY.try_lock() {
        Ok(entries) => Some(entries),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Everything registered and still alive, taken at once.
#[derive(Debug, Default)]
pub struct Registered {
    /// The var stores.
    pub var_stores: Vec<WeakVarStore>,
    /// The tensors, with new handles.
    pub tensors: Vec<(String, Tensor)>,
    /// The optimizer state tensors, with new handles.
    pub states: Vec<(String, Tensor)>,
}

/// Like [`var_stores`], [`tensors`] and [`states`] together, without waiting
/// for the registry: `None` when another thread holds it now.
pub fn try_all() -> Option<Registered> {
    let entries = entries_now()?;
    let mut out = Registered::default();
    for e in entries.iter() {
        match e {
            Entry::VarStore(vs) if vs.variables.strong_count() > 0 => out.var_stores.push(vs.clone()),
            Entry::VarStore(_) => {}
            Entry::Tensor { name, tensor } => out.tensors.extend(tensor.upgrade().map(|t| (name.clone(), t))),
            Entry::State { name, tensor } => out.states.extend(tensor.upgrade().map(|t| (name.clone(), t))),
        }
    }
    Some(out)
}

/// Registers `vs` under `name` (its variables are reported as `name.variable`;
/// an empty name adds no prefix). Held weakly.
pub fn register_var_store(name: impl Into<String>, vs: &VarStore) {
    let entry = WeakVarStore { name: name.into(), variables: Arc::downgrade(&vs.variables_) };
    entries().push(Entry::VarStore(entry));
}

/// Registers a tensor under `name`, held weakly.
pub fn register_tensor(name: impl Into<String>, tensor: &Tensor) -> Result<()> {
    let tensor = WeakTensor::new(tensor)?;
    entries().push(Entry::Tensor { name: name.into(), tensor });
    Ok(())
}

/// Registers the tensors of an optimizer's state, each under its name and held
/// weakly, in place of the state tensors registered before under the same
/// names (libtorch updates a state in place, so one registration after the
/// first step stays right; a tensor that is gone drops out).
pub fn register_states(states: &[(String, Tensor)]) -> Result<()> {
    let weak: Vec<(String, WeakTensor)> =
        states.iter().map(|(n, t)| WeakTensor::new(t).map(|w| (n.clone(), w))).collect::<Result<_>>()?;
    let mut entries = entries();
    let names: std::collections::HashSet<&str> = weak.iter().map(|(n, _)| n.as_str()).collect();
    entries.retain(|e| !matches!(e, Entry::State { name, .. } if names.contains(name.as_str())));
    entries.extend(weak.into_iter().map(|(name, tensor)| Entry::State { name, tensor }));
    HAS_STATES.store(true, Ordering::Relaxed);
    Ok(())
}

/// The registered optimizer state tensors still alive, with new handles.
pub fn states() -> Vec<(String, Tensor)> {
    if !HAS_STATES.load(Ordering::Relaxed) {
        return Vec::new();
    }
    entries()
        .iter()
        .filter_map(|e| match e {
            Entry::State { name, tensor } => tensor.upgrade().map(|t| (name.clone(), t)),
            _ => None,
        })
        .collect()
}

/// Forgets every registered var store and tensor.
pub fn clear_registry() {
    let mut entries = entries();
    entries.clear();
    HAS_STATES.store(false, Ordering::Relaxed);
}

/// The registered var stores that are still alive.
pub fn var_stores() -> Vec<WeakVarStore> {
    entries()
        .iter()
        .filter_map(|e| match e {
            Entry::VarStore(vs) => Some(vs.clone()),
            _ => None,
        })
        .collect()
}

/// The registered tensors that are still alive, with new handles.
pub fn tensors() -> Vec<(String, Tensor)> {
    entries()
        .iter()
        .filter_map(|e| match e {
            Entry::Tensor { name, tensor } => tensor.upgrade().map(|t| (name.clone(), t)),
            _ => None,
        })
        .collect()
}
