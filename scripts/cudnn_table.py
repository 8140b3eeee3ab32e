#!/usr/bin/env python3
"""Writes memlab-core/src/replay/cudnn_h200.rs, the table of cuDNN's
convolution workspaces measured by `cudnn_workspaces --grid`, from its JSON
lines:

    python3 scripts/cudnn_table.py fixtures/cudnn/convolution_h200.jsonl \
        > memlab-core/src/replay/cudnn_h200.rs

Each backward pass's first allocation, the contiguous copy of the loss's
broadcast gradient, is set aside; what is left is the pass's workspace, if
any (`kernels::tests` checks the table against the file).
"""
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print("//! cuDNN's convolution workspaces on an H200 (libtorch 2.11.0+cu130,")
print("//! driver 580.159.04, 2026-11-29): `cudnn_workspaces --grid`, written by")
print("//! `scripts/cudnn_table.py` from `fixtures/cudnn/convolution_h200.jsonl`.")
print()
print("use super::kernels::Measured;")
print()
print("#[allow(clippy::too_many_arguments)]")
print("#[rustfmt::skip]")
print("const fn m(")
for arg in ["n: i64", "c_in: i64", "c_out: i64", "h: i64", "k: i64", "stride: i64", "padding: i64",
            "output_padding: i64", "forward: u64", "input_grad: u64", "weight_grad: u64"]:
    print(f"    {arg},")
print(") -> Measured {")
print("    let transposed = output_padding >= 0;")
print("    let output_padding = if transposed { output_padding } else { 0 };")
print("    Measured { n, c_in, c_out, h, k, stride, padding, output_padding, transposed, forward, input_grad, weight_grad }")
print("}")
print()
print("/// Batch, input and output channels, size, kernel, stride, padding,")
print("/// output padding (-1: not transposed); the forward pass's workspace, the")
print("/// input gradient's, the weight gradient's (0: none).")
print("#[rustfmt::skip]")
print("pub const H200_GRID: &[Measured] = &[")
for r in rows:
    n, ci, co, h, k, s = r["n"], r["c_in"], r["c_out"], r["h"], r["k"], r["stride"]
    transposed = r.get("transposed", False)
    p = r.get("padding", k // 2)
    op = r.get("output_padding", 0)
    oh = (h - 1) * s - 2 * p + k + op if transposed else (h + 2 * p - k) // s + 1
    output = 4 * n * co * oh * oh

    def one(key):
        sizes = list(r[key])
        if key != "forward" and sizes and sizes[0] == output:
            sizes = sizes[1:]
        assert len(sizes) <= 1, r
        return sizes[0] if sizes else 0

    print(f"    m({n}, {ci}, {co}, {h}, {k}, {s}, {p}, {op if transposed else -1}, "
          f"{one('forward')}, {one('input_grad')}, {one('weight_grad')}),")
print("];")
