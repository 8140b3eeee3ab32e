//! The per-cell logger's GPU columns, in evcxr's child process as this
//! binary plays it (`tests/common/cells.rs`): the same code path as in the
//! kernel, where the GPU host cannot fetch the crates a notebook needs.

use std::sync::Mutex;
use std::time::Duration;

use crate::common::cells::{child_runtime, csv_figure, drive};
use memlab::Render;
use tch::Tensor;

use super::{floats, MIB};

/// What the cells keep from one to the next.
static KEPT: Mutex<Vec<Tensor>> = Mutex::new(Vec::new());

/// The child: each cell by name.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cells_child() {
    child_runtime(|cell| match cell {
        "start" => {
            assert!(memlab::gpu::cuda_is_available(), "this test needs a CUDA GPU");
            KEPT.lock().unwrap().push(floats(MIB / 4));
            memlab::notebook::log_cells().unwrap();
        }
        "keep_4_temporary_8" => {
            KEPT.lock().unwrap().push(floats(MIB));
            drop(floats(2 * MIB));
        }
        "free_4" => drop(KEPT.lock().unwrap().pop()),
        "table" => {
            print!("{}", memlab::notebook::cells().to_csv().unwrap());
            println!("END CSV");
        }
        other => panic!("no cell {other}"),
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_columns_of_every_cell() {
    let _s = super::serial();
    // The child is a process of its own: give it the memory the tests
    // before this one left in this process's cache, or its CUDA start-up
    // can find the device full.
    memlab::gpu::empty_cache().unwrap();
    let cells = ["start", "keep_4_temporary_8", "free_4", "table"];
    let (outputs, exited) = drive("notebook::cells_child", &["--include-ignored"], &cells, Duration::from_millis(300));
    assert!(exited);
    let keep = outputs[1].join("\n");
    let gpu = keep.lines().find(|l| l.starts_with("GPU:")).unwrap_or_else(|| panic!("a GPU row:\n{keep}"));
    assert!(gpu.starts_with("GPU:     4.00M          8.00M     5.00M"), "{gpu}");
    let csv: Vec<String> = outputs[3].join("\n").split("END CSV").next().unwrap().lines().map(String::from).collect();
    assert_eq!(csv_figure(&csv, "cell 2", "GPU.consumed"), 4 * MIB);
    assert_eq!(csv_figure(&csv, "cell 2", "GPU.peaked"), 8 * MIB);
    assert_eq!(csv_figure(&csv, "cell 2", "GPU.used"), 5 * MIB);
    assert_eq!(csv_figure(&csv, "cell 3", "GPU.consumed"), -4 * MIB);
    assert_eq!(csv_figure(&csv, "cell 3", "GPU.used"), MIB);
    // The CPU tensors' columns stay apart: nothing on the CPU.
    assert_eq!(csv_figure(&csv, "cell 2", "CPU tensors.consumed"), 0);
    println!("{}", outputs[1].join("\n"));
    println!("{}", csv.join("\n"));
}
