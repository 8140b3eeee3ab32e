//! Peaks for nested intervals.
//!
//! An allocator keeps one high-water mark per counter, and the only way to
//! measure the peak of one statement is to reset it when the statement starts.
//! Resetting would erase the peak that an enclosing statement (the caller's
//! line, a recursive outer call, another thread's statement) has reached so
//! far. The ledger keeps that from happening: every open interval on a device
//! has a slot, and each time any probe reads and resets the allocator, the peak
//! it read is first folded into every open slot. A slot therefore always holds
//! the highest level reached since its interval began.
//!
//! The same fold keeps the peaks a reader of the statistics expects: the
//! highest levels since the process started or since its own last
//! [`reset_peaks`]. Once a probe has reset the allocator, [`read`] gives
//! each peak field as the higher of the allocator's and the ledger's, so
//! that no tool that measures a span (the profiler, the cell logger, the
//! monitors, a peak watch) changes the figures the program reads.

use crate::sync::LockExt;
use std::sync::{Mutex, MutexGuard};

use crate::backend::Backend;
use crate::device::Device;
use crate::error::Result;
use crate::stats::{RawStats, CUMULATIVE_FIELDS, N_FIELDS};

/// The most CUDA devices memlab tracks in one process.
pub const MAX_CUDA_DEVICES: usize = 64;

/// Open intervals of one device: the running peak of each peak field, indexed
/// like [`RawStats`] (only the peak fields are used).
struct Ledger {
    slots: Vec<[i64; N_FIELDS]>,
    open: Vec<bool>,
    free: Vec<usize>,
    /// Running totals taken away by resets since the oldest open interval
    /// began, indexed like [`RawStats`]; `None` when there were none.
    offsets: Option<Box<[i64; N_FIELDS]>>,
    /// The peaks reached since the program's last [`reset_peaks`] (or the
    /// process's start), folded in at every probe's reset: what the
    /// allocator's peak fields would hold had no probe reset them. `None`
    /// while no probe has reset them since: they hold it themselves.
    program: Option<Box<[i64; N_FIELDS]>>,
}

impl Ledger {
    const fn new() -> Self {
        Ledger { slots: Vec::new(), open: Vec::new(), free: Vec::new(), offsets: None, program: None }
    }

    /// Keeps the peaks of `sample`, read right before a probe resets them,
    /// for the program's reads.
    fn keep_for_program(&mut self, sample: &RawStats, peaks: &[usize]) {
        let program = self.program.get_or_insert_with(|| Box::new([0; N_FIELDS]));
        for &i in peaks {
            program[i] = program[i].max(sample.0[i]);
        }
    }

    /// Adds back what resets took from the running totals.
    #[inline]
    fn restore_totals(&self, sample: &mut RawStats) {
        if let Some(offsets) = &self.offsets {
            for &i in CUMULATIVE_FIELDS.iter() {
                sample.0[i] += offsets[i];
            }
        }
    }

    fn close(&mut self, slot: usize) {
        self.open[slot] = false;
        self.free.push(slot);
        if self.free.len() == self.slots.len() {
            // No interval spans a reset any more.
            self.offsets = None;
        }
    }

    fn fold(&mut self, sample: &RawStats, peaks: &[usize]) {
        for (slot, open) in self.slots.iter_mut().zip(&self.open) {
            if *open {
                for &i in peaks {
                    slot[i] = slot[i].max(sample.0[i]);
                }
            }
        }
    }

    /// Right after a reset every peak equals its level, which sits just before
    /// it in each (current, peak, allocated, freed) group.
    fn seed(&mut self, slot: usize, sample: &RawStats, peaks: &[usize]) {
        let s = &mut self.slots[slot];
        for &i in peaks {
            s[i] = sample.0[i - 1];
        }
        self.open[slot] = true;
    }
}

crate::process::process_wide! {
    static LEDGERS: [Mutex<Ledger>; MAX_CUDA_DEVICES + 1] = [const { Mutex::new(Ledger::new()) }; MAX_CUDA_DEVICES + 1];
}

fn ledger(device: Device) -> MutexGuard<'static, Ledger> {
    let index = match device {
        Device::Cpu => 0,
        Device::Cuda(i) => 1 + i.min(MAX_CUDA_DEVICES - 1),
    };
    // A panic while the lock was held cannot leave a slot half-written in a way
    // that matters (peaks only grow), so a poisoned lock is still usable.
    LEDGERS[index].locked()
}

/// Samples `device`, folds its peaks into every open interval, resets the
/// allocator's peaks and opens a new interval. Returns the slot. `peaks` are
/// the peak fields the backend fills for this device.
pub(crate) fn open(backend: &dyn Backend, device: Device, sample: &mut RawStats, peaks: &[usize]) -> Result<usize> {
    let mut l = ledger(device);
    backend.sample(device, sample, true)?;
    l.keep_for_program(sample, peaks);
    l.restore_totals(sample);
    l.fold(sample, peaks);
    let slot = match l.free.pop() {
        Some(slot) => slot,
        None => {
            l.slots.push([0; N_FIELDS]);
            l.open.push(false);
            l.slots.len() - 1
        }
    };
    l.seed(slot, sample, peaks);
    Ok(slot)
}

/// Samples `device`, ends the interval of `slot` (writing its peaks into the
/// peak fields of `sample`), and either starts the next interval in the same
/// slot (`reopen`) or frees the slot.
pub(crate) fn probe(
    backend: &dyn Backend,
    device: Device,
    slot: usize,
    sample: &mut RawStats,
    peaks: &[usize],
    reopen: bool,
) -> Result<()> {
    let mut l = ledger(device);
    let read = backend.sample(device, sample, true);
    if read.is_ok() {
        l.keep_for_program(sample, peaks);
        l.restore_totals(sample);
        l.fold(sample, peaks);
        let ended = &l.slots[slot];
        for &i in peaks {
            sample.0[i] = ended[i];
        }
    }
    if reopen && read.is_ok() {
        l.seed(slot, sample, peaks);
    } else {
        l.close(slot);
    }
    read
}

/// Sets every peak of `device` to its current level, first folding the peaks
/// reached so far into the open intervals, so profiled lines running now keep
/// them. The program's reset: [`read`] gives the peaks from here on.
pub fn reset_peaks(backend: &dyn Backend, device: Device) -> Result<()> {
    let mut l = ledger(device);
    let mut sample = RawStats::default();
    backend.sample(device, &mut sample, true)?;
    l.fold(&sample, backend.peak_fields(device));
    l.program = None;
    Ok(())
}

/// Every figure of `device` as the program reads it: the allocator's, with
/// each peak the highest level since the program's last [`reset_peaks`],
/// however often a probe has reset the allocator's peaks since.
pub fn read(backend: &dyn Backend, device: Device, out: &mut RawStats) -> Result<()> {
    let l = ledger(device);
    backend.sample(device, out, false)?;
    if let Some(program) = &l.program {
        for &i in backend.peak_fields(device) {
            out.0[i] = out.0[i].max(program[i]);
        }
    }
    Ok(())
}

/// Sets the running totals of `device` to zero; intervals open now keep
/// counting from where they were.
pub fn reset_totals(backend: &dyn Backend, device: Device) -> Result<()> {
    let mut l = ledger(device);
    let mut taken = RawStats::default();
    backend.reset_totals(device, &mut taken)?;
    if l.free.len() < l.slots.len() {
        let offsets = l.offsets.get_or_insert_with(|| Box::new([0; N_FIELDS]));
        for &i in CUMULATIVE_FIELDS.iter() {
            offsets[i] += taken.0[i];
        }
    }
    Ok(())
}
