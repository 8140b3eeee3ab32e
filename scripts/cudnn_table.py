#!/usr/bin/env python3
"""Writes memlab-core/src/replay/cudnn_h200.rs, the tables of cuDNN's
convolution workspaces measured by `cudnn_workspaces --grid` and
`--grid dense`, from their JSON lines:

    python3 scripts/cudnn_table.py fixtures/cudnn/convolution_h200.jsonl \
        fixtures/cudnn/convolution_dense_h200.jsonl > memlab-core/src/replay/cudnn_h200.rs

Each backward pass's first allocation, the contiguous copy of the loss's
broadcast gradient, is set aside; what is left is the pass's workspace, if
any (`kernels::tests` checks the tables against the files).
"""
import json
import sys

print("//! cuDNN's convolution workspaces on an H200 (libtorch 2.11.0+cu130,")
print("//! driver 580.159.04, 2026-11-29): `cudnn_workspaces --grid` and `--grid dense`,")
print("//! written by `scripts/cudnn_table.py` from `fixtures/cudnn/convolution_h200.jsonl`")
print("//! and `fixtures/cudnn/convolution_dense_h200.jsonl`.")
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


def table(path, name, doc):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    print()
    for line in doc:
        print(f"/// {line}")
    print("/// Batch, input and output channels, size, kernel, stride, padding,")
    print("/// output padding (-1: not transposed); the forward pass's workspace, the")
    print("/// input gradient's, the weight gradient's (0: none).")
    print("#[rustfmt::skip]")
    print(f"pub const {name}: &[Measured] = &[")
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


table(sys.argv[1], "H200_GRID", ["The common networks' shapes at batches 4 to 8,192 (powers of 2)."])
table(sys.argv[2], "H200_DENSE", [
    "The zoo's image models' shapes at every batch from 1 to 256: cuDNN's",
    "choice of algorithm, and with it the workspace, changes between the",
    "powers of 2 (the grid's rows of these shapes are the same here).",
])
