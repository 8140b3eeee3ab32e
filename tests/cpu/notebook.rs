//! The per-cell logger in evcxr's child process, played by this binary (see
//! `tests/common/cells.rs`): a line after every cell with exact figures of
//! its CPU tensors, its time without the pause before the next cell, the
//! compact form, stop and resume, and the table of every cell as CSV.

use std::sync::Mutex;
use std::time::Duration;

use crate::common::cells::{child_runtime, csv_figure, drive};
use memlab::Render;
use tch::{Kind, Tensor};

const MIB: i64 = 1 << 20;

/// What the cells keep from one to the next, as evcxr keeps a cell's variables.
static KEPT: Mutex<Vec<Tensor>> = Mutex::new(Vec::new());

fn keep(t: Tensor) {
    KEPT.lock().unwrap().push(t);
}

/// The child: each cell by name.
#[test]
fn cells_child() {
    child_runtime(|cell| match cell {
        "before" => keep(Tensor::zeros([MIB], (Kind::Float, tch::Device::Cpu))),
        "start" => {
            memlab::notebook::log_cells().unwrap();
            println!("logging");
        }
        "keep_4_temporary_8" => {
            // 4 MiB kept, then 8 MiB made and dropped: consumed 4 MiB,
            // peaked 8 MiB above the end.
            keep(Tensor::zeros([MIB], (Kind::Float, tch::Device::Cpu)));
            let temporary = Tensor::zeros([2 * MIB], (Kind::Float, tch::Device::Cpu));
            drop(temporary);
            println!("kept");
        }
        "sleep" => std::thread::sleep(Duration::from_millis(200)),
        "temporary_8" => drop(Tensor::zeros([2 * MIB], (Kind::Float, tch::Device::Cpu))),
        "read_peak" => {
            let s = memlab::stats::device_stats(memlab::Device::Cpu).unwrap();
            println!("peak {} current {}", s.allocated_bytes.all.peak, s.allocated_bytes.all.current);
        }
        "compact" => memlab::notebook::CellLogger::new().compact(true).start().unwrap(),
        "free_4" => drop(KEPT.lock().unwrap().pop()),
        "stop" => memlab::notebook::stop(),
        "quiet" => keep(Tensor::zeros([MIB / 2], (Kind::Float, tch::Device::Cpu))),
        "resume" => memlab::notebook::resume(),
        "table" => {
            let cells = memlab::notebook::cells();
            print!("{}", cells.to_csv().unwrap());
            println!("END CSV");
            print!("{cells}");
        }
        other => panic!("no cell {other}"),
    });
}

#[test]
fn a_line_after_every_cell_with_exact_figures() {
    let cells =
        ["before", "start", "keep_4_temporary_8", "sleep", "compact", "free_4", "stop", "quiet", "resume", "table"];
    let (outputs, exited) = drive(&crate::common::test_path("cells_child"), &[], &cells, Duration::from_millis(600));
    assert!(exited, "the child ends when the kernel closes its input");
    let out = |cell: &str| outputs[cells.iter().position(|c| *c == cell).unwrap()].join("\n");

    // Nothing before logging starts; the starting cell's rest is logged.
    assert!(!out("before").contains("RAM:"), "{}", out("before"));
    assert!(out("start").contains("logging\nRAM:"), "its line after what it printed:\n{}", out("start"));
    assert!(out("start").contains("(cell 1, from log_cells(), compile not timed)"), "{}", out("start"));

    // The table form, after what the cell printed, with the allocator's exact figures.
    let keep = out("keep_4_temporary_8");
    assert!(keep.contains("kept\nRAM:  Consumed  Peak over end      Used     Total  in "), "{keep}");
    let cpu = keep.lines().find(|l| l.starts_with("CPU:")).unwrap_or_else(|| panic!("a CPU row:\n{keep}"));
    assert!(cpu.starts_with("CPU:     4.00M          8.00M     8.00M"), "{cpu}");

    // The time is the cell's run, not the user's pause before it.
    let sleep = out("sleep");
    let time: f64 = sleep.split(" in ").nth(1).and_then(|t| t.split('s').next()).unwrap().parse().unwrap();
    assert!((0.2..0.5).contains(&time), "a 200 ms cell after a 600 ms pause took {time}s:\n{sleep}");

    // The compact form from the calling cell's line on; nothing while stopped.
    assert!(out("compact").starts_with("cell 4, compile not timed: "), "{}", out("compact"));
    let line = out("free_4");
    assert!(
        line.starts_with("cell 5, compile not timed: ") && line.contains(" | CPU tensors -4.00M ^4.00M =4.00M"),
        "{line}"
    );
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(out("quiet").is_empty() && !out("resume").is_empty(), "{outputs:?}");

    // Every cell, kept as data: the exact bytes, and the times as measured.
    let table = out("table");
    let csv: Vec<String> = table.split("END CSV").next().unwrap().lines().map(String::from).collect();
    assert_eq!(csv.len(), 1 + 8, "a header and eight cells, the last not yet ended:\n{table}");
    assert_eq!(csv_figure(&csv, "cell 2", "CPU tensors.consumed"), 4 * MIB);
    assert_eq!(csv_figure(&csv, "cell 2", "CPU tensors.peaked"), 8 * MIB);
    assert_eq!(csv_figure(&csv, "cell 2", "CPU tensors.used"), 8 * MIB);
    assert_eq!(csv_figure(&csv, "cell 7", "CPU tensors.consumed"), 2 * MIB, "measured while stopped");
    assert!(table.contains("compiling it is not seen"), "{table}");
}

/// The logger measures each cell with peak slots of its own: the figures
/// the cells read (`memlab::stats`) are those they read without it. It
/// used to reset the allocator's peak at every cell: after an 8 MiB
/// temporary the next cell read a peak of its current level.
#[test]
fn the_logger_leaves_the_programs_figures_as_they_are() {
    let peaks = |cells: &[&str]| {
        let (outputs, exited) = drive(&crate::common::test_path("cells_child"), &[], cells, Duration::from_millis(50));
        assert!(exited);
        let line = outputs.last().unwrap().join("\n");
        let figure = |name: &str| -> i64 {
            let at = line.find(name).unwrap_or_else(|| panic!("{name} in {line}"));
            line[at + name.len()..].split_whitespace().next().unwrap().parse().unwrap()
        };
        (figure("peak "), figure("current "))
    };
    for cells in [&["temporary_8", "read_peak"][..], &["start", "temporary_8", "read_peak"]] {
        let (peak, current) = peaks(cells);
        assert!(peak >= current + 8 * MIB - MIB / 2, "{cells:?}: peak {peak}, current {current}");
    }
}

#[test]
fn outside_a_notebook_it_says_what_to_use() {
    if std::env::var_os("EVCXR_IS_RUNTIME").is_some() {
        return;
    }
    let err = memlab::notebook::log_cells().unwrap_err().to_string();
    assert!(err.contains("evcxr") && err.contains("memlab::StepLogger"), "{err}");
    assert!(memlab::notebook::cells().to_string().contains("No cell logged"));
}
