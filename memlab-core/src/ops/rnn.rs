//! A recurrent layer's call (`aten::lstm`, `aten::gru`), read from its
//! record: what CUDA's cuDNN RNN sizes its buffers by.

use crate::DType;

use super::{Op, OpRecord};

/// Which recurrent cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RnnMode {
    /// Four gates and a cell state.
    Lstm,
    /// Three gates.
    Gru,
}

impl RnnMode {
    /// The gates a layer computes.
    pub fn gates(self) -> u64 {
        match self {
            RnnMode::Lstm => 4,
            RnnMode::Gru => 3,
        }
    }
}

/// One call of `aten::lstm` or `aten::gru` on padded input (the `.input`
/// overload, which tch's `nn::lstm` and `nn::gru` call), as its record
/// gives it: its tensors' shapes and its bool, int and float arguments
/// (`has_biases, num_layers, dropout, train, bidirectional, batch_first`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RnnCall {
    /// LSTM or GRU.
    pub mode: RnnMode,
    /// Stacked layers.
    pub layers: u64,
    /// 2 where bidirectional.
    pub directions: u64,
    /// The input's features.
    pub input: u64,
    /// The hidden state's features.
    pub hidden: u64,
    /// Time steps.
    pub seq: u64,
    /// Sequences in the batch.
    pub batch: u64,
    /// Of the input, the states and the weights (one type for all).
    pub dtype: DType,
    /// Its bytes.
    pub element_size: u64,
    /// The input's first dimension is the batch.
    pub batch_first: bool,
    /// Training mode: cuDNN keeps a reserve space for the backward pass.
    pub train: bool,
    /// Each layer has its two biases.
    pub has_biases: bool,
}

impl RnnCall {
    /// The call `record` made, where it is one memlab can read: an LSTM
    /// without projections or a GRU, of floats, halves or bfloat16, with no
    /// dropout between layers while training (cuDNN's dropout keeps a state
    /// of its own), its shapes consistent. `None` otherwise: the op is then
    /// not modelled.
    pub fn of(record: &OpRecord) -> Option<RnnCall> {
        if !matches!(record.op, Op::Other) {
            return None;
        }
        let mode = match record.name.as_str() {
            "lstm" => RnnMode::Lstm,
            "gru" => RnnMode::Gru,
            _ => return None,
        };
        let s: Vec<f64> = record.scalars.iter().map(|s| s.0).collect();
        // The packed overload has five: it is not this one.
        let [has_biases, layers, dropout, train, bidirectional, batch_first] = s[..] else { return None };
        let flag = |v: f64| (v == 0.0 || v == 1.0).then_some(v == 1.0);
        let (has_biases, train, bidirectional, batch_first) =
            (flag(has_biases)?, flag(train)?, flag(bidirectional)?, flag(batch_first)?);
        if !(1.0..=64.0).contains(&layers) || layers.fract() != 0.0 || (train && dropout != 0.0 && layers > 1.0) {
            return None;
        }
        let (layers, directions) = (layers as u64, if bidirectional { 2 } else { 1 });
        let tensors = record.tensors.as_ref()?;
        let shape = |i: usize| -> Option<Vec<u64>> {
            let arg = tensors.first.get(i)?;
            arg.shape.as_ref()?.iter().map(|&d| u64::try_from(d).ok()).collect()
        };
        let dtype = tensors.first.first()?.dtype?;
        let element_size = match dtype {
            DType::Float => 4,
            DType::Half | DType::BFloat16 => 2,
            _ => return None,
        };
        let (x, h) = (shape(0)?, shape(1)?);
        let (&[a, b, input], &[stacked, batch, hidden]) = (&x[..], &h[..]) else { return None };
        let (seq, x_batch) = if batch_first { (b, a) } else { (a, b) };
        if x_batch != batch || stacked != layers * directions || [seq, batch, input, hidden].contains(&0) {
            return None;
        }
        // An LSTM's cell state is the hidden state's shape where it has no
        // projections.
        if mode == RnnMode::Lstm && shape(2)? != h {
            return None;
        }
        let states = if mode == RnnMode::Lstm { 2 } else { 1 };
        let call = RnnCall {
            mode,
            layers,
            directions,
            input,
            hidden,
            seq,
            batch,
            dtype,
            element_size,
            batch_first,
            train,
            has_biases,
        };
        // Every weight given, of the shapes these sizes make: the tensors'
        // bytes are the input's, the states' and the weights'.
        let given = tensors.count as u64;
        let per_layer = if has_biases { 4 } else { 2 };
        let expected = [seq * batch * input, states * stacked * batch * hidden]
            .iter()
            .sum::<u64>()
            .checked_mul(element_size)?
            .checked_add(call.weight_bytes())?;
        (given == 1 + states + layers * directions * per_layer && tensors.bytes == expected).then_some(call)
    }

    /// The weights' bytes in all (what cuDNN's flat weight buffer holds,
    /// and the flat gradient of it CUDA's backward pass makes).
    pub fn weight_bytes(&self) -> u64 {
        let gates = self.mode.gates() * self.hidden;
        let biases = if self.has_biases { 2 * gates } else { 0 };
        let mut elements = 0;
        for layer in 0..self.layers {
            let input = if layer == 0 { self.input } else { self.hidden * self.directions };
            elements += self.directions * (gates * input + gates * self.hidden + biases);
        }
        elements * self.element_size
    }

    /// The output's bytes (every step's hidden state, both directions').
    pub fn output_bytes(&self) -> u64 {
        self.seq * self.batch * self.hidden * self.directions * self.element_size
    }

    /// One final state's bytes (`hy`, and an LSTM's `cy`).
    pub fn state_bytes(&self) -> u64 {
        self.layers * self.directions * self.batch * self.hidden * self.element_size
    }

    /// The input's bytes (and its gradient's).
    pub fn input_bytes(&self) -> u64 {
        self.seq * self.batch * self.input * self.element_size
    }

    /// How many final states it returns: an LSTM two, a GRU one.
    pub fn states(&self) -> usize {
        match self.mode {
            RnnMode::Lstm => 2,
            RnnMode::Gru => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{Scalar, TensorArg, TensorArgs};

    /// `aten::lstm`'s record as the shim gives it for tch's `nn::lstm`: 256
    /// features in, 512 hidden, one layer, batch 32 first, 64 steps.
    fn lstm(scalars: &[f64], bytes_off: u64) -> OpRecord {
        let arg = |shape: &[i64]| TensorArg { dtype: Some(DType::Float), shape: Some(shape.to_vec()) };
        let weights = (2048 * 256 + 2048 * 512 + 2 * 2048) * 4;
        let bytes = (32 * 64 * 256 + 2 * 32 * 512) * 4 + weights + bytes_off;
        OpRecord {
            name: "lstm".into(),
            tensors: Some(TensorArgs {
                count: 7,
                bytes,
                first: vec![arg(&[32, 64, 256]), arg(&[1, 32, 512]), arg(&[1, 32, 512]), arg(&[2048, 256])],
            }),
            scalars: scalars.iter().map(|&v| Scalar(v)).collect(),
            ..OpRecord::new(0, 1, Op::Other)
        }
    }

    #[test]
    fn an_lstm_call_is_read_from_its_shapes_and_flags() {
        let call = RnnCall::of(&lstm(&[1.0, 1.0, 0.0, 1.0, 0.0, 1.0], 0)).expect("read");
        assert_eq!((call.seq, call.batch, call.input, call.hidden), (64, 32, 256, 512));
        assert_eq!((call.layers, call.directions, call.batch_first, call.train), (1, 1, true, true));
        // The H200 measured these (examples/cudnn_rnn_sizes.rs): the flat
        // weight gradient, the output, hy.
        assert_eq!(call.weight_bytes(), 6_307_840);
        assert_eq!(call.output_bytes(), 4_194_304);
        assert_eq!(call.state_bytes(), 65_536);
    }

    #[test]
    fn calls_memlab_cannot_read_whole_are_not_read() {
        // The packed overload (five flags), dropout between layers, shapes
        // that do not add up (a projection, weights of other sizes).
        assert_eq!(RnnCall::of(&lstm(&[1.0, 1.0, 0.0, 1.0, 0.0], 0)), None);
        assert_eq!(RnnCall::of(&lstm(&[1.0, 2.0, 0.5, 1.0, 0.0, 1.0], 0)), None);
        assert_eq!(RnnCall::of(&lstm(&[1.0, 1.0, 0.0, 1.0, 0.0, 1.0], 4)), None);
        let mut other = lstm(&[1.0, 1.0, 0.0, 1.0, 0.0, 1.0], 0);
        other.name = "rnn_tanh".into();
        assert_eq!(RnnCall::of(&other), None);
    }
}
