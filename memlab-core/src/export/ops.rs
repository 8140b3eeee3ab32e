//! Which op made which allocation of a recorded history: each allocation
//! belongs to the innermost op running when it was made
//! ([`innermost`]), which decides what a snapshot keeps of the ops a
//! recording watched ([`that_allocate`]) and what each op allocated
//! ([`allocated_by_name`], against which [`crate::ops::table`] is checked).

use crate::events::Action;
use crate::ops::{table, Op, OpRecord};

use super::TraceEntry;

/// The ops that only make memory for their caller (`empty`, `empty_like`,
/// …): an allocation inside one belongs to the op that called it, where one
/// did.
const ALLOCATION_PRIMITIVES: [&str; 6] =
    ["empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_"];

/// For each event of `trace` (one device's history, in time order), the
/// index in `ops` of the innermost op running when it happened, if any: of
/// the ops whose window holds the event's time, the one that began last
/// (ties: the one recorded last, since an op's record comes before those of
/// the ops it calls), passing over an op that only makes memory for the op
/// that called it (`empty`). Ops are taken to nest, as they do on one
/// thread.
pub fn innermost(trace: &[TraceEntry], ops: &[OpRecord]) -> Vec<Option<usize>> {
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_by_key(|&i| (ops[i].start_us, i));
    let end = |i: usize| ops[i].end_us.max(ops[i].start_us);
    let (mut next, mut open): (usize, Vec<usize>) = (0, Vec::new());
    trace
        .iter()
        .map(|e| {
            while next < order.len() && ops[order[next]].start_us <= e.time_us {
                let op = order[next];
                open.retain(|&o| end(o) >= ops[op].start_us);
                open.push(op);
                next += 1;
            }
            open.retain(|&o| end(o) >= e.time_us);
            let primitive = |o: &&usize| ALLOCATION_PRIMITIVES.contains(&ops[**o].name.as_str());
            open.iter().rev().find(|o| !primitive(o)).or(open.last()).copied()
        })
        .collect()
}

/// Per op name, over every device's history in `traces`: how many times
/// the op ran and the bytes allocated while it was the innermost op running
/// ([`innermost`]). What [`table`]'s classes are checked against: an op the
/// same on both devices allocates the same bytes a run in a CPU and a CUDA
/// recording of one step.
pub fn allocated_by_name(
    traces: &[Vec<TraceEntry>],
    ops: &[OpRecord],
) -> std::collections::BTreeMap<String, (u64, u64)> {
    let name = |r: &OpRecord| if r.name.is_empty() { format!("{:?}", r.op) } else { r.name.clone() };
    let mut out = std::collections::BTreeMap::new();
    for r in ops {
        out.entry(name(r)).or_insert((0, 0)).0 += 1;
    }
    for trace in traces {
        for (e, op) in trace.iter().zip(innermost(trace, ops)) {
            if let (Action::Alloc, Some(op)) = (e.action, op) {
                out.entry(name(&ops[op])).or_insert((0, 0)).1 += e.size;
            }
        }
    }
    out
}

/// The ops of `ops` worth keeping with `traces`: those of the kinds memlab
/// models, each other op that allocated, innermost, on some device's
/// history, and each op the [`table`] names as not modelled during which
/// anything was allocated (its kernel may call others that allocate, as
/// the CPU's RNNs do), and each backward node during which anything was
/// allocated (what links a forward op to its backward pass). What a
/// recording's snapshot carries.
pub fn that_allocate(ops: Vec<OpRecord>, traces: &[Vec<TraceEntry>]) -> Vec<OpRecord> {
    let mut allocated = vec![false; ops.len()];
    let mut times: Vec<u64> = Vec::new();
    for trace in traces {
        for (e, op) in trace.iter().zip(innermost(trace, &ops)) {
            if e.action == Action::Alloc {
                times.push(e.time_us);
                if let Some(op) = op {
                    allocated[op] = true;
                }
            }
        }
    }
    times.sort_unstable();
    for (r, allocated) in ops.iter().zip(allocated.iter_mut()) {
        let named = matches!(table::entry(&r.name), Some(e) if matches!(e.class, table::Class::NotModelled(_)))
            || matches!(r.op, Op::BackwardNode);
        if named && !*allocated {
            let from = times.partition_point(|&t| t < r.start_us);
            *allocated = times.get(from).is_some_and(|&t| t <= r.end_us.max(r.start_us));
        }
    }
    ops.into_iter()
        .zip(allocated)
        .filter(|(r, allocated)| *allocated || !matches!(r.op, Op::Other | Op::BackwardNode))
        .map(|(r, _)| r)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Op;

    fn op(name: &str, start_us: u64, end_us: u64) -> OpRecord {
        OpRecord { name: name.into(), ..OpRecord::new(start_us, end_us, Op::Other) }
    }

    /// `linear` (10–20) calls `t` (11, allocating nothing) and `addmm`
    /// (12–15); `relu` (30–31) comes after; `sum` (40–41) allocates
    /// nothing but is of a kind memlab models.
    #[test]
    fn an_allocation_belongs_to_the_innermost_op_and_only_allocating_ops_are_kept() {
        let ops = vec![
            op("linear", 10, 20),
            op("t", 11, 11),
            op("addmm", 12, 15),
            op("empty", 13, 13),
            op("relu", 30, 31),
            OpRecord::new(40, 41, Op::Matmul { in_backward: false }),
            op("empty", 60, 60),
        ];
        let event = |action, time_us| TraceEntry::new(action, Some(time_us), 64, time_us);
        let trace = vec![
            event(Action::Alloc, 5),
            event(Action::Alloc, 13),
            event(Action::Alloc, 18),
            event(Action::FreeRequested, 30),
            event(Action::Alloc, 31),
            event(Action::Alloc, 50),
            event(Action::Alloc, 60),
        ];
        // addmm's output, made through `empty`, is addmm's; an `empty` no op
        // called is its own.
        assert_eq!(innermost(&trace, &ops), vec![None, Some(2), Some(0), Some(4), Some(4), None, Some(6)]);
        let kept: Vec<String> = that_allocate(ops, &[trace]).into_iter().map(|r| r.name).collect();
        assert_eq!(
            kept,
            ["linear", "addmm", "relu", "", "empty"],
            "`t` made nothing; the product is kept for its kind"
        );
    }
}
