//! Parsing of the attribute arguments: `#[profile(device = "cuda:0", crate = path)]`
//! and `#[profile_every(N, …)]`. Each option may appear once; errors point at
//! the offending token and say what is accepted.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::{Error, LitInt, LitStr, Path, Result, Token};

/// A device choice, checked at compile time.
pub enum DeviceArg {
    Auto,
    CurrentCuda,
    Cpu,
    Cuda(usize),
}

pub struct Options {
    pub every: u32,
    pub device: Option<DeviceArg>,
    pub krate: Option<Path>,
}

impl Options {
    /// Parses `#[profile(...)]` arguments (`every_required = false`) or
    /// `#[profile_every(...)]` arguments, whose first argument is the period.
    pub fn parse(input: ParseStream, every_required: bool) -> Result<Options> {
        let mut options = Options { every: 0, device: None, krate: None };
        if every_required {
            if input.is_empty() {
                return Err(Error::new(
                    Span::call_site(),
                    "profile_every needs a period: write `#[memlab::profile_every(10)]` to print every 10 calls",
                ));
            }
            let n: LitInt = input.parse()?;
            options.every = n.base10_parse()?;
            if options.every == 0 {
                return Err(Error::new_spanned(n, "the period must be at least 1 call"));
            }
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        while !input.is_empty() {
            if input.peek(Token![crate]) {
                let key = input.parse::<Token![crate]>()?;
                input.parse::<Token![=]>()?;
                if options.krate.is_some() {
                    return Err(Error::new_spanned(key, "`crate` is given twice"));
                }
                options.krate = Some(input.parse()?);
            } else {
                let key: syn::Ident = input.parse()?;
                input.parse::<Token![=]>()?;
                match key.to_string().as_str() {
                    "device" => {
                        if options.device.is_some() {
                            return Err(Error::new_spanned(key, "`device` is given twice"));
                        }
                        let value: LitStr = input.parse()?;
                        options.device = Some(parse_device(&value)?);
                    }
                    _ => {
                        return Err(Error::new_spanned(
                            key,
                            "unknown option: memlab's profile attributes take `device = \"cpu\" | \"cuda\" | \"cuda:N\" | \"auto\"` and `crate = path`",
                        ))
                    }
                }
            }
            if !input.is_empty() {
                input.parse::<Token![,]>()?;
            }
        }
        Ok(options)
    }
}

fn parse_device(lit: &LitStr) -> Result<DeviceArg> {
    let text = lit.value();
    let device = match text.as_str() {
        "auto" => DeviceArg::Auto,
        "cuda" => DeviceArg::CurrentCuda,
        "cpu" => DeviceArg::Cpu,
        other => match other.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(i) => DeviceArg::Cuda(i),
            None => {
                return Err(Error::new_spanned(
                    lit,
                    format!("`{text}` is not a device: write \"cpu\", \"cuda\" (the current CUDA device), \"cuda:N\" or \"auto\""),
                ))
            }
        },
    };
    Ok(device)
}

pub struct ProfileArgs(pub Options);

impl Parse for ProfileArgs {
    fn parse(input: ParseStream) -> Result<Self> {
        Options::parse(input, false).map(ProfileArgs)
    }
}

pub struct EveryArgs(pub Options);

impl Parse for EveryArgs {
    fn parse(input: ParseStream) -> Result<Self> {
        Options::parse(input, true).map(EveryArgs)
    }
}
