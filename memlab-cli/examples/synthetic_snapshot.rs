//! Writes a synthetic memory snapshot in PyTorch's schema, as
//! `torch.cuda.memory._dump_snapshot` writes it (pickle protocol 4, every
//! dict, list and string memoized, frame dicts shared between stacks, items
//! appended and set in batches of 1,000), of about the size asked for (within
//! a few percent): the
//! input of the command-line tool's scale benchmarks.
//!
//!     cargo run --release -p memlab-cli --example synthetic_snapshot -- OUT.pickle [--size 1G] [--seed N] [--grow SITE] [--native]
//!
//! One CUDA device. A simulated caching allocator serves a training loop's
//! allocations from 2 MiB or rounded-up segments: every allocation is a
//! `segment_alloc` (when no free segment fits) and an `alloc`, every free a
//! `free_requested` and a `free_completed`, some followed by a
//! `segment_free`. Stacks are deep (24 to 64 Python frames, from a few
//! thousand distinct frames), so that frames dominate the file as they do in
//! real snapshots. The final segments agree with the trace. `--grow SITE`
//! makes the allocations of stack number SITE live three times as long, for
//! a second run that `diff` tells apart. `--native` gives each stack the
//! C++ frames PyTorch's default recording (`stacks="all"`) puts before the
//! Python ones: the recorder's, the caching allocator's, a run of libtorch's
//! dispatcher and kernels, CPython's interpreter down to `_start` (another
//! 20 to 40 frames).
//!
//! Small outputs pass `python -m torch.cuda._memory_viz stats` (the tests
//! check it).

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};

/// A pickle writer that memoizes as Python's does.
struct Pickle<W: Write> {
    out: W,
    memo: u32,
    strings: std::collections::HashMap<String, u32>,
    written: u64,
}

impl<W: Write> Pickle<W> {
    fn new(mut out: W) -> std::io::Result<Self> {
        out.write_all(&[0x80, 4])?;
        Ok(Pickle { out, memo: 0, strings: Default::default(), written: 2 })
    }

    fn raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.written += bytes.len() as u64;
        self.out.write_all(bytes)
    }

    fn memoize(&mut self) -> std::io::Result<u32> {
        self.raw(&[0x94])?;
        self.memo += 1;
        Ok(self.memo - 1)
    }

    fn get(&mut self, index: u32) -> std::io::Result<()> {
        match u8::try_from(index) {
            Ok(i) => self.raw(&[b'h', i]),
            Err(_) => {
                self.raw(b"j")?;
                self.raw(&index.to_le_bytes())
            }
        }
    }

    fn str(&mut self, s: &str) -> std::io::Result<()> {
        if let Some(&i) = self.strings.get(s) {
            return self.get(i);
        }
        match u8::try_from(s.len()) {
            Ok(n) => self.raw(&[0x8c, n])?,
            Err(_) => {
                self.raw(b"X")?;
                self.raw(&(s.len() as u32).to_le_bytes())?;
            }
        }
        self.raw(s.as_bytes())?;
        let i = self.memoize()?;
        self.strings.insert(s.to_string(), i);
        Ok(())
    }

    fn int(&mut self, v: u64) -> std::io::Result<()> {
        if v < 256 {
            self.raw(&[b'K', v as u8])
        } else if v < 65536 {
            self.raw(b"M")?;
            self.raw(&(v as u16).to_le_bytes())
        } else if v < 1 << 31 {
            self.raw(b"J")?;
            self.raw(&(v as u32).to_le_bytes())
        } else {
            let bytes = v.to_le_bytes();
            let mut n = 8;
            while n > 1 && bytes[n - 1] == 0 {
                n -= 1;
            }
            // A set top bit would read as negative: one more byte.
            let extra = bytes[n - 1] & 0x80 != 0;
            self.raw(&[0x8a, (n + usize::from(extra)) as u8])?;
            self.raw(&bytes[..n])?;
            if extra {
                self.raw(&[0])?;
            }
            Ok(())
        }
    }

    fn bool(&mut self, v: bool) -> std::io::Result<()> {
        self.raw(&[if v { 0x88 } else { 0x89 }])
    }

    /// A memoized empty dict, then its items (each writes its key and
    /// value) in batches of 1,000; returns its memo index.
    fn dict(
        &mut self,
        items: usize,
        mut item: impl FnMut(&mut Self, usize) -> std::io::Result<()>,
    ) -> std::io::Result<u32> {
        self.raw(b"}")?;
        let index = self.memoize()?;
        self.batches(items, b's', b'u', &mut item)?;
        Ok(index)
    }

    /// A memoized empty list, then its items in batches of 1,000.
    fn list(
        &mut self,
        items: usize,
        mut item: impl FnMut(&mut Self, usize) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        self.raw(b"]")?;
        self.memoize()?;
        self.batches(items, b'a', b'e', &mut item)
    }

    /// A key and an integer value.
    fn int_item(&mut self, key: &str, value: u64) -> std::io::Result<()> {
        self.str(key)?;
        self.int(value)
    }

    /// A key and a string value.
    fn str_item(&mut self, key: &str, value: &str) -> std::io::Result<()> {
        self.str(key)?;
        self.str(value)
    }

    fn batches(
        &mut self,
        items: usize,
        one: u8,
        many: u8,
        item: &mut impl FnMut(&mut Self, usize) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut i = 0;
        while i < items {
            let n = (items - i).min(1000);
            if n > 1 {
                self.raw(b"(")?;
            }
            for k in i..i + n {
                item(self, k)?;
            }
            self.raw(&[if n > 1 { many } else { one }])?;
            i += n;
        }
        Ok(())
    }
}

/// A small, fast, seeded generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone)]
struct Event {
    action: &'static str,
    addr: u64,
    size: u64,
    time_us: u64,
    stack: usize,
}

struct Segment {
    size: u64,
    /// The block in it, if allocated: (requested bytes, stack).
    block: Option<(u64, usize)>,
}

fn parse_size(text: &str) -> Option<u64> {
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = digits.parse().ok()?;
    Some(
        n * match unit {
            "" => 1,
            "K" | "k" => 1 << 10,
            "M" | "m" => 1 << 20,
            "G" | "g" => 1 << 30,
            _ => return None,
        },
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (mut out, mut target, mut seed, mut grow, mut native) = (None, 64u64 << 20, 1u64, None, false);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--size" => target = args.next().and_then(|s| parse_size(&s)).ok_or("--size takes a size: 200M, 1G")?,
            "--seed" => seed = args.next().and_then(|s| s.parse().ok()).ok_or("--seed takes a number")?,
            "--grow" => grow = Some(args.next().and_then(|s| s.parse().ok()).ok_or("--grow takes a stack number")?),
            "--native" => native = true,
            path if out.is_none() && !path.starts_with('-') => out = Some(path.to_string()),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let out = out.ok_or("give the file to write: synthetic_snapshot OUT.pickle [--size 1G]")?;
    let mut rng = Rng(seed);

    // Distinct frames, then stacks of them, innermost first: a few library
    // frames over the model's own.
    let files =
        ["torch/nn/modules/module.py", "torch/nn/functional.py", "torch/autograd/graph.py", "torch/optim/adam.py"];
    let mut frames: Vec<(String, String, u64)> = (0..3000)
        .map(|i| {
            let file = if i % 3 == 0 {
                format!("/opt/venv/lib/python3.12/site-packages/{}", files[i % files.len()])
            } else {
                format!("/home/user/project/model/layer_{}.py", i % 97)
            };
            (file, format!("function_{i}"), 10 + (i as u64 * 7) % 900)
        })
        .collect();
    let python = frames.len() as u64;
    // Native frames as `stacks="all"` records them (no file, line 0): the
    // recorder's and the allocator's, then ops through the dispatcher,
    // then the interpreter.
    let mut add_native = |names: Vec<String>| -> Vec<usize> {
        names
            .into_iter()
            .map(|name| {
                frames.push((String::from("??"), name, 0));
                frames.len() - 1
            })
            .collect()
    };
    let recorder = add_native(
        [
            "torch::unwind::unwind()",
            "torch::CapturedTraceback::gather(bool, bool, bool)",
            "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long)",
        ]
        .map(String::from)
        .to_vec(),
    );
    let ops = add_native(
        (0..300)
            .map(|i| match i % 3 {
                0 => format!("at::_ops::op_{i}::call(at::Tensor const&, at::Tensor const&)"),
                1 => format!("c10::impl::wrap_kernel_functor_unboxed_<op_{i}>::call(c10::OperatorKernel*)"),
                _ => format!("at::native::kernel_{i}(at::Tensor const&)"),
            })
            .collect(),
    );
    let interpreter = add_native(
        [
            "_PyEval_EvalFrameDefault",
            "_PyObject_MakeTpCall",
            "PyObject_Call",
            "Py_RunMain",
            "__libc_start_main",
            "_start",
        ]
        .map(String::from)
        .to_vec(),
    );
    let stacks: Vec<Vec<usize>> = (0..4096)
        .map(|_| {
            let mut stack = Vec::new();
            if native {
                stack.extend(&recorder);
                stack.extend((0..12 + rng.below(25)).map(|_| ops[rng.below(ops.len() as u64) as usize]));
                stack.extend(&interpreter);
            }
            let depth = 24 + rng.below(41) as usize;
            stack.extend((0..depth).map(|_| rng.below(python) as usize));
            stack
        })
        .collect();

    // The allocator, simulated until the events' share of the file reaches
    // the size asked for (about 60 bytes an event plus 3 to 5 a frame).
    let mut events: Vec<Event> = Vec::new();
    let mut segments: BTreeMap<u64, Segment> = BTreeMap::new();
    let mut live: Vec<u64> = Vec::new();
    let mut next_address: u64 = 0x7f00_0000_0000;
    let mut time_us: u64 = 1_795_000_000_000_000;
    let mut estimate: u64 = 0;
    let mut deaths: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    // Segments with no block, by size, for reuse.
    let mut free_segments: std::collections::HashMap<u64, Vec<u64>> = Default::default();
    let mut step: u64 = 0;
    while estimate < target {
        step += 1;
        time_us += 1 + rng.below(40);
        // Allocate: a size from 512 bytes to 64 MiB, mostly small.
        let size = 512u64 << rng.below(18).min(rng.below(18));
        let size = size - rng.below(size / 4) / 512 * 512;
        let stack = rng.below(stacks.len() as u64) as usize;
        let rounded = if size <= 1 << 20 { 2 << 20 } else { size.div_ceil(2 << 20) * (2 << 20) };
        let address = match free_segments.get_mut(&rounded).and_then(Vec::pop) {
            Some(a) => a,
            None => {
                let a = next_address;
                next_address += rounded;
                segments.insert(a, Segment { size: rounded, block: None });
                events.push(Event { action: "segment_alloc", addr: a, size: rounded, time_us, stack });
                estimate += 50 + 11 * stacks[stack].len() as u64 / 2;
                a
            }
        };
        segments.get_mut(&address).expect("a segment").block = Some((size, stack));
        events.push(Event { action: "alloc", addr: address, size, time_us, stack });
        estimate += 50 + 11 * stacks[stack].len() as u64 / 2;
        live.push(address);
        let life = 1 + rng.below(200) * if grow == Some(stack % 64) { 3 } else { 1 };
        deaths.entry(step + life).or_default().push(address);
        // Free what dies now.
        for address in deaths.remove(&step).unwrap_or_default() {
            let segment = segments.get_mut(&address).expect("a segment");
            let (size, stack) = segment.block.take().expect("a live block");
            let segment_size = segment.size;
            live.retain(|a| *a != address);
            for action in ["free_requested", "free_completed"] {
                events.push(Event { action, addr: address, size, time_us, stack });
                estimate += 50 + 11 * stacks[stack].len() as u64 / 2;
            }
            if rng.below(4) == 0 {
                let freed = segments.remove(&address).expect("a segment");
                events.push(Event { action: "segment_free", addr: address, size: freed.size, time_us, stack });
                estimate += 50 + 11 * stacks[stack].len() as u64 / 2;
            } else {
                free_segments.entry(segment_size).or_default().push(address);
            }
        }
    }

    let file = std::fs::File::create(&out)?;
    let mut p = Pickle::new(BufWriter::with_capacity(1 << 20, file))?;
    // Each frame dict is written once and fetched after, as PyTorch's
    // symbolizer shares them; each stack is a list of its own.
    let mut frame_memo: Vec<Option<u32>> = vec![None; frames.len()];
    let mut write_stack = |p: &mut Pickle<_>, stack: &[usize]| -> std::io::Result<()> {
        p.list(stack.len(), |p, k| {
            let f = stack[k];
            if let Some(i) = frame_memo[f] {
                return p.get(i);
            }
            let (file, name, line) = &frames[f];
            let index = p.dict(3, |p, j| match j {
                0 => p.str_item("name", name),
                1 => p.str_item("filename", file),
                _ => p.int_item("line", *line),
            })?;
            frame_memo[f] = Some(index);
            Ok(())
        })
    };
    let segment_list: Vec<(u64, &Segment)> = segments.iter().map(|(a, s)| (*a, s)).collect();
    p.dict(4, |p, key| match key {
        0 => {
            p.str("segments")?;
            p.list(segment_list.len(), |p, i| {
                let (address, s) = segment_list[i];
                let requested = s.block.map_or(0, |(r, _)| r);
                let rounded = requested.div_ceil(512) * 512;
                // (address, size, requested, state, stack) of its blocks.
                let mut blocks: Vec<(u64, u64, u64, &str, Option<usize>)> = Vec::new();
                match s.block {
                    Some((requested, stack)) => {
                        blocks.push((address, rounded, requested, "active_allocated", Some(stack)));
                        if rounded < s.size {
                            blocks.push((address + rounded, s.size - rounded, 0, "inactive", None));
                        }
                    }
                    None => blocks.push((address, s.size, 0, "inactive", None)),
                }
                p.dict(12, |p, k| match k {
                    0 => p.int_item("device", 0),
                    1 => p.int_item("address", address),
                    2 => p.int_item("total_size", s.size),
                    3 => p.int_item("allocated_size", rounded),
                    4 => p.int_item("active_size", rounded),
                    5 => p.int_item("requested_size", requested),
                    6 => p.int_item("stream", 0),
                    7 => p.str_item("segment_type", if s.size == 2 << 20 { "small" } else { "large" }),
                    8 => {
                        p.str("segment_pool_id")?;
                        p.int(0)?;
                        p.int(0)?;
                        p.raw(&[0x86])?; // TUPLE2
                        p.memoize().map(drop)
                    }
                    9 => {
                        p.str("is_expandable")?;
                        p.bool(false)
                    }
                    10 => {
                        p.str("frames")?;
                        p.list(0, |_, _| Ok(()))
                    }
                    _ => {
                        p.str("blocks")?;
                        p.list(blocks.len(), |p, b| {
                            let (address, size, requested, state, stack) = blocks[b];
                            p.dict(5, |p, k| match k {
                                0 => p.int_item("address", address),
                                1 => p.int_item("size", size),
                                2 => p.int_item("requested_size", requested),
                                3 => p.str_item("state", state),
                                _ => {
                                    p.str("frames")?;
                                    write_stack(p, stack.map_or(&[][..], |s| &stacks[s][..]))
                                }
                            })
                            .map(drop)
                        })
                    }
                })
                .map(drop)
            })
        }
        1 => {
            p.str("device_traces")?;
            p.list(1, |p, _| {
                p.list(events.len(), |p, i| {
                    let e = &events[i];
                    p.dict(8, |p, k| match k {
                        0 => p.str_item("action", e.action),
                        1 => p.int_item("addr", e.addr),
                        2 => p.int_item("size", e.size),
                        3 => p.int_item("stream", 0),
                        4 => p.int_item("time_us", e.time_us),
                        5 => p.str_item("compile_context", "N/A"),
                        6 => p.str_item("user_metadata", ""),
                        _ => {
                            p.str("frames")?;
                            write_stack(p, &stacks[e.stack])
                        }
                    })
                    .map(drop)
                })
            })
        }
        2 => {
            p.str("allocator_settings")?;
            p.dict(1, |p, _| {
                p.str("expandable_segments")?;
                p.bool(false)
            })
            .map(drop)
        }
        _ => {
            p.str("external_annotations")?;
            p.list(0, |_, _| Ok(()))
        }
    })?;
    p.raw(b".")?;
    p.out.flush()?;
    println!(
        "wrote {out}: {} bytes, {} events, {} segments, {} blocks live at the end",
        p.written,
        events.len(),
        segments.len(),
        live.len()
    );
    Ok(())
}
