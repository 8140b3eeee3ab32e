//! A tensor's element type as memlab's reports name it: tch's `Kind`
//! names (`Float`, `BFloat16`), without depending on tch. The libtorch
//! backend turns libtorch's scalar types (and tch's `Kind`s) into these.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A tensor's element type. JSON, CSV and text write it as tch's `Kind`
/// names it (`Float`); a type memlab does not name is `Other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum DType {
    /// `uint8`.
    Uint8,
    /// `int8`.
    Int8,
    /// `int16`.
    Int16,
    /// `int32`.
    Int,
    /// `int64`.
    Int64,
    /// `float16`.
    Half,
    /// `float32`.
    Float,
    /// `float64`.
    Double,
    /// `complex32`.
    ComplexHalf,
    /// `complex64`.
    ComplexFloat,
    /// `complex128`.
    ComplexDouble,
    /// `bool`.
    Bool,
    /// Quantized `int8`.
    QInt8,
    /// Quantized `uint8`.
    QUInt8,
    /// Quantized `int32`.
    QInt32,
    /// `bfloat16`.
    BFloat16,
    /// Any other element type libtorch has (the float8 and unsigned types, …).
    Other,
}

impl DType {
    /// Every type memlab names, in the order of libtorch's scalar types
    /// (`c10::ScalarType`), whose codes 0 to 15 they are.
    pub const NAMED: [DType; 16] = [
        DType::Uint8,
        DType::Int8,
        DType::Int16,
        DType::Int,
        DType::Int64,
        DType::Half,
        DType::Float,
        DType::Double,
        DType::ComplexHalf,
        DType::ComplexFloat,
        DType::ComplexDouble,
        DType::Bool,
        DType::QInt8,
        DType::QUInt8,
        DType::QInt32,
        DType::BFloat16,
    ];

    /// The type of libtorch's scalar-type code `code` (`c10::ScalarType`).
    pub fn from_code(code: i32) -> DType {
        usize::try_from(code).ok().and_then(|i| DType::NAMED.get(i)).copied().unwrap_or(DType::Other)
    }

    /// Its name, as tch's `Kind` has it (`Float`).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::Uint8 => "Uint8",
            DType::Int8 => "Int8",
            DType::Int16 => "Int16",
            DType::Int => "Int",
            DType::Int64 => "Int64",
            DType::Half => "Half",
            DType::Float => "Float",
            DType::Double => "Double",
            DType::ComplexHalf => "ComplexHalf",
            DType::ComplexFloat => "ComplexFloat",
            DType::ComplexDouble => "ComplexDouble",
            DType::Bool => "Bool",
            DType::QInt8 => "QInt8",
            DType::QUInt8 => "QUInt8",
            DType::QInt32 => "QInt32",
            DType::BFloat16 => "BFloat16",
            DType::Other => "Other",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn written_as_tch_names_it_everywhere() {
        for (code, dtype) in DType::NAMED.iter().enumerate() {
            assert_eq!(DType::from_code(code as i32), *dtype);
            assert_eq!(serde_json::to_string(dtype).unwrap(), format!("\"{dtype}\""));
        }
        assert_eq!((DType::from_code(-1), DType::from_code(16)), (DType::Other, DType::Other));
        assert_eq!(serde_json::to_string(&DType::Other).unwrap(), "\"Other\"");
        assert_eq!(serde_json::from_str::<DType>("\"BFloat16\"").unwrap(), DType::BFloat16);
    }
}
