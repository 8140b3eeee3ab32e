//! `#[memlab::profile]` on every form of function it must keep exactly as
//! written: each module is code a user writes, which must build without a
//! warning and run. (What the attribute must refuse, with a message that
//! says what to do, is `tests/ui`, compiled by trybuild.)

// Forms a user may write, kept as written even where clippy would not.
#[allow(clippy::multiple_bound_locations)]
mod signatures;
mod tails;
#[allow(clippy::assertions_on_constants, clippy::eq_op)]
mod weird_usage;
