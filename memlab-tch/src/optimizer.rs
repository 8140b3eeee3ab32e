//! The state of tch's optimizers. `tch::nn::Optimizer` keeps libtorch's
//! `torch::optim::Optimizer` in a private field, with no accessor; its moment
//! buffers are often the largest block of a training run after the
//! parameters. memlab finds the object without assuming the order of the
//! fields, confirms its class in C++, and reads the state map under the
//! caller's borrow of the optimizer: memlab never keeps the pointer, since tch
//! frees the object when the optimizer drops and every step changes the map.

use memlab_core::sync::LockExt;
use std::ffi::c_void;
use std::mem::{align_of, size_of, transmute_copy};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use memlab_core::{Error, Result};
use serde::Serialize;
use tch::nn::{self, Optimizer, OptimizerConfig, Variables};
use tch::Tensor;

use crate::ffi;

/// The tch releases whose optimizers memlab reads (their layout was checked
/// for each).
pub const TCH_RELEASES: [&str; 2] = ffi::TCH_LAYOUT_CHECKED;

/// The optimizer classes tch builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// `nn::Adam`.
    Adam,
    /// `nn::AdamW`.
    AdamW,
    /// `nn::Sgd`.
    Sgd,
    /// `nn::RmsProp`.
    RmsProp,
}

/// An optimizer as configured: what `memlab::measure_model` builds and
/// steps to measure its state, and what `TrainingMonitor::optimizer` names
/// to estimate it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum StepOptimizer {
    /// SGD without momentum.
    Sgd,
    /// SGD with momentum 0.9.
    SgdMomentum,
    /// Adam.
    Adam,
    /// Adam with amsgrad (a third buffer: the running maximum).
    AdamAmsgrad,
    /// AdamW.
    AdamW,
    /// AdamW with amsgrad.
    AdamWAmsgrad,
    /// RMSprop (tch's defaults: no momentum, not centred).
    RmsProp,
    /// Centred RMSprop with momentum 0.9 (three buffers).
    RmsPropCenteredMomentum,
}

impl StepOptimizer {
    /// Every configuration, in the order above.
    pub const ALL: [StepOptimizer; 8] = [
        StepOptimizer::Sgd,
        StepOptimizer::SgdMomentum,
        StepOptimizer::Adam,
        StepOptimizer::AdamAmsgrad,
        StepOptimizer::AdamW,
        StepOptimizer::AdamWAmsgrad,
        StepOptimizer::RmsProp,
        StepOptimizer::RmsPropCenteredMomentum,
    ];

    /// The state buffers it keeps per parameter, each the parameter's size:
    /// its state is this many times the parameters' bytes (libtorch keeps
    /// Adam's step count outside any tensor).
    pub fn state_buffers(self) -> u64 {
        match self {
            StepOptimizer::Sgd => 0,
            StepOptimizer::SgdMomentum | StepOptimizer::RmsProp => 1,
            StepOptimizer::Adam | StepOptimizer::AdamW => 2,
            StepOptimizer::AdamAmsgrad | StepOptimizer::AdamWAmsgrad | StepOptimizer::RmsPropCenteredMomentum => 3,
        }
    }

    /// The tch optimizer of this configuration over `vs`'s variables, with
    /// learning rate 1e-3.
    pub fn build(self, vs: &nn::VarStore) -> Result<nn::Optimizer> {
        let built = match self {
            StepOptimizer::Sgd => nn::Sgd::default().build(vs, 1e-3),
            StepOptimizer::SgdMomentum => nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, 1e-3),
            StepOptimizer::Adam => nn::Adam::default().build(vs, 1e-3),
            StepOptimizer::AdamAmsgrad => nn::Adam::default().amsgrad(true).build(vs, 1e-3),
            StepOptimizer::AdamW => nn::AdamW::default().build(vs, 1e-3),
            StepOptimizer::AdamWAmsgrad => nn::AdamW::default().amsgrad(true).build(vs, 1e-3),
            StepOptimizer::RmsProp => nn::RmsProp::default().build(vs, 1e-3),
            StepOptimizer::RmsPropCenteredMomentum => {
                nn::RmsProp { momentum: 0.9, centered: true, ..Default::default() }.build(vs, 1e-3)
            }
        };
        built.map_err(crate::torch_error)
    }
}

/// A tensor of a parameter's optimizer state, by libtorch's name for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateSlot {
    /// Adam's first moment.
    ExpAvg,
    /// Adam's second moment.
    ExpAvgSq,
    /// Adam's running maximum of the second moment (amsgrad only).
    MaxExpAvgSq,
    /// SGD's and RMSprop's momentum.
    MomentumBuffer,
    /// RMSprop's running average of squared gradients.
    SquareAvg,
    /// Centred RMSprop's running average of gradients.
    GradAvg,
}

impl StateSlot {
    /// libtorch's name: `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`,
    /// `momentum_buffer`, `square_avg`, `grad_avg`.
    pub fn name(self) -> &'static str {
        match self {
            StateSlot::ExpAvg => "exp_avg",
            StateSlot::ExpAvgSq => "exp_avg_sq",
            StateSlot::MaxExpAvgSq => "max_exp_avg_sq",
            StateSlot::MomentumBuffer => "momentum_buffer",
            StateSlot::SquareAvg => "square_avg",
            StateSlot::GradAvg => "grad_avg",
        }
    }

    fn from_ffi(slot: i32) -> Result<Option<StateSlot>> {
        Ok(Some(match slot {
            ffi::STATE_NONE => return Ok(None),
            ffi::STATE_EXP_AVG => StateSlot::ExpAvg,
            ffi::STATE_EXP_AVG_SQ => StateSlot::ExpAvgSq,
            ffi::STATE_MAX_EXP_AVG_SQ => StateSlot::MaxExpAvgSq,
            ffi::STATE_MOMENTUM_BUFFER => StateSlot::MomentumBuffer,
            ffi::STATE_SQUARE_AVG => StateSlot::SquareAvg,
            ffi::STATE_GRAD_AVG => StateSlot::GradAvg,
            other => return Err(Error::Backend(format!("unknown optimizer state slot {other}"))),
        }))
    }
}

/// One parameter of an optimizer and one tensor of its state.
#[derive(Debug)]
pub struct ParamState {
    /// The parameter's `TensorImpl` address (see [`tensor_impl`]).
    pub param: u64,
    /// The index of the parameter's group.
    pub group: usize,
    /// Which tensor of the state this is; `None`: the parameter has no state
    /// yet (no step since it joined, or it never had a gradient).
    pub slot: Option<StateSlot>,
    /// The state tensor itself (shared with the optimizer, not a copy).
    pub tensor: Option<Tensor>,
}

/// What an optimizer holds, read under a borrow of it.
#[derive(Debug)]
pub struct OptimizerState {
    /// Its class.
    pub kind: OptimizerKind,
    /// Which of the var stores given to [`read`] it was built on.
    pub store: usize,
    /// Every parameter it updates, group by group, once per state tensor.
    pub params: Vec<ParamState>,
}

/// The `TensorImpl` address of `tensor`: what optimizer states are keyed by,
/// and the same for every shallow clone of a variable (a var store's
/// variable and tch's trainable copy of it), whatever device its data moves
/// to.
///
/// An `at::Tensor` holds one word, its intrusive pointer to the
/// `TensorImpl` (`at::TensorBase::impl_`), so the address is read from the
/// handle itself, without a call into libtorch: walks over thousands of
/// variables pay a load each. The first read in a process is checked against
/// libtorch's own accessor; should a libtorch ever lay the tensor out
/// otherwise, every read asks libtorch.
pub fn tensor_impl(tensor: &Tensor) -> Result<u64> {
    const UNKNOWN: u8 = 0;
    const FIRST_WORD: u8 = 1;
    const ASK: u8 = 2;
    static LAYOUT: AtomicU8 = AtomicU8::new(UNKNOWN);
    let asked = || {
        let mut out = 0u64;
        // SAFETY: `as_ptr` is tch's live at::Tensor; the shim writes one word.
        ffi::check(unsafe { ffi::memlab_tensor_impl(tensor.as_ptr().cast(), &mut out) }).map(|()| out)
    };
    // SAFETY: `as_ptr` points at the live at::Tensor this handle owns, an
    // object at least one word long and aligned for it; reading that word
    // reads the pointer it holds.
    let word = unsafe { std::ptr::read(tensor.as_ptr().cast::<u64>()) };
    match LAYOUT.load(Ordering::Relaxed) {
        FIRST_WORD => Ok(word),
        ASK => asked(),
        _ => {
            let address = asked()?;
            LAYOUT.store(if address == word { FIRST_WORD } else { ASK }, Ordering::Relaxed);
            Ok(address)
        }
    }
}

/// The state of `optimizer`, which was built on one of `stores` (the
/// `variables_` of var stores). The borrow keeps the optimizer alive and
/// unchanged while memlab reads it; the tensors returned share the state's
/// storage and stay valid on their own.
pub fn read(optimizer: &Optimizer, stores: &[Arc<Mutex<Variables>>]) -> Result<OptimizerState> {
    let (object, store) = locate(optimizer, stores)?;
    let mut kind = ffi::OPTIMIZER_NONE;
    // SAFETY: `object` is the optimizer's torch::optim::Optimizer*, identified
    // by `locate`, alive for the borrow; the shim writes one int.
    ffi::check(unsafe { ffi::memlab_optimizer_kind(object, &mut kind) })?;
    let kind = match kind {
        ffi::OPTIMIZER_ADAM => OptimizerKind::Adam,
        ffi::OPTIMIZER_ADAMW => OptimizerKind::AdamW,
        ffi::OPTIMIZER_SGD => OptimizerKind::Sgd,
        ffi::OPTIMIZER_RMSPROP => OptimizerKind::RmsProp,
        _ => {
            return Err(Error::Optimizer(
                "it is none of the classes tch builds (Adam, AdamW, SGD, RMSprop), which are all memlab reads".into(),
            ))
        }
    };
    let mut entries: Vec<ffi::OptimizerState> = Vec::new();
    loop {
        let mut count = 0i64;
        // SAFETY: `entries` has room for `capacity` records; every tensor
        // handle written is taken over below.
        ffi::check(unsafe {
            ffi::memlab_optimizer_states(object, entries.as_mut_ptr(), entries.capacity() as i64, &mut count)
        })?;
        let count = usize::try_from(count).unwrap_or(0);
        if count <= entries.capacity() {
            // SAFETY: the shim initialised the first `count` records.
            unsafe { entries.set_len(count) };
            break;
        }
        // Too little room: the shim handed out no handles; ask again with enough.
        entries.reserve_exact(count);
    }
    let mut params = Vec::with_capacity(entries.len());
    // Every handle is owned from here on, even if a slot turns out unknown.
    let tensors: Vec<Option<Tensor>> =
        entries.iter().map(|e| (!e.tensor.is_null()).then(|| unsafe { Tensor::from_ptr(e.tensor.cast()) })).collect();
    for (e, tensor) in entries.iter().zip(tensors) {
        let slot = StateSlot::from_ffi(e.slot)?;
        params.push(ParamState { param: e.param, group: usize::try_from(e.group).unwrap_or(0), slot, tensor });
    }
    Ok(OptimizerState { kind, store, params })
}

/// How many parameters `optimizer`, built on `store` (a var store's
/// `variables_`), keeps state for: one number, read without touching a
/// tensor. libtorch adds a parameter's state at its first step with a
/// gradient and then updates it in place, so a state read once stays right
/// until this number changes.
pub fn state_count(optimizer: &Optimizer, store: &Arc<Mutex<Variables>>) -> Result<usize> {
    let (object, _) = locate(optimizer, std::slice::from_ref(store))?;
    let mut count = 0i64;
    // SAFETY: `object` is the optimizer's torch::optim::Optimizer*, identified
    // by `locate`, alive for the borrow; the shim writes one number.
    ffi::check(unsafe { ffi::memlab_optimizer_state_count(object, &mut count) })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The address of the `torch::optim::Optimizer` inside `optimizer`, and which
/// of `stores` it was built on. tch's `Optimizer` is three words: the C++
/// object, an `Arc` of its var store's variables, and how many of them it
/// has taken in. The `Arc` is recognised by its address, the count by being
/// no more than the store's trainable variables; the word left is the object,
/// and nothing is dereferenced until then (its class is confirmed in C++).
fn locate(optimizer: &Optimizer, stores: &[Arc<Mutex<Variables>>]) -> Result<(*const c_void, usize)> {
    const WORD: usize = size_of::<usize>();
    let release = crate::tch_release();
    let checked = ffi::TCH_LAYOUT_CHECKED.join(" and ");
    if !ffi::TCH_LAYOUT_CHECKED.contains(&release) {
        return Err(Error::Optimizer(format!(
            "memlab was built against tch {release}, whose Optimizer layout it has not checked (it knows tch \
             {checked}); build with one of those"
        )));
    }
    let unexpected = || {
        Error::Optimizer(format!(
            "tch {release}'s Optimizer is not laid out as memlab knows it for tch {checked} ({} bytes); build \
             with a memlab that knows this tch",
            size_of::<Optimizer>()
        ))
    };
    if size_of::<Optimizer>() != ffi::TCH_OPTIMIZER_WORDS * WORD || size_of::<Arc<Mutex<Variables>>>() != WORD {
        return Err(unexpected());
    }
    // SAFETY: three initialised words (checked above): a pointer, an Arc and
    // a usize, read as plain integers.
    let words: [usize; ffi::TCH_OPTIMIZER_WORDS] = unsafe { transmute_copy(optimizer) };
    // SAFETY: an Arc is one non-null pointer (checked above), read as an integer.
    let arcs: Vec<usize> = stores.iter().map(|a| unsafe { transmute_copy::<_, usize>(a) }).collect();
    let trainable = |store: usize| stores[store].locked().trainable_variables.len();
    let (object, store) = classify(words, &arcs, trainable).map_err(|why| match why {
        Layout::NoStore => Error::Optimizer(
            "it was built on a var store memlab was not given: pass that var store too (or register it)".into(),
        ),
        Layout::Unexpected => unexpected(),
    })?;
    Ok((object as *const c_void, store))
}

/// Why three words are not a tch `Optimizer` memlab was given the store of.
#[derive(Debug, PartialEq, Eq)]
enum Layout {
    /// No word is the `Arc` of a store given.
    NoStore,
    /// The two other words are not one count and one object.
    Unexpected,
}

/// Which of an `Optimizer`'s three `words` is the C++ object, and which of
/// the stores (whose `Arc`s are `arcs`) it was built on: one word is a
/// store's `Arc`, one is a count no larger than that store's trainable
/// variables, and the last, a plausible aligned address, is the object.
/// Decides from the numbers alone; nothing is dereferenced.
fn classify(
    words: [usize; 3],
    arcs: &[usize],
    trainable: impl Fn(usize) -> usize,
) -> std::result::Result<(usize, usize), Layout> {
    let found = words.iter().enumerate().find_map(|(i, w)| arcs.iter().position(|a| a == w).map(|s| (i, s)));
    let (arc_word, store) = found.ok_or(Layout::NoStore)?;
    let trainable = trainable(store);
    let others: Vec<usize> = (0..3).filter(|&i| i != arc_word).map(|i| words[i]).collect();
    let is_count = |w: usize| w <= trainable;
    let is_object = |w: usize| w > 0xffff && w.is_multiple_of(align_of::<usize>()) && !arcs.contains(&w);
    match (is_count(others[0]) && is_object(others[1]), is_count(others[1]) && is_object(others[0])) {
        (true, false) => Ok((others[1], store)),
        (false, true) => Ok((others[0], store)),
        _ => Err(Layout::Unexpected),
    }
}

#[cfg(test)]
mod tests {
    use super::{classify, tensor_impl, Layout};
    use crate::ffi;

    /// What libtorch's own accessor says.
    fn asked(tensor: &tch::Tensor) -> u64 {
        let mut out = 0u64;
        // SAFETY: a live tensor; the shim writes one word.
        ffi::check(unsafe { ffi::memlab_tensor_impl(tensor.as_ptr().cast(), &mut out) }).unwrap();
        out
    }

    #[test]
    fn a_tensor_is_told_by_its_impl_without_asking_libtorch() {
        let t = tch::Tensor::zeros([4, 4], (tch::Kind::Float, tch::Device::Cpu));
        // The first read checks the layout; every later one is a load.
        for tensor in
            [&t, &t.shallow_clone(), &t.view([16]), &t.detach(), &tch::Tensor::ones([1], tch::kind::FLOAT_CPU)]
        {
            assert_eq!(tensor_impl(tensor).unwrap(), asked(tensor));
        }
        assert_eq!(tensor_impl(&t).unwrap(), tensor_impl(&t.shallow_clone()).unwrap(), "a shallow clone is the same");
        assert_ne!(tensor_impl(&t).unwrap(), tensor_impl(&t.view([16])).unwrap(), "a view is another tensor");
    }

    const ARC: usize = 0x5555_0000_1000;
    const OTHER_ARC: usize = 0x5555_0000_2000;
    const OBJECT: usize = 0x5555_0000_8000;

    #[test]
    fn the_object_is_found_in_any_field_order() {
        let trainable = |_| 4;
        for words in [[OBJECT, ARC, 3], [ARC, OBJECT, 3], [3, ARC, OBJECT], [ARC, 0, OBJECT], [OBJECT, 4, ARC]] {
            assert_eq!(classify(words, &[ARC], trainable), Ok((OBJECT, 0)), "{words:x?}");
        }
        assert_eq!(classify([OBJECT, OTHER_ARC, 2], &[ARC, OTHER_ARC], trainable), Ok((OBJECT, 1)));
    }

    #[test]
    fn anything_else_is_refused_before_a_dereference() {
        let trainable = |_| 4;
        // Built on a store memlab was not given.
        assert_eq!(classify([OBJECT, OTHER_ARC, 3], &[ARC], trainable), Err(Layout::NoStore));
        // A count larger than the store's variables: no word reads as one.
        assert_eq!(classify([OBJECT, ARC, 5], &[ARC], trainable), Err(Layout::Unexpected));
        // No plausible object: null, small, misaligned, or another store's Arc.
        for object in [0, 0x40, OBJECT + 1, OTHER_ARC] {
            assert_eq!(classify([object, ARC, 3], &[ARC, OTHER_ARC], trainable), Err(Layout::Unexpected), "{object:x}");
        }
        // Two words that could each be the object: ambiguous, so refused.
        assert_eq!(classify([OBJECT, ARC, OBJECT + 8], &[ARC], trainable), Err(Layout::Unexpected));
    }
}
