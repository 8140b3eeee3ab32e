//! A call of `scaled_dot_product_attention`, or of the CPU's flash kernel
//! it runs (`_scaled_dot_product_flash_attention_for_cpu` and its backward
//! op), read from its record: what CUDA's memory-efficient attention (for
//! float32) and cuDNN's attention (for halves and bfloat16) size their
//! buffers by.

use crate::DType;

use super::{Op, OpRecord};

/// Which op of an attention the record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionOp {
    /// `scaled_dot_product_attention`, which picks the kernel.
    Dispatch,
    /// The CPU's flash kernel, forward.
    CpuForward,
    /// The CPU's flash kernel's backward op.
    CpuBackward,
}

/// An attention with no mask and no dropout, its query of
/// `[batch, heads, len, head_dim]` and its key and value of `kv_len` steps:
/// what libtorch 2.11 runs on an H100 or H200 as memory-efficient attention
/// (float32) or cuDNN's attention (halves and bfloat16, head sizes a
/// multiple of 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionCall {
    /// Which op.
    pub op: AttentionOp,
    /// The query's, key's and value's type: `Float`, `Half` or `BFloat16`.
    pub dtype: DType,
    /// Sequences in the batch.
    pub batch: u64,
    /// Heads.
    pub heads: u64,
    /// The query's steps.
    pub len: u64,
    /// The key's and value's steps.
    pub kv_len: u64,
    /// Each head's features, of the query and key.
    pub head_dim: u64,
    /// Each head's features, of the value (and the output).
    pub value_dim: u64,
}

impl AttentionCall {
    /// The call `record` made, where memlab models it: query, key and value
    /// of one type of four dimensions, the same batch and heads (no grouped
    /// heads), head sizes up to 256, no mask and no dropout; in halves and
    /// bfloat16, as measured: head sizes a multiple of 8, the value's the
    /// query's, the key as long as the query. `None` otherwise.
    pub fn of(record: &OpRecord) -> Option<AttentionCall> {
        if !matches!(record.op, Op::Other) {
            return None;
        }
        let (op, first, tensors_without_mask) = match record.name.as_str() {
            "scaled_dot_product_attention" => (AttentionOp::Dispatch, 0, 3..=3),
            "_scaled_dot_product_flash_attention_for_cpu" => (AttentionOp::CpuForward, 0, 3..=3),
            // grad_out, query, key, value, out, logsumexp, and the mask
            // autograd passes undefined (its forward pass, with a mask, is
            // not modelled: the prediction is then a range anyway).
            "_scaled_dot_product_flash_attention_for_cpu_backward" => (AttentionOp::CpuBackward, 1, 6..=7),
            _ => return None,
        };
        let tensors = record.tensors.as_ref()?;
        if !tensors_without_mask.contains(&tensors.count) {
            return None;
        }
        // The first float argument is the dropout's probability.
        if record.scalars.first().is_none_or(|s| s.0 != 0.0) {
            return None;
        }
        let dtype = tensors.first.get(first)?.dtype?;
        if !matches!(dtype, DType::Float | DType::Half | DType::BFloat16) {
            return None;
        }
        let shape = |i: usize| -> Option<[u64; 4]> {
            let arg = tensors.first.get(i)?;
            if arg.dtype? != dtype {
                return None;
            }
            let dims: Vec<u64> = arg.shape.as_ref()?.iter().map(|&d| u64::try_from(d).ok()).collect::<Option<_>>()?;
            dims.try_into().ok()
        };
        let (q, k, v) = (shape(first)?, shape(first + 1)?, shape(first + 2)?);
        let [batch, heads, len, head_dim] = q;
        if k[..2] != q[..2] || v[..2] != q[..2] || k[3] != head_dim || v[2] != k[2] {
            return None;
        }
        let call = AttentionCall { op, dtype, batch, heads, len, kv_len: k[2], head_dim, value_dim: v[3] };
        // cuDNN's was measured with the key as long as the query and the
        // value as wide: others stay ranges.
        let cudnn = call.cudnn();
        let measured = !cudnn || (head_dim.is_multiple_of(8) && call.value_dim == head_dim && call.kv_len == len);
        let sizes = head_dim <= 256 && call.value_dim <= 256 && measured;
        (sizes && [batch, heads, len, call.kv_len, head_dim].iter().all(|&d| d > 0)).then_some(call)
    }

    /// Whether CUDA runs it as cuDNN's attention (halves and bfloat16)
    /// rather than as memory-efficient attention (float32).
    pub fn cudnn(&self) -> bool {
        self.dtype != DType::Float
    }

    /// The bytes of one element.
    pub fn element_size(&self) -> u64 {
        if self.cudnn() {
            2
        } else {
            4
        }
    }

    /// The query's bytes (each of the gradients of query, key and value is
    /// its own tensor's).
    pub fn query_bytes(&self) -> u64 {
        self.batch * self.heads * self.len * self.head_dim * self.element_size()
    }

    /// The output's bytes.
    pub fn output_bytes(&self) -> u64 {
        self.batch * self.heads * self.len * self.value_dim * self.element_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{Scalar, TensorArg, TensorArgs};

    fn record(name: &str, dtype: DType, count: u32, dropout: f64) -> OpRecord {
        let arg = TensorArg { dtype: Some(dtype), shape: Some(vec![2, 4, 100, 64]) };
        OpRecord {
            name: name.into(),
            tensors: Some(TensorArgs { count, bytes: 0, first: vec![arg.clone(), arg.clone(), arg.clone(), arg] }),
            scalars: vec![Scalar(dropout), Scalar(1.0)],
            ..OpRecord::new(0, 1, Op::Other)
        }
    }

    #[test]
    fn float_attention_without_mask_or_dropout_is_read_and_no_other() {
        let forward = AttentionCall::of(&record("_scaled_dot_product_flash_attention_for_cpu", DType::Float, 3, 0.0));
        let call = forward.expect("read");
        assert_eq!((call.batch, call.heads, call.len, call.kv_len, call.head_dim), (2, 4, 100, 100, 64));
        assert_eq!(call.query_bytes(), 2 * 4 * 100 * 64 * 4);
        let backward = "_scaled_dot_product_flash_attention_for_cpu_backward";
        assert_eq!(
            AttentionCall::of(&record(backward, DType::Float, 7, 0.0)).map(|c| c.op),
            Some(AttentionOp::CpuBackward)
        );
        // bfloat16 and halves: cuDNN's.
        for dtype in [DType::BFloat16, DType::Half] {
            let call = AttentionCall::of(&record("scaled_dot_product_attention", dtype, 3, 0.0)).expect("read");
            assert!(call.cudnn() && call.query_bytes() == 2 * 4 * 100 * 64 * 2, "{call:?}");
        }
        // A mask, dropout, doubles: not modelled.
        for (dtype, count, dropout) in [(DType::Float, 4, 0.0), (DType::Float, 3, 0.1), (DType::Double, 3, 0.0)] {
            let r = record("scaled_dot_product_attention", dtype, count, dropout);
            assert_eq!(AttentionCall::of(&r), None, "{r:?}");
        }
    }
}
