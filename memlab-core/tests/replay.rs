//! The allocator model against the GPU: PyTorch 2.11's own recordings, and
//! memlab's (`memlab_*`), of training loops and allocation patterns on an
//! H100
//! (`fixtures/replay/`, made by `scripts/replay_fixtures.py`, with the
//! allocator's own figures of each run in `results.jsonl`), replayed under
//! the settings each was recorded with (every segment event, the peak and
//! the out-of-memory errors as the GPU had them) and under each other
//! setting (the peak and the errors of the GPU's run under that setting).

use memlab_core::events::Action;
use memlab_core::export::Snapshot;
use memlab_core::replay::{replay_device, AllocatorConfig, Card};

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/replay")
}

/// One line of `results.jsonl`: what the GPU's allocator said of a run.
#[derive(serde::Deserialize, Debug)]
struct Run {
    workload: String,
    setting: String,
    conf: String,
    total_memory: u64,
    fraction: f64,
    peak_reserved: u64,
    num_ooms: u64,
    /// The out-of-memory error's message, where the run had one.
    oom: Option<String>,
}

/// The MiB a PyTorch out-of-memory message says are "reserved by PyTorch
/// but unallocated", to the hundredth.
fn unallocated_mib(message: &str) -> f64 {
    let before = message.split(" MiB is reserved by PyTorch but unallocated").next().unwrap();
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

fn runs() -> Vec<Run> {
    let text = std::fs::read_to_string(fixtures().join("results.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn every_recording_replays_under_its_own_settings() {
    for run in runs() {
        let file = Snapshot::read_pickle(fixtures().join(format!("{}__{}.pickle", run.workload, run.setting))).unwrap();
        let mut config = AllocatorConfig::parse(&run.conf).unwrap();
        // The file's own record of the settings says the same.
        let settings = file.snapshot.allocator_settings.as_ref().expect("PyTorch 2.11 writes its allocator's settings");
        assert_eq!(AllocatorConfig::from_snapshot(settings).unwrap(), config, "{}", run.conf);
        config.memory_fraction = run.fraction;
        let card = Card { capacity: run.total_memory, total: run.total_memory };
        let r = replay_device(&file.snapshot, 0, &config, &config, card).unwrap();
        println!(
            "{:14} {:11} segment events {}/{}, peak reserved {} MiB (GPU {}), out of memory {} (GPU {})",
            run.workload,
            run.setting,
            r.segment_events_matched,
            r.segment_events,
            r.peak_reserved >> 20,
            run.peak_reserved >> 20,
            r.ooms.len(),
            run.num_ooms
        );
        let what = format!("{} under {}", run.workload, run.setting);
        assert!(r.segment_events > 0, "{what}: a recording with segments");
        if run.workload.starts_with("memlab_fragmentation") {
            // The OOM recorder's CUDA set-up left a 2 MiB segment before the
            // recording began: rebuilt from the snapshot, it is the one the
            // allocator gives back when the request fails.
            assert_eq!((r.reserved_before, r.rebuilt_segments, r.rebuilt_blocks), (2 << 20, 1, 0), "{what}");
        } else {
            assert_eq!(r.reserved_before, 0, "{what}: recorded from the first allocation");
        }
        assert_eq!(r.unknown_frees, 0, "{what}: recorded from the first allocation");
        assert_eq!(r.segment_events_matched, r.segment_events, "{what}: first difference {:?}", r.first_mismatch);
        assert_eq!(r.first_mismatch, None, "{what}");
        assert_eq!(r.peak_reserved, run.peak_reserved, "{what}: the GPU's reserved peak");
        assert_eq!(r.oom_count as u64, run.num_ooms, "{what}: the GPU's out-of-memory errors");
        assert_eq!(r.ooms.len(), r.oom_count, "{what}: each listed");
        assert!(r.ooms.iter().all(|o| o.recorded), "{what}: failing where the GPU failed");
        // The free bytes inside the segments when it failed: the GPU's message says them.
        if let (Some(message), Some(o)) = (&run.oom, r.ooms.first()) {
            let free = (o.oom.reserved - o.oom.allocated) as f64 / (1 << 20) as f64;
            assert_eq!(format!("{free:.2}"), format!("{:.2}", unallocated_mib(message)), "{what}: {message}");
            assert!(o.oom.largest_free <= o.oom.reserved - o.oom.allocated, "{what}");
        }
    }
}

#[test]
fn each_workload_replayed_under_the_other_settings_predicts_the_gpu() {
    let runs = runs();
    for from in &runs {
        let file =
            Snapshot::read_pickle(fixtures().join(format!("{}__{}.pickle", from.workload, from.setting))).unwrap();
        let mut recorded = AllocatorConfig::parse(&from.conf).unwrap();
        recorded.memory_fraction = from.fraction;
        for to in runs.iter().filter(|r| r.workload == from.workload && r.setting != from.setting) {
            let mut config = AllocatorConfig::parse(&to.conf).unwrap();
            config.memory_fraction = to.fraction;
            let card = Card { capacity: to.total_memory, total: to.total_memory };
            let r = replay_device(&file.snapshot, 0, &recorded, &config, card).unwrap();
            let oom = !r.ooms.is_empty();
            println!(
                "{:14} recorded {:11} replayed as {:11}: peak reserved {:5} MiB (GPU {:5}), out of memory {} (GPU {})",
                from.workload,
                from.setting,
                to.setting,
                r.peak_reserved >> 20,
                to.peak_reserved >> 20,
                oom,
                to.num_ooms > 0
            );
            let what = format!("{} recorded under {}, replayed as {}", from.workload, from.setting, to.setting);
            if from.workload == "caught" {
                // A program that caught its error and went on asked for
                // what it did because of the error: under another setting
                // it would have asked otherwise (it allocates until it
                // fails). The replay is no prediction past the error, and
                // says so: the GPU ran out under expandable segments too,
                // twice, where the replay of the default's requests does not.
                let first = file.snapshot.device_traces[0].iter().position(|e| e.action == Action::Oom);
                assert_eq!(r.continued_after_oom, first, "{what}: the replay says the program went on");
                assert!(first.is_some() && to.num_ooms == 2 && from.num_ooms == 2, "{what}");
                continue;
            }
            assert_eq!(r.peak_reserved, to.peak_reserved, "{what}: the GPU's reserved peak under that setting");
            assert_eq!(oom, to.num_ooms > 0, "{what}: out of memory as on the GPU");
        }
    }
}

/// A prediction does not depend on the CPU's thread count: the same step
/// recorded with 2 and with 16 threads (`examples/zoo.rs --out --threads N`,
/// `fixtures/zoo/threads/`) predicts the same CUDA peaks. The CNN's and the
/// decoder's CPU runs allocate otherwise with the threads (oneDNN's
/// convolution scratch, the flash attention kernel's per-thread buffers);
/// the LSTM's does not. The LSTM's and the decoder's are predicted through
/// the models of cuDNN's RNN and CUDA's attention, whole: no op left out.
#[test]
fn a_prediction_is_the_same_from_2_and_16_threads() {
    use memlab_core::replay::{predict_cuda, PredictOptions};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/zoo/threads");
    for (model, cpu_runs_differ) in [("lstm_64", false), ("cnn_2048", true), ("gpt_4", true)] {
        let [two, sixteen] = [2, 16].map(|threads| {
            let file = Snapshot::read_pickle(dir.join(format!("{model}_{threads}_threads.pickle"))).unwrap();
            let predicted = predict_cuda(model, &file.snapshot, &PredictOptions::default()).unwrap();
            if model != "cnn_2048" {
                let kernels = predicted.kernels.as_ref().unwrap();
                assert!(predicted.unmodelled.is_empty(), "{model}: {predicted}");
                assert!(kernels.rnns + kernels.attentions > 0, "{model}: {predicted}");
            }
            let peaks = predicted.settings.iter().map(|s| (s.peak_reserved, s.peak_allocated)).collect::<Vec<_>>();
            let history: Vec<(Action, u64)> =
                file.snapshot.device_traces.iter().flatten().map(|e| (e.action, e.size)).collect();
            (history, peaks)
        });
        assert_eq!(two.0 != sixteen.0, cpu_runs_differ, "{model}: whether the CPU runs allocate otherwise");
        assert_eq!(two.1, sixteen.1, "{model}: the predictions do not differ");
    }
}

/// Nine batch searches of `examples/zoo.rs` on an H200 under a memory
/// fraction (`fixtures/zoo/searches/`): every try in one process, the
/// failed ones included. Replayed under their own settings, each makes
/// every segment event the GPU made and runs out exactly where it did, the
/// tries after a failure and the retries that gave cached blocks back
/// included: what the predicted searches get wrong there is their history,
/// not the allocator.
#[test]
fn the_h200s_searches_replay_to_each_of_their_failures() {
    let dir = fixtures().join("../zoo/searches");
    let mut names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    assert_eq!(names.len(), 9);
    // The H200's memory, as torch gave it.
    let total = 150_109_880_320;
    for path in names {
        let file = Snapshot::read_pickle(&path).unwrap();
        let settings = file.snapshot.allocator_settings.as_ref().expect("the settings are recorded");
        let config = AllocatorConfig::from_snapshot(settings).unwrap();
        assert!(config.memory_fraction < 0.02, "{}: under a memory fraction", path.display());
        let card = Card { capacity: total, total };
        let r = replay_device(&file.snapshot, 0, &config, &config, card).unwrap();
        let what = path.file_name().unwrap().to_string_lossy().into_owned();
        let recorded = file.snapshot.device_traces[0].iter().filter(|e| e.action == Action::Oom).count();
        assert!(recorded >= 2, "{what}: a try that ran out");
        assert_eq!(r.segment_events_matched, r.segment_events, "{what}: first difference {:?}", r.first_mismatch);
        assert_eq!(r.oom_count, recorded, "{what}: the GPU's out-of-memory errors");
        assert!(r.ooms.iter().all(|o| o.recorded), "{what}: failing where the GPU failed");
    }
}
