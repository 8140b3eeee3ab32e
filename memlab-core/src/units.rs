//! Byte units, defined once: the allocators count in bytes, libtorch's
//! settings in MiB.

/// One KiB.
pub const KIB: u64 = 1 << 10;
/// One MiB, the unit of libtorch's `_mb` settings.
pub const MIB: u64 = 1 << 20;
/// One GiB.
pub const GIB: u64 = 1 << 30;
