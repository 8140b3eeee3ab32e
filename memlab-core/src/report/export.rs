//! The CSV export: one row per line that ran, every statistic in bytes or
//! counts, unrounded. (JSON is the report's own `Serialize`.)

use super::Report;
use crate::error::Result;
use crate::stats::FIELDS;

pub(super) fn csv(report: &Report) -> Result<String> {
    let mut header =
        vec!["function", "file", "device", "calls", "line", "code", "hits", "increment", "increment_total", "ooms"];
    header.extend(FIELDS.iter().map(|f| f.name));
    let mut rows = Vec::new();
    for f in &report.functions {
        let device = f.device.map(|d| d.to_string()).unwrap_or_default();
        for l in &f.lines {
            let Some(s) = &l.stats else { continue };
            let mut row = vec![
                f.name.clone(),
                f.file.to_string(),
                device.clone(),
                f.calls.to_string(),
                l.line.to_string(),
                l.code.trim().to_string(),
                s.hits.to_string(),
                s.increment.to_string(),
                s.increment_total.to_string(),
                s.ooms.to_string(),
            ];
            row.extend(s.values.iter().map(i64::to_string));
            rows.push(row);
        }
    }
    crate::render::csv_string("the line profile", &header, rows)
}
