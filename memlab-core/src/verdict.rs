//! Why a request for memory failed, in one word: the verdict of memlab's
//! out-of-memory diagnosis (decided in [`crate::oom`]). It sits at the
//! bottom so that every file model that names it (the OOM report, the
//! trace's out-of-memory events) reaches it without climbing.

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The request alone is larger than the device (or what this process may
    /// use of it): no freeing can make it fit; usually a wrong shape.
    RequestExceedsDevice,
    /// The cache has enough free bytes, but no free block that large: they
    /// are in pieces.
    Fragmentation,
    /// The device would have room but other processes hold it.
    OtherProcesses,
    /// There is not enough free memory: what this process holds has to shrink.
    NotEnoughFree,
}

impl Verdict {
    /// The verdict as JSON names it (`request_exceeds_device`).
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::RequestExceedsDevice => "request_exceeds_device",
            Verdict::Fragmentation => "fragmentation",
            Verdict::OtherProcesses => "other_processes",
            Verdict::NotEnoughFree => "not_enough_free",
        }
    }

    /// A short name: `request exceeds the device`, `fragmentation`, …
    pub fn title(self) -> &'static str {
        match self {
            Verdict::RequestExceedsDevice => "the request alone exceeds the device",
            Verdict::Fragmentation => "fragmentation",
            Verdict::OtherProcesses => "other processes hold the memory",
            Verdict::NotEnoughFree => "not enough free memory",
        }
    }
}
