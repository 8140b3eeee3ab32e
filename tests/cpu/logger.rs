//! StepLogger and the driver-level figures on a machine without a GPU (and,
//! for what does not depend on one, anywhere): RAM figures of a step, the
//! compact and table forms, start/stop, and "no GPU" answers that never panic.

use std::sync::{Arc, Mutex};

use crate::common::{check_child, child, serial};
use memlab::StepLogger;
use tch::{Kind, Tensor};

#[test]
fn ram_figures_of_a_step() {
    // The resident set and the threads are the process's: alone in a child.
    if !child("ram_figures_of_a_step") {
        check_child("ram_figures_of_a_step", &[]);
        return;
    }
    let _s = serial();
    let mut logger = StepLogger::new().exact_ram(true).exact_ram_peak(true);
    logger.stop();
    let kept = logger.log("allocate", || {
        // 64 MiB written (so resident) and freed, 16 MiB kept.
        let spike = Tensor::ones([16 << 20], (Kind::Float, tch::Device::Cpu));
        drop(spike);
        Tensor::ones([4 << 20], (Kind::Float, tch::Device::Cpu))
    });
    let data = logger.data().unwrap();
    assert_eq!(data.label, "allocate");
    assert!(data.ram.total > data.ram.used && data.ram.used > 0);
    let second = data.to_string().lines().nth(1).unwrap().to_string();
    assert!(!data.ram.sampled && second.starts_with("Gen:") && !second.contains("sampled"), "{data}");
    // glibc returns large blocks to the system at once, so the 64 MiB spike is
    // a peak above what stays.
    assert!(data.ram.peaked >= 40 << 20, "peaked {} (exact: {})", data.ram.peaked, data.ram.peak_exact);
    assert!(data.ram.consumed >= 12 << 20, "consumed {}", data.ram.consumed);
    // The CPU tensors from the allocator, exact: 16 MiB kept, 64 MiB at the peak.
    let cpu = data.cpu.expect("memlab counts the CPU allocator");
    assert_eq!((cpu.consumed, cpu.peaked), (16 << 20, 48 << 20), "{data}");
    assert_eq!(data.gpu.is_some(), memlab::gpu::cuda_is_available());
    drop(kept);
}

#[test]
fn ram_follows_the_background_readings_by_default() {
    // The resident set and the threads are the process's: alone in a child.
    if !child("ram_follows_the_background_readings_by_default") {
        check_child("ram_follows_the_background_readings_by_default", &[]);
        return;
    }
    let _s = serial();
    let mut logger = StepLogger::new();
    logger.stop();
    // Steps that hold 32 MiB (written, so resident) long enough for the
    // sampler, which reads every millisecond, to see it before they end.
    let hold = || {
        let t = Tensor::ones([8 << 20], (Kind::Float, tch::Device::Cpu));
        std::thread::sleep(std::time::Duration::from_millis(20));
        t
    };
    let first = logger.log("warm", hold);
    let second = logger.log("keep 32 MiB", hold);
    let data = logger.data().unwrap();
    assert!(data.ram.sampled && !data.ram.peak_exact);
    let mib = 1 << 20;
    assert!((28 * mib..=40 * mib).contains(&data.ram.consumed), "consumed {}", data.ram.consumed);
    assert!(data.ram.used >= data.ram.consumed as u64);
    assert!(data.to_string().contains("  (sampled)"), "{data}");
    drop((first, second));
}

#[test]
fn printed_forms_and_start_stop() {
    let _s = serial();
    let printed = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = printed.clone();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(move |t| {
        sink.lock().unwrap().push(t.to_string())
    })));
    let mut logger = StepLogger::new();
    logger.log("table", || ());
    let mut compact = StepLogger::new().compact(true);
    compact.log("one line", || ());
    compact.stop();
    compact.log("quiet", || ());
    compact.start();
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
    let printed = printed.lock().unwrap();
    assert_eq!(printed.len(), 2);
    assert!(printed[0].starts_with("RAM:  Consumed  Peak over end      Used     Total  in "), "{}", printed[0]);
    assert!(printed[0].contains("(table)\nGen: "), "{}", printed[0]);
    assert!(printed[1].starts_with("one line: ") && printed[1].contains("s | RAM "), "{}", printed[1]);
    assert!(printed[1].contains("  (sampled)"), "RAM figures from samples say so: {}", printed[1]);
    assert_eq!(printed[1].lines().count(), 1);
    assert_eq!(compact.data().unwrap().label, "quiet");
}

#[test]
fn no_gpu_is_an_answer_not_a_crash() {
    // Runs a logged step too: the resident set is the process's, so alone.
    let _s = serial();
    if memlab::gpu::cuda_device_count() > 0 {
        assert!(memlab::gpu::driver_memory(0).unwrap().total > 0);
        return;
    }
    // The cause first: this process sees no CUDA device.
    for err in [
        memlab::gpu::driver_memory(0).unwrap_err(),
        memlab::gpu::process_gpu_memory(0).unwrap_err(),
        memlab::where_gpu_memory_went(0).unwrap_err(),
    ] {
        assert!(err.to_string().contains("cuda:0 is not available: this process sees 0 CUDA device(s)"), "{err}");
    }
    let mut logger = StepLogger::new();
    logger.stop();
    assert!(logger.preinit_cuda().is_err());
    logger.log("cpu only", || ());
    assert!(logger.data().unwrap().gpu.is_none());
    assert!(logger.data().unwrap().to_string().contains("GPU: no CUDA device"));
}

#[test]
fn printed_forms_snapshot() {
    let mut data = memlab::logger::StepData::default();
    data.label = "step 3".into();
    data.time = std::time::Duration::from_micros(12_500);
    let mut ram = memlab::logger::RamFigures::default();
    (ram.consumed, ram.peaked, ram.used, ram.total) = (4 << 20, 1 << 20, 512 << 20, 16 << 30);
    (ram.peak_exact, ram.sampled) = (false, true);
    data.ram = ram;
    let mut cpu = memlab::logger::CpuFigures::default();
    (cpu.consumed, cpu.peaked, cpu.used) = (-(2 << 20), 8 << 20, 100 << 20);
    data.cpu = Some(cpu);
    let mut gpu = memlab::logger::GpuFigures::default();
    (gpu.device, gpu.consumed, gpu.peaked, gpu.used, gpu.reserved, gpu.total) =
        (0, 64 << 20, 192 << 20, 129 << 20, 160 << 20, 80 << 30);
    (gpu.driver_used, gpu.driver_peaked, gpu.process_used) = (Some(1 << 30), Some(0), Some(900 << 20));
    data.gpu = Some(gpu);
    let table = "\
RAM:  Consumed  Peak over end      Used     Total  in 0.013s (step 3)
Gen:     4.00M          1.00M   512.00M    16.00G  (sampled)
CPU:    -2.00M          8.00M   100.00M            (tensors, libtorch's CPU allocator)
GPU:    64.00M        192.00M   129.00M    80.00G  (cuda:0, libtorch's allocator; reserved 160.00M)
     driver (sampled): device-wide 1.00G used, peaked 0.00B above; this process 900.00M (NVML)
";
    assert_eq!(data.to_string(), table);
    let line = "step 3: 0.013s | RAM +4.00M ^1.00M =512.00M of 16.00G  (sampled) | CPU tensors -2.00M ^8.00M =100.00M | GPU +64.00M ^192.00M =129.00M of 80.00G\n";
    assert_eq!(data.compact_line(), line);
}

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").expect("procfs");
    tasks.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok()).map(|n| n.trim().into()).collect()
}

#[test]
fn one_sampler_serves_a_step_and_a_sampling_recording_at_once() {
    use std::time::Duration;
    // The resident set and the threads are the process's: alone in a child.
    if !child("one_sampler_serves_a_step_and_a_sampling_recording_at_once") {
        check_child("one_sampler_serves_a_step_and_a_sampling_recording_at_once", &[]);
        return;
    }
    let _s = serial();
    let settings = memlab::events::Settings::default().sampling(Duration::from_millis(1));
    let recording = memlab::Recording::start(settings).unwrap();
    let mut logger = StepLogger::new().sample_every(Duration::from_millis(50));
    logger.stop();
    let threads = logger.log("step", || {
        let kept = Tensor::ones([4 << 20], (Kind::Float, tch::Device::Cpu));
        std::thread::sleep(Duration::from_millis(200));
        drop(kept);
        thread_names()
    });
    let readings = memlab::events::timeline().readings.len();
    drop(recording);
    // memlab's threads (the kernel keeps 15 bytes of a name): the sampler alone.
    let ours: Vec<_> = threads.iter().filter(|n| n.starts_with("memlab-")).collect();
    assert_eq!(ours, ["memlab-sampler"], "one sampling thread for both: {threads:?}");
    // The recording asked for a reading every millisecond: the step's 50 ms
    // do not slow it down (200 expected; 20 leaves room for a loaded machine).
    assert!(readings >= 20, "{readings} readings in 200 ms");
    let data = logger.data().unwrap();
    // Consumed plus peaked is the step's sampled peak above its start: 16 MiB were written.
    let above_start = data.ram.consumed + data.ram.peaked;
    assert!(data.ram.sampled && above_start >= 12 << 20, "the step's own peak: {data}");
}

#[test]
fn a_step_notes_the_memory_of_the_model_given_for_the_exports() {
    use tch::nn::{self, Module, OptimizerConfig};
    let _s = serial();
    memlab::clear_registry();
    let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let fc = nn::linear(vs.root() / "fc", 64, 64, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut logger = StepLogger::new().of(&vs);
    logger.stop();
    let x = Tensor::ones([8, 64], (Kind::Float, tch::Device::Cpu));
    logger.log("step", || fc.forward(&x).sum(Kind::Float).backward());
    let gradient = fc.ws.grad().data_ptr() as u64;
    // Freed: no later walk can name them. The exporter's own model is
    // empty: the category comes from the step's note.
    opt.zero_grad();
    let snapshot = memlab::export::Exporter::default().snapshot().unwrap();
    drop(recording);
    let cpu = snapshot.devices().iter().position(|d| d == "cpu").unwrap();
    let allocs = snapshot.device_traces[cpu].iter().filter(|e| e.action == "alloc" && e.addr == Some(gradient));
    let categories: Vec<_> = allocs.map(|e| (e.size, e.category)).collect();
    assert_eq!(categories.last(), Some(&(64 * 64 * 4, Some(memlab::export::Category::Gradient))), "{categories:?}");
}
