//! The process-wide recorder: a bounded history of events, the live set, and
//! the accounts of open dispose scopes.
//!
//! Backends call [`record`] from their allocator hooks. On CUDA that happens
//! under the caching allocator's lock, so nothing here may call into libtorch,
//! and nothing that holds the recorder's lock may either.

use crate::hash::FastMap;
use crate::sync::LockExt;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::clock::{is_active, now_ns, set_active, start};
use super::context::{self, StatementRef};
use super::{Action, Backtrace, Event};
use crate::device::Device;

/// How the recorder works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settings {
    /// The most events kept in the history; older ones are dropped and counted.
    /// 0 keeps no history (the live set and dispose scopes still work).
    pub capacity: usize,
    /// Capture the call stack of every allocation (a few hundred nanoseconds
    /// each on Linux x86-64; see BENCHMARKS.md), shown as the user's frames.
    pub backtraces: bool,
    /// Read the process's resident set and the driver's device use this
    /// often while the recording runs (see [`reading`](super::reading));
    /// `None` reads them only while a `StepLogger` samples its steps.
    pub sample_every: Option<std::time::Duration>,
    /// Watch the ops whose CUDA kernels allocate otherwise than their CPU
    /// kernels (sums, means, convolutions; see [`crate::ops`]): a snapshot
    /// then carries them, and a CUDA run predicted from a CPU recording
    /// models their staging buffers and workspaces. Each op then costs a
    /// callback (about a microsecond) while the recording runs.
    pub ops: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { capacity: 100_000, backtraces: false, sample_every: None, ops: false }
    }
}

impl Settings {
    /// Settings with this history capacity.
    pub fn capacity(mut self, events: usize) -> Self {
        self.capacity = events;
        self
    }

    /// Settings with backtraces on or off.
    pub fn backtraces(mut self, on: bool) -> Self {
        self.backtraces = on;
        self
    }

    /// Settings that read the resident set and the driver's device use every
    /// `every` while the recording runs (traces draw them as counters).
    pub fn sampling(mut self, every: std::time::Duration) -> Self {
        self.sample_every = Some(every);
        self
    }

    /// Settings that watch the ops whose CUDA kernels allocate otherwise
    /// ([`Settings::ops`]).
    pub fn ops(mut self, on: bool) -> Self {
        self.ops = on;
        self
    }
}

/// An allocation that is alive now.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LiveAllocation {
    /// Where it is.
    pub device: Device,
    /// Its address (a tensor storage's data pointer).
    pub address: u64,
    /// Its size in bytes (CUDA: the rounded block).
    pub size: u64,
    /// The event that allocated it.
    pub seq: u64,
    /// When, in nanoseconds since the recorder started.
    pub time_ns: u64,
    /// The thread that allocated it.
    pub thread: u64,
    /// The dispose scope that answers for it now, if any.
    pub scope: Option<u64>,
    /// The profiled statement that allocated it, if any.
    pub statement: Option<StatementRef>,
    /// Where it was allocated, when backtraces were on.
    pub backtrace: Option<Arc<Backtrace>>,
}

/// As data: the statement and the site as text, the backtrace as the user's
/// frames (resolved now, once per allocation).
impl serde::Serialize for LiveAllocation {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("LiveAllocation", 10)?;
        s.serialize_field("device", &self.device)?;
        s.serialize_field("address", &self.address)?;
        s.serialize_field("size", &self.size)?;
        s.serialize_field("seq", &self.seq)?;
        s.serialize_field("time_ns", &self.time_ns)?;
        s.serialize_field("thread", &self.thread)?;
        s.serialize_field("scope", &self.scope)?;
        s.serialize_field("statement", &self.statement.map(|st| st.to_string()))?;
        s.serialize_field("site", &self.site())?;
        s.serialize_field("backtrace", &self.backtrace.as_ref().map(|b| b.user_frames()))?;
        s.end()
    }
}

impl LiveAllocation {
    /// Where it was allocated, as precisely as memlab knows: the user frames of
    /// its backtrace, else the profiled statement, else `None`.
    pub fn site(&self) -> Option<String> {
        if let Some(first) = self.backtrace.as_ref().and_then(|bt| bt.first_frame()) {
            return Some(first.to_string());
        }
        self.statement.map(|s| s.to_string())
    }
}

/// Byte and block counts of one dispose scope on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ScopeCounts {
    /// Bytes allocated while the scope was innermost (plus escapes handed over
    /// by scopes nested in it).
    pub created_bytes: u64,
    /// Blocks allocated, likewise.
    pub created: u64,
    /// Of those, bytes freed before the scope closed.
    pub freed_bytes: u64,
    /// Blocks freed, likewise.
    pub freed: u64,
    /// Bytes still alive when the scope closed, and not kept.
    pub escaped_bytes: u64,
    /// Blocks still alive, likewise.
    pub escaped: u64,
    /// Bytes exempted with `keep`.
    pub kept_bytes: u64,
    /// Blocks exempted with `keep`.
    pub kept: u64,
    /// Bytes still alive when the scope closed that belong to the model's
    /// state (new gradients of its var stores): replaced, not escaped.
    pub model_state_bytes: u64,
    /// Blocks of model state, likewise.
    pub model_state: u64,
}

/// What a closed dispose scope found.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ScopeOutcome {
    /// Counts per device.
    pub devices: BTreeMap<Device, ScopeCounts>,
    /// The allocations that escaped, oldest first.
    pub escaped: Vec<LiveAllocation>,
    /// The allocations still alive that are the model's state (see
    /// [`scope_close`]), oldest first; no scope answers for them any more.
    pub model_state: Vec<LiveAllocation>,
    /// The scope the escapes were handed to: the nearest enclosing scope
    /// still open, if any.
    pub handed_to: Option<u64>,
}

/// How much the recorder holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Events observed since recording began.
    pub recorded: u64,
    /// Events dropped from the history to stay within its capacity.
    pub dropped: u64,
    /// Events in the history now.
    pub kept: usize,
    /// Allocations in the live set.
    pub live: usize,
    /// Allocations left out of the live set because memory ran out while it
    /// grew: dispose scopes and the unnamed holders by site miss them.
    pub untracked: u64,
}

#[derive(Default)]
struct Account {
    devices: BTreeMap<Device, ScopeCounts>,
    parent: Option<u64>,
}

struct Recorder {
    /// What the recorder does now: the union of what its users asked for.
    settings: Settings,
    /// Users, each with the settings it asked for (`None`: joined as it is).
    users: Vec<(u64, Option<Settings>)>,
    history: VecDeque<Event>,
    /// Events seen since the recorder first ran: the next event's `seq`
    /// (unique for the process's life).
    recorded: u64,
    /// `recorded` when the current recording began.
    recorded_before: u64,
    dropped: u64,
    /// Allocations left out of the live set for want of memory to grow it.
    untracked: u64,
    /// By device and address: what the live set keeps of each allocation.
    live: FastMap<(Device, u64), Held>,
    scopes: FastMap<u64, Account>,
}

/// What the live set keeps of an allocation: a [`LiveAllocation`] without
/// the device and address its key holds. Every allocation event writes one,
/// so it is kept small.
#[derive(Clone)]
struct Held {
    size: u64,
    seq: u64,
    time_ns: u64,
    thread: u64,
    scope: Option<u64>,
    statement: Option<StatementRef>,
    backtrace: Option<Arc<Backtrace>>,
}

impl Held {
    fn at(&self, (device, address): (Device, u64)) -> LiveAllocation {
        LiveAllocation {
            device,
            address,
            size: self.size,
            seq: self.seq,
            time_ns: self.time_ns,
            thread: self.thread,
            scope: self.scope,
            statement: self.statement,
            backtrace: self.backtrace.clone(),
        }
    }
}

crate::process::process_wide! {
    /// The recorder's `recorded`, readable without its lock (see [`recorded`]).
    static RECORDED: AtomicU64 = AtomicU64::new(0);
}
crate::process::process_wide! {
    static BACKTRACES: AtomicBool = AtomicBool::new(false);
}
crate::process::process_wide! {
    static NEXT_SCOPE: AtomicU64 = AtomicU64::new(1);
}
crate::process::process_wide! {
    static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);
}

fn recorder() -> MutexGuard<'static, Option<Recorder>> {
    // Every update leaves the recorder consistent before it can panic.
    RECORDER.locked()
}

fn with<R>(f: impl FnOnce(&mut Recorder) -> R) -> R {
    let mut guard = recorder();
    let r = guard.get_or_insert_with(|| Recorder {
        settings: Settings::default(),
        users: Vec::new(),
        history: VecDeque::new(),
        recorded: 0,
        recorded_before: 0,
        dropped: 0,
        untracked: 0,
        live: HashMap::default(),
        scopes: HashMap::default(),
    });
    f(r)
}

/// A user of the recorder, from [`retain`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a user is released with `release`"]
pub struct User {
    ticket: u64,
    /// Whether this user turned recording on: the caller then turns its
    /// backend's hooks on.
    pub first: bool,
}

/// Starts recording, or adds a user of an already running recorder. A user
/// that asks for `settings` gets at least them for as long as it is there:
/// the recorder runs with the largest capacity and with backtraces if any
/// user asked for them. `None` joins with whatever is in force (memlab's own
/// tools do that).
pub fn retain(settings: Option<Settings>) -> User {
    crate::process::process_wide! {
        static NEXT: AtomicU64 = AtomicU64::new(1);
    }
    start();
    let ticket = NEXT.fetch_add(1, Ordering::Relaxed);
    let user = with(|r| {
        r.users.push((ticket, settings));
        let first = r.users.len() == 1;
        if first {
            // A new recording: what an earlier one kept is not part of it
            // (the frees between the two were never seen).
            r.history.clear();
            r.dropped = 0;
            r.untracked = 0;
            r.recorded_before = r.recorded;
            set_active(true);
        }
        r.apply_settings();
        User { ticket, first }
    });
    if user.first {
        // Outside the recorder's lock: nothing takes the two locks nested.
        super::timeline::clear();
    }
    user
}

/// Removes a user; the last one turns recording off and returns true (the
/// caller then turns its backend's hooks off). The live set is cleared then:
/// frees that are not observed would leave it wrong. The history stays,
/// readable, until the next recording starts.
pub fn release(user: User) -> bool {
    with(|r| {
        let Some(at) = r.users.iter().position(|(t, _)| *t == user.ticket) else { return false };
        r.users.remove(at);
        let last = r.users.is_empty();
        if last {
            set_active(false);
            r.live.clear();
        }
        r.apply_settings();
        last
    })
}

impl Recorder {
    /// Puts the union of the users' settings in force; a smaller capacity
    /// drops the oldest events now.
    fn apply_settings(&mut self) {
        // The union of what users asked for; only joiners, or nobody: the defaults.
        let settings = self
            .users
            .iter()
            .filter_map(|(_, asked)| *asked)
            .reduce(|a, b| Settings {
                capacity: a.capacity.max(b.capacity),
                backtraces: a.backtraces || b.backtraces,
                sample_every: match (a.sample_every, b.sample_every) {
                    (Some(x), Some(y)) => Some(x.min(y)),
                    (x, y) => x.or(y),
                },
                ops: a.ops || b.ops,
            })
            .unwrap_or_default();
        #[cfg(all(feature = "unwinder", target_os = "linux", target_arch = "x86_64"))]
        if settings.backtraces {
            super::unwind::prepare();
        }
        BACKTRACES.store(settings.backtraces, Ordering::Relaxed);
        self.settings = settings;
        while self.history.len() > settings.capacity {
            self.history.pop_front();
            self.dropped += 1;
        }
    }
}

/// The settings in force: the union of what the recorder's users asked for.
pub fn current_settings() -> Settings {
    with(|r| r.settings)
}

/// Records one event. Called by backends from their allocator hooks; returns
/// at once when recording is off.
pub fn record(device: Device, action: Action, address: u64, size: u64, stream: u64) {
    record_counted(device, action, address, size, stream, &|| {});
}

/// Like [`record`], for an allocator whose hook counts the event too:
/// `count` updates its figures, under the recorder's lock when recording is
/// on (so that figures read under the lock, see [`history_with`], agree with
/// the history), at once when it is off.
///
/// Not generic, so that it is compiled (and its helpers inlined) here, not
/// in each backend that calls it.
pub fn record_counted(device: Device, action: Action, address: u64, size: u64, stream: u64, count: &dyn Fn()) {
    if !is_active() {
        count();
        return;
    }
    let started = super::own_work::on().then(std::time::Instant::now);
    record_active(device, action, address, size, stream, count);
    if let Some(started) = started {
        super::own_work::add(0, &[1, started.elapsed().as_nanos() as u64]);
    }
}

/// [`record_counted`] while recording is on.
#[inline(always)]
fn record_active(device: Device, action: Action, address: u64, size: u64, stream: u64, count: &dyn Fn()) {
    // Nothing from here to `count()` under the lock can panic (every
    // thread-local is read with `try_with`): the event is counted once.
    let time_ns = now_ns();
    let context::Whereabouts { thread, scope, statement } = context::whereabouts();
    // Allocations, and failed requests: the frames of the failing call.
    let backtrace = (matches!(action, Action::Alloc | Action::Oom) && BACKTRACES.load(Ordering::Relaxed))
        .then(Backtrace::capture_shared);
    with(|r| {
        count();
        let seq = r.recorded;
        r.recorded += 1;
        RECORDED.store(r.recorded, Ordering::Release);
        match action {
            Action::Alloc => {
                if let Some(id) = scope {
                    let counts = r.scopes.entry(id).or_default().devices.entry(device).or_default();
                    counts.created += 1;
                    counts.created_bytes += size;
                }
                let live = Held { size, seq, time_ns, thread, scope, statement, backtrace: backtrace.clone() };
                // Growing the live set can fail when memory runs out: the
                // allocation then goes untracked (and is counted), rather
                // than the process aborting inside the allocator.
                if r.live.len() < r.live.capacity() || r.live.try_reserve(1).is_ok() {
                    r.live.insert((device, address), live);
                } else {
                    r.untracked += 1;
                }
            }
            Action::FreeRequested => {
                if let Some(gone) = r.live.remove(&(device, address)) {
                    if let Some(account) = gone.scope.and_then(|id| r.scopes.get_mut(&id)) {
                        let counts = account.devices.entry(device).or_default();
                        counts.freed += 1;
                        counts.freed_bytes += gone.size;
                    }
                }
            }
            _ => {}
        }
        if r.settings.capacity > 0 {
            // Full, or no memory to grow it (memory has run out): the oldest
            // event makes room.
            let full = r.history.len() >= r.settings.capacity
                || (r.history.len() == r.history.capacity() && r.history.try_reserve(1).is_err());
            if full && r.history.pop_front().is_some() {
                r.dropped += 1;
            }
            if r.history.len() == r.history.capacity() {
                r.dropped += 1;
                return;
            }
            r.history.push_back(Event {
                seq,
                time_ns,
                device,
                action,
                address,
                size,
                stream,
                thread,
                scope,
                statement,
                backtrace,
            });
        } else {
            r.dropped += 1;
        }
    });
}

/// The events in the history (oldest first) and the recorder's counts.
pub fn history() -> (Vec<Event>, Stats) {
    with(|r| (r.history.iter().cloned().collect(), stats_of(r)))
}

/// How many events the recorder has seen since the process started: the
/// `seq` the next one gets. Read without the recorder's lock, for readers
/// of allocator figures that must know which events a reading includes: an
/// allocator that records its events under its own lock (CUDA's) shows in a
/// reading taken between two equal values of this exactly the events
/// numbered below it.
pub fn recorded() -> u64 {
    RECORDED.load(Ordering::Acquire)
}

/// The history and the recorder's counts, together with `read()`'s figures
/// taken under the recorder's lock: an allocator whose hook counts its
/// events as it records them ([`record_counted`], the CPU's) then shows
/// exactly the events of the history. `read` must not take a lock that an
/// allocator holds while it records (CUDA's).
pub fn history_with<R>(read: impl FnOnce() -> R) -> (Vec<Event>, Stats, R) {
    with(|r| {
        let figures = read();
        (r.history.iter().cloned().collect(), stats_of(r), figures)
    })
}

fn stats_of(r: &Recorder) -> Stats {
    Stats {
        recorded: r.recorded - r.recorded_before,
        dropped: r.dropped,
        kept: r.history.len(),
        live: r.live.len(),
        untracked: r.untracked,
    }
}

/// Everything allocated now, oldest first (empty while recording is off).
pub fn live() -> Vec<LiveAllocation> {
    let mut all: Vec<LiveAllocation> = with(|r| r.live.iter().map(|(key, held)| held.at(*key)).collect());
    all.sort_by_key(|l| l.seq);
    all
}

/// [`live`], together with `read()`'s figures taken under the recorder's
/// lock (see [`history_with`]): the CPU's counters then count exactly the
/// live set's allocations and those the recording never saw.
pub fn live_with<R>(read: impl FnOnce() -> R) -> (Vec<LiveAllocation>, R) {
    let (mut all, figures) = with(|r| {
        let figures = read();
        (r.live.iter().map(|(key, held)| held.at(*key)).collect::<Vec<LiveAllocation>>(), figures)
    });
    all.sort_by_key(|l| l.seq);
    (all, figures)
}

/// The event numbers (`seq`) of the live allocations at `keys` (device,
/// address), read under one lock; `None` where recording did not see one made.
pub fn live_seqs(keys: &[(Device, u64)]) -> Vec<Option<u64>> {
    with(|r| keys.iter().map(|key| r.live.get(key).map(|a| a.seq)).collect())
}

/// The live allocation at `address` on `device`, if recording saw it made.
pub fn attribute(device: Device, address: u64) -> Option<LiveAllocation> {
    with(|r| r.live.get(&(device, address)).map(|held| held.at((device, address))))
}

/// Opens a dispose scope on this thread and returns its id. Recording must be
/// on (hold [`retain`] for the scope's life).
pub fn scope_open() -> u64 {
    let id = NEXT_SCOPE.fetch_add(1, Ordering::Relaxed);
    let parent = context::innermost_scope();
    with(|r| r.scopes.insert(id, Account { devices: BTreeMap::new(), parent }));
    context::push_scope(id);
    id
}

/// Exempts the allocation at `address` on `device` from scope `id`: it is
/// handed to the enclosing scope (`to_outer`), or to no scope at all. Returns
/// its size, or `None` when scope `id` does not answer for such an allocation.
pub fn scope_keep(id: u64, device: Device, address: u64, to_outer: bool) -> Option<u64> {
    with(|r| {
        let outer = r.scopes.get(&id)?.parent;
        let parent = if to_outer { outer } else { None };
        let live = r.live.get_mut(&(device, address)).filter(|l| l.scope == Some(id))?;
        live.scope = parent;
        let size = live.size;
        let counts = r.scopes.get_mut(&id)?.devices.entry(device).or_default();
        counts.kept += 1;
        counts.kept_bytes += size;
        if let Some(p) = parent.and_then(|p| r.scopes.get_mut(&p)) {
            let counts = p.devices.entry(device).or_default();
            counts.created += 1;
            counts.created_bytes += size;
        }
        Some(size)
    })
}

/// Closes scope `id`. What it allocated and is still alive either is the
/// model's state (its address is in `model`: a var store's new gradient, say),
/// which no scope answers for any more, or escaped, and is handed to the
/// nearest enclosing scope still open (which then answers for it). Scopes
/// nested in this one and still open are handed to that scope too, so scopes
/// closed out of order never hand anything to a closed one.
pub fn scope_close(id: u64, model: &HashSet<(Device, u64)>) -> ScopeOutcome {
    context::remove_scope(id);
    with(|r| {
        let Some(account) = r.scopes.remove(&id) else { return ScopeOutcome::default() };
        // Parents always name open scopes: every close re-parents its children.
        let parent = account.parent;
        for other in r.scopes.values_mut().filter(|a| a.parent == Some(id)) {
            other.parent = parent;
        }
        let mut devices = account.devices;
        let mut escaped: Vec<LiveAllocation> = Vec::new();
        let mut model_state: Vec<LiveAllocation> = Vec::new();
        for (&key, live) in r.live.iter_mut().filter(|(_, l)| l.scope == Some(id)) {
            let counts = devices.entry(key.0).or_default();
            if model.contains(&key) {
                counts.model_state += 1;
                counts.model_state_bytes += live.size;
                live.scope = None;
                model_state.push(live.at(key));
            } else {
                counts.escaped += 1;
                counts.escaped_bytes += live.size;
                live.scope = parent;
                escaped.push(live.at(key));
            }
        }
        escaped.sort_by_key(|l| l.seq);
        model_state.sort_by_key(|l| l.seq);
        if let Some(parent) = parent.and_then(|p| r.scopes.get_mut(&p)) {
            for l in &escaped {
                let counts = parent.devices.entry(l.device).or_default();
                counts.created += 1;
                counts.created_bytes += l.size;
            }
        }
        ScopeOutcome { devices, escaped, model_state, handed_to: parent }
    })
}

/// The recorder's counts.
pub fn stats() -> Stats {
    with(|r| stats_of(r))
}
