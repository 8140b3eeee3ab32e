//! What an out-of-memory report says about the CUDA caching allocator's
//! settings, decided from the failure's figures and, where a recording
//! ran, after its replay: a setting is advised only where the replay shows
//! it avoids the failure, never one the process already has; where no
//! setting helps, what would (the bytes to free, an `empty_cache` where
//! one avoids it); without a recording, the one setting the figures
//! suggest, said to be untested, with how to test it.

use serde::{Deserialize, Serialize};

use crate::events::Action;
use crate::export::Snapshot;
use crate::replay::{replay_device_at, AllocatorConfig, Card, DeviceReplays, Replayed};
use crate::verdict::Verdict;

/// What the report advises about the allocator's settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SettingsAdvice {
    /// The recording's replay avoids the failure under these settings,
    /// none of which the process had.
    Replayed {
        /// Each setting that avoids it, with its replayed peak.
        avoiding: Vec<Avoiding>,
    },
    /// No setting the replay tried avoids the failure: what would.
    NoSettingHelps {
        /// The bytes to free at the failure, as replayed: of tensors
        /// (`tensors_alone`), or of the segments the allocator holds (it
        /// needs a new segment, and gives back only segments no tensor uses).
        free: u64,
        /// Whether the tensors alone pass what the allocator may hold.
        tensors_alone: bool,
        /// An `empty_cache` that avoids the failure in the replay, if one does.
        empty_cache: Option<EmptyCachePoint>,
    },
    /// The replay under the process's own settings does not reproduce the
    /// failure: it backs no setting.
    NotReproduced,
    /// The program caught an earlier out-of-memory error and went on (at
    /// this history entry): what it asked for after it depended on the
    /// error, which another setting moves, so the replay backs no setting.
    WentOnAfterError {
        /// The earlier error's history entry.
        entry: usize,
    },
    /// No recording ran: a setting the figures suggest, not tried.
    Untested {
        /// As `PYTORCH_CUDA_ALLOC_CONF` writes it.
        setting: String,
    },
}

/// A setting that avoids the failure in the replay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Avoiding {
    /// As `PYTORCH_CUDA_ALLOC_CONF` writes it (`""`: libtorch's defaults).
    pub settings: String,
    /// Its replayed peak reserved.
    pub peak_reserved: u64,
}

/// Where an `empty_cache` avoids the failure in the replay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmptyCachePoint {
    /// The history entry it goes before.
    pub entry: usize,
    /// That entry's time, microseconds since the recording began.
    pub time_us: u64,
    /// Where that entry's allocation was made, where known.
    pub site: Option<String>,
    /// Bytes allocated to tensors at that point, by the history's own
    /// allocations (blocks held before the history began are not counted).
    pub allocated: u64,
}

/// How many of the history's emptiest moments are tried for an `empty_cache`.
const EMPTY_CACHE_TRIES: usize = 4;

/// The settings advice of a CUDA failure of `verdict`, in a process running
/// under `process`. `cache_would_suffice`: the device's free memory and the
/// cache's together would have served the request. With a recording, its
/// `replayed` history (of `snapshot`, the failing device named `device`)
/// decides; without one, the figures alone suggest a setting, untested.
pub fn advise_settings(
    verdict: Verdict,
    cache_would_suffice: bool,
    process: &AllocatorConfig,
    replayed: Option<(&Snapshot, &Replayed)>,
    device: &str,
) -> Option<SettingsAdvice> {
    let Some((snapshot, replayed)) = replayed else {
        let fragmented =
            verdict == Verdict::Fragmentation || (verdict == Verdict::NotEnoughFree && cache_would_suffice);
        return (fragmented && !process.expandable_segments)
            .then(|| SettingsAdvice::Untested { setting: "expandable_segments:True".into() });
    };
    let d = replayed.devices.iter().find(|d| d.recorded.device == device)?;
    // A report's history ends at its failure: an error the program went
    // on after is an earlier one.
    if let Some(entry) = d.recorded.continued_after_oom {
        return Some(SettingsAdvice::WentOnAfterError { entry });
    }
    let Some(oom) = d.recorded_oom() else {
        return Some(SettingsAdvice::NotReproduced);
    };
    // Never a setting that does what the process's own do.
    let has = |conf: &str| AllocatorConfig::parse(conf).is_ok_and(|c| c.same_effect(process));
    let avoiding: Vec<Avoiding> = d
        .avoiding()
        .map(|x| Avoiding { settings: d.conf(x), peak_reserved: x.peak_reserved })
        .filter(|a| !has(&a.settings))
        .collect();
    if !avoiding.is_empty() {
        return Some(SettingsAdvice::Replayed { avoiding });
    }
    let m = &oom.oom;
    if m.requested > m.limit || m.requested >= crate::replay::ONE_EXABYTE {
        // The request alone exceeds what the allocator may hold: no setting
        // and no freeing helps, as the verdict says.
        return None;
    }
    let tensors_alone = u128::from(m.allocated) + u128::from(m.requested) > u128::from(m.limit);
    let free = if tensors_alone {
        (m.allocated.saturating_add(m.requested)).saturating_sub(m.limit)
    } else {
        m.segment.saturating_sub(m.limit.saturating_sub(m.reserved))
    };
    let empty_cache = if tensors_alone { None } else { empty_cache_point(snapshot, d, oom.entry) };
    Some(SettingsAdvice::NoSettingHelps { free, tensors_alone, empty_cache })
}

/// Tries an `empty_cache` at the history's emptiest moments before the
/// failure at `failed` (the fewest bytes allocated, before an allocation):
/// the first that avoids every failure in the replay, if any does.
fn empty_cache_point(snapshot: &Snapshot, d: &DeviceReplays, failed: usize) -> Option<EmptyCachePoint> {
    let index = snapshot.devices().iter().position(|n| *n == d.recorded.device)?;
    let trace = snapshot.device_traces.get(index)?;
    let config = AllocatorConfig::parse(&d.recorded.settings).ok()?;
    let card = Card { capacity: d.capacity, total: d.total };
    // Bytes allocated before each allocation, by the history's own sizes
    // (the reader bounds their sums).
    let mut live = std::collections::HashMap::new();
    let mut allocated = 0u64;
    let mut lows: Vec<(u64, usize)> = Vec::new();
    for (i, e) in trace.iter().enumerate().take(failed) {
        match (e.action, e.addr) {
            (Action::Alloc, Some(addr)) => {
                lows.push((allocated, i));
                allocated += e.size;
                if let Some(old) = live.insert(addr, e.size) {
                    allocated -= old;
                }
            }
            (Action::FreeRequested, Some(addr)) => allocated -= live.remove(&addr).unwrap_or(0),
            _ => {}
        }
    }
    lows.sort_unstable();
    let recorded = &d.recorded.empty_cache_at;
    for (allocated, entry) in lows.into_iter().filter(|(_, e)| !recorded.contains(e)).take(EMPTY_CACHE_TRIES) {
        let mut points = recorded.clone();
        points.push(entry);
        points.sort_unstable();
        let replay = replay_device_at(snapshot, index, &config, card, &points).ok()?;
        if replay.ooms.is_empty() {
            let e = &trace[entry];
            return Some(EmptyCachePoint { entry, time_us: e.time_us, site: crate::replay::site(e), allocated });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{replay_snapshot, ReplayOptions, MIB};

    fn snapshot(entries: &[(Action, u64, u64)], conf: &str) -> Snapshot {
        let mut s = crate::replay::tests::history(entries);
        s.allocator_settings =
            Some(crate::export::AllocatorSettings { conf: Some(conf.to_string()), ..Default::default() });
        s
    }

    fn advise(s: &Snapshot, capacity: u64, verdict: Verdict) -> Option<SettingsAdvice> {
        let options = ReplayOptions { capacity: Some(capacity), compare: true, ..Default::default() };
        let replayed = replay_snapshot("t", s, &options).unwrap();
        let process = AllocatorConfig::from_snapshot(s.allocator_settings.as_ref().unwrap()).unwrap();
        advise_settings(verdict, false, &process, Some((s, &replayed)), "cuda:0")
    }

    #[test]
    fn a_setting_is_advised_only_where_the_replay_avoids_the_failure() {
        use Action::*;
        // 40 MiB: 5 MiB holds a 20 MiB segment, 30 MiB more needs its own
        // 30 MiB segment. Expandable segments fit both.
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB), (Oom, 0, 30 * MIB)], "");
        let Some(SettingsAdvice::Replayed { avoiding }) = advise(&s, 40 * MIB, Verdict::Fragmentation) else {
            panic!()
        };
        let settings: Vec<&str> = avoiding.iter().map(|a| a.settings.as_str()).collect();
        assert_eq!(settings, ["expandable_segments:True", "max_split_size_mb:128,expandable_segments:True"]);
        // A process already under expandable segments is never told to set
        // them: the replay of the same history under them is its own.
        let s =
            snapshot(&[(SegmentMap, 1, 20 * MIB), (Alloc, 1, 5 * MIB), (Oom, 0, 38 * MIB)], "expandable_segments:True");
        let advice = advise(&s, 40 * MIB, Verdict::NotEnoughFree).unwrap();
        let SettingsAdvice::NoSettingHelps { free, tensors_alone, empty_cache } = advice else { panic!("{advice:?}") };
        assert_eq!((free, tensors_alone, empty_cache), (3 * MIB, true, None), "5 + 38 - 40");
        // A request larger than all the allocator may hold gets no settings
        // advice (and no bytes to free: none would do): the verdict says so.
        let s = snapshot(&[(SegmentAlloc, 1, 20 * MIB), (Alloc, 1, 5 * MIB), (Oom, 0, 50 * MIB)], "");
        assert_eq!(advise(&s, 40 * MIB, Verdict::RequestExceedsDevice), None);
    }

    #[test]
    fn without_a_recording_the_setting_is_untested_and_never_one_the_process_has() {
        let default = AllocatorConfig::default();
        let expandable = AllocatorConfig::parse("expandable_segments:True").unwrap();
        let untested = Some(SettingsAdvice::Untested { setting: "expandable_segments:True".into() });
        assert_eq!(advise_settings(Verdict::Fragmentation, false, &default, None, "cuda:0"), untested);
        assert_eq!(advise_settings(Verdict::NotEnoughFree, true, &default, None, "cuda:0"), untested);
        assert_eq!(advise_settings(Verdict::NotEnoughFree, false, &default, None, "cuda:0"), None);
        assert_eq!(advise_settings(Verdict::Fragmentation, false, &expandable, None, "cuda:0"), None);
    }

    #[test]
    fn where_no_setting_helps_an_empty_cache_that_does_is_found() {
        use Action::*;
        // On 58 MiB: a 30 MiB block in a segment of its own, freed and
        // cached; a 4 MiB block kept, cut out of that cached segment; then
        // 38 MiB asked: 30 + 38 > 58, and the cached segment cannot go back
        // (it holds the 4 MiB). Expandable segments do not help either: the
        // 30 MiB mapped two 20 MiB pages, and 38 MiB beside the 4 MiB needs
        // a third (60 > 58). An empty_cache before the 4 MiB gives the
        // 30 MiB segment back; the 4 MiB takes a 20 MiB segment, and
        // 20 + 38 fits.
        let s = snapshot(
            &[
                (SegmentAlloc, 1, 30 * MIB),
                (Alloc, 1, 30 * MIB),
                (FreeRequested, 1, 30 * MIB),
                (FreeCompleted, 1, 30 * MIB),
                (Alloc, 2, 4 * MIB),
                (Oom, 0, 38 * MIB),
            ],
            "",
        );
        let advice = advise(&s, 58 * MIB, Verdict::Fragmentation).unwrap();
        let expected = SettingsAdvice::NoSettingHelps {
            free: 10 * MIB,
            tensors_alone: false,
            empty_cache: Some(EmptyCachePoint { entry: 4, time_us: 4, site: None, allocated: 0 }),
        };
        assert_eq!(advice, expected, "38 - (58 - 30) to give back, or an empty_cache before the 4 MiB");
    }

    #[test]
    fn after_an_error_the_program_went_on_from_no_setting_is_backed() {
        use Action::*;
        // The GPU's recording of a program that allocates 8 MiB blocks until
        // the allocator fails under a 3 GiB memory fraction, catches the
        // error, frees every other block and asks for 256 MiB (failing
        // again). Replayed under expandable segments its recorded requests
        // fit; on the GPU that setting ran out twice as well
        // (fixtures/replay/results.jsonl), since the loop went on further.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/replay/caught__default.pickle");
        let file = crate::export::Snapshot::read_pickle(path).unwrap();
        let options = ReplayOptions {
            fraction: Some(0.021459116915775848),
            total: Some(150_109_880_320),
            compare: true,
            ..Default::default()
        };
        let replayed = replay_snapshot("caught", &file.snapshot, &options).unwrap();
        let d = &replayed.devices[0];
        assert!(d.avoiding().any(|x| d.conf(x) == "expandable_segments:True"), "the requests as recorded fit");
        let first = file.snapshot.device_traces[0].iter().position(|e| e.action == Oom);
        assert_eq!(d.recorded.continued_after_oom, first);
        let advice = advise_settings(
            Verdict::Fragmentation,
            false,
            &AllocatorConfig::default(),
            Some((&file.snapshot, &replayed)),
            "cuda:0",
        );
        assert_eq!(advice, Some(SettingsAdvice::WentOnAfterError { entry: first.unwrap() }));
        let json: serde_json::Value = serde_json::from_str(&crate::render::Render::to_json(&replayed)).unwrap();
        assert_eq!(json["devices"][0]["continued_after_oom"], serde_json::json!(first.unwrap()));
        let text = crate::render::Render::to_text(&replayed);
        assert!(
            text.contains(&format!("The program went on after the error at history entry {}", first.unwrap())),
            "{text}"
        );
    }
}
