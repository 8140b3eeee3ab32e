//! The line-profiler report: one model ([`Report`]), rendered by the render
//! layer like every report ([`Render`](crate::render::Render): a text table,
//! HTML, an evcxr cell), and exported as CSV and JSON. Renderings are
//! `String`s; printing is left to the caller.

mod document;
mod export;

use crate::sync::LockExt;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::str::FromStr;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::profiled::{display_path, profiled_fns, LineStats, ProfiledFn, Table};
use crate::stats::{field_index, FIELDS};

/// One column of a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProfileColumn {
    /// A field of `torch.cuda.memory_stats()`, by index in [`FIELDS`].
    Stat(usize),
    /// The largest change of allocated bytes over one run of the line.
    Increment,
    /// The change of allocated bytes summed over all runs of the line.
    IncrementTotal,
    /// How many times the line ran.
    Hits,
    /// Requests the allocator could not serve while the line ran, all runs
    /// together. A function's table shows it, also when not chosen, as soon
    /// as the function had one.
    Ooms,
}

impl ProfileColumn {
    /// The columns reports show unless told otherwise: the peak of active and of
    /// reserved bytes while the line ran, allocated bytes after it, its
    /// increment, and its hit count.
    pub fn defaults() -> Vec<ProfileColumn> {
        ["active_bytes.all.peak", "reserved_bytes.all.peak", "allocated_bytes.all.current", "increment", "hits"]
            .iter()
            .map(|n| n.parse().expect("default column names are valid"))
            .collect()
    }

    /// The column's name as it is parsed.
    pub fn name(&self) -> &'static str {
        match self {
            ProfileColumn::Stat(i) => FIELDS[*i].name,
            ProfileColumn::Increment => "increment",
            ProfileColumn::IncrementTotal => "increment_total",
            ProfileColumn::Hits => "hits",
            ProfileColumn::Ooms => "ooms",
        }
    }

    /// Whether the column counts bytes (as opposed to allocations, calls, …).
    pub fn is_bytes(&self) -> bool {
        match self {
            ProfileColumn::Stat(i) => FIELDS[*i].name.contains("_bytes") || FIELDS[*i].name == "max_split_size",
            ProfileColumn::Increment | ProfileColumn::IncrementTotal => true,
            ProfileColumn::Hits | ProfileColumn::Ooms => false,
        }
    }

    /// The column's value in a line's record.
    pub fn value(&self, stats: &LineStats) -> i64 {
        match self {
            ProfileColumn::Stat(i) => stats.values[*i],
            ProfileColumn::Increment => stats.increment,
            ProfileColumn::IncrementTotal => stats.increment_total,
            ProfileColumn::Hits => stats.hits as i64,
            ProfileColumn::Ooms => stats.ooms as i64,
        }
    }

    fn signed(&self) -> bool {
        matches!(self, ProfileColumn::Increment | ProfileColumn::IncrementTotal)
    }
}

impl FromStr for ProfileColumn {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "increment" => Ok(ProfileColumn::Increment),
            "increment_total" => Ok(ProfileColumn::IncrementTotal),
            "hits" => Ok(ProfileColumn::Hits),
            "ooms" => Ok(ProfileColumn::Ooms),
            name => field_index(name).map(ProfileColumn::Stat).ok_or_else(|| Error::UnknownStat(name.to_string())),
        }
    }
}

/// One source line of a profiled function. As data, the figures of a line
/// that ran sit beside its number and code; a line that never ran has
/// `"hits": 0` and `"stats": null`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LineReport {
    /// The line number in the source file.
    pub line: u32,
    /// The source text of the line, as it was compiled (borrowed from the
    /// program; owned when the report was read from a file).
    pub code: Cow<'static, str>,
    /// The figures, or `None` for a line with no statement or one that never ran.
    pub stats: Option<LineStats>,
}

impl serde::Serialize for LineReport {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(serde::Serialize)]
        struct Line<'a> {
            line: u32,
            code: &'a str,
            #[serde(flatten)]
            stats: &'a LineStats,
        }
        #[derive(serde::Serialize)]
        struct Silent<'a> {
            line: u32,
            code: &'a str,
            hits: u64,
            stats: Option<()>,
        }
        match &self.stats {
            Some(stats) => Line { line: self.line, code: &self.code, stats }.serialize(serializer),
            None => Silent { line: self.line, code: &self.code, hits: 0, stats: None }.serialize(serializer),
        }
    }
}

/// One profiled function.
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct FunctionReport {
    /// The function's path, e.g. `demo::Mlp::forward`, without generic
    /// arguments; for a trait method, the implementing type's path.
    pub name: String,
    /// For a method of a trait impl: the trait (its last path segment).
    #[serde(rename = "trait")]
    pub trait_name: Option<String>,
    /// Its source file.
    pub file: Cow<'static, str>,
    /// The device it was last measured on.
    pub device: Option<Device>,
    /// Completed calls covered by the figures.
    pub calls: u64,
    /// The last error that kept it from being measured, with what to do.
    pub error: Option<String>,
    /// Its source lines, in order.
    pub lines: Vec<LineReport>,
}

impl FunctionReport {
    fn new(function: &ProfiledFn, table: Table, device: Option<Device>, error: Option<String>) -> Self {
        let meta = function.meta();
        let lines = meta
            .source
            .iter()
            .enumerate()
            .map(|(i, code)| LineReport {
                line: meta.first_line + i as u32,
                code: Cow::Borrowed(*code),
                stats: table.lines.get(i).cloned().flatten(),
            })
            .collect();
        FunctionReport {
            name: function.name().to_string(),
            trait_name: function.trait_name().map(str::to_string),
            file: Cow::Borrowed(meta.file),
            device,
            calls: table.calls,
            error,
            lines,
        }
    }

    /// The record of source line `line`, if it ran.
    pub fn line(&self, line: u32) -> Option<&LineStats> {
        self.lines.iter().find(|l| l.line == line).and_then(|l| l.stats.as_ref())
    }

    /// The first line whose source text contains `code`, e.g. `"let w ="`.
    pub fn find(&self, code: &str) -> Option<&LineReport> {
        self.lines.iter().find(|l| l.code.contains(code))
    }

    /// The name as tables print it: the path, then the trait in parentheses
    /// for a trait method (`demo::Net::step (Step)`).
    pub fn title(&self) -> String {
        match &self.trait_name {
            Some(t) => format!("{} ({t})", self.name),
            None => self.name.clone(),
        }
    }

    /// Whether the function ran at all (its entry was recorded).
    pub fn ran(&self) -> bool {
        self.lines.iter().any(|l| l.stats.is_some())
    }
}

/// The figures of profiled functions, ready to render. As data: the names
/// of the columns tables show, and the functions.
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct Report {
    /// The columns tables show.
    #[serde(serialize_with = "column_names")]
    columns: Vec<ProfileColumn>,
    /// The functions, sorted by name.
    pub functions: Vec<FunctionReport>,
}

fn column_names<S: serde::Serializer>(
    columns: &[ProfileColumn],
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.collect_seq(columns.iter().map(|c| c.name()))
}

impl Report {
    /// Every profiled function linked into the program, called or not.
    pub fn collect() -> Report {
        Report::from_functions(profiled_fns(), |_| true)
    }

    fn from_functions(all: impl Iterator<Item = &'static ProfiledFn>, keep: impl Fn(&ProfiledFn) -> bool) -> Report {
        let mut functions: Vec<FunctionReport> = all
            .filter(|s| keep(s))
            .map(|function| {
                let (table, device, error) = match function.state().as_ref() {
                    Some(st) => (st.total.clone(), st.device, st.error.clone()),
                    None => (Table::default(), None, None),
                };
                FunctionReport::new(function, table, device, error)
            })
            .collect();
        functions.sort_by(|a, b| a.name.cmp(&b.name).then(a.file.cmp(&b.file)));
        Report { functions, columns: default_columns() }
    }

    /// The `#[profile]` functions (not `profile_every` ones), for printing at exit.
    pub(crate) fn at_exit() -> Report {
        Report::from_functions(profiled_fns(), |s| s.meta().every == 0)
    }

    /// The calls of `function` since `profile_every` last printed; starts a new window.
    pub(crate) fn window_of(function: &'static ProfiledFn) -> Report {
        let (table, device, error) =
            function.with_state(|st| (std::mem::take(&mut st.window), st.device, st.error.clone()));
        let function = FunctionReport::new(function, table, device, error);
        Report { functions: vec![function], columns: default_columns() }
    }

    /// The same report showing `columns`: `memory_stats()` keys, `increment`,
    /// `increment_total` or `hits`.
    pub fn with_columns<S: AsRef<str>>(mut self, columns: &[S]) -> Result<Report> {
        self.columns = columns.iter().map(|c| c.as_ref().parse()).collect::<Result<_>>()?;
        Ok(self)
    }

    /// The columns shown.
    pub fn columns(&self) -> &[ProfileColumn] {
        &self.columns
    }

    /// The report of the function whose path is `name` or ends with
    /// `::name`: `forward`, `Net::forward`, `Holder::make` or `Holder<T>::make`
    /// for a method of a generic type, `Net::step` or `<Net as Step>::step`
    /// for a trait method; raw identifiers may keep their `r#`. A name that
    /// fits several functions is an error listing them (a full path wins).
    pub fn function(&self, name: &str) -> Result<&FunctionReport> {
        if let Some(exact) = self.functions.iter().find(|f| Query::new(name).is_exact(f)) {
            return Ok(exact);
        }
        let query = Query::new(name);
        let found: Vec<&FunctionReport> = self.functions.iter().filter(|f| query.matches(f)).collect();
        match found.as_slice() {
            [one] => Ok(one),
            [] => Err(Error::UnknownFunction {
                name: name.to_string(),
                known: self.functions.iter().map(FunctionReport::title).collect::<Vec<_>>().join(", "),
            }),
            many => Err(Error::AmbiguousFunction {
                name: name.to_string(),
                candidates: many.iter().map(|f| f.title()).collect(),
            }),
        }
    }

    /// The same report with only the functions whose path is `name` or ends
    /// with `::name` (written as for [`function`](Self::function)).
    pub fn filter(mut self, name: &str) -> Report {
        let query = Query::new(name);
        self.functions.retain(|f| query.matches(f));
        self
    }

    /// A report read back from the JSON [`Render::to_json`](crate::render::Render::to_json) writes
    /// (the line profile of memlab's snapshots too): it renders as the
    /// program's own did.
    pub fn from_json(json: &str) -> Result<Report> {
        serde_json::from_str(json).map_err(|e| {
            Error::InvalidArgument(format!("not the JSON of a line profile ({e}): give what `Report::to_json` wrote"))
        })
    }
}

/// Reads what [`Report`]'s `Serialize` writes; a line that ran must carry
/// every figure (a missing one would read as a wrong zero).
impl<'de> serde::Deserialize<'de> for Report {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        #[derive(serde::Deserialize)]
        struct ReportData {
            columns: Vec<String>,
            functions: Vec<FunctionData>,
        }
        #[derive(serde::Deserialize)]
        struct FunctionData {
            name: String,
            #[serde(rename = "trait")]
            trait_name: Option<String>,
            file: String,
            device: Option<Device>,
            calls: u64,
            error: Option<String>,
            lines: Vec<LineData>,
        }
        #[derive(serde::Deserialize)]
        struct LineData {
            line: u32,
            code: String,
            hits: u64,
            increment: Option<i64>,
            increment_total: Option<i64>,
            ooms: Option<u64>,
            stats: Option<BTreeMap<String, i64>>,
        }
        let data = ReportData::deserialize(deserializer)?;
        let columns =
            data.columns.iter().map(|c| c.parse()).collect::<Result<Vec<ProfileColumn>>>().map_err(D::Error::custom)?;
        let mut functions = Vec::with_capacity(data.functions.len());
        for f in data.functions {
            let mut lines = Vec::with_capacity(f.lines.len());
            for l in f.lines {
                let stats = match l.stats {
                    None => None,
                    Some(by_name) => {
                        let lacks =
                            |what: &str| D::Error::custom(format!("line {} of {} has no {what}", l.line, f.name));
                        let mut values = [0; crate::stats::N_FIELDS];
                        for (value, field) in values.iter_mut().zip(FIELDS.iter()) {
                            *value = *by_name.get(field.name).ok_or_else(|| lacks(field.name))?;
                        }
                        Some(LineStats {
                            hits: l.hits,
                            values,
                            increment: l.increment.ok_or_else(|| lacks("increment"))?,
                            increment_total: l.increment_total.ok_or_else(|| lacks("increment_total"))?,
                            ooms: l.ooms.ok_or_else(|| lacks("ooms"))?,
                        })
                    }
                };
                lines.push(LineReport { line: l.line, code: Cow::Owned(l.code), stats });
            }
            functions.push(FunctionReport {
                name: f.name,
                trait_name: f.trait_name,
                file: Cow::Owned(f.file),
                device: f.device,
                calls: f.calls,
                error: f.error,
                lines,
            });
        }
        Ok(Report { columns, functions })
    }
}

crate::render::displayed_as_text!(Report);

/// A function name as a user writes it, read the way paths are displayed.
struct Query {
    path: String,
    trait_name: Option<String>,
}

impl Query {
    fn new(name: &str) -> Query {
        let (path, trait_name) = display_path(&name.replace("r#", ""));
        Query { path, trait_name }
    }

    fn trait_fits(&self, f: &FunctionReport) -> bool {
        self.trait_name.is_none() || self.trait_name == f.trait_name
    }

    fn is_exact(&self, f: &FunctionReport) -> bool {
        f.name == self.path && self.trait_fits(f)
    }

    /// Whether `f`'s path is the query's or ends with `::` and it.
    fn matches(&self, f: &FunctionReport) -> bool {
        let ends = f.name.strip_suffix(self.path.as_str()).is_some_and(|head| head.is_empty() || head.ends_with("::"));
        ends && self.trait_fits(f)
    }
}

/// Clears the figures of every profiled function.
pub fn reset() {
    for function in profiled_fns() {
        *function.state() = None;
    }
}

crate::process::process_wide! {
    static COLUMNS: std::sync::Mutex<Option<Vec<ProfileColumn>>> = std::sync::Mutex::new(None);
}

/// Sets the columns of every report that does not choose its own: names of
/// `torch.cuda.memory_stats()` keys (`reserved_bytes.large_pool.peak`, …) or
/// `increment`, `increment_total`, `hits`.
pub fn set_default_columns<S: AsRef<str>>(names: &[S]) -> Result<()> {
    let columns = names.iter().map(|n| n.as_ref().parse()).collect::<Result<Vec<ProfileColumn>>>()?;
    *COLUMNS.locked() = Some(columns);
    Ok(())
}

/// The columns reports use by default.
pub fn default_columns() -> Vec<ProfileColumn> {
    COLUMNS.locked().clone().unwrap_or_else(ProfileColumn::defaults)
}
