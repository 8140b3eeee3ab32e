//! The libtorch versions memlab supports, and reading one from libtorch's
//! `torch/version.h`. Shared by the build script (which refuses any other
//! version before compiling C++) and the crate (whose tests check the
//! parser), through `#[path]`.

/// A libtorch version: major, minor, patch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LibtorchVersion {
    /// `TORCH_VERSION_MAJOR`.
    pub major: u32,
    /// `TORCH_VERSION_MINOR`.
    pub minor: u32,
    /// `TORCH_VERSION_PATCH`.
    pub patch: u32,
}

impl std::fmt::Display for LibtorchVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The supported libtorch releases (major, minor) and the tch release that
/// binds each.
pub const SUPPORTED: [((u32, u32), &str); 2] = [((2, 11), "0.24"), ((2, 13), "0.26")];

impl LibtorchVersion {
    /// The version `header` (the text of libtorch's `torch/version.h`, or
    /// of `torch/headeronly/version.h`, which it includes in 2.11 and later)
    /// defines with `TORCH_VERSION_MAJOR`, `_MINOR` and `_PATCH`.
    pub fn parse(header: &str) -> Result<LibtorchVersion, String> {
        let field = |name: &str| -> Result<u32, String> {
            header
                .lines()
                .filter_map(|line| line.trim().strip_prefix("#define"))
                .find_map(|rest| {
                    let mut words = rest.split_whitespace();
                    (words.next() == Some(name)).then(|| words.next())
                })
                .flatten()
                .ok_or_else(|| format!("it defines no {name}"))?
                .parse()
                .map_err(|_| format!("its {name} is not a number"))
        };
        Ok(LibtorchVersion {
            major: field("TORCH_VERSION_MAJOR")?,
            minor: field("TORCH_VERSION_MINOR")?,
            patch: field("TORCH_VERSION_PATCH")?,
        })
    }

    /// The tch release that binds this libtorch, when memlab supports it.
    pub fn tch(self) -> Option<&'static str> {
        SUPPORTED.iter().find(|((major, minor), _)| (*major, *minor) == (self.major, self.minor)).map(|(_, tch)| *tch)
    }

    /// Ok for a supported version; otherwise the one sentence a build prints.
    pub fn check(self) -> Result<(), String> {
        if self.tch().is_some() {
            return Ok(());
        }
        let supported: Vec<String> =
            SUPPORTED.iter().map(|((major, minor), tch)| format!("{major}.{minor} (tch {tch})")).collect();
        Err(format!(
            "memlab supports libtorch {}, not the libtorch {self} found: build with one of those (its tch \
             release's torch, from PyPI; scripts/env.sh sets up 2.11.0, or 2.13.0 with MEMLAB_TORCH=2.13.0)",
            supported.join(" and ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER_2_11: &str = "#pragma once\n\n/// Indicates the major version of LibTorch.\n#define TORCH_VERSION_MAJOR 2\n\n\
        /// Indicates the minor version of LibTorch.\n#define TORCH_VERSION_MINOR 11\n\n#define TORCH_VERSION_PATCH 0\n\n\
        #define TORCH_VERSION_ABI_TAG 0\n#define TORCH_VERSION \\\n  \"2.11.0\"\n";

    #[test]
    fn versions_are_read_from_the_header() {
        let v = LibtorchVersion::parse(HEADER_2_11).unwrap();
        assert_eq!((v.major, v.minor, v.patch), (2, 11, 0));
        assert_eq!(v.to_string(), "2.11.0");
        assert_eq!(v.tch(), Some("0.24"));
        let v = LibtorchVersion::parse(&HEADER_2_11.replace("MINOR 11", "MINOR 13").replace("PATCH 0", "PATCH 1"));
        assert_eq!(v.map(|v| (v.to_string(), v.tch())), Ok(("2.13.1".to_string(), Some("0.26"))));
    }

    #[test]
    fn an_unsupported_or_unreadable_version_says_what_to_do() {
        let v = LibtorchVersion::parse(&HEADER_2_11.replace("MINOR 11", "MINOR 12")).unwrap();
        let why = v.check().unwrap_err();
        assert!(
            why.starts_with(
                "memlab supports libtorch 2.11 (tch 0.24) and 2.13 (tch 0.26), not the libtorch 2.12.0 found"
            ),
            "{why}"
        );
        assert!(LibtorchVersion::parse(HEADER_2_11).unwrap().check().is_ok());
        assert_eq!(
            LibtorchVersion::parse("#define TORCH_VERSION_MAJOR 2\n"),
            Err("it defines no TORCH_VERSION_MINOR".into())
        );
        assert!(LibtorchVersion::parse("#define TORCH_VERSION_MAJOR two").unwrap_err().contains("not a number"));
    }
}
