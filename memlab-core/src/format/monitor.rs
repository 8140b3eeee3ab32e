//! The training monitor's CSV files and their rows: `memlab_iterations.csv`
//! (one row per recorded iteration) and `memlab_variables.csv` (a row when
//! the bytes of a variable's weight, gradient or optimizer state change).
//! The monitor appends the rows as it records; these are their formats.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{About, Contents, FileFormat, Input, Registered, WrittenIn};
use crate::{Error, Result, TensorKind};

/// One row of `memlab_iterations.csv`: a monitor record's figures, in bytes
/// (a figure the record has not is an empty field). Read back with its
/// strings owned; the monitor writes it with them borrowed (`S = &str`), so
/// that a record costs no allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IterationRow<S = String> {
    /// The epoch.
    pub epoch: u64,
    /// The iteration within it.
    pub iteration: u64,
    /// `cpu`, `cuda:0`, …; empty where the monitor has no device.
    pub device: S,
    /// The allocator's reserved peak over the iteration.
    pub peak_reserved: i64,
    /// Reserved when recorded.
    pub current_reserved: i64,
    /// The allocated peak over the iteration.
    pub peak_allocated: i64,
    /// Allocated when recorded.
    pub current_allocated: i64,
    /// The model's weights.
    pub weights: i64,
    /// Their gradients.
    pub gradients: i64,
    /// The optimizer's state: measured where it can be read, else estimated.
    pub optimizer_state: Option<i64>,
    /// The optimizer's state as read from its tensors.
    pub optimizer_state_measured: i64,
    /// The optimizer's state as its kind implies, where given.
    pub optimizer_state_estimate: Option<i64>,
    /// Everything else allocated: activations, inputs, temporaries.
    pub feature_maps: i64,
    /// Gradients of intermediate results alive at the record, where known.
    pub intermediate_gradients: Option<i64>,
}

/// One row of `memlab_variables.csv`: a variable's weight, gradient or
/// optimizer state whose bytes changed at that iteration (0 when it went).
/// Strings as in [`IterationRow`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariableRow<S = String> {
    /// The epoch of the record that saw the change.
    pub epoch: u64,
    /// Its iteration.
    pub iteration: u64,
    /// `cpu`, `cuda:0`, …; empty where the monitor has no device.
    pub device: S,
    /// The variable's name (`fc.weight`).
    pub variable: S,
    /// What the tensor is: the weight, its gradient or optimizer state.
    pub kind: TensorKind,
    /// Its bytes from that iteration on.
    pub bytes: i64,
}

impl VariableRow<&str> {
    /// A row of no variable: what its header is written from.
    pub const EXAMPLE: VariableRow<&'static str> =
        VariableRow { epoch: 0, iteration: 0, device: "", variable: "", kind: TensorKind::Parameter, bytes: 0 };
}

/// The header line of rows of type `T`: its fields' names.
pub fn header<T: Serialize>(row: &T) -> String {
    let mut w = csv::WriterBuilder::new().has_headers(true).from_writer(Vec::new());
    let line = w.serialize(row).ok().and_then(|()| w.into_inner().ok()).unwrap_or_default();
    String::from_utf8_lossy(&line).lines().next().unwrap_or_default().to_string()
}

/// Reads a CSV file the monitor wrote, `memlab_iterations.csv` as
/// [`IterationRow`]s or `memlab_variables.csv` as [`VariableRow`]s.
pub fn read_rows<T: for<'de> Deserialize<'de>>(path: impl AsRef<Path>) -> Result<Vec<T>> {
    let path = path.as_ref();
    let what = || format!("read {}", path.display());
    let mut reader = csv::Reader::from_path(path).map_err(|e| Error::io(what(), std::io::Error::other(e)))?;
    reader.deserialize().collect::<std::result::Result<Vec<T>, _>>().map_err(|e| {
        Error::InvalidArgument(format!(
            "{} is not a CSV file the monitor wrote ({e}); give memlab_iterations.csv or memlab_variables.csv",
            path.display()
        ))
    })
}

/// `memlab_iterations.csv`; reads back as `Vec<IterationRow>`.
pub struct IterationsCsv;

/// `memlab_variables.csv`; reads back as `Vec<VariableRow>`.
pub struct VariablesCsv;

inventory::submit! { Registered(&IterationsCsv) }
inventory::submit! { Registered(&VariablesCsv) }

/// Reads `input` as a `Vec` of rows of `T` where its first line is their
/// header (`example`'s).
fn read_if_headed<T>(input: &Input, example: &impl Serialize) -> Option<Result<Contents>>
where
    T: for<'de> Deserialize<'de> + Send + 'static,
{
    (input.first_line() == Some(header(example).as_str())).then(|| read_rows::<T>(input.path()).map(Contents::new))
}

impl FileFormat for IterationsCsv {
    fn about(&self) -> &'static About {
        &About {
            name: "iterations-csv",
            description: "the training monitor's iterations CSV",
            recognised_by: Some("its header"),
            extension: "csv",
            stem: "memlab_iterations",
            written_in: WrittenIn::ITS_TOOL,
            order: 50,
            made_from_recording: true,
        }
    }

    /// Appended a row at a time by the monitor.
    fn estimate(&self) -> u64 {
        0
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        read_if_headed::<IterationRow>(input, &IterationRow::<&str>::default())
    }
}

impl FileFormat for VariablesCsv {
    fn about(&self) -> &'static About {
        &About {
            name: "variables-csv",
            description: "the training monitor's variables CSV",
            recognised_by: Some("its header"),
            extension: "csv",
            stem: "memlab_variables",
            written_in: WrittenIn::ITS_TOOL,
            order: 50,
            made_from_recording: true,
        }
    }

    /// Appended a row at a time by the monitor.
    fn estimate(&self) -> u64 {
        0
    }

    fn read(&self, input: &Input) -> Option<Result<Contents>> {
        read_if_headed::<VariableRow>(input, &VariableRow::EXAMPLE)
    }
}
