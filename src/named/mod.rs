//! The one walk over the tensors memlab knows by name: the variables of var
//! stores (given to a tool, or registered), their gradients, and tensors added
//! or registered by name. Every tool that names memory goes through here, so
//! a storage is named, grouped with its views and told apart from memory the
//! allocator never allocated the same way everywhere.

use memlab_core::sync::LockExt;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use memlab_core::hash::FastSet;
use memlab_core::TensorKind;
use memlab_core::{Device, Error, Result};
use memlab_tch::optimizer::{tensor_impl, OptimizerKind};
use memlab_tch::registry;
use memlab_tch::storage::{facts, Facts, StorageLayout};
use memlab_tch::WeakTensor;
use tch::nn::{Optimizer, VarStore, Variables};
use tch::Tensor;

pub(crate) mod gradients;
pub(crate) mod seen;

/// An optimizer's state as read when it was given: its tensors by name, and
/// the variables it holds no state for, with why.
pub(crate) struct OptimizerStates {
    /// Its class.
    pub(crate) kind: OptimizerKind,
    /// The var store it was built on: its name (prefix) and variables.
    pub(crate) store: (String, Arc<Mutex<Variables>>),
    /// `parameter.slot` and the state tensor (shared with the optimizer).
    pub(crate) tensors: Vec<(String, Tensor)>,
    /// Parameters the optimizer has taken in but keeps no state for yet: no
    /// step since they joined, no gradient (frozen), or plain SGD.
    pub(crate) stateless: Vec<String>,
    /// Trainable variables the optimizer has not taken in: created after it
    /// was built (tch adds them at the next step).
    pub(crate) absent: Vec<String>,
}

impl OptimizerStates {
    /// Reads `optimizer`, which was built on one of `stores`, naming its
    /// state after the store's variables.
    pub(crate) fn read(optimizer: &Optimizer, stores: &[(String, Arc<Mutex<Variables>>)]) -> Result<OptimizerStates> {
        let arcs: Vec<Arc<Mutex<Variables>>> = stores.iter().map(|(_, v)| v.clone()).collect();
        let state = memlab_tch::optimizer::read(optimizer, &arcs)?;
        let store = stores[state.store].clone();
        let (prefix, variables) = &store;
        let variables = variables.locked();
        let full = |name: &str| if prefix.is_empty() { name.to_string() } else { format!("{prefix}.{name}") };
        // A tensor held under two names (tied weights) is named after the
        // first of them in order, whatever order the store keeps them in.
        let mut names: HashMap<u64, String> = HashMap::new();
        let mut sorted: Vec<(&String, &Tensor)> = variables.named_variables.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        for (name, tensor) in sorted {
            names.entry(tensor_impl(tensor)?).or_insert_with(|| full(name));
        }
        let name_of = |param: u64| names.get(&param).cloned().unwrap_or_else(|| format!("parameter@{param:#x}"));
        let mut out = OptimizerStates {
            kind: state.kind,
            store: store.clone(),
            tensors: Vec::new(),
            stateless: Vec::new(),
            absent: Vec::new(),
        };
        let mut taken = HashSet::new();
        for p in state.params {
            taken.insert(p.param);
            match (p.slot, p.tensor) {
                (Some(slot), Some(tensor)) => {
                    out.tensors.push((format!("{}.{}", name_of(p.param), slot.name()), tensor))
                }
                _ => out.stateless.push(name_of(p.param)),
            }
        }
        for var in &variables.trainable_variables {
            let param = tensor_impl(&var.tensor)?;
            if taken.insert(param) {
                out.absent.push(name_of(param));
            }
        }
        out.tensors.sort_by(|a, b| a.0.cmp(&b.0));
        out.stateless.sort();
        out.absent.sort();
        Ok(out)
    }
}

/// Registers `optimizer` with memlab and gives it back as a
/// [`RegisteredOptimizer`], which is the same optimizer (it derefs to tch's
/// `nn::Optimizer`) and keeps memlab's registration of its state right:
/// after each step it registers the state libtorch created or changed. Every
/// tool that works from the registry then names it: [`MemReporter::registered`],
/// `track!()`, [`where_gpu_memory_went`], the out-of-memory recorder,
/// [`Courtesy::new`] (which then moves the state with the model), and
/// dispose scopes and [`check_step`] (which then count it as model state).
/// Its var store must be registered first (see [`register_var_store`]): the
/// state is named after its variables (`model.fc.weight.exp_avg`).
///
/// Register it where it is built, before the first step: libtorch creates
/// the state at the first step (Adam's `exp_avg` and `exp_avg_sq`, SGD's
/// `momentum_buffer`), and the registered optimizer's own step methods
/// (`backward_step`, `backward_step_clip`, `backward_step_clip_norm`,
/// `step`) register it right after. It has every method of tch's optimizer
/// that changes it; code written for `&mut nn::Optimizer` runs inside
/// [`with_mut`](RegisteredOptimizer::with_mut), after which the state is
/// registered too. It lends the optimizer only that way (no `DerefMut`):
/// memlab reads the optimizer's state on the thread that holds it, between
/// steps, never while a step may be changing it on another thread.
///
/// ```
/// use memlab::Render;
/// use tch::nn::{self, Module, OptimizerConfig};
/// use tch::{Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let fc = nn::linear(vs.root() / "fc", 32, 32, Default::default());
/// memlab::register_var_store("model", &vs);
/// let mut adam = memlab::register_optimizer(nn::Adam::default().build(&vs, 1e-3)?)?;
/// assert_eq!(adam.registered_states(), 0); // no state before the first step
/// adam.backward_step(&fc.forward(&Tensor::ones([4, 32], (Kind::Float, Device::Cpu))).sum(Kind::Float));
/// assert_eq!(adam.registered_states(), 4); // exp_avg and exp_avg_sq of weight and bias
/// let report = memlab::MemReporter::registered().report()?;
/// assert!(report.to_text().contains("model.fc.weight.exp_avg_sq"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`MemReporter::registered`]: crate::MemReporter::registered
/// [`where_gpu_memory_went`]: crate::where_gpu_memory_went
/// [`Courtesy::new`]: crate::Courtesy::new
/// [`check_step`]: crate::check_step
/// [`register_var_store`]: crate::register_var_store
pub fn register_optimizer(optimizer: Optimizer) -> Result<RegisteredOptimizer> {
    let states = OptimizerStates::read(&optimizer, &Model::registered().stores())?;
    let mut registered = RegisteredOptimizer { optimizer, store: states.store, seen: None, states: 0 };
    registered.refresh()?;
    Ok(registered)
}

/// An optimizer registered with memlab: tch's `nn::Optimizer` (it derefs to
/// it, for reading), whose step methods also register the state libtorch
/// made (see [`register_optimizer`]). Dropping it drops the optimizer; the
/// state's registration ends with it.
#[must_use = "the optimizer is registered while it lives: keep it and step it"]
pub struct RegisteredOptimizer {
    optimizer: Optimizer,
    /// The var store it was built on, as registered: its name and variables.
    store: (String, Arc<Mutex<Variables>>),
    /// At the last registration: the parameters with state, and the store's
    /// trainable variables. Neither changed: nothing to read again.
    seen: Option<(usize, usize)>,
    /// State tensors registered at the last registration.
    states: usize,
}

impl RegisteredOptimizer {
    /// tch's `backward_step`, then the registration of the state it made.
    pub fn backward_step(&mut self, loss: &Tensor) {
        self.optimizer.backward_step(loss);
        self.after_step();
    }

    /// tch's `backward_step_clip`, then the registration of the state it made.
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.optimizer.backward_step_clip(loss, max);
        self.after_step();
    }

    /// tch's `backward_step_clip_norm`, then the registration of the state it made.
    pub fn backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.optimizer.backward_step_clip_norm(loss, max);
        self.after_step();
    }

    /// tch's `step`, then the registration of the state it made.
    pub fn step(&mut self) {
        self.optimizer.step();
        self.after_step();
    }

    /// Runs `f` with tch's optimizer (for code written for `&mut
    /// nn::Optimizer`: `opt.with_mut(|opt| train_step(&model, opt))`), then
    /// registers the state its steps made.
    pub fn with_mut<R>(&mut self, f: impl FnOnce(&mut Optimizer) -> R) -> R {
        let out = f(&mut self.optimizer);
        self.after_step();
        out
    }

    /// tch's `zero_grad`.
    pub fn zero_grad(&mut self) {
        self.optimizer.zero_grad();
    }

    /// tch's `set_lr`.
    pub fn set_lr(&mut self, lr: f64) {
        self.optimizer.set_lr(lr);
    }

    /// tch's `set_lr_group`.
    pub fn set_lr_group(&mut self, group: usize, lr: f64) {
        self.optimizer.set_lr_group(group, lr);
    }

    /// tch's `set_momentum`.
    pub fn set_momentum(&mut self, momentum: f64) {
        self.optimizer.set_momentum(momentum);
    }

    /// tch's `set_momentum_group`.
    pub fn set_momentum_group(&mut self, group: usize, momentum: f64) {
        self.optimizer.set_momentum_group(group, momentum);
    }

    /// tch's `set_weight_decay`.
    pub fn set_weight_decay(&mut self, weight_decay: f64) {
        self.optimizer.set_weight_decay(weight_decay);
    }

    /// tch's `set_weight_decay_group`.
    pub fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        self.optimizer.set_weight_decay_group(group, weight_decay);
    }

    /// How many state tensors are registered now (0 before the first step).
    pub fn registered_states(&self) -> usize {
        self.states
    }

    /// tch's optimizer, no longer kept registered by its steps (the state
    /// registered so far stays, held weakly, until the optimizer drops).
    pub fn into_inner(self) -> Optimizer {
        self.optimizer
    }

    fn after_step(&mut self) {
        if let Err(e) = self.refresh() {
            memlab_core::process::process_wide! {
                static SAID: std::sync::Once = std::sync::Once::new();
            }
            SAID.call_once(|| {
                memlab_core::output::warn(&format!(
                    "memlab: the optimizer's state could not be registered after a step ({e}); memlab's tools \
                     leave it unnamed\n"
                ))
            });
        }
    }

    /// Registers the state again where it changed (parameters with state,
    /// or the store's trainable variables, differ from the last time), and,
    /// while the out-of-memory recorder is armed, keeps the store's
    /// gradients for its handler (see the `gradients` module).
    fn refresh(&mut self) -> Result<()> {
        let count = memlab_tch::optimizer::state_count(&self.optimizer, &self.store.1)?;
        let trainable = self.store.1.locked().trainable_variables.len();
        if self.seen != Some((count, trainable)) {
            let states = OptimizerStates::read(&self.optimizer, std::slice::from_ref(&self.store))?;
            registry::register_states(&states.tensors)?;
            self.states = states.tensors.len();
            self.seen = Some((count, trainable));
        }
        if gradients::kept() {
            gradients::remember_store(&self.store.1)?;
        }
        Ok(())
    }
}

impl std::ops::Deref for RegisteredOptimizer {
    type Target = Optimizer;

    fn deref(&self) -> &Optimizer {
        &self.optimizer
    }
}

impl std::fmt::Debug for RegisteredOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredOptimizer").field("store", &self.store.0).field("states", &self.states).finish()
    }
}

/// What memlab names memory after: var stores (their variables and
/// gradients), named tensors, optimizer state and, for
/// [`Model::registered`], everything registered with
/// [`register_var_store`](crate::register_var_store),
/// [`register_tensor`](crate::register_tensor) and
/// [`register_optimizer`](crate::register_optimizer). Described once and
/// given to every tool that names memory, each the same way: `of(model)`
/// ([`MemReporter::of`](crate::MemReporter::of),
/// [`Exporter::of`](crate::export::Exporter::of), [`Courtesy::of`](crate::Courtesy::of),
/// [`DisposeScope::of`](crate::DisposeScope::of), [`Tracker::of`](crate::tracker::Tracker::of),
/// [`TrainingMonitor::of`](crate::TrainingMonitor::of),
/// [`GpuAccount::of`](crate::gpu::GpuAccount::of)), or `registered()` for the
/// registry. A var store is a model too (`MemReporter::of(&vs)`). These
/// tools' `var_store(prefix, vs)`, `tensor(name, t)` and `optimizer(&opt)`
/// add to their model. A tool made from more than its model takes the model
/// with `.of(model)`, and names memory after the registry without one:
/// [`OomRecorder::of`](crate::OomRecorder::of),
/// [`StepLogger::of`](crate::StepLogger::of),
/// [`WillItFit::of`](crate::WillItFit::of) and
/// [`BatchSizeSearch::of`](crate::BatchSizeSearch::of);
/// [`measure_model`](crate::measure_model) takes it as its first argument.
///
/// ```
/// use tch::{nn, Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let _fc = nn::linear(vs.root() / "fc", 256, 256, Default::default());
/// let cache = Tensor::zeros([1024], (Kind::Float, Device::Cpu));
/// let model = memlab::Model::new().var_store("model", &vs).tensor("kv_cache", &cache);
/// let report = memlab::MemReporter::of(model.clone()).device(memlab::Device::Cpu).report()?;
/// let names: Vec<_> = report.device(memlab::Device::Cpu).unwrap().rows.iter().map(|r| r.name.clone()).collect();
/// assert!(names.contains(&"model.fc.weight".to_string()) && names.contains(&"kv_cache".to_string()));
/// let snapshot = memlab::export::Exporter::of(model); // the same names in the exports
/// # drop(snapshot);
/// # Ok::<(), memlab::Error>(())
/// ```
pub struct Model {
    stores: Vec<(String, Arc<Mutex<Variables>>)>,
    tensors: Vec<(String, Tensor)>,
    optimizers: Vec<OptimizerStates>,
    /// Optimizer state tensors taken when these sources were made, inside an
    /// out-of-memory handler (see [`WeakModel::now`]).
    states: Vec<(String, Tensor)>,
    /// Why an optimizer given could not be read: returned by the first walk.
    error: Option<Error>,
    registry: bool,
    /// Whether the walks run inside an out-of-memory handler: they then pass
    /// by a var store another thread (or this one, further up its stack)
    /// holds, noting it in `busy`, and never ask libtorch for a gradient
    /// (see [`GRADIENTS`]).
    in_handler: bool,
    busy: Mutex<Vec<String>>,
}

fn shallow(tensors: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    tensors.iter().map(|(name, t)| (name.clone(), t.shallow_clone())).collect()
}

fn weakly<'a>(tensors: impl IntoIterator<Item = &'a (String, Tensor)>) -> Result<Vec<(String, WeakTensor)>> {
    tensors.into_iter().map(|(name, t)| WeakTensor::new(t).map(|w| (name.clone(), w))).collect()
}

impl Clone for OptimizerStates {
    fn clone(&self) -> OptimizerStates {
        OptimizerStates {
            kind: self.kind,
            store: self.store.clone(),
            tensors: shallow(&self.tensors),
            stateless: self.stateless.clone(),
            absent: self.absent.clone(),
        }
    }
}

/// A copy that shares the tensors and var stores (no tensor is copied).
impl Clone for Model {
    fn clone(&self) -> Model {
        Model {
            stores: self.stores.clone(),
            tensors: shallow(&self.tensors),
            optimizers: self.optimizers.clone(),
            states: shallow(&self.states),
            error: self.error.clone(),
            registry: self.registry,
            in_handler: self.in_handler,
            busy: Mutex::new(self.busy()),
        }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |list: &[(String, Tensor)]| list.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        f.debug_struct("Model")
            .field("var_stores", &self.stores.iter().map(|(prefix, _)| prefix).collect::<Vec<_>>())
            .field("tensors", &names(&self.tensors))
            .field("optimizers", &self.optimizers.iter().map(|o| o.kind).collect::<Vec<_>>())
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl Default for Model {
    fn default() -> Model {
        Model {
            stores: Vec::new(),
            tensors: Vec::new(),
            optimizers: Vec::new(),
            states: Vec::new(),
            error: None,
            registry: false,
            in_handler: false,
            busy: Mutex::new(Vec::new()),
        }
    }
}

/// The model of one var store, its variables under their own names: what
/// makes `MemReporter::of(&vs)`, `Courtesy::of(&vs)` and the like read.
impl From<&VarStore> for Model {
    fn from(vs: &VarStore) -> Model {
        Model::new().var_store("", vs)
    }
}

/// The builders of every tool that names memory, which add to the tool's
/// [`Model`]: one signature and one meaning for all of them.
macro_rules! names_memory_after_its_model {
    ($tool:ty, $model:ident) => {
        impl $tool {
            /// Adds a var store to the tool's model: its variables (and their
            /// gradients) are named `prefix.variable`, or `variable` when
            /// `prefix` is empty (see [`Model::var_store`](crate::Model::var_store)).
            pub fn var_store(mut self, prefix: impl Into<String>, vs: &tch::nn::VarStore) -> Self {
                self.$model.add_store(prefix, vs);
                self
            }

            /// Adds a tensor (and its gradient, if it has one) to the tool's
            /// model under `name` (see [`Model::tensor`](crate::Model::tensor)).
            pub fn tensor(mut self, name: impl Into<String>, tensor: &tch::Tensor) -> Self {
                self.$model.add_tensor(name, tensor);
                self
            }

            /// Adds the state of `optimizer` to the tool's model, read now
            /// under this borrow (see [`Model::optimizer`](crate::Model::optimizer)):
            /// `fc.weight.exp_avg` and the like, with exact bytes. When it
            /// cannot be read, the tool's first walk returns the error.
            pub fn optimizer(mut self, optimizer: &tch::nn::Optimizer) -> Self {
                self.$model.add_optimizer(optimizer);
                self
            }
        }
    };
}
pub(crate) use names_memory_after_its_model;

impl Model {
    /// A model with nothing in it yet: add var stores, tensors and optimizers.
    pub fn new() -> Model {
        Model::default()
    }

    /// Everything registered (var stores, tensors, optimizers) at each use,
    /// plus what is added.
    pub fn registered() -> Model {
        Model { registry: true, ..Model::default() }
    }

    /// Adds a var store; its variables (and their gradients) are named
    /// `prefix.variable`, or `variable` when `prefix` is empty.
    pub fn var_store(mut self, prefix: impl Into<String>, vs: &VarStore) -> Model {
        self.add_store(prefix, vs);
        self
    }

    /// Adds a tensor (and its gradient, if it has one) under `name`.
    pub fn tensor(mut self, name: impl Into<String>, tensor: &Tensor) -> Model {
        self.add_tensor(name, tensor);
        self
    }

    /// Adds the state of `optimizer`, read now under this borrow (memlab never
    /// keeps the optimizer): `fc.weight.exp_avg` and the like, with exact
    /// bytes. Its var store must be one added or registered, which names the
    /// state. When it cannot be read (its var store was not given, or a tch
    /// whose layout memlab does not know), the first tool that walks the
    /// model returns the error.
    pub fn optimizer(mut self, optimizer: &Optimizer) -> Model {
        self.add_optimizer(optimizer);
        self
    }

    /// A copy held weakly (see [`WeakModel`]). The error of an optimizer
    /// that could not be read is returned now.
    pub(crate) fn downgrade(&self) -> Result<WeakModel> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        Ok(WeakModel {
            stores: self.stores.iter().map(|(prefix, v)| (prefix.clone(), Arc::downgrade(v))).collect(),
            tensors: weakly(&self.tensors)?,
            states: weakly(self.optimizers.iter().flat_map(|o| &o.tensors).chain(&self.states))?,
            registry: self.registry,
        })
    }

    fn note_busy(&self, what: impl Into<String>) {
        self.busy.locked().push(what.into());
    }

    /// What a walk without waiting passed by because it was held.
    pub(crate) fn busy(&self) -> Vec<String> {
        self.busy.locked().clone()
    }

    /// Adds a var store whose variables are named `prefix.variable` (no
    /// prefix when `prefix` is empty).
    pub(crate) fn add_store(&mut self, prefix: impl Into<String>, vs: &VarStore) {
        self.stores.push((prefix.into(), vs.variables_.clone()));
    }

    /// Adds a var store's variables, shared, with no prefix.
    pub(crate) fn add_variables(&mut self, variables: Arc<Mutex<Variables>>) {
        self.stores.push((String::new(), variables));
    }

    /// Adds a tensor under `name`.
    pub(crate) fn add_tensor(&mut self, name: impl Into<String>, tensor: &Tensor) {
        self.tensors.push((name.into(), tensor.shallow_clone()));
    }

    /// Reads the state of `optimizer` now, under the caller's borrow (memlab
    /// never keeps the optimizer): its var store must be one of the stores
    /// added or registered. An error is kept for the next walk to return.
    pub(crate) fn add_optimizer(&mut self, optimizer: &Optimizer) {
        match OptimizerStates::read(optimizer, &self.stores()) {
            Ok(states) => self.optimizers.push(states),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }

    /// Forgets the optimizers read (and an error reading one): their state
    /// handles are let go.
    pub(crate) fn clear_optimizers(&mut self) {
        self.optimizers.clear();
        self.error = None;
    }

    /// The optimizers' states read so far.
    pub(crate) fn optimizers(&self) -> &[OptimizerStates] {
        &self.optimizers
    }

    /// The var stores: the ones added, then the registered ones still alive.
    pub(crate) fn stores(&self) -> Vec<(String, Arc<Mutex<Variables>>)> {
        let mut out = self.stores.clone();
        if self.registry {
            out.extend(
                registry::var_stores().into_iter().filter_map(|vs| vs.variables.upgrade().map(|v| (vs.name, v))),
            );
        }
        out
    }

    /// The named tensors: the ones added, then the registered ones still alive.
    pub(crate) fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = shallow(&self.tensors);
        if self.registry {
            out.extend(registry::tensors());
        }
        out
    }

    /// Calls `visit` with the full name and the tensor of every variable,
    /// store by store, names sorted, and then of every named tensor
    /// (`TensorKind::Tensor`). Gradients are the visitor's to read: one call into
    /// libtorch gives a tensor's facts and its gradient's.
    pub(crate) fn for_each(&self, mut visit: impl FnMut(&str, &Tensor, TensorKind) -> Result<()>) -> Result<()> {
        self.for_each_variable(&mut visit)?;
        self.for_each_state(|name, tensor| visit(name, tensor, TensorKind::OptimizerState))?;
        for (name, tensor) in self.tensors() {
            visit(&name, &tensor, TensorKind::Tensor)?;
        }
        Ok(())
    }

    /// Calls `visit` with the name and tensor of every optimizer state tensor.
    pub(crate) fn for_each_state(&self, mut visit: impl FnMut(&str, &Tensor) -> Result<()>) -> Result<()> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        for (name, tensor) in self.optimizers.iter().flat_map(|o| &o.tensors).chain(&self.states) {
            visit(name, tensor)?;
        }
        let registered = if self.registry { registry::states() } else { Vec::new() };
        if !registered.is_empty() {
            // An optimizer both registered and given is visited once.
            let given: HashSet<&str> =
                self.optimizers.iter().flat_map(|o| &o.tensors).map(|(n, _)| n.as_str()).collect();
            for (name, tensor) in registered {
                if !given.contains(name.as_str()) {
                    visit(&name, &tensor)?;
                }
            }
        }
        Ok(())
    }

    /// Like [`for_each`](Self::for_each), the variables only.
    pub(crate) fn for_each_variable(
        &self,
        mut visit: impl FnMut(&str, &Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        for (prefix, variables) in self.stores() {
            let variables = if !self.in_handler {
                variables.locked()
            } else {
                match variables.try_lock() {
                    Ok(v) => v,
                    Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => {
                        let name = if prefix.is_empty() { "a var store" } else { prefix.as_str() };
                        self.note_busy(format!("{name} (its lock was held: tch holds it while it moves or loads it)"));
                        continue;
                    }
                }
            };
            let trainable = Trainable::of(&variables);
            let mut names: Vec<&String> = variables.named_variables.keys().collect();
            names.sort();
            for name in names {
                let full = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
                let tensor = &variables.named_variables[name];
                visit(&full, tensor, trainable.kind(tensor))?;
            }
        }
        Ok(())
    }

    /// The data addresses of the model's state, per device: every variable
    /// and its gradient (not the named tensors). Dispose scopes treat a new
    /// allocation found here as replaced model state (a training step's fresh
    /// gradients), not as an escape.
    pub(crate) fn model_addresses(&self) -> Result<HashSet<(Device, u64)>> {
        let mut out = HashSet::new();
        self.for_each_variable(|_, tensor, _| {
            let (main, grad) = memlab_tch::storage::storages(tensor)?;
            out.extend(std::iter::once(main).chain(grad).filter_map(|i| i.device.map(|d| (d, i.data_ptr))));
            Ok(())
        })?;
        self.for_each_state(|_, tensor| {
            let (main, _) = memlab_tch::storage::storages(tensor)?;
            out.extend(main.device.map(|d| (d, main.data_ptr)));
            Ok(())
        })?;
        Ok(out)
    }

    /// Where each named storage starts and what it is (variables, their
    /// gradients, optimizer state, named tensors): the light walk, without
    /// names or shapes.
    pub(crate) fn kinds(&self) -> Result<Vec<(Device, u64, TensorKind)>> {
        let mut out = Vec::new();
        self.for_each(|_, tensor, kind| {
            let (main, grad) = memlab_tch::storage::storages(tensor)?;
            out.extend(main.device.map(|d| (d, main.data_ptr, kind)));
            if kind == TensorKind::Parameter {
                out.extend(grad.and_then(|g| g.device.map(|d| (d, g.data_ptr, TensorKind::Gradient))));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Every named storage and gradient, grouped by device and storage.
    /// Inside an out-of-memory handler the gradients are those the walks
    /// before it saw (see [`GRADIENTS`]); outside, while the recorder is
    /// armed, this walk's gradients are kept for such a handler.
    pub(crate) fn collect(&self) -> Result<Named> {
        let mut named = Named::default();
        let remember = !self.in_handler && gradients::kept();
        let mut seen: Vec<(u64, WeakTensor)> = Vec::new();
        let remembered = if self.in_handler { gradients::now() } else { None };
        if self.in_handler && remembered.is_none() {
            self.note_busy("the gradients (memlab's record of them was being updated by another thread)");
        }
        self.for_each(|name, tensor, kind| {
            let with_grad = kind == TensorKind::Parameter && !self.in_handler;
            let (main, grad) = facts(tensor, with_grad)?;
            named.add(name, Source::Tensor(tensor), main, kind)?;
            let grad_name = || format!("{name}.grad");
            if let Some(grad) = grad {
                named.add(&grad_name(), Source::GradOf(tensor), grad, TensorKind::Gradient)?;
                if remember && let Some(weak) = memlab_tch::grad_of(tensor).and_then(|g| WeakTensor::new(&g).ok()) {
                    seen.push((tensor_impl(tensor)?, weak));
                }
            } else if kind == TensorKind::Parameter {
                let kept =
                    remembered.as_deref().and_then(Option::as_ref).and_then(|r| r.get(&tensor_impl(tensor).ok()?));
                if let Some(grad) = kept.and_then(WeakTensor::upgrade) {
                    let (facts, _) = facts(&grad, false)?;
                    named.add(&grad_name(), Source::Tensor(&grad), facts, TensorKind::Gradient)?;
                }
            }
            Ok(())
        })?;
        if remember {
            gradients::remember(seen);
        }
        Ok(named)
    }
}

/// A [`Model`] held weakly, for the walks inside an allocator: the
/// out-of-memory recorder's, armed for the whole process, and a batch
/// search's at its tries' failures. It keeps none of the model's memory
/// alive, and what the program drops is no longer named. Its optimizers'
/// state is what they held when it was made. It is walked as
/// [`now`](Self::now) gives it.
#[derive(Debug)]
pub(crate) struct WeakModel {
    stores: Vec<(String, std::sync::Weak<Mutex<Variables>>)>,
    tensors: Vec<(String, WeakTensor)>,
    states: Vec<(String, WeakTensor)>,
    registry: bool,
}

impl WeakModel {
    /// Everything registered, at each walk.
    pub(crate) fn registered() -> WeakModel {
        WeakModel { stores: Vec::new(), tensors: Vec::new(), states: Vec::new(), registry: true }
    }

    /// What is alive of the model now, and everything registered when it
    /// takes the registry, taken without waiting for any lock: for code
    /// that runs inside an allocator (an out-of-memory handler), where the
    /// failing thread may hold a var store's lock itself (tch holds it while
    /// `set_device`, `load` and `copy` allocate). A registry or var store
    /// that is held is passed by and listed in [`busy`](Model::busy).
    pub(crate) fn now(&self) -> Model {
        let alive = |list: &[(String, WeakTensor)]| -> Vec<(String, Tensor)> {
            list.iter().filter_map(|(name, w)| w.upgrade().map(|t| (name.clone(), t))).collect()
        };
        let mut model = Model {
            stores: self.stores.iter().filter_map(|(prefix, v)| v.upgrade().map(|v| (prefix.clone(), v))).collect(),
            tensors: alive(&self.tensors),
            states: alive(&self.states),
            in_handler: true,
            ..Model::default()
        };
        if !self.registry {
            return model;
        }
        match registry::try_all() {
            Some(registered) => {
                let stores = registered.var_stores.into_iter();
                model.stores.extend(stores.filter_map(|vs| vs.variables.upgrade().map(|v| (vs.name, v))));
                model.tensors.extend(registered.tensors);
                // An optimizer both registered and given is visited once.
                let given: HashSet<String> = model.states.iter().map(|(name, _)| name.clone()).collect();
                model.states.extend(registered.states.into_iter().filter(|(name, _)| !given.contains(name)));
            }
            None => model.note_busy("memlab's registry (held by another thread)"),
        }
        model
    }
}

/// Which variables of a var store tch trains.
#[derive(Default)]
pub(crate) enum Trainable {
    /// All of them (tch lists as many trainable variables as the store
    /// has): the common case, told without looking at any.
    #[default]
    All,
    /// Those whose tensors (`TensorImpl`s) are these: tch's list, whose
    /// entries are shallow clones of the variables.
    These(FastSet<u64>),
}

impl Trainable {
    /// What `variables` holds.
    pub(crate) fn of(variables: &Variables) -> Trainable {
        if variables.trainable_variables.len() >= variables.named_variables.len() {
            return Trainable::All;
        }
        Trainable::These(variables.trainable_variables.iter().filter_map(|v| tensor_impl(&v.tensor).ok()).collect())
    }

    /// What `tensor`, a variable of the store, is: a parameter if tch trains
    /// it, else a buffer (a variable that cannot be told counts as a
    /// parameter).
    pub(crate) fn kind(&self, tensor: &Tensor) -> TensorKind {
        match self {
            Trainable::These(ids) if tensor_impl(tensor).is_ok_and(|id| !ids.contains(&id)) => TensorKind::Buffer,
            _ => TensorKind::Parameter,
        }
    }
}

/// Where a named tensor comes from: the tensor, or the gradient of one (made
/// into a tensor handle only when needed, for sparse gradients; never inside
/// an out-of-memory handler, whose walk names gradients it already holds).
#[derive(Clone, Copy)]
enum Source<'a> {
    Tensor(&'a Tensor),
    GradOf(&'a Tensor),
}

impl Source<'_> {
    fn get(self) -> Tensor {
        match self {
            Source::Tensor(t) => t.shallow_clone(),
            Source::GradOf(t) => memlab_tch::grad_of(t).unwrap_or_default(),
        }
    }
}

/// One named tensor with a storage.
#[derive(Clone, Debug)]
pub(crate) struct View {
    pub(crate) kind: TensorKind,
    pub(crate) name: String,
    pub(crate) shape: Vec<i64>,
    pub(crate) dtype: memlab_core::DType,
    pub(crate) numel: u64,
    /// The tensor's own size: elements × element size.
    pub(crate) own_bytes: u64,
}

/// The named tensors viewing one storage, in the order they were found.
#[derive(Clone, Debug)]
pub(crate) struct Storage {
    pub(crate) data_ptr: u64,
    pub(crate) nbytes: u64,
    pub(crate) element_size: u64,
    /// Whether the allocator whose figures memlab reads allocated it.
    pub(crate) from_allocator: bool,
    pub(crate) views: Vec<View>,
}

impl Storage {
    /// Whether one tensor is the whole storage (the usual case): it needs no
    /// row of its own.
    pub(crate) fn is_single(&self) -> bool {
        self.views.len() == 1 && self.views[0].own_bytes == self.nbytes
    }
}

/// The named storages found, per device, each storage once.
#[derive(Default)]
pub(crate) struct Named {
    storages: BTreeMap<Device, Vec<Storage>>,
    /// Per storage: its index in its device's list.
    index: HashMap<(Device, u64), usize>,
    addresses: HashSet<(Device, u64)>,
}

impl Named {
    /// Adds `tensor`, whose facts are `facts`. The tensor itself is only
    /// touched for sparse layouts, whose parts are added one by one.
    fn add(&mut self, name: &str, source: Source<'_>, facts: Facts, kind: TensorKind) -> Result<()> {
        let Facts { info, dtype, shape } = facts;
        let Some(device) = info.device else { return Ok(()) };
        let part = |this: &mut Self, suffix: &str, t: std::result::Result<Tensor, tch::TchError>| -> Result<()> {
            let t = t.map_err(memlab_tch::torch_error)?;
            let f = memlab_tch::storage::facts(&t, false)?.0;
            this.add(&format!("{name}.{suffix}"), Source::Tensor(&t), f, kind)
        };
        let tensor = || source.get();
        match info.layout {
            StorageLayout::SparseCoo => {
                let tensor = tensor();
                part(self, "indices", tensor.f_internal_indices())?;
                return part(self, "values", tensor.f_internal_values());
            }
            StorageLayout::SparseCompressed => {
                // CSR and BSR keep compressed rows; CSC and BSC compressed columns.
                let tensor = tensor();
                if tensor.f_crow_indices().is_ok() {
                    part(self, "crow_indices", tensor.f_crow_indices())?;
                    part(self, "col_indices", tensor.f_col_indices())?;
                } else {
                    part(self, "ccol_indices", tensor.f_ccol_indices())?;
                    part(self, "row_indices", tensor.f_row_indices())?;
                }
                return part(self, "values", tensor.f_values());
            }
            StorageLayout::Strided | StorageLayout::Other => {}
        }
        let Some(storage) = info.storage_id else {
            return Err(Error::InvalidArgument(format!(
                "`{name}` has no storage of its own, and a layout memlab cannot size"
            )));
        };
        let list = self.storages.entry(device).or_default();
        let at = *self.index.entry((device, storage)).or_insert_with(|| {
            list.push(Storage {
                data_ptr: info.data_ptr,
                nbytes: info.nbytes,
                element_size: info.element_size.max(1),
                from_allocator: info.from_allocator,
                views: Vec::new(),
            });
            list.len() - 1
        });
        self.addresses.insert((device, info.data_ptr));
        let own_bytes = info.numel * info.element_size;
        list[at].views.push(View { kind, name: name.to_string(), shape, dtype, numel: info.numel, own_bytes });
        Ok(())
    }

    /// The named storages of `device`, in the order they were found.
    pub(crate) fn storages(&self, device: Device) -> &[Storage] {
        self.storages.get(&device).map_or(&[], Vec::as_slice)
    }

    /// Takes the named storages of `device` out, for a renderer to move their
    /// names and shapes into its rows.
    pub(crate) fn take_storages(&mut self, device: Device) -> Vec<Storage> {
        self.storages.remove(&device).unwrap_or_default()
    }

    /// Whether a named storage's data starts at `address` on `device`.
    pub(crate) fn owns(&self, device: Device, address: u64) -> bool {
        self.addresses.contains(&(device, address))
    }

    /// Bytes of the named storages on `device`: (allocated by the allocator, not).
    pub(crate) fn bytes(&self, device: Device) -> (u64, u64) {
        self.storages(device).iter().fold((0, 0), |(inside, outside), s| {
            if s.from_allocator {
                (inside + s.nbytes, outside)
            } else {
                (inside, outside + s.nbytes)
            }
        })
    }
}
