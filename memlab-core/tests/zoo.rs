//! "Will it fit" on the zoo of `examples/zoo.rs`, from the committed files
//! alone: each entry's CPU steps as `memlab::WillItFit::save` wrote them on
//! the H200 host (`fixtures/zoo/steps/`), predicted again here, against the
//! H200's own peaks (`fixtures/zoo/h200_cuda.jsonl`).
//!
//! Two checks. The predictions are those of `fixtures/zoo/predicted.jsonl`,
//! to the byte (`MEMLAB_BLESS=1` writes it again after a change that is
//! meant to move them; the diff then shows which). And every entry is
//! within [−1 %, +2 %] of the GPU's peak reserved, or a range that holds
//! it, but the misses named in `MISSES`: an entry that newly misses fails,
//! and so does one of `MISSES` that no longer misses (take it out).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memlab_core::export::Snapshot;
use memlab_core::replay::{predict_cuda, PredictOptions};

/// The entries that miss the band today, by model, size and setting, with
/// why: what the model does not model yet.
const MISSES: &[(&str, u32, &str, &str)] = &[];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/zoo")
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

type Key = (String, u64, String);

fn key(v: &serde_json::Value) -> Key {
    (v["model"].as_str().unwrap().into(), v["size"].as_u64().unwrap(), v["setting"].as_str().unwrap().into())
}

#[test]
fn the_committed_zoo_is_predicted_as_before_and_within_the_band_but_its_named_misses() {
    let gpu: BTreeMap<Key, serde_json::Value> =
        lines(&fixtures().join("h200_cuda.jsonl")).into_iter().map(|v| (key(&v), v)).collect();
    // Each entry's steps, read once for all its settings.
    let mut steps: BTreeMap<(String, u64), Snapshot> = BTreeMap::new();
    let mut predicted = Vec::new();
    for (model, size, setting) in gpu.keys() {
        let file = steps.entry((model.clone(), *size)).or_insert_with(|| {
            let path = fixtures().join("steps").join(format!("{model}_{size}.pickle.gz"));
            Snapshot::read_pickle(&path).unwrap_or_else(|e| panic!("{e}")).snapshot
        });
        // As examples/zoo.rs asks: the defaults first, then the setting.
        let mut settings = vec![String::new()];
        if setting != "default" {
            settings.push(setting.clone());
        }
        let options = PredictOptions { settings, ..Default::default() };
        let prediction = predict_cuda(&format!("{model} at {size}"), file, &options).unwrap();
        let p = prediction.settings.last().unwrap();
        let mut line = serde_json::json!({
            "model": model, "size": size, "setting": setting,
            "predicted_reserved": p.peak_reserved, "predicted_allocated": p.peak_allocated,
        });
        if let Some(range) = p.range {
            line["predicted_low"] = range.low.reserved.into();
            line["predicted_high"] = range.high.reserved.into();
        }
        predicted.push(line);
    }
    drop(steps);

    // As before, to the byte.
    let path = fixtures().join("predicted.jsonl");
    let text: String = predicted.iter().map(|l| format!("{l}\n")).collect();
    if std::env::var_os("MEMLAB_BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let before = std::fs::read_to_string(&path).unwrap_or_default();
    let changed: Vec<String> =
        text.lines().zip(before.lines()).filter(|(now, was)| now != was).map(|(now, _)| now.to_string()).collect();
    assert!(
        changed.is_empty() && text.lines().count() == before.lines().count(),
        "the zoo's predictions moved (MEMLAB_BLESS=1 to write them again, if meant):\n{}",
        changed.join("\n")
    );

    // Within the band, or a range that holds the GPU's figure, but the named misses.
    let mut missed = Vec::new();
    for line in &predicted {
        let k = key(line);
        let real = gpu[&k]["peak_reserved"].as_u64().unwrap() as f64;
        let point = line["predicted_reserved"].as_u64().unwrap() as f64;
        let error = point / real - 1.0;
        let in_band = (-0.01..=0.02).contains(&error);
        let held = line.get("predicted_low").is_some_and(|low| {
            let high = line["predicted_high"].as_u64().unwrap() as f64;
            low.as_u64().unwrap() as f64 <= real && real <= high && (high - low.as_u64().unwrap() as f64) <= 0.1 * point
        });
        if !in_band && !held {
            missed.push((k, error));
        }
    }
    let named = |k: &Key| MISSES.iter().any(|m| m.0 == k.0 && u64::from(m.1) == k.1 && m.2 == k.2);
    let new: Vec<String> =
        missed.iter().filter(|(k, _)| !named(k)).map(|(k, e)| format!("{k:?}: {:+.2} %", 100.0 * e)).collect();
    assert!(new.is_empty(), "entries out of the band that were in it:\n{}", new.join("\n"));
    let mended: Vec<String> = MISSES
        .iter()
        .filter(|m| !missed.iter().any(|(k, _)| m.0 == k.0 && u64::from(m.1) == k.1 && m.2 == k.2))
        .map(|m| format!("{m:?}"))
        .collect();
    assert!(mended.is_empty(), "entries of MISSES now in the band: take them out\n{}", mended.join("\n"));
}
