//! Procedural macros of memlab. Use them through the `memlab` crate
//! (`#[memlab::profile]`, `#[memlab::profile_every(N)]`); the generated code
//! refers to `::memlab::__private`, which is not public API.

mod attr;
mod expand;

use proc_macro::TokenStream;

/// Profiles the memory of every statement of a function, line by line.
///
/// See `memlab::profile` for the semantics and the options.
#[proc_macro_attribute]
pub fn profile(args: TokenStream, item: TokenStream) -> TokenStream {
    match syn::parse::<attr::ProfileArgs>(args) {
        Ok(attr::ProfileArgs(options)) => expand::profile(options, item.into()).into(),
        Err(e) => with_error(item, e),
    }
}

/// Like `profile`, and prints the table of the last N calls every N calls.
///
/// See `memlab::profile_every`.
#[proc_macro_attribute]
pub fn profile_every(args: TokenStream, item: TokenStream) -> TokenStream {
    match syn::parse::<attr::EveryArgs>(args) {
        Ok(attr::EveryArgs(options)) => expand::profile(options, item.into()).into(),
        Err(e) => with_error(item, e),
    }
}

fn with_error(item: TokenStream, error: syn::Error) -> TokenStream {
    let mut out: proc_macro2::TokenStream = item.into();
    out.extend(error.to_compile_error());
    out.into()
}
