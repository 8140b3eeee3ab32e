//! What each aten op allocated on the CPU and on CUDA, from a zoo model's two
//! recordings (`examples/zoo.rs --out`, with every op watched): the evidence
//! behind `memlab_core::ops::table`. Per op name: its runs on each device,
//! the bytes allocated while it was the innermost op running (mean per run),
//! and its class in the table. An op the table calls `same` whose bytes per
//! run differ between the devices is flagged.
//!
//! ```text
//! cargo run --release --example zoo_ops -- CPU.pickle CUDA.pickle [CPU.pickle CUDA.pickle …]
//! ```

use std::collections::BTreeMap;

use memlab_core::export::ops::allocated_by_name;
use memlab_core::export::Snapshot;
use memlab_core::ops::table::{class_of, Class};
use memlab_core::ops::OpRecord;

/// Per op name: runs, bytes allocated while it was innermost, and class.
type PerOp = BTreeMap<String, (u64, u64, Class)>;

fn per_op(path: &str) -> Result<PerOp, Box<dyn std::error::Error>> {
    let snapshot = Snapshot::read_pickle(path)?.snapshot;
    let ops: Vec<OpRecord> = snapshot.memlab.as_ref().and_then(|m| m.ops.clone()).ok_or_else(|| {
        format!("{path}: the recording did not watch its ops (record with `Settings::ops`, as zoo --out does)")
    })?;
    let classes: BTreeMap<String, Class> = ops.iter().map(|r| (r.name.clone(), class_of(r))).collect();
    Ok(allocated_by_name(&snapshot.device_traces, &ops)
        .into_iter()
        .map(|(name, (runs, bytes))| {
            let class = classes.get(&name).copied().unwrap_or(Class::Modelled);
            (name, (runs, bytes, class))
        })
        .collect())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() || !args.len().is_multiple_of(2) {
        return Err("give pairs of recordings: CPU.pickle CUDA.pickle [...]".into());
    }
    for pair in args.chunks(2) {
        let (cpu, cuda) = (per_op(&pair[0])?, per_op(&pair[1])?);
        println!("{} against {}", pair[0], pair[1]);
        println!("{:<48} {:>6} {:>14} {:>6} {:>14}  class", "op", "runs", "CPU B/run", "runs", "CUDA B/run");
        let names: std::collections::BTreeSet<&String> = cpu.keys().chain(cuda.keys()).collect();
        for name in names {
            let (cr, cb, class) = cpu.get(name).copied().unwrap_or((0, 0, Class::Same));
            let (gr, gb, gclass) = cuda.get(name).copied().unwrap_or((0, 0, class));
            let per = |b: u64, r: u64| b.checked_div(r).unwrap_or(0);
            let class = if cpu.contains_key(name) { class } else { gclass };
            let flag = if class == Class::Same && per(cb, cr) != per(gb, gr) { "  <- differs" } else { "" };
            println!(
                "{name:<48} {cr:>6} {:>14} {gr:>6} {:>14}  {}{flag}",
                per(cb, cr),
                per(gb, gr),
                match class {
                    Class::Same => "same".to_string(),
                    Class::Modelled => "modelled".to_string(),
                    Class::NotModelled(b) => format!("not modelled ({b:?})"),
                }
            );
        }
        println!();
    }
    Ok(())
}
