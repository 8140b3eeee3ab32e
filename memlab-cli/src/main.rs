//! `memlab`: reads memory snapshots (memlab's and PyTorch's own
//! `torch.cuda.memory._dump_snapshot` pickles, protocols 2 to 5) without
//! libtorch, and says what they hold.
//!
//! ```text
//! memlab summary SNAPSHOT [--json]
//! memlab view SNAPSHOT [-o FILE.html] [--json]
//! memlab diff A B [--html FILE.html] [--json]
//! memlab merge FILES… -o DIR [--offset RANK=µs]… [--json]
//! ```
//!
//! Bad input (a missing, empty, truncated or non-snapshot file, a pickle that
//! builds objects) gets one line on standard error and exit code 2.

use std::process::ExitCode;

use memlab_cli::{analysis, diff, merge, view};

use clap::{Parser, Subcommand};
use memlab_core::export::Snapshot;
use memlab_core::render::Render;

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

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Summary { snapshot, json } => {
            let file = Snapshot::read_pickle(&snapshot).map_err(|e| e.to_string())?;
            let summary = analysis::Summary::of(&snapshot, &file);
            if json {
                println!("{}", summary.to_json());
            } else {
                print!("{}", summary.to_text());
            }
            Ok(())
        }
        Command::View { snapshot, output, json } => {
            let file = Snapshot::read_pickle(&snapshot).map_err(|e| e.to_string())?;
            let summary = analysis::Summary::of(&snapshot, &file);
            let output = output.unwrap_or_else(|| {
                let path = std::path::Path::new(&snapshot);
                path.with_extension("html").to_string_lossy().into_owned()
            });
            let page = view::page(&snapshot, &file, &summary);
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
            if json {
                println!("{}", merged.to_json());
            } else {
                print!("{}", merged.to_text());
            }
            Ok(())
        }
        Command::Diff { a, b, html, json } => {
            // One file at a time: only its summary is kept.
            let summary = |path: &str| -> Result<analysis::Summary, String> {
                let file = Snapshot::read_pickle(path).map_err(|e| e.to_string())?;
                Ok(analysis::Summary::of(path, &file))
            };
            let (sa, sb) = (summary(&a)?, summary(&b)?);
            let diff = diff::Diff::of(&sa, &sb);
            if let Some(html) = &html {
                let page = diff.document().to_page("memlab diff");
                std::fs::write(html, page).map_err(|e| format!("cannot write {html}: {e}"))?;
            }
            if json {
                println!("{}", diff.to_json());
            } else {
                print!("{}", diff.to_text());
            }
            Ok(())
        }
    }
}
