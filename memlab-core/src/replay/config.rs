//! The caching allocator's settings as libtorch 2.11 parses them from
//! `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`):
//! `expandable_segments:True,max_split_size_mb:128`. Read in PyTorch's
//! `c10/core/AllocatorConfig.cpp` (`AcceleratorAllocatorConfig::parseArgs`)
//! and `c10/cuda/CUDAAllocatorConfig.cpp` (`CUDAAllocatorConfig::parseArgs`)
//! as shipped in 2.11.0 (git 70d99e99), whose headers the wheel carries.

use crate::error::{Error, Result};

/// One MiB, the unit of the `_mb` keys.
pub const MIB: u64 = 1 << 20;
/// Buckets of `roundup_power2_divisions`: `[1 MiB, 2 MiB)` and below, then
/// one per power of two up to `>= 32 GiB` (`kRoundUpPowerOfTwoIntervals`).
pub const DIVISION_BUCKETS: usize = 16;
/// `kMinLargeAlloc`: requests from here on get a segment of their own size
/// (rounded up to 2 MiB), and `large_segment_size_mb` must exceed it.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;

/// The settings of libtorch's CUDA caching allocator that decide where
/// memory goes. The default is libtorch's: no `max_split_size`, no rounding
/// beyond 512 bytes, 20 MiB large segments, no garbage collection, no
/// expandable segments, no memory fraction.
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
        }
    }
}

/// Keys libtorch 2.11 accepts that do not move device memory.
const WITHOUT_EFFECT: [&str; 7] = [
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_use_background_threads",
];

fn bad(text: &str, why: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("allocator setting `{text}`: {why}"))
}

impl AllocatorConfig {
    /// Parses settings written as for `PYTORCH_CUDA_ALLOC_CONF`
    /// (`key:value,key:value`; whitespace ignored). An empty string is the
    /// default. Refuses what libtorch refuses, and `backend:cudaMallocAsync`,
    /// which is another allocator: CUDA's own, which memlab does not model.
    pub fn parse(text: &str) -> Result<AllocatorConfig> {
        let mut config = AllocatorConfig::default();
        let squeezed: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        let entries = split_entries(&squeezed).map_err(|why| bad(text, why))?;
        // libtorch reads the large segment size first: the other sizes are checked against it.
        for (key, value) in &entries {
            if key == "large_segment_size_mb" {
                let mb = integer(value).map_err(|why| bad(text, why))?;
                if mb * MIB <= MIN_LARGE_ALLOC {
                    return Err(bad(
                        text,
                        format!("large_segment_size_mb must be more than {}", MIN_LARGE_ALLOC / MIB),
                    ));
                }
                config.large_segment_size = mb.saturating_mul(MIB);
            }
        }
        config.max_non_split_rounding = config.large_segment_size;
        let large_mb = config.large_segment_size / MIB;
        for (key, value) in &entries {
            match key.as_str() {
                "large_segment_size_mb" => {}
                "max_split_size_mb" | "max_non_split_rounding_mb" => {
                    let mb = integer(value).map_err(|why| bad(text, why))?;
                    if mb < large_mb {
                        return Err(bad(text, format!("{key} must be at least {large_mb} (the large segment size)")));
                    }
                    let bytes = mb.saturating_mul(MIB);
                    if key == "max_split_size_mb" {
                        config.max_split_size = Some(bytes);
                    } else {
                        config.max_non_split_rounding = bytes;
                    }
                }
                "garbage_collection_threshold" => {
                    let v: f64 = value.parse().map_err(|_| bad(text, format!("{value} is not a number")))?;
                    if !(v > 0.0 && v < 1.0) {
                        return Err(bad(text, "garbage_collection_threshold must be between 0 and 1, both excluded"));
                    }
                    config.garbage_collection_threshold = v;
                }
                "roundup_power2_divisions" => {
                    config.roundup_power2_divisions = divisions(value).map_err(|why| bad(text, why))?;
                }
                "expandable_segments" => config.expandable_segments = boolean(value).map_err(|why| bad(text, why))?,
                "per_process_memory_fraction" => {
                    let v: f64 = value.parse().map_err(|_| bad(text, format!("{value} is not a number")))?;
                    if !(0.0..=1.0).contains(&v) {
                        return Err(bad(text, "per_process_memory_fraction must be between 0 and 1"));
                    }
                    config.memory_fraction = v;
                }
                "backend" => match value.as_str() {
                    "native" => {}
                    "cudaMallocAsync" => {
                        return Err(bad(
                            text,
                            "backend:cudaMallocAsync is CUDA's own allocator, which memlab does not model; replay \
                             with the native backend's settings instead",
                        ))
                    }
                    other => return Err(bad(text, format!("unknown backend {other} (native or cudaMallocAsync)"))),
                },
                "graph_capture_record_stream_reuse" => {
                    boolean(value).map_err(|why| bad(text, why))?;
                    config.without_effect.push(format!("{key}:{value}"));
                }
                k if WITHOUT_EFFECT.contains(&k) => config.without_effect.push(format!("{key}:{value}")),
                other => return Err(bad(text, format!("unknown key `{other}` (libtorch 2.11 refuses it too)"))),
            }
        }
        Ok(config)
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
    /// fraction) come from the environment's string alone.
    pub fn from_snapshot(settings: &serde_json::Value) -> Result<AllocatorConfig> {
        let conf = settings.get("PYTORCH_CUDA_ALLOC_CONF").and_then(|v| v.as_str()).unwrap_or("");
        let mut config = AllocatorConfig::parse(conf)?;
        if let Some(v) = settings.get("max_split_size").and_then(|v| v.as_u64()) {
            // libtorch's unlimited is SIZE_MAX.
            config.max_split_size = (v < u64::MAX / 2).then_some(v);
        }
        if let Some(v) = settings.get("garbage_collection_threshold").and_then(|v| v.as_f64()) {
            config.garbage_collection_threshold = v;
        }
        if let Some(v) = settings.get("expandable_segments").and_then(|v| v.as_bool()) {
            config.expandable_segments = v;
        }
        if let Some(map) = settings.get("roundup_power2_divisions").and_then(|v| v.as_object()) {
            // Keyed by each bucket's start in MiB: 1, 2, 4, … 32768.
            for (mb, v) in map {
                let (Ok(mb), Some(v)) = (mb.parse::<u64>(), v.as_u64()) else { continue };
                if mb.is_power_of_two() {
                    let index = (63 - mb.leading_zeros() as usize).min(DIVISION_BUCKETS - 1);
                    config.roundup_power2_divisions[index] = v;
                }
            }
        }
        Ok(config)
    }

    /// The power-of-two divisions for a request of `size` bytes
    /// (`roundup_power2_divisions(size)`, AllocatorConfig.cpp).
    pub fn divisions(&self, size: u64) -> u64 {
        let log = 63 - u64::from(size.max(1).leading_zeros());
        let index = if log > 20 { (log - 20) as usize } else { 0 };
        self.roundup_power2_divisions[index.min(DIVISION_BUCKETS - 1)]
    }
}

/// `key:value` entries, a list value (`[a:b,c:d]`) kept whole.
fn split_entries(text: &str) -> std::result::Result<Vec<(String, String)>, String> {
    let mut entries = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let bytes = text.as_bytes();
    for i in 0..=bytes.len() {
        let c = bytes.get(i).copied();
        match c {
            Some(b'[') => depth += 1,
            Some(b']') => depth -= 1,
            Some(b',') | None if depth == 0 => {
                let entry = &text[start..i];
                start = i + 1;
                if entry.is_empty() {
                    continue;
                }
                let (key, value) = entry.split_once(':').ok_or_else(|| format!("`{entry}` is not key:value"))?;
                if value.is_empty() {
                    return Err(format!("`{key}` has no value"));
                }
                entries.push((key.to_string(), value.to_string()));
            }
            _ => {}
        }
        if depth < 0 {
            return Err("a `]` without its `[`".into());
        }
    }
    if depth != 0 {
        return Err("a `[` without its `]`".into());
    }
    Ok(entries)
}

fn integer(value: &str) -> std::result::Result<u64, String> {
    value.parse().map_err(|_| format!("{value} is not a whole number"))
}

fn boolean(value: &str) -> std::result::Result<bool, String> {
    match value {
        "True" => Ok(true),
        "False" => Ok(false),
        other => Err(format!("{other} is not True or False (libtorch takes those two words only)")),
    }
}

/// `N` (every bucket), or `[b:v,…,>:v]` with `b` a power of two in MiB:
/// the first entry also fills the buckets below it, gaps keep 0, `>` fills
/// the buckets above the last (AllocatorConfig.cpp, `parseRoundUpPower2Divisions`).
fn divisions(value: &str) -> std::result::Result<[u64; DIVISION_BUCKETS], String> {
    let power = |v: u64| v == 0 || v.is_power_of_two();
    let mut out = [0u64; DIVISION_BUCKETS];
    let Some(list) = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) else {
        let n = integer(value)?;
        if n == 0 || !n.is_power_of_two() {
            return Err(format!("roundup_power2_divisions {n} is not a power of two"));
        }
        return Ok([n; DIVISION_BUCKETS]);
    };
    let mut last: Option<usize> = None;
    for item in list.split(',').filter(|s| !s.is_empty()) {
        let (bound, v) = item.split_once(':').ok_or_else(|| format!("`{item}` is not size:divisions"))?;
        let v = integer(v)?;
        if !power(v) {
            return Err(format!("divisions {v} is not a power of two"));
        }
        if bound == ">" {
            let from = last.map_or(0, |l| l + 1);
            for slot in out.iter_mut().skip(from) {
                *slot = v;
            }
            continue;
        }
        let mb = integer(bound)?;
        if !mb.is_power_of_two() {
            return Err(format!("{mb} MiB is not a power of two"));
        }
        let index = (63 - mb.leading_zeros() as usize).min(DIVISION_BUCKETS - 1);
        if last.is_none() {
            for slot in out.iter_mut().take(index) {
                *slot = v;
            }
        }
        out[index] = v;
        last = Some(index);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(AllocatorConfig::parse("max_split_size_mb:16").unwrap_err().to_string().contains("at least 20"));
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
        assert!(e.contains("unknown key `expandable`"), "{e}");
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
        let c = AllocatorConfig::from_snapshot(&settings).unwrap();
        assert_eq!((c.max_split_size, c.expandable_segments, c.large_segment_size), (Some(128 * MIB), true, 32 * MIB));
        assert_eq!(&c.roundup_power2_divisions[..3], &[0, 4, 0]);
        // Unlimited, as libtorch writes it; and a setting changed at run time wins over the environment's.
        let settings = serde_json::json!({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "max_split_size": u64::MAX, "expandable_segments": false});
        let c = AllocatorConfig::from_snapshot(&settings).unwrap();
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
}
