//! A reader of pickles that hold plain data (protocols 2 to 5): dicts, lists,
//! tuples, sets, strings, bytes, numbers, booleans and `None`. Opcodes that
//! build objects (`GLOBAL`, `REDUCE`, `BUILD`, …) are refused, never run: a
//! pickle is a program, and reading a snapshot must not run one.
//!
//! Made for files of gigabytes. The file is read twice, through a buffer:
//! the first pass checks every opcode and notes which memo entries the
//! pickle fetches again; the second builds the values and keeps in the memo
//! only those, so that what nothing fetches again (a trace entry's dict) is
//! freed as soon as its parent lets go of it. Strings are interned: the
//! thousands of copies of a key or a file name are one `u32` each. A
//! [`Shaper`] may replace a dict the moment it is filled with a compact
//! value of its own (a trace entry), so that millions of entries never exist
//! as dicts at once.

use std::cell::RefCell;
use std::io::{Read, Seek, SeekFrom};
use std::rc::Rc;

use crate::hash::FastMap;

/// A list (or set) of the pickle, shared as Python shares it.
pub(crate) type List = Rc<RefCell<Vec<Value>>>;
/// A dict of the pickle: its items in order.
pub(crate) type Dict = Rc<RefCell<Vec<(Value, Value)>>>;

/// A value of the pickle.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer from 2^63 to 2^64 - 1 (addresses, stream handles).
    UInt(u64),
    /// An integer beyond 64 bits, or below -2^63: kept as unreadable.
    Huge,
    /// A float.
    Float(f64),
    /// An interned string (see [`Strings`]).
    Str(u32),
    /// Bytes (their content is never needed).
    Bytes,
    List(List),
    Tuple(Rc<[Value]>),
    Dict(Dict),
    /// What a [`Shaper`] made of a dict.
    Shaped(u32),
}

/// A value is dropped without recursion: a hostile pickle nests lists a
/// million deep in two bytes a level, and dropping them one frame a level
/// would overflow the stack. What a value alone holds is moved out to a list
/// of its own and dropped from there, level by level. (A list that holds
/// itself is never dropped: it leaks, no more than the file's size.)
impl Drop for Value {
    fn drop(&mut self) {
        let mut pending = Vec::new();
        self.give_up_items(&mut pending);
        while let Some(mut value) = pending.pop() {
            value.give_up_items(&mut pending);
        }
    }
}

impl Value {
    /// The number, if the value is a non-negative integer.
    pub(crate) fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::UInt(u) => Some(u),
            Value::Bool(b) => Some(u64::from(b)),
            _ => None,
        }
    }

    /// The string's id, if the value is a string.
    pub(crate) fn as_str(&self) -> Option<u32> {
        match *self {
            Value::Str(id) => Some(id),
            _ => None,
        }
    }

    /// Moves the items of a list, tuple or dict that nothing else shares
    /// into `into`, leaving it empty.
    fn give_up_items(&mut self, into: &mut Vec<Value>) {
        match self {
            Value::List(list) => {
                if let Some(items) = Rc::get_mut(list) {
                    into.append(items.get_mut());
                }
            }
            Value::Tuple(items) => {
                if let Some(items) = Rc::get_mut(items) {
                    into.extend(items.iter_mut().map(|item| std::mem::replace(item, Value::None)));
                }
            }
            Value::Dict(dict) => {
                if let Some(items) = Rc::get_mut(dict) {
                    into.extend(items.get_mut().drain(..).flat_map(|(k, v)| [k, v]));
                }
            }
            _ => {}
        }
    }

    /// A short name of the value's type, for messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "a boolean",
            Value::Int(_) | Value::UInt(_) | Value::Huge => "an integer",
            Value::Float(_) => "a float",
            Value::Str(_) => "a string",
            Value::Bytes => "bytes",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Dict(_) | Value::Shaped(_) => "a dict",
        }
    }
}

/// The pickle's strings, each text once.
#[derive(Default, Debug)]
pub(crate) struct Strings {
    ids: FastMap<Rc<str>, u32>,
    texts: Vec<Rc<str>>,
}

impl Strings {
    /// The id of `text`, interned now if new.
    pub(crate) fn intern(&mut self, text: &str) -> u32 {
        if let Some(&id) = self.ids.get(text) {
            return id;
        }
        let id = self.texts.len() as u32;
        let text: Rc<str> = Rc::from(text);
        self.texts.push(text.clone());
        self.ids.insert(text, id);
        id
    }

    /// The text of string `id`.
    pub(crate) fn text(&self, id: u32) -> &str {
        &self.texts[id as usize]
    }
}

/// Replaces dicts of a known shape with compact values as they are filled.
pub(crate) trait Shaper {
    /// `items` were just set in a dict that nothing else holds (none of the
    /// pickle's later opcodes can reach it but through its parent): returns
    /// a [`Value::Shaped`] to stand for it, or `None` to keep the dict.
    fn shape(&mut self, strings: &Strings, items: &mut Vec<(Value, Value)>) -> Result<Option<Value>, String>;

    /// More items set in a dict that [`shape`](Self::shape) replaced.
    fn extend(&mut self, strings: &Strings, shaped: u32, items: Vec<(Value, Value)>) -> Result<(), String>;
}

/// Why a pickle could not be read.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The file is empty.
    Empty,
    /// The file does not start as a pickle of protocol 2 to 5 does.
    NotAPickle,
    /// A pickle of a protocol outside 2 to 5.
    Protocol(u8),
    /// The file ends before the pickle's `STOP`.
    Truncated(u64),
    /// An opcode that builds objects or calls code.
    Refused { opcode: &'static str, at: u64 },
    /// An opcode of protocols 0 and 1 only, or none at all.
    Unknown { byte: u8, at: u64 },
    /// Opcodes that do not make sense together.
    Malformed { why: String, at: u64 },
    /// What the shaper refused.
    Shape { why: String, at: u64 },
    /// Reading the file failed.
    Io(std::io::Error),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Empty => write!(f, "the file is empty"),
            Fault::NotAPickle => write!(
                f,
                "not a pickle: it does not start with a pickle header of protocol 2 to 5 (bytes 0x80 0x02 to 0x80 0x05)"
            ),
            Fault::Protocol(p) => write!(f, "a pickle of protocol {p}: memlab reads protocols 2 to 5"),
            Fault::Truncated(at) => write!(f, "truncated: the pickle ends at byte {at}, before its end (STOP)"),
            Fault::Refused { opcode, at } => write!(
                f,
                "refused: the pickle builds objects ({opcode} at byte {at}); memlab reads plain data only and never runs a pickle's code"
            ),
            Fault::Unknown { byte, at } => write!(
                f,
                "opcode 0x{byte:02x} at byte {at} is not one of protocols 2 to 5's data opcodes (is the file a pickle?)"
            ),
            Fault::Malformed { why, at } => write!(f, "malformed pickle at byte {at}: {why}"),
            Fault::Shape { why, at } => write!(f, "{why} (at byte {at})"),
            Fault::Io(e) => write!(f, "{e}"),
        }
    }
}

impl From<std::io::Error> for Fault {
    fn from(e: std::io::Error) -> Fault {
        Fault::Io(e)
    }
}

/// The opcodes (Python's `pickletools` names them).
mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINFLOAT: u8 = b'G';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE: u8 = b'X';
    pub const BINUNICODE8: u8 = 0x8d;
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const BINBYTES: u8 = b'B';
    pub const BINBYTES8: u8 = 0x8e;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const EMPTY_LIST: u8 = b']';
    pub const APPEND: u8 = b'a';
    pub const APPENDS: u8 = b'e';
    pub const LIST: u8 = b'l';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE: u8 = b't';
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const EMPTY_DICT: u8 = b'}';
    pub const DICT: u8 = b'd';
    pub const SETITEM: u8 = b's';
    pub const SETITEMS: u8 = b'u';
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const PROTO: u8 = 0x80;
    pub const FRAME: u8 = 0x95;
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const MEMOIZE: u8 = 0x94;
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';

    /// The opcodes that build objects or call code, by name.
    pub fn refused(byte: u8) -> Option<&'static str> {
        Some(match byte {
            b'c' => "GLOBAL",
            0x93 => "STACK_GLOBAL",
            b'R' => "REDUCE",
            b'b' => "BUILD",
            b'i' => "INST",
            b'o' => "OBJ",
            0x81 => "NEWOBJ",
            0x92 => "NEWOBJ_EX",
            0x82 => "EXT1",
            0x83 => "EXT2",
            0x84 => "EXT4",
            b'P' => "PERSID",
            b'Q' => "BINPERSID",
            0x97 => "NEXT_BUFFER",
            0x98 => "READONLY_BUFFER",
            _ => return None,
        })
    }
}

/// The file, read through a buffer of its own (a `BufReader` byte at a time
/// costs more than the rest of an opcode).
struct Input<R> {
    source: R,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    /// The file offset of `buf[0]`.
    base: u64,
    /// Text longer than the buffer.
    long: Vec<u8>,
}

const BUFFER: usize = 1 << 20;

impl<R: Read> Input<R> {
    fn new(source: R) -> Self {
        Input { source, buf: vec![0; BUFFER], pos: 0, end: 0, base: 0, long: Vec::new() }
    }

    /// The offset of the next byte.
    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// Moves what is left to the front and reads more; false at the end.
    #[cold]
    fn refill(&mut self) -> Result<bool, Fault> {
        self.buf.copy_within(self.pos..self.end, 0);
        self.base += self.pos as u64;
        self.end -= self.pos;
        self.pos = 0;
        loop {
            match self.source.read(&mut self.buf[self.end..]) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.end += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Fault::Io(e)),
            }
        }
    }

    /// The next byte; `None` at the end of the file.
    #[inline]
    fn next(&mut self) -> Result<Option<u8>, Fault> {
        if self.pos == self.end && !self.refill()? {
            return Ok(None);
        }
        self.pos += 1;
        Ok(Some(self.buf[self.pos - 1]))
    }

    #[inline]
    fn byte(&mut self) -> Result<u8, Fault> {
        let at = self.offset();
        self.next()?.ok_or(Fault::Truncated(at))
    }

    /// The next `n` bytes.
    #[inline]
    fn bytes(&mut self, n: usize) -> Result<&[u8], Fault> {
        if self.end - self.pos < n {
            if n > self.buf.len() {
                return self.long(n);
            }
            while self.end - self.pos < n {
                if !self.refill()? {
                    return Err(Fault::Truncated(self.base + self.end as u64));
                }
            }
        }
        self.pos += n;
        Ok(&self.buf[self.pos - n..self.pos])
    }

    /// Bytes beyond the buffer's size, read into a vector of their own.
    #[cold]
    fn long(&mut self, n: usize) -> Result<&[u8], Fault> {
        let mut long = std::mem::take(&mut self.long);
        long.clear();
        long.extend_from_slice(&self.buf[self.pos..self.end]);
        self.base += self.end as u64;
        self.pos = 0;
        self.end = 0;
        while long.len() < n {
            let had = long.len();
            let want = (n - had).min(BUFFER);
            long.resize(had + want, 0);
            let got = loop {
                match self.source.read(&mut long[had..]) {
                    Ok(k) => break k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Fault::Io(e)),
                }
            };
            long.truncate(had + got);
            self.base += got as u64;
            if got == 0 {
                return Err(Fault::Truncated(self.base));
            }
        }
        // What was read past the `n` bytes goes back to the buffer.
        let extra = long.len() - n;
        self.buf[..extra].copy_from_slice(&long[n..]);
        self.base -= extra as u64;
        self.end = extra;
        long.truncate(n);
        self.long = long;
        Ok(&self.long)
    }

    fn u32(&mut self) -> Result<u32, Fault> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, Fault> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }

    /// A length of `width` bytes (1, 4 or 8), as the opcode's argument.
    fn length(&mut self, width: u8, at: u64) -> Result<usize, Fault> {
        let n = match width {
            1 => u64::from(self.byte()?),
            4 => u64::from(self.u32()?),
            _ => self.u64()?,
        };
        usize::try_from(n).map_err(|_| Fault::Malformed { why: format!("a length of {n} bytes"), at })
    }
}

/// The width of a length-prefixed opcode's length, if it is one.
fn length_width(byte: u8) -> Option<u8> {
    match byte {
        op::SHORT_BINUNICODE | op::SHORT_BINSTRING | op::SHORT_BINBYTES => Some(1),
        op::BINUNICODE | op::BINSTRING | op::BINBYTES => Some(4),
        op::BINUNICODE8 | op::BINBYTES8 | op::BYTEARRAY8 => Some(8),
        _ => None,
    }
}

/// A set of memo indices.
#[derive(Default)]
struct Bits(Vec<u64>);

impl Bits {
    fn insert(&mut self, i: u32) -> bool {
        let (word, bit) = ((i / 64) as usize, 1u64 << (i % 64));
        if word >= self.0.len() {
            self.0.resize(word + 1, 0);
        }
        let new = self.0[word] & bit == 0;
        self.0[word] |= bit;
        new
    }

    fn contains(&self, i: u32) -> bool {
        self.0.get((i / 64) as usize).is_some_and(|w| w & (1u64 << (i % 64)) != 0)
    }
}

/// What the first pass learned.
struct Plan {
    protocol: u8,
    /// The memo indices some `GET` fetches.
    fetched: Bits,
}

/// Checks the header and every opcode, and notes the memo indices fetched.
fn plan<R: Read>(source: R) -> Result<Plan, Fault> {
    let mut input = Input::new(source);
    let protocol = match (input.next()?, input.next()?) {
        (None, _) => return Err(Fault::Empty),
        (Some(op::PROTO), Some(p)) if (2..=5).contains(&p) => p,
        (Some(op::PROTO), Some(p)) if p < 0x10 => return Err(Fault::Protocol(p)),
        _ => return Err(Fault::NotAPickle),
    };
    let mut fetched = Bits::default();
    loop {
        let at = input.offset();
        let byte = input.byte()?;
        match byte {
            op::STOP => break,
            op::MARK
            | op::POP
            | op::POP_MARK
            | op::DUP
            | op::NONE
            | op::NEWTRUE
            | op::NEWFALSE
            | op::EMPTY_LIST
            | op::APPEND
            | op::APPENDS
            | op::LIST
            | op::EMPTY_TUPLE
            | op::TUPLE
            | op::TUPLE1
            | op::TUPLE2
            | op::TUPLE3
            | op::EMPTY_DICT
            | op::DICT
            | op::SETITEM
            | op::SETITEMS
            | op::EMPTY_SET
            | op::ADDITEMS
            | op::FROZENSET
            | op::MEMOIZE => {}
            op::BININT1 | op::BINPUT | op::PROTO => {
                input.byte()?;
            }
            op::BININT2 => {
                input.bytes(2)?;
            }
            op::BININT | op::LONG_BINPUT => {
                input.bytes(4)?;
            }
            op::BINFLOAT | op::FRAME => {
                input.bytes(8)?;
            }
            op::LONG1 => {
                let n = input.byte()?;
                input.bytes(n.into())?;
            }
            op::LONG4 => {
                let n = input.u32()? as usize;
                input.bytes(n)?;
            }
            op::BINGET => {
                fetched.insert(input.byte()?.into());
            }
            op::LONG_BINGET => {
                fetched.insert(input.u32()?);
            }
            _ => {
                if let Some(width) = length_width(byte) {
                    let n = input.length(width, at)?;
                    input.bytes(n)?;
                } else if let Some(opcode) = op::refused(byte) {
                    return Err(Fault::Refused { opcode, at });
                } else {
                    return Err(Fault::Unknown { byte, at });
                }
            }
        }
    }
    Ok(Plan { protocol, fetched })
}

/// The pickle machine of the second pass.
struct Machine<'s, S> {
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: FastMap<u32, Value>,
    /// Every memo index stored (the next `MEMOIZE` takes their count).
    stored: Bits,
    stored_count: u32,
    fetched: Bits,
    strings: Strings,
    shaper: &'s mut S,
}

/// A value read, with the strings its `Str`s name.
pub(crate) struct Pickle {
    pub value: Value,
    pub strings: Strings,
    pub protocol: u8,
}

/// Reads the pickle in `source` (read twice: it must seek), with `shaper`
/// replacing dicts it knows. `strings` are interned before reading, so that
/// the shaper knows their ids.
pub(crate) fn read<R: Read + Seek, S: Shaper>(
    mut source: R,
    strings: Strings,
    shaper: &mut S,
) -> Result<Pickle, Fault> {
    let plan = plan(&mut source)?;
    source.seek(SeekFrom::Start(0))?;
    let mut m = Machine {
        stack: Vec::new(),
        marks: Vec::new(),
        memo: FastMap::default(),
        stored: Bits::default(),
        stored_count: 0,
        fetched: plan.fetched,
        strings,
        shaper,
    };
    let value = m.run(Input::new(source))?;
    Ok(Pickle { value, strings: m.strings, protocol: plan.protocol })
}

fn malformed(why: impl Into<String>, at: u64) -> Fault {
    Fault::Malformed { why: why.into(), at }
}

impl<S: Shaper> Machine<'_, S> {
    fn run<R: Read>(&mut self, mut input: Input<R>) -> Result<Value, Fault> {
        input.bytes(2)?; // PROTO n, checked by the plan
        loop {
            let at = input.offset();
            let byte = input.byte()?;
            match byte {
                op::STOP => {
                    return self.stack.pop().ok_or_else(|| malformed("STOP with nothing on the stack", at));
                }
                op::MARK => self.marks.push(self.stack.len()),
                op::POP => {
                    if self.stack.len() > self.marks.last().copied().unwrap_or(0) {
                        self.stack.pop();
                    } else {
                        self.pop_mark(at)?;
                    }
                }
                op::POP_MARK => {
                    self.pop_mark(at)?;
                }
                op::DUP => {
                    let top = self.top(at)?.clone();
                    self.stack.push(top);
                }
                op::NONE => self.stack.push(Value::None),
                op::NEWTRUE => self.stack.push(Value::Bool(true)),
                op::NEWFALSE => self.stack.push(Value::Bool(false)),
                op::BININT => {
                    let v = i32::from_le_bytes(input.bytes(4)?.try_into().expect("4 bytes"));
                    self.stack.push(Value::Int(v.into()));
                }
                op::BININT1 => {
                    let v = input.byte()?;
                    self.stack.push(Value::Int(v.into()));
                }
                op::BININT2 => {
                    let v = u16::from_le_bytes(input.bytes(2)?.try_into().expect("2 bytes"));
                    self.stack.push(Value::Int(v.into()));
                }
                op::LONG1 => {
                    let n = input.byte()?;
                    let v = long(input.bytes(n.into())?);
                    self.stack.push(v);
                }
                op::LONG4 => {
                    let n = input.u32()? as usize;
                    let v = long(input.bytes(n)?);
                    self.stack.push(v);
                }
                op::BINFLOAT => {
                    let bytes = input.bytes(8)?;
                    self.stack.push(Value::Float(f64::from_be_bytes(bytes.try_into().expect("8 bytes"))));
                }
                op::FRAME => {
                    input.bytes(8)?;
                }
                op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8 | op::SHORT_BINSTRING | op::BINSTRING => {
                    let n = input.length(length_width(byte).expect("a length"), at)?;
                    let text = input.bytes(n)?;
                    let id = match std::str::from_utf8(text) {
                        Ok(text) => self.strings.intern(text),
                        Err(_) => self.strings.intern(&String::from_utf8_lossy(text)),
                    };
                    self.stack.push(Value::Str(id));
                }
                op::SHORT_BINBYTES | op::BINBYTES | op::BINBYTES8 | op::BYTEARRAY8 => {
                    let n = input.length(length_width(byte).expect("a length"), at)?;
                    input.bytes(n)?;
                    self.stack.push(Value::Bytes);
                }
                op::EMPTY_LIST => self.stack.push(Value::List(Rc::default())),
                op::EMPTY_DICT => self.stack.push(Value::Dict(Rc::default())),
                op::EMPTY_TUPLE => self.stack.push(Value::Tuple(Rc::from(Vec::new()))),
                op::EMPTY_SET => self.stack.push(Value::List(Rc::default())),
                op::LIST | op::FROZENSET => {
                    let items = self.pop_mark(at)?;
                    self.stack.push(Value::List(Rc::new(RefCell::new(items))));
                }
                op::TUPLE => {
                    let items = self.pop_mark(at)?;
                    self.stack.push(Value::Tuple(items.into()));
                }
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = usize::from(byte - op::TUPLE1 + 1);
                    if self.stack.len() < self.marks.last().copied().unwrap_or(0) + n {
                        return Err(malformed(format!("a tuple of {n} with fewer items on the stack"), at));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(items.into()));
                }
                op::APPEND => {
                    let item = self.pop(at)?;
                    self.append(vec![item], at)?;
                }
                op::APPENDS | op::ADDITEMS => {
                    let items = self.pop_mark(at)?;
                    self.append(items, at)?;
                }
                op::DICT => {
                    let items = self.pop_mark(at)?;
                    self.stack.push(Value::Dict(Rc::default()));
                    self.set_items(items, at)?;
                }
                op::SETITEM => {
                    let value = self.pop(at)?;
                    let key = self.pop(at)?;
                    self.set_items(vec![key, value], at)?;
                }
                op::SETITEMS => {
                    let items = self.pop_mark(at)?;
                    self.set_items(items, at)?;
                }
                op::MEMOIZE => {
                    let index = self.stored_count;
                    self.put(index, at)?;
                }
                op::BINPUT => {
                    let index = input.byte()?.into();
                    self.put(index, at)?;
                }
                op::LONG_BINPUT => {
                    let index = input.u32()?;
                    self.put(index, at)?;
                }
                op::BINGET | op::LONG_BINGET => {
                    let index = if byte == op::BINGET { input.byte()?.into() } else { input.u32()? };
                    let value = self
                        .memo
                        .get(&index)
                        .ok_or_else(|| malformed(format!("memo entry {index} fetched before it was stored"), at))?
                        .clone();
                    self.stack.push(value);
                }
                // The plan refused everything else.
                _ => return Err(Fault::Unknown { byte, at }),
            }
        }
    }

    fn top(&self, at: u64) -> Result<&Value, Fault> {
        self.stack.last().ok_or_else(|| malformed("an opcode needs a value and the stack is empty", at))
    }

    fn pop(&mut self, at: u64) -> Result<Value, Fault> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return Err(malformed("an opcode needs a value and finds a mark or nothing", at));
        }
        Ok(self.stack.pop().expect("checked"))
    }

    fn pop_mark(&mut self, at: u64) -> Result<Vec<Value>, Fault> {
        let mark = self.marks.pop().ok_or_else(|| malformed("an opcode needs a mark and there is none", at))?;
        Ok(self.stack.split_off(mark))
    }

    fn put(&mut self, index: u32, at: u64) -> Result<(), Fault> {
        if self.stored.insert(index) {
            self.stored_count += 1;
        }
        if self.fetched.contains(index) {
            let top = self.top(at)?.clone();
            self.memo.insert(index, top);
        }
        Ok(())
    }

    fn append(&mut self, items: Vec<Value>, at: u64) -> Result<(), Fault> {
        match self.stack.last() {
            Some(Value::List(list)) => {
                list.borrow_mut().extend(items);
                Ok(())
            }
            Some(other) => Err(malformed(format!("items appended to {}", other.kind()), at)),
            None => Err(malformed("items appended to nothing", at)),
        }
    }

    /// Sets `items` (key, value, key, value, …) in the dict on top.
    fn set_items(&mut self, items: Vec<Value>, at: u64) -> Result<(), Fault> {
        if !items.len().is_multiple_of(2) {
            return Err(malformed("a dict's items are not pairs", at));
        }
        let mut pairs = Vec::with_capacity(items.len() / 2);
        let mut items = items.into_iter();
        while let (Some(k), Some(v)) = (items.next(), items.next()) {
            pairs.push((k, v));
        }
        let shape = |why| Fault::Shape { why, at };
        let slot = self.stack.last_mut().ok_or_else(|| malformed("items set in nothing", at))?;
        match slot {
            Value::Dict(dict) => {
                let replaced = if Rc::strong_count(dict) == 1 {
                    let mut all = std::mem::take(&mut *dict.borrow_mut());
                    all.extend(pairs);
                    let shaped = self.shaper.shape(&self.strings, &mut all).map_err(shape)?;
                    if shaped.is_none() {
                        *dict.borrow_mut() = all;
                    }
                    shaped
                } else {
                    dict.borrow_mut().extend(pairs);
                    None
                };
                if let Some(value) = replaced {
                    *slot = value;
                }
                Ok(())
            }
            Value::Shaped(id) => {
                let id = *id;
                self.shaper.extend(&self.strings, id, pairs).map_err(shape)
            }
            other => Err(malformed(format!("items set in {}", other.kind()), at)),
        }
    }
}

/// A `LONG1`/`LONG4` integer: little-endian two's complement.
fn long(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        return Value::Int(0);
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    // Leading sign bytes carry nothing.
    let mut n = bytes.len();
    while n > 1 && bytes[n - 1] == if negative { 0xff } else { 0 } {
        n -= 1;
    }
    let significant = &bytes[..n];
    if significant.len() > 9 || (significant.len() == 9 && (negative || significant[8] != 0)) {
        return Value::Huge;
    }
    let mut word = [if negative { 0xff } else { 0 }; 8];
    let take = significant.len().min(8);
    word[..take].copy_from_slice(&significant[..take]);
    let v = u64::from_le_bytes(word);
    if negative {
        Value::Int(v as i64)
    } else if v > i64::MAX as u64 {
        Value::UInt(v)
    } else {
        Value::Int(v as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Keep;

    impl Shaper for Keep {
        fn shape(&mut self, _: &Strings, _: &mut Vec<(Value, Value)>) -> Result<Option<Value>, String> {
            Ok(None)
        }
        fn extend(&mut self, _: &Strings, _: u32, _: Vec<(Value, Value)>) -> Result<(), String> {
            unreachable!("nothing is shaped")
        }
    }

    /// Two bytes a level: dropped one stack frame a level, a million levels
    /// overflowed the stack.
    #[test]
    fn lists_nested_a_million_deep_are_read_and_dropped() {
        let depth = 1_000_000;
        let mut bytes = b"\x80\x02".to_vec();
        bytes.extend(std::iter::repeat_n(op::EMPTY_LIST, depth));
        bytes.extend(std::iter::repeat_n(op::APPEND, depth - 1));
        bytes.push(op::STOP);
        // On a thread with a small stack.
        let read = move || {
            let (value, _) = read_bytes(&bytes).unwrap();
            let Value::List(outer) = &value else { panic!("{}", value.kind()) };
            assert_eq!(outer.borrow().len(), 1);
        };
        std::thread::Builder::new().stack_size(256 << 10).spawn(read).unwrap().join().unwrap();
    }

    fn read_bytes(bytes: &[u8]) -> Result<(Value, Strings), Fault> {
        let r = read(std::io::Cursor::new(bytes), Strings::default(), &mut Keep)?;
        Ok((r.value, r.strings))
    }

    #[test]
    fn integers_of_every_width() {
        for (bytes, want) in [
            (&[0xff][..], Some(-1i128)),
            (&[0x00, 0x80, 0xff], Some(-32768)),
            (&[0xff, 0x00], Some(255)),
            (&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00], Some(u64::MAX as i128)),
            (&[0, 0, 0, 0, 0, 0, 0, 0x80], Some(i64::MIN as i128)),
            (&[0, 0, 0, 0, 0, 0, 0, 0, 0x01], None),
        ] {
            let got = match long(bytes) {
                Value::Int(i) => Some(i128::from(i)),
                Value::UInt(u) => Some(i128::from(u)),
                Value::Huge => None,
                other => panic!("{other:?}"),
            };
            assert_eq!(got, want, "{bytes:?}");
        }
    }

    #[test]
    fn a_pickle_that_builds_objects_is_refused_before_anything_runs() {
        // pickle.dumps(os.system) at protocol 4, cut short: it names a global.
        let bytes = b"\x80\x04\x95\x14\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.";
        let err = read_bytes(bytes).unwrap_err().to_string();
        assert!(err.contains("STACK_GLOBAL at byte 28"), "{err}");
    }

    #[test]
    fn what_is_not_a_pickle_says_so() {
        assert!(matches!(read_bytes(b""), Err(Fault::Empty)));
        assert!(matches!(read_bytes(b"hello"), Err(Fault::NotAPickle)));
        assert!(matches!(read_bytes(b"\x80\x01]."), Err(Fault::Protocol(1))));
        assert!(matches!(read_bytes(b"\x80\x04]("), Err(Fault::Truncated(4))));
        assert!(matches!(read_bytes(b"\x80\x04\x8c\x09abc"), Err(Fault::Truncated(_))));
    }

    #[test]
    fn shared_values_come_back_shared_and_strings_interned() {
        // pickle.dumps({"a": [1, "x"], "b": "x"}, protocol=4) by hand: the
        // list's "x" is memoized and fetched again for "b".
        let bytes = b"\x80\x04}(\x8c\x01a]\x94(K\x01\x8c\x01x\x94e\x8c\x01bh\x01u.";
        let (value, strings) = read_bytes(bytes).unwrap();
        let Value::Dict(dict) = &value else { panic!("a dict") };
        let dict = dict.borrow();
        assert_eq!(dict.len(), 2);
        let (Value::Str(a), Value::List(list)) = (&dict[0].0, &dict[0].1) else { panic!("{dict:?}") };
        assert_eq!(strings.text(*a), "a");
        let list = list.borrow();
        assert!(matches!(list[0], Value::Int(1)));
        let (Value::Str(x1), Value::Str(x2)) = (&list[1], &dict[1].1) else { panic!("{dict:?}") };
        assert_eq!((strings.text(*x1), x1), ("x", x2));
    }
}
