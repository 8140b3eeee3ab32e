"""The step of benches/recording.rs in PyTorch: a 4-layer 256-wide MLP,
batch 64, forward + backward + SGD step, timed plain and under
torch.cuda.memory._record_memory_history (stacks "python" and "all"), the
history PyTorch's memory_viz reads. Prints a Markdown table like the Rust
benchmark's, so the two can be compared in the same run on the same GPU.

    python3 scripts/bench_recording_pytorch.py [ROUNDS]
"""

import sys
import time

import torch

WIDTH, LAYERS, BATCH, STEPS = 256, 4, 64, 50


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    if not torch.cuda.is_available():
        print("no CUDA device: PyTorch records memory history on CUDA only")
        return
    dev = torch.device("cuda", 0)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, 10 if i + 1 == LAYERS else WIDTH))
        if i + 1 < LAYERS:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH, device=dev)
    y = torch.randint(10, (BATCH,), device=dev)

    def block():
        start = time.perf_counter()
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / STEPS * 1e6

    modes = [("plain", None), ("_record_memory_history, python stacks", "python"),
             ("_record_memory_history, all stacks", "all")]

    def run(stacks):
        if stacks is not None:
            torch.cuda.memory._record_memory_history(max_entries=100000, stacks=stacks)
        t = block()
        if stacks is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
        return t

    for _, stacks in modes:
        run(stacks)
    times = [[] for _ in modes]
    for r in range(rounds):
        for k in range(len(modes)):
            m = (r + k) % len(modes)
            times[m].append(run(modes[m][1]))
    median = lambda v: sorted(v)[len(v) // 2]
    med = [median(t) for t in times]
    # Each round's block against the same round's plain block: the step's
    # drift over the run cancels out.
    paired = [median([a / b for a, b in zip(t, times[0])]) for t in times]
    print(f"PyTorch {torch.__version__}, {LAYERS}-layer {WIDTH}-wide MLP, batch {BATCH}, "
          f"forward + backward + SGD step; {rounds} rounds of {STEPS} steps per mode\n")
    print("| device | mode | step (median) | × plain | × plain, paired by round |")
    print("|---|---|---:|---:|---:|")
    for (label, _), t, p in zip(modes, med, paired):
        print(f"| cuda:0 | {label} | {t:.1f} µs | {t / med[0]:.3f} | {p:.3f} |")


if __name__ == "__main__":
    main()
