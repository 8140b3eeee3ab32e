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
