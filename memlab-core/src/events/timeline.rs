//! What happened around the allocations while a recording ran: spans of
//! time (profiled function calls, logged steps, monitor iterations) and
//! readings of the process's resident set and the driver's device use.
//! Exports draw them beside the allocator's figures.
//!
//! Kept apart from the event history (its own lock, its own bound) so the
//! allocator hooks never wait for them; nothing is kept while no recording runs.

use crate::sync::LockExt;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use super::clock::{is_active, now_ns};
use super::thread_number;

/// What a span of time was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// A call of a profiled function.
    Call,
    /// A step run under a `StepLogger`.
    Step,
    /// A training-loop iteration, from one monitor record to the next.
    Iteration,
}

/// A span of time on one thread.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Span {
    /// What it was.
    pub kind: SpanKind,
    /// The function's path, the step's label, or `iteration N`.
    pub name: Cow<'static, str>,
    /// memlab's number for the thread (as in [`Event::thread`](super::Event)).
    pub thread: u64,
    /// Nanoseconds since the recorder started, as events count them.
    pub start_ns: u64,
    /// Likewise, its end.
    pub end_ns: u64,
}

/// The process's memory as the operating system and the driver saw it at one moment.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Reading {
    /// Nanoseconds since the recorder started.
    pub time_ns: u64,
    /// The resident set, in bytes.
    pub rss: u64,
    /// Per CUDA device read: the driver's figure of used memory.
    pub driver_used: Vec<DriverUsed>,
}

/// The driver's figure of one CUDA device's used memory at a reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DriverUsed {
    /// The CUDA device's index.
    pub device: usize,
    /// Its used memory, all processes together, in bytes.
    pub bytes: u64,
}

/// The most spans and readings kept; older ones are dropped and counted.
pub const TIMELINE_CAPACITY: usize = 100_000;

#[derive(Default)]
struct Queues {
    spans: VecDeque<Span>,
    readings: VecDeque<Reading>,
    dropped: u64,
}

crate::process::process_wide! {
    static TIMELINE: Mutex<Queues> =
        Mutex::new(Queues { spans: VecDeque::new(), readings: VecDeque::new(), dropped: 0 });
}

fn queues() -> MutexGuard<'static, Queues> {
    // Every change is one push or pop: a panic elsewhere leaves nothing half done.
    TIMELINE.locked()
}

fn push<T>(queue: &mut VecDeque<T>, dropped: &mut u64, item: T) {
    if queue.len() >= TIMELINE_CAPACITY {
        queue.pop_front();
        *dropped += 1;
    }
    queue.push_back(item);
}

/// The recorder's clock now, in nanoseconds, for a span's start.
pub fn span_start() -> u64 {
    now_ns()
}

/// Records a span of `kind` on the calling thread from `start_ns` (from
/// [`span_start`]) to now. Does nothing while no recording runs.
pub fn span(kind: SpanKind, name: impl Into<Cow<'static, str>>, start_ns: u64) {
    if !is_active() {
        return;
    }
    let span = Span { kind, name: name.into(), thread: thread_number(), start_ns, end_ns: now_ns() };
    let mut t = queues();
    let t = &mut *t;
    push(&mut t.spans, &mut t.dropped, span);
}

/// Records a reading of the resident set and the driver's use of some
/// devices, taken now. Does nothing while no recording runs.
pub fn reading(rss: u64, driver_used: Vec<DriverUsed>) {
    if !is_active() {
        return;
    }
    let reading = Reading { time_ns: now_ns(), rss, driver_used };
    let mut t = queues();
    let t = &mut *t;
    push(&mut t.readings, &mut t.dropped, reading);
}

/// What a recording kept beside the allocations, oldest first: spans
/// (profiled calls, `StepLogger` steps, `TrainingMonitor` iterations),
/// readings of the resident set and the driver's device use, and how many of
/// either were dropped to stay within [`TIMELINE_CAPACITY`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Timeline {
    /// The spans, oldest first.
    pub spans: Vec<Span>,
    /// The readings, oldest first.
    pub readings: Vec<Reading>,
    /// Spans and readings dropped, the oldest first, to stay within
    /// [`TIMELINE_CAPACITY`].
    pub dropped: u64,
}

/// The timeline of the current (or last) recording.
pub fn timeline() -> Timeline {
    let t = queues();
    Timeline {
        spans: t.spans.iter().cloned().collect(),
        readings: t.readings.iter().cloned().collect(),
        dropped: t.dropped,
    }
}

/// Forgets what an earlier recording kept: a new one starts.
pub(super) fn clear() {
    let mut t = queues();
    t.spans.clear();
    t.readings.clear();
    t.dropped = 0;
}
