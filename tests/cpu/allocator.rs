//! The counting CPU allocator and the storage facts, checked against byte
//! counts computed independently from shapes and dtypes. Runs one test at a
//! time: the counters are process-wide.

use crate::common::serial;

use memlab::{stats::StorageLayout, Device};
use tch::{Kind, Tensor};

fn cpu() -> memlab::stats::DeviceStats {
    memlab::stats::device_stats(Device::Cpu).expect("CPU figures are available")
}

#[test]
fn installed_before_the_first_tensor() {
    assert!(memlab::stats::cpu_allocator_installed());
    assert!(memlab::stats::cpu_allocator_installed_at_load());
    assert!(memlab::stats::install_cpu_allocator().is_ok(), "installing again is a no-op");
}

#[test]
fn counts_exact_bytes_and_blocks() {
    let _s = serial();
    let before = cpu();
    let t = Tensor::zeros([3, 5, 7], (Kind::Double, tch::Device::Cpu));
    let during = cpu();
    let bytes = 3 * 5 * 7 * 8;
    assert_eq!(during.allocated_bytes.all.current - before.allocated_bytes.all.current, bytes);
    assert_eq!(during.allocated_bytes.all.allocated - before.allocated_bytes.all.allocated, bytes);
    assert_eq!(during.allocation.all.current - before.allocation.all.current, 1);
    assert_eq!(during.num_device_alloc - before.num_device_alloc, 1);
    // No cache on the CPU: the byte figures agree.
    for s in [during.reserved_bytes, during.active_bytes, during.requested_bytes] {
        assert_eq!(s.all, during.allocated_bytes.all);
    }
    assert_eq!(during.allocated_bytes.large_pool.current, 0);
    drop(t);
    let after = cpu();
    assert_eq!(after.allocated_bytes.all.current, before.allocated_bytes.all.current);
    assert_eq!(after.allocated_bytes.all.freed - before.allocated_bytes.all.freed, bytes);
    assert_eq!(after.allocation.all.freed - before.allocation.all.freed, 1);
}

#[test]
fn peaks_reset_to_the_current_level() {
    let _s = serial();
    memlab::stats::reset_peak_stats(Device::Cpu).unwrap();
    let base = cpu().allocated_bytes.all.current;
    drop(Tensor::zeros([1 << 20], (Kind::Uint8, tch::Device::Cpu)));
    assert_eq!(cpu().allocated_bytes.all.peak, base + (1 << 20));
    memlab::stats::reset_peak_stats(Device::Cpu).unwrap();
    assert_eq!(cpu().allocated_bytes.all.peak, base);
    memlab::stats::reset_accumulated_stats(Device::Cpu).unwrap();
    let s = cpu();
    assert_eq!((s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed), (0, 0));
}

#[test]
fn views_share_their_storage() {
    let _s = serial();
    let base = Tensor::zeros([1024, 1024], (Kind::Float, tch::Device::Cpu));
    let view = base.narrow(0, 10, 2);
    let b = memlab::stats::storage_info(&base).unwrap();
    let v = memlab::stats::storage_info(&view).unwrap();
    assert_eq!(b.storage_id, v.storage_id);
    assert!(b.storage_id.is_some());
    assert_eq!(v.nbytes, 4 << 20, "a view keeps its whole storage alive");
    assert_eq!((v.numel, v.element_size), (2 * 1024, 4));
    assert_eq!(v.data_ptr, b.data_ptr);
    assert_eq!((v.device, v.layout), (Some(Device::Cpu), StorageLayout::Strided));
    let copy = view.copy();
    let c = memlab::stats::storage_info(&copy).unwrap();
    assert_ne!(c.storage_id, b.storage_id);
    assert_eq!(c.nbytes, 2 * 1024 * 4);
}

#[test]
fn sparse_tensors_have_no_storage_of_their_own() {
    let _s = serial();
    let dense = Tensor::eye(4, (Kind::Float, tch::Device::Cpu));
    let sparse = dense.to_sparse_sparse_dim(2);
    let s = memlab::stats::storage_info(&sparse).unwrap();
    assert_eq!(s.layout, StorageLayout::SparseCoo);
    assert_eq!(s.storage_id, None);
    let values = memlab::stats::storage_info(&sparse.values()).unwrap();
    assert_eq!(values.nbytes, 4 * 4);
}

#[test]
fn undefined_tensors_are_an_error_not_a_crash() {
    let err = memlab::stats::storage_info(&Tensor::new()).unwrap_err();
    assert!(err.to_string().contains("undefined"), "{err}");
}

#[test]
fn cuda_calls_answer_without_a_gpu() {
    let count = memlab::gpu::cuda_device_count();
    assert_eq!(memlab::gpu::cuda_is_available(), count > 0);
    let missing = Device::Cuda(count);
    let err = memlab::stats::device_stats(missing).unwrap_err();
    assert_eq!(err, memlab::Error::DeviceUnavailable { device: missing, count });
    assert!(err.to_string().contains("profile `cpu`"), "{err}");
    assert!(memlab::gpu::cuda_mem_info(count).is_err());
    assert!(memlab::stats::reset_peak_stats(missing).is_err());
    assert!(memlab::gpu::empty_cache().is_ok());
    if count == 0 {
        assert_eq!(memlab::gpu::auto_device(), Device::Cpu);
    }
}

#[test]
fn libtorch_cuda_stays_linked_when_libtorch_has_it() {
    // tch alone drops libtorch_cuda under --as-needed linking; memlab keeps it.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let libtorch_cpu = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .expect("libtorch_cpu.so is loaded");
    let libtorch_has_cuda = std::path::Path::new(libtorch_cpu).with_file_name("libtorch_cuda.so").exists();
    assert_eq!(memlab::gpu::built_with_cuda(), libtorch_has_cuda);
    if libtorch_has_cuda {
        assert!(maps.contains("libtorch_cuda.so"), "libtorch_cuda.so is loaded");
    }
}
