//! Typed cells: what a table cell or a label's value holds, a figure of a
//! known kind or text. Tools hand the render layer values, never formatted
//! figures; the layer decides how each kind reads in text, HTML, CSV and
//! JSON.

use std::fmt;
use std::time::Duration;

/// One value of a report: a figure of a known kind, or text.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    /// Nothing (a line that never ran; a figure that is unknown).
    Empty,
    /// A number of bytes, base 1024 with two decimals (`4.00M`, `-2.50K`).
    /// Held as an `i128`, so that every `u64` and `i64` figure is exact.
    Bytes(i128),
    /// A change of bytes, with its sign (`+4.00M`, `-2.00K`, `0.00B`).
    SignedBytes(i128),
    /// A byte count in parentheses: bytes that are also counted elsewhere
    /// (a view's bytes, which its base already holds): `(16.00B)`.
    SharedBytes(i128),
    /// Bytes and how many blocks hold them: `4.00M (3)`.
    BytesIn {
        /// The bytes.
        bytes: i128,
        /// How many blocks (tensors, allocations) hold them.
        count: u64,
    },
    /// A plain count (`12`).
    Count(i128),
    /// A time span, in seconds with three decimals (`1.250s`).
    Duration(Duration),
    /// A share, given as a fraction, shown as a whole percentage (`92%`).
    Percent(f64),
    /// Prose or a name.
    Text(String),
    /// Source code, indentation kept.
    Code(String),
}

impl Cell {
    /// `bytes` as a figure of bytes (any integer type up to 64 bits, exact).
    pub fn bytes(bytes: impl Amount) -> Cell {
        Cell::Bytes(bytes.amount())
    }

    /// `bytes` held by `count` blocks.
    pub fn bytes_in(bytes: impl Amount, count: u64) -> Cell {
        Cell::BytesIn { bytes: bytes.amount(), count }
    }

    /// A change of `bytes`, shown with its sign.
    pub fn signed_bytes(bytes: impl Amount) -> Cell {
        Cell::SignedBytes(bytes.amount())
    }

    /// `count` as a plain figure.
    pub fn count(count: impl Amount) -> Cell {
        Cell::Count(count.amount())
    }

    /// `text` as prose.
    pub fn text(text: impl Into<String>) -> Cell {
        Cell::Text(text.into())
    }

    /// `code` as source code.
    pub fn code(code: impl Into<String>) -> Cell {
        Cell::Code(code.into())
    }

    /// The figure a bar of this cell is as long as, if it is a figure.
    pub(super) fn magnitude(&self) -> Option<i128> {
        match *self {
            Cell::Bytes(n) | Cell::SignedBytes(n) | Cell::SharedBytes(n) | Cell::Count(n) => Some(n),
            Cell::BytesIn { bytes, .. } => Some(bytes),
            _ => None,
        }
    }

    /// The cell as a JSON value: figures as numbers (bytes and counts
    /// exact, durations in seconds, shares as fractions), text as strings,
    /// nothing as `null`.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::{json, Value};
        match self {
            Cell::Empty => Value::Null,
            Cell::Bytes(n) | Cell::SignedBytes(n) | Cell::SharedBytes(n) | Cell::Count(n) => number(*n),
            Cell::BytesIn { bytes, count } => json!({ "bytes": number(*bytes), "count": count }),
            Cell::Duration(d) => json!(d.as_secs_f64()),
            Cell::Percent(p) => json!(p),
            Cell::Text(t) | Cell::Code(t) => json!(t),
        }
    }

    /// The cell as a CSV field: figures unrounded (bytes and counts as
    /// integers, durations in seconds, shares as fractions), text as is.
    pub fn to_csv(&self) -> String {
        match self {
            Cell::Empty => String::new(),
            Cell::Bytes(n) | Cell::SignedBytes(n) | Cell::SharedBytes(n) | Cell::Count(n) => n.to_string(),
            Cell::BytesIn { bytes, .. } => bytes.to_string(),
            Cell::Duration(d) => d.as_secs_f64().to_string(),
            Cell::Percent(p) => p.to_string(),
            Cell::Text(t) | Cell::Code(t) => t.clone(),
        }
    }
}

/// A figure as a JSON number: exact wherever it fits an `i64` or a `u64`
/// (every figure a cell is made from does).
fn number(n: i128) -> serde_json::Value {
    match (i64::try_from(n), u64::try_from(n)) {
        (Ok(n), _) => n.into(),
        (_, Ok(n)) => n.into(),
        _ => (n as f64).into(),
    }
}

/// Writes `bytes` base 1024 with two decimals and a unit of `B K M G T P E`.
fn write_bytes(f: &mut fmt::Formatter<'_>, bytes: i128) -> fmt::Result {
    const UNITS: [&str; 7] = ["B", "K", "M", "G", "T", "P", "E"];
    let mut value = bytes.unsigned_abs() as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    write!(f, "{}{value:.2}{}", if bytes < 0 { "-" } else { "" }, UNITS[unit])
}

/// The text rendering of the cell: what `to_text` puts in a column and what
/// `format!` puts in prose.
impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cell::Empty => Ok(()),
            Cell::Bytes(n) => write_bytes(f, *n),
            Cell::SignedBytes(n) => {
                if *n > 0 {
                    f.write_str("+")?;
                }
                write_bytes(f, *n)
            }
            Cell::SharedBytes(n) => {
                f.write_str("(")?;
                write_bytes(f, *n)?;
                f.write_str(")")
            }
            Cell::BytesIn { bytes, count } => {
                write_bytes(f, *bytes)?;
                write!(f, " ({count})")
            }
            Cell::Count(n) => write!(f, "{n}"),
            Cell::Duration(d) => write!(f, "{:.3}s", d.as_secs_f64()),
            Cell::Percent(p) => write!(f, "{:.0}%", p * 100.0),
            Cell::Text(t) | Cell::Code(t) => f.write_str(t),
        }
    }
}

impl From<String> for Cell {
    fn from(text: String) -> Cell {
        Cell::Text(text)
    }
}

impl From<&str> for Cell {
    fn from(text: &str) -> Cell {
        Cell::Text(text.to_string())
    }
}

impl From<&String> for Cell {
    fn from(text: &String) -> Cell {
        Cell::Text(text.clone())
    }
}

/// An integer that a figure can hold: every byte count memlab reads is one
/// of these, held exactly.
pub trait Amount {
    /// The value as an `i128`.
    fn amount(self) -> i128;
}

macro_rules! amount {
    ($($t:ty),*) => {$(
        impl Amount for $t {
            fn amount(self) -> i128 {
                self as i128
            }
        }
    )*};
}
amount!(i64, u64, usize, u32, i32, isize);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_read_base_1024_with_two_decimals() {
        let text = |c: Cell| c.to_string();
        assert_eq!(text(Cell::bytes(0u64)), "0.00B");
        assert_eq!(text(Cell::bytes(512u64)), "512.00B");
        assert_eq!(text(Cell::bytes(40u64 * 1024)), "40.00K");
        assert_eq!(text(Cell::bytes(4u64 << 20)), "4.00M");
        assert_eq!(text(Cell::bytes(-3i64 << 30)), "-3.00G");
        assert_eq!(text(Cell::bytes(1u64 << 60)), "1.00E");
        assert_eq!(text(Cell::bytes(u64::MAX)), "16.00E");
        assert_eq!(text(Cell::bytes(i64::MIN)), "-8.00E");
        assert_eq!(text(Cell::signed_bytes(4i64 << 20)), "+4.00M");
        assert_eq!(text(Cell::signed_bytes(-2048i64)), "-2.00K");
        assert_eq!(text(Cell::signed_bytes(0i64)), "0.00B");
        assert_eq!(text(Cell::SharedBytes(16)), "(16.00B)");
        assert_eq!(text(Cell::BytesIn { bytes: 3 << 20, count: 3 }), "3.00M (3)");
        assert_eq!(text(Cell::count(12u64)), "12");
        assert_eq!(text(Cell::Duration(Duration::from_millis(1250))), "1.250s");
        assert_eq!(text(Cell::Percent(0.916)), "92%");
        assert_eq!(text(Cell::Empty), "");
    }

    #[test]
    fn figures_stay_exact_in_csv_and_json() {
        assert_eq!(Cell::bytes(4u64 << 20).to_csv(), "4194304");
        assert_eq!(Cell::signed_bytes(-2048i64).to_json(), serde_json::json!(-2048));
        assert_eq!(Cell::BytesIn { bytes: 10, count: 2 }.to_json(), serde_json::json!({"bytes": 10, "count": 2}));
        assert_eq!(Cell::Duration(Duration::from_millis(1500)).to_csv(), "1.5");
        assert_eq!(Cell::Empty.to_json(), serde_json::Value::Null);
        // Every u64 and i64 stays exact.
        assert_eq!(Cell::bytes(u64::MAX).to_json(), serde_json::json!(u64::MAX));
        assert_eq!(Cell::bytes(u64::MAX).to_csv(), u64::MAX.to_string());
        assert_eq!(Cell::signed_bytes(i64::MIN).to_json(), serde_json::json!(i64::MIN));
        assert_eq!(Cell::text("fc.weight").to_csv(), "fc.weight");
    }
}
