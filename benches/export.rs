//! How the exports scale: records N allocation events (default 1,000,000:
//! alloc/free pairs of small CPU tensors, with backtraces), then times
//! building and writing each format, and the HTML report's rendering in
//! headless Chromium when it is installed. Prints a table.
//!
//!     source scripts/env.sh && cargo bench --bench export [-- EVENTS [deep]]
//!
//! By default the allocations come from one call site. With `deep`, they come
//! from 8,192 distinct call stacks, each 13 frames of the user's code deeper
//! than the loop (two functions calling each other by the bits of a counter),
//! so the exports build and name thousands of stacks, as a real model's
//! layers and steps give them.
//!
//! Each figure is one timing of a step that takes a large fraction of a
//! second, and the table also gives the files' sizes, so this benchmark keeps
//! its own `main` rather than a harness's repeated samples. Without `--bench`
//! (`cargo test --benches` runs it so) it records 10,000 events and leaves
//! out the rendering, to show that it works.

use std::process::Command;
use std::time::Instant;

use tch::{Kind, Tensor};

#[memlab::profile(device = "cpu")]
fn churn(pairs: usize, kept: &mut Vec<Tensor>) {
    for i in 0..pairs {
        let t = Tensor::zeros([16 + (i % 64) as i64], (Kind::Float, tch::Device::Cpu));
        if i % 1000 == 0 {
            kept.push(t); // a slow leak, so the timeline climbs
        }
    }
}

/// Depth of the `deep` call stacks below their first function: 2^(DEPTH + 1) distinct ones.
const DEPTH: usize = 12;

#[inline(never)]
fn left(i: usize, depth: usize) -> Tensor {
    if depth == 0 {
        return Tensor::zeros([16 + (i % 64) as i64], (Kind::Float, tch::Device::Cpu));
    }
    let t = if (i >> depth) & 1 == 0 { left(i, depth - 1) } else { right(i, depth - 1) };
    std::hint::black_box(t)
}

#[inline(never)]
fn right(i: usize, depth: usize) -> Tensor {
    if depth == 0 {
        return Tensor::zeros([16 + (i % 64) as i64], (Kind::Float, tch::Device::Cpu));
    }
    let t = if (i >> depth) & 1 == 0 { left(i, depth - 1) } else { right(i, depth - 1) };
    std::hint::black_box(t)
}

#[memlab::profile(device = "cpu")]
fn churn_deep(pairs: usize, kept: &mut Vec<Tensor>) {
    for i in 0..pairs {
        let t = if i & 1 == 0 { left(i, DEPTH) } else { right(i, DEPTH) };
        if i % 1000 == 0 {
            kept.push(t);
        }
    }
}

fn secs(start: Instant) -> f64 {
    start.elapsed().as_secs_f64()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    memlab::profiler::set_print_at_exit(false);
    // `cargo bench` passes `--bench` (after EVENTS and deep); `cargo test --benches` does not.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let measuring = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test");
    let positional: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let (events, deep) = if measuring {
        let events = positional.first().map(|a| a.parse()).transpose()?.unwrap_or(1_000_000);
        (events, positional.get(1).is_some_and(|a| *a == "deep"))
    } else {
        println!("test mode: 10,000 events, no rendering (`cargo bench --bench export` measures)\n");
        (10_000, false)
    };
    let settings = memlab::events::Settings::default().capacity(events + 1000).backtraces(true);
    let recording = memlab::Recording::start(settings)?;
    let mut kept = Vec::new();
    let start = Instant::now();
    if deep {
        churn_deep(events / 2, &mut kept);
    } else {
        churn(events / 2, &mut kept);
    }
    let record = secs(start);
    let (history, stats) = memlab::events::history();
    let recorded = history.len();
    drop(history);

    let dir = std::env::temp_dir().join(format!("memlab-bench-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let exporter = memlab::export::Exporter::registered();
    let mut rows = Vec::new();
    let t = Instant::now();
    let snapshot = exporter.snapshot()?;
    let build = secs(t);
    let t = Instant::now();
    snapshot.write_pickle(dir.join("memlab_snapshot.pickle"))?;
    rows.push(("snapshot (pickle)", build, secs(t), std::fs::metadata(dir.join("memlab_snapshot.pickle"))?.len()));
    drop(snapshot);
    let t = Instant::now();
    let trace = exporter.trace()?;
    let build = secs(t);
    let t = Instant::now();
    trace.write_json(dir.join("memlab_trace.json"))?;
    rows.push(("trace (JSON)", build, secs(t), std::fs::metadata(dir.join("memlab_trace.json"))?.len()));
    drop(trace);
    let t = Instant::now();
    let report = exporter.html_report()?;
    let build = secs(t);
    let t = Instant::now();
    let html = dir.join("memlab_report.html");
    report.write(&html)?;
    rows.push(("HTML report", build, secs(t), std::fs::metadata(&html)?.len()));

    let sites = if deep { format!("{} distinct call stacks", 1 << (DEPTH + 1)) } else { "one call site".to_string() };
    println!("{recorded} events from {sites} recorded in {record:.2} s ({} dropped)\n", stats.dropped);
    println!("| format | build, s | write, s | file |");
    println!("|---|---:|---:|---:|");
    for (name, build, write, bytes) in &rows {
        println!("| {name} | {build:.2} | {write:.2} | {:.1} MB |", *bytes as f64 / 1e6);
    }
    // Rendering: headless Chromium loading the page and laying it out, less
    // the same browser on an empty page. Test mode leaves it out.
    let chromium = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .filter(|_| measuring)
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()));
    match chromium {
        Some(browser) => {
            let empty = dir.join("empty.html");
            std::fs::write(&empty, "<!DOCTYPE html><html><body></body></html>")?;
            let load = |page: &std::path::Path| -> std::io::Result<f64> {
                let t = Instant::now();
                Command::new(browser)
                    .args(["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"])
                    .arg(format!("file://{}", page.display()))
                    .output()?;
                Ok(secs(t))
            };
            let (mut base, mut page) = (f64::MAX, f64::MAX);
            for _ in 0..3 {
                base = base.min(load(&empty)?);
                page = page.min(load(&html)?);
            }
            println!(
                "\nHTML report in headless Chromium: {page:.2} s to load and lay out, {base:.2} s for an empty page (best of 3): {:.2} s for the report",
                page - base
            );
        }
        None if measuring => println!("\nno chromium on PATH: the rendering time is not measured"),
        None => {}
    }
    std::fs::remove_dir_all(&dir)?;
    drop((kept, recording));
    Ok(())
}
