//! `memlab`: reads memory snapshots (memlab's and PyTorch's own
//! `torch.cuda.memory._dump_snapshot` pickles, protocols 2 to 5) without
//! libtorch, and says what they hold.
//!
//! ```text
//! memlab summary SNAPSHOT [--json]
//! memlab view SNAPSHOT [-o FILE.html] [--all-frames] [--json]
//! memlab diff A B [--html FILE.html] [--json]
//! memlab merge FILES… -o DIR [--offset RANK=µs]… [--json]
//! memlab replay SNAPSHOT [--setting CONF]… [--capacity BYTES | --fraction F] [--total BYTES] [--compare] [--libtorch VERSION] [--json]
//! memlab replay CPU_SNAPSHOT --as-cuda [--capacity BYTES] [--setting CONF]… [--json] [--history FILE.pickle]
//! ```
//!
//! Bad input (a missing, empty, truncated or non-snapshot file, a pickle that
//! builds objects) gets one line on standard error and exit code 2.

use std::process::ExitCode;

use memlab_cli::{analysis, diff, merge, replay, view};

use clap::{Parser, Subcommand};
use memlab_core::export::{Snapshot, SnapshotFile};
use memlab_core::format;
use memlab_core::render::Render;
use memlab_core::replay::Libtorch;

#[derive(Parser)]
#[command(name = "memlab", version, about = "Reads memory snapshots: memlab's and PyTorch's own, without libtorch")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per device: the peaks (allocated, reserved) and when, what was live at
    /// the peak by category and by site, fragmentation, whether the history
    /// is partial.
    Summary {
        /// A snapshot pickle: memlab's, or torch.cuda.memory._dump_snapshot's.
        snapshot: String,
        /// Print the summary as JSON (every site, exact figures, the keys read past).
        #[arg(long)]
        json: bool,
    },
    /// The self-contained HTML report: the summary, then per device memory
    /// over time stacked by site, what was live at the peak by call stack
    /// and by site.
    View {
        /// A snapshot pickle: memlab's, or torch.cuda.memory._dump_snapshot's.
        snapshot: String,
        /// Where to write the page (default: the snapshot's name with .html).
        #[arg(short = 'o', long = "output", value_name = "FILE.html")]
        output: Option<String>,
        /// Print the summary as JSON too, with where the page went.
        #[arg(long)]
        json: bool,
        /// Show every frame of the call stacks: CPython's, libtorch's
        /// dispatcher's, the runtime's (by default each run of them between
        /// the program's own frames is one node, listed when clicked).
        #[arg(long)]
        all_frames: bool,
    },
    /// What changed between two runs, per device: the peaks, and what was
    /// live at the peak by category and by site (new, gone, grown, shrunk),
    /// largest change first.
    Diff {
        /// The first run's snapshot.
        a: String,
        /// The second run's snapshot.
        b: String,
        /// Also write the comparison as a self-contained HTML page.
        #[arg(long, value_name = "FILE.html")]
        html: Option<String>,
        /// Print the comparison as JSON (every row, exact figures).
        #[arg(long)]
        json: bool,
    },
    /// The files of several processes (ranks) in one Perfetto trace and one
    /// page: per-rank peaks (the highest marked), which rank ran out of
    /// memory and why, each rank's memory over time on one time axis (clocks
    /// aligned by the wall clock each file recorded), and what differed at
    /// the peaks.
    Merge {
        /// Snapshots (memlab's or PyTorch's; a rank from `rankN` in the
        /// name), memlab's trace JSONs and out-of-memory report JSONs.
        #[arg(required = true)]
        files: Vec<String>,
        /// The directory to write merged_trace.json and merged.html in.
        #[arg(short = 'o', long = "output", value_name = "DIR")]
        output: String,
        /// Microseconds to add to every time of a rank whose host's clock is
        /// off (repeat for several ranks).
        #[arg(long = "offset", value_name = "RANK=µs")]
        offsets: Vec<String>,
        /// Print the table of ranks and the failures as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replays a snapshot's CUDA history through a model of libtorch's
    /// caching allocator (2.11's or 2.13's, as the recording says): under the recorded settings (with how many of the
    /// allocator's own segment events the model made too) and others, the
    /// peaks, and whether and where memory runs out. With --as-cuda, predicts
    /// a CUDA run from a CPU history instead: will it fit?
    Replay {
        /// A snapshot pickle with a CUDA history: PyTorch's (recorded with
        /// torch.cuda.memory._record_memory_history) or memlab's; with
        /// --as-cuda, memlab's with a CPU history.
        snapshot: String,
        /// Settings to replay under, as PYTORCH_CUDA_ALLOC_CONF writes them
        /// (expandable_segments:True,max_split_size_mb:128); repeat for several.
        #[arg(long = "setting", value_name = "CONF")]
        settings: Vec<String>,
        /// What the allocator could reserve: bytes, or with K, M, G, T (binary
        /// units). With --as-cuda: the card's memory.
        #[arg(long, value_name = "BYTES", conflicts_with = "fraction")]
        capacity: Option<String>,
        /// A memory fraction of the device's total memory (set_per_process_memory_fraction).
        #[arg(long, value_name = "F")]
        fraction: Option<f64>,
        /// The device's total memory: bytes, or with K, M, G, T.
        #[arg(long, value_name = "BYTES", conflicts_with = "as_cuda")]
        total: Option<String>,
        /// Also replay the settings people try (default, expandable segments,
        /// max_split_size_mb at 64, 128 and 512, both, and garbage collection
        /// under a memory fraction), side by side.
        #[arg(long, conflicts_with = "as_cuda")]
        compare: bool,
        /// Predict a CUDA run from the snapshot's CPU history (a memlab
        /// recording of the step on the CPU with Settings::ops, which watches
        /// the ops whose CUDA kernels allocate otherwise): its allocations
        /// replayed through the CUDA allocator's model with what CUDA adds
        /// (estimates). With --capacity, the card's memory: whether the step
        /// fits (a --setting may then carry per_process_memory_fraction:F, a
        /// share of that card). A recording made without Settings::ops is
        /// not predictable: it says why, and gives no verdict.
        #[arg(long = "as-cuda", conflicts_with = "fraction")]
        as_cuda: bool,
        /// The libtorch that made the recording, where the file does not say
        /// (PyTorch's snapshots never do): 2.11 (the default) or 2.13, whose
        /// allocators differ. With --as-cuda: the libtorch to predict for.
        #[arg(long, value_name = "VERSION")]
        libtorch: Option<String>,
        /// Print every figure as JSON: one object per device, or with
        /// --as-cuda the prediction.
        #[arg(long)]
        json: bool,
        /// With --as-cuda: also write the CUDA history the prediction
        /// replays (the CPU run's allocations with what CUDA adds, the ops
        /// beside them) as a snapshot pickle, for `memlab view` or `memlab
        /// replay`, or to set beside a CUDA run's own recording.
        #[arg(long, value_name = "FILE.pickle", requires = "as_cuda")]
        history: Option<String>,
    },
}

/// Prints a report: its data as JSON, or its text.
fn show(report: &(impl Render + serde::Serialize), json: bool) {
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
}

/// Bytes as written on the command line: `1610612736`, `1536M`, `80G`
/// (binary units; a trailing `B` or `iB` allowed).
fn bytes(text: &str, flag: &str) -> Result<u64, String> {
    let t = text.trim().trim_end_matches("iB").trim_end_matches('B');
    let (digits, unit) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => (&t[..i], &t[i..]),
        None => (t, ""),
    };
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("{flag} {text}: write bytes, or a number with K, M, G or T (80G)")),
    };
    let digits = digits.trim();
    // Whole bytes are read exactly; a fraction of a unit (1.5G) in floating point.
    let exact = digits.parse::<u64>().ok().map(|n| n.checked_mul(1u64 << shift));
    let n: f64 = digits.parse().map_err(|_| format!("{flag} {text}: {digits:?} is not a number"))?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("{flag} {text}: not a size"));
    }
    let bytes = n * (1u64 << shift) as f64;
    match exact {
        Some(Some(bytes)) => Ok(bytes),
        Some(None) => Err(format!("{flag} {text}: more bytes than a 64-bit count holds")),
        None if bytes < u64::MAX as f64 => Ok(bytes as u64),
        None => Err(format!("{flag} {text}: more bytes than a 64-bit count holds")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("memlab: {message}");
            ExitCode::from(2)
        }
    }
}

/// The snapshot at `path`, for `memlab COMMAND`: the file is recognised by
/// memlab's registry of formats, so that a file of another format memlab
/// writes is named for what it is; a file of none gets the snapshot
/// reader's own word on what is wrong with it.
fn read_snapshot(path: &str, command: &str) -> Result<SnapshotFile, String> {
    match format::read(path) {
        Ok((format, contents)) => contents.downcast::<SnapshotFile>().map_err(|_| {
            format!(
                "cannot read {path}: it is {}, not a snapshot; memlab {command} reads snapshot pickles (memlab merge reads traces and out-of-memory reports too)",
                format.description()
            )
        }),
        Err(e) if format::is_unrecognised(&e) => Snapshot::read_pickle(path).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Summary { snapshot, json } => {
            let file = read_snapshot(&snapshot, "summary")?;
            let summary = analysis::Summary::of(&snapshot, &file);
            show(&summary, json);
            Ok(())
        }
        Command::View { snapshot, output, json, all_frames } => {
            let file = read_snapshot(&snapshot, "view")?;
            let summary = analysis::Summary::of(&snapshot, &file);
            let output = output.unwrap_or_else(|| {
                let path = std::path::Path::new(&snapshot);
                path.with_extension("html").to_string_lossy().into_owned()
            });
            let page = view::page_with(&snapshot, &file, &summary, all_frames);
            std::fs::write(&output, &page).map_err(|e| format!("cannot write {output}: {e}"))?;
            if json {
                let value = serde_json::json!({ "page": output, "bytes": page.len(), "summary": summary });
                println!("{}", serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?);
            } else {
                println!("wrote {output} ({}): open it in a browser", memlab_core::render::Cell::bytes(page.len()));
            }
            Ok(())
        }
        Command::Merge { files, output, offsets, json } => {
            let offsets = offsets.iter().map(|o| merge::parse_offset(o)).collect::<Result<_, _>>()?;
            let options = merge::Options { out: output.into(), offsets };
            let merged = merge::merge(&files, &options)?;
            show(&merged, json);
            Ok(())
        }
        Command::Diff { a, b, html, json } => {
            // One file at a time: only its summary is kept.
            let summary = |path: &str| -> Result<analysis::Summary, String> {
                let file = read_snapshot(path, "diff")?;
                Ok(analysis::Summary::of(path, &file))
            };
            let (sa, sb) = (summary(&a)?, summary(&b)?);
            let diff = diff::Diff::of(&sa, &sb);
            if let Some(html) = &html {
                let page = diff.document().to_page("memlab diff");
                std::fs::write(html, page).map_err(|e| format!("cannot write {html}: {e}"))?;
            }
            show(&diff, json);
            Ok(())
        }
        Command::Replay { snapshot, settings, capacity, as_cuda: true, json, libtorch, history, .. } => {
            let file = read_snapshot(&snapshot, "replay")?;
            // For the libtorch asked for, else the one that made the recording
            // (what `memlab::will_it_fit` predicted for), else 2.11.
            let recorded = file.snapshot.memlab.as_ref().and_then(|m| m.run.as_ref()).and_then(|r| r.libtorch.clone());
            let options = memlab_core::replay::PredictOptions {
                capacity: capacity.as_deref().map(|c| bytes(c, "--capacity")).transpose()?,
                settings,
                libtorch: libtorch
                    .as_deref()
                    .map(Libtorch::parse)
                    .transpose()
                    .map_err(|e| e.to_string())?
                    .or_else(|| recorded.as_deref().and_then(Libtorch::of_recording))
                    .unwrap_or_default(),
                ..Default::default()
            };
            let predicted =
                memlab_core::replay::predict_cuda(&snapshot, &file.snapshot, &options).map_err(|e| e.to_string())?;
            if let Some(out) = &history {
                memlab_core::replay::predicted_history(&snapshot, &file.snapshot, &options)
                    .and_then(|h| h.write_pickle(out))
                    .map_err(|e| format!("--history {out}: {e}"))?;
            }
            show(&predicted, json);
            Ok(())
        }
        Command::Replay { snapshot, settings, capacity, fraction, total, compare, json, libtorch, .. } => {
            if let Some(f) = fraction.filter(|f| !(0.0..=1.0).contains(f)) {
                return Err(format!("--fraction {f}: a memory fraction is between 0 and 1"));
            }
            let options = replay::Options {
                settings,
                capacity: capacity.as_deref().map(|c| bytes(c, "--capacity")).transpose()?,
                fraction,
                total: total.as_deref().map(|t| bytes(t, "--total")).transpose()?,
                compare,
                libtorch: libtorch.as_deref().map(Libtorch::parse).transpose().map_err(|e| e.to_string())?,
            };
            let file = read_snapshot(&snapshot, "replay")?;
            let replayed = replay::replay(&snapshot, &file, &options)?;
            show(&replayed, json);
            Ok(())
        }
    }
}
