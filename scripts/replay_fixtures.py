"""Makes the allocator-replay fixtures on a CUDA machine: small training
loops (an MLP, a conv net, a transformer over varying sequence lengths),
pytorch#123548's allocation pattern, a fragmentation out-of-memory error
under a memory fraction, a side stream with record_stream and empty_cache,
garbage collection under a fraction, roundup_power2_divisions, a program
that catches its out-of-memory errors and goes on, and a fragmentation
failure at the scale of the device, each run in a process of its own under each
allocator setting (libtorch reads PYTORCH_CUDA_ALLOC_CONF when CUDA starts).
Each run is recorded from its first CUDA allocation by PyTorch's own
recorder (torch.cuda.memory._record_memory_history, no stacks, max_entries
large enough for the whole run) and leaves

    OUT/<workload>__<setting>.pickle   the snapshot (pytorch.org/memory_viz opens it)
    OUT/results.jsonl                  one line per run: the allocator's own figures

    python3 scripts/replay_fixtures.py OUT [WORKLOAD ...]
"""

import json
import os
import subprocess
import sys

MIB = 1 << 20
SETTINGS = {
    "default": "",
    "expandable": "expandable_segments:True",
    "mss128": "max_split_size_mb:128",
}
WORKLOADS = {
    "mlp": SETTINGS,
    "conv": SETTINGS,
    "transformer": SETTINGS,
    "pattern123548": dict(SETTINGS, both="expandable_segments:True,max_split_size_mb:128"),
    "fragmentation": dict(SETTINGS, gc="garbage_collection_threshold:0.6"),
    "streams": SETTINGS,
    "gc": {"default": "", "gc": "garbage_collection_threshold:0.5", "expandable": "expandable_segments:True"},
    "divisions": {"default": "", "div4": "roundup_power2_divisions:4",
                  "divlist": "roundup_power2_divisions:[64:2,256:4,>:8]"},
    "caught": {"default": "", "expandable": "expandable_segments:True"},
    # At the device's scale (its recordings are a few MB: only the figures
    # of its runs are kept, in fixtures/oom/).
    "frag93": SETTINGS,
}
# The fragmentation run's memory fraction: 1.5 GiB of the device.
FRACTION_BYTES = 3 * (1 << 29)


def mlp(torch, dev):
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(4):
        x = torch.randn(256, 1024, device=dev)
        y = torch.randint(10, (256,), device=dev)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def conv(torch, dev):
    torch.backends.cudnn.benchmark = False
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 128, 3, padding=1),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(128 * 32 * 32, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(3):
        x = torch.randn(64, 3, 64, 64, device=dev)
        y = torch.randint(10, (64,), device=dev)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def transformer(torch, dev):
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for seq in [64, 200, 128, 333, 96]:
        x = torch.randn(16, seq, 256, device=dev)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def pattern123548(torch, dev):
    kept = []
    for _ in range(30):
        a = torch.empty(91 * MIB, dtype=torch.uint8, device=dev)
        b = torch.empty(91 * MIB // 2, dtype=torch.uint8, device=dev)
        kept.append(torch.empty(2 * MIB, dtype=torch.uint8, device=dev))
        del a, b


def fragmentation(torch, dev):
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(FRACTION_BYTES / total)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    del big
    pieces = [torch.empty(10 * MIB, dtype=torch.uint8, device=dev) for _ in range(100)]
    del pieces[::2]
    # 500 MiB live, 500 MiB free in 10 MiB pieces: 600 MiB in one piece.
    torch.empty(600 * MIB, dtype=torch.uint8, device=dev)


def streams(torch, dev):
    """A side stream: blocks allocated on it, and main-stream blocks used on
    it (record_stream), whose frees wait for it; empty_cache now and then."""
    side = torch.cuda.Stream()
    kept = []
    for i in range(24):
        x = torch.ones(3 * MIB + i * 65536, dtype=torch.uint8, device=dev)
        with torch.cuda.stream(side):
            y = torch.empty(5 * MIB, dtype=torch.uint8, device=dev)
            y[: x.numel()].copy_(x)
            x.record_stream(side)
        del x
        if i % 3 == 0:
            kept.append(y)
        del y
        z = torch.empty(700 * 1024, dtype=torch.uint8, device=dev)
        del z
        if i % 8 == 7:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def gc(torch, dev):
    """Varying large blocks under a 1 GiB fraction, so that garbage
    collection (where set) gives segments back."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((1 << 30) / total)
    kept = []
    for i in range(40):
        size = (30 + (i * 37) % 170) * MIB
        t = torch.empty(size, dtype=torch.uint8, device=dev)
        if i % 7 == 0:
            kept.append(torch.empty(12 * MIB, dtype=torch.uint8, device=dev))
        del t


def divisions(torch, dev):
    """Sizes between powers of two, where roundup_power2_divisions rounds."""
    kept = []
    for i in range(60):
        size = 300 * 1024 + i * 3 * MIB + (i * 7919) % 100000
        t = torch.empty(size, dtype=torch.uint8, device=dev)
        if i % 4 == 0:
            kept.append(t)
        del t


def caught(torch, dev):
    """A program that catches an out-of-memory error and goes on: under a
    3 GiB memory fraction, 8 MiB blocks until the allocator fails; the
    error caught, every other block freed, then 256 MiB asked (which fails
    too, caught again)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(3 * (1 << 30) / total)
    blocks = []
    try:
        while True:
            blocks.append(torch.empty(8 * MIB, dtype=torch.uint8, device=dev))
    except torch.OutOfMemoryError:
        pass
    del blocks[::2]
    try:
        torch.empty(256 * MIB, dtype=torch.uint8, device=dev)
    except torch.OutOfMemoryError:
        pass


def frag93(torch, dev):
    """8 MiB blocks until 93% of the device is in use, every other freed,
    then 40 GiB asked: free memory in pieces under every setting."""
    total = torch.cuda.get_device_properties(0).total_memory
    blocks = []
    while torch.cuda.mem_get_info()[0] > total * 7 // 100:
        blocks.append(torch.empty(8 * MIB, dtype=torch.uint8, device=dev))
    del blocks[::2]
    torch.empty(40 << 30, dtype=torch.uint8, device=dev)


def run_one(workload, setting, out):
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
    oom = None
    try:
        globals()[workload](torch, dev)
    except torch.OutOfMemoryError as e:
        oom = str(e).split("\n")[0]
    torch.cuda.synchronize()
    path = os.path.join(out, f"{workload}__{setting}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    stats = torch.cuda.memory_stats()
    props = torch.cuda.get_device_properties(0)
    row = {
        "workload": workload,
        "setting": setting,
        "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "device": props.name,
        "total_memory": props.total_memory,
        "fraction": torch.cuda.get_per_process_memory_fraction(0) if hasattr(torch.cuda, "get_per_process_memory_fraction") else None,
        "peak_reserved": stats["reserved_bytes.all.peak"],
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "reserved_end": stats["reserved_bytes.all.current"],
        "num_ooms": stats["num_ooms"],
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_device_alloc": stats["num_device_alloc"],
        "num_device_free": stats["num_device_free"],
        "oom": oom,
        "snapshot_bytes": os.path.getsize(path),
    }
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def main():
    if len(sys.argv) >= 5 and sys.argv[1] == "--one":
        run_one(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    chosen = sys.argv[2:] or list(WORKLOADS)
    for workload in chosen:
        for setting, conf in WORKLOADS[workload].items():
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            done = subprocess.run([sys.executable, __file__, "--one", workload, setting, out], env=env)
            print(workload, setting, "rc", done.returncode, flush=True)


if __name__ == "__main__":
    main()
