//! The caching allocator's settings as libtorch 2.11 parses them from
//! `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`):
//! `expandable_segments:True,max_split_size_mb:128`. Read in PyTorch's
//! `c10/core/AllocatorConfig.cpp` (`AcceleratorAllocatorConfig::parseArgs`)
//! and `c10/cuda/CUDAAllocatorConfig.cpp` (`CUDAAllocatorConfig::parseArgs`)
//! as shipped in 2.11.0 (git 70d99e99), whose headers the wheel carries.
//! The table of what it refuses and clamps is on [`AllocatorConfig`].

use super::Libtorch;
use crate::error::{Error, Result};
use crate::export::AllocatorSettings;

pub use crate::units::MIB;
/// Buckets of `roundup_power2_divisions`: `[1 MiB, 2 MiB)` and below, then
/// one per power of two up to `>= 32 GiB` (`kRoundUpPowerOfTwoIntervals`).
pub const DIVISION_BUCKETS: usize = 16;
/// Requests from here on fail at once, as libtorch's (`one_exa_bytes`).
/// Also the largest device the model takes: no device has as much, and
/// below it every sum of the model's figures stays within `i64`.
pub const ONE_EXABYTE: u64 = 1 << 60;
/// `kMinLargeAlloc`: requests from here on get a segment of their own size
/// (rounded up to 2 MiB), and `large_segment_size_mb` must exceed it.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;

/// The settings of libtorch's CUDA caching allocator that decide where
/// memory goes, read as libtorch 2.11 reads `PYTORCH_CUDA_ALLOC_CONF`.
///
/// What libtorch 2.11 does with each key: how it reads the value, what it
/// refuses (with its own message, which memlab quotes) and what it clamps,
/// each refusal and clamp tried on 2.11.0+cu130's own libraries. The one
/// table `--setting` strings and the settings a snapshot records are both
/// read through.
///
/// | key | value | refused | clamped or changed |
/// |---|---|---|---|
/// | `large_segment_size_mb` | `stoull`, MiB, read before every other key | ≤ 10 | above `SIZE_MAX / 1 MiB` |
/// | `max_split_size_mb` | `stoull`, MiB | below the large segment size | above `SIZE_MAX / 1 MiB`: not unlimited then |
/// | `max_non_split_rounding_mb` | `stoull`, MiB | below the large segment size | above `SIZE_MAX / 1 MiB`; a request plus it wraps in `size_t` |
/// | `garbage_collection_threshold` | `stod` | outside (0, 1) | |
/// | `roundup_power2_divisions` | `stoull`, or `[MiB:n,…,>:n]` | not a power of two (0 too; in a list 0 is "none"); a list's bound not a power of two | a bound past 32 GiB goes to the last bucket; 2^55 or more rounds to powers of two (`512 × n` wraps) |
/// | `expandable_segments` | `True` or `False` | anything else | |
/// | `per_process_memory_fraction` | `stod` | outside [0, 1] | |
/// | `backend` | `native` or `cudaMallocAsync` | anything else; memlab refuses `cudaMallocAsync` (not modelled) | |
/// | `pinned_num_register_threads` | `stoull` | not a power of two, above 128 | |
/// | `pinned_reserve_segment_size_mb` | `stoull` | 0 | |
/// | `release_lock_on_cudamalloc`, `release_lock_on_hipmalloc`, `pinned_use_cuda_host_register`, `pinned_use_hip_host_register`, `pinned_use_background_threads`, `graph_capture_record_stream_reuse` | `True` or `False` | anything else | |
/// | 2.13 only: `pinned_free_catch_all` | `True` or `False` | anything else | |
/// | 2.13 only: `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb` | `stoull`, MiB | | |
/// | 2.13 only: `throw_on_cudamalloc_oom` | `True` or `False` | anything else; memlab refuses `True` (not modelled) | |
///
/// [`read_as`](Self::read_as) reads a string as another version does
/// (see [`Libtorch`] for what differs); 2.13's four keys more were read in
/// its headers, not tried against its libraries.
///
/// Every number is read as C++'s `stoull` and `stod` read it: digits after
/// an optional sign, the rest ignored (`30abc` is 30, said in the notes), a
/// negative wrapped modulo 2^64 (`-1` is 2^64 − 1, then clamped); no digits,
/// or a number past the type, is refused. Separators are not checked
/// (`max_split_size_mb,128` is read as `max_split_size_mb:128`), as
/// libtorch does not check them.
///
/// The default is libtorch's: no `max_split_size`, no rounding beyond 512
/// bytes, 20 MiB large segments, no garbage collection, no expandable
/// segments, no memory fraction.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct AllocatorConfig {
    /// `max_split_size_mb`, in bytes: blocks this large are not split, and
    /// serve smaller requests never (`None`: no limit, libtorch's `SIZE_MAX`).
    pub max_split_size: Option<u64>,
    /// `max_non_split_rounding_mb`, in bytes: how much larger than a request
    /// of at least `max_split_size` a cached block that serves it may be
    /// (defaults to the large segment size).
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions`, per bucket (0: no rounding beyond 512 bytes).
    pub roundup_power2_divisions: [u64; DIVISION_BUCKETS],
    /// `garbage_collection_threshold` (0: off). libtorch applies it only
    /// under a memory fraction below 1.
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `large_segment_size_mb`, in bytes: the segment of a request between
    /// 1 and 10 MiB, and an expandable large segment's page.
    pub large_segment_size: u64,
    /// `per_process_memory_fraction` (1: no limit), which
    /// `set_per_process_memory_fraction` overrides.
    pub memory_fraction: f64,
    /// Keys that libtorch accepts and that change nothing the model shows
    /// (pinned host memory, locking), as given.
    pub without_effect: Vec<String>,
    /// The libtorch whose allocator these settings are for: how they were
    /// read, and which allocator the model follows.
    pub libtorch: Libtorch,
}

impl Default for AllocatorConfig {
    fn default() -> AllocatorConfig {
        AllocatorConfig {
            max_split_size: None,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: [0; DIVISION_BUCKETS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            large_segment_size: 20 * MIB,
            memory_fraction: 1.0,
            without_effect: Vec::new(),
            libtorch: Libtorch::default(),
        }
    }
}

/// The most MiB a size key holds: libtorch clamps to `SIZE_MAX / 1 MiB`.
pub const MAX_MB: u64 = u64::MAX / MIB;

/// The most pinned-memory register threads (`pinned_max_register_threads`).
const MAX_REGISTER_THREADS: u64 = 128;

fn bad(text: &str, why: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("allocator setting `{text}`: {why}"))
}

/// libtorch's own refusal, quoted.
fn refused(libtorch: Libtorch, message: impl std::fmt::Display) -> String {
    format!("{libtorch} refuses it (\"{message}\")")
}

/// Settings as libtorch reads them, with what it changed on the way.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadSettings {
    /// The settings.
    pub config: AllocatorConfig,
    /// What libtorch 2.11 read otherwise than written: values clamped,
    /// wrapped or cut short, each a sentence.
    pub notes: Vec<String>,
}

impl AllocatorConfig {
    /// Parses settings written as for `PYTORCH_CUDA_ALLOC_CONF`
    /// (`key:value,key:value`; whitespace ignored), as libtorch 2.11 reads
    /// them (see the table on [`AllocatorConfig`]). An empty string is
    /// the default. Refuses what libtorch refuses, and
    /// `backend:cudaMallocAsync`, which is another allocator: CUDA's own,
    /// which memlab does not model.
    pub fn parse(text: &str) -> Result<AllocatorConfig> {
        AllocatorConfig::read(text).map(|read| read.config)
    }

    /// [`parse`](Self::parse), with what libtorch changed on the way.
    pub fn read(text: &str) -> Result<ReadSettings> {
        AllocatorConfig::read_as(text, Libtorch::default())
    }

    /// [`read`](Self::read) as `libtorch` reads the string (2.13 knows four
    /// keys more): settings for that version's allocator.
    pub fn read_as(text: &str, libtorch: Libtorch) -> Result<ReadSettings> {
        let tokens = tokenize(text);
        let mut reader = Reader { text, tokens: &tokens, notes: Vec::new(), libtorch };
        let config = reader.settings()?;
        Ok(ReadSettings { config, notes: reader.notes })
    }

    /// The settings as `PYTORCH_CUDA_ALLOC_CONF` would give them, only what
    /// differs from the default (`""` for the default).
    pub fn to_conf(&self) -> String {
        let default = AllocatorConfig::default();
        let mut out = Vec::new();
        if self.large_segment_size != default.large_segment_size {
            out.push(format!("large_segment_size_mb:{}", self.large_segment_size / MIB));
        }
        if let Some(mss) = self.max_split_size {
            out.push(format!("max_split_size_mb:{}", mss / MIB));
        }
        if self.max_non_split_rounding != self.large_segment_size {
            out.push(format!("max_non_split_rounding_mb:{}", self.max_non_split_rounding / MIB));
        }
        if self.garbage_collection_threshold > 0.0 {
            out.push(format!("garbage_collection_threshold:{}", self.garbage_collection_threshold));
        }
        let d = &self.roundup_power2_divisions;
        if d.iter().any(|v| *v != 0) {
            if d.iter().all(|v| *v == d[0]) {
                out.push(format!("roundup_power2_divisions:{}", d[0]));
            } else {
                let list: Vec<String> = d.iter().enumerate().map(|(i, v)| format!("{}:{v}", 1u64 << i)).collect();
                out.push(format!("roundup_power2_divisions:[{}]", list.join(",")));
            }
        }
        if self.expandable_segments {
            out.push("expandable_segments:True".into());
        }
        if self.memory_fraction < 1.0 {
            out.push(format!("per_process_memory_fraction:{}", self.memory_fraction));
        }
        out.join(",")
    }

    /// The settings a PyTorch snapshot's `allocator_settings` give (2.5
    /// and later): the environment's `PYTORCH_CUDA_ALLOC_CONF` as written,
    /// then the values libtorch holds, which win (a setting changed at run
    /// time shows there). Keys libtorch does not list there
    /// (`large_segment_size_mb`, `max_non_split_rounding_mb`, the memory
    /// fraction) come from the environment's string alone. A value
    /// libtorch 2.11 could not have held (a `max_split_size` below the
    /// large segment size or not whole MiB, a threshold outside (0, 1),
    /// divisions not a power of two) is refused, saying which.
    pub fn from_snapshot(settings: &AllocatorSettings) -> Result<AllocatorConfig> {
        AllocatorConfig::read_snapshot(settings).map(|read| read.config)
    }

    /// [`from_snapshot`](Self::from_snapshot), with what libtorch changed
    /// on the way in the environment's string.
    pub fn read_snapshot(settings: &AllocatorSettings) -> Result<ReadSettings> {
        AllocatorConfig::read_snapshot_as(settings, Libtorch::default())
    }

    /// [`read_snapshot`](Self::read_snapshot) for a snapshot `libtorch` wrote.
    pub fn read_snapshot_as(settings: &AllocatorSettings, libtorch: Libtorch) -> Result<ReadSettings> {
        let held = |key: &str, value: String, why: String| {
            Error::InvalidArgument(format!(
                "the snapshot's allocator_settings hold {key} = {value}, which {libtorch} cannot hold: {why}"
            ))
        };
        // A key libtorch writes, with a value not of its type.
        for (key, why) in [
            ("PYTORCH_CUDA_ALLOC_CONF", "not a string"),
            ("max_split_size", "not a whole number of bytes"),
            ("garbage_collection_threshold", "not a number"),
            ("expandable_segments", "not True or False"),
            ("roundup_power2_divisions", "not a dict of whole numbers"),
        ] {
            if let Some(value) = settings.other.get(key) {
                return Err(held(key, value.to_string(), why.to_string()));
            }
        }
        let mut read = AllocatorConfig::read_as(settings.conf.as_deref().unwrap_or(""), libtorch)?;
        let config = &mut read.config;
        let minimum = config.large_segment_size;
        if let Some(n) = settings.max_split_size {
            // libtorch writes `int64_t(size_t)`: unlimited (SIZE_MAX) as -1,
            // its clamped largest as -1048576.
            let bytes = if n < 0 { n as i64 as u64 } else { u64::try_from(n).unwrap_or(u64::MAX) };
            config.max_split_size = if bytes == u64::MAX {
                None
            } else if bytes % MIB != 0 || bytes < minimum {
                return Err(held(
                    "max_split_size",
                    n.to_string(),
                    format!(
                        "it is set in whole MiB, at least the large segment size ({}); {}",
                        minimum / MIB,
                        refused(
                            libtorch,
                            format!(
                                "CachingAllocator option max_split_size_mb too small, must be >= {}",
                                minimum / MIB
                            )
                        )
                    ),
                ));
            } else {
                Some(bytes)
            };
        }
        if let Some(t) = settings.garbage_collection_threshold {
            // 0 is libtorch's default: off.
            if t != 0.0 && !(t > 0.0 && t < 1.0) {
                return Err(held(
                    "garbage_collection_threshold",
                    t.to_string(),
                    refused(libtorch, "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),
                ));
            }
            config.garbage_collection_threshold = t;
        }
        if let Some(expandable) = settings.expandable_segments {
            config.expandable_segments = expandable;
        }
        if let Some(divisions) = &settings.roundup_power2_divisions {
            let shown = || serde_json::to_string(divisions).unwrap_or_default();
            // Keyed by each bucket's start in MiB: 1, 2, 4, … 32768.
            for (mb, &n) in divisions {
                let bucket = mb.parse::<u64>().ok().filter(|m| m.is_power_of_two()).map(|m| m.trailing_zeros());
                let Some(bucket) = bucket.filter(|&b| (b as usize) < DIVISION_BUCKETS) else {
                    return Err(held(
                        "roundup_power2_divisions",
                        shown(),
                        format!("{mb} is not a bucket (1, 2, 4, … 32768 MiB)"),
                    ));
                };
                if n != 0 && !n.is_power_of_two() {
                    return Err(held(
                        "roundup_power2_divisions",
                        shown(),
                        refused(libtorch, "For roundups, the divisions has to be power of 2 or 0 to disable roundup"),
                    ));
                }
                config.roundup_power2_divisions[bucket as usize] = n;
            }
        }
        Ok(read)
    }

    /// Whether `other` places memory as these settings do: the same in
    /// everything but the keys without effect and the memory fraction (which
    /// the device's run, not the settings string, decides).
    pub fn same_effect(&self, other: &AllocatorConfig) -> bool {
        let plain =
            |c: &AllocatorConfig| AllocatorConfig { without_effect: Vec::new(), memory_fraction: 1.0, ..c.clone() };
        plain(self) == plain(other)
    }

    /// The power-of-two divisions for a request of `size` bytes
    /// (`roundup_power2_divisions(size)`, AllocatorConfig.cpp).
    pub fn divisions(&self, size: u64) -> u64 {
        let log = 63 - u64::from(size.max(1).leading_zeros());
        let index = if log > 20 { (log - 20) as usize } else { 0 };
        self.roundup_power2_divisions[index.min(DIVISION_BUCKETS - 1)]
    }
}

/// The string cut as libtorch's `ConfigTokenizer` cuts it: C's whitespace
/// dropped anywhere, each of `,` `:` `[` `]` a token of its own, the runs
/// between them words.
fn tokenize(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    // C's isspace, not Unicode's: a no-break space stays in its word.
    for c in text.chars().filter(|c| !matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r')) {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                tokens.push(std::mem::take(&mut word));
            }
            tokens.push(c.to_string());
        } else {
            word.push(c);
        }
    }
    if !word.is_empty() {
        tokens.push(word);
    }
    tokens
}

/// The parse, token by token, as `parseArgs` walks them: a key, a
/// separator (not checked), its value; then a separator (not checked).
struct Reader<'t> {
    text: &'t str,
    tokens: &'t [String],
    notes: Vec<String>,
    libtorch: Libtorch,
}

impl Reader<'_> {
    fn settings(&mut self) -> Result<AllocatorConfig> {
        let mut config = AllocatorConfig { libtorch: self.libtorch, ..AllocatorConfig::default() };
        let (switches, pinned_sizes) = (self.libtorch.switches_without_effect(), self.libtorch.pinned_sizes());
        // libtorch reads the large segment size first, wherever it is: the
        // other sizes are checked against it.
        for i in 0..self.tokens.len() {
            if self.tokens[i] == "large_segment_size_mb" {
                let mb = self.size(i + 2)?;
                if mb <= MIN_LARGE_ALLOC / MIB {
                    return Err(self.refused("CachingAllocator option large_segment_size_mb must be > 10 MB"));
                }
                config.large_segment_size = self.clamped("large_segment_size_mb", mb) * MIB;
            }
        }
        config.max_non_split_rounding = config.large_segment_size;
        let minimum = config.large_segment_size / MIB;
        let mut i = 0;
        while i < self.tokens.len() {
            let key = self.tokens[i].as_str();
            let value = i + 2;
            i = value;
            match key {
                "large_segment_size_mb" => {}
                "max_split_size_mb" | "max_non_split_rounding_mb" => {
                    let mb = self.size(value)?;
                    if mb < minimum {
                        return Err(
                            self.refused(format!("CachingAllocator option {key} too small, must be >= {minimum}"))
                        );
                    }
                    let bytes = self.clamped(key, mb) * MIB;
                    if key == "max_split_size_mb" {
                        config.max_split_size = Some(bytes);
                    } else {
                        config.max_non_split_rounding = bytes;
                    }
                }
                "garbage_collection_threshold" => {
                    let t = self.double(value)?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(self.refused("garbage_collect_threshold is invalid, set it in (0.0, 1.0)"));
                    }
                    config.garbage_collection_threshold = t;
                }
                "per_process_memory_fraction" => {
                    let f = self.double(value)?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err(self.refused("per_process_memory_fraction is invalid, set it in [0.0, 1.0]"));
                    }
                    config.memory_fraction = f;
                }
                "roundup_power2_divisions" => {
                    (config.roundup_power2_divisions, i) = self.divisions(value)?;
                }
                "expandable_segments" => config.expandable_segments = self.boolean(value)?,
                "backend" => match self.token(value)? {
                    "native" => {}
                    "cudaMallocAsync" => {
                        return Err(bad(
                            self.text,
                            "backend:cudaMallocAsync is CUDA's own allocator, which memlab does not model; replay \
                             with the native backend's settings instead",
                        ))
                    }
                    _ => return Err(self.refused("Unknown allocator backend, options are native and cudaMallocAsync")),
                },
                "pinned_num_register_threads" => {
                    let n = self.size(value)?;
                    if !n.is_power_of_two() {
                        return Err(self.refused(format!("Number of register threads has to be power of 2, got {n}")));
                    }
                    if n > MAX_REGISTER_THREADS {
                        return Err(self.refused(format!(
                            "Number of register threads should be less than or equal to {MAX_REGISTER_THREADS}, got {n}"
                        )));
                    }
                }
                "pinned_reserve_segment_size_mb" => {
                    if self.size(value)? == 0 {
                        return Err(self.refused("Pinned reserve segment size has to be greater than 0"));
                    }
                }
                k if pinned_sizes.contains(&k) => {
                    self.size(value)?;
                }
                "throw_on_cudamalloc_oom" if self.libtorch.has_preemptive_oom() => {
                    if self.boolean(value)? {
                        return Err(bad(
                            self.text,
                            format!(
                                "throw_on_cudamalloc_oom:True makes {} refuse a request over the memory fraction \
                                 before it frees its cache, which memlab does not model yet; replay without it",
                                self.libtorch
                            ),
                        ));
                    }
                }
                k if switches.contains(&k) => {
                    self.boolean(value)?;
                }
                other => return Err(self.refused(format!("Unrecognized key '{other}' in CUDA allocator config."))),
            }
            let kept = ["pinned_num_register_threads", "throw_on_cudamalloc_oom"];
            if switches.contains(&key) || pinned_sizes.contains(&key) || kept.contains(&key) {
                config.without_effect.push(format!("{key}:{}", self.tokens[value]));
            }
            // The separator after the value, whatever it is.
            if i + 1 < self.tokens.len() {
                i += 1;
            }
            i += 1;
        }
        // libtorch adds the rounding to an oversize request's size (one of
        // max_split_size or more) in size_t: from where the sum wraps, no
        // cached block serves it.
        let wraps_from = (u64::MAX - config.max_non_split_rounding).saturating_add(1);
        let Some(mss) = config.max_split_size else { return Ok(config) };
        if wraps_from <= mss {
            self.notes.push(format!(
                "max_non_split_rounding_mb:{}: libtorch adds it to a request's size in 64 bits, where the sum \
                 wraps for every request of max_split_size_mb or more, so no cached block serves one again: the \
                 model does the same",
                config.max_non_split_rounding / MIB
            ));
        } else if wraps_from < ONE_EXABYTE {
            self.notes.push(format!(
                "max_non_split_rounding_mb:{}: libtorch adds it to a request's size in 64 bits, where the sum \
                 wraps for requests of {wraps_from} bytes or more: no cached block serves those again (the model \
                 does the same)",
                config.max_non_split_rounding / MIB
            ));
        }
        Ok(config)
    }

    fn refused(&self, message: impl std::fmt::Display) -> Error {
        bad(self.text, refused(self.libtorch, message))
    }

    /// The token at `i`, or libtorch's internal assertion when there is none.
    fn token(&self, i: usize) -> Result<&str> {
        self.tokens.get(i).map(String::as_str).ok_or_else(|| {
            bad(
                self.text,
                "a key without its value; libtorch stops on an internal assertion (\"Index out of bounds in \
                 ConfigTokenizer\")",
            )
        })
    }

    /// `mb` MiB of `key`, clamped as libtorch clamps it.
    fn clamped(&mut self, key: &str, mb: u64) -> u64 {
        if mb > MAX_MB {
            self.notes.push(format!(
                "{key}:{mb} is clamped to {MAX_MB}, the most MiB a 64-bit size holds{}",
                if key == "max_split_size_mb" {
                    " (not unlimited: libtorch tells that by the unclamped SIZE_MAX)"
                } else {
                    ""
                }
            ));
        }
        mb.min(MAX_MB)
    }

    /// The token at `i` read as `std::stoull` reads it.
    fn size(&mut self, i: usize) -> Result<u64> {
        let token = self.token(i)?;
        let (negative, rest) = match token.as_bytes().first() {
            Some(b'-') => (true, &token[1..]),
            Some(b'+') => (false, &token[1..]),
            _ => (false, token),
        };
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(bad(
                self.text,
                format!("`{token}` is not a whole number; {} refuses it (\"stoull\")", self.libtorch),
            ));
        }
        let magnitude: u64 = rest[..digits].parse().map_err(|_| {
            bad(
                self.text,
                format!("{token} is past the largest 64-bit number; {} refuses it (\"stoull\")", self.libtorch),
            )
        })?;
        let value = if negative { magnitude.wrapping_neg() } else { magnitude };
        if digits < rest.len() {
            self.notes.push(format!("`{token}` is read as {value}: libtorch's stoull ignores what follows the digits"));
        } else if negative && magnitude != 0 {
            self.notes.push(format!("`{token}` is read as {value}: libtorch's stoull wraps a negative number"));
        }
        Ok(value)
    }

    /// The token at `i` read as `std::stod` reads it (decimal).
    fn double(&mut self, i: usize) -> Result<f64> {
        let token = self.token(i)?;
        let number = (1..=token.len()).rev().find_map(|end| {
            let head = token.get(..end)?;
            head.parse::<f64>().ok().map(|v| (v, head))
        });
        let Some((value, head)) = number else {
            return Err(bad(self.text, format!("`{token}` is not a number; {} refuses it (\"stod\")", self.libtorch)));
        };
        let finite_text = !head.to_ascii_lowercase().contains("inf");
        let nonzero_text = head.bytes().take_while(|b| !matches!(b, b'e' | b'E')).any(|b| (b'1'..=b'9').contains(&b));
        // glibc's strtod reports a subnormal result out of range too.
        let underflow = (value == 0.0 && nonzero_text) || (value != 0.0 && value.abs() < f64::MIN_POSITIVE);
        if (value.is_infinite() && finite_text) || underflow {
            return Err(bad(
                self.text,
                format!("{token} is past what a double holds; {} refuses it (\"stod\")", self.libtorch),
            ));
        }
        if head.len() < token.len() {
            self.notes.push(format!("`{token}` is read as {value}: libtorch's stod ignores what follows the number"));
        }
        Ok(value)
    }

    /// The token at `i`: `True` or `False`, nothing else.
    fn boolean(&self, i: usize) -> Result<bool> {
        match self.token(i)? {
            "True" => Ok(true),
            "False" => Ok(false),
            other => {
                Err(self
                    .refused(format!("Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{other}'")))
            }
        }
    }

    /// `roundup_power2_divisions`' value at `i`: one number for every
    /// bucket, or a list `[MiB:n,…,>:n]` whose first entry also fills the
    /// buckets below it, whose `>` fills those after the last entry, and
    /// whose gaps keep 0 (`parseRoundUpPower2Divisions`). Returns the
    /// buckets and the index of the value's last token.
    fn divisions(&mut self, i: usize) -> Result<([u64; DIVISION_BUCKETS], usize)> {
        let mut out = [0u64; DIVISION_BUCKETS];
        if self.token(i)? != "[" {
            let n = self.size(i)?;
            if !n.is_power_of_two() {
                return Err(self.refused("For roundups, the divisions has to be power of 2"));
            }
            if n >= 1 << 55 {
                self.notes.push(format!(
                    "roundup_power2_divisions:{n}: libtorch's 512 × {n} wraps in 64 bits, so every request is \
                     rounded up to a power of two: the model does the same"
                ));
            }
            return Ok(([n; DIVISION_BUCKETS], i));
        }
        let (mut at, mut last, mut first) = (i + 1, 0usize, true);
        while self.token(at)? != "]" {
            let bound = self.token(at)?.to_string();
            let n = self.size(at + 2)?;
            at += 2;
            if !(n == 0 || n.is_power_of_two()) {
                return Err(self.refused("For roundups, the divisions has to be power of 2 or 0 to disable roundup"));
            }
            if bound == ">" {
                for slot in out.iter_mut().skip(last + 1) {
                    *slot = n;
                }
            } else {
                let mb = self.size(at - 2)?;
                if !mb.is_power_of_two() {
                    return Err(self.refused("For roundups, the intervals have to be power of 2"));
                }
                let index = (mb.trailing_zeros() as usize).min(DIVISION_BUCKETS - 1);
                if mb > 1 << (DIVISION_BUCKETS - 1) {
                    self.notes.push(format!(
                        "roundup_power2_divisions' bound {mb} MiB is past the last bucket's (32768 MiB, which also \
                         holds everything larger): libtorch counts it as that bucket"
                    ));
                }
                if first {
                    for slot in out.iter_mut().take(index) {
                        *slot = n;
                    }
                    first = false;
                }
                out[index] = n;
                last = index;
            }
            // The separator after an entry, unless the list ends there.
            if self.token(at + 1)? != "]" {
                at += 1;
            }
            at += 1;
        }
        Ok((out, at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::AllocatorSettings;

    #[test]
    fn the_default_is_libtorchs() {
        let c = AllocatorConfig::parse("").unwrap();
        assert_eq!(c, AllocatorConfig::default());
        assert_eq!((c.large_segment_size, c.max_non_split_rounding, c.max_split_size), (20 * MIB, 20 * MIB, None));
        assert_eq!(c.to_conf(), "");
    }

    #[test]
    fn keys_parse_as_libtorch_parses_them() {
        let c = AllocatorConfig::parse(" expandable_segments:True, max_split_size_mb:128 ").unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, Some(128 * MIB));
        assert_eq!(c.to_conf(), "max_split_size_mb:128,expandable_segments:True");
        // The large segment size is read first, and bounds the others from below.
        let c = AllocatorConfig::parse("max_split_size_mb:40,large_segment_size_mb:32").unwrap();
        assert_eq!((c.large_segment_size, c.max_non_split_rounding), (32 * MIB, 32 * MIB));
        assert!(AllocatorConfig::parse("max_split_size_mb:16").unwrap_err().to_string().contains("must be >= 20"));
        assert!(AllocatorConfig::parse("large_segment_size_mb:10").is_err(), "must exceed 10 MiB");
        let c = AllocatorConfig::parse("garbage_collection_threshold:0.6,per_process_memory_fraction:0.5").unwrap();
        assert_eq!((c.garbage_collection_threshold, c.memory_fraction), (0.6, 0.5));
        assert!(AllocatorConfig::parse("garbage_collection_threshold:1").is_err());
        assert!(AllocatorConfig::parse("expandable_segments:true").is_err(), "only True and False");
        assert!(AllocatorConfig::parse("pinned_num_register_threads:8").unwrap().without_effect.len() == 1);
    }

    #[test]
    fn what_libtorch_refuses_or_memlab_cannot_model_is_an_error_saying_so() {
        let e = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap_err().to_string();
        assert!(e.contains("does not model"), "{e}");
        let e = AllocatorConfig::parse("expandable:True").unwrap_err().to_string();
        assert!(e.contains("Unrecognized key 'expandable' in CUDA allocator config."), "{e}");
        assert!(AllocatorConfig::parse("max_split_size_mb").is_err());
        assert!(AllocatorConfig::parse("roundup_power2_divisions:[256:1").is_err());
    }

    #[test]
    fn a_snapshots_settings_are_what_libtorch_held() {
        let settings = serde_json::json!({
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128,large_segment_size_mb:32",
            "max_split_size": 134217728u64, "garbage_collection_threshold": 0.0, "expandable_segments": true,
            "roundup_power2_divisions": {"1": 0, "2": 4, "4": 0},
        });
        let c = AllocatorConfig::from_snapshot(&AllocatorSettings::from_json(settings).unwrap()).unwrap();
        assert_eq!((c.max_split_size, c.expandable_segments, c.large_segment_size), (Some(128 * MIB), true, 32 * MIB));
        assert_eq!(&c.roundup_power2_divisions[..3], &[0, 4, 0]);
        // Unlimited, as libtorch writes it; and a setting changed at run time wins over the environment's.
        let settings = serde_json::json!({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "max_split_size": u64::MAX, "expandable_segments": false});
        let c = AllocatorConfig::from_snapshot(&AllocatorSettings::from_json(settings).unwrap()).unwrap();
        assert_eq!((c.max_split_size, c.expandable_segments), (None, false));
    }

    #[test]
    fn division_lists_fill_buckets_as_libtorch_does() {
        // [256:1,512:2,1024:4,>:8]: the first entry fills everything below it
        // too (buckets 0 to 8: below 512 MiB); 512 MiB to 1 GiB gets 2; 1 to
        // 2 GiB 4; 2 GiB and up 8.
        let c = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap();
        assert_eq!(c.roundup_power2_divisions, [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]);
        // A gap between entries keeps 0 (no rounding).
        let c = AllocatorConfig::parse("roundup_power2_divisions:[1:4,64:2]").unwrap();
        assert_eq!(&c.roundup_power2_divisions[..8], &[4, 0, 0, 0, 0, 0, 2, 0]);
        // Bucket of a size: below 2 MiB is bucket 0; [2^(20+i), 2^(21+i)) is bucket i.
        let c = AllocatorConfig::parse("roundup_power2_divisions:[1:1,2:2,4:4,>:8]").unwrap();
        assert_eq!((c.divisions(512), c.divisions(2 * MIB - 1), c.divisions(2 * MIB)), (1, 1, 2));
        assert_eq!((c.divisions(4 * MIB), c.divisions(1 << 40)), (4, 8));
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(c.roundup_power2_divisions, [4; DIVISION_BUCKETS]);
        assert!(AllocatorConfig::parse("roundup_power2_divisions:3").is_err());
    }

    /// Every refusal of the table, with libtorch 2.11's own message: each of
    /// these strings makes libtorch raise, and made memlab replay (the first
    /// two exited 0).
    #[test]
    fn what_libtorch_refuses_is_refused_with_its_message() {
        for (text, says) in [
            (
                "release_lock_on_cudamalloc:maybe",
                "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'maybe'",
            ),
            ("pinned_num_register_threads:abc", "(\"stoull\")"),
            ("pinned_num_register_threads:3", "Number of register threads has to be power of 2, got 3"),
            ("pinned_num_register_threads:0", "has to be power of 2, got 0"),
            ("pinned_num_register_threads:256", "should be less than or equal to 128, got 256"),
            ("pinned_reserve_segment_size_mb:0", "Pinned reserve segment size has to be greater than 0"),
            ("pinned_use_cuda_host_register:1", "Expected 'True' or 'False'"),
            ("graph_capture_record_stream_reuse:yes", "Expected 'True' or 'False'"),
            ("expandable_segments:Maybe", "but got 'Maybe'"),
            ("large_segment_size_mb:10", "CachingAllocator option large_segment_size_mb must be > 10 MB"),
            ("max_split_size_mb:19", "CachingAllocator option max_split_size_mb too small, must be >= 20"),
            ("large_segment_size_mb:64,max_split_size_mb:40", "must be >= 64"),
            ("max_non_split_rounding_mb:2", "max_non_split_rounding_mb too small, must be >= 20"),
            ("max_split_size_mb:99999999999999999999", "(\"stoull\")"),
            ("garbage_collection_threshold:1", "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),
            ("garbage_collection_threshold:nan", "garbage_collect_threshold is invalid"),
            ("garbage_collection_threshold:1e-400", "(\"stod\")"),
            ("per_process_memory_fraction:1.5", "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"),
            ("per_process_memory_fraction:nan", "per_process_memory_fraction is invalid"),
            ("roundup_power2_divisions:3", "For roundups, the divisions has to be power of 2"),
            ("roundup_power2_divisions:0", "For roundups, the divisions has to be power of 2"),
            ("roundup_power2_divisions:[64:3]", "power of 2 or 0 to disable roundup"),
            ("roundup_power2_divisions:[48:2]", "For roundups, the intervals have to be power of 2"),
            ("roundup_power2_divisions:[256:4:8]", "Index out of bounds in ConfigTokenizer"),
            ("max_split_size_mb", "Index out of bounds in ConfigTokenizer"),
            ("backend:other", "Unknown allocator backend, options are native and cudaMallocAsync"),
            ("Max_split_size_mb:30", "Unrecognized key 'Max_split_size_mb' in CUDA allocator config."),
            ("max_split_size_mb=30", "Unrecognized key 'max_split_size_mb=30'"),
        ] {
            let e = AllocatorConfig::parse(text).expect_err(text).to_string();
            assert!(e.contains(says) && e.contains(text), "{text}: {e}");
        }
    }

    /// What libtorch clamps or reads otherwise is read as it reads it, and
    /// said. A size past `SIZE_MAX / 1 MiB` used to wrap: the checked value
    /// and the stored one differed.
    #[test]
    fn what_libtorch_clamps_is_clamped_and_said() {
        for mb in ["17592186044436", "17592186044415", "-1"] {
            let read = AllocatorConfig::read(&format!("large_segment_size_mb:{mb}")).unwrap();
            assert_eq!(read.config.large_segment_size, MAX_MB * MIB, "{mb}");
            assert_eq!(read.config.max_non_split_rounding, MAX_MB * MIB);
        }
        let read = AllocatorConfig::read("large_segment_size_mb:17592186044436").unwrap();
        assert!(read.notes.iter().any(|n| n.contains("clamped to 17592186044415")), "{:?}", read.notes);
        // The largest max_split_size is not "unlimited".
        let read = AllocatorConfig::read("max_split_size_mb:-1").unwrap();
        assert_eq!(read.config.max_split_size, Some(MAX_MB * MIB));
        assert!(
            read.notes.iter().any(|n| n.contains("wraps a negative"))
                && read.notes.iter().any(|n| n.contains("not unlimited"))
        );
        // stoull's and stod's readings, separators unchecked, whitespace dropped.
        let read = AllocatorConfig::read("max_split_size_mb:30abc, garbage_collection_threshold : 0.5x").unwrap();
        assert_eq!((read.config.max_split_size, read.config.garbage_collection_threshold), (Some(30 * MIB), 0.5));
        assert_eq!(read.notes.len(), 2, "{:?}", read.notes);
        assert_eq!(AllocatorConfig::parse("max_split_size_mb,128").unwrap().max_split_size, Some(128 * MIB));
        assert_eq!(AllocatorConfig::parse("max_split_size_mb: 3 0").unwrap().max_split_size, Some(30 * MIB));
        // A leading `>` fills from the second bucket; a bound past 32 GiB is the last bucket's.
        let c = AllocatorConfig::parse("roundup_power2_divisions:[>:4]").unwrap();
        assert_eq!(c.roundup_power2_divisions[..2], [0, 4]);
        let read = AllocatorConfig::read("roundup_power2_divisions:[1048576:2]").unwrap();
        assert_eq!(read.config.roundup_power2_divisions, [2; DIVISION_BUCKETS]);
        assert_eq!(read.notes.len(), 1);
        // Huge divisions wrap libtorch's product: noted, and modelled.
        let read = AllocatorConfig::read("roundup_power2_divisions:36028797018963968").unwrap();
        assert!(read.notes[0].contains("rounded up to a power of two"), "{:?}", read.notes);
    }

    /// The settings a snapshot records go through the same table: values
    /// libtorch cannot hold are refused, libtorch's encodings of unlimited
    /// and of its clamped largest are read as such.
    #[test]
    fn a_snapshots_settings_go_through_the_same_table() {
        let read = |settings: serde_json::Value| {
            AllocatorConfig::from_snapshot(&AllocatorSettings::from_json(settings).unwrap())
        };
        for (settings, says) in [
            (serde_json::json!({"max_split_size": 100}), "max_split_size = 100"),
            (serde_json::json!({"max_split_size": 25 * MIB + 1}), "whole MiB"),
            (serde_json::json!({"garbage_collection_threshold": 7.5}), "garbage_collect_threshold is invalid"),
            (serde_json::json!({"roundup_power2_divisions": {"1": 3}}), "power of 2 or 0"),
            (serde_json::json!({"roundup_power2_divisions": {"3": 2}}), "not a bucket"),
            (serde_json::json!({"expandable_segments": "yes"}), "not True or False"),
            (
                serde_json::json!({"PYTORCH_CUDA_ALLOC_CONF": "release_lock_on_cudamalloc:maybe"}),
                "Expected 'True' or 'False'",
            ),
        ] {
            let e = read(settings.clone()).expect_err(&settings.to_string()).to_string();
            assert!(e.contains(says), "{settings}: {e}");
        }
        assert_eq!(read(serde_json::json!({"max_split_size": -1})).unwrap().max_split_size, None);
        assert_eq!(read(serde_json::json!({"max_split_size": -1048576})).unwrap().max_split_size, Some(MAX_MB * MIB));
        assert_eq!(read(serde_json::json!({"max_split_size": 20 * MIB})).unwrap().max_split_size, Some(20 * MIB));
    }

    /// The settings are typed as libtorch 2.11 writes them; what a newer
    /// PyTorch adds stays as read, and goes back into the file.
    #[test]
    fn a_snapshots_settings_keep_the_keys_a_newer_pytorch_adds() {
        let written = serde_json::json!({
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
            "garbage_collection_threshold": 0.0, "expandable_segments": true,
            "roundup_power2_divisions": {"1": 0, "2": 4}, "max_round_threshold": 0, "max_cached_size": 1 << 30,
        });
        let settings = AllocatorSettings::from_json(written.clone()).unwrap();
        assert_eq!((settings.conf.as_deref(), settings.max_split_size), (Some("expandable_segments:True"), Some(-1)));
        assert_eq!(settings.other.keys().collect::<Vec<_>>(), ["max_cached_size", "max_round_threshold"]);
        assert_eq!(settings.to_json(), written, "written back as read");
        let c = AllocatorConfig::from_snapshot(&settings).unwrap();
        assert_eq!((c.max_split_size, c.expandable_segments, c.roundup_power2_divisions[1]), (None, true, 4));
        // A value unset (None in Python) is not set.
        let settings = AllocatorSettings::from_json(serde_json::json!({"max_split_size": null})).unwrap();
        assert_eq!(settings, AllocatorSettings::default());
        assert!(AllocatorSettings::from_json(serde_json::json!([1, 2])).is_none());
    }
}
