//! `memlab`: reads memory snapshots (memlab's and PyTorch's own
//! `torch.cuda.memory._dump_snapshot` pickles, protocols 2 to 5) without
//! libtorch, and says what they hold.
//!
//!     memlab summary SNAPSHOT [--json]
//!
//! Bad input (a missing, empty, truncated or non-snapshot file, a pickle that
//! builds objects) gets one line on standard error and exit code 2.

mod analysis;
mod summary;

use std::process::ExitCode;

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
                println!("{}", serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?);
            } else {
                print!("{}", summary.to_text());
            }
            Ok(())
        }
    }
}
