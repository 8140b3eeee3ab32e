//! A predicted history run on to its steady state: its last step again, as
//! the next steps of training run it.
//!
//! A prediction runs the step on the CPU until the CPU's peak holds (three
//! steps, commonly), but the CUDA allocator's reserved peak can go on
//! growing for a step or two more, as the holes each step leaves in the
//! segments move: on an H200 a GRU language model under expandable segments
//! mapped its last 20 MiB in its fourth step. Where a history ends in two
//! steps that make the same requests in the same order, the last one is the
//! steady step, and the prediction runs it again until the peak holds.

use std::collections::HashMap;

use super::kernels::Soft;
use crate::events::Action;
use crate::export::{Snapshot, TraceEntry};

/// The least share of a history's large requests (eighths) a step takes: a
/// shorter tail that repeats is a loop inside the step (the optimizer's
/// update of parameters of one shape), not the step.
const LEAST_EIGHTHS: usize = 1;

/// Requests above this go to the large pool (libtorch's `kSmallSize`).
const SMALL: u64 = 1 << 20;

/// Where repeated steps' addresses differ: the `r`-th repetition's blocks
/// are the last step's, plus `r` in these bits (no recorded or added
/// address has them: the CPU's are below 2^48, memlab's own from 2^61).
const REPEAT_SHIFT: u32 = 52;
const REPEAT_BITS: u64 = 0xf << REPEAT_SHIFT;

/// The most repetitions a history takes.
pub(super) const MOST: usize = 8;

/// The last two steps of a trace: where each begins, in entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LastSteps {
    /// Where the step before the last begins.
    before: usize,
    /// Where the last step begins; it runs to the trace's end.
    last: usize,
}

/// The last two steps of `trace`: the longest tail of its large requests
/// (allocations and frees above 1 MiB, by size, in order) that the large
/// requests just before it make again, where it takes at least an eighth
/// of them. Each step begins after the previous one's last large request.
/// The small requests between (scalars, a CPU kernel's scratch) need not
/// repeat: the CPU's threads order them as they come.
pub(super) fn last_steps(trace: &[TraceEntry]) -> Option<LastSteps> {
    let large: Vec<usize> = trace
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            e.size > SMALL && matches!(e.action, Action::Alloc | Action::FreeRequested | Action::FreeCompleted)
        })
        .map(|(i, _)| i)
        .collect();
    let m = large.len();
    let keys: Vec<(u8, u64)> = large.iter().rev().map(|&i| (trace[i].action as u8, trace[i].size)).collect();
    let z = z_function(&keys);
    // Something before the two steps (the weights at least), so that the
    // step before the last is a step and not what lived before it.
    let len = (2..=m.saturating_sub(1) / 2).rev().find(|&len| len * 8 >= m * LEAST_EIGHTHS && z[len] >= len)?;
    let after = |k: usize| if k == 0 { 0 } else { large[k - 1] + 1 };
    let steps = LastSteps { before: after(m - 2 * len), last: after(m - len) };
    (steps.before < steps.last && steps.last < trace.len()).then_some(steps)
}

/// The longest common prefix of `s` and each of its suffixes (`z[0]` is `s`'s length).
fn z_function<T: PartialEq>(s: &[T]) -> Vec<usize> {
    let n = s.len();
    let mut z = vec![0; n + 1];
    if n == 0 {
        return z;
    }
    z[0] = n;
    let (mut left, mut right) = (0, 0);
    for i in 1..n {
        if i < right {
            z[i] = (right - i).min(z[i - left]);
        }
        while i + z[i] < n && s[z[i]] == s[i + z[i]] {
            z[i] += 1;
        }
        if i + z[i] > right {
            (left, right) = (i, i + z[i]);
        }
    }
    z
}

/// Which block an entry of the last step is, run again.
#[derive(Clone, Copy)]
enum Block {
    /// The block the entry at this offset of the step allocated, in the
    /// same repetition.
    Own(usize),
    /// The block the entry at this offset allocated in the repetition
    /// before: one the step before made and this step frees (last step's
    /// gradients), matched by size and order to what this step keeps.
    Carried(usize),
    /// A block made before the step before: it is not made again, and its
    /// free is not repeated.
    Older,
}

/// Each entry of the last step's block, where every address is free of
/// the bits repetitions use.
fn blocks(trace: &[TraceEntry], steps: LastSteps) -> Option<Vec<Block>> {
    let (before, last) = (&trace[steps.before..steps.last], &trace[steps.last..]);
    let made_before: std::collections::HashSet<u64> =
        before.iter().filter(|e| e.action == Action::Alloc).filter_map(|e| e.addr).collect();
    // What the last step keeps for the next, by size, in order: its
    // allocations it does not free (an address freed and made again, as
    // the CPU's allocator reuses them, is a block of each).
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut freed = vec![false; last.len()];
    for (k, e) in last.iter().enumerate() {
        match (e.action, e.addr) {
            (Action::Alloc, Some(a)) => drop(live.insert(a, k)),
            (Action::FreeCompleted, Some(a)) => {
                if let Some(k) = live.remove(&a) {
                    freed[k] = true;
                }
            }
            _ => {}
        }
    }
    let mut kept: HashMap<u64, Vec<usize>> = HashMap::new();
    for (k, e) in last.iter().enumerate() {
        if e.action == Action::Alloc && !freed[k] {
            kept.entry(e.size).or_default().push(k);
        }
    }
    let mut own: HashMap<u64, usize> = HashMap::new();
    // The blocks of the step before that this one frees, matched to what it keeps.
    let mut carried: HashMap<u64, Option<usize>> = HashMap::new();
    let mut carried_of_size: HashMap<u64, usize> = HashMap::new();
    let mut out = Vec::with_capacity(last.len());
    let mut matched_of_size: HashMap<u64, usize> = HashMap::new();
    for (j, e) in last.iter().enumerate() {
        let address = e.addr?;
        if address & REPEAT_BITS != 0 {
            return None;
        }
        out.push(match e.action {
            Action::Alloc => {
                own.insert(address, j);
                Block::Own(j)
            }
            Action::FreeRequested | Action::FreeCompleted => match own.get(&address) {
                Some(&k) => Block::Own(k),
                None if made_before.contains(&address) => {
                    let matched = *carried.entry(address).or_insert_with(|| {
                        let rank = carried_of_size.entry(e.size).or_insert(0);
                        *rank += 1;
                        let found = kept.get(&e.size).and_then(|k| k.get(*rank - 1)).copied();
                        if found.is_some() {
                            *matched_of_size.entry(e.size).or_insert(0) += 1;
                        }
                        found
                    });
                    matched.map_or(Block::Older, Block::Carried)
                }
                None => Block::Older,
            },
            _ => return None,
        });
    }
    // A block the last step keeps that no step frees again would pile up
    // with each repetition: such steps are not steady.
    if kept.iter().any(|(size, k)| matched_of_size.get(size).copied().unwrap_or(0) < k.len()) {
        return None;
    }
    Some(out)
}

/// `history` with its last step ([`last_steps`]) run `times` more after
/// it, each a step later, and the cuDNN workspaces among them marked as
/// the last step's were.
pub(super) fn repeated(
    history: &Snapshot,
    soft: &HashMap<u64, Soft>,
    steps: LastSteps,
    times: usize,
) -> Option<(Snapshot, HashMap<u64, Soft>)> {
    let trace = history.device_traces.first()?;
    if times > MOST || steps.last >= trace.len() || steps.before >= steps.last {
        return None;
    }
    let blocks = blocks(trace, steps)?;
    let last = &trace[steps.last..];
    let period = last[last.len() - 1].time_us.saturating_sub(trace[steps.last - 1].time_us).max(1);
    let address = |k: usize, r: usize| last[k].addr.map(|a| a + ((r as u64) << REPEAT_SHIFT));
    let mut out = history.clone();
    let mut soft = soft.clone();
    let extended = &mut out.device_traces[0];
    extended.reserve(last.len() * times);
    for r in 1..=times {
        for (e, block) in last.iter().zip(&blocks) {
            let addr = match *block {
                Block::Own(k) => address(k, r),
                Block::Carried(k) => address(k, r - 1),
                Block::Older => continue,
            };
            if e.action == Action::Alloc {
                if let Some(s) = e.addr.and_then(|a| soft.get(&a)).copied() {
                    soft.insert(addr?, s);
                }
            }
            extended.push(TraceEntry { addr, time_us: e.time_us + period * r as u64, ..e.clone() });
        }
    }
    Some((out, soft))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn entry(action: Action, addr: u64, size: u64, time_us: u64) -> TraceEntry {
        TraceEntry::new(action, Some(addr), size, time_us)
    }

    /// A step that frees the gradient the step before kept, makes a
    /// temporary and frees it, keeps a gradient of its own, and makes a
    /// small scalar `scalars` times.
    fn step(trace: &mut Vec<TraceEntry>, at: u64, last_gradient: Option<u64>, scalars: usize) {
        let t = trace.len() as u64;
        if let Some(g) = last_gradient {
            trace.push(entry(Action::FreeRequested, g, 8 * MIB, t));
            trace.push(entry(Action::FreeCompleted, g, 8 * MIB, t));
        }
        trace.push(entry(Action::Alloc, at, 4 * MIB, t + 1));
        for k in 0..scalars as u64 {
            trace.push(entry(Action::Alloc, at + 0x100 + k, 4, t + 1));
            trace.push(entry(Action::FreeCompleted, at + 0x100 + k, 4, t + 1));
        }
        trace.push(entry(Action::Alloc, at + 0x1000, 8 * MIB, t + 2));
        trace.push(entry(Action::FreeRequested, at, 4 * MIB, t + 3));
        trace.push(entry(Action::FreeCompleted, at, 4 * MIB, t + 3));
    }

    fn history(trace: Vec<TraceEntry>) -> Snapshot {
        Snapshot { segments: Vec::new(), device_traces: vec![trace], allocator_settings: None, memlab: None }
    }

    /// Three steps, the first without a gradient to free, the small
    /// requests differing from step to step: the last two are the steps,
    /// and the last runs twice more, each freeing the gradient of the one
    /// before, at addresses of its own.
    #[test]
    fn the_last_step_runs_on_freeing_what_the_one_before_kept() {
        let mut trace = vec![entry(Action::Alloc, 0x100, MIB, 0)];
        step(&mut trace, 0x10000, None, 0);
        step(&mut trace, 0x20000, Some(0x11000), 2);
        step(&mut trace, 0x30000, Some(0x21000), 1);
        let steps = last_steps(&trace).unwrap();
        // The first step's four entries and the weight's; the second's ten.
        assert_eq!(steps, LastSteps { before: 5, last: 15 });
        let (out, _) = repeated(&history(trace.clone()), &HashMap::new(), steps, 2).unwrap();
        let out = &out.device_traces[0];
        let each = trace.len() - steps.last;
        assert_eq!(out.len(), trace.len() + 2 * each);
        let first = 1 << REPEAT_SHIFT;
        // The first repetition frees the last step's gradient, then keeps its own.
        assert_eq!(out[trace.len()].addr, Some(0x31000));
        assert_eq!(out[trace.len() + 5].addr, Some(0x31000 + first));
        // The second frees the first's.
        assert_eq!(out[trace.len() + each].addr, Some(0x31000 + first));
        assert!(out.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        // Every block allocated once, and freed at most once.
        let mut live = std::collections::HashSet::new();
        for e in out {
            match e.action {
                Action::Alloc => assert!(live.insert(e.addr.unwrap()), "{e:?}"),
                Action::FreeCompleted => assert!(live.remove(&e.addr.unwrap()), "{e:?}"),
                _ => {}
            }
        }
        // Two gradients live at the end: the weights' block and the last repetition's.
        assert_eq!(live.len(), 2, "{live:?}");
    }

    /// A step that keeps a block no later step frees (a list that grows)
    /// is not run on: each repetition would keep one more.
    #[test]
    fn a_step_that_keeps_more_than_it_frees_is_not_run_on() {
        let mut trace = vec![entry(Action::Alloc, 0x100, 2 * MIB, 0)];
        for (k, at) in [0x10000u64, 0x20000, 0x30000].into_iter().enumerate() {
            let last = (k > 0).then(|| at - 0x10000 + 0x1000);
            step(&mut trace, at, last, 0);
            trace.push(entry(Action::Alloc, at + 0x2000, 3 * MIB, 10 + k as u64));
        }
        let steps = last_steps(&trace).expect("the steps repeat");
        assert!(repeated(&history(trace), &HashMap::new(), steps, 1).is_none());
    }

    /// Steps whose large requests differ are not run on.
    #[test]
    fn steps_that_do_not_repeat_are_not_run_on() {
        let mut trace = vec![entry(Action::Alloc, 0x100, MIB, 0)];
        step(&mut trace, 0x10000, None, 0);
        step(&mut trace, 0x20000, Some(0x11000), 0);
        step(&mut trace, 0x30000, Some(0x21000), 0);
        let n = trace.len();
        // The last step's temporary grows.
        for e in &mut trace[n - 5..] {
            if e.addr == Some(0x30000) {
                e.size = 6 * MIB;
            }
        }
        assert_eq!(last_steps(&trace), None, "{trace:?}");
    }
}
