//! The monitor's CSV files: `memlab_iterations.csv` (one row per recorded
//! iteration) and `memlab_variables.csv` (a row when the bytes of a
//! variable's weight, gradient or optimizer state tensor change), opened once, appended to with a header only for new files, and
//! flushed at least once a second, at `epoch_end`, on `flush()` and on drop.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use memlab_core::format::{csv_header as header, FileFormat, IterationRow, IterationsCsv, VariableRow, VariablesCsv};
use memlab_core::Device;

use super::{IterationRecord, Row, TensorBytes};

/// A record's row of `memlab_iterations.csv`, its strings borrowed.
fn iteration_row<'a>(r: &IterationRecord, device: &'a str) -> IterationRow<&'a str> {
    IterationRow {
        epoch: r.epoch,
        iteration: r.iteration,
        device,
        peak_reserved: r.peak_reserved,
        current_reserved: r.current_reserved,
        peak_allocated: r.peak_allocated,
        current_allocated: r.current_allocated,
        weights: r.weights,
        gradients: r.gradients,
        optimizer_state: r.optimizer_state,
        optimizer_state_measured: r.optimizer_state_measured,
        optimizer_state_estimate: r.optimizer_state_estimate,
        feature_maps: r.feature_maps,
        intermediate_gradients: r.intermediate_gradients,
    }
}

/// Opens `path` for appending rows like `example`; writes the header when
/// the file is new, and refuses a file whose header is another one.
fn open_csv<T: Serialize>(path: &Path, example: &T) -> std::io::Result<csv::Writer<File>> {
    let expected = header(example);
    let exists = path.exists();
    if exists {
        let first = BufReader::new(File::open(path)?).lines().next().transpose()?.unwrap_or_default();
        if !first.is_empty() && first != expected {
            return Err(std::io::Error::other(format!(
                "{} already exists with other columns; move it away or choose another directory",
                path.display()
            )));
        }
    }
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    let empty = file.metadata()?.len() == 0;
    let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(file);
    if empty {
        w.write_record(expected.split(','))?;
    }
    Ok(w)
}

/// The two CSV files of a monitor, open for appending. Rows are buffered and
/// written at least once a second, at the end of every epoch, on
/// [`TrainingMonitor::flush`] and when the monitor is dropped (a panic that
/// unwinds, such as tch's out-of-memory panic, drops it too): writing every
/// row at once would cost a small training step more than the rest of the
/// monitor.
pub(super) struct CsvFiles {
    iterations: csv::Writer<File>,
    variables: csv::Writer<File>,
    flushed: Instant,
    /// The rows of the last record: the variables' bytes as last written.
    last_weights: Vec<Row>,
    last_gradients: Vec<Row>,
    last_states: Vec<Row>,
    /// The device of the records and its name.
    device: (Option<Device>, String),
}

/// The longest rows wait in memory before they are written.
const CSV_FLUSH_EVERY: Duration = Duration::from_secs(1);

impl CsvFiles {
    pub(super) fn open(dir: &Path) -> std::io::Result<CsvFiles> {
        if !dir.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the directory does not exist; create it first",
            ));
        }
        Ok(CsvFiles {
            iterations: open_csv(&dir.join(IterationsCsv.about().file_name("")), &IterationRow::<&str>::default())?,
            variables: open_csv(&dir.join(VariablesCsv.about().file_name("")), &VariableRow::EXAMPLE)?,
            flushed: Instant::now(),
            last_weights: Vec::new(),
            last_gradients: Vec::new(),
            last_states: Vec::new(),
            device: (None, String::new()),
        })
    }

    pub(super) fn append(&mut self, r: &IterationRecord) -> std::io::Result<()> {
        if self.device.0 != r.device {
            self.device = (r.device, r.device.map(|d| d.to_string()).unwrap_or_default());
        }
        let device = &self.device.1;
        self.iterations.serialize(iteration_row(r, device))?;
        // Variables: a row when a variable's bytes change (every variable at
        // the first record), and a 0-byte row when a gradient goes away.
        for (rows, last) in [
            (&r.weight_rows, &mut self.last_weights),
            (&r.gradient_rows, &mut self.last_gradients),
            (&r.optimizer_state_rows, &mut self.last_states),
        ] {
            // Most records repeat the rows of the one before.
            if rows == last {
                continue;
            }
            let before: HashMap<&str, i64> = last.iter().map(|r| (r.name.as_str(), r.bytes)).collect();
            let now: HashSet<&str> = rows.iter().map(|r| r.name.as_str()).collect();
            let changed = rows.iter().filter(|r| before.get(r.name.as_str()) != Some(&r.bytes)).map(|r| (r, r.bytes));
            let gone = last.iter().filter(|r| !now.contains(r.name.as_str())).map(|r| (r, 0));
            for (TensorBytes { name, kind, .. }, bytes) in changed.chain(gone) {
                self.variables.serialize(VariableRow {
                    epoch: r.epoch,
                    iteration: r.iteration,
                    device: device.as_str(),
                    variable: name.as_str(),
                    kind: *kind,
                    bytes,
                })?;
            }
            last.clone_from(rows);
        }
        if self.flushed.elapsed() >= CSV_FLUSH_EVERY {
            self.flush()?;
        }
        Ok(())
    }

    pub(super) fn flush(&mut self) -> std::io::Result<()> {
        self.flushed = Instant::now();
        self.iterations.flush()?;
        self.variables.flush()
    }
}
