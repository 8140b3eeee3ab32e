"""What CUDA's embedding backward allocates, in order, at 60 shapes.

Run on the GPU host (torch 2.11.0+cu130) to remake the fixture that
`memlab_core::replay::embedding_backward_temporaries` is checked against:

    python3 scripts/embedding_backward_h100.py > fixtures/fit/embedding_backward_h100.jsonl

Each line: the op's shape as memlab's `EmbeddingBackward` names it, and
`events`, every allocation (+bytes) and free (-bytes) PyTorch's recorder saw
while `aten::embedding_dense_backward` ran, the table's gradient included.
"""
import json

import torch

FLOATS = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}


def measure(n, width, rows, dtype=torch.float32, index=torch.int64, freq=False, narrowed=False):
    torch.cuda.empty_cache()
    if narrowed:
        # A language model's inputs: tokens narrowed from a longer sequence.
        batch = max(1, n // 256)
        tokens = torch.randint(rows, (batch, n // batch + 1), device="cuda", dtype=index)
        indices = tokens[:, : n // batch]
        grad = torch.randn(batch, n // batch, width, device="cuda").to(dtype)
    else:
        indices = torch.randint(rows, (n,), device="cuda", dtype=index)
        grad = torch.randn(n, width, device="cuda").to(dtype)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    gradient = torch.ops.aten.embedding_dense_backward(grad, indices, rows, -1, freq)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [
        ("+" if e["action"] == "alloc" else "-") + str(e["size"])
        for e in snapshot["device_traces"][0]
        if e["action"] in ("alloc", "free_requested")
    ]
    row = {
        "indices": indices.numel(),
        "index_size": indices.element_size(),
        "rows": rows,
        "width": width,
        "element_size": FLOATS[dtype],
        "scale_grad_by_freq": freq,
        "indices_contiguous": indices.is_contiguous(),
        "grad_contiguous": grad.is_contiguous(),
        "events": " ".join(events),
    }
    print(json.dumps(row), flush=True)
    del gradient


def main():
    torch.cuda.init()
    # The transformer's tokens, narrowed, at several batches and shapes.
    for n in [3072, 3328, 4096, 8192, 13312, 13568, 16384, 32768, 65536, 262144]:
        measure(n, 512, 8192, narrowed=True)
    for width in [64, 100, 768, 1024]:
        measure(13568, width, 8192, narrowed=True)
    measure(13568, 512, 50257, narrowed=True)
    measure(13568, 512, 8192)
    measure(13568, 512, 8192, dtype=torch.float16, narrowed=True)
    measure(13568, 512, 8192, dtype=torch.bfloat16, narrowed=True)
    measure(13568, 512, 8192, index=torch.int32, narrowed=True)
    measure(13568, 512, 8192, freq=True, narrowed=True)
    measure(2048, 512, 8192, narrowed=True)
    measure(2048, 512, 8192, freq=True, narrowed=True)
    # Both index types across CUB's tiles, odd counts, counts per index,
    # wide tables, doubles, few rows.
    for index in [torch.int32, torch.int64]:
        for n in [3073, 3100, 4095, 4607, 4608, 4609, 9216, 9217, 13567, 13571, 20000, 100003, 1000000, 4000000]:
            measure(n, 128, 8192, index=index)
        for n in [5000, 13568]:
            measure(n, 64, 8192, index=index, freq=True)
        measure(13568, 100, 300000, index=index)
        measure(13568, 64, 8192, dtype=torch.float64, index=index)
        measure(50000, 64, 1000, index=index)


if __name__ == "__main__":
    main()
