//! What CUDA's memory-efficient attention allocates (libtorch 2.11,
//! `_efficient_attention_forward` and `_efficient_attention_backward`), which
//! `scaled_dot_product_attention` runs for float32 tensors without a mask or
//! dropout, where the CPU ran its own flash kernel.
//!
//! Measured on an H200 with `examples/attention_sizes.rs` (36 float32 shapes:
//! batches of 1 to 33, 1 to 16 heads, 16 to 2,048 steps, head sizes of 32 to
//! 256, causal or not; `fixtures/cudnn/attention_h200.jsonl`), exact in each:
//!
//! - forward: the output and a logsumexp of `B·H·⌈L/32⌉·32` floats, where the
//!   CPU's has `B·H·L`;
//! - backward: the three gradients, then a temporary of the query's size, two
//!   of `B·H·L` floats (the first freed at once), and a workspace of
//!   `B·H·L'·D'` floats and `B·H·L'·max(1, D'/128) / 4` bytes, with `L'` the
//!   steps rounded up to 64 and `D'` the head size to 64, 128 or 256.
//!
//! And what cuDNN's attention allocates (`_cudnn_attention_forward` and
//! `_cudnn_attention_backward`), which it runs for halves and bfloat16
//! (36 shapes of each, exact in each):
//!
//! - forward: a seed and an offset of 8 bytes each, kept for the backward
//!   pass, the output and a logsumexp of `B·H·L` floats (as the CPU's), and
//!   256 bytes freed at once;
//! - backward: the three gradients, then a temporary of twice the output,
//!   the logsumexp and 256 bytes, freed at once.

use crate::ops::attention::AttentionCall;

/// The logsumexp the forward pass keeps for the backward pass, in bytes.
pub fn logsumexp(call: &AttentionCall) -> u64 {
    call.batch * call.heads * call.len.div_ceil(32) * 32 * 4
}

/// The CPU kernel's logsumexp, in bytes.
pub fn cpu_logsumexp(call: &AttentionCall) -> u64 {
    call.batch * call.heads * call.len * 4
}

/// One of the backward pass's two row sums, in bytes.
pub fn delta(call: &AttentionCall) -> u64 {
    call.batch * call.heads * call.len * 4
}

/// The backward pass's workspace, in bytes.
pub fn workspace(call: &AttentionCall) -> u64 {
    let steps = call.len.div_ceil(64) * 64;
    let dim = match call.head_dim {
        0..=64 => 64,
        65..=128 => 128,
        _ => 256,
    };
    let rows = call.batch * call.heads * steps;
    rows * dim * 4 + rows * (dim / 128).max(1) / 4
}

/// cuDNN's backward pass's temporary, in bytes.
pub fn cudnn_backward_temporary(call: &AttentionCall) -> u64 {
    2 * call.output_bytes() + cpu_logsumexp(call) + 256
}

/// The seed's bytes, and the offset's.
pub const CUDNN_SEED: u64 = 8;
/// The forward pass's temporary, in bytes.
pub const CUDNN_FORWARD_TEMPORARY: u64 = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::AttentionOp;

    /// Every shape the H200 measured: the forward pass's logsumexp and the
    /// backward pass's allocations after the gradients (float32); every
    /// allocation of cuDNN's passes (halves and bfloat16).
    #[test]
    fn the_sizes_are_the_measured_ones_for_every_shape() {
        let path = format!("{}/../fixtures/cudnn/attention_h200.jsonl", env!("CARGO_MANIFEST_DIR"));
        let mut checked = 0;
        for line in std::fs::read_to_string(path).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let u = |k: &str| v[k].as_u64().unwrap();
            let dtype = match v["dtype"].as_str().unwrap() {
                "f32" => crate::DType::Float,
                "f16" => crate::DType::Half,
                _ => crate::DType::BFloat16,
            };
            let call = AttentionCall {
                op: AttentionOp::CpuForward,
                dtype,
                batch: u("batch"),
                heads: u("heads"),
                len: u("len"),
                kv_len: u("len"),
                head_dim: u("head_dim"),
                value_dim: u("head_dim"),
            };
            let allocations = |op: &str| -> Vec<u64> {
                let o = v["ops"].as_array().unwrap().iter().find(|o| o["op"] == op).unwrap();
                o["allocations"].as_array().unwrap().iter().map(|a| a[0].as_u64().unwrap()).collect()
            };
            let q = call.query_bytes();
            if call.cudnn() {
                let (o, lse) = (call.output_bytes(), cpu_logsumexp(&call));
                let forward = [CUDNN_SEED, CUDNN_SEED, o, lse, CUDNN_FORWARD_TEMPORARY];
                assert_eq!(allocations("_cudnn_attention_forward"), forward, "{line}");
                let backward = [q, q, q, cudnn_backward_temporary(&call)];
                assert_eq!(allocations("_cudnn_attention_backward"), backward, "{line}");
                checked += 1;
                continue;
            }
            assert_eq!(allocations("_efficient_attention_forward"), [q, logsumexp(&call)], "{line}");
            // The sweep's gradient arrives expanded (a sum's): the kernel
            // copies it first, which a gradient in its layout does not need.
            let backward = allocations("_efficient_attention_backward");
            let expected: Vec<u64> = if call.heads == 1 {
                // One row sum: the second comes where the first was freed.
                vec![q, q, q, q, q, delta(&call), workspace(&call)]
            } else {
                vec![q, q, q, q, q, delta(&call), delta(&call), workspace(&call)]
            };
            assert_eq!(backward, expected, "{line}");
            checked += 1;
        }
        assert_eq!(checked, 108);
    }
}
