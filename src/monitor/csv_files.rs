//! The monitor's CSV files: `memlab_iterations.csv` (one row per recorded
//! iteration) and `memlab_variables.csv` (a row when the bytes of a
//! variable's weight, gradient or optimizer state tensor change), opened once, appended to with a header only for new files, and
//! flushed at least once a second, at `epoch_end`, on `flush()` and on drop.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write as _};
use std::path::Path;
use std::time::{Duration, Instant};

use memlab_core::Device;

use super::{IterationRecord, Row, TensorBytes};

const ITERATION_HEADER: [&str; 14] = [
    "epoch",
    "iteration",
    "device",
    "peak_reserved",
    "current_reserved",
    "peak_allocated",
    "current_allocated",
    "weights",
    "gradients",
    "optimizer_state",
    "optimizer_state_measured",
    "optimizer_state_estimate",
    "feature_maps",
    "intermediate_gradients",
];

const VARIABLE_HEADER: [&str; 6] = ["epoch", "iteration", "device", "variable", "kind", "bytes"];

/// Opens `path` for appending; writes the header when the file is new, and
/// refuses a file whose header is another one.
fn open_csv(path: &Path, header: &[&str]) -> std::io::Result<csv::Writer<File>> {
    let expected = header.join(",");
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
        w.write_record(header)?;
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
    /// Numbers and device names only, which CSV never quotes: written as they are.
    iterations: BufWriter<File>,
    variables: csv::Writer<File>,
    flushed: Instant,
    /// The rows of the last record: the variables' bytes as last written.
    last_weights: Vec<Row>,
    last_gradients: Vec<Row>,
    last_states: Vec<Row>,
    /// The device of the records and its name.
    device: (Option<Device>, String),
}

/// Formats integers for the CSV files without allocating.
#[derive(Default)]
struct Digits([u8; 20]);

impl Digits {
    fn of(&mut self, value: i64) -> &[u8] {
        let mut n = value.unsigned_abs();
        let mut at = self.0.len();
        loop {
            at -= 1;
            self.0[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        if value < 0 {
            at -= 1;
            self.0[at] = b'-';
        }
        &self.0[at..]
    }
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
            iterations: BufWriter::new(
                open_csv(&dir.join("memlab_iterations.csv"), &ITERATION_HEADER)?
                    .into_inner()
                    .map_err(|e| e.into_error())?,
            ),
            variables: open_csv(&dir.join("memlab_variables.csv"), &VARIABLE_HEADER)?,
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
        let mut digits = Digits::default();
        let w = &mut self.iterations;
        w.write_all(digits.of(r.epoch as i64))?;
        w.write_all(b",")?;
        w.write_all(digits.of(r.iteration as i64))?;
        w.write_all(b",")?;
        w.write_all(device.as_bytes())?;
        for value in [
            Some(r.peak_reserved),
            Some(r.current_reserved),
            Some(r.peak_allocated),
            Some(r.current_allocated),
            Some(r.weights),
            Some(r.gradients),
            r.optimizer_state,
            Some(r.optimizer_state_measured),
            r.optimizer_state_estimate,
            Some(r.feature_maps),
            r.intermediate_gradients,
        ] {
            w.write_all(b",")?;
            if let Some(v) = value {
                w.write_all(digits.of(v))?;
            }
        }
        w.write_all(b"\n")?;
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
                let kind = kind.as_str();
                let w = &mut self.variables;
                w.write_field(digits.of(r.epoch as i64))?;
                w.write_field(digits.of(r.iteration as i64))?;
                w.write_field(device)?;
                w.write_field(name)?;
                w.write_field(kind)?;
                w.write_field(digits.of(bytes))?;
                w.write_record(None::<&[u8]>)?;
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
