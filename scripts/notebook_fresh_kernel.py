"""The kernel scripts/notebook-kernel.sh registers, started as a user's
Jupyter starts it: from an environment without anything scripts/env.sh sets
(no torch on LD_LIBRARY_PATH, no LIBTORCH_USE_PYTORCH, a bare PATH). Its first
cells add tch and memlab and call memlab: they must build, load libtorch and
answer with the CPU allocator's figure, with no "dlopen failed". Prints how
long the first memlab cell took (it builds memlab and tch, unless the
kernel's kept build already holds them).

    python scripts/notebook_fresh_kernel.py KERNEL_NAME MEMLAB_ROOT [TCH_VERSION]
"""

import os
import sys
import time

from jupyter_client.manager import start_new_kernel


def main():
    name, root = sys.argv[1], sys.argv[2]
    tch = sys.argv[3] if len(sys.argv) > 3 else "0.24"
    keep = ("HOME", "USER", "LANG", "JUPYTER_PATH", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR")
    clean = {k: v for k, v in os.environ.items() if k in keep}
    clean["PATH"] = "/usr/bin:/bin"
    manager, client = start_new_kernel(kernel_name=name, env=clean, startup_timeout=120)
    failures = []
    try:
        cells = [
            ':dep tch = "%s"' % tch,
            ':dep memlab = { path = "%s" }' % root,
            "let kept = tch::Tensor::zeros([1 << 20], (tch::Kind::Float, tch::Device::Cpu));\n"
            "memlab::stats::device_stats(memlab::Device::Cpu).unwrap().allocated_bytes.all.current",
        ]
        for cell in cells:
            out = []

            def hook(msg):
                content = msg["content"]
                if msg["msg_type"] == "stream":
                    out.append(content["text"])
                elif msg["msg_type"] in ("execute_result", "display_data"):
                    out.append(content["data"].get("text/plain", ""))
                elif msg["msg_type"] == "error":
                    out.append("\n".join(content["traceback"]) or content["evalue"])

            start = time.time()
            reply = client.execute_interactive(cell, timeout=3600, output_hook=hook)
            took = time.time() - start
            text = "".join(out)
            print(f"cell {cell.splitlines()[0]!r}: {reply['content']['status']} in {took:.0f}s: {text.strip()[:300]}")
            if reply["content"]["status"] != "ok" or "dlopen failed" in text:
                failures.append(cell)
        value = text.strip().splitlines()[-1] if text.strip() else ""
        if not value.isdigit() or int(value) < 4 << 20:
            failures.append(f"the allocator's figure: {value!r} (4 MiB at least)")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    if failures:
        print("memlab: the fresh kernel failed:", failures)
        sys.exit(1)
    print("memlab: the registered kernel ran memlab from a bare environment")


if __name__ == "__main__":
    main()
