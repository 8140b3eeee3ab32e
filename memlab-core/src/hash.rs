//! Hash maps for the keys memlab makes itself: allocator addresses, device
//! indices, ids, event numbers, return addresses, short fixed strings.
//!
//! The keys come from the allocator and from memlab, not from an adversary,
//! so SipHash's protection against chosen keys buys nothing, and it costs a
//! good part of an allocation event and most of an export's time. A
//! multiply-rotate mix per word is enough.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-rotate hasher (see the module documentation).
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            self.write_u64(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, byte: u8) {
        self.write_u64(u64::from(byte));
    }

    #[inline]
    fn write_u32(&mut self, word: u32) {
        self.write_u64(u64::from(word));
    }

    #[inline]
    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    #[inline]
    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }

    #[inline]
    fn write_isize(&mut self, word: isize) {
        self.write_u64(word as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A `HashSet` with [`FastHasher`].
pub type FastSet<K> = HashSet<K, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hash;

    fn hash(value: impl Hash) -> u64 {
        let mut h = FastHasher::default();
        value.hash(&mut h);
        h.finish()
    }

    #[test]
    fn nearby_addresses_and_short_strings_spread() {
        let addresses: FastSet<u64> = (0..10_000u64).map(|i| hash(0x7f00_0000_0000 + 64 * i) >> 50).collect();
        assert!(addresses.len() > 8000, "top bits of aligned addresses spread: {}", addresses.len());
        assert_ne!(hash("frames"), hash("framez"));
        assert_ne!(hash("abcdefgh1"), hash("abcdefgh2"), "the tail after the last word counts");
    }
}
