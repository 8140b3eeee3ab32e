//! The names of native functions, from the ELF symbol tables of the loaded
//! modules.
//!
//! libtorch's libraries carry no debug information, but they keep a symbol
//! table with every function's name, its own local ones included
//! (`at::native::run_conv_plan`, which allocates cuDNN's workspace, is one):
//! enough to tell what libtorch allocated for itself, and which backward
//! function of autograd's allocated on its engine's threads. The dynamic
//! symbol table (what `dladdr` reads) holds only exported functions, and the
//! nearest one below an address may well not be the function there.
//!
//! A module's table is read once, on first need, from its file mapped in
//! memory; only the functions' addresses and sizes are kept, and a name is
//! read and demangled when an address inside it is asked for. An address
//! outside every function's extent has no name: nothing is guessed.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use object::{Object, ObjectSymbol, ObjectSymbolTable, SymbolIndex, SymbolKind};

use crate::hash::FastMap;
use crate::sync::LockExt;

/// The demangled name of the function whose code holds the return address
/// `address` (the call before it), if the symbol tables name one.
/// Answers are kept for the process's life: a program has a bounded number
/// of call sites.
pub(crate) fn function_at(address: u64) -> Option<Arc<str>> {
    static NAMED: Mutex<Option<FastMap<u64, Option<Arc<str>>>>> = Mutex::new(None);
    if let Some(known) = NAMED.locked().as_ref().and_then(|m| m.get(&address).cloned()) {
        return known;
    }
    // Read outside the lock: a module's first table takes a while.
    let name = lookup(address.saturating_sub(1)).map(|n| Arc::from(demangle(&n)));
    NAMED.locked().get_or_insert_with(Default::default).entry(address).or_insert(name).clone()
}

/// A module's function symbols: where each starts and ends (the file's
/// addresses) and its index in the table, sorted by start.
struct Table {
    file: object::File<'static>,
    /// Whether the symbols are the dynamic table's (the module has no other).
    dynamic: bool,
    functions: Vec<(u64, u64, u32)>,
}

impl Table {
    fn read(path: &std::path::Path) -> Option<Table> {
        let file = std::fs::File::open(path).ok()?;
        // SAFETY: the file is a loaded module, which is not written while
        // the process runs; the mapping is kept for the process's life, as
        // the loader keeps the module.
        let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
        let data: &'static [u8] = &Box::leak(Box::new(map))[..];
        let file = object::File::parse(data).ok()?;
        let (table, dynamic) = match file.symbol_table() {
            Some(table) if table.symbols().next().is_some() => (table, false),
            _ => (file.dynamic_symbol_table()?, true),
        };
        let mut functions: Vec<(u64, u64, u32)> = table
            .symbols()
            .filter(|s| s.kind() == SymbolKind::Text && s.is_definition() && s.size() > 0)
            .filter_map(|s| Some((s.address(), s.address() + s.size(), u32::try_from(s.index().0).ok()?)))
            .collect();
        functions.sort_unstable();
        Some(Table { file, dynamic, functions })
    }

    /// The raw (mangled) name of the function whose extent holds `address`
    /// (the file's address); the innermost of nested extents.
    fn name_at(&self, address: u64) -> Option<String> {
        let after = self.functions.partition_point(|f| f.0 <= address);
        // Aliases and clones may share a start: look back over those that
        // start at or below the address for one that still holds it.
        let (_, _, index) = self.functions[..after].iter().rev().take(8).find(|f| address < f.1)?;
        let index = SymbolIndex(*index as usize);
        let symbol = match self.dynamic {
            true => self.file.dynamic_symbol_table()?.symbol_by_index(index).ok()?,
            false => self.file.symbol_table()?.symbol_by_index(index).ok()?,
        };
        symbol.name().ok().map(str::to_string)
    }
}

/// The raw name of the function at `address` (a code address, not a return
/// address), from the table of the module mapped there.
fn lookup(address: u64) -> Option<String> {
    static TABLES: Mutex<Vec<(PathBuf, Option<Arc<Table>>)>> = Mutex::new(Vec::new());
    let (path, bias) = super::loader::module_at(address)?;
    let known = TABLES.locked().iter().find(|(p, _)| *p == path).map(|(_, t)| t.clone());
    let table = match known {
        Some(table) => table,
        None => {
            let read = Table::read(&path).map(Arc::new);
            let mut tables = TABLES.locked();
            match tables.iter().find(|(p, _)| *p == path) {
                Some((_, table)) => table.clone(),
                None => {
                    tables.push((path, read.clone()));
                    read
                }
            }
        }
    }?;
    table.name_at(address.checked_sub(bias)?)
}

/// A symbol's name as a person reads it: C++'s and Rust's manglings undone,
/// a compiler's clone suffix (`.cold`, `.isra.0`) kept as a note.
fn demangle(raw: &str) -> String {
    let (symbol, clone) = match raw.find('.') {
        Some(at) if raw.starts_with("_Z") => (&raw[..at], Some(&raw[at + 1..])),
        _ => (raw, None),
    };
    let plain = if symbol.starts_with("_R") || is_legacy_rust(symbol) {
        format!("{:#}", rustc_demangle::demangle(symbol))
    } else if symbol.starts_with("_Z") {
        cpp_demangle::Symbol::new(symbol).ok().and_then(|s| s.demangle().ok()).unwrap_or_else(|| symbol.to_string())
    } else {
        symbol.to_string()
    };
    match clone {
        Some(clone) => format!("{plain} [clone .{clone}]"),
        None => plain,
    }
}

/// Whether `symbol` is Rust's legacy mangling: C++'s nested name whose last
/// part is a hash, `17h` and 16 hexadecimal digits, and nothing after it.
fn is_legacy_rust(symbol: &str) -> bool {
    symbol.starts_with("_ZN")
        && symbol.len() > 20
        && symbol.ends_with('E')
        && symbol[symbol.len() - 20..symbol.len() - 1].starts_with("17h")
        && symbol[symbol.len() - 17..symbol.len() - 1].bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_demangled_as_a_person_reads_them() {
        assert_eq!(
            demangle("_ZN5torch8autograd9generated20ConvolutionBackward05applyEOSt6vectorIN2at6TensorESaIS5_EE"),
            "torch::autograd::generated::ConvolutionBackward0::apply(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)"
        );
        assert_eq!(demangle("_ZN2at6native13run_conv_planEv.cold"), "at::native::run_conv_plan() [clone .cold]");
        assert_eq!(demangle("_ZN4core3ptr13drop_in_place17h0123456789abcdefE"), "core::ptr::drop_in_place");
        assert_eq!(demangle("malloc"), "malloc");
    }

    /// A function of this test program is named by the table, at every
    /// address inside it; an address in no module has no name.
    #[test]
    fn a_function_of_the_program_is_named_from_the_symbol_table() {
        #[inline(never)]
        extern "C" fn memlab_symbols_probe(x: u64) -> u64 {
            std::hint::black_box(x).wrapping_mul(3)
        }
        assert_eq!(memlab_symbols_probe(2), 6);
        let start = memlab_symbols_probe as *const () as u64;
        // A return address one byte in: the call before it is the first byte.
        let name = function_at(start + 1).expect("the program's symbol table names it");
        assert!(name.ends_with("::memlab_symbols_probe"), "{name}");
        assert_ne!(function_at(start), Some(name), "the byte before it is another's, or no function's");
        assert!(function_at(8).is_none(), "no module is mapped at 8");
    }
}
