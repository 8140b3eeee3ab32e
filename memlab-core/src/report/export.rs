//! Machine-readable exports: CSV with one row per line that ran, and JSON of
//! the whole model. Both carry every statistic, in bytes or counts, unrounded.

use serde_json::{json, Map, Value};

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

pub(super) fn json(report: &Report) -> String {
    let functions: Vec<Value> = report
        .functions
        .iter()
        .map(|f| {
            let lines: Vec<Value> = f
                .lines
                .iter()
                .map(|l| match &l.stats {
                    Some(s) => {
                        let stats: Map<String, Value> =
                            FIELDS.iter().zip(s.values.iter()).map(|(k, v)| (k.name.to_string(), json!(v))).collect();
                        json!({
                            "line": l.line, "code": l.code, "hits": s.hits,
                            "increment": s.increment, "increment_total": s.increment_total, "ooms": s.ooms, "stats": stats,
                        })
                    }
                    None => json!({ "line": l.line, "code": l.code, "hits": 0, "stats": null }),
                })
                .collect();
            json!({
                "name": f.name, "trait": f.trait_name, "file": f.file, "device": f.device.map(|d| d.to_string()),
                "calls": f.calls, "error": f.error, "lines": lines,
            })
        })
        .collect();
    let columns: Vec<&str> = report.columns().iter().map(|c| c.name()).collect();
    serde_json::to_string_pretty(&json!({ "columns": columns, "functions": functions }))
        .expect("a JSON value always serialises")
}
