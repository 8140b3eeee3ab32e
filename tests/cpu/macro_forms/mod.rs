//! `#[memlab::profile]` on every form of function it must keep exactly as
//! written: each module is code a user writes, which must build without a
//! warning and run. (What the attribute must refuse, with a message that
//! says what to do, is `tests/ui`, compiled by trybuild.)

mod signatures;
mod tails;
mod weird_usage;
