//! Threads memlab starts for itself: started and running before the call
//! that asks for one returns, so that a failure path (out of memory, a
//! warning for a sink) never has to start one when it may fail to.

/// Starts a thread named `name` that runs `f`, and returns once it runs:
/// its stack, its signal stack and its share of the C allocator exist by
/// then. Threads that serve a failure path (they deliver its warnings, or
/// watch for what it needs) start this way when the recorder is armed, so
/// that none of their start-up can fail later for want of memory.
///
/// The wait is bounded (100 ms): a library that holds memlab and is
/// loaded with `dlopen` arms the recorder from its initializer
/// (`MEMLAB_OOM_DIR`), while the loader holds its lock, and a new thread's
/// first thread-local with a destructor waits for that lock. Waiting for it
/// there would hang the load; the thread then finishes starting as soon as
/// the load is done.
pub fn spawn_started(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let (started, running) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new().name(name.to_string()).spawn(move || {
        // A first allocation gives the thread its part of the C allocator now.
        drop(std::hint::black_box(Box::new([0u64; 4])));
        let _ = started.send(());
        f();
    })?;
    let _ = running.recv_timeout(START_WAIT);
    Ok(())
}

/// How long [`spawn_started`] waits for its thread: a thread starts in well
/// under a millisecond unless something holds it back.
const START_WAIT: std::time::Duration = std::time::Duration::from_millis(100);
