//! Reading a memory snapshot back: memlab's pickles and PyTorch's own
//! (`torch.cuda.memory._dump_snapshot`), protocols 2 to 5, into the same
//! [`Snapshot`] model the writer writes.
//!
//! Keys the model has no place for are counted, not refused: PyTorch adds
//! keys between versions (`allocator_settings`, `external_annotations`,
//! `compile_context`, `user_metadata`, …). A file without `segments` or
//! `device_traces` is not a snapshot and is refused, as is any pickle that
//! builds objects (see [`unpickle`](super::unpickle)).
//!
//! So are figures no allocator can hold ([`check_figures`]): a device's
//! bytes, added over its final segments and its whole history, past
//! `i64::MAX` (libtorch's statistics are 64-bit signed), or a block that
//! runs past the end of the address space. Every analysis of a file read
//! here can then add its figures without overflow.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use super::snapshot::{
    AllocatorSettings, Block, BlockState, Category, Segment, SegmentType, Snapshot, SnapshotFrame, SnapshotInfo, Stack,
};
use super::unpickle::{self, Dict, Fault, List, Shaper, Strings, Value};
use super::TraceEntry;
use crate::events::Action;
use crate::hash::FastMap;
use crate::{Error, Result};

/// A snapshot read from a file, with what the reader left out.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SnapshotFile {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// The pickle's protocol (2 to 5).
    pub protocol: u8,
    /// Keys the model has no place for, by where they occur
    /// (`device_traces[][].compile_context`), with how often: read past.
    pub ignored: BTreeMap<String, u64>,
}

impl SnapshotFile {
    /// `snapshot` as the file memlab writes of it would read back: pickle
    /// protocol [`PICKLE_PROTOCOL`](super::PICKLE_PROTOCOL), nothing read
    /// past. A live capture's report is built from this, as `memlab view`'s
    /// is from the file.
    pub fn of(snapshot: Snapshot) -> SnapshotFile {
        SnapshotFile { snapshot, protocol: super::pickle::PROTOCOL, ignored: BTreeMap::new() }
    }
}

impl Snapshot {
    /// Reads a snapshot pickle: memlab's, or one PyTorch's
    /// `torch.cuda.memory._dump_snapshot` wrote. Files of gigabytes are read
    /// through a buffer, twice, never whole into memory. A gzipped one
    /// (`FILE.pickle.gz`) is read as it is, decompressed into memory.
    pub fn read_pickle(path: impl AsRef<Path>) -> Result<SnapshotFile> {
        let path = path.as_ref();
        let unreadable = |why: String| Error::UnreadableSnapshot { file: path.display().to_string(), why };
        let meta = std::fs::metadata(path).map_err(|e| unreadable(io_why(&e)))?;
        if meta.is_dir() {
            return Err(unreadable("it is a directory; give a snapshot's file (a .pickle)".into()));
        }
        let mut file = File::open(path).map_err(|e| unreadable(io_why(&e)))?;
        let mut magic = [0u8; 2];
        let gzipped = file.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
        file.seek(std::io::SeekFrom::Start(0)).map_err(|e| unreadable(io_why(&e)))?;
        if gzipped {
            let mut bytes = Vec::new();
            flate2::read::MultiGzDecoder::new(std::io::BufReader::new(file))
                .read_to_end(&mut bytes)
                .map_err(|e| unreadable(format!("it is gzipped but does not decompress: {e}")))?;
            return read(std::io::Cursor::new(bytes)).map_err(unreadable);
        }
        read(file).map_err(unreadable)
    }

    /// Reads a snapshot pickle from memory (see [`read_pickle`](Self::read_pickle)).
    pub fn from_pickle(bytes: &[u8]) -> Result<SnapshotFile> {
        read(std::io::Cursor::new(bytes)).map_err(|why| Error::UnreadableSnapshot { file: "the pickle".into(), why })
    }
}

fn io_why(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

/// The keys the reader knows, interned before reading so that the shaper
/// compares ids, not text.
struct Keys {
    action: u32,
    addr: u32,
    size: u32,
    stream: u32,
    time_us: u32,
    frames: u32,
    category: u32,
    tensor: u32,
    device_free: u32,
    filename: u32,
    line: u32,
    name: u32,
}

impl Keys {
    fn new(strings: &mut Strings) -> Keys {
        let mut k = |s| strings.intern(s);
        Keys {
            action: k("action"),
            addr: k("addr"),
            size: k("size"),
            stream: k("stream"),
            time_us: k("time_us"),
            frames: k("frames"),
            category: k("category"),
            tensor: k("tensor"),
            device_free: k("device_free"),
            filename: k("filename"),
            line: k("line"),
            name: k("name"),
        }
    }
}

/// Builds the trace entries and the stacks as the pickle is read.
struct Builder {
    keys: Keys,
    /// Trace entries by [`Value::Shaped`] index; `None` for an action the
    /// model does not know (PyTorch's `snapshot`, say), which is counted.
    entries: Vec<Option<TraceEntry>>,
    stacks: Stacks,
    empty: Stack,
    ignored: BTreeMap<String, u64>,
    /// Ignored keys and actions of trace entries, by id: counted without
    /// their text, named at the end.
    ignored_entry_keys: FastMap<u32, u64>,
    ignored_actions: FastMap<u32, u64>,
    /// How many more values the file may give as plain data (see `read`).
    plain_left: usize,
}

impl Builder {
    /// Sets `items` in `entry`; false when its action is not one the model knows.
    fn apply(
        &mut self,
        strings: &Strings,
        entry: &mut TraceEntry,
        items: Vec<(Value, Value)>,
    ) -> std::result::Result<bool, String> {
        let k = &self.keys;
        let mut known = true;
        for (key, value) in items {
            let Some(key) = key.as_str() else { return Err("a trace entry has a key that is not a string".into()) };
            let number = |what: &str| {
                value.as_u64().ok_or_else(|| format!("a trace entry's `{what}` is {}, not a count", value.kind()))
            };
            if key == k.action {
                let name = value.as_str().ok_or("a trace entry's `action` is not a string")?;
                match Action::from_name(strings.text(name)) {
                    Some(action) => entry.action = action,
                    None => {
                        *self.ignored_actions.entry(name).or_default() += 1;
                        known = false;
                    }
                }
            } else if key == k.addr {
                entry.addr = Some(number("addr")?);
            } else if key == k.size {
                entry.size = number("size")?;
            } else if key == k.stream {
                entry.stream = number("stream")?;
            } else if key == k.time_us {
                entry.time_us = number("time_us")?;
            } else if key == k.device_free {
                entry.device_free = Some(number("device_free")?);
            } else if key == k.frames {
                entry.frames = self.stacks.of(strings, k, &value)?;
            } else if key == k.category {
                // PyTorch's profiler may leave it None.
                entry.category = value.as_str().and_then(|c| Category::from_name(strings.text(c)));
            } else if key == k.tensor {
                let name = value.as_str().ok_or("a trace entry's `tensor` is not a string")?;
                entry.tensor = Some(strings.text(name).into());
            } else {
                *self.ignored_entry_keys.entry(key).or_default() += 1;
            }
        }
        Ok(known)
    }
}

impl Shaper for Builder {
    fn shape(
        &mut self,
        strings: &Strings,
        items: &mut Vec<(Value, Value)>,
    ) -> std::result::Result<Option<Value>, String> {
        // A trace entry: a dict with `action` and `size` (a segment has no action).
        let has = |key| items.iter().any(|(k, _)| k.as_str() == Some(key));
        if !(has(self.keys.action) && has(self.keys.size)) {
            return Ok(None);
        }
        let mut entry = TraceEntry {
            action: Action::Alloc,
            addr: None,
            size: 0,
            stream: 0,
            time_us: 0,
            frames: self.empty.clone(),
            category: None,
            tensor: None,
            device_free: None,
        };
        let known = self.apply(strings, &mut entry, std::mem::take(items))?;
        self.entries.push(known.then_some(entry));
        Ok(Some(Value::Shaped((self.entries.len() - 1) as u32)))
    }

    fn extend(
        &mut self,
        strings: &Strings,
        shaped: u32,
        items: Vec<(Value, Value)>,
    ) -> std::result::Result<(), String> {
        let Some(mut entry) = self.entries[shaped as usize].take() else { return Ok(()) };
        let known = self.apply(strings, &mut entry, items)?;
        self.entries[shaped as usize] = known.then_some(entry);
        Ok(())
    }
}

/// Stacks, each distinct one built once: by the list's identity when the
/// pickle shares the list (memlab's files), else by its frames.
#[derive(Default)]
struct Stacks {
    /// Frames by (file, line, function) ids.
    frame_ids: FastMap<(u32, u32, u32), u32>,
    frames: Vec<(u32, u32, u32)>,
    by_frames: FastMap<Box<[u32]>, Stack>,
    /// Shared lists, kept alive here so that their address names them.
    by_list: FastMap<usize, (List, Stack)>,
    /// Shared frame dicts likewise.
    by_dict: FastMap<usize, (Dict, u32)>,
    scratch: Vec<u32>,
}

impl Stacks {
    fn of(&mut self, strings: &Strings, k: &Keys, value: &Value) -> std::result::Result<Stack, String> {
        let list = match value {
            Value::List(list) => list,
            Value::Tuple(items) => return self.build(strings, k, items),
            Value::None => return Ok(Arc::from(Vec::new())),
            other => return Err(format!("`frames` is {}, not a list", other.kind())),
        };
        let shared = Rc::strong_count(list) > 1;
        if shared {
            if let Some((_, stack)) = self.by_list.get(&(Rc::as_ptr(list) as usize)) {
                return Ok(stack.clone());
            }
        }
        let stack = self.build(strings, k, &list.borrow())?;
        if shared {
            self.by_list.insert(Rc::as_ptr(list) as usize, (list.clone(), stack.clone()));
        }
        Ok(stack)
    }

    fn build(&mut self, strings: &Strings, k: &Keys, items: &[Value]) -> std::result::Result<Stack, String> {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        for item in items {
            ids.push(self.frame(k, item)?);
        }
        let stack = match self.by_frames.get(ids.as_slice()) {
            Some(stack) => stack.clone(),
            None => {
                let stack: Stack = ids
                    .iter()
                    .map(|&id| {
                        let (file, line, name) = self.frames[id as usize];
                        SnapshotFrame { filename: strings.text(file).into(), line, name: strings.text(name).into() }
                    })
                    .collect::<Vec<_>>()
                    .into();
                self.by_frames.insert(ids.as_slice().into(), stack.clone());
                stack
            }
        };
        self.scratch = ids;
        Ok(stack)
    }

    fn frame(&mut self, k: &Keys, item: &Value) -> std::result::Result<u32, String> {
        let Value::Dict(dict) = item else { return Err(format!("a frame is {}, not a dict", item.kind())) };
        let shared = Rc::strong_count(dict) > 1;
        if shared {
            if let Some((_, id)) = self.by_dict.get(&(Rc::as_ptr(dict) as usize)) {
                return Ok(*id);
            }
        }
        let (mut file, mut line, mut name) = (None, 0u32, None);
        for (key, value) in dict.borrow().iter() {
            match key.as_str() {
                Some(key) if key == k.filename => file = value.as_str(),
                Some(key) if key == k.name => name = value.as_str(),
                Some(key) if key == k.line => line = value.as_u64().and_then(|l| u32::try_from(l).ok()).unwrap_or(0),
                _ => {}
            }
        }
        let (Some(file), Some(name)) = (file, name) else {
            return Err("a frame without `filename` or `name`".into());
        };
        let next = self.frames.len() as u32;
        let id = *self.frame_ids.entry((file, line, name)).or_insert(next);
        if id == next {
            self.frames.push((file, line, name));
        }
        if shared {
            self.by_dict.insert(Rc::as_ptr(dict) as usize, (dict.clone(), id));
        }
        Ok(id)
    }
}

fn read<R: Read + Seek>(mut source: R) -> std::result::Result<SnapshotFile, String> {
    // Each value a pickle holds takes at least a byte of it, unless it is
    // shared (a memo fetch): plain data made into JSON may hold no more
    // values than the file has bytes, and one list shared twice over at
    // every level would hold 2^levels.
    let bytes = source.seek(std::io::SeekFrom::End(0)).map_err(|e| e.to_string())?;
    source.seek(std::io::SeekFrom::Start(0)).map_err(|e| e.to_string())?;
    let mut strings = Strings::default();
    let keys = Keys::new(&mut strings);
    let mut builder = Builder {
        keys,
        entries: Vec::new(),
        stacks: Stacks::default(),
        empty: Arc::from(Vec::new()),
        ignored: BTreeMap::new(),
        ignored_entry_keys: FastMap::default(),
        ignored_actions: FastMap::default(),
        plain_left: usize::try_from(bytes).unwrap_or(usize::MAX).saturating_add(1024),
    };
    let pickle = unpickle::read(source, strings, &mut builder).map_err(|f: Fault| f.to_string())?;
    let strings = pickle.strings;
    let Value::Dict(top) = &pickle.value else {
        return Err(format!(
            "not a memory snapshot: the pickle holds {}, not the dict of `segments` and `device_traces` that \
             torch.cuda.memory._dump_snapshot writes",
            pickle.value.kind()
        ));
    };
    let top = std::mem::take(&mut *top.borrow_mut());
    let mut segments = None;
    let mut traces = None;
    let mut memlab = None;
    let mut allocator_settings = None;
    for (key, value) in top {
        let Some(key) = key.as_str().map(|k| strings.text(k)) else { continue };
        match key {
            "segments" => segments = Some(value),
            "device_traces" => traces = Some(value),
            "memlab" => memlab = Some(value),
            "allocator_settings" => {
                let value = to_json(&strings, &value, &mut builder.plain_left)
                    .map_err(|e| format!("its `allocator_settings` are not plain data: {e}"))?;
                allocator_settings = Some(
                    AllocatorSettings::from_json(value)
                        .ok_or_else(|| "its `allocator_settings` are not a dict".to_string())?,
                )
            }
            other => *builder.ignored.entry(other.to_string()).or_default() += 1,
        }
    }
    let (Some(segments), Some(traces)) = (segments, traces) else {
        return Err(
            "not a memory snapshot: the pickle's dict has no `segments` or no `device_traces` (a snapshot from \
             torch.cuda.memory._dump_snapshot or memlab has both)"
                .into(),
        );
    };
    let segments = read_segments(&strings, &mut builder, &segments)?;
    let device_traces = read_traces(&strings, &mut builder, &traces)?;
    let memlab = memlab.map(|m| read_info(&strings, &mut builder, &m)).transpose()?;
    let mut ignored = builder.ignored;
    for (key, count) in builder.ignored_entry_keys {
        *ignored.entry(format!("device_traces[][].{}", strings.text(key))).or_default() += count;
    }
    for (action, count) in builder.ignored_actions {
        *ignored.entry(format!("device_traces[][].action={}", strings.text(action))).or_default() += count;
    }
    let snapshot = Snapshot { segments, device_traces, allocator_settings, memlab };
    check_figures(&snapshot)?;
    Ok(SnapshotFile { snapshot, protocol: pickle.protocol, ignored })
}

/// Refuses a snapshot whose figures no allocator can hold, naming the first
/// segment or history entry that passes the limit. Per device, the bytes of
/// its final segments and their blocks and of every history entry but an
/// `oom` (a request, which may ask for any number) are added up: every sum
/// an analysis makes of them (allocated or reserved at any moment, what
/// was held before the history) is at most that total, which must stay
/// within `i64::MAX`, as libtorch's own statistics do. A segment, block or
/// entry whose address and size run past the address space is refused too.
pub fn check_figures(snapshot: &Snapshot) -> std::result::Result<(), String> {
    const LIMIT: u64 = i64::MAX as u64;
    let names = snapshot.devices();
    let name = |device: usize| names.get(device).cloned().unwrap_or_else(|| format!("device {device}"));
    let past = |what: String| {
        format!(
            "{what} takes the device's bytes past 2^63 - 1 (8.00E), more than any allocator holds or libtorch's \
             statistics can count: the file is damaged or was not written by an allocator"
        )
    };
    let ends = |what: &dyn Fn() -> String, address: u64, size: u64| {
        address
            .checked_add(size)
            .map(|_| ())
            .ok_or_else(|| format!("{} runs past the end of the address space ({address:#x} + {size} bytes)", what()))
    };
    let mut totals: BTreeMap<usize, u64> = BTreeMap::new();
    for (i, segment) in snapshot.segments.iter().enumerate() {
        let what = || format!("segment {i} ({} at {:#x})", name(segment.device), segment.address);
        ends(&what, segment.address, segment.total_size)?;
        let total = totals.entry(segment.device).or_default();
        let sizes =
            std::iter::once(segment.total_size).chain(segment.blocks.iter().flat_map(|b| [b.size, b.requested_size]));
        for size in sizes {
            *total = total.checked_add(size).filter(|&t| t <= LIMIT).ok_or_else(|| past(what()))?;
        }
        for (j, block) in segment.blocks.iter().enumerate() {
            ends(&|| format!("block {j} of {}", what()), block.address, block.size)?;
        }
    }
    for (device, trace) in snapshot.device_traces.iter().enumerate() {
        let mut total = totals.get(&device).copied().unwrap_or(0);
        for (i, e) in trace.iter().enumerate().filter(|(_, e)| e.action != Action::Oom) {
            let what = || format!("{}'s history entry {i} ({} of {} bytes)", name(device), e.action.as_str(), e.size);
            total = total.checked_add(e.size).filter(|&t| t <= LIMIT).ok_or_else(|| past(what()))?;
            if let Some(address) = e.addr {
                ends(&what, address, e.size)?;
            }
        }
    }
    Ok(())
}

/// The items of a dict value, keys as text.
fn items<'v>(strings: &'v Strings, value: &Value, what: &str) -> std::result::Result<Vec<(&'v str, Value)>, String> {
    let Value::Dict(dict) = value else { return Err(format!("{what} is {}, not a dict", value.kind())) };
    Ok(dict.borrow().iter().filter_map(|(k, v)| Some((strings.text(k.as_str()?), v.clone()))).collect())
}

fn list_of(value: &Value, what: &str) -> std::result::Result<Vec<Value>, String> {
    match value {
        Value::List(list) => Ok(list.borrow().clone()),
        Value::Tuple(items) => Ok(items.to_vec()),
        other => Err(format!("{what} is {}, not a list", other.kind())),
    }
}

fn count(value: &Value, what: &str) -> std::result::Result<u64, String> {
    value.as_u64().ok_or_else(|| format!("{what} is {}, not a count", value.kind()))
}

fn text<'s>(strings: &'s Strings, value: &Value, what: &str) -> std::result::Result<&'s str, String> {
    value.as_str().map(|s| strings.text(s)).ok_or_else(|| format!("{what} is {}, not a string", value.kind()))
}

/// Counts one more value read out of the file against what it may give
/// (see `read`): a segment, a block or a trace entry the pickle shares is
/// read again at every reference.
fn spend(b: &mut Builder) -> std::result::Result<(), String> {
    b.plain_left = b
        .plain_left
        .checked_sub(1)
        .ok_or("it holds more segments, blocks and events than the file has bytes (a list it shares over and over)")?;
    Ok(())
}

fn read_segments(strings: &Strings, b: &mut Builder, value: &Value) -> std::result::Result<Vec<Segment>, String> {
    let mut segments = Vec::new();
    for segment in list_of(value, "`segments`")? {
        spend(b)?;
        let mut s = Segment {
            device: 0,
            address: 0,
            total_size: 0,
            stream: 0,
            segment_type: SegmentType::Large,
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            is_expandable: false,
            blocks: Vec::new(),
        };
        let (mut allocated, mut active, mut requested, mut blocks) = (None, None, None, None);
        for (key, value) in items(strings, &segment, "a segment")? {
            let what = || format!("a segment's `{key}`");
            match key {
                "device" => s.device = count(&value, &what())? as usize,
                "address" => s.address = count(&value, &what())?,
                "total_size" => s.total_size = count(&value, &what())?,
                "stream" => s.stream = count(&value, &what())?,
                "allocated_size" => allocated = Some(count(&value, &what())?),
                "active_size" => active = Some(count(&value, &what())?),
                "requested_size" => requested = Some(count(&value, &what())?),
                "is_expandable" => s.is_expandable = matches!(value, Value::Bool(true)),
                "segment_type" => {
                    let name = text(strings, &value, &what())?;
                    s.segment_type = SegmentType::from_name(name)
                        .ok_or_else(|| format!("a segment's type is `{name}`, not `small` or `large`"))?;
                }
                "blocks" => blocks = Some(value),
                other => *b.ignored.entry(format!("segments[].{other}")).or_default() += 1,
            }
        }
        let blocks = blocks.ok_or("a segment without `blocks`")?;
        // Blocks of older PyTorch versions have no address: they follow
        // each other from the segment's.
        let mut next = s.address;
        for block in list_of(&blocks, "a segment's `blocks`")? {
            spend(b)?;
            let mut address = None;
            let (mut size, mut block_requested, mut state, mut frames) = (None, None, None, None);
            for (key, value) in items(strings, &block, "a block")? {
                let what = || format!("a block's `{key}`");
                match key {
                    "address" => address = Some(count(&value, &what())?),
                    "size" => size = Some(count(&value, &what())?),
                    "requested_size" => block_requested = Some(count(&value, &what())?),
                    "state" => {
                        let name = text(strings, &value, &what())?;
                        state =
                            Some(BlockState::from_name(name).ok_or_else(|| format!("a block's state is `{name}`"))?);
                    }
                    "frames" => frames = Some(b.stacks.of(strings, &b.keys, &value)?),
                    other => *b.ignored.entry(format!("segments[].blocks[].{other}")).or_default() += 1,
                }
            }
            let size = size.ok_or("a block without `size`")?;
            let state = state.ok_or("a block without `state`")?;
            let address = address.unwrap_or(next);
            next = address + size;
            let requested = block_requested.unwrap_or(if state == BlockState::Inactive { 0 } else { size });
            s.blocks.push(Block {
                address,
                size,
                requested_size: requested,
                state,
                frames: frames.unwrap_or_else(|| Arc::from(Vec::new())),
            });
        }
        // Older snapshots leave out the sums; they follow from the blocks.
        let sum = |f: &dyn Fn(&Block) -> u64| s.blocks.iter().map(f).sum::<u64>();
        s.allocated_size = allocated
            .unwrap_or_else(|| sum(&|bl: &Block| if bl.state == BlockState::ActiveAllocated { bl.size } else { 0 }));
        s.active_size =
            active.unwrap_or_else(|| sum(&|bl: &Block| if bl.state == BlockState::Inactive { 0 } else { bl.size }));
        s.requested_size = requested.unwrap_or_else(|| sum(&|bl: &Block| bl.requested_size));
        segments.push(s);
    }
    Ok(segments)
}

fn read_traces(strings: &Strings, b: &mut Builder, value: &Value) -> std::result::Result<Vec<Vec<TraceEntry>>, String> {
    let mut traces = Vec::new();
    for trace in list_of(value, "`device_traces`")? {
        let Value::List(list) = &trace else {
            return Err(format!("a device's trace is {}, not a list", trace.kind()));
        };
        let list = std::mem::take(&mut *list.borrow_mut());
        let mut entries = Vec::with_capacity(list.len());
        for item in list {
            spend(b)?;
            let index = match &item {
                Value::Shaped(index) => *index,
                // A dict the pickle shares was not shaped as it was read.
                Value::Dict(dict) => match b.shape(strings, &mut dict.borrow().clone())? {
                    Some(Value::Shaped(index)) => index,
                    _ => return Err("a trace entry without `action` or `size`".into()),
                },
                other => return Err(format!("a trace entry is {}, not a dict", other.kind())),
            };
            // Entries of unknown actions were counted and are left out.
            if let Some(entry) = b.entries[index as usize].take() {
                entries.push(entry);
            }
        }
        traces.push(entries);
    }
    Ok(traces)
}

fn read_info(strings: &Strings, b: &mut Builder, value: &Value) -> std::result::Result<SnapshotInfo, String> {
    let mut info = SnapshotInfo::default();
    for (key, value) in items(strings, value, "`memlab`")? {
        match key {
            "devices" => {
                info.devices = list_of(&value, "`memlab.devices`")?
                    .iter()
                    .map(|d| text(strings, d, "a device").map(String::from))
                    .collect::<std::result::Result<_, _>>()?;
            }
            "partial" => info.partial = matches!(value, Value::Bool(true)),
            "dropped" => info.dropped = count(&value, "`memlab.dropped`")?,
            "recorded" => info.recorded = count(&value, "`memlab.recorded`")?,
            "run" => {
                let json = to_json(strings, &value, &mut b.plain_left)
                    .map_err(|e| format!("`memlab.run` is not plain data: {e}"))?;
                info.run = Some(serde_json::from_value(json).map_err(|e| format!("`memlab.run` is not a run: {e}"))?);
            }
            "device_memory" => {
                let json = to_json(strings, &value, &mut b.plain_left)
                    .map_err(|e| format!("`memlab.device_memory` is not plain data: {e}"))?;
                info.device_memory = serde_json::from_value(json)
                    .map_err(|e| format!("`memlab.device_memory` is not a list of devices' memory: {e}"))?;
            }
            "unseen_before" => {
                let json = to_json(strings, &value, &mut b.plain_left)
                    .map_err(|e| format!("`memlab.unseen_before` is not plain data: {e}"))?;
                info.unseen_before = serde_json::from_value(json)
                    .map_err(|e| format!("`memlab.unseen_before` is not a list of devices' bytes: {e}"))?;
            }
            "ops" => {
                let json = to_json(strings, &value, &mut b.plain_left)
                    .map_err(|e| format!("`memlab.ops` is not plain data: {e}"))?;
                info.ops =
                    Some(serde_json::from_value(json).map_err(|e| format!("`memlab.ops` is not a list of ops: {e}"))?);
            }
            "prediction_inputs" => {
                let json = to_json(strings, &value, &mut b.plain_left)
                    .map_err(|e| format!("`memlab.prediction_inputs` is not plain data: {e}"))?;
                info.prediction_inputs = Some(
                    serde_json::from_value(json)
                        .map_err(|e| format!("`memlab.prediction_inputs` is not a prediction's inputs: {e}"))?,
                );
            }
            "profile" => {
                let json = to_json(strings, &value, &mut b.plain_left)
                    .map_err(|e| format!("`memlab.profile` is not plain data: {e}"))?;
                info.profile = Some(
                    serde_json::from_value(json).map_err(|e| format!("`memlab.profile` is not a line profile: {e}"))?,
                );
            }
            other => *b.ignored.entry(format!("memlab.{other}")).or_default() += 1,
        }
    }
    Ok(info)
}

/// How deep plain data may nest (serde_json refuses JSON nested 128
/// deep). A list the pickle puts inside itself nests without end.
const MAX_NESTING: usize = 127;

/// A plain value (`None`, bools, numbers, strings, lists, dicts with string
/// keys) as JSON.
/// `left`: how many more values the file may give (see `read`).
fn to_json(strings: &Strings, value: &Value, left: &mut usize) -> std::result::Result<serde_json::Value, String> {
    nested_to_json(strings, value, 0, left)
}

fn nested_to_json(
    strings: &Strings,
    value: &Value,
    depth: usize,
    left: &mut usize,
) -> std::result::Result<serde_json::Value, String> {
    use serde_json::Value as J;
    if depth >= MAX_NESTING && matches!(value, Value::List(_) | Value::Tuple(_) | Value::Dict(_)) {
        return Err(format!("it nests deeper than {MAX_NESTING} lists and dicts (or holds itself)"));
    }
    *left =
        left.checked_sub(1).ok_or("it holds more values than the file has bytes (a list it shares over and over)")?;
    Ok(match value {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::UInt(u) => J::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::Str(s) => J::String(strings.text(*s).to_string()),
        Value::List(_) | Value::Tuple(_) => J::Array(
            list_of(value, "a list")?
                .iter()
                .map(|v| nested_to_json(strings, v, depth + 1, left))
                .collect::<std::result::Result<_, String>>()?,
        ),
        Value::Dict(_) => J::Object(
            items(strings, value, "a dict")?
                .into_iter()
                .map(|(k, v)| Ok((k.to_string(), nested_to_json(strings, &v, depth + 1, left)?)))
                .collect::<std::result::Result<_, String>>()?,
        ),
        other => return Err(format!("it holds {}, which plain data has not", other.kind())),
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::render::Render;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(name)
    }

    #[test]
    fn pytorch_snapshots_read_with_their_extra_keys_counted() {
        let file = Snapshot::read_pickle(fixture("leaky.pickle")).unwrap();
        let s = &file.snapshot;
        assert_eq!(file.protocol, 4);
        assert!(s.memlab.is_none());
        assert_eq!((s.segments.len(), s.device_traces.len()), (15, 1));
        let trace = &s.device_traces[0];
        assert_eq!(trace.len(), 487);
        let count = |a: Action| trace.iter().filter(|e| e.action == a).count();
        assert_eq!(
            [Action::Alloc, Action::FreeRequested, Action::FreeCompleted, Action::SegmentAlloc].map(count),
            [184, 146, 146, 11]
        );
        assert_eq!(file.ignored.get("device_traces[][].compile_context"), Some(&487));
        assert_eq!(file.ignored.get("segments[].segment_pool_id"), Some(&15));
        let settings =
            file.snapshot.allocator_settings.as_ref().expect("PyTorch 2.5 and later write the allocator's settings");
        assert!(settings.expandable_segments.is_some() && settings.other.is_empty(), "{settings:?}");
        let first = &trace[0];
        assert_eq!((first.addr, first.size, first.time_us), (Some(139883191910912), 524288, 1795489044207495));
        assert_eq!(first.frames[0].name, "leaky_or_fixed");
        assert_eq!(first.frames[0].line, 78);
        assert_eq!(s.devices(), ["cuda:0"]);
        // The segments add up as PyTorch wrote them.
        let segment = &s.segments[0];
        assert_eq!(segment.blocks.iter().map(|b| b.size).sum::<u64>(), segment.total_size);
    }

    #[test]
    fn every_protocol_reads_the_same() {
        let read = |name| Snapshot::read_pickle(fixture(name)).unwrap();
        let (p4, p2, p5) = (read("mlp.pickle"), read("mlp_protocol2.pickle"), read("mlp_protocol5.pickle"));
        assert_eq!((p4.protocol, p2.protocol, p5.protocol), (4, 2, 5));
        for other in [&p2, &p5] {
            assert_eq!(format!("{:?}", other.snapshot), format!("{:?}", p4.snapshot));
            assert_eq!(other.ignored, p4.ignored);
        }
    }

    /// A line profile with a line that ran (every figure distinct) and one
    /// that did not.
    fn profile() -> crate::report::Report {
        let stats: serde_json::Map<String, serde_json::Value> = crate::stats::FIELDS
            .iter()
            .enumerate()
            .map(|(i, f)| (f.name.to_string(), (i as i64 * 1000 - 7).into()))
            .collect();
        let json = serde_json::json!({
            "columns": ["allocated_bytes.all.current", "increment", "hits"],
            "functions": [{
                "name": "train::step", "trait": null, "file": "src/train.rs", "device": "cuda:0", "calls": 3,
                "error": null,
                "lines": [
                    {"line": 7, "code": "fn step() {", "hits": 3, "increment": 4096, "increment_total": -12288,
                     "ooms": 1, "stats": stats},
                    {"line": 8, "code": "    // nothing", "hits": 0, "stats": null},
                ],
            }],
        });
        let report = crate::report::Report::from_json(&json.to_string()).unwrap();
        // What it writes is what it read.
        assert_eq!(serde_json::from_str::<serde_json::Value>(&report.to_json()).unwrap(), json);
        report
    }

    #[test]
    fn memlab_snapshots_read_back_as_written() {
        let frames: Stack =
            Arc::from(vec![SnapshotFrame { filename: "src/train.rs".into(), line: 7, name: "step".into() }]);
        let entry = |action, addr, size, time_us| TraceEntry {
            action,
            addr: Some(addr),
            size,
            stream: 0,
            time_us,
            frames: frames.clone(),
            category: (action == Action::Alloc).then_some(Category::Gradient),
            tensor: (action == Action::Alloc && addr == 64).then(|| "fc.weight".into()),
            device_free: None,
        };
        let written = Snapshot {
            segments: vec![Segment {
                device: 0,
                address: 1 << 63,
                total_size: 2 << 20,
                stream: 7,
                segment_type: SegmentType::Small,
                allocated_size: 512,
                active_size: 512,
                requested_size: 500,
                is_expandable: true,
                blocks: vec![Block {
                    address: 1 << 63,
                    size: 512,
                    requested_size: 500,
                    state: BlockState::ActiveAllocated,
                    frames: frames.clone(),
                }],
            }],
            device_traces: vec![
                vec![entry(Action::Alloc, 1 << 63, 512, 3), entry(Action::SegmentMap, 4096, 1 << 21, 4)],
                vec![entry(Action::Alloc, 64, 100, 5), entry(Action::FreeRequested, 64, 100, 6)],
            ],
            allocator_settings: AllocatorSettings::from_json(serde_json::json!({
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "max_split_size": 134217728_u64,
                "garbage_collection_threshold": 0.0,
                "expandable_segments": true,
                "roundup_power2_divisions": {"1": 0, "2": 4},
                "max_cached_size": 1_073_741_824_u64,
            })),
            memlab: Some(SnapshotInfo {
                devices: vec!["cuda:0".into(), "cpu".into()],
                partial: true,
                dropped: 3,
                recorded: 7,
                run: Some(crate::run::RunInfo {
                    rank: Some(1),
                    world_size: Some(2),
                    host: Some("node7".into()),
                    pid: 4242,
                    process_start: Some(1_795_000_000),
                    clock_zero_unix_us: 1_795_000_012_345_678,
                    libtorch: Some("2.11.0".into()),
                    devices: vec![crate::run::DeviceId { device: "cuda:0".into(), uuid: Some("GPU-8c3f".into()) }],
                }),
                device_memory: vec![super::super::DeviceMemory {
                    device: "cuda:0".into(),
                    total: 85_017_493_504,
                    memory_fraction: 0.5,
                }],
                profile: Some(profile()),
                ops: Some(vec![crate::ops::OpRecord {
                    start_us: 5,
                    end_us: 9,
                    op: crate::ops::Op::Reduction(crate::ops::Reduction {
                        shape: vec![4096, 512],
                        strides: vec![512, 1],
                        element_size: 4,
                        reduced: 1,
                    }),
                    name: "sum".into(),
                    tensors: Some(crate::ops::TensorArgs {
                        count: 1,
                        bytes: 4096 * 512 * 4,
                        first: vec![crate::ops::TensorArg {
                            dtype: Some(crate::DType::Float),
                            shape: Some(vec![4096, 512]),
                        }],
                    }),
                    sequence: Some(7),
                    sequence_end: Some(9),
                    scalars: vec![crate::ops::Scalar(1.0), crate::ops::Scalar(0.5)],
                }]),
                unseen_before: Vec::new(),
                prediction_inputs: None,
            }),
        };
        let read = Snapshot::from_pickle(&written.to_pickle().unwrap()).unwrap();
        assert_eq!(format!("{:?}", read.snapshot), format!("{written:?}"));
        assert_eq!(read.snapshot.device_traces[1][0].tensor.as_deref(), Some("fc.weight"));
        let info = read.snapshot.memlab.as_ref().unwrap();
        assert_eq!(info.profile.as_ref().unwrap().to_json(), profile().to_json());
        assert!(read.ignored.is_empty(), "{:?}", read.ignored);
        // The stack shared in the file is one stack read back.
        assert!(Arc::ptr_eq(&read.snapshot.device_traces[0][0].frames, &read.snapshot.device_traces[1][1].frames));
    }

    #[test]
    fn figures_no_allocator_can_hold_are_refused_naming_where() {
        let segment = |address: u64, total_size: u64| Segment {
            device: 0,
            address,
            total_size,
            stream: 0,
            segment_type: SegmentType::Large,
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            is_expandable: false,
            blocks: Vec::new(),
        };
        let entry = |action, addr, size| TraceEntry::new(action, Some(addr), size, 0);
        let file = |segments: Vec<Segment>, trace: Vec<TraceEntry>| Snapshot {
            segments,
            device_traces: vec![trace],
            allocator_settings: None,
            memlab: None,
        };
        let refused = |s: Snapshot| Snapshot::from_pickle(&s.to_pickle().unwrap()).unwrap_err().to_string();
        // Two final segments of 2^62 bytes: 2^63 in all, one past i64::MAX
        // (added in 64 bits, two of 2^63 made 0).
        let e = refused(file(vec![segment(0, 1 << 62), segment(1 << 62, 1 << 62)], Vec::new()));
        assert!(e.contains("segment 1 (cuda:0 at 0x4000000000000000)") && e.contains("past 2^63 - 1"), "{e}");
        // Two of 2^63 each, the pair whose sum wrapped to 0 B reserved: the
        // first is already past what any allocator holds.
        let e = refused(file(vec![segment(0, 1 << 63), segment(1 << 63, 1 << 63)], Vec::new()));
        assert!(e.contains("segment 0 (cuda:0 at 0x0)") && e.contains("past 2^63 - 1"), "{e}");
        // A history whose allocations pass it, at the entry that does.
        let e = refused(file(
            Vec::new(),
            vec![entry(Action::Alloc, 1 << 40, 1 << 62), entry(Action::Alloc, 1 << 41, 1 << 62)],
        ));
        assert!(e.contains("cuda:0's history entry 1 (alloc of 4611686018427387904 bytes)"), "{e}");
        // A block that runs past the end of the address space.
        let e = refused(file(Vec::new(), vec![entry(Action::Alloc, u64::MAX - 10, 512)]));
        assert!(e.contains("history entry 0") && e.contains("past the end of the address space"), "{e}");
        // A request may ask for anything: an `oom` entry of u64::MAX reads.
        let oom = TraceEntry::new(Action::Oom, None, u64::MAX, 0);
        let read = Snapshot::from_pickle(&file(vec![segment(0, 1 << 62)], vec![oom]).to_pickle().unwrap()).unwrap();
        assert_eq!(read.snapshot.device_traces[0][0].size, u64::MAX);
    }

    #[test]
    fn what_is_not_a_snapshot_is_refused_with_the_reason() {
        let err = |bytes: &[u8]| Snapshot::from_pickle(bytes).unwrap_err().to_string();
        // pickle.dumps([1, 2], protocol=4)
        assert!(err(b"\x80\x04\x95\x09\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02e.").contains("holds a list"));
        // pickle.dumps({"segments": []}, protocol=4)
        let no_traces = b"\x80\x04\x95\x11\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x08segments\x94]\x94s.";
        assert!(err(no_traces).contains("no `segments` or no `device_traces`"), "{}", err(no_traces));
        let dir = std::env::temp_dir();
        let e = Snapshot::read_pickle(&dir).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = Snapshot::read_pickle(dir.join("memlab-no-such.pickle")).unwrap_err().to_string();
        assert!(e.ends_with("no such file"), "{e}");
    }

    /// A pickle's list can hold itself; made into JSON, it would nest
    /// without end and overflow the stack.
    #[test]
    fn plain_data_that_holds_itself_is_refused() {
        // l = []; l.append(l); pickle.dumps({"segments": [], "device_traces": [], "memlab": {"ops": l}}, protocol=2)
        let bytes = b"\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02X\x0d\x00\x00\x00device_tracesq\x03]q\x04\
                      X\x06\x00\x00\x00memlabq\x05}q\x06X\x03\x00\x00\x00opsq\x07]q\x08h\x08asu.";
        let e = Snapshot::from_pickle(&bytes[..]).unwrap_err().to_string();
        assert!(e.contains("`memlab.ops` is not plain data: it nests deeper than 127"), "{e}");
    }

    /// A pickle's string (`BINUNICODE`), appended to `bytes`.
    fn pickle_text(bytes: &mut Vec<u8>, text: &str) {
        bytes.push(b'X');
        bytes.extend((text.len() as u32).to_le_bytes());
        bytes.extend(text.as_bytes());
    }

    /// One segment whose list holds one block 300 times, itself listed 300
    /// times: 1.4 KB of pickle and 90,000 blocks, refused.
    #[test]
    fn segments_shared_over_and_over_are_refused() {
        let mut bytes = b"\x80\x02}(".to_vec();
        pickle_text(&mut bytes, "segments");
        bytes.extend(b"](}q\x01(");
        for (name, value) in [("address", &b"K\x00"[..]), ("total_size", b"K\x10"), ("stream", b"K\x00")] {
            pickle_text(&mut bytes, name);
            bytes.extend(value);
        }
        pickle_text(&mut bytes, "segment_type");
        pickle_text(&mut bytes, "large");
        pickle_text(&mut bytes, "blocks");
        bytes.extend(b"](}q\x03(");
        pickle_text(&mut bytes, "size");
        bytes.extend(b"K\x10");
        pickle_text(&mut bytes, "state");
        pickle_text(&mut bytes, "inactive");
        bytes.push(b'u');
        bytes.extend(b"h\x03".repeat(299));
        bytes.extend(b"eu");
        bytes.extend(b"h\x01".repeat(299));
        bytes.push(b'e');
        pickle_text(&mut bytes, "device_traces");
        bytes.extend(b"]u.");
        let e = Snapshot::from_pickle(&bytes[..]).unwrap_err().to_string();
        assert!(e.contains("more segments, blocks and events than the file has bytes"), "{e}");
    }

    /// A list that holds the one before it twice, a hundred times over, is
    /// 1 KB of pickle and 2^100 values as JSON: refused, not built.
    #[test]
    fn plain_data_that_shares_a_list_over_and_over_is_refused() {
        let mut bytes = b"\x80\x02}(".to_vec();
        for name in ["segments", "device_traces"] {
            pickle_text(&mut bytes, name);
            bytes.push(b']');
        }
        pickle_text(&mut bytes, "memlab");
        bytes.extend(b"}(");
        pickle_text(&mut bytes, "ops");
        // l0 = [], memoized 0; l(i) = [l(i-1), l(i-1)], memoized i, each
        // popped once memoized.
        bytes.extend(b"]q\x00");
        for i in 1..=100u8 {
            bytes.extend([b'0', b'(', b'h', i - 1, b'h', i - 1, b'l', b'q', i]);
        }
        bytes.extend(b"uu.");
        let e = Snapshot::from_pickle(&bytes[..]).unwrap_err().to_string();
        assert!(e.contains("more values than the file has bytes"), "{e}");
    }
}
