//! The staging buffers of libtorch's CUDA reductions: a sum or mean that
//! splits each output's inputs over several blocks stages their partial
//! results in a buffer (and counts the blocks in a semaphore array) that it
//! allocates through the caching allocator for the moment of the kernel.
//! Freed at once, the buffer stays cached: it is part of a step's reserved
//! peak, and a CPU run has nothing like it.
//!
//! [`staging`] follows libtorch 2.11's `Reduce.cuh` (`setReduceConfig`, the
//! config's `global_memory_size` and `semaphore_size`) after
//! `TensorIterator`'s reordering and coalescing of the dimensions, for a
//! contiguous output and a freshly allocated input. On an H100 it gives
//! exactly what the allocator recorded for a bias gradient's sum over the
//! batch of every shape measured (see the tests).

use crate::ops::Reduction;

/// What a reduction's configuration depends on, of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReductionDevice {
    /// Streaming multiprocessors (`multiProcessorCount`): 132 on an H100 SXM.
    pub sms: u32,
    /// Threads per multiprocessor (`maxThreadsPerMultiProcessor`): 2048.
    pub threads_per_sm: u32,
    /// Threads per warp: 32.
    pub warp: u32,
}

impl ReductionDevice {
    /// An H100 SXM (and an H200): 132 multiprocessors of 2048 threads.
    pub const H100: ReductionDevice = ReductionDevice { sms: 132, threads_per_sm: 2048, warp: 32 };
}

/// The staging buffer's and the semaphores' bytes a CUDA run of
/// `reduction` allocates (both 0 where it reduces within a block), or `None`
/// where the model does not follow it (more than 2^31 elements: libtorch
/// splits such a reduction).
pub fn staging(reduction: &Reduction, device: ReductionDevice) -> Option<(u64, u64)> {
    let element = i64::from(reduction.element_size.max(1));
    let accumulator = if element <= 4 { 4 } else { 8 };
    let input_vector = if element == 2 { 8 } else { 4 };
    let (shape, output, input) = iterator(reduction, element)?;
    let numel: i64 = shape.iter().product();
    if numel == 0 {
        return Some((0, 0));
    }
    let reduce_dims = output.iter().filter(|&&s| s == 0).count();
    let outputs: i64 = shape.iter().zip(&output).filter(|(_, &s)| s != 0).map(|(n, _)| n).product();
    let inputs_per_output = numel / outputs.max(1);
    let ndim = shape.len();
    // Whether the reduced dimension is the fastest-moving one.
    let reduction_fastest = reduce_dims == ndim || input[0] < input[reduce_dims];
    let (mut dim0, dim1, fastest) = if reduction_fastest {
        (inputs_per_output, outputs, input[0])
    } else {
        (outputs, inputs_per_output, input[reduce_dims])
    };
    let mut output_vector = 1;
    if fastest == element {
        if reduction_fastest && dim0 >= 128 && reduce_dims == 1 {
            dim0 /= input_vector;
        } else if !reduction_fastest {
            output_vector = output_vector_size(&shape, &input, reduce_dims, element);
            dim0 /= output_vector;
        }
    }
    // The block's shape.
    let max_threads = 512 / output_vector;
    let warp = i64::from(device.warp);
    let fit = |d: i64| if d < max_threads { last_pow2(d) } else { max_threads };
    let mut width = fit(dim0).min(warp);
    let height = fit(dim1).min(max_threads / width);
    width = fit(dim0).min(max_threads / height);
    // How inputs and outputs split over the block and the grid.
    let (mut step_input, mut step_output) = (1i64, 1i64);
    let block_x_reduces = reduction_fastest;
    if block_x_reduces {
        step_input *= width;
    } else {
        step_output *= width;
    }
    let values_per_thread = |step_input: i64| div_up(inputs_per_output, step_input);
    let split_over_warps = values_per_thread(step_input) >= (height * 16).min(256);
    if split_over_warps {
        step_input *= height;
    } else {
        step_output *= height;
    }
    let target = i64::from(device.sms) * (i64::from(device.threads_per_sm) / (width * height));
    let grid_x = div_up(outputs / output_vector, step_output);
    let per_thread = values_per_thread(step_input);
    if !(split_over_warps && per_thread >= 256 && grid_x <= target) {
        return Some((0, 0));
    }
    let ctas = div_up(target, grid_x).min(div_up(per_thread, 16)).max(div_up(per_thread, 256));
    if ctas <= 1 {
        return Some((0, 0));
    }
    let mut buffer = accumulator * outputs * ctas;
    if !block_x_reduces {
        buffer *= width * output_vector;
    }
    Some((u64::try_from(buffer).ok()?, u64::try_from(4 * grid_x).ok()?))
}

/// The reduction's iterator as libtorch builds it: the output's and input's
/// strides in bytes, dimensions ordered fastest first (reduced ones before
/// kept ones) and merged where they are contiguous. `None` past 32-bit
/// indexing.
fn iterator(reduction: &Reduction, element: i64) -> Option<(Vec<i64>, Vec<i64>, Vec<i64>)> {
    let n = reduction.shape.len();
    if n == 0 || reduction.strides.len() != n || n > 64 {
        return None;
    }
    let reduced = |d: usize| reduction.reduced & (1 << d) != 0;
    // The output: contiguous over the kept dimensions, stride 0 on the reduced.
    let mut output = vec![0i64; n];
    let mut size = 1;
    for d in (0..n).rev() {
        if !reduced(d) {
            output[d] = size * element;
            size *= reduction.shape[d];
        }
    }
    let input: Vec<i64> = reduction.strides.iter().map(|s| s * element).collect();
    let shape = &reduction.shape;
    // Reordering: fastest first, by insertion as TensorIterator sorts.
    let mut perm: Vec<usize> = (0..n).rev().collect();
    let should_swap = |d0: usize, d1: usize| -> i32 {
        for (arg, strides) in [&output, &input].into_iter().enumerate() {
            let (s0, s1) = (strides[d0], strides[d1]);
            if arg == 0 && (s0 == 0) != (s1 == 0) {
                return if s1 == 0 { 1 } else { -1 };
            }
            if s0 == 0 || s1 == 0 {
                continue;
            }
            if s0 != s1 {
                return if s0 < s1 { -1 } else { 1 };
            }
            if shape[d0] > shape[d1] {
                return 1;
            }
        }
        0
    };
    for i in 1..n {
        let mut dim1 = i;
        for dim0 in (0..i).rev() {
            match should_swap(perm[dim0], perm[dim1]) {
                c if c > 0 => {
                    perm.swap(dim0, dim1);
                    dim1 = dim0;
                }
                c if c < 0 => break,
                _ => {}
            }
        }
    }
    let mut shape: Vec<i64> = perm.iter().map(|&p| reduction.shape[p]).collect();
    let mut strides: [Vec<i64>; 2] =
        [perm.iter().map(|&p| output[p]).collect(), perm.iter().map(|&p| input[p]).collect()];
    // Coalescing contiguous neighbours.
    let mut prev = 0;
    for d in 1..n {
        let merge = shape[prev] == 1 || shape[d] == 1 || strides.iter().all(|s| shape[prev] * s[prev] == s[d]);
        if merge {
            if shape[prev] == 1 {
                for s in &mut strides {
                    s[prev] = s[d];
                }
            }
            shape[prev] *= shape[d];
        } else {
            prev += 1;
            if prev != d {
                for s in &mut strides {
                    s[prev] = s[d];
                }
                shape[prev] = shape[d];
            }
        }
    }
    shape.truncate(prev + 1);
    let [mut output, mut input] = strides;
    output.truncate(prev + 1);
    input.truncate(prev + 1);
    // 32-bit indexing only.
    let limit = i64::from(i32::MAX);
    let numel = shape.iter().try_fold(1i64, |a, &b| a.checked_mul(b))?;
    let extent = |s: &[i64]| shape.iter().zip(s).map(|(n, s)| (n - 1).max(0) * s.abs()).sum::<i64>();
    (numel <= limit && extent(&output) <= limit && extent(&input) <= limit).then_some((shape, output, input))
}

/// How many outputs a thread writes at once: 4, halved until it divides the
/// data's alignment (a fresh block's 512 bytes), the output dimension and
/// every input stride but the reduced one's.
fn output_vector_size(shape: &[i64], input: &[i64], reduce_dims: usize, element: i64) -> i64 {
    let mut vector = 4;
    let mut fit = |n: i64| {
        while vector > 1 && n % vector != 0 {
            vector /= 2;
        }
    };
    fit(512 / element);
    fit(shape[reduce_dims]);
    for (j, s) in input.iter().enumerate() {
        if j != reduce_dims {
            fit(s / element);
        }
    }
    vector
}

fn div_up(a: i64, b: i64) -> i64 {
    (a + b - 1) / b.max(1)
}

/// The largest power of two at most `n` (at least 1).
fn last_pow2(n: i64) -> i64 {
    if n <= 1 {
        1
    } else {
        1 << (63 - n.leading_zeros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: i64, c: i64) -> Reduction {
        Reduction { shape: vec![n, c], strides: vec![c, 1], element_size: 4, reduced: 1 }
    }

    /// What the H100's allocator recorded for `grad.sum(0)` of a float
    /// [N, C] gradient (a bias's, in the MLP and transformer of
    /// examples/fit_models.rs): buffer and semaphores, in bytes.
    #[test]
    fn the_staging_of_a_bias_gradient_is_what_the_h100_allocated() {
        for (n, c, buffer, semaphores) in [
            (1024, 4096, 33_554_432, 128),
            (4096, 4096, 134_217_728, 128),
            (4096, 1536, 50_331_648, 48),
            (4096, 2048, 67_108_864, 64),
            (4096, 512, 16_777_216, 16),
            (4096, 8192, 138_412_032, 256),
        ] {
            assert_eq!(staging(&rows(n, c), ReductionDevice::H100), Some((buffer, semaphores)), "[{n}, {c}].sum(0)");
        }
    }

    /// Fewer rows than the kernel splits over blocks, sums along a row, and a
    /// 3-d input reduced over its first two dimensions (a Linear on a
    /// sequence) as the 2-d one it collapses to.
    #[test]
    fn small_and_row_reductions_stage_nothing_and_leading_dimensions_merge() {
        assert_eq!(staging(&rows(1000, 4096), ReductionDevice::H100), Some((0, 0)));
        let along_rows = Reduction { reduced: 2, ..rows(4096, 4096) };
        assert_eq!(staging(&along_rows, ReductionDevice::H100), Some((0, 0)));
        let sequence =
            Reduction { shape: vec![8, 512, 4096], strides: vec![512 * 4096, 4096, 1], element_size: 4, reduced: 0b11 };
        assert_eq!(staging(&sequence, ReductionDevice::H100), staging(&rows(4096, 4096), ReductionDevice::H100));
        let huge = rows(1 << 20, 1 << 12);
        assert_eq!(staging(&huge, ReductionDevice::H100), None, "past 32-bit indexing");
    }
}
