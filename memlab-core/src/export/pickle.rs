//! A pickle writer for the snapshot (protocol 4). Strings and shared frame
//! lists are written once and then referenced from the pickle's memo, as
//! Python's own pickler does for shared objects: a million events from a few
//! call sites repeat the same keys and stacks, and without the memo the file
//! would hold every copy.

use crate::hash::FastMap;

const PROTO: u8 = 0x80;
/// The pickle protocol memlab writes its snapshots in.
pub const PROTOCOL: u8 = 4;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const NONE: u8 = b'N';
const BINFLOAT: u8 = b'G';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

pub(super) struct Pickler {
    out: Vec<u8>,
    memo: u32,
    strings: FastMap<String, u32>,
    /// Static strings (dict keys, action names) by where they live: found
    /// without hashing or comparing their text.
    statics: FastMap<(usize, usize), u32>,
    shared: FastMap<usize, u32>,
}

impl Pickler {
    pub(super) fn new() -> Pickler {
        Pickler {
            out: vec![PROTO, PROTOCOL],
            memo: 0,
            strings: FastMap::default(),
            statics: FastMap::default(),
            shared: FastMap::default(),
        }
    }

    pub(super) fn finish(mut self) -> Vec<u8> {
        self.out.push(STOP);
        self.out
    }

    fn memoize(&mut self) -> u32 {
        self.out.push(MEMOIZE);
        self.memo += 1;
        self.memo - 1
    }

    fn get(&mut self, index: u32) {
        match u8::try_from(index) {
            Ok(i) => self.out.extend_from_slice(&[BINGET, i]),
            Err(_) => {
                self.out.push(LONG_BINGET);
                self.out.extend_from_slice(&index.to_le_bytes());
            }
        }
    }

    pub(super) fn int(&mut self, v: i128) {
        if (0..=0xff).contains(&v) {
            self.out.extend_from_slice(&[BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.out.push(BININT2);
            self.out.extend_from_slice(&(v as u16).to_le_bytes());
        } else if (i32::MIN as i128..=i32::MAX as i128).contains(&v) {
            self.out.push(BININT);
            self.out.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // Little-endian two's complement, as short as the sign allows.
            let bytes = v.to_le_bytes();
            let mut n = bytes.len();
            while n > 1 {
                let (last, before) = (bytes[n - 1], bytes[n - 2]);
                if (last == 0 && before & 0x80 == 0) || (last == 0xff && before & 0x80 != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.out.extend_from_slice(&[LONG1, n as u8]);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }

    pub(super) fn bool(&mut self, v: bool) {
        self.out.push(if v { NEWTRUE } else { NEWFALSE });
    }

    /// A float (big-endian, as Python's pickler writes it).
    pub(super) fn float(&mut self, v: f64) {
        self.out.push(BINFLOAT);
        self.out.extend_from_slice(&v.to_be_bytes());
    }

    /// A JSON value as Python would hold it: `None`, bools, ints, floats,
    /// strings, lists and dicts.
    pub(super) fn json(&mut self, v: &serde_json::Value) {
        use serde_json::Value as J;
        match v {
            J::Null => self.out.push(NONE),
            J::Bool(b) => self.bool(*b),
            J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => self.int(i.into()),
                (_, Some(u), _) => self.int(u.into()),
                (_, _, f) => self.float(f.unwrap_or(f64::NAN)),
            },
            J::String(s) => self.str(s),
            J::Array(items) => self.list(|p| items.iter().for_each(|item| p.json(item))),
            J::Object(items) => self.dict(|p| {
                for (key, value) in items {
                    p.str(key);
                    p.json(value);
                }
            }),
        }
    }

    /// A string, written once and referenced after.
    pub(super) fn str(&mut self, s: &str) {
        if let Some(&i) = self.strings.get(s) {
            return self.get(i);
        }
        match u8::try_from(s.len()) {
            Ok(n) => self.out.extend_from_slice(&[SHORT_BINUNICODE, n]),
            Err(_) => {
                self.out.push(BINUNICODE);
                self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            }
        }
        self.out.extend_from_slice(s.as_bytes());
        let i = self.memoize();
        self.strings.insert(s.to_string(), i);
    }

    /// A static string (a key, a name from a fixed set): like
    /// [`str`](Self::str), looked up by address. A static's address never
    /// holds other text, which is not true of a `String`'s.
    pub(super) fn key(&mut self, s: &'static str) {
        let at = (s.as_ptr() as usize, s.len());
        if let Some(&i) = self.statics.get(&at) {
            return self.get(i);
        }
        self.str(s);
        let i = self.strings[s];
        self.statics.insert(at, i);
    }

    /// A dict whose items `items` writes as key, value, key, value, ….
    pub(super) fn dict(&mut self, items: impl FnOnce(&mut Pickler)) {
        self.out.extend_from_slice(&[EMPTY_DICT, MARK]);
        items(self);
        self.out.push(SETITEMS);
    }

    /// A list whose items `items` writes.
    pub(super) fn list(&mut self, items: impl FnOnce(&mut Pickler)) {
        self.out.extend_from_slice(&[EMPTY_LIST, MARK]);
        items(self);
        self.out.push(APPENDS);
    }

    /// An object shared by several parents (identified by `id`): written the
    /// first time, referenced after.
    pub(super) fn shared(&mut self, id: usize, write: impl FnOnce(&mut Pickler)) {
        if let Some(&i) = self.shared.get(&id) {
            return self.get(i);
        }
        write(self);
        let i = self.memoize();
        self.shared.insert(id, i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_for_small_and_large_values() {
        let mut p = Pickler::new();
        p.list(|p| {
            p.int(7);
            p.int(300);
            p.int(-1);
            p.int(1 << 40);
            p.str("ab");
            p.str("ab");
        });
        let bytes = p.finish();
        assert_eq!(
            bytes,
            [
                &[PROTO, 4, EMPTY_LIST, MARK, BININT1, 7, BININT2, 44, 1, BININT, 255, 255, 255, 255][..],
                &[LONG1, 6, 0, 0, 0, 0, 0, 1],
                &[SHORT_BINUNICODE, 2, b'a', b'b', MEMOIZE, BINGET, 0, APPENDS, STOP],
            ]
            .concat()
        );
    }

    #[test]
    fn json_values_as_python_holds_them() {
        let mut p = Pickler::new();
        p.json(&serde_json::json!([null, true, 1.5, -2, "x"]));
        let bytes = p.finish();
        assert_eq!(
            bytes,
            [
                &[PROTO, 4, EMPTY_LIST, MARK, NONE, NEWTRUE, BINFLOAT][..],
                &1.5f64.to_be_bytes(),
                &[BININT, 254, 255, 255, 255, SHORT_BINUNICODE, 1, b'x', MEMOIZE, APPENDS, STOP],
            ]
            .concat()
        );
    }
}
