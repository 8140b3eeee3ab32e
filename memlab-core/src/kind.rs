//! What a named tensor is to its model: the one vocabulary every tool uses
//! (the storage report, the tracker, the snapshot's categories, the OOM
//! report's holders, the training monitor's files).

use std::fmt;

/// What a named tensor is to the model. JSON and CSV name a kind by
/// [`as_str`](TensorKind::as_str) (`optimizer_state`); text by its
/// `Display` (`optimizer state`). Memory no named tensor holds is
/// "unnamed" wherever memlab writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A trainable variable of a var store.
    Parameter,
    /// A variable of a var store that is not trained (running statistics,
    /// frozen tables): tch's non-trainable variables.
    Buffer,
    /// The gradient of a parameter.
    Gradient,
    /// A tensor of an optimizer's state (`fc.weight.exp_avg`).
    OptimizerState,
    /// A tensor added or registered by name.
    Tensor,
}

impl TensorKind {
    /// Every kind, in the order above.
    pub const ALL: [TensorKind; 5] = [
        TensorKind::Parameter,
        TensorKind::Buffer,
        TensorKind::Gradient,
        TensorKind::OptimizerState,
        TensorKind::Tensor,
    ];

    /// The kind as JSON and CSV name it (`optimizer_state`).
    pub fn as_str(self) -> &'static str {
        match self {
            TensorKind::Parameter => "parameter",
            TensorKind::Buffer => "buffer",
            TensorKind::Gradient => "gradient",
            TensorKind::OptimizerState => "optimizer_state",
            TensorKind::Tensor => "tensor",
        }
    }

    /// The kind `name` names, as [`as_str`](Self::as_str) writes it.
    pub fn from_name(name: &str) -> Option<TensorKind> {
        TensorKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// The kind as text names it (`optimizer state`).
impl fmt::Display for TensorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TensorKind::OptimizerState => "optimizer state",
            other => other.as_str(),
        })
    }
}

/// Memory no named tensor holds, as JSON, CSV and text name it.
pub const UNNAMED: &str = "unnamed";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_name_per_kind() {
        for kind in TensorKind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            assert_eq!(TensorKind::from_name(kind.as_str()), Some(kind));
            assert_eq!(kind.to_string().replace(' ', "_"), kind.as_str());
        }
    }
}
