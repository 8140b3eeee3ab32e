//! evcxr's child process as the per-cell logger meets it, without evcxr:
//! the test binary starts itself again as the child, which reads each cell
//! from standard input (`LOAD_AND_RUN <library> <function>`), runs it, and
//! prints `EVCXR_EXECUTION_COMPLETE`, as evcxr 0.22's runtime does; the
//! parent plays the kernel.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Set in the child's environment.
const CHILD: &str = "MEMLAB_TEST_CELLS_CHILD";

/// In the child: runs the cells that arrive through `run`, given each
/// cell's name, until the kernel closes its input; then exits. In the
/// parent: returns at once.
pub fn child_runtime(mut run: impl FnMut(&str)) {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    // The harness has printed the test's name, with no line end.
    println!();
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("a line from the kernel");
        let cell = line.strip_prefix("LOAD_AND_RUN ").and_then(|rest| rest.split(' ').nth(1)).expect("a cell");
        run(cell);
        println!("EVCXR_EXECUTION_COMPLETE");
    }
    std::process::exit(0);
}

/// What one cell printed, line by line, before its end.
pub type Output = Vec<String>;

/// Starts this test binary again with `child_test` as its one test (with
/// `harness_args`), as evcxr's child, and sends it `cells` one by one,
/// waiting `pause` between the end of one and the next (the user reading).
/// Returns each cell's output and the child's exit status once its input
/// is closed.
pub fn drive(child_test: &str, harness_args: &[&str], cells: &[&str], pause: Duration) -> (Vec<Output>, bool) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([child_test, "--exact", "--nocapture", "--test-threads=1"])
        .args(harness_args)
        .env(CHILD, "1")
        .env("EVCXR_IS_RUNTIME", "1")
        .env("MEMLAB_PRINT_AT_EXIT", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the child");
    let (lines_tx, lines) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if lines_tx.send(line.unwrap_or_default()).is_err() {
                return;
            }
        }
    });
    let mut to_child = child.stdin.take().unwrap();
    let mut outputs = Vec::new();
    for (n, cell) in cells.iter().enumerate() {
        if n > 0 {
            std::thread::sleep(pause);
        }
        writeln!(to_child, "LOAD_AND_RUN /cells/libcode_{n}.so {cell}").unwrap();
        to_child.flush().unwrap();
        let mut output = Vec::new();
        loop {
            match lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) if line == "EVCXR_EXECUTION_COMPLETE" => break,
                Ok(line) => output.push(line),
                Err(_) => {
                    let _ = child.kill();
                    panic!("cell {cell} did not end within a minute; it printed:\n{}", output.join("\n"));
                }
            }
        }
        outputs.push(output);
    }
    drop(to_child);
    let status = child.wait().expect("the child ends");
    (outputs, status.success())
}

/// The figures of `cell` in the CSV of every cell: the value in `column`
/// (a header such as `CPU tensors consumed`).
pub fn csv_figure(csv: &[String], cell: &str, column: &str) -> i64 {
    let header: Vec<&str> = csv[0].split(',').collect();
    let at = header.iter().position(|h| *h == column).unwrap_or_else(|| panic!("no column {column} in {header:?}"));
    let row = csv.iter().find(|r| r.split(',').next() == Some(cell)).unwrap_or_else(|| panic!("no {cell} in {csv:?}"));
    row.split(',').nth(at).unwrap().parse().unwrap_or_else(|_| panic!("{column} of {cell}: {row}"))
}
