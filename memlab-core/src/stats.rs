//! The allocator statistics memlab reads: one flat record per device, laid out
//! exactly like libtorch's `c10::CachingDeviceAllocator::DeviceStats`, and named
//! the way `torch.cuda.memory_stats()` names its keys.

use std::fmt;

pub use crate::device::{Device, DeviceSelector};

/// How one field of [`RawStats`] behaves over time, which decides what a
/// profiled statement reports for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// A level (`*.current`, `max_split_size`): the statement reports the level after it ran.
    Current,
    /// A high-water mark (`*.peak`): the statement reports the highest level while it ran.
    Peak,
    /// A running total (`*.allocated`, `*.freed`, `num_*`): the statement reports how much
    /// it added while it ran.
    Cumulative,
}

/// Number of `i64` fields in a [`RawStats`] record.
pub const N_FIELDS: usize = 122;

/// One field of the flat record: its `memory_stats()` name and kind.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    /// The key `torch.cuda.memory_stats()` uses, e.g. `active_bytes.all.peak`.
    pub name: &'static str,
    /// How the field behaves over time.
    pub kind: FieldKind,
}

macro_rules! stat_array_fields {
    ($($array:literal),*) => {
        [$(
            stat_array_fields!(@pool $array, "all"),
            stat_array_fields!(@pool $array, "small_pool"),
            stat_array_fields!(@pool $array, "large_pool"),
        )*]
    };
    (@pool $array:literal, $pool:literal) => {
        [
            Field { name: concat!($array, ".", $pool, ".current"), kind: FieldKind::Current },
            Field { name: concat!($array, ".", $pool, ".peak"), kind: FieldKind::Peak },
            Field { name: concat!($array, ".", $pool, ".allocated"), kind: FieldKind::Cumulative },
            Field { name: concat!($array, ".", $pool, ".freed"), kind: FieldKind::Cumulative },
        ]
    };
}

const ARRAY_FIELDS: [[Field; 4]; 27] = stat_array_fields!(
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes"
);

const TAIL_FIELDS: [Field; 14] = [
    Field { name: "num_alloc_retries", kind: FieldKind::Cumulative },
    Field { name: "num_ooms", kind: FieldKind::Cumulative },
    Field { name: "oversize_allocations.current", kind: FieldKind::Current },
    Field { name: "oversize_allocations.peak", kind: FieldKind::Peak },
    Field { name: "oversize_allocations.allocated", kind: FieldKind::Cumulative },
    Field { name: "oversize_allocations.freed", kind: FieldKind::Cumulative },
    Field { name: "oversize_segments.current", kind: FieldKind::Current },
    Field { name: "oversize_segments.peak", kind: FieldKind::Peak },
    Field { name: "oversize_segments.allocated", kind: FieldKind::Cumulative },
    Field { name: "oversize_segments.freed", kind: FieldKind::Cumulative },
    Field { name: "num_sync_all_streams", kind: FieldKind::Cumulative },
    Field { name: "num_device_alloc", kind: FieldKind::Cumulative },
    Field { name: "num_device_free", kind: FieldKind::Cumulative },
    Field { name: "max_split_size", kind: FieldKind::Current },
];

/// Every field of [`RawStats`], in storage order.
pub static FIELDS: [Field; N_FIELDS] = FIELD_TABLE;

/// [`FIELDS`] as a constant, for compile-time checks of the layout (the C++
/// shim's slots are asserted against it).
pub const FIELD_TABLE: [Field; N_FIELDS] = {
    let mut out = [Field { name: "", kind: FieldKind::Current }; N_FIELDS];
    let mut i = 0;
    while i < 27 {
        let mut j = 0;
        while j < 4 {
            out[i * 4 + j] = ARRAY_FIELDS[i][j];
            j += 1;
        }
        i += 1;
    }
    let mut k = 0;
    while k < TAIL_FIELDS.len() {
        out[108 + k] = TAIL_FIELDS[k];
        k += 1;
    }
    out
};

/// The indices of every field, `0..N_FIELDS`.
pub static ALL_FIELDS: [usize; N_FIELDS] = {
    let mut out = [0; N_FIELDS];
    let mut i = 0;
    while i < N_FIELDS {
        out[i] = i;
        i += 1;
    }
    out
};

/// Index of a field by its `memory_stats()` name, e.g. `reserved_bytes.all.peak`.
pub fn field_index(name: &str) -> Option<usize> {
    FIELDS.iter().position(|f| f.name == name)
}

/// Index in [`FIELDS`] of `array.pool.counter`: `array` counts the stat
/// arrays in `DeviceStats` order (0 = `allocation` … 8 = `requested_bytes`),
/// `pool` is 0 = all, 1 = small_pool, 2 = large_pool, and `counter` is
/// 0 = current, 1 = peak, 2 = allocated, 3 = freed.
pub const fn array_index(array: usize, pool: usize, counter: usize) -> usize {
    (array * 3 + pool) * 4 + counter
}

/// Index of `allocated_bytes.all.current`, whose change is a statement's increment.
pub const ALLOCATED_BYTES_CURRENT: usize = array_index(4, 0, 0);

/// Index in [`FIELDS`] of `num_ooms`: the allocator's count of requests it
/// could not serve (the counting CPU allocator counts its own too).
pub const NUM_OOMS: usize = 109;
const _: () = assert!(field_is(NUM_OOMS, "num_ooms"));

/// Whether field `index` is called `name` (for compile-time checks).
const fn field_is(index: usize, name: &str) -> bool {
    let (a, b) = (FIELDS[index].name.as_bytes(), name.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut k = 0;
    while k < a.len() {
        if a[k] != b[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// All allocator figures of one device as one flat record of `i64`s, in
/// [`FIELDS`] order. This is what the backends fill and the profiler stores.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RawStats(pub [i64; N_FIELDS]);

impl Default for RawStats {
    fn default() -> Self {
        RawStats([0; N_FIELDS])
    }
}

impl fmt::Debug for RawStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(FIELDS.iter().zip(self.0.iter()).filter(|(_, v)| **v != 0).map(|(k, v)| (k.name, v)))
            .finish()
    }
}

impl RawStats {
    /// The value of a field by its `memory_stats()` name.
    pub fn get(&self, name: &str) -> Option<i64> {
        field_index(name).map(|i| self.0[i])
    }

    /// The record as `(name, value)` pairs, in storage order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, i64)> + '_ {
        FIELDS.iter().zip(self.0.iter()).map(|(f, v)| (f.name, *v))
    }

    /// `allocated_bytes.all`: bytes of live allocations (one field group,
    /// without building the whole typed view).
    pub fn allocated_bytes(&self) -> Stat {
        self.stat(4)
    }

    /// `reserved_bytes.all`: bytes the allocator holds, cached ones included.
    pub fn reserved_bytes(&self) -> Stat {
        self.stat(5)
    }

    fn stat(&self, array: usize) -> Stat {
        let at = |counter| self.0[array_index(array, 0, counter)];
        Stat { current: at(0), peak: at(1), allocated: at(2), freed: at(3) }
    }

    /// The typed view of this record.
    pub fn to_device_stats(&self) -> DeviceStats {
        DeviceStats::from(self)
    }
}

/// One allocator counter, as libtorch keeps it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Stat {
    /// The level now.
    pub current: i64,
    /// The highest level since the last peak reset.
    pub peak: i64,
    /// Total added since the last reset of accumulated statistics.
    pub allocated: i64,
    /// Total removed since the last reset of accumulated statistics.
    pub freed: i64,
}

/// A counter kept for all memory and for each of the CUDA caching allocator's pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StatArray {
    /// Both pools together (`*.all.*`).
    pub all: Stat,
    /// Blocks of at most 1 MiB (`*.small_pool.*`); always zero on the CPU.
    pub small_pool: Stat,
    /// Blocks above 1 MiB (`*.large_pool.*`); always zero on the CPU.
    pub large_pool: Stat,
}

/// Every statistic of one device's allocator, the set `torch.cuda.memory_stats()`
/// returns. On the CPU memlab's counting allocator fills the `all` pool of
/// `allocation`, `active`, `segment`, `allocated_bytes`, `active_bytes`,
/// `reserved_bytes` and `requested_bytes`; the CPU keeps no cache, so those
/// byte figures are equal there, and the other fields are zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct DeviceStats {
    /// Number of allocations requested by tensors.
    pub allocation: StatArray,
    /// Number of segments obtained from the device (`cudaMalloc` calls held).
    pub segment: StatArray,
    /// Number of memory blocks in use.
    pub active: StatArray,
    /// Number of cached blocks that are split and unused.
    pub inactive_split: StatArray,
    /// Bytes allocated to tensors (rounded to the allocator's block sizes).
    pub allocated_bytes: StatArray,
    /// Bytes held from the device, in use or cached.
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks, including blocks freed but still awaiting stream use.
    pub active_bytes: StatArray,
    /// Bytes in cached, split, unused blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes tensors asked for, before rounding.
    pub requested_bytes: StatArray,
    /// Times a failed device allocation led the allocator to free its cache and retry.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors raised.
    pub num_ooms: i64,
    /// Allocations above `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments above `max_split_size`.
    pub oversize_segments: Stat,
    /// Times the allocator synchronised all streams.
    pub num_sync_all_streams: i64,
    /// Device allocation calls made.
    pub num_device_alloc: i64,
    /// Device free calls made.
    pub num_device_free: i64,
    /// The allocator's `max_split_size` setting in bytes.
    pub max_split_size: i64,
}

impl From<&RawStats> for DeviceStats {
    fn from(raw: &RawStats) -> Self {
        let r = &raw.0;
        let stat = |i: usize| Stat { current: r[i], peak: r[i + 1], allocated: r[i + 2], freed: r[i + 3] };
        let array = |a: usize| StatArray {
            all: stat(array_index(a, 0, 0)),
            small_pool: stat(array_index(a, 1, 0)),
            large_pool: stat(array_index(a, 2, 0)),
        };
        DeviceStats {
            allocation: array(0),
            segment: array(1),
            active: array(2),
            inactive_split: array(3),
            allocated_bytes: array(4),
            reserved_bytes: array(5),
            active_bytes: array(6),
            inactive_split_bytes: array(7),
            requested_bytes: array(8),
            num_alloc_retries: r[108],
            num_ooms: r[109],
            oversize_allocations: stat(110),
            oversize_segments: stat(114),
            num_sync_all_streams: r[118],
            num_device_alloc: r[119],
            num_device_free: r[120],
            max_split_size: r[121],
        }
    }
}

/// How many fields of [`FIELDS`] are of `kind`.
const fn count_of(kind: FieldKind) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < N_FIELDS {
        if FIELD_TABLE[i].kind as u8 == kind as u8 {
            n += 1;
        }
        i += 1;
    }
    n
}

/// The indices in [`FIELDS`] of the fields of `kind`, in order (`N` is their count).
const fn indices_of<const N: usize>(kind: FieldKind) -> [usize; N] {
    let mut out = [0usize; N];
    let mut n = 0;
    let mut i = 0;
    while i < N_FIELDS {
        if FIELD_TABLE[i].kind as u8 == kind as u8 {
            out[n] = i;
            n += 1;
        }
        i += 1;
    }
    assert!(n == N);
    out
}

/// The indices of every peak field (`*.peak`) of [`RawStats`].
pub static PEAK_FIELDS: [usize; count_of(FieldKind::Peak)] = indices_of(FieldKind::Peak);

/// The indices of every running total (`*.allocated`, `*.freed`, `num_*`) of [`RawStats`].
pub static CUMULATIVE_FIELDS: [usize; count_of(FieldKind::Cumulative)] = indices_of(FieldKind::Cumulative);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_fields_follow_their_level() {
        for &i in PEAK_FIELDS.iter() {
            assert!(FIELDS[i].name.ends_with(".peak"));
            assert_eq!(FIELDS[i - 1].name.replace(".current", ".peak"), FIELDS[i].name);
        }
        assert!(PEAK_FIELDS.contains(&field_index("active_bytes.all.peak").unwrap()));
    }

    #[test]
    fn field_table_matches_memory_stats_names() {
        assert_eq!(FIELDS[0].name, "allocation.all.current");
        assert_eq!(FIELDS[ALLOCATED_BYTES_CURRENT].name, "allocated_bytes.all.current");
        let mut raw = RawStats::default();
        for (i, v) in raw.0.iter_mut().enumerate() {
            *v = i as i64;
        }
        assert_eq!(raw.allocated_bytes(), raw.to_device_stats().allocated_bytes.all);
        assert_eq!(raw.reserved_bytes(), raw.to_device_stats().reserved_bytes.all);
        assert_eq!(FIELDS[array_index(6, 2, 1)].name, "active_bytes.large_pool.peak");
        assert_eq!(FIELDS[107].name, "requested_bytes.large_pool.freed");
        assert_eq!(FIELDS[121].name, "max_split_size");
        let mut names: Vec<_> = FIELDS.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), N_FIELDS, "field names are unique");
    }

    #[test]
    fn typed_view_reads_the_right_slots() {
        let mut raw = RawStats::default();
        raw.0[field_index("active_bytes.all.peak").unwrap()] = 7;
        raw.0[field_index("num_ooms").unwrap()] = 2;
        raw.0[field_index("oversize_segments.freed").unwrap()] = 3;
        let s = raw.to_device_stats();
        assert_eq!(s.active_bytes.all.peak, 7);
        assert_eq!(s.num_ooms, 2);
        assert_eq!(s.oversize_segments.freed, 3);
        assert_eq!(raw.get("active_bytes.all.peak"), Some(7));
        assert_eq!(raw.get("no_such_stat"), None);
    }
}
