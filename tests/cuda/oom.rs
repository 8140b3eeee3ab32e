//! The out-of-memory recorder on CUDA.

use super::*;

// The out-of-memory recorder on CUDA: an oversize request and a model too
// large for the device get different verdicts; a failure while tch moves a
// var store to the GPU (holding the store's lock) gives a report, not a deadlock.

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_oom_reports_tell_an_oversize_request_from_a_model_too_large() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    memlab::clear_registry();
    let dir = oom_dir("verdicts");
    memlab::OomRecorder::new(&dir).max_reports(100).init_cuda(true).arm().unwrap();
    let (_, total) = memlab::gpu::cuda_mem_info(0).unwrap();
    // A matrix product: this thread's cuBLAS handle has its workspace.
    let square = floats(64 * 64).reshape([64, 64]);
    drop(square.matmul(&square));

    // 1. An oversize request: a shape bug.
    let err = asks_the_gpu_too_much().expect_err("4 TiB cannot be allocated");
    assert!(err.to_string().contains("out of memory"), "{err}");
    let oversize = memlab::last_oom().expect("a report of the oversize request");
    let d = &oversize.diagnosis;
    assert_eq!((d.device, d.verdict, d.rounded), (Device::Cuda(0), memlab::oom::Verdict::RequestExceedsDevice, true));
    assert!(d.requested >= 4 << 40, "the allocator's rounding of 4 TiB: {}", d.requested);
    let driver = d.figures.device.expect("the allocator's free and total bytes");
    assert_eq!(driver.total, total);
    assert!(oversize.statement.as_deref().is_some_and(|s| s.contains("f_empty")), "{:?}", oversize.statement);
    println!("{}", oversize.to_text());

    // 2. A model too large for the device: 4 GiB layers until one fails.
    let vs = tch::nn::VarStore::new(GPU);
    memlab::register_var_store("huge", &vs);
    let mut layers = Vec::new();
    let failed = loop {
        match vs.root().f_zeros(&format!("layer{}", layers.len()), &[1 << 30]) {
            Ok(t) => layers.push(t),
            Err(e) => break e,
        }
        assert!(layers.len() < 1024, "the device never filled");
    };
    assert!(failed.to_string().contains("out of memory"), "{failed}");
    let full = memlab::last_oom().expect("a report of the model that did not fit");
    assert_eq!(full.number, oversize.number + 1, "a second failure, a second report");
    let d = &full.diagnosis;
    assert_eq!(d.verdict, memlab::oom::Verdict::NotEnoughFree, "{}", full.to_text());
    assert_eq!(d.requested, 4 << 30, "a 4 GiB layer: its own segment");
    assert_eq!(full.holders.named_bytes, layers.len() as u64 * (4 << 30), "every layer made so far, by name");
    assert!(full.holders.named.iter().all(|n| n.name.starts_with("huge.layer")), "{:?}", full.holders.named);
    assert!(d.advice.contains("The largest holders: huge.layer"), "{}", d.advice);
    // libtorch's cuBLAS workspaces are named among what no tensor holds.
    let workspaces = &full.holders.workspaces;
    assert!(workspaces.iter().any(|w| w.name.starts_with("cuBLAS workspace (handle")), "{workspaces:?}");
    let in_workspaces: u64 = workspaces.iter().map(|w| w.bytes).sum();
    assert!(workspaces.iter().all(|w| w.bytes >= 1 << 20) && in_workspaces as i64 <= full.holders.not_named);
    assert!(full.to_text().contains("of which cuBLAS workspace (handle"), "{}", full.to_text());
    assert!(full.files[0].exists());
    // The report's JSON reads back through the model that wrote it (what
    // `memlab merge` does), every CUDA figure included.
    let json = full.files.iter().find(|f| f.extension().is_some_and(|e| e == "json")).expect("the report's JSON");
    let read = memlab::oom::OomReport::read(json).unwrap();
    assert_eq!(read.to_text(), full.to_text());
    assert_eq!(read.diagnosis.figures, d.figures);
    println!("{}", full.to_text());
    drop((layers, vs));
    memlab::gpu::empty_cache().unwrap();

    // The device still serves, and training-sized work goes on.
    let x = floats(1 << 20);
    assert_eq!((&x + 1.0).sum(Kind::Float).double_value(&[]), (1 << 20) as f64);
    memlab::OomRecorder::disarm();
    memlab::clear_registry();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memlab_oom_dir_alone_reports_a_cuda_failure() {
    // The harness names a test by its module path.
    let name = "oom::memlab_oom_dir_alone_reports_a_cuda_failure";
    if common::child(name) {
        // No memlab call: the variable armed the recorder as the program
        // loaded, and its watcher attaches the observer after the first CUDA
        // allocation.
        let first = floats(1);
        let waited = std::time::Instant::now();
        while !memlab_tch::oom::watching_cuda() {
            assert!(waited.elapsed() < std::time::Duration::from_secs(5), "the observer was never attached");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(asks_the_gpu_too_much().is_err());
        let report = memlab::last_oom().expect("a report of the CUDA failure");
        assert_eq!(report.diagnosis.device, Device::Cuda(0));
        assert_eq!(report.diagnosis.verdict, memlab::oom::Verdict::RequestExceedsDevice);
        let dir = std::path::PathBuf::from(std::env::var("MEMLAB_OOM_DIR").unwrap());
        assert!(report.files.iter().all(|f| f.starts_with(&dir)), "{:?}", report.files);
        drop(first);
        return;
    }
    let dir = oom_dir("environment");
    // The child's GPU memory must not meet another test's of this process.
    let _s = serial();
    let (_, stderr) = common::check_child(name, &[("MEMLAB_OOM_DIR", dir.to_str().unwrap())]);
    assert!(stderr.contains("memlab: out of memory on cuda:0"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_oom_while_a_var_store_moves_to_the_gpu_is_reported_not_deadlocked() {
    let _s = serial();
    assert!(memlab::gpu::cuda_is_available(), "this test needs CUDA");
    memlab::clear_registry();
    let dir = oom_dir("set-device");
    memlab::OomRecorder::new(&dir).max_reports(100).init_cuda(true).arm().unwrap();
    memlab::gpu::empty_cache().unwrap();
    // Leave about 1 GiB free on the device, then move a 2 GiB model there.
    let (free, _) = memlab::gpu::cuda_mem_info(0).unwrap();
    let blocker = Tensor::zeros([(free as i64 - (1 << 30)) / 4], (Kind::Float, GPU));
    let report = common::within(std::time::Duration::from_secs(120), || {
        let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
        for i in 0..4 {
            let _ = vs.root().zeros(&format!("w{i}"), &[1 << 27]); // 512 MiB each
        }
        memlab::register_var_store("moving", &vs);
        // tch holds the store's lock while it copies each variable over.
        let moved = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vs.set_device(GPU)));
        assert!(moved.is_err(), "2 GiB cannot fit in 1 GiB");
        memlab::last_oom().expect("a report")
    });
    assert!(
        report.holders.busy.iter().any(|b| b.starts_with("moving (its lock was held")),
        "{:?}",
        report.holders.busy
    );
    println!("{}", report.to_text());
    drop(blocker);
    memlab::OomRecorder::disarm();
    memlab::clear_registry();
    memlab::gpu::empty_cache().unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// A fragmentation failure (8 MiB blocks until 93% of the device is used,
/// every other freed, then 40 GiB asked), in a process under libtorch's
/// defaults and in one already running with expandable segments, while a
/// recording runs. The report's settings advice follows its replay: a
/// setting only where the replay avoids the failure, never one the process
/// has (the process under expandable segments was told to set them). With
/// `MEMLAB_FIXTURE_OUT` set, the reports' JSON and recordings are copied
/// there (`fixtures/oom/`, where CPU tests replay them).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_fragmentation_report_advises_only_what_its_replay_supports() {
    const DIR: &str = "MEMLAB_TEST_OOM_REPORTS";
    let name = "oom::a_fragmentation_report_advises_only_what_its_replay_supports";
    if common::child(name) {
        let dir = std::path::PathBuf::from(std::env::var(DIR).unwrap());
        memlab::OomRecorder::new(&dir).max_reports(10).init_cuda(true).arm().unwrap();
        let recording = memlab::Recording::start(memlab::events::Settings::default().backtraces(true)).unwrap();
        // Until 93% of the device is in use.
        let (_, total) = memlab::gpu::cuda_mem_info(0).unwrap();
        let mut held: Vec<Tensor> = Vec::new();
        while memlab::gpu::cuda_mem_info(0).unwrap().0 > total * 7 / 100 {
            held.push(Tensor::empty([8 << 20], (Kind::Uint8, GPU)));
        }
        let mut i = 0;
        held.retain(|_| {
            i += 1;
            i % 2 == 0
        });
        let err = Tensor::f_empty([40 << 30], (Kind::Uint8, GPU)).expect_err("40 GiB among the holes");
        assert!(err.to_string().contains("out of memory"), "{err}");
        let report = memlab::last_oom().expect("a report of the failure");
        println!("REPORT {}", report.files[0].display());
        drop((held, recording));
        return;
    }
    let _s = serial();
    memlab::gpu::empty_cache().unwrap();
    for (setting, conf) in [("default", ""), ("expandable", "expandable_segments:True")] {
        let dir = oom_dir(&format!("advice-{setting}"));
        let env = [(DIR, dir.to_str().unwrap()), ("PYTORCH_CUDA_ALLOC_CONF", conf)];
        let (stdout, _) = common::check_child(name, &env);
        // The harness prints the test's name first, on the same line.
        let text_file = stdout.lines().find_map(|l| l.split_once("REPORT ").map(|(_, path)| path));
        let text_file = text_file.expect("the report's path");
        let json = std::path::Path::new(text_file).with_extension("json");
        let report = memlab::oom::OomReport::read(&json).unwrap();
        let text = report.to_text();
        println!("{text}");
        assert_eq!(report.diagnosis.verdict, memlab::oom::Verdict::Fragmentation, "{setting}");
        assert_eq!(report.allocator_settings.as_deref(), Some(conf), "the process's settings, as libtorch held them");
        let replayed = report.replay.as_ref().expect("a recording ran: the report replays it");
        let device = &replayed.devices[0];
        assert!(device.recorded_oom().is_some(), "{setting}: the replay reproduces the failure:\n{text}");
        // Advice after the replay, never contradicting it.
        match report.settings_advice.as_ref().expect("settings advice") {
            memlab::oom::SettingsAdvice::Replayed { avoiding } => {
                for a in avoiding {
                    let row = device.replays.iter().find(|x| device.conf(x) == a.settings).expect("its row");
                    assert!(
                        row.ooms.is_empty(),
                        "{setting}: advised {} where its replay runs out:\n{text}",
                        a.settings
                    );
                }
            }
            memlab::oom::SettingsAdvice::NoSettingHelps { free, .. } => {
                assert!(*free > 0);
                assert!(device.replays.iter().all(|x| !x.ooms.is_empty()), "{setting}: {text}");
            }
            other => panic!("{setting}: {other:?}\n{text}"),
        }
        if !conf.is_empty() {
            assert!(!text.contains(&format!("PYTORCH_CUDA_ALLOC_CONF={conf} would")), "{text}");
            assert!(!text.contains("Untested"), "{text}");
        }
        if let Some(out) = std::env::var_os("MEMLAB_FIXTURE_OUT") {
            let out = std::path::PathBuf::from(out);
            std::fs::create_dir_all(&out).unwrap();
            std::fs::copy(&json, out.join(format!("frag93_{setting}.json"))).unwrap();
            std::fs::copy(json.with_extension("pickle"), out.join(format!("frag93_{setting}.pickle"))).unwrap();
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
