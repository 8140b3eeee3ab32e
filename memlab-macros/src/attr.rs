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
            options.every = parse_period(input)?;
            if !input.is_empty() {
                expect_comma(input)?;
            }
        }
        while !input.is_empty() {
            if input.peek(Token![crate]) {
                let key = input.parse::<Token![crate]>()?;
                expect_eq(input, "crate", "crate = my_reexport::memlab")?;
                if options.krate.is_some() {
                    return Err(Error::new_spanned(key, "`crate` is given twice"));
                }
                options.krate = Some(input.parse::<Path>().map_err(|e| {
                    Error::new(e.span(), "`crate` takes a path, without quotes: `crate = my_reexport::memlab`")
                })?);
            } else {
                let key: syn::Ident = input.parse().map_err(|e| Error::new(e.span(), OPTIONS))?;
                match key.to_string().as_str() {
                    "device" => {
                        expect_eq(input, "device", "device = \"cuda:0\"")?;
                        if options.device.is_some() {
                            return Err(Error::new_spanned(key, "`device` is given twice"));
                        }
                        let value: LitStr = input.parse().map_err(|e| {
                            Error::new(
                                e.span(),
                                "`device` takes a string: \"cpu\", \"cuda\" (the current CUDA device), \"cuda:N\" or \"auto\"",
                            )
                        })?;
                        options.device = Some(parse_device(&value)?);
                    }
                    "every" | "period" => {
                        return Err(Error::new_spanned(
                            key,
                            "the period is not an option: write `#[memlab::profile_every(10)]` to print every 10 calls",
                        ))
                    }
                    _ => return Err(Error::new_spanned(key, OPTIONS)),
                }
            }
            if !input.is_empty() {
                expect_comma(input)?;
            }
        }
        Ok(options)
    }
}

/// What the profile attributes accept, for errors about anything else.
const OPTIONS: &str = "unknown option: memlab's profile attributes take `device = \"cpu\" | \"cuda\" | \"cuda:N\" | \"auto\"` and `crate = path`";

/// The period of `profile_every`: a positive number of calls.
fn parse_period(input: ParseStream) -> Result<u32> {
    const WHAT: &str =
        "profile_every takes a positive number of calls: write `#[memlab::profile_every(10)]` to print every 10 calls";
    let negative = input.peek(Token![-]);
    if negative {
        let minus: Token![-] = input.parse()?;
        return Err(Error::new_spanned(minus, WHAT));
    }
    let n: LitInt = input.parse().map_err(|e| Error::new(e.span(), WHAT))?;
    if n.base10_digits().starts_with('-') {
        return Err(Error::new_spanned(n, WHAT));
    }
    let every: u64 = n.base10_parse().map_err(|_| Error::new_spanned(&n, WHAT))?;
    if every == 0 {
        return Err(Error::new_spanned(n, "the period must be at least 1 call"));
    }
    u32::try_from(every).map_err(|_| Error::new_spanned(&n, "the period is at most 4294967295 calls"))
}

fn expect_eq(input: ParseStream, key: &str, example: &str) -> Result<()> {
    input
        .parse::<Token![=]>()
        .map(drop)
        .map_err(|e| Error::new(e.span(), format!("`{key}` needs a value: write `{example}`")))
}

fn expect_comma(input: ParseStream) -> Result<()> {
    input.parse::<Token![,]>().map(drop).map_err(|e| Error::new(e.span(), "separate the options with commas"))
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
